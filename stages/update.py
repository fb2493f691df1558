"""`flowgrpo update`: rollout + scores -> advantages, a clipped policy-gradient step, a checkpoint.

Reads the iteration's rewards (small columns only), computes group-relative advantages over
the whole iteration, then trains: inner epochs over shuffled samples, each epoch split into
`train.steps_per_epoch` optimizer steps; every optimizer step accumulates gradients over the
trained denoising steps of its samples, streamed micro-batch by micro-batch from the
memory-mapped rollout parts. Each rank takes every world_size-th sample of an optimizer batch;
a rank with fewer samples runs zero-weighted micro-batches so FSDP's collectives stay aligned.

Write order, for crash safety: checkpoint files, then advantages.arrow, metrics.json and the
update manifest, then the checkpoint's manifest, which is what marks the iteration done.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from flowgrpo_cli.algorithm.advantages import compute_advantages, data_metrics
from flowgrpo_cli.algorithm.grpo_guard import normalized_log_ratio, step_weight
from flowgrpo_cli.algorithm.loss import LossMetrics, kl_std, policy_loss
from flowgrpo_cli.algorithm.registry import spec
from flowgrpo_cli.algorithm.sde import STEP_FUNCTIONS, StepOutput
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import barrier, dist_info
from flowgrpo_cli.launch.stage import Finished, StageResult, run_stage, verify_inputs
from flowgrpo_cli.models import Conditioning, ModelAdapter
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.store.config import STAGE_SECTIONS, Config, config_hash
from flowgrpo_cli.store.contract import RolloutManifest, ScoreManifest
from flowgrpo_cli.store.rundir import (
    CHECKPOINT,
    MANIFEST,
    ROLLOUT,
    SCORE,
    UPDATE,
    RunDir,
    StageWriter,
    manifest_hash,
    read_manifest,
    read_metrics,
    require_manifest,
)
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.store.trajectory import (
    TrajectoryRows,
    from_record_batch,
    open_part,
    read_conditioning,
    read_table,
    write_table,
)
from flowgrpo_cli.training import forward_process
from flowgrpo_cli.training.policy import checkpoint_version
from flowgrpo_cli.training.trainer import Trainer

ADVANTAGES = "advantages.arrow"


@dataclass(frozen=True)
class IterationData:
    """The iteration's samples that are trained on, with their advantages (all ranks).

    Under algorithm.drop_zero_advantage (the default, as in the reference) samples whose
    advantage is exactly 0 (flat groups, groups of one) are left out before the optimizer
    batches are formed: the policy-gradient mean is then over samples that carry signal, and
    they add no KL gradient either. advantages.arrow still lists every scored sample.
    """

    rollout: RolloutManifest
    sample_ids: list[str]
    group_ids: torch.Tensor  # [N] int64
    advantages: torch.Tensor  # [N] float32
    locations: list[tuple[int, int, int]]  # per sample: (part, record batch, row)
    metrics: dict[str, float]
    table: pa.Table  # sample_id, group_id, reward, advantage: written as advantages.arrow


def load_iteration(
    config: Config, run: RunDir, iteration: int, policy_version: str
) -> IterationData:
    """The iteration's samples and advantages; `policy_version` is the one rollout must have
    sampled with (the trainer's sampling_version())."""
    rollout_dir, scores_dir = run.stage_dir(iteration, ROLLOUT), run.stage_dir(iteration, SCORE)
    rollout = RolloutManifest.read(rollout_dir)
    scores = ScoreManifest.read(scores_dir)
    if rollout.identity["config"] != config_hash(config, STAGE_SECTIONS[ROLLOUT.name]):
        raise FlowGrpoError(
            f"{rollout_dir} was sampled with another config or model than this update's; "
            "delete that iteration folder to redo it"
        )
    if rollout.policy_version != policy_version:
        raise FlowGrpoError(
            f"{rollout_dir} was sampled with policy {rollout.policy_version}, but this update "
            f"expects samples of {policy_version}: the rollout is stale; delete it and roll "
            "out again"
        )
    parts = [rollout_dir / name for name in rollout.trajectory_parts]
    samples = read_table(parts, ["sample_id", "group_id"])
    score_columns = ["sample_id", "reward", *scores.rewards]
    score_table = read_table([scores_dir / name for name in scores.parts], score_columns)
    for name in score_columns[1:]:  # a part re-hashed to match but not what score wrote
        kind = score_table.schema.field(name).type
        if not (pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_null(kind)):
            raise FlowGrpoError(
                f"{scores_dir}: column `{name}` holds {kind}, not numbers; delete {scores_dir} "
                f"and re-run `flowgrpo score --iteration {iteration}`"
            )
    by_id = {sid: i for i, sid in enumerate(score_table.column("sample_id").to_pylist())}
    sample_ids = samples.column("sample_id").to_pylist()
    missing = [sid for sid in sample_ids if sid not in by_id]
    if missing:
        raise FlowGrpoError(
            f"{scores_dir} has no score for {len(missing)} sample(s) of the rollout (first: "
            f"{missing[:3]}); re-run `flowgrpo score --iteration {iteration}`"
        )
    order = [by_id[sid] for sid in sample_ids]
    rewards = np.array(score_table.column("reward").to_numpy(zero_copy_only=False), dtype=float)
    rewards = rewards[order]
    kept = ~np.isnan(rewards)  # the score stage leaves dropped samples without a reward
    if not kept.any():
        raise FlowGrpoError(f"{scores_dir}: every sample was dropped; nothing to train on")
    group_ids = torch.tensor(samples.column("group_id").to_pylist())[kept]
    total = torch.from_numpy(rewards[kept])
    advantages = compute_advantages(
        total, group_ids, std_mode=config.algorithm.advantage_std,
        clip=config.algorithm.advantage_clip,
    )  # fmt: skip
    per_reward = {
        name: torch.from_numpy(
            np.array(score_table.column(name).to_numpy(zero_copy_only=False), float)[order]
        )[kept]
        for name in scores.rewards
    }
    metrics = data_metrics(
        per_reward, total, group_ids, advantages, clip=config.algorithm.advantage_clip
    )
    metrics["reward/dropped_samples"] = float((~kept).sum())
    kept_ids = [sid for sid, k in zip(sample_ids, kept, strict=True) if k]
    table = pa.table({
        "sample_id": pa.array(kept_ids, pa.string()),
        "group_id": pa.array(group_ids.tolist(), pa.int64()),
        "reward": pa.array(total.tolist(), pa.float64()),
        "advantage": pa.array(advantages.tolist(), pa.float32()),
    })  # fmt: skip
    trained = (
        advantages != 0
        if config.algorithm.drop_zero_advantage
        else torch.ones_like(advantages, dtype=torch.bool)
    )
    trained_ids = [sid for sid, t in zip(kept_ids, trained.tolist(), strict=True) if t]
    metrics["update/samples_trained"] = float(len(trained_ids))
    return IterationData(
        rollout, trained_ids, group_ids[trained], advantages[trained],
        _locate(parts, set(trained_ids)), metrics, table,
    )  # fmt: skip


def _locate(parts, wanted: set[str]) -> list[tuple[int, int, int]]:
    """(part, record batch, row) of every wanted sample, in part order."""
    out = []
    for p, path in enumerate(parts):
        reader = open_part(path)
        for b in range(reader.num_record_batches):
            ids = reader.get_batch(b).column("sample_id").to_pylist()
            out.extend((p, b, r) for r, sid in enumerate(ids) if sid in wanted)
    return out


class StoredSamples:
    """The samples an update trains on, read micro-batch by micro-batch from the memory-mapped
    rollout parts, with the text conditioning rollout stored once per group."""

    def __init__(self, rollout_dir: Path, data: IterationData):
        rollout = data.rollout
        self.folder = rollout_dir
        self.readers = [open_part(rollout_dir / name) for name in rollout.trajectory_parts]
        self.conditioning = read_conditioning(
            [rollout_dir / name for name in rollout.conditioning_parts]
        )
        self.locations = data.locations

    def rows(self, indices: list[int]) -> TrajectoryRows:
        """The rows of `indices`, in that order."""
        by_batch: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for position, index in enumerate(indices):
            part, batch, row = self.locations[index]
            by_batch[(part, batch)].append((position, row))
        pieces, positions = [], []
        for (part, batch), entries in by_batch.items():
            record = self.readers[part].get_batch(batch)
            pieces.append(record.take(pa.array([row for _, row in entries])))
            positions.extend(position for position, _ in entries)
        merged = pa.Table.from_batches(pieces).combine_chunks()
        # Grouping by record batch reordered the rows; put them back in the order asked for.
        in_order = merged.take(pa.array(np.argsort(positions)))
        return from_record_batch(in_order.to_batches()[0])

    def conditioning_of(self, rows: TrajectoryRows, device: torch.device) -> Conditioning:
        return Conditioning.cat(
            [
                Conditioning({k: v.unsqueeze(0) for k, v in self.conditioning[g].items()})
                for g in rows.group_ids
            ]
        ).to(device)


def stored_step(
    adapter: ModelAdapter,
    rollout: RolloutManifest,
    rows: TrajectoryRows,
    position: int,
    cond: Conditioning,
    device: torch.device,
) -> StepOutput:
    """Trajectory step `position` of `rows` recomputed under the adapter's current weights:
    the velocity, then the step rollout took, scoring the stored next latent (log-prob, mean).

    The one velocity-plus-step of the update: its policy pass, its reference pass (called
    inside the trainer's reference context) and the old-log-prob recompute all come here, with
    the sampler settings and sigmas the rollout manifest recorded.
    """
    sampler = rollout.sampler
    x = rows.latents[:, position].to(device)  # [B, ...]
    sigma = rows.timesteps[:, position].to(device)  # [B]
    v = adapter.velocity(x, sigma, cond, guidance_scale=sampler.guidance_scale)
    return STEP_FUNCTIONS[sampler.kind](
        x,
        v,
        sigma,
        rows.timesteps_next[:, position].to(device),
        noise_level=sampler.noise_level,
        sigma_max_substitute=rollout.sigma_max_substitute,
        next_latents=rows.latents[:, position + 1].to(device),
    )


def optimizer_batches(
    num_samples: int, config: Config, iteration: int, epoch: int
) -> list[list[int]]:
    """The epoch's shuffled sample indices, split evenly into `steps_per_epoch` batches (fewer
    when there are fewer samples; none without samples)."""
    if num_samples == 0:
        return []
    order = list(range(num_samples))
    random.Random(derive_seed(config.run.seed, iteration, "epoch", epoch)).shuffle(order)
    steps = min(config.train.steps_per_epoch, num_samples)
    return [list(chunk) for chunk in np.array_split(order, steps)]


def run(
    config: Config, run: RunDir, iteration: int, trainer: Trainer, progress: Progress | None = None
) -> StageResult:
    progress = progress or NullProgress()
    info = dist_info()
    rollout_dir, scores_dir = run.stage_dir(iteration, ROLLOUT), run.stage_dir(iteration, SCORE)
    update_dir, checkpoint_dir = run.stage_dir(iteration, UPDATE), run.checkpoint_dir(iteration)
    if read_manifest(checkpoint_dir) is not None and read_manifest(update_dir) is not None:
        return StageResult(read_manifest(update_dir), read_metrics(update_dir), fresh=False)
    if config.algorithm.train_cfg and spec(config.algorithm.name).needs_trajectory:
        raise FlowGrpoError(
            f"algorithm.train_cfg is for nft and awm; {config.algorithm.name} already trains "
            "the sampler's own steps, guidance included: leave it false"
        )
    policy = trainer.policy
    if "pruned" in require_manifest(rollout_dir, ROLLOUT.command):
        raise FlowGrpoError(
            f"{rollout_dir}: its trajectory latents were deleted after its update finished "
            "(run.keep_trajectories), so this update cannot be redone alone; delete "
            f"{rollout_dir.parent} to redo the whole iteration"
        )
    require_manifest(scores_dir, SCORE.command)
    identity = {
        "config": config_hash(config, STAGE_SECTIONS[UPDATE.name]),
        "rollout": manifest_hash(rollout_dir),
        "scores": manifest_hash(scores_dir),
        "policy": policy.version,
    }
    if info.is_main:
        (update_dir / MANIFEST).unlink(missing_ok=True)  # the checkpoint is not done: redo
    writer = StageWriter(update_dir, UPDATE.name, identity)
    loaded: list[IterationData] = []
    saved: list[str] = []

    def train() -> dict[str, float]:
        verify_inputs(rollout_dir, scores_dir)
        data = load_iteration(config, run, iteration, trainer.sampling_version())
        loaded.append(data)
        started = time.perf_counter()
        metrics = _train(config, iteration, trainer, data, StoredSamples(rollout_dir, data),
                         progress)  # fmt: skip
        if trainer.anchor is not None:  # after the iteration's steps, as the references do
            metrics["update/anchor_decay"] = trainer.update_anchor()
        seconds = time.perf_counter() - started
        trainer.state.iteration = iteration
        trainer.state.config_hash = identity["config"]
        saved.extend(trainer.save(checkpoint_dir))  # every rank gathers; rank 0 writes
        return {
            **data.metrics,
            **metrics,
            "update/seconds": seconds,
            "update/samples_per_s": len(data.sample_ids) * config.train.inner_epochs / seconds,
        }

    def finish(metrics: dict[str, float]) -> Finished:
        data = loaded[0]
        write_table(writer.part_path(ADVANTAGES), data.table)
        return Finished(
            metrics=metrics,
            parts=[ADVANTAGES],
            counts={"samples": len(data.sample_ids),
                    "optimizer_steps": trainer.state.optimizer_steps},
            extra={"checkpoint": str(checkpoint_dir.relative_to(run.root))},
        )  # fmt: skip

    result = run_stage(writer, train, finish)
    if info.is_main:  # written last: the checkpoint's manifest marks the iteration done
        StageWriter(checkpoint_dir, CHECKPOINT.name, identity).finish(
            saved, counts={"iteration": iteration}
        )
    barrier()
    policy.version = checkpoint_version(checkpoint_dir, policy.mode)
    trainer.track_saved_anchor(checkpoint_dir)
    return result


def _train(
    config: Config,
    iteration: int,
    trainer: Trainer,
    data: IterationData,
    samples: StoredSamples,
    progress: Progress,
) -> dict[str, float]:
    plan = _plan(len(data.sample_ids), config, iteration)
    # Fewer samples than steps_per_epoch (most often: the rest had advantage 0 and were
    # dropped) means fewer optimizer steps; none at all when every sample was dropped.
    skipped = config.train.inner_epochs * config.train.steps_per_epoch - len(plan)
    if not plan:
        return {
            "update/optimizer_steps": 0.0,
            "update/optimizer_steps_skipped": float(skipped),
            "update/lr": trainer.learning_rate(),
        }
    progress.start(
        f"update iter {iteration}", total=sum(len(m) for *_, m in plan), unit="micro-batches"
    )
    algorithm = spec(config.algorithm.name)
    policy_gradient = algorithm.needs_trajectory
    old_log_probs = (
        _recompute_old_logprobs(config, trainer, data, samples)
        if policy_gradient and config.algorithm.recompute_old_logprobs
        else None
    )
    losses = LossMetrics(algorithm.folds)
    step_metrics: list[dict[str, float]] = []
    gap: torch.Tensor | None = None
    trainer.policy.transformer.train()
    for epoch, batch_size, micro_batches in plan:
        for indices in micro_batches:
            if policy_gradient:
                micro_gap = _backward_micro_batch(
                    config, trainer, data, samples, indices, batch_size, old_log_probs, losses
                )
                if gap is None:  # the first micro-batch, before any optimizer step
                    gap = micro_gap
            else:
                _backward_forward_process(
                    config, iteration, epoch, trainer, data, samples, indices, batch_size, losses
                )
            progress.advance(1)
        step_metrics.append(trainer.step())
    progress.finish()
    trainer.policy.transformer.eval()
    losses.all_reduce()
    metrics = losses.summary()
    if policy_gradient:
        # The KL's name says which divisor it has (the two differ by 1/|dt| for the SDE).
        metrics[f"update/kl_{config.algorithm.kl_convention}"] = metrics.pop("update/kl")
        metrics["update/logprob_gap_max"] = float(gap.max())
        metrics["update/logprob_gap_mean"] = float(gap.mean())
    else:  # a mean squared velocity difference, not a divergence of step distributions
        metrics["update/kl_velocity"] = metrics.pop("update/kl")
    metrics.update({
        "update/grad_norm": float(np.mean([m["grad_norm"] for m in step_metrics])),
        "update/grad_norm_max": float(np.max([m["grad_norm"] for m in step_metrics])),
        "update/lr": step_metrics[-1]["lr"],
        "update/optimizer_steps": float(len(step_metrics)),
        "update/optimizer_steps_skipped": float(skipped),
    })  # fmt: skip
    return metrics


def _backward_forward_process(
    config: Config,
    iteration: int,
    epoch: int,
    trainer: Trainer,
    data: IterationData,
    samples: StoredSamples,
    indices: list[int],
    batch_size: int,
    losses: LossMetrics,
) -> None:
    """nft / awm: one micro-batch, weighted as _backward_micro_batch weights its samples."""
    policy = trainer.policy
    real = bool(indices)
    indices = indices or [0]  # a zero-weighted stand-in keeps collectives aligned
    rows = samples.rows(indices)
    forward_process.backward_micro_batch(
        config, trainer, data.rollout, rows, samples.conditioning_of(rows, policy.device),
        data.advantages[indices].to(policy.device), iteration=iteration, epoch=epoch,
        weight=len(indices) * dist_info().world_size / batch_size if real else 0.0,
        losses=losses if real else None,
    )  # fmt: skip


def _backward_micro_batch(
    config: Config,
    trainer: Trainer,
    data: IterationData,
    samples: StoredSamples,
    indices: list[int],
    batch_size: int,
    old_log_probs: dict[tuple[int, int], torch.Tensor] | None,
    losses: LossMetrics,
) -> torch.Tensor:
    """Accumulate the gradient of one micro-batch's loss over its trained steps, weighted so
    that an optimizer step's gradient is the mean over its samples and steps (over every
    rank). Returns |new - stored log-prob| of its steps: the on-policy gap before a step."""
    policy, beta = trainer.policy, config.algorithm.beta
    guard = config.algorithm.name == "grpo_guard"
    world = dist_info().world_size
    real = bool(indices)
    indices = indices or [0]  # a zero-weighted stand-in keeps collectives aligned
    rows = samples.rows(indices)
    positions = torch.nonzero(rows.trained[0]).flatten().tolist()
    if not positions:
        raise FlowGrpoError(f"{samples.folder}: no trained step in the stored trajectories")
    cond = samples.conditioning_of(rows, policy.device)
    advantages = data.advantages[indices].to(policy.device)
    weight = (len(indices) * world / (batch_size * len(positions))) if real else 0.0
    gaps = []
    for position in positions:
        old_mean = None
        if guard:  # the sampling weights' mean; before the graph of the trained forward exists
            with torch.no_grad(), trainer.anchor_weights():
                old_step = stored_step(
                    policy.adapter, data.rollout, rows, position, cond, policy.device
                )
                old_mean = old_step.mean
        out = stored_step(policy.adapter, data.rollout, rows, position, cond, policy.device)
        stored = rows.log_probs[:, position].to(policy.device)
        old = stored
        if old_log_probs is not None:
            old = torch.stack([old_log_probs[(i, position)] for i in indices]).to(policy.device)
        gaps.append((out.log_prob.detach() - stored).abs())
        ref_mean = None
        if beta > 0:
            with torch.no_grad(), trainer.reference_context():
                ref = stored_step(policy.adapter, data.rollout, rows, position, cond, policy.device)
                ref_mean = ref.mean
        result = policy_loss(
            out.log_prob,
            old,
            advantages,
            clip_range=config.algorithm.clip_range,
            beta=beta,
            mean=out.mean if beta > 0 else None,
            ref_mean=ref_mean,
            std=kl_std(out, config.algorithm.kl_convention) if beta > 0 else None,
            clipped_log_ratio=(
                normalized_log_ratio(out.log_prob, old, out.mean, old_mean, out.std)
                if guard
                else None
            ),
            pg_scale=(
                step_weight(rows.timesteps[:, position], rows.timesteps_next[:, position])
                if guard
                else 1.0
            ),
        )
        (result.loss * weight).backward()
        if real:
            losses.add(result)
    return torch.cat(gaps)


@torch.no_grad()
def _recompute_old_logprobs(
    config: Config, trainer: Trainer, data: IterationData, samples: StoredSamples
) -> dict[tuple[int, int], torch.Tensor]:
    """Old log-probs under the current weights, before any step: (sample, step) -> logp.

    Every rank computes them for every sample: the same forwards on every rank keep FSDP's
    collectives aligned, and the result is small.
    """
    policy = trainer.policy
    out: dict[tuple[int, int], torch.Tensor] = {}
    micro = config.train.micro_batch_size
    for start in range(0, len(data.sample_ids), micro):
        indices = list(range(start, min(start + micro, len(data.sample_ids))))
        rows = samples.rows(indices)
        cond = samples.conditioning_of(rows, policy.device)
        for position in torch.nonzero(rows.trained[0]).flatten().tolist():
            step = stored_step(policy.adapter, data.rollout, rows, position, cond, policy.device)
            for i, index in enumerate(indices):
                out[(index, position)] = step.log_prob[i].cpu()
    return out


def _plan(
    num_samples: int, config: Config, iteration: int
) -> list[tuple[int, int, list[list[int]]]]:
    """Per optimizer step: (its epoch, its batch size, this rank's micro-batches of sample
    indices).

    Each rank takes every world_size-th sample of a batch; every rank runs the same number of
    micro-batches (some may be empty: zero-weighted stand-ins keep collectives aligned).
    """
    info = dist_info()
    micro = config.train.micro_batch_size
    plan = []
    for epoch in range(config.train.inner_epochs):
        for batch in optimizer_batches(num_samples, config, iteration, epoch):
            share = batch[info.rank :: info.world_size]
            count = math.ceil(math.ceil(len(batch) / info.world_size) / micro)
            micro_batches = [share[m * micro : (m + 1) * micro] for m in range(count)]
            plan.append((epoch, len(batch), micro_batches))
    return plan
