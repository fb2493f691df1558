"""2. The update stage against the bare LoRA forward + backward of the same micro-batches.

A: `stages.update.run` for iteration 0 of the shared tiny run (the rollout benchmark's 32
   images, scored by jpeg_compressibility), its update folder and checkpoint removed and the
   policy's version reset before each call. Everything the stage does is timed: reading the
   scores, advantages, streaming rows from the memory-mapped parts, the loss, the optimizer
   steps, the checkpoint and the manifests.
B: the same policy (one `load_policy`), the rows read into memory once beforehand, the same
   optimizer batches and micro-batches (`update.optimizer_batches`); per micro-batch and
   trained step: `adapter.velocity` with grad, a trivial loss, backward, and with beta > 0 a
   no-grad velocity with the adapter disabled; an AdamW step after each optimizer batch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from benchmarks.common import (
    Context,
    Report,
    Row,
    Section,
    SectionTimers,
    Side,
    alternate,
    breakdown_rows,
    fmt_s,
    goal_both,
    largest_gaps,
    remove,
    timer_overhead,
    total_calls,
)
from flowgrpo_cli.store.rundir import ROLLOUT, UPDATE

GOAL = 1.15

ORDER = [
    "verify rollout and score parts (XXH3)",
    "load scores, advantages, locate rows",
    "read conditioning part",
    "read micro-batch rows (mmap, take, copy)",
    "conditioning cat per micro-batch",
    "transformer forward, policy (grad)",
    "transformer forward, reference (no grad)",
    "velocity: CFG batching + guidance",
    "SDE log-prob, policy",
    "SDE log-prob, reference",
    "policy loss (ratio, clip, KL)",
    "backward",
    "adapter disable / enable",
    "loss metrics",
    "grad-norm clip + checks (Trainer.step)",
    "AdamW step",
    "checkpoint save (LoRA + optimizer state)",
    "policy version (sha256 of the checkpoint)",
    "stage folder, advantages, metrics, manifests (sha256)",
    "training loop glue",
]


@dataclass(frozen=True)
class MicroBatch:
    latents: torch.Tensor  # [b, T+1, C, h, w]
    timesteps: torch.Tensor  # [b, T]
    cond: object  # Conditioning of the b rows


class BareLoop:
    """LoRA forward + backward (+ reference forward) on rows held in memory."""

    def __init__(self, config, run_dir, policy):
        from flowgrpo_cli.models import Conditioning
        from flowgrpo_cli.stages.update import optimizer_batches
        from flowgrpo_cli.store.rundir import read_manifest
        from flowgrpo_cli.store.trajectory import from_record_batch, read_conditioning, read_table

        folder = run_dir.stage_dir(0, ROLLOUT)
        manifest = read_manifest(folder)
        table = read_table([folder / p for p in manifest["trajectory_parts"]])
        rows = from_record_batch(table.combine_chunks().to_batches()[0])
        stored = read_conditioning([folder / p for p in manifest["conditioning_parts"]])
        self.positions = torch.nonzero(rows.trained[0]).flatten().tolist()
        micro = config.train.micro_batch_size
        self.plan: list[list[MicroBatch]] = []
        for epoch in range(config.train.inner_epochs):
            for batch in optimizer_batches(len(rows.sample_ids), config, 0, epoch):
                chunks = [batch[m : m + micro] for m in range(0, len(batch), micro)]
                self.plan.append(
                    [
                        MicroBatch(
                            latents=rows.latents[chunk],
                            timesteps=rows.timesteps[chunk],
                            cond=Conditioning.cat(
                                [
                                    Conditioning({k: v.unsqueeze(0) for k, v in stored[g].items()})
                                    for g in (rows.group_ids[i] for i in chunk)
                                ]
                            ),
                        )
                        for chunk in chunks
                    ]
                )
        self.policy = policy
        self.beta = config.algorithm.beta
        self.guidance = config.sampler.guidance_scale
        self.optimizer = torch.optim.AdamW(
            policy.trainable_parameters(),
            lr=config.train.lr,
            weight_decay=config.train.weight_decay,
        )

    @property
    def forwards(self) -> int:
        return sum(len(m) for m in self.plan) * len(self.positions)

    def run(self) -> None:
        adapter, transformer = self.policy.adapter, self.policy.transformer
        transformer.train()
        for micro_batches in self.plan:
            for mb in micro_batches:
                for position in self.positions:
                    x, sigma = mb.latents[:, position], mb.timesteps[:, position]
                    v = adapter.velocity(x, sigma, mb.cond, guidance_scale=self.guidance)
                    if self.beta > 0:
                        with torch.no_grad(), self.policy.adapters_disabled():
                            adapter.velocity(x, sigma, mb.cond, guidance_scale=self.guidance)
                    v.square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        transformer.eval()


def run(ctx: Context, report: Report, shared: dict) -> None:
    from flowgrpo_cli.stages import score, update
    from flowgrpo_cli.training.trainer import Trainer

    config, run_dir, policy = shared["config"], shared["run"], shared["policy"]
    score.run(config, run_dir, 0)
    trainer = Trainer(config, policy)
    bare = BareLoop(config, run_dir, policy)

    def clear() -> None:
        remove(run_dir.stage_dir(0, UPDATE))
        remove(run_dir.checkpoint_dir(0))
        policy.version = "base"  # what the rollout was sampled with

    sides = {
        "update": Side(lambda: update.run(config, run_dir, 0, trainer), reset=clear),
        "bare": Side(bare.run),
    }
    timings = alternate(sides, ctx.reps, profile=_profiled)

    profiles = timings.profiles
    gap = ", ".join(
        f"{k} +{v:.2f} s" for k, v in largest_gaps(profiles["update"], profiles["bare"])
    )
    micro_batches = sum(len(m) for m in bare.plan)
    report.rows.append(
        Row(
            "2. update stage vs bare LoRA forward + backward",
            fmt_s(timings.median("update")),
            fmt_s(timings.median("bare")),
            timings.ratio_text("update", "bare"),
            f"<= {GOAL:.2f}x",
            goal_both(timings, "update", "bare", GOAL),
            f"{len(bare.positions)} trained steps x {micro_batches} micro-batches of "
            f"{config.train.micro_batch_size} = {bare.forwards} forward+backward, "
            f"{len(bare.plan)} optimizer steps, beta {config.algorithm.beta} (+ as many "
            f"reference forwards); A {timings.spread('update')}, B {timings.spread('bare')} "
            f"over {ctx.reps} rounds. Largest gaps (medians): {gap}",
        )
    )
    _toggle(ctx, report, policy, timings)
    header, rows = breakdown_rows(
        timings,
        [
            ("update stage", "update"),
            ("bare loop", "bare"),
        ],
        ORDER,
    )
    report.sections.append(
        Section(
            "2. Update: where the time goes (exclusive seconds, median of the timed rounds)",
            header,
            rows,
            "Recorded during the timed rounds (the timers add about "
            f"{timer_overhead() * 1e6:.1f} us to each of the stage's "
            f"{total_calls(profiles['update'])} timed calls). The bare loop's rows are in "
            "memory before it starts; the stage reads them from the memory-mapped parts, and "
            "also computes the loss and its metrics, clips the gradient norm, and writes the "
            "checkpoint, advantages and manifests.",
        )
    )


def _toggle(ctx: Context, report: Report, policy, update_timings) -> None:
    """2b: switching the LoRA adapter off and on around each reference forward (beta > 0),
    diffusers' way against toggling the peft layers directly (what the trainer does)."""
    transformer = policy.transformer
    layers = policy.lora_layers
    pairs = 50

    def diffusers_toggle() -> None:
        for _ in range(pairs):
            transformer.disable_adapters()
            transformer.enable_adapters()

    def peft_toggle() -> None:
        for _ in range(pairs):
            with policy.adapters_disabled():  # what the trainer's reference context does
                pass

    timings = alternate(
        {"diffusers": Side(diffusers_toggle), "peft": Side(peft_toggle)}, reps=ctx.reps
    )
    per_pair = timings.median("diffusers") / pairs
    in_update = statistics.median(
        t.seconds.get("adapter disable / enable", 0.0) for t in update_timings.profiles["update"]
    )
    report.rows.append(
        Row(
            "2b. adapter off/on around a reference forward: diffusers vs direct peft",
            f"{per_pair * 1e3:.1f} ms/pair",
            f"{timings.median('peft') / pairs * 1e3:.1f} ms/pair",
            timings.ratio_text("diffusers", "peft"),
            "-",
            "-",
            f"{len(layers)} LoRA layers, switched once per trained step and micro-batch. "
            "diffusers' disable_adapters / enable_adapters first run check_peft_version "
            "(importlib.metadata parses peft's METADATA) on every call; the trainer toggles "
            "the peft layers it found once (Policy.adapters_disabled). In the update above: "
            f"{in_update:.2f} s of {fmt_s(update_timings.median('update'))}",
        )
    )


def _profiled() -> SectionTimers:
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    import flowgrpo_cli.algorithm.sde as sde
    import flowgrpo_cli.launch.stage as stage_skeleton
    from flowgrpo_cli.algorithm.loss import LossMetrics
    from flowgrpo_cli.models.sd3 import SD3Adapter
    from flowgrpo_cli.stages import update
    from flowgrpo_cli.store.rundir import StageWriter
    from flowgrpo_cli.training import samples
    from flowgrpo_cli.training.algorithms import flow_grpo
    from flowgrpo_cli.training.trainer import Trainer

    def forward_label(*args, **kwargs) -> str:
        grad = torch.is_grad_enabled()
        return f"transformer forward, {'policy (grad)' if grad else 'reference (no grad)'}"

    def step_label(*args, **kwargs) -> str:
        return f"SDE log-prob, {'policy' if torch.is_grad_enabled() else 'reference'}"

    files = "stage folder, advantages, metrics, manifests (sha256)"
    timers = SectionTimers()
    for owner, name, label in (
        (update, "load_iteration", "load scores, advantages, locate rows"),
        (samples, "read_conditioning", "read conditioning part"),
        (samples.StoredSamples, "rows", "read micro-batch rows (mmap, take, copy)"),
        (samples.StoredSamples, "conditioning_of", "conditioning cat per micro-batch"),
        (SD3Transformer2DModel, "forward", forward_label),
        (SD3Adapter, "velocity", "velocity: CFG batching + guidance"),
        (flow_grpo, "policy_loss", "policy loss (ratio, clip, KL)"),
        (torch.Tensor, "backward", "backward"),
        (BaseTunerLayer, "enable_adapters", "adapter disable / enable"),
        (LossMetrics, "add", "loss metrics"),
        (Trainer, "step", "grad-norm clip + checks (Trainer.step)"),
        (torch.optim.AdamW, "step", "AdamW step"),
        (Trainer, "save", "checkpoint save (LoRA + optimizer state)"),
        (StageWriter, "begin", files),
        (StageWriter, "finish", files),
        (update, "write_table", files),
        (stage_skeleton, "atomic_write_json", files),
        (update, "verify_inputs", "verify rollout and score parts (XXH3)"),
        (update, "checkpoint_version", "policy version (sha256 of the checkpoint)"),
        (update, "_train", "training loop glue"),
    ):
        timers.patch(owner, name, label)
    timers.patch_item(sde.STEP_FUNCTIONS, "sde", step_label)
    return timers
