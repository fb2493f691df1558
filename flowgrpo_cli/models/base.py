"""What every model adapter provides: `ModelAdapter`, the base of the family adapters, which
holds what the families do alike (`PackedLatentAdapter`: what FLUX and Qwen-Image share
besides), and the small helpers they use.

An adapter wraps one diffusers pipeline and splits its ``__call__`` into the pieces Flow-GRPO
drives itself: encode prompts, draw the initial noise, the sigma schedule, one velocity
function (with CFG) shared by rollout and training, and decode. Run with plain Euler steps
``x_next = x + (sigma_next - sigma) * v`` in float32, the pieces reproduce the pipeline's own
images; that equivalence is what the tests hold every family to.

The sampler's state is the latent image ``[B, C, h, w]`` (h, w = image size / 8) for every
family. FLUX and Qwen-Image pack it into 2x2 patch tokens inside `velocity` only: their
pipelines draw the noise in that layout before packing, packing is a pure permutation (so
elementwise Euler / SDE steps commute with it), and it lets `velocity` read the image grid
from the tensor itself.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypedDict

import numpy as np
import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.guidance import apply_cfg

if TYPE_CHECKING:
    from pathlib import Path

    from diffusers.models.modeling_utils import ModelMixin
    from PIL import Image


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning of a batch: named tensors, batch dim first.

    Keys are the pipeline's own names (``prompt_embeds``, ``pooled_prompt_embeds``,
    ``prompt_embeds_mask`` and their ``negative_`` twins). ``tensors`` is a plain dict of
    tensors, so a store can save it as is and rebuild it with ``Conditioning(tensors)``.
    """

    tensors: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Conditioning tensors disagree on the batch size: {sizes}")

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def index(self, idx: int | slice | Sequence[int] | torch.Tensor) -> Conditioning:
        """Rows ``idx`` of every tensor; an int keeps the batch dim (one row)."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        elif not isinstance(idx, slice):
            idx = torch.as_tensor(idx, dtype=torch.long)
        return Conditioning({name: t[idx] for name, t in self.tensors.items()})

    def repeat_interleave(self, repeats: int) -> Conditioning:
        """Each row `repeats` times in a row: one prompt's conditioning for its whole group."""
        tensors = self.tensors.items()
        return Conditioning({name: t.repeat_interleave(repeats, dim=0) for name, t in tensors})

    def to(self, device: torch.device | str) -> Conditioning:
        return Conditioning({name: t.to(device) for name, t in self.tensors.items()})

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        """Stack conditionings of separate batches (e.g. prompts stored one by one).

        Token sequences of different lengths (Qwen-Image's embeddings are as long as the
        longest prompt of the batch they were encoded in) are right-padded with zeros, as the
        Qwen-Image pipeline pads its embeddings and masks itself.
        """
        names = list(parts[0].tensors)
        if any(set(part.tensors) != set(names) for part in parts):
            raise ValueError(f"Conditionings to concatenate have different keys: {names} vs others")
        out = {}
        for name in names:
            tensors = [part[name] for part in parts]
            if tensors[0].ndim >= 2:
                length = max(t.shape[1] for t in tensors)
                tensors = [_pad_dim1(t, length) for t in tensors]
            shapes = sorted({tuple(t.shape[1:]) for t in tensors})
            if len(shapes) > 1:
                # An edit family's `image_latents`: source images resized to different sizes
                # (another aspect ratio) give token grids one forward cannot hold together.
                raise FlowGrpoError(
                    f"cannot batch conditionings whose {name!r} have the shapes {shapes}: "
                    "source images of different aspect ratios cannot share a batch: set "
                    "data.source_size = [width, height] to resize every source to one size "
                    "when prepare stores it (as flow_grpo's edit recipes do), or keep "
                    "sampler.batch_size within a group"
                )
            out[name] = torch.cat(tensors, dim=0)
        return Conditioning(out)


def _pad_dim1(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    pad = t.new_zeros((t.shape[0], length - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


# All three families use joint (MM-DiT style) attention: image projections to_q / to_k / to_v /
# to_out.0 and text-stream projections add_*_proj / to_add_out (FLUX's single-stream blocks
# reuse the to_q / to_k / to_v names). Named from the block, as the Flow-GRPO reference recipes
# name them: "attn.to_q" matches `transformer_blocks.0.attn.to_q` but not the second,
# image-only attention (`attn2`) of SD3.5's dual-attention blocks, which the reference leaves
# alone. Each family's adapter adds the reference's other targets (FLUX's and Qwen-Image's
# feed-forward layers) in its `default_lora_targets`.
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class PipelinePlacement:
    """Where an adapter's pipeline computes, and in what dtypes: read once, then remembered.

    diffusers' ``ModelMixin.dtype`` / ``.device`` and ``DiffusionPipeline.device`` walk every
    submodule (and its offloading hooks) on each access, 0.4-3.5 ms apiece even on the tiny
    test model; the rollout asks once per denoising step and per prompt encoding, which was
    about a tenth of a tiny rollout's time (docs/performance.md). load_adapter places the
    pipeline before wrapping it and nothing moves it afterwards, so the first answer holds.
    Subclasses are dataclasses with a ``pipeline`` field.
    """

    pipeline: Any

    @functools.cached_property
    def device(self) -> torch.device:
        return self.pipeline.device

    @functools.cached_property
    def transformer_dtype(self) -> torch.dtype:
        return self.pipeline.transformer.dtype

    @functools.cached_property
    def vae_dtype(self) -> torch.dtype:
        return self.pipeline.vae.dtype


class ModelAdapter(PipelinePlacement, ABC):
    """One pipeline family, split into the pieces Flow-GRPO drives itself: the base of every
    family's adapter.

    The public methods are what rollout and training call; what the families do alike is
    written here once, and a family supplies the abstract methods (its latent layout, its
    encode_prompt call, its transformer forward). Tensors the sampler sees are float32
    whatever the model dtype; latents are cast to the transformer's dtype only for its forward.
    Subclasses are frozen dataclasses with a ``pipeline`` field: the diffusers pipeline, as
    from_pretrained loaded it.
    """

    #: The family name ("sd3", "flux", "qwenimage", "qwenimage_edit" or "flux_kontext"), a
    #: key of models.FAMILIES.
    family: ClassVar[str]
    #: Whether the family edits a source image (one per prompt, an input of `encode_prompts`)
    #: rather than generating from text alone.
    takes_source_image: ClassVar[bool] = False
    #: About how many pixels the pipeline resizes a source image to (0: the family takes
    #: none): what `flowgrpo plan` counts the source image's tokens from.
    source_pixels: ClassVar[int] = 0
    #: max_shift of the resolution-dependent time shift when the scheduler config has none:
    #: the pipeline's own default (StableDiffusion3Pipeline's is 1.16).
    default_max_shift: ClassVar[float] = 1.15

    @property
    def transformer(self) -> ModelMixin:
        """The denoiser: the module that gets LoRA and FSDP."""
        return self.pipeline.transformer

    def save_pretrained(self, folder: Path) -> None:
        """The pipeline as a folder that DiffusionPipeline.from_pretrained and load_adapter
        both read back: save_pretrained's, and what a family corrects in it."""
        self.pipeline.save_pretrained(folder, safe_serialization=True)

    @property
    @abstractmethod
    def default_lora_targets(self) -> list[str]:
        """The modules LoRA goes on by default, as the reference recipe of the family adapts
        them (peft target_modules: a name or a dotted suffix of one). The planner calls
        ``Adapter.default_lora_targets.fget(None)``: read nothing from self."""

    @abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample shape of the state the sampler integrates: (C, height / 8, width / 8)."""

    def runs_cfg(self, guidance_scale: float) -> bool:
        """Whether `velocity` runs the negative prompts at this scale (CFG), and so whether
        `encode_prompts` encodes them."""
        return guidance_scale > 1.0

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None,
        *,
        guidance_scale: float,
        max_sequence_length: int | None = None,
        system_prompt: str | None = None,
        source_images: Sequence[Image.Image] | None = None,
    ) -> Conditioning:
        """Encode with the pipeline's own encode_prompt.

        Negative prompts are encoded only when `velocity` will use them at this
        guidance_scale ("" when none are given); otherwise they are ignored, as the pipelines
        ignore them. max_sequence_length None keeps the pipeline's default. A system prompt
        is refused by the families whose text encoders take none (see `_system_prompt`).
        source_images: one per prompt for an edit family (`takes_source_image`), which keeps
        what it encodes of them in the conditioning; refused by the others.
        """
        check_source_images(self.family, self.takes_source_image, len(prompts), source_images)
        negatives = None
        if self.runs_cfg(guidance_scale):
            negatives = negatives_for(prompts, negative_prompts)
        # An edit family's sources at the pipeline's size, for its text encoder and its VAE.
        sources = None
        if source_images is not None:
            sources = [self.resized_source(image) for image in source_images]
        with self._system_prompt(system_prompt):
            tensors = self._encode_prompts(
                prompts, negatives, sequence_length_kwargs(max_sequence_length), sources
            )
        if sources is not None:  # encoded once per prompt, kept with its conditioning
            tensors["image_latents"] = torch.cat([self._encode_source(image) for image in sources])
        return Conditioning(tensors)

    def resized_source(self, image: Image.Image) -> Image.Image:
        """An edit family's source image at its pipeline's size for it."""
        raise NotImplementedError(f"the {self.family} family takes no source image")

    def _encode_source(self, image: Image.Image) -> torch.Tensor:
        """An edit family's VAE latents [1, C, h', w'] of a resized source image, as its
        pipeline's prepare_latents makes them (before it packs them)."""
        raise NotImplementedError(f"the {self.family} family takes no source image")

    def _system_prompt(self, system_prompt: str | None) -> AbstractContextManager[None]:
        """What `encode_prompts` encodes in: here, a refusal of any system prompt."""
        refuse_system_prompt(self.family, system_prompt)
        return contextlib.nullcontext()

    @abstractmethod
    def _encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str] | None,
        length: SequenceLength,
        sources: Sequence[Image.Image] | None,
    ) -> dict[str, torch.Tensor]:
        """The pipeline's encode_prompt of `prompts`, and of `negatives` unless None, keyed by
        the pipeline's names; `length` is its max_sequence_length keyword (or none). `sources`:
        the source images of an edit family (one per prompt, resized by `resized_source`), None
        for the others; `encode_prompts` adds their latents."""

    def initial_latents(
        self, generators: list[torch.Generator], height: int, width: int
    ) -> torch.Tensor:
        """Noise float32 [B, *latent_shape], row i drawn from generators[i] exactly as the
        pipeline's prepare_latents draws it (so a row does not depend on the batch).

        Every family's prepare_latents draws the unpacked [B, C, h, w] (Qwen-Image with a frame
        dim of 1) before it packs anything: the same numbers."""
        return draw_noise(generators, self.latent_shape(height, width), self.device)

    def sigmas(self, num_steps: int, height: int, width: int, shift: float = 0.0) -> torch.Tensor:
        """float32 [num_steps + 1], from 1 down to a final 0, as the pipeline schedules them.

        `shift` > 0 (sampler.shift): the same scheduler with its resolution-dependent shifting
        off and this static shift instead (as MixGRPO's `--shift 3` schedules FLUX)."""
        if shift:
            fixed = fixed_shift_config(self.pipeline.scheduler.config, shift)
            return scheduler_sigmas(
                self.pipeline, num_steps, config=fixed, **self._schedule(num_steps)
            )
        mu = self._mu(height, width)
        by_size = {} if mu is None else {"mu": mu}
        return scheduler_sigmas(self.pipeline, num_steps, **self._schedule(num_steps), **by_size)

    def _schedule(self, num_steps: int) -> dict[str, Any]:
        """The pipeline's set_timesteps arguments besides mu: none here (the scheduler's own
        timesteps, as StableDiffusion3Pipeline leaves them)."""
        return {}

    def time_shift(self, height: int, width: int, shift: float = 0.0) -> float:
        """s of the scheduler's time shift sigma = s t / (1 + (s - 1) t) at this size; with
        `shift` > 0, that fixed shift (see `sigmas`)."""
        config = self.pipeline.scheduler.config
        if shift:
            return shift_factor(fixed_shift_config(config, shift), None)
        return shift_factor(config, self._mu(height, width))

    def _mu(self, height: int, width: int) -> float | None:
        """The exponent of the resolution-dependent time shift; None when the scheduler shifts
        by its static `shift` (use_dynamic_shifting off, SD3.5's), and then ignores mu.

        Mirrors the pipelines (FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline):
        diffusers' `calculate_shift` (FLUX's; the other two call copies of it) of the token count,
        with the scheduler config's base / max sequence lengths and shifts, or the pipelines'
        defaults; the scheduler then applies its `time_shift` (see `shift_factor`)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting", False):
            return None
        return calculate_shift(
            self._image_tokens(height, width),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", self.default_max_shift),
        )

    @abstractmethod
    def _image_tokens(self, height: int, width: int) -> int:
        """How many image tokens the transformer sees at this size (calculate_shift's input)."""

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
    ) -> torch.Tensor:
        """One denoising forward with guidance, as the pipeline's __call__ does it.

        latents float32 [B, *latent_shape], sigma float32 [B]; returns float32 like latents.
        Used by rollout and training alike, so both see the same batch layout and CFG.
        """
        cfg = self.runs_cfg(guidance_scale) and uses_cfg(cond, guidance_scale, self.family)
        sigma = sigma.to(latents.device, torch.float32).expand(latents.shape[0])  # [B]
        # The scheduler's timestep t = sigma * num_train_timesteps, float32 [B].
        t = sigma * self.pipeline.scheduler.config.num_train_timesteps
        return self._velocity(latents, t, cond, guidance_scale, cfg)

    @abstractmethod
    def _velocity(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scale: float, cfg: bool
    ) -> torch.Tensor:
        """`velocity` at the scheduler's timesteps t [B]; cfg: run the negative prompts too."""

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, *latent_shape] -> images float32 [B, 3, H, W] in [0, 1].

        Here as the SD3 and FLUX pipelines decode with their AutoencoderKL: unscale, unshift,
        decode, postprocess."""
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(scaled.to(self.device, self.vae_dtype), return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image.float(), output_type="pt")


class PackedLatentAdapter(ModelAdapter):
    """FLUX and Qwen-Image: transformers that take 2x2 patch tokens, with true CFG.

    Both pipelines pack the latents into tokens (`pack_latents`) and compute the time shift's
    mu from the packed token count, schedule linspace(1, 1/N, N) shifted by it, cast t to the
    model dtype and hand the transformer t / 1000, and run CFG as a second forward with the
    negative prompts. A family says what its transformer takes besides the tokens
    (`_transformer_inputs`, `_text_inputs`), and whether CFG rescales (`cfg_rescale`).
    """

    #: apply_cfg's rescale_to_cond_norm: Qwen-Image rescales each token of the combined
    #: velocity to the norm of its conditional one.
    cfg_rescale: ClassVar[bool] = False

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        factor = self.pipeline.vae_scale_factor
        # 2x2 packing needs an even latent grid.
        check_image_size(height, width, factor * 2)
        return (self.transformer.config.in_channels // 4, height // factor, width // factor)

    def _image_tokens(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)  # packed tokens

    def _schedule(self, num_steps: int) -> dict[str, Any]:
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps)}

    def _velocity(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scale: float, cfg: bool
    ) -> torch.Tensor:
        _, _, h, w = latents.shape
        tokens = pack_latents(latents.to(self.transformer_dtype))  # [B, (h/2)(w/2), 4C]
        grids = [(h // 2, w // 2)]
        hidden = tokens
        if "image_latents" in cond:
            # An edit family: the encoded source image [B, C, h', w'] follows the generated
            # tokens in the sequence, and the transformer's output is cut back to those.
            source = cond["image_latents"].to(tokens.device, tokens.dtype)
            grids.append((source.shape[2] // 2, source.shape[3] // 2))
            hidden = torch.cat([tokens, pack_latents(source)], dim=1)
        inputs = {
            "hidden_states": hidden,
            # The pipeline casts t = sigma * 1000 to the latents' dtype, then divides by 1000.
            "timestep": t.to(tokens.dtype) / 1000,
            **self._transformer_inputs(tokens, grids, scale),
        }

        def forward(prefix: str) -> torch.Tensor:
            text = self._text_inputs(cond, prefix, tokens)
            out = self.transformer(**inputs, **text, return_dict=False)[0]
            return out[:, : tokens.shape[1]].float()

        v = forward("")  # [B, (h/2)(w/2), 4C]
        if cfg:
            # cfg_rescale's norms are per token: over the channels of the packed layout, as
            # the pipeline takes them.
            v = apply_cfg(forward("negative_"), v, scale, rescale_to_cond_norm=self.cfg_rescale)
        return unpack_latents(v, h, w)

    @abstractmethod
    def _transformer_inputs(
        self, tokens: torch.Tensor, grids: list[tuple[int, int]], scale: float
    ) -> dict[str, Any]:
        """The transformer's keyword arguments besides the tokens (hidden_states), the timestep
        and the text's: what the family's transformer needs for its token grids of rows x cols
        (the generated image's, then an edit family's source image's) and this guidance
        scale."""

    @abstractmethod
    def _text_inputs(self, cond: Conditioning, prefix: str, tokens: torch.Tensor) -> dict[str, Any]:
        """The transformer's text keyword arguments, from the tensors of `cond` whose names
        start with `prefix` ("" for the prompts, "negative_" for the negative prompts), on the
        device (and, floats, in the dtype) of the image tokens."""


def check_image_size(height: int, width: int, multiple: int) -> None:
    """Refuse sizes the pipelines would silently round: the latent grid must divide evenly."""
    if height <= 0 or width <= 0 or height % multiple or width % multiple:
        raise FlowGrpoError(
            f"Image size {height}x{width} is not supported: height and width must be positive "
            f"multiples of {multiple} (e.g. 512x512)."
        )


def draw_noise(
    generators: Sequence[torch.Generator], shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """float32 [len(generators), *shape], one row per generator, as the pipelines draw it."""
    from diffusers.utils.torch_utils import randn_tensor

    if not generators:
        raise ValueError("initial_latents needs one generator per sample; got none")
    # randn_tensor draws row i from generators[i] alone (on the generators' device, then
    # moves it): the very call the pipelines' prepare_latents make.
    return randn_tensor(
        (len(generators), *shape), generator=list(generators), device=device, dtype=torch.float32
    )


def scheduler_sigmas(
    pipeline: Any, num_steps: int, config: Any = None, **set_timesteps_kwargs: Any
) -> torch.Tensor:
    """The sigmas the pipeline's scheduler sets for `num_steps`, without touching its state;
    `config` replaces the scheduler's config."""
    scheduler = type(pipeline.scheduler).from_config(config or pipeline.scheduler.config)
    scheduler.set_timesteps(num_steps, device="cpu", **set_timesteps_kwargs)
    return scheduler.sigmas.to(torch.float32)


def fixed_shift_config(scheduler_config: Any, shift: float) -> dict[str, Any]:
    """The scheduler's config with resolution-dependent shifting off and `shift` as its static
    shift: diffusers' FlowMatchEulerDiscreteScheduler(shift=shift) for this model."""
    if "shift" not in scheduler_config:
        raise FlowGrpoError(
            f"sampler.shift = {shift} sets the static time shift of a flow-matching scheduler; "
            f"this pipeline's scheduler has no `shift` in its config: leave sampler.shift at 0"
        )
    return {**scheduler_config, "shift": float(shift), "use_dynamic_shifting": False}


def shift_factor(scheduler_config: Any, mu: float | None) -> float:
    """s of the time shift the scheduler applies to its times t, sigma = s t / (1 + (s - 1) t):
    its static `shift`, or exp(mu) (linear: mu) when it shifts by resolution.

    A scheduler that then stretches its sigmas to `shift_terminal` (Qwen-Image's) maps times
    to sigmas through the whole N-step schedule, not through s alone: refused."""
    if scheduler_config.get("shift_terminal"):
        raise FlowGrpoError(
            f"sampler.post_window_compress < 1 redraws the steps after the SDE window on the "
            f"scheduler's time shift, and this scheduler also stretches its sigmas to "
            f"shift_terminal = {scheduler_config['shift_terminal']} (Qwen-Image's), which "
            "that redraw does not follow: keep post_window_compress = 1 on this model "
            "(post_window_solver and ode_solver work on any)"
        )
    if mu is None:
        return float(scheduler_config.get("shift", 1.0))
    if scheduler_config.get("time_shift_type", "exponential") == "linear":
        return float(mu)
    return math.exp(mu)


def uses_cfg(cond: Conditioning, guidance_scale: float, family: str) -> bool:
    """Whether this forward uses CFG; refuses a conditioning encoded without negatives."""
    use_cfg = guidance_scale > 1.0
    if use_cfg and "negative_prompt_embeds" not in cond:
        raise FlowGrpoError(
            f"{family}: guidance_scale {guidance_scale} needs negative prompt embeddings, but the "
            "conditioning has none: encode the prompts with the same guidance_scale."
        )
    return use_cfg


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C]: 2x2 patch tokens, row-major over the patch grid,
    channels of a token ordered (c, dy, dx); the layout FLUX and Qwen-Image transformers take."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack_latents` for a latent grid of height x width."""
    b, _, channels = tokens.shape
    patches = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, height, width)


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """Images float [B, 3, H, W] in [0, 1] -> PIL images, rounded as diffusers' numpy_to_pil."""
    from PIL import Image

    pixels = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    return [Image.fromarray(p.permute(1, 2, 0).numpy()) for p in pixels]


def to_png(images: torch.Tensor) -> list[bytes]:
    """Images float [B, 3, H, W] in [0, 1] -> PNG bytes, one per image.

    zlib level 1, not Pillow's 6: 4x faster at 512x512 for about 19% more bytes (`just bench`),
    and the rollout encodes every image on its sampling path."""
    out = []
    for image in to_pil(images):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        out.append(buffer.getvalue())
    return out


def negatives_for(prompts: list[str], negative_prompts: list[str] | None) -> list[str]:
    """The negative prompt of each prompt: "" when none are given (SD3's pipeline default)."""
    if negative_prompts is None:
        return [""] * len(prompts)
    if len(negative_prompts) != len(prompts):
        raise FlowGrpoError(
            f"Got {len(negative_prompts)} negative prompts for {len(prompts)} prompts: pass one "
            "per prompt, or none."
        )
    return list(negative_prompts)


def check_source_images(
    family: str, takes_source_image: bool, prompts: int, source_images: Sequence[Any] | None
) -> None:
    """One source image per prompt for an edit family, none for the others."""
    if source_images is None:
        if takes_source_image:
            raise FlowGrpoError(
                f"The {family} model edits a source image, and the prompts came without one: "
                "prepare an editing data set, a jsonl, csv or parquet prompt file whose rows "
                "name their image in an `image` column (a path relative to the file; parquet "
                'may hold the image bytes), e.g. {"prompt": "make the sky red", "image": '
                '"images/0001.png"}, with `flowgrpo prepare --train FILE` into a new run '
                "(docs/stages.md)."
            )
        return
    if not takes_source_image:
        raise FlowGrpoError(
            f"The prompts come with source images (an editing data set), but the {family} "
            "model generates from text alone: set model.path to an editing model (the "
            "qwenimage_edit family, e.g. Qwen/Qwen-Image-Edit, or flux_kontext, e.g. "
            "black-forest-labs/FLUX.1-Kontext-dev)."
        )
    if len(source_images) != prompts:
        raise FlowGrpoError(f"Got {len(source_images)} source images for {prompts} prompts.")


def refuse_system_prompt(family: str, system_prompt: str | None) -> None:
    if system_prompt is not None:
        raise FlowGrpoError(
            f"A system prompt was given, but the {family} text encoders take none: only "
            "Qwen-Image (a chat model as text encoder) uses one."
        )


class SequenceLength(TypedDict, total=False):
    """encode_prompt's max_sequence_length keyword, or no keyword (the pipeline's default)."""

    max_sequence_length: int


def sequence_length_kwargs(max_sequence_length: int | None) -> SequenceLength:
    """encode_prompt keyword for a max length; None keeps the pipeline's default."""
    return {} if max_sequence_length is None else {"max_sequence_length": max_sequence_length}
