"""Evaluation: ODE sampling (noise level 0) of fixed test prompts with fixed seeds, scored.

`RUN/eval/iter-N/` holds the evaluation of the policy that iteration N starts from (iter-0 is
the base model): one Arrow part per rank (sample_id, prompt, ground_truth, image, rewards),
metrics.json and the manifest; `samples/eval-iter-N.png` is its image grid.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.base import RolloutEngine, SampleRequest, batches
from flowgrpo_cli.engines.sampling import SamplerSettings
from flowgrpo_cli.launch.distributed import dist_info
from flowgrpo_cli.launch.stage import Finished, run_stage, verify_inputs
from flowgrpo_cli.reporting.grid import GridItem, make_grid
from flowgrpo_cli.store.config import Config, config_hash
from flowgrpo_cli.store.datatable import read_split
from flowgrpo_cli.store.rundir import (
    EVAL,
    PREPARE,
    RunDir,
    StageWriter,
    atomic_write_bytes,
    part_name,
    require_manifest,
)
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.store.trajectory import read_table, write_table

GRID_IMAGES = 16


def evaluation_requests(config: Config, run: RunDir) -> list[SampleRequest]:
    require_manifest(run.data_dir, PREPARE.command)
    rows = read_split(run, "test")
    if config.eval.num_prompts:
        rows = rows[: config.eval.num_prompts]
    return [
        SampleRequest(
            sample_id=f"eval-p{i:05d}",
            prompt_index=int(row["prompt_index"]),
            group_id=i,
            seed=derive_seed(config.run.seed, "eval", i),  # the same noise at every evaluation
            prompt=row["prompt"],
            ground_truth=row["ground_truth"],
            negative_prompt=row["negative_prompt"] or "",
            system_prompt=row["system_prompt"] or "",
        )
        for i, row in enumerate(rows)
    ]


def evaluate(
    config: Config, run: RunDir, iteration: int, engine: RolloutEngine, rewards: Any
) -> dict[str, float]:
    """Evaluate the engine's current policy; returns `eval/...` metrics (cached on disk)."""
    info = dist_info()
    verify_inputs(run.data_dir)
    requests = evaluation_requests(config, run)
    if not requests:
        return {}
    identity = {"config": config_hash(config), "policy": engine.version}
    writer = StageWriter(run.eval_dir(iteration), EVAL.name, identity)
    parts = [part_name(r, info.world_size) for r in range(info.world_size)]
    settings = SamplerSettings(
        kind=config.sampler.kind, noise_level=0.0, guidance_scale=config.eval.guidance_scale,
        height=config.model.height, width=config.model.width,
        schedule=build_step_schedule(config.eval.num_steps),
    )  # fmt: skip

    def evaluate_my_prompts() -> dict[str, float]:
        started = time.perf_counter()
        mine = requests[info.rank :: info.world_size]
        table = _sample_and_score(mine, engine, rewards, settings, config.sampler.batch_size)
        write_table(writer.part_path(parts[info.rank]), table)
        return {"eval/seconds": time.perf_counter() - started}

    def finish(local: dict[str, float]) -> Finished:
        table = read_table([writer.dir / p for p in parts])
        _write_grid(run, iteration, table)
        return Finished(
            metrics=_metrics(table, local["eval/seconds"]),
            parts=parts,
            counts={"images": table.num_rows},
        )

    result = run_stage(writer, evaluate_my_prompts, finish)
    return result.metrics if info.is_main or not result.fresh else {}


def _sample_and_score(
    requests: list[SampleRequest],
    engine: RolloutEngine,
    rewards: Any,
    settings: SamplerSettings,
    batch_size: int,
) -> pa.Table:
    """ODE images of `requests`, PNG-encoded and scored: one row per request."""
    from flowgrpo_cli.models import to_pil, to_png
    from flowgrpo_cli.rewards.base import RewardBatch

    conditioning = engine.encode(requests, settings.guidance_scale)
    tables = []
    for chunk in batches(requests, batch_size):
        pixels = engine.sample(chunk, conditioning, settings).images
        scored = rewards.score(RewardBatch(
            images=to_pil(pixels),
            prompts=[r.prompt for r in chunk],
            ground_truths=[r.ground_truth for r in chunk],
            metadata=[{"sample_id": r.sample_id, "group_id": r.group_id} for r in chunk],
        ))  # fmt: skip
        columns = {
            "sample_id": pa.array([r.sample_id for r in chunk], pa.string()),
            "prompt": pa.array([r.prompt for r in chunk], pa.string()),
            "ground_truth": pa.array([r.ground_truth for r in chunk], pa.string()),
            "image": pa.array(to_png(pixels), pa.binary()),
            **{n: pa.array(scored.columns[n], pa.float64()) for n in scored.names},
            "reward": pa.array(scored.reward, pa.float64()),
            "reward_error": pa.array(scored.reward_error, pa.string()),
        }
        tables.append(pa.table(columns))
    return pa.concat_tables(tables)


def _metrics(table: pa.Table, seconds: float) -> dict[str, float]:
    import pyarrow.compute as pc

    metrics = {"eval/seconds": seconds, "eval/images": float(table.num_rows)}
    names = [
        c
        for c in table.column_names
        if c not in ("sample_id", "prompt", "ground_truth", "image", "reward_error")
    ]
    for name in names:
        column = table.column(name)
        if column.null_count < column.length():
            metrics[f"eval/{name}_mean"] = pc.mean(column).as_py()
    if "ocr" in names:  # exact match: the OCR reward is 1 only when the target was read
        ocr = [v for v in table.column("ocr").to_pylist() if v is not None]
        metrics["eval/ocr_exact"] = sum(v == 1.0 for v in ocr) / max(1, len(ocr))
    return metrics


def _write_grid(run: RunDir, iteration: int, table: pa.Table) -> None:
    rows = table.slice(0, GRID_IMAGES).to_pylist()
    items = [GridItem(r["image"], r["prompt"], r["ground_truth"], r["reward"]) for r in rows]
    atomic_write_bytes(run.eval_samples_path(iteration), make_grid(items))
