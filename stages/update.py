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
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from flowgrpo_cli.algorithm.advantages import compute_advantages, data_metrics
from flowgrpo_cli.algorithm.loss import LossMetrics, kl_std, policy_loss
from flowgrpo_cli.algorithm.sde import STEP_FUNCTIONS
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import barrier, broadcast_object, dist_info
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.store.config import STAGE_SECTIONS, Config, config_hash
from flowgrpo_cli.store.rundir import (
    MANIFEST,
    RunDir,
    StageWriter,
    atomic_write_json,
    manifest_hash,
    read_manifest,
    require_manifest,
    sha256_file,
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
from flowgrpo_cli.training.policy import weights_file
from flowgrpo_cli.training.trainer import Trainer

STAGE = "update"


@dataclass(frozen=True)
class UpdateResult:
    manifest: dict[str, Any]
    metrics: dict[str, float]


@dataclass(frozen=True)
class IterationData:
    """The iteration's samples that are trained on, with their advantages (all ranks).

    Under algorithm.drop_zero_advantage (the default, as in the reference) samples whose
    advantage is exactly 0 (flat groups, groups of one) are left out before the optimizer
    batches are formed: the policy-gradient mean is then over samples that carry signal, and
    they add no KL gradient either. advantages.arrow still lists every scored sample.
    """

    sample_ids: list[str]
    group_ids: torch.Tensor  # [N] int64
    advantages: torch.Tensor  # [N] float32
    locations: list[tuple[int, int, int]]  # per sample: (part, record batch, row)
    metrics: dict[str, float]
    table: pa.Table  # sample_id, group_id, reward, advantage: written as advantages.arrow


def _stage_dirs(run: RunDir, iteration: int):
    return (
        run.stage_dir(iteration, "rollout"),
        run.stage_dir(iteration, "scores"),
        run.stage_dir(iteration, STAGE),
        run.checkpoint_dir(iteration),
    )


def load_iteration(
    config: Config, run: RunDir, iteration: int, policy_version: str
) -> IterationData:
    rollout_dir, scores_dir, _, _ = _stage_dirs(run, iteration)
    rollout = require_manifest(rollout_dir, "rollout")
    scores = require_manifest(scores_dir, "score")
    if rollout["identity"]["config"] != config_hash(config, STAGE_SECTIONS["rollout"]):
        raise FlowGrpoError(
            f"{rollout_dir} was sampled with another config or model than this update's; "
            "delete that iteration folder to redo it"
        )
    if rollout["policy_version"] != policy_version:
        raise FlowGrpoError(
            f"{rollout_dir} was sampled with policy {rollout['policy_version']}, but the policy "
            f"to update is {policy_version}: the rollout is stale; delete it and roll out again"
        )
    parts = [rollout_dir / name for name in rollout["trajectory_parts"]]
    samples = read_table(parts, ["sample_id", "group_id"])
    score_table = read_table([scores_dir / p["name"] for p in scores["parts"]])
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
        for name in scores["rewards"]
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
        trained_ids, group_ids[trained], advantages[trained], _locate(parts, set(trained_ids)),
        metrics, table,
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


class SampleReader:
    """Micro-batches of trajectory rows, read from the memory-mapped parts on demand."""

    def __init__(self, parts, locations):
        self.readers = [open_part(p) for p in parts]
        self.locations = locations

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
) -> UpdateResult:
    progress = progress or NullProgress()
    info = dist_info()
    rollout_dir, scores_dir, update_dir, checkpoint_dir = _stage_dirs(run, iteration)
    if read_manifest(checkpoint_dir) is not None and read_manifest(update_dir) is not None:
        return UpdateResult(read_manifest(update_dir), {})
    policy = trainer.policy
    require_manifest(rollout_dir, "rollout")
    require_manifest(scores_dir, "score")
    identity = {
        "config": config_hash(config, STAGE_SECTIONS[STAGE]),
        "rollout": manifest_hash(rollout_dir),
        "scores": manifest_hash(scores_dir),
        "policy": policy.version,
    }
    if info.is_main:
        (update_dir / MANIFEST).unlink(missing_ok=True)  # the checkpoint is not done: redo
    writer = StageWriter(update_dir, STAGE, identity)
    broadcast_object(writer.begin() if info.is_main else None)
    data = load_iteration(config, run, iteration, policy.version)
    started = time.perf_counter()
    train_metrics = _train(config, run, iteration, trainer, data, progress)
    seconds = time.perf_counter() - started
    trainer.state.iteration = iteration
    trainer.state.config_hash = identity["config"]
    files = trainer.save(checkpoint_dir)
    barrier()
    metrics = {
        **data.metrics,
        **train_metrics,
        "update/seconds": seconds,
        "update/samples_per_s": len(data.sample_ids) * config.train.inner_epochs / seconds,
    }
    manifest: dict[str, Any] = {}
    if info.is_main:
        write_table(writer.part_path("advantages.arrow"), data.table)
        atomic_write_json(update_dir / "metrics.json", metrics)
        manifest = writer.finish(["advantages.arrow"], counts={
            "samples": len(data.sample_ids), "optimizer_steps": trainer.state.optimizer_steps,
        }, extra={"checkpoint": str(checkpoint_dir.relative_to(run.root))})  # fmt: skip
        checkpoint = StageWriter(checkpoint_dir, "checkpoint", identity)
        checkpoint.finish(files, counts={"iteration": iteration})
    barrier()
    weights = checkpoint_dir / weights_file(policy.mode)
    policy.version = f"{checkpoint_dir.name}:{sha256_file(weights)[:16]}"
    return UpdateResult(manifest, metrics)


def _train(
    config: Config,
    run: RunDir,
    iteration: int,
    trainer: Trainer,
    data: IterationData,
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
    policy, adapter = trainer.policy, trainer.policy.adapter
    rollout_dir = run.stage_dir(iteration, "rollout")
    rollout = read_manifest(rollout_dir)
    parts = [rollout_dir / name for name in rollout["trajectory_parts"]]
    conditioning = read_conditioning([rollout_dir / n for n in rollout["conditioning_parts"]])
    reader = SampleReader(parts, data.locations)
    sampler = rollout["sampler"]
    step_fn = STEP_FUNCTIONS[sampler["kind"]]
    sigma_max_substitute = float(
        adapter.sigmas(sampler["num_steps"], sampler["height"], sampler["width"])[1]
    )
    beta = config.algorithm.beta
    world = dist_info().world_size
    device = policy.device

    progress.start(
        f"update iter {iteration}", total=sum(len(m) for _, m in plan), unit="micro-batches"
    )

    losses = LossMetrics()
    step_metrics: list[dict[str, float]] = []
    gap: list[torch.Tensor] = []
    old_override = (
        _recompute_old_logprobs(reader, data, conditioning, trainer, step_fn,
                                sigma_max_substitute, sampler, config)
        if config.algorithm.recompute_old_logprobs else None
    )  # fmt: skip
    policy.transformer.train()
    first_micro_batch = True
    for batch_size, micro_batches in plan:
        for indices in micro_batches:
            real = bool(indices)
            indices = indices or [0]  # a zero-weighted stand-in keeps collectives aligned
            rows = reader.rows(indices)
            positions = torch.nonzero(rows.trained[0]).flatten().tolist()
            if not positions:
                raise FlowGrpoError(f"{rollout_dir}: no trained step in the stored trajectories")
            cond = _conditioning(conditioning, rows.group_ids, device)
            advantages = data.advantages[indices].to(device)
            weight = (len(indices) * world / (batch_size * len(positions))) if real else 0.0
            for position in positions:
                x = rows.latents[:, position].to(device)
                x_next = rows.latents[:, position + 1].to(device)
                sigma = rows.timesteps[:, position].to(device)
                sigma_next = rows.timesteps_next[:, position].to(device)
                v = adapter.velocity(x, sigma, cond, guidance_scale=sampler["guidance_scale"])
                out = step_fn(
                    x,
                    v,
                    sigma,
                    sigma_next,
                    noise_level=sampler["noise_level"],
                    sigma_max_substitute=sigma_max_substitute,
                    next_latents=x_next,
                )
                stored = rows.log_probs[:, position].to(device)
                old = stored
                if old_override is not None:
                    old = torch.stack([old_override[(i, position)] for i in indices]).to(device)
                if first_micro_batch:  # before any optimizer step: the on-policy check
                    gap.append((out.log_prob.detach() - stored).abs())
                ref_mean = None
                if beta > 0:
                    with torch.no_grad(), trainer.reference_context():
                        v_ref = adapter.velocity(
                            x, sigma, cond, guidance_scale=sampler["guidance_scale"]
                        )
                        ref_mean = step_fn(
                            x,
                            v_ref,
                            sigma,
                            sigma_next,
                            noise_level=sampler["noise_level"],
                            sigma_max_substitute=sigma_max_substitute,
                            next_latents=x_next,
                        ).mean
                result = policy_loss(
                    out.log_prob,
                    old,
                    advantages,
                    clip_range=config.algorithm.clip_range,
                    beta=beta,
                    mean=out.mean if beta > 0 else None,
                    ref_mean=ref_mean,
                    std=kl_std(out, config.algorithm.kl_convention) if beta > 0 else None,
                )
                (result.loss * weight).backward()
                if real:
                    losses.add(result)
            first_micro_batch = False
            progress.advance(1)
        step_metrics.append(trainer.step())
    progress.finish()
    policy.transformer.eval()
    losses.all_reduce()
    metrics = losses.summary()
    # The KL's name says which divisor it has (the two differ by 1/|dt| for the SDE).
    metrics[f"update/kl_{config.algorithm.kl_convention}"] = metrics.pop("update/kl")
    gaps = torch.cat(gap) if gap else torch.zeros(1)
    metrics.update({
        "update/logprob_gap_max": float(gaps.max()),
        "update/logprob_gap_mean": float(gaps.mean()),
        "update/grad_norm": float(np.mean([m["grad_norm"] for m in step_metrics])),
        "update/grad_norm_max": float(np.max([m["grad_norm"] for m in step_metrics])),
        "update/lr": step_metrics[-1]["lr"],
        "update/optimizer_steps": float(len(step_metrics)),
        "update/optimizer_steps_skipped": float(skipped),
    })  # fmt: skip
    return metrics


def _plan(num_samples: int, config: Config, iteration: int) -> list[tuple[int, list[list[int]]]]:
    """Per optimizer step: (its batch size, this rank's micro-batches of sample indices).

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
            plan.append((len(batch), [share[m * micro : (m + 1) * micro] for m in range(count)]))
    return plan


def _conditioning(store, group_ids: list[int], device) -> Conditioning:
    return Conditioning.cat(
        [Conditioning({k: v.unsqueeze(0) for k, v in store[g].items()}) for g in group_ids]
    ).to(device)


@torch.no_grad()
def _recompute_old_logprobs(
    reader, data, conditioning, trainer, step_fn, sigma_max_substitute, sampler, config
):
    """Old log-probs under the current weights, before any step: (sample, step) -> logp.

    Every rank computes them for every sample: the same forwards on every rank keep FSDP's
    collectives aligned, and the result is small.
    """
    adapter, device = trainer.policy.adapter, trainer.policy.device
    out: dict[tuple[int, int], torch.Tensor] = {}
    mine = list(range(len(data.sample_ids)))
    micro = config.train.micro_batch_size
    for start in range(0, len(mine), micro):
        indices = mine[start : start + micro]
        rows = reader.rows(indices)
        cond = _conditioning(conditioning, rows.group_ids, device)
        for position in torch.nonzero(rows.trained[0]).flatten().tolist():
            x = rows.latents[:, position].to(device)
            sigma = rows.timesteps[:, position].to(device)
            v = adapter.velocity(x, sigma, cond, guidance_scale=sampler["guidance_scale"])
            result = step_fn(
                x,
                v,
                sigma,
                rows.timesteps_next[:, position].to(device),
                noise_level=sampler["noise_level"],
                sigma_max_substitute=sigma_max_substitute,
                next_latents=rows.latents[:, position + 1].to(device),
            )
            for i, index in enumerate(indices):
                out[(index, position)] = result.log_prob[i].cpu()
    return out
