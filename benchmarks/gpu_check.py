"""`just gpu-check`: what one GPU does with an SD3.5-Medium-sized Flow-GRPO run, in one command.

    python -m benchmarks.gpu_check                  # one CUDA GPU, a few minutes, no Hub
    python -m benchmarks.gpu_check --out gpu.json   # the JSON also to a file
    python -m benchmarks.gpu_check --smoke          # the same code path on the CPU, tiny shapes

It builds a pipeline of SD3.5 Medium's published architecture with random weights (the
transformer at full size, 2.47B parameters; the VAE at full size; the three text encoders as
small stand-ins with the published output widths, so every tensor the transformer sees has its
real shape), saves it as a diffusers folder, and runs `flowgrpo loop` on it for two iterations
through the very functions the CLI calls (`resolve_run`, `run_loop`), with
examples/sd35m_ocr.toml as the config: bfloat16, LoRA r 32 / alpha 64 on the default targets,
512x512, 10 SDE steps, CFG 4.5, beta 0.04, gradient checkpointing. Iteration 0 is the warm-up;
throughputs are iteration 1's. Each stage call is wrapped to record its wall time and its peak
GPU memory. One JSON comes out (stdout, and --out): the device, rollout and update images/s,
peak memory per stage against `flowgrpo plan`'s prediction, the rollout/update log-prob gap
(the on-policy check) and, where vllm-omni is importable, its engine's images/s.

Two departures from examples/sd35m_ocr.toml, both stated in the JSON: the reward is
jpeg_compressibility (OCR reads nothing on random-weight images, so every advantage would be 0
and nothing would train), and the iteration is small (sizes under "sizes").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import PROMPTS_TEST, PROMPTS_TRAIN, REPO, machine

NO_CUDA = "no CUDA device; run with --smoke to check the code path on CPU"
EXAMPLE_CONFIG = REPO / "examples" / "sd35m_ocr.toml"

# ---------------------------------------------------------------------------------------------
# Architectures. The transformer and the VAE are SD3.5 Medium's published configs, the files
# `flowgrpo plan` builds its plan from (flowgrpo_cli/models/architectures/sd3.5-medium.json).

ARCHITECTURE = "sd3.5-medium"


def published_configs() -> dict[str, dict[str, Any]]:
    """Component -> the published config.json of SD3.5 Medium, as `flowgrpo plan` reads it."""
    from flowgrpo_cli.planning.architectures import known_architectures

    return known_architectures()[ARCHITECTURE]["configs"]


#: Stand-in text encoders of the GPU check: the published output widths (CLIP hidden 768 and
#: 1280, projections 768 + 1280 = the pooled 2048, T5 d_model 4096), two layers each.
STANDIN_TEXT_ENCODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "text_encoder": ("clip", {"hidden_size": 768, "intermediate_size": 256,
                              "num_hidden_layers": 2, "num_attention_heads": 4,
                              "projection_dim": 768}),
    "text_encoder_2": ("clip", {"hidden_size": 1280, "intermediate_size": 256,
                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                "projection_dim": 1280}),
    "text_encoder_3": ("t5", {"d_model": 4096, "d_kv": 64, "d_ff": 256, "num_layers": 2,
                              "num_heads": 8}),
}  # fmt: skip

#: --smoke: SD3.5's block kinds (dual attention, RMS-normed q/k) at toy widths.
SMOKE_TRANSFORMER: dict[str, Any] = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 64,
    "caption_projection_dim": 64,
    "pooled_projection_dim": 64,
    "pos_embed_max_size": 16,
    "dual_attention_layers": (0,),
    "qk_norm": "rms_norm",
}
#: --smoke: the published VAE's layout at toy widths.
SMOKE_VAE_CHANGES: dict[str, Any] = {
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}
SMOKE_TEXT_ENCODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "text_encoder": ("clip", {"hidden_size": 32, "intermediate_size": 64,
                              "num_hidden_layers": 2, "num_attention_heads": 4,
                              "projection_dim": 32}),
    "text_encoder_2": ("clip", {"hidden_size": 32, "intermediate_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4,
                                "projection_dim": 32}),
    "text_encoder_3": ("t5", {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                              "num_heads": 4}),
}  # fmt: skip


def transformer_config(smoke: bool) -> tuple[dict[str, Any], str]:
    """(SD3Transformer2DModel config, where it came from); --smoke: SMOKE_TRANSFORMER."""
    if smoke:
        return dict(SMOKE_TRANSFORMER), "benchmarks/gpu_check.py SMOKE_TRANSFORMER"
    path = f"flowgrpo_cli/models/architectures/{ARCHITECTURE}.json"
    return dict(published_configs()["transformer"]), path


def vae_config(smoke: bool) -> dict[str, Any]:
    vae = dict(published_configs()["vae"])
    return {**vae, **SMOKE_VAE_CHANGES} if smoke else vae


# ---------------------------------------------------------------------------------------------
# Sizes of the run


@dataclass(frozen=True)
class Sizes:
    prompts_per_iteration: int
    group_size: int
    sampler_batch_size: int
    micro_batch_size: int
    num_steps: int
    height: int
    width: int
    iterations: int  # iteration 0 warms up; the last one is measured
    dtype: str
    max_sequence_length: int  # 0: the pipeline's default (SD3: 256 T5 tokens)

    def overrides(self) -> list[str]:
        return [
            f"algorithm.prompts_per_iteration={self.prompts_per_iteration}",
            f"algorithm.group_size={self.group_size}",
            f"sampler.batch_size={self.sampler_batch_size}",
            f"train.micro_batch_size={self.micro_batch_size}",
            f"sampler.num_steps={self.num_steps}",
            f"model.height={self.height}",
            f"model.width={self.width}",
            f'model.dtype="{self.dtype}"',
            f"model.max_sequence_length={self.max_sequence_length}",
        ]


#: One GPU: 2 prompts x 8 images (two rollout batches of 8, 16 CFG rows per forward), the
#: update in micro-batches of 4 (the example's), two iterations.
GPU_SIZES = Sizes(2, 8, 8, 4, 10, 512, 512, 2, "bfloat16", 0)
#: --smoke: float32, where the on-policy gap must vanish (below 1e-6).
SMOKE_SIZES = Sizes(2, 4, 4, 2, 3, 64, 64, 2, "float32", 16)


# ---------------------------------------------------------------------------------------------
# The model


def _text_encoder(kind: str, values: dict[str, Any], *, meta: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    if kind == "clip":
        config = CLIPTextConfig(
            **{"vocab_size": 1000, "max_position_embeddings": 77, "bos_token_id": 0,
               "eos_token_id": 1, "pad_token_id": 1, **values}
        )  # fmt: skip
        model_class = CLIPTextModelWithProjection
    else:
        config = T5Config(
            **{"vocab_size": 256, "feed_forward_proj": "gated-gelu",
               "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
               **values}
        )  # fmt: skip
        model_class = T5EncoderModel
    if meta:
        with torch.device("meta"):
            return model_class(config)
    return model_class(config)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stored_count(module: torch.nn.Module) -> int:
    """Parameters and buffers: what a checkpoint holds. SD3.5 Medium's 2.47B counts its
    positional-embedding table (384 x 384 positions x 1536, a buffer) beside 2.24B parameters."""
    return parameter_count(module) + sum(b.numel() for b in module.buffers())


def published_encoder_bytes(dtype: str) -> int:
    """Bytes of SD3.5 Medium's published text encoders loaded in `dtype`, as `flowgrpo plan`
    counts them on the meta device."""
    from flowgrpo_cli.planning.architectures import resolve_architecture

    components = resolve_architecture("", arch=ARCHITECTURE).components
    return sum(c.weight_bytes(dtype) for n, c in components.items() if n.startswith("text_"))


def build_pipeline(out_dir: Path, *, smoke: bool, device: torch.device, dtype: str) -> dict:
    """Save an SD3.5-architecture pipeline with random weights into `out_dir` (what
    from_pretrained reads); returns what was built. The transformer is initialised on
    `device` (seconds on a GPU, where 2.47B parameters would take a while on the CPU)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    from flowgrpo_cli.models.tiny import char_clip_tokenizer, char_t5_tokenizer
    from flowgrpo_cli.training.policy import DTYPES

    _quiet()
    transformer_kwargs, source = transformer_config(smoke)
    encoders = SMOKE_TEXT_ENCODERS if smoke else STANDIN_TEXT_ENCODERS
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        with torch.device(device):
            transformer = SD3Transformer2DModel.from_config(transformer_kwargs)
        # Saved from the CPU, in the dtype the run loads it in (half the file in bfloat16).
        transformer = transformer.to("cpu", DTYPES[dtype])
        _free_memory(device)
        parts = {name: _text_encoder(kind, values) for name, (kind, values) in encoders.items()}
        vae = AutoencoderKL.from_config(vae_config(smoke))
    pipeline = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        tokenizer=char_clip_tokenizer(),
        tokenizer_2=char_clip_tokenizer(),
        tokenizer_3=char_t5_tokenizer(),
        **parts,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    built = {
        "transformer_config_source": source,
        "transformer_config": {k: list(v) if isinstance(v, tuple) else v
                               for k, v in transformer_kwargs.items()},
        "transformer_parameters": parameter_count(transformer),
        "transformer_parameters_and_buffers": stored_count(transformer),
        "vae_parameters": parameter_count(vae),
        "text_encoder_parameters": {name: parameter_count(m) for name, m in parts.items()},
        "weights": "random (seed 0)",
    }  # fmt: skip
    del pipeline, transformer, parts, vae
    _free_memory(device)
    return built


def _quiet() -> None:
    """No per-shard progress bars or dtype notices from save_pretrained: errors only."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for library in (diffusers_logging, transformers_logging):
        library.set_verbosity_error()
        library.disable_progress_bar()


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Stage wrappers: wall time and peak memory of every call of a stage


@dataclass
class PhaseRecord:
    phase: str
    iteration: int | None
    seconds: float
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    allocated_before_bytes: int | None


class PhaseRecorder:
    """Wraps module functions (the stages `run_loop` calls) to time each call and read the
    CUDA allocator's peaks over it; restores them on exit."""

    def __init__(self, device: torch.device):
        self.device = device
        self.records: list[PhaseRecord] = []
        self._stack = contextlib.ExitStack()

    def wrap(self, owner: Any, name: str, phase: str, iteration_arg: int | None) -> None:
        original = getattr(owner, name)
        cuda = self.device.type == "cuda"

        def recorded(*args: Any, **kwargs: Any) -> Any:
            before = None
            if cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                before = torch.cuda.memory_allocated(self.device)
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - started
            self.records.append(
                PhaseRecord(
                    phase=phase,
                    iteration=args[iteration_arg] if iteration_arg is not None else None,
                    seconds=seconds,
                    peak_allocated_bytes=(
                        torch.cuda.max_memory_allocated(self.device) if cuda else None
                    ),
                    peak_reserved_bytes=(
                        torch.cuda.max_memory_reserved(self.device) if cuda else None
                    ),
                    allocated_before_bytes=before,
                )
            )
            return result

        setattr(owner, name, recorded)
        self._stack.callback(setattr, owner, name, original)

    def find(self, phase: str, iteration: int | None = None) -> PhaseRecord | None:
        for record in self.records:
            if record.phase == phase and (iteration is None or record.iteration == iteration):
                return record
        return None

    def __enter__(self) -> PhaseRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


# ---------------------------------------------------------------------------------------------
# `flowgrpo plan`'s prediction (another module; optional until it exists)

PLAN_MODULES = ("flowgrpo_cli.planning", "flowgrpo_cli.plan")
PLAN_PHASES = ("rollout", "update", "evaluate")


def predicted_memory(config: Any, iterations: int) -> dict[str, int] | str:
    """Per-GPU bytes `flowgrpo plan` predicts for each phase of this config, or why not."""
    for name in PLAN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and name.startswith(err.name):
                continue
            return f"error importing {name}: {err}"
        plan_run = getattr(module, "plan_run", None)
        if plan_run is None:
            continue
        try:
            plan = plan_run(config, iterations=iterations, arch=None)
            return {
                phase: int(plan.memory[phase].total_bytes)
                for phase in PLAN_PHASES
                if phase in plan.memory
            }
        except Exception as err:  # report it: the check's other numbers still stand
            return f"error: {type(err).__name__}: {err}"
    return "not available"


# ---------------------------------------------------------------------------------------------
# The run


def _run_config(model: Path, sizes: Sizes, device: str) -> list[str]:
    return [
        f"model.path={model}",
        f"model.device={device}",
        f"data.train={PROMPTS_TRAIN}",
        f"data.test={PROMPTS_TEST}",
        "reward.weights={jpeg_compressibility = 1.0}",
        "reward.ocr_workers=1",
        "eval.every=0",
        "distributed.nproc=1",
        "log.trackers=[]",
        *sizes.overrides(),
    ]


def run_check(
    workdir: Path, *, smoke: bool, device: torch.device, log: Callable[[str], None]
) -> dict[str, Any]:
    import flowgrpo_cli.loop as loop_module
    from flowgrpo_cli.loop import run_loop
    from flowgrpo_cli.stages import rollout, score, update
    from flowgrpo_cli.store.metrics_log import read_log
    from flowgrpo_cli.store.runconfig import resolve_run

    sizes = SMOKE_SIZES if smoke else GPU_SIZES
    phases: dict[str, float] = {}
    started = time.perf_counter()
    log(f"building the {'smoke' if smoke else 'SD3.5-Medium-sized'} pipeline (random weights)")
    model = workdir / "model"
    built = build_pipeline(model, smoke=smoke, device=device, dtype=sizes.dtype)
    phases["build_model_s"] = time.perf_counter() - started

    resolved = resolve_run(
        EXAMPLE_CONFIG,
        _run_config(model, sizes, str(device)),
        workdir / "run",
    )
    config, run = resolved.config, resolved.run
    log(f"flowgrpo loop, {sizes.iterations} iterations of {sizes.prompts_per_iteration} "
        f"prompts x {sizes.group_size} images at {sizes.height}x{sizes.width}")  # fmt: skip
    loop_started = time.perf_counter()
    with PhaseRecorder(device) as recorder:
        recorder.wrap(loop_module, "load_policy", "load_policy", None)
        recorder.wrap(loop_module, "Trainer", "trainer_setup", None)
        recorder.wrap(rollout, "run", "rollout", 2)
        recorder.wrap(score, "run", "score", 2)
        recorder.wrap(update, "run", "update", 2)
        with resolved.writing():
            run_loop(config, run, sizes.iterations)
    phases["loop_s"] = time.perf_counter() - loop_started
    lines = {line["iteration"]: line for line in read_log(run)}
    _free_memory(device)

    measured = sizes.iterations - 1
    metrics = lines[measured]
    predicted = predicted_memory(config, sizes.iterations)
    encoder_gap = _encoder_gap(built, sizes.dtype, smoke)
    result = {
        "sizes": {
            **asdict(sizes),
            "guidance_scale": config.sampler.guidance_scale,
            "noise_level": config.sampler.noise_level,
            "lora_rank": config.train.lora_rank,
            "lora_alpha": config.train.lora_alpha,
            "lora_targets": config.train.lora_targets or "the family's default",
            "beta": config.algorithm.beta,
            "gradient_checkpointing": config.train.gradient_checkpointing,
            "mixed_precision": config.train.mixed_precision,
            "steps_per_epoch": config.train.steps_per_epoch,
            "images_per_iteration": sizes.prompts_per_iteration * sizes.group_size,
            "measured_iteration": measured,
            "config": str(EXAMPLE_CONFIG.relative_to(REPO)),
            "reward": "jpeg_compressibility (OCR reads nothing on random-weight images: every "
            "advantage would be 0 and nothing would train)",
        },
        "model": built,
        "rollout": {
            "images_per_s": metrics["rollout/images_per_s"],
            "images": metrics["rollout/images"],
            "stage_seconds": metrics["rollout/seconds"],
            "warmup_images_per_s": lines[0]["rollout/images_per_s"],
        },
        "update": {
            "images_per_s": metrics["update/samples_per_s"],
            "samples_trained": metrics["update/samples_trained"],
            "optimizer_steps": metrics["update/optimizer_steps"],
            "stage_seconds": metrics["update/seconds"],
            "warmup_images_per_s": lines[0]["update/samples_per_s"],
        },
        "logprob_gap": {
            "dtype": sizes.dtype,
            "what": "|log-prob recomputed by the update - log-prob stored by the rollout| on "
            "the update's first micro-batch, before any optimizer step (update/logprob_gap_*)",
            "rollout_rows_per_forward": sizes.sampler_batch_size * 2,
            "update_rows_per_forward": sizes.micro_batch_size * 2,
            "float32_bound": 1e-6,
            "per_iteration": {
                str(i): {
                    "max": lines[i]["update/logprob_gap_max"],
                    "mean": lines[i]["update/logprob_gap_mean"],
                }
                for i in sorted(lines)
            },
            "max": max(line["update/logprob_gap_max"] for line in lines.values()),
            "mean": sum(line["update/logprob_gap_mean"] for line in lines.values()) / len(lines),
        },
        "memory": _memory(recorder, measured, predicted, encoder_gap, device),
        "wall_seconds": _wall(recorder, phases),
    }
    return result


def _encoder_gap(built: dict, dtype: str, smoke: bool) -> int | None:
    """Bytes the published text encoders would add to what the stand-ins hold (GPU mode)."""
    if smoke:
        return None
    element = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    standin = sum(built["text_encoder_parameters"].values()) * element
    return published_encoder_bytes(dtype) - standin


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _memory(
    recorder: PhaseRecorder,
    iteration: int,
    predicted: dict[str, int] | str,
    encoder_gap: int | None,
    device: torch.device,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "device": device.type,
        "note": (
            "peak torch.cuda.max_memory_allocated / max_memory_reserved over each stage call "
            "of the measured iteration, reset at its start"
            if device.type == "cuda"
            else "cpu: no CUDA allocator to read; peaks are null"
        ),
        "plan": predicted if isinstance(predicted, str) else "flowgrpo plan (plan_run)",
        "published_text_encoders_extra_bytes": encoder_gap,
    }
    for phase in ("rollout", "update"):
        record = recorder.find(phase, iteration)
        prediction = predicted.get(phase) if isinstance(predicted, dict) else None
        allocated = record.peak_allocated_bytes if record else None
        with_encoders = (
            allocated + encoder_gap if allocated is not None and encoder_gap is not None else None
        )
        out[phase] = {
            "peak_allocated_bytes": allocated,
            "peak_reserved_bytes": record.peak_reserved_bytes if record else None,
            "allocated_at_start_bytes": record.allocated_before_bytes if record else None,
            "predicted_bytes": prediction,
            "ratio_allocated_to_predicted": _ratio(allocated, prediction),
            "ratio_reserved_to_predicted": _ratio(
                record.peak_reserved_bytes if record else None, prediction
            ),
            # The stand-in text encoders are smaller than the published ones, which stay on the
            # GPU for the whole run: the measured peak plus that difference is the real run's.
            "peak_allocated_with_published_encoders_bytes": with_encoders,
            "ratio_with_published_encoders_to_predicted": _ratio(with_encoders, prediction),
        }
    return out


def _wall(recorder: PhaseRecorder, phases: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = dict(phases)
    for record in recorder.records:
        key = record.phase if record.iteration is None else f"{record.phase}_{record.iteration}"
        out[f"{key}_s"] = record.seconds
    return out


# ---------------------------------------------------------------------------------------------
# vllm-omni (its own environment: `just setup-vllm`)


def vllm_omni_check(workdir: Path, *, smoke: bool, device: torch.device) -> dict[str, Any]:
    """vllm-omni's images/s against the diffusers engine's, on the same requests.

    The engine samples Qwen-Image pipelines only (flowgrpo_cli/engines/vllm_omni.py), so this
    builds flowgrpo's tiny Qwen-Image with a transformer of Qwen-Image's widths (head dim 128,
    24 heads) but only VLLM_LAYERS of its 60 blocks: both engines sample the same batch."""
    if importlib.util.find_spec("vllm_omni") is None:
        return {
            "status": "not installed",
            "how": "`just setup-vllm`, then `.venv-vllm/bin/python -m benchmarks.gpu_check`",
        }
    if smoke:
        return {"status": "skipped in --smoke (vllm-omni needs a GPU)"}
    try:
        return _vllm_omni_measure(workdir, device)
    except Exception as err:  # the SD3.5 numbers above stand without it
        return {"status": f"error: {type(err).__name__}: {err}"}


VLLM_LAYERS = 6
VLLM_IMAGES = 8


def _vllm_omni_measure(workdir: Path, device: torch.device) -> dict[str, Any]:
    from diffusers import QwenImageTransformer2DModel

    from flowgrpo_cli.algorithm.schedule import build_step_schedule
    from flowgrpo_cli.engines.base import SampleRequest
    from flowgrpo_cli.engines.diffusers_engine import DiffusersEngine
    from flowgrpo_cli.engines.vllm_omni import VllmOmniEngine
    from flowgrpo_cli.models.tiny import build_tiny_pipeline
    from flowgrpo_cli.store.config import load_config
    from flowgrpo_cli.store.contract import SamplerSettings
    from flowgrpo_cli.training.policy import load_policy

    folder = build_tiny_pipeline("qwenimage", workdir / "qwenimage", seed=0)
    text_width = json.loads((folder / "transformer" / "config.json").read_text())[
        "joint_attention_dim"
    ]
    with torch.random.fork_rng(devices=[device.index or 0]):
        torch.manual_seed(0)
        with torch.device(device):
            transformer = QwenImageTransformer2DModel(
                patch_size=2, in_channels=64, out_channels=16, num_layers=VLLM_LAYERS,
                attention_head_dim=128, num_attention_heads=24,
                joint_attention_dim=text_width, axes_dims_rope=(16, 56, 56),
            )  # fmt: skip
        transformer.to(torch.bfloat16).save_pretrained(folder / "transformer")
    del transformer
    _free_memory(device)
    config = load_config(
        None,
        [f"model.path={folder}", "model.device=cuda", 'model.dtype="bfloat16"',
         "train.lora_rank=32", "train.lora_alpha=64"],
    )  # fmt: skip
    policy = load_policy(config, device)
    size, steps = GPU_SIZES.height, GPU_SIZES.num_steps
    requests = [
        SampleRequest(f"s{i}", i % 2, i % 2, 1000 + i, f'A sign that says "CHECK {i % 2}"',
                      "", "", "")
        for i in range(VLLM_IMAGES)
    ]  # fmt: skip
    settings = SamplerSettings(
        kind="sde", noise_level=0.7, guidance_scale=4.0, height=size, width=size,
        schedule=build_step_schedule(steps),
    )  # fmt: skip
    engines = {
        "diffusers": DiffusersEngine(policy, max_sequence_length=0),
        "vllm-omni": VllmOmniEngine(policy, max_sequence_length=0),
    }
    conditioning = engines["diffusers"].encode(requests, settings.guidance_scale)
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {}
    try:
        for name, engine in engines.items():
            started = time.perf_counter()
            engine.sample(requests, conditioning, settings)  # warm-up (vllm-omni: start-up)
            torch.cuda.synchronize(device)
            out[f"{name}_first_batch_s"] = time.perf_counter() - started
            started = time.perf_counter()
            out[name] = engine.sample(requests, conditioning, settings)
            torch.cuda.synchronize(device)
            seconds[name] = time.perf_counter() - started
    finally:
        engines["vllm-omni"].close()
    gap = (out.pop("diffusers").log_probs - out.pop("vllm-omni").log_probs).abs().max()
    return {
        "status": "measured",
        "model": f"Qwen-Image transformer widths, {VLLM_LAYERS} of 60 blocks, random weights, "
        "bfloat16, LoRA r 32; tiny text encoder and VAE",
        "images": VLLM_IMAGES,
        "size": size,
        "num_steps": steps,
        "guidance_scale": settings.guidance_scale,
        "images_per_s": VLLM_IMAGES / seconds["vllm-omni"],
        "diffusers_images_per_s": VLLM_IMAGES / seconds["diffusers"],
        "speedup_over_diffusers": seconds["diffusers"] / seconds["vllm-omni"],
        "max_abs_logprob_difference": float(gap),
        **{k: v for k, v in out.items() if k.endswith("_s")},
    }


# ---------------------------------------------------------------------------------------------
# Entry point


def _device_info(device: torch.device) -> dict[str, Any]:
    info = machine()
    out: dict[str, Any] = {
        "type": device.type,
        "name": info["cpu"] if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": info["commit"],
        "date": info["date"],
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["total_memory_bytes"] = props.total_memory
        out["capability"] = f"{props.major}.{props.minor}"
        out["cudnn"] = torch.backends.cudnn.version()
    return out


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("diffusers", "transformers", "peft", "vllm-omni"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: the same code path"
    )
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    parser.add_argument(
        "--workdir", type=Path, help="scratch folder (default: a temporary one, removed after)"
    )
    args = parser.parse_args(argv)

    def log(text: str) -> None:
        print(f"gpu-check: {text}", file=sys.stderr, flush=True)

    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())

    started = time.perf_counter()
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="flowgrpo-gpu-check-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result: dict[str, Any] = {
            "check": "smoke (CPU, tiny shapes)" if args.smoke else "SD3.5-Medium-sized, one GPU",
            "device": _device_info(device),
            "versions": _versions(),
        }
        result.update(run_check(workdir, smoke=args.smoke, device=device, log=log))
        log("vllm-omni engine")
        vllm_started = time.perf_counter()
        result["vllm_omni"] = vllm_omni_check(workdir, smoke=args.smoke, device=device)
        result["wall_seconds"]["vllm_omni_s"] = time.perf_counter() - vllm_started
        result["wall_seconds"]["total_s"] = time.perf_counter() - started
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(result, indent=2, default=_json_default, allow_nan=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


if __name__ == "__main__":
    sys.exit(main())
