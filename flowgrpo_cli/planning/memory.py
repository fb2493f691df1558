"""Memory per device of each stage of `flowgrpo loop`, from the architecture and the config.

What is resident follows the code: load_adapter moves the whole pipeline (transformer, every
text encoder, VAE) to the device in model.dtype and nothing leaves it, so every component
counts in every stage; the update reads the text conditioning rollout stored, but the
encoders stay loaded. The KL reference is the same transformer with its LoRA disabled (no
copy) in LoRA mode, a deep copy in full mode (training.trainer._make_reference). LoRA weights
are float32; AdamW keeps two moments of each trained weight in its dtype, from the first
optimizer step on; gradients live during the update only (zero_grad sets them to None). EMA
and the nft / awm / grpo_guard anchor are copies of the trained weights, and swapping one in
(evaluation with EMA, nft's sampling, the anchor's forwards) backs the weights up first.
With distributed.nproc > 1 the loop shards the transformer (its frozen base weights too, and
the full-mode reference) with FSDP2, block by block; buffers, text encoders, VAE and reward
models are whole on every rank, and a forward gathers a block at a time (two with
prefetching) plus the weights outside the blocks. Model rewards stay loaded all loop long.

What the meta device cannot count (what a forward keeps alive) comes from ACTIVATION,
measured on the CPU by benchmarks/plan_constants.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.planning.architectures import DTYPE_BYTES, Architecture, reward_model_parameters
from flowgrpo_cli.store.config import MODEL_REWARDS, Config
from flowgrpo_cli.training.algorithms import algorithm_for

# Activation constants, in units of (tokens x transformer inner width x bytes per element),
# measured by `python -m benchmarks.plan_constants` (its docstring says how): a dispatch mode
# follows every storage the operators allocate on the CPU (weights, buffers and inputs left
# out) through small real transformers of each block kind (the family's head size and MLP
# ratio, inner width 256), LoRA on the family's default targets or every weight trained,
# with and without gradient checkpointing, in float32 and bfloat16. Keys:
#   saved_image / saved_text: alive after a forward with gradient, per token per block;
#   saved_outside: the same for what lies outside the blocks (embeddings, final layer), per
#                  token; backward_extra: the peak during backward above saved + gradients,
#                  per token; work: the peak of a forward without gradient, per token.
# With checkpointing a block keeps its inputs alone (1.0); without, 15-45 of them.
# The measured values are kept as measured in constants.json beside this module.
ACTIVATION: dict[str, dict[str, float]] = {}
# VAE decode without gradient: peak bytes per output pixel / element size (real VAE widths,
# 128 x 128 decodes), and a CLIP vision forward: peak per image token / (width x element).
VAE_DECODE: dict[str, float] = {}
CLIP_FORWARD: dict[str, float] = {}
CUDA_CONTEXT = 500_000_000  # CUDA context and kernels: not allocated by torch; typical value


@dataclass(frozen=True)
class StageMemory:
    """Peak bytes of one stage on one device, and what they are made of."""

    items: list[tuple[str, int]]

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.items)


@dataclass(frozen=True)
class Shapes:
    """The sizes every stage's estimate starts from."""

    dtype: str
    element: int  # bytes per element of model.dtype
    nproc: int
    image_tokens: int  # the generated image's
    text_tokens: int
    text_note: str
    cond_elements: int  # one prompt's text conditioning elements (without the negative's)
    latent_elements: int
    pixels: int
    cuda: bool
    trained: int  # trained parameters (LoRA or the whole transformer)
    trained_bytes: int  # their dtype: float32 for LoRA, model.dtype for full
    trained_tensors: int
    # An edit family's source image: its tokens follow the generated ones in every forward,
    # its latents are stored once per prompt (none for the negative prompt).
    source_tokens: int = 0
    source_elements: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def sequence_image_tokens(self) -> int:
        """Image tokens of one transformer sequence: the generated image's and the source's."""
        return self.image_tokens + self.source_tokens

    @property
    def conditioning_name(self) -> str:
        return "text and source-image conditioning" if self.source_elements else "text conditioning"

    def conditioning(self, negative: int) -> int:
        """Elements of one prompt's stored conditioning; negative = 2 with negative prompts."""
        return self.cond_elements * negative + self.source_elements


def text_tokens(config: Config, arch: Architecture) -> tuple[int, str]:
    """Text tokens of one prompt's conditioning, as each family's pipeline encodes it."""
    length = config.model.max_sequence_length
    if arch.family == "sd3":
        t5 = length or 256
        return 77 + t5, f"77 CLIP + {t5} T5 tokens"
    if arch.base_family == "flux":
        t5 = length or 512
        return t5, f"{t5} T5 tokens"
    assumed = min(128, length or 1024)
    note = (
        f"{assumed} tokens assumed (Qwen-Image's embeddings are as long as the prompt, at "
        "most model.max_sequence_length)"
    )
    if arch.family == "qwenimage_edit":
        # Qwen2.5-VL reads the source with the prompt: one token per 28 x 28 pixels.
        vision = arch.adapter_class().source_pixels // 28**2
        return assumed + vision, f"{note} + {vision} of the source image"
    return assumed, note


def conditioning_elements(config: Config, arch: Architecture, tokens: int) -> int:
    """Elements of one prompt's stored conditioning (without its negative's)."""
    joint = int(arch.transformer_config["joint_attention_dim"])
    if arch.base_family == "qwenimage":
        return tokens * joint + tokens  # the embeddings and their mask
    return tokens * joint + int(arch.transformer_config["pooled_projection_dim"])


def evaluation_prompts(config: Config) -> tuple[int, str]:
    """Prompts one evaluation samples: eval.num_prompts, else the test set's size when its
    file can be read (a guess of 100 when it cannot)."""
    if config.eval.num_prompts:
        return config.eval.num_prompts, "eval.num_prompts"
    from pathlib import Path

    path = Path(config.data.test) if config.data.test else None
    if path is not None and path.is_file() and path.suffix in (".txt", ".jsonl"):
        with path.open("rb") as handle:
            return sum(1 for line in handle if line.strip()), f"the lines of {path.name}"
    return 100, "assumed (eval.num_prompts = 0: the whole test set, not read here)"


def shapes(config: Config, arch: Architecture) -> Shapes:
    tokens, note = text_tokens(config, arch)
    element = DTYPE_BYTES[config.model.dtype]
    if config.train.mode == "lora":
        targets = config.train.lora_targets or arch.default_lora_targets()
        trained, tensors = arch.lora(targets, config.train.lora_rank)
        trained_bytes = 4  # policy.load_policy keeps LoRA weights in float32
    else:
        trained = arch.components["transformer"].parameters
        if arch.transformer_module is None:
            raise FlowGrpoError(f"{arch.source}: built without its transformer module")
        tensors = sum(1 for _ in arch.transformer_module.parameters())
        trained_bytes = element
    return Shapes(
        dtype=config.model.dtype,
        element=element,
        nproc=config.distributed.nproc,
        image_tokens=arch.image_tokens(config.model.height, config.model.width),
        text_tokens=tokens,
        text_note=note,
        cond_elements=conditioning_elements(config, arch, tokens),
        latent_elements=math.prod(arch.latent_shape(config.model.height, config.model.width)),
        pixels=config.model.height * config.model.width,
        cuda=config.model.device != "cpu",
        trained=trained,
        trained_bytes=trained_bytes,
        trained_tensors=tensors,
        source_tokens=arch.source_tokens,
        source_elements=arch.source_elements,
    )


def cfg_layout(arch: Architecture, guidance_scale: float) -> tuple[int, int]:
    """(samples per forward per image, forwards per step) of the family's guidance: SD3
    batches [uncond; cond] into one forward; Qwen-Image and FLUX without guidance embedding
    run true CFG as a second forward; FLUX.1-dev's guidance is an input of the one forward."""
    if guidance_scale <= 1.0 or (arch.base_family == "flux" and arch.guidance_embeds):
        return 1, 1
    return (2, 1) if arch.family == "sd3" else (1, 2)


def _key(arch_kind: str, config: Config, dtype: str) -> str:
    checkpointing = "gc" if config.train.gradient_checkpointing else "nogc"
    precision = "float32" if dtype == "float32" else "bfloat16"
    return f"{arch_kind}/{config.train.mode}/{checkpointing}/{precision}"


def _constants(arch: Architecture, config: Config) -> list[tuple[int, dict[str, float]]]:
    _load_constants()
    return [
        (count, ACTIVATION[_key(kind, config, config.model.dtype)])
        for kind, count in arch.blocks.items()
    ]


def saved_activations(arch: Architecture, config: Config, s: Shapes, samples: int) -> int:
    """Bytes a forward with gradient over `samples` sequences keeps for backward."""
    unit = arch.inner * s.element * samples
    per_block = sum(
        count * (c["saved_image"] * s.sequence_image_tokens + c["saved_text"] * s.text_tokens)
        for count, c in _constants(arch, config)
    )
    outside = max(c["saved_outside"] for _, c in _constants(arch, config))
    return int(unit * (per_block + outside * (s.sequence_image_tokens + s.text_tokens)))


def backward_extra(arch: Architecture, config: Config, s: Shapes, samples: int) -> int:
    unit = arch.inner * s.element * samples * (s.sequence_image_tokens + s.text_tokens)
    return int(unit * max(c["backward_extra"] for _, c in _constants(arch, config)))


def forward_work(arch: Architecture, config: Config, s: Shapes, samples: int) -> int:
    """Peak bytes of a forward without gradient over `samples` sequences."""
    unit = arch.inner * s.element * samples * (s.sequence_image_tokens + s.text_tokens)
    return int(unit * max(c["work"] for _, c in _constants(arch, config)))


def vae_decode(arch: Architecture, s: Shapes, images: int) -> int:
    _load_constants()
    kind = "qwen" if arch.base_family == "qwenimage" else "sd3"
    precision = "float32" if s.dtype == "float32" else "bfloat16"
    return int(VAE_DECODE[f"{kind}/{precision}"] * s.pixels * images * s.element)


def stage_memory(config: Config, arch: Architecture, s: Shapes) -> dict[str, StageMemory]:
    """Peak bytes per device of rollout, update, evaluation (and score with a model
    reward), each as labelled items."""
    n = s.nproc
    algorithm = algorithm_for(config)
    dtype = config.model.dtype
    shard = f", 1/{n} FSDP shard" if n > 1 else ""
    transformer = arch.components["transformer"]
    resident: list[tuple[str, int]] = []
    if s.cuda:
        resident.append(("CUDA context (typical; outside torch's allocator)", CUDA_CONTEXT))
    params = transformer.parameters * s.element
    buffers = transformer.weight_bytes(dtype) - params
    resident.append(
        (
            f"transformer weights, {transformer.parameters / 1e9:.3g}B x {dtype}{shard}",
            math.ceil(params / n),
        )
    )
    if buffers:
        resident.append(("transformer buffers (position embedding; whole on every rank)", buffers))
    for name, component in arch.components.items():
        if name == "transformer":
            continue
        resident.append(
            (
                f"{name} ({component.class_name}, {component.parameters / 1e6:,.0f}M) x {dtype}",
                component.weight_bytes(dtype),
            )
        )
    for name in MODEL_REWARDS:
        if name in config.reward.weights:
            reward_dtype = config.reward.dtype
            if reward_dtype == "auto":
                reward_dtype = "float16" if s.cuda else "float32"
            count = reward_model_parameters(name)
            resident.append(
                (
                    f"reward model {name} ({count / 1e6:.0f}M x {reward_dtype})",
                    count * DTYPE_BYTES[reward_dtype],
                )
            )
    trained = math.ceil(s.trained * s.trained_bytes / n)
    what = "LoRA weights (float32" if config.train.mode == "lora" else "trained weights (the above"
    if config.train.mode == "lora":
        resident.append(
            (
                f"LoRA weights, r {config.train.lora_rank}, {s.trained / 1e6:.1f}M "
                f"x float32{shard}",
                trained,
            )
        )
    resident.append((f"AdamW moments (2 x {what}){shard})", 2 * trained))
    if config.train.ema_decay > 0:
        resident.append((f"EMA copy of the trained weights{shard}", trained))
    if algorithm.default_anchor_decay is not None:
        resident.append(
            (f"{config.algorithm.name} anchor copy of the trained weights{shard}", trained)
        )
    if config.train.mode == "full" and config.algorithm.beta > 0:
        resident.append(
            (f"KL reference: a frozen copy of the transformer{shard}", math.ceil(params / n))
        )
    gather: list[tuple[str, int]] = []
    if n > 1:
        gather_element = 2 if config.train.mixed_precision == "bfloat16" else s.element
        gather.append(
            (
                "FSDP: 2 gathered blocks + the weights outside blocks",
                (2 * arch.largest_block + arch.outside_blocks) * gather_element,
            )
        )

    out = {
        "rollout": _rollout(config, arch, s, resident + gather, trained),
        "update": _update(config, arch, s, resident + gather, trained),
        "evaluate": _evaluate(config, arch, s, resident + gather, trained),
    }
    if any(name in config.reward.weights for name in MODEL_REWARDS):
        out["score"] = _score(config, s, resident)
    return out


def _biggest(*phases: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The phase of a stage with the largest peak (its items)."""
    return max(phases, key=lambda items: sum(size for _, size in items))


def _sampling(
    config: Config, arch: Architecture, s: Shapes, guidance: float, batch: int, stochastic: int
) -> list[tuple[str, int]]:
    per_forward, forwards = cfg_layout(arch, guidance)
    negative = 2 if per_forward * forwards > 1 else 1
    cond = batch * s.conditioning(negative) * s.element
    source = f" (+ {s.source_tokens} of the source)" if s.source_tokens else ""
    forward = [
        (
            f"transformer forward, no grad: {batch} x {per_forward} sequences of "
            f"{s.image_tokens} image{source} + {s.text_tokens} text tokens",
            forward_work(arch, config, s, batch * per_forward),
        ),
        ("conditioning of the batch", cond),
    ]
    states = batch * (stochastic + 2) * s.latent_elements * 4
    decode = [
        (
            f"VAE decode of {batch} images ({config.model.height}x{config.model.width})",
            vae_decode(arch, s, batch),
        )
    ]
    return [("latents kept for the batch (float32)", states), *_biggest(forward, decode)]


def _rollout(config, arch, s: Shapes, base, trained: int) -> StageMemory:

    images = config.algorithm.group_size * config.algorithm.prompts_per_iteration
    per_rank = math.ceil(images / s.nproc)
    batch = min(config.sampler.batch_size, per_rank)
    groups = math.ceil(config.algorithm.prompts_per_iteration / s.nproc)
    per_forward, forwards = cfg_layout(arch, config.sampler.guidance_scale)
    negative = 2 if per_forward * forwards > 1 else 1
    items = list(base)
    items.append(
        (
            f"{s.conditioning_name} of the rank's {groups} prompts",
            groups * s.conditioning(negative) * s.element,
        )
    )
    if algorithm_for(config).samples_with_anchor:
        items.append(("backup of the weights while the anchor samples", trained))
    stochastic = sum(algorithm_for(config).step_schedule(0).stochastic)
    items += _sampling(config, arch, s, config.sampler.guidance_scale, batch, stochastic)
    return StageMemory(items)


def _update(config, arch, s: Shapes, base, trained: int) -> StageMemory:
    algorithm = algorithm_for(config)
    images = config.algorithm.group_size * config.algorithm.prompts_per_iteration
    per_step = math.ceil(images / (config.train.steps_per_epoch * s.nproc))
    micro = min(config.train.micro_batch_size, max(per_step, 1))
    guidance = algorithm_for(config).trained_guidance(
        config.sampler.guidance_scale, arch.guidance_embeds
    )
    per_forward, forwards = cfg_layout(arch, guidance)
    sequences = micro * per_forward
    negative = 2 if per_forward * forwards > 1 else 1
    checkpointing = "with" if config.train.gradient_checkpointing else "without"
    graph = saved_activations(arch, config, s, sequences) * forwards
    items = list(base)
    items.append(
        (f"gradients of the trained weights{', 1/' + str(s.nproc) if s.nproc > 1 else ''}", trained)
    )
    items.append(
        (
            "conditioning of a micro-batch (float32, as stored)",
            micro * s.conditioning(negative) * 4,
        )
    )
    items.append(
        (
            f"activations kept for backward: micro-batch {micro} x {per_forward} sequences"
            f"{' x 2 forwards (true CFG)' if forwards > 1 else ''}, {checkpointing} "
            "gradient checkpointing",
            graph,
        )
    )
    backward = [("backward's working memory", backward_extra(arch, config, s, sequences))]
    reference = []
    if config.algorithm.beta > 0 and algorithm.needs_trajectory:
        reference = [
            (
                "KL reference forward, no grad (while the graph is alive)",
                forward_work(arch, config, s, sequences),
            )
        ]
    items += _biggest(backward, reference)
    if algorithm.default_anchor_decay is not None:  # before the graph exists: never on top
        swap = [
            ("backup of the weights while the anchor runs", trained),
            ("anchor forward, no grad", forward_work(arch, config, s, sequences)),
        ]
        rest = [item for item in items if item[0].startswith(("activations", "backward", "KL"))]
        if sum(b for _, b in swap) > sum(b for _, b in rest):
            items = [item for item in items if item not in rest] + swap
    return StageMemory(items)


def _evaluate(config, arch, s: Shapes, base, trained: int) -> StageMemory:

    items = list(base)
    if config.train.ema_decay > 0:
        items.append(("backup of the weights while EMA evaluates", trained))
    per_forward, forwards = cfg_layout(arch, config.eval.guidance_scale)
    negative = 2 if per_forward * forwards > 1 else 1
    prompts, _ = evaluation_prompts(config)
    mine = math.ceil(prompts / s.nproc)
    batch = min(config.sampler.batch_size, mine)
    items.append(
        (
            f"{s.conditioning_name} of the rank's {mine} evaluation prompts",
            mine * s.conditioning(negative) * s.element,
        )
    )
    items += _sampling(config, arch, s, config.eval.guidance_scale, batch, 0)
    return StageMemory(items)


def _score(config, s: Shapes, base) -> StageMemory:
    _load_constants()
    items = list(base)
    reward_dtype = config.reward.dtype
    if reward_dtype == "auto":
        reward_dtype = "float16" if s.cuda else "float32"
    precision = "float32" if reward_dtype == "float32" else "bfloat16"
    from flowgrpo_cli.planning.architectures import REWARD_CLIPS

    for name in MODEL_REWARDS:  # they may run at once, on threads: summed
        if name in config.reward.weights:
            vision = REWARD_CLIPS[name]["vision_config"]
            tokens = (vision["image_size"] // vision["patch_size"]) ** 2 + 1
            work = (
                CLIP_FORWARD[precision]
                * config.reward.batch_size
                * tokens
                * vision["hidden_size"]
                * DTYPE_BYTES[reward_dtype]
            )
            items.append((f"{name} forward of {config.reward.batch_size} images", int(work)))
    return StageMemory(items)


_LOADED = False


def _load_constants() -> None:
    """ACTIVATION, VAE_DECODE and CLIP_FORWARD from constants.json beside this module (the
    output of benchmarks/plan_constants.py, kept as measured)."""
    global _LOADED
    if _LOADED:
        return
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).with_name("constants.json")).read_text())
    ACTIVATION.update(data["blocks"])
    VAE_DECODE.update(data["vae"])
    CLIP_FORWARD.update(data["clip"])
    _LOADED = True
