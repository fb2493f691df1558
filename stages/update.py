"""`flowgrpo update`: rollout + scores -> advantages, the algorithm's optimizer steps, a checkpoint.

Reads the iteration's rewards (small columns only), computes group-relative advantages over
the whole iteration (of the weighted total, or of each reward first under
algorithm.reward_aggregation = "normalize_each"), then trains: inner epochs over shuffled
samples, each epoch split into `train.steps_per_epoch` optimizer steps; every optimizer step
accumulates the gradients the algorithm's `backward` computes (training/algorithms:
Flow-GRPO's clipped ratio over trained steps, nft's or awm's loss over re-noised latents) on
its samples, streamed micro-batch by micro-batch from the memory-mapped rollout parts. Each
rank takes every world_size-th sample of an optimizer batch; a rank with fewer samples runs
zero-weighted micro-batches so FSDP's collectives stay aligned.

Write order, for crash safety: checkpoint files, then advantages.arrow, metrics.json and the
update manifest, then the checkpoint's manifest, which is what marks the iteration done.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from flowgrpo_cli.algorithm.advantages import compute_advantages, data_metrics, normalize_each
from flowgrpo_cli.algorithm.loss import LossMetrics
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import barrier, dist_info
from flowgrpo_cli.launch.stage import Finished, StageResult, run_stage, verify_inputs
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
    open_part,
    read_table,
    write_table,
)
from flowgrpo_cli.training.algorithms import algorithm_for
from flowgrpo_cli.training.algorithms.base import MicroBatch, UpdateContext
from flowgrpo_cli.training.policy import checkpoint_version
from flowgrpo_cli.training.samples import StoredSamples
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
    per_reward = {
        name: torch.from_numpy(
            np.array(score_table.column(name).to_numpy(zero_copy_only=False), float)[order]
        )[kept]
        for name in scores.rewards
    }
    advantages, metrics = _advantages(config, per_reward, total, group_ids)
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


def _advantages(
    config: Config,
    per_reward: dict[str, torch.Tensor],
    total: torch.Tensor,
    group_ids: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages [N] under algorithm.reward_aggregation, and the iteration's data metrics
    (per_reward, total, group_ids: [N], the kept samples')."""
    section = config.algorithm
    std_mode, clip, ddof = section.advantage_std, section.advantage_clip, section.advantage_std_ddof
    if section.reward_aggregation == "weighted_sum":
        advantages = compute_advantages(total, group_ids, std_mode=std_mode, clip=clip, ddof=ddof)
        return advantages, data_metrics(per_reward, total, group_ids, advantages, clip=clip)
    decoupled = normalize_each(
        per_reward, config.reward.weights, group_ids, std_mode=std_mode, clip=clip, ddof=ddof
    )
    metrics = data_metrics(
        per_reward, total, group_ids, decoupled.advantages, clip=clip,
        per_reward_advantages=decoupled.per_reward,
    )  # fmt: skip
    return decoupled.advantages, metrics


def _locate(parts, wanted: set[str]) -> list[tuple[int, int, int]]:
    """(part, record batch, row) of every wanted sample, in part order."""
    out: list[tuple[int, int, int]] = []
    for p, path in enumerate(parts):
        reader = open_part(path)
        for b in range(reader.num_record_batches):
            ids = reader.get_batch(b).column("sample_id").to_pylist()
            out.extend((p, b, r) for r, sid in enumerate(ids) if sid in wanted)
    return out


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
    if read_manifest(checkpoint_dir) is not None:
        done = read_manifest(update_dir)
        if done is not None:
            return StageResult(done, read_metrics(update_dir), fresh=False)
    algorithm_for(config).check()
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
        samples = StoredSamples(rollout_dir, data.rollout, data.locations)
        metrics = _train(config, iteration, trainer, data, samples, progress)
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
    context = UpdateContext(config, iteration, trainer, data.rollout, samples,
                            len(data.sample_ids))  # fmt: skip
    algorithm = algorithm_for(config)
    algorithm.begin_update(context)
    losses = LossMetrics(algorithm.folds)
    step_metrics: list[dict[str, float]] = []
    trainer.policy.transformer.train()
    for epoch, batch_size, micro_batches in plan:
        for indices in micro_batches:
            batch = _micro_batch(trainer, data, samples, indices, batch_size, epoch)
            algorithm.backward(context, batch, losses if batch.real else None)
            progress.advance(1)
        step_metrics.append(trainer.step())
    progress.finish()
    trainer.policy.transformer.eval()
    losses.all_reduce()
    metrics = algorithm.update_metrics(context, losses.summary())
    metrics.update({
        "update/grad_norm": float(np.mean([m["grad_norm"] for m in step_metrics])),
        "update/grad_norm_max": float(np.max([m["grad_norm"] for m in step_metrics])),
        "update/lr": step_metrics[-1]["lr"],
        "update/optimizer_steps": float(len(step_metrics)),
        "update/optimizer_steps_skipped": float(skipped),
    })  # fmt: skip
    return metrics


def _micro_batch(
    trainer: Trainer,
    data: IterationData,
    samples: StoredSamples,
    indices: list[int],
    batch_size: int,
    epoch: int,
) -> MicroBatch:
    """This rank's samples `indices` of an optimizer step of `batch_size`, read from the
    rollout parts; none: a zero-weighted stand-in that keeps collectives aligned."""
    device = trainer.policy.device
    real = bool(indices)
    indices = indices or [0]
    rows = samples.rows(indices)
    return MicroBatch(
        indices=indices,
        rows=rows,
        cond=samples.conditioning_of(rows, device),
        advantages=data.advantages[indices].to(device),
        batch_size=batch_size,
        world_size=dist_info().world_size,
        epoch=epoch,
        real=real,
    )


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
