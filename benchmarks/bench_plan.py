"""8. `flowgrpo plan`'s peak memory against the measured one, on a model whose weights weigh.

The model: SD3.5-Medium's transformer at its real widths (1536 wide, 24 heads of 64, RMS-normed
queries and keys, dual-attention blocks) with 4 of its 24 blocks and a smaller position
embedding table, random weights, saved as a diffusers pipeline folder with the tiny text
encoders and VAE (`flowgrpo tiny-model`'s): about 0.27B parameters, 1.1 GB in float32. A run of
it at 128 px (LoRA r 32, CFG 4.5, micro-batches of 2 without gradient checkpointing, so the
activations weigh too) is rolled out, scored and updated in a fresh process
(benchmarks.plan_child), which measures each stage's peak resident set above its baseline;
the ratio is the plan's prediction over that measurement, for the rollout and the update.
About a minute on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import REPO, Context, Report, Row, child_env, fmt_mb, fmt_ratio, make_run

LOW, HIGH = 0.85, 1.15
OVERRIDES = (
    "model.height=128",
    "model.width=128",
    "model.max_sequence_length=32",
    "sampler.num_steps=3",
    "sampler.guidance_scale=4.5",
    "sampler.batch_size=4",
    "algorithm.group_size=2",
    "algorithm.prompts_per_iteration=2",
    "algorithm.beta=0.04",
    "train.micro_batch_size=2",
    "train.steps_per_epoch=2",
    "train.gradient_checkpointing=false",
    "reward.weights={jpeg_compressibility = 1.0}",
    "log.trackers=[]",
)


# --smoke: 2 blocks (1 dual-attention) 4 heads wide, at 64 px: the same code in seconds.
SMOKE_OVERRIDES = ("model.height=64", "model.width=64")


def build_model(folder, smoke: bool = False):
    """SD3.5-Medium's block widths, 4 blocks (2 dual-attention), tiny encoders and VAE (smoke:
    2 blocks of 4 heads)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    from flowgrpo_cli.models import tiny

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2 if smoke else 4,
            attention_head_dim=64,
            num_attention_heads=4 if smoke else 24,
            joint_attention_dim=64,
            caption_projection_dim=64 * (4 if smoke else 24),
            pooled_projection_dim=64,
            pos_embed_max_size=96,
            dual_attention_layers=(0,) if smoke else (0, 1),
            qk_norm="rms_norm",
        )
        pipeline = StableDiffusion3Pipeline(
            transformer=transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            vae=tiny._autoencoder_kl(scaling_factor=1.5305, shift_factor=0.0609),
            text_encoder=CLIPTextModelWithProjection(tiny._clip_config()),
            tokenizer=tiny.char_clip_tokenizer(),
            text_encoder_2=CLIPTextModelWithProjection(tiny._clip_config()),
            tokenizer_2=tiny.char_clip_tokenizer(),
            text_encoder_3=tiny._t5_encoder(),
            tokenizer_3=tiny.char_t5_tokenizer(),
        )
    pipeline.save_pretrained(folder, safe_serialization=True)
    return folder


def run(ctx: Context, report: Report, shared: dict) -> None:
    model = build_model(ctx.workdir / "plan-sd35m-4-blocks", smoke=ctx.smoke)
    overrides = (*OVERRIDES, *SMOKE_OVERRIDES) if ctx.smoke else OVERRIDES
    _, run_dir = make_run(ctx.workdir / "plan-run", model, *overrides)
    env = child_env()
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave the resident set
    env["MALLOC_ARENA_MAX"] = "2"
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.plan_child", str(run_dir.root)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if child.returncode:
        raise RuntimeError(f"plan child failed:\n{child.stderr[-3000:]}")
    print(child.stderr.strip()[-400:], flush=True)  # the stages' times
    result = json.loads(child.stdout.strip().splitlines()[-1])
    shared["plan"] = result
    for stage in ("rollout", "update"):
        predicted, measured = result["predicted"][stage], result["measured"][stage]
        ratio = predicted / measured
        report.rows.append(
            Row(
                f"8{'a' if stage == 'rollout' else 'b'}. plan vs measured peak memory, {stage}",
                fmt_mb(predicted),
                fmt_mb(measured),
                fmt_ratio(ratio),
                f"{LOW:.2f}-{HIGH:.2f}x",
                "yes" if LOW <= ratio <= HIGH else f"no ({ratio:.2f}x)",
                ("--smoke size: 2 blocks of 4 heads, 64 px; " if ctx.smoke else "")
                + "SD3.5-M-wide transformer, 4 blocks, 0.27B params, float32 CPU, 128 px, LoRA "
                "r 32, CFG, micro-batch 2, no checkpointing: `flowgrpo plan` (A) vs the peak "
                "resident set above the baseline in a fresh process (B, benchmarks.plan_child)",
            )
        )
