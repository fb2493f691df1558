"""`flowgrpo rollout`: the iteration's prompts + the current policy -> RUN/iter-N/rollout/.

Each rank writes one trajectory part (one row per image) and one conditioning part (one row
per prompt group); rank 0 writes the manifest once every part exists. Which prompts an
iteration uses, each sample's seed (and its group's initial-noise seed, with
sampler.same_noise_per_group) and the SDE window depend only on (run seed, iteration, prompt,
k), never on batch size or rank count, so 1 and N processes write the same samples.
"""

from __future__ import annotations

import math
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import fields, replace

from flowgrpo_cli.algorithm.sde import check_noise_level
from flowgrpo_cli.engines.base import RolloutEngine, SampleRequest, batches
from flowgrpo_cli.engines.sampling import SampledBatch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import DistInfo, dist_info
from flowgrpo_cli.launch.stage import Finished, StageResult, run_stage, verify_inputs
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.store.config import STAGE_SECTIONS, Config, config_hash
from flowgrpo_cli.store.contract import RolloutManifest, SamplerSettings
from flowgrpo_cli.store.datatable import read_split, source_images
from flowgrpo_cli.store.rundir import (
    PREPARE,
    ROLLOUT,
    RunDir,
    StageWriter,
    manifest_hash,
    part_name,
    require_manifest,
)
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.store.trajectory import (
    ArrowPartWriter,
    TrajectoryRows,
    conditioning_table,
    to_record_batch,
    write_table,
)
from flowgrpo_cli.training.algorithms import algorithm_for


def select_prompts(num_prompts: int, per_iteration: int, seed: int, iteration: int) -> list[int]:
    """Prompt rows of an iteration: drawn without replacement, by (seed, iteration) alone."""
    if per_iteration > num_prompts:
        raise FlowGrpoError(
            f"algorithm.prompts_per_iteration = {per_iteration}, but data/train.parquet has "
            f"only {num_prompts} prompts"
        )
    return random.Random(derive_seed(seed, iteration, "prompts")).sample(
        range(num_prompts), per_iteration
    )


def latent_bytes_per_iteration(config: Config, latent_shape: tuple[int, ...]) -> int:
    """What one iteration's trajectory latents take on disk (float32): every image's states
    around its stochastic steps, or its clean latent alone for nft / awm."""
    states = 1
    algorithm = algorithm_for(config)
    if algorithm.needs_trajectory:
        states += sum(algorithm.step_schedule(0).stochastic)
    images = config.algorithm.group_size * config.algorithm.prompts_per_iteration
    return images * states * math.prod(latent_shape) * 4


def sampler_settings(config: Config, iteration: int) -> SamplerSettings:
    sampler = config.sampler
    changes_post_window = (
        sampler.post_window_solver != "euler" or sampler.post_window_compress < 1.0
    )
    if changes_post_window and (not sampler.window_size or sampler.noise_level == 0):
        raise FlowGrpoError(
            "sampler.post_window_solver / post_window_compress change the ODE steps after "
            "the SDE window, and this config has none: set sampler.window_size (and a "
            "noise_level > 0), or leave them at 'euler' / 1.0"
        )
    if sampler.same_noise_per_group and sampler.noise_level == 0:
        raise FlowGrpoError(
            "sampler.same_noise_per_group starts every image of a group from one noise, and "
            "sampler.noise_level = 0 adds none after it: the group's images would all be the "
            "same, with advantages of 0; set a noise_level > 0, or leave same_noise_per_group off"
        )
    if sampler.ode_solver != "euler" and sampler.post_window_solver != "euler":
        raise FlowGrpoError(
            f"sampler.ode_solver = {sampler.ode_solver!r} already takes every deterministic "
            "step, those after the SDE window included: remove sampler.post_window_solver "
            "(it takes the steps after the window alone, MixGRPO-Flash's)"
        )
    return SamplerSettings(
        kind=sampler.kind,
        noise_level=sampler.noise_level,
        guidance_scale=sampler.guidance_scale,
        height=config.model.height,
        width=config.model.width,
        schedule=algorithm_for(config).step_schedule(iteration),
        post_window_solver=sampler.post_window_solver,
        post_window_compress=sampler.post_window_compress,
        shift=sampler.shift,
        same_noise_per_group=sampler.same_noise_per_group,
        ode_solver=sampler.ode_solver,
    )


def rank_groups(num_groups: int, info: DistInfo) -> list[int]:
    """Groups of this rank: every group stays whole on one rank."""
    if num_groups % info.world_size:
        raise FlowGrpoError(
            f"algorithm.prompts_per_iteration = {num_groups} groups cannot be split evenly "
            f"over {info.world_size} ranks: use a multiple of {info.world_size}"
        )
    return list(range(info.rank, num_groups, info.world_size))


def build_requests(
    config: Config, run: RunDir, iteration: int, groups: list[int]
) -> list[SampleRequest]:
    rows = read_split(run, "train")  # a file that is not what prepare wrote is named
    chosen = select_prompts(
        len(rows), config.algorithm.prompts_per_iteration, config.run.seed, iteration
    )
    images = source_images(run, "train", [chosen[group] for group in groups])  # {}: text only
    requests = []
    for group in groups:
        index = chosen[group]
        row = rows[index]
        # sampler.same_noise_per_group: one initial noise per group, from a seed of its own
        # (run seed, iteration, prompt), so it is the same on any rank and in any batch.
        noise_seed = None
        if config.sampler.same_noise_per_group:
            noise_seed = derive_seed(config.run.seed, iteration, index, "initial_noise")
        for k in range(config.algorithm.group_size):
            requests.append(
                SampleRequest(
                    sample_id=f"i{iteration:06d}-g{group:04d}-k{k:03d}",
                    prompt_index=index,
                    group_id=group,
                    seed=derive_seed(config.run.seed, iteration, index, k),
                    prompt=row["prompt"],
                    ground_truth=row["ground_truth"],
                    negative_prompt=row["negative_prompt"] or "",
                    system_prompt=row["system_prompt"] or "",
                    noise_seed=noise_seed,
                    source_image=images.get(index),
                )
            )
    return requests


def run(
    config: Config,
    run: RunDir,
    iteration: int,
    engine: RolloutEngine,
    progress: Progress | None = None,
) -> StageResult:
    """Write this rank's parts of iteration `iteration`'s rollout (skipping finished ones)."""
    progress = progress or NullProgress()
    info = dist_info()
    algorithm = algorithm_for(config)
    algorithm.check()  # refuses settings the algorithm would ignore, before any sampling
    require_manifest(run.data_dir, PREPARE.command)
    identity = {
        "config": config_hash(config, STAGE_SECTIONS[ROLLOUT.name]),
        "data": manifest_hash(run.data_dir),
        "policy": engine.version,
        "iteration": iteration,
        "world_size": info.world_size,
    }
    writer = StageWriter(run.stage_dir(iteration, ROLLOUT), ROLLOUT.name, identity)
    settings = sampler_settings(config, iteration)
    parts = [part_name(r, info.world_size) for r in range(info.world_size)]

    def sample_my_parts() -> dict[str, float]:
        verify_inputs(run.data_dir)
        check_noise_level(settings.kind, settings.noise_level, engine.sigmas(settings).tolist())
        _check_final_latent(config, settings)
        requests = build_requests(
            config, run, iteration, rank_groups(config.algorithm.prompts_per_iteration, info)
        )
        started = time.perf_counter()
        produced = _sample_part(
            writer, parts[info.rank], requests, engine, settings, config.sampler.batch_size,
            progress, label=f"rollout iter {iteration}",
            keep_trajectory=algorithm.needs_trajectory,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        return {
            "rollout/seconds": seconds,
            "rollout/window_start": float(settings.schedule.first_stochastic),
            "rollout/images": float(produced),
            "rollout/images_per_s": produced / seconds if produced and seconds > 0 else 0.0,
        }

    def finish(metrics: dict[str, float]) -> Finished:
        manifest = RolloutManifest(
            trajectory_parts=tuple(parts),
            conditioning_parts=tuple(_conditioning_name(p) for p in parts),
            policy_version=engine.version,
            sampler=settings,
            sigmas=tuple(float(s) for s in engine.sigmas(settings)),
            dtype=config.model.dtype,
            identity=identity,
        )
        section = config.algorithm
        return Finished(
            metrics=metrics,
            parts=[*manifest.trajectory_parts, *manifest.conditioning_parts],
            counts={
                "images": section.prompts_per_iteration * section.group_size,
                "groups": section.prompts_per_iteration,
                "group_size": section.group_size,
            },
            extra=manifest.fields(),
        )

    return run_stage(writer, sample_my_parts, finish)


def _check_final_latent(config: Config, settings: SamplerSettings) -> None:
    """nft / awm need the clean latent; vllm-omni hands back the trajectory's states only, so
    its last one is the clean latent only when the last step is stochastic (or none is)."""
    if algorithm_for(config).needs_trajectory or config.sampler.engine != "vllm-omni":
        return
    if settings.noise_level > 0 and not settings.schedule.stochastic[-1]:
        raise FlowGrpoError(
            f"algorithm.name = {config.algorithm.name!r} with the vllm-omni engine needs the "
            "SDE window to reach the last step (or sampler.noise_level = 0): its trajectory "
            "ends at the window, not at the clean latent"
        )


def _conditioning_name(part: str) -> str:
    return part.replace("part-", "conditioning-")


def _sample_part(
    writer: StageWriter,
    part: str,
    requests: list[SampleRequest],
    engine: RolloutEngine,
    settings: SamplerSettings,
    batch_size: int,
    progress: Progress,
    *,
    label: str,
    keep_trajectory: bool,
) -> int:
    """Sample `requests` into the trajectory part `part` and its conditioning part (kept when
    a killed run left both finished); returns the number of images sampled."""
    conditioning_part = _conditioning_name(part)
    if writer.has_part(part) and writer.has_part(conditioning_part):
        return 0
    conditioning = engine.encode(requests, settings.guidance_scale)
    progress.start(label, total=len(requests))
    # Batch k's PNG encoding and part write run on a second thread while batch k + 1 samples:
    # CPU work that an accelerator (or a second core) would otherwise wait for. One batch in
    # flight bounds the memory; an error on either thread ends the stage, and the `with` waits
    # for the writer before the part is closed or discarded.
    with (
        ArrowPartWriter(writer.part_path(part)) as out,
        ThreadPoolExecutor(1, thread_name_prefix="rollout-writer") as writer_thread,
    ):
        pending: Future | None = None
        for chunk in batches(requests, batch_size):
            sampled = _on_cpu(engine.sample(chunk, conditioning, settings))
            if pending is not None:
                pending.result()
            if not keep_trajectory:  # nft / awm train on the clean latent alone
                sampled = _final_latent_only(sampled)
            pending = writer_thread.submit(_write_batch, out, chunk, sampled, settings)
            progress.advance(len(chunk))
        if pending is not None:
            pending.result()
    write_table(writer.part_path(conditioning_part), _conditioning_table(conditioning))
    progress.finish()
    return len(requests)


def _on_cpu(sampled: SampledBatch) -> SampledBatch:
    """The batch with its tensors on the CPU, copied on the sampling thread (so a GPU copy
    keeps its place in that thread's stream order)."""
    return SampledBatch(**{f.name: getattr(sampled, f.name).cpu() for f in fields(sampled)})


def _final_latent_only(sampled: SampledBatch) -> SampledBatch:
    """The batch as a sampler without stochastic steps gives it: the final latent alone."""
    import torch

    batch = sampled.final_latents.shape[0]
    empty = torch.zeros(batch, 0)
    return replace(
        sampled, latents=sampled.final_latents.unsqueeze(1), log_probs=empty,
        timesteps=empty, timesteps_next=empty,
    )  # fmt: skip


def _write_batch(
    out: ArrowPartWriter,
    chunk: list[SampleRequest],
    sampled: SampledBatch,
    settings: SamplerSettings,
) -> None:
    """PNG-encode a sampled batch and append its rows to the part (on the writer thread)."""
    out.write(to_record_batch(_rows(chunk, sampled, settings)))


def _rows(
    chunk: list[SampleRequest], sampled: SampledBatch, settings: SamplerSettings
) -> TrajectoryRows:
    import torch

    from flowgrpo_cli.models import to_png

    schedule = settings.schedule
    steps = sampled.log_probs.shape[1]
    positions = set(schedule.trained_positions) if steps else set()
    trained = torch.tensor(
        [[p in positions for p in range(steps)]] * len(chunk), dtype=torch.bool
    ).reshape(len(chunk), steps)
    return TrajectoryRows(
        sample_ids=[r.sample_id for r in chunk],
        prompt_indices=[r.prompt_index for r in chunk],
        group_ids=[r.group_id for r in chunk],
        seeds=[r.seed for r in chunk],
        prompts=[r.prompt for r in chunk],
        ground_truths=[r.ground_truth for r in chunk],
        timesteps=sampled.timesteps,
        timesteps_next=sampled.timesteps_next,
        trained=trained,
        log_probs=sampled.log_probs,
        latents=sampled.latents,
        images=to_png(sampled.images),
    )


def _conditioning_table(conditioning):
    """One row per group, each with its own shapes (no padding to the longest prompt)."""
    import pyarrow as pa

    return pa.concat_tables(
        conditioning_table([group], conditioning[group].to("cpu").tensors)
        for group in sorted(conditioning)
    )
