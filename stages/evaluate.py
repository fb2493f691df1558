"""`flowgrpo evaluate` (and the loop's periodic evaluation): ODE sampling (noise level 0) of
fixed test prompts with fixed seeds, scored. Its steps are eval.ode_solver's (Euler unless set,
as both DiffusionNFT's and AWM's evaluations), whatever solver the rollout uses.

`RUN/eval/iter-N/` holds the evaluation of the policy that iteration N starts from, the policy
after N updates (iter-0 is the base model): one Arrow part per rank (sample_id, prompt,
ground_truth, image, rewards), metrics.json and the manifest; `samples/eval-iter-N.png` is its
image grid (an editing run's shows each source image beside its edit). Its identity is the
whole config's hash and the evaluated weights' version (`+ema` when they are the EMA), so the
loop and `flowgrpo evaluate` find each other's evaluations.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pyarrow as pa

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.base import RolloutEngine, SampleRequest, batches
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import dist_info
from flowgrpo_cli.launch.stage import Finished, StageResult, run_stage, verify_inputs
from flowgrpo_cli.reporting.grid import GridItem, edit_cells, make_grid
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.rewards.base import sample_metadata
from flowgrpo_cli.store.config import Config, config_hash
from flowgrpo_cli.store.contract import SamplerSettings
from flowgrpo_cli.store.datatable import geneval_records, read_split, source_images
from flowgrpo_cli.store.rundir import (
    CHECKPOINT,
    EVAL,
    PREPARE,
    RunDir,
    StageWriter,
    atomic_write_bytes,
    numbered_folders,
    part_name,
    read_manifest,
    require_manifest,
)
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.store.trajectory import read_table, write_table

if TYPE_CHECKING:
    from flowgrpo_cli.rewards.rewardset import RewardSet

GRID_IMAGES = 16


def evaluation_requests(config: Config, run: RunDir) -> list[SampleRequest]:
    require_manifest(run.data_dir, PREPARE.command)
    rows = read_split(run, "test")
    if config.eval.num_prompts:
        rows = rows[: config.eval.num_prompts]
    images = source_images(run, "test", [row["prompt_index"] for row in rows])  # {}: text only
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
            source_image=images.get(row["prompt_index"]),
        )
        for i, row in enumerate(rows)
    ]


def evaluation_settings(config: Config) -> SamplerSettings:
    """How evaluation samples: noise level 0, eval.num_steps steps of eval.ode_solver's."""
    return SamplerSettings(
        kind=config.sampler.kind, noise_level=0.0, guidance_scale=config.eval.guidance_scale,
        height=config.model.height, width=config.model.width,
        schedule=build_step_schedule(config.eval.num_steps), ode_solver=config.eval.ode_solver,
    )  # fmt: skip


def evaluated_iteration(config: Config, run: RunDir, checkpoint: int | None, base: bool) -> int:
    """The eval/iter-M that `flowgrpo evaluate` writes: M = N + 1 for checkpoints/iter-N (the
    policy after N + 1 updates; default: the latest finished checkpoint), M = 0 for the base
    model (`base`: the weights the run starts from). A folder that is not a prepared run, a
    run without test prompts, and a checkpoint that is unfinished or lost its weights are
    refused by name, with the checkpoints that can be evaluated."""
    if not run.config_path.is_file():
        raise FlowGrpoError(
            f"{run.root} is not a run directory (it has no config.toml): give --run the folder "
            "of a run made by `flowgrpo prepare` or `flowgrpo loop`"
        )
    if read_manifest(run.data_dir) is None:
        raise FlowGrpoError(
            f"{run.root} has no prepared prompts ({run.data_dir} is missing or unfinished): "
            "run `flowgrpo prepare` first"
        )
    if not evaluation_requests(config, run):
        raise FlowGrpoError(
            f"{run.data_dir / 'test.parquet'} holds no prompts: nothing to evaluate on (prepare "
            "the run with test prompts: data.test or data.test_fraction)"
        )
    if base:
        return 0
    if checkpoint is not None and checkpoint < 0:
        raise FlowGrpoError(f"--iteration {checkpoint}: must be at least 0 (--base: the base)")
    finished = finished_checkpoints(run)
    usable = [n for n, kept in finished.items() if kept]
    if checkpoint is None:
        if not finished:
            raise FlowGrpoError(
                f"{run.root} has no finished checkpoint yet: train first (`flowgrpo loop`), or "
                "evaluate the base model with --base"
            )
        checkpoint = max(finished)
    if finished.get(checkpoint):
        return checkpoint + 1
    folder = run.checkpoint_dir(checkpoint)
    if checkpoint in finished:
        problem = (
            f"{folder} no longer holds its weights (deleted to save disk: "
            "run.checkpoint_every, run.keep_checkpoints)"
        )
    elif folder.exists():
        problem = f"{folder} is unfinished (its update did not finish)"
    else:
        problem = f"{folder} does not exist"
    have = (
        f"checkpoints with weights: iterations {_ranges(usable)}"
        if usable
        else "the run has no checkpoint with weights (--base evaluates the base model)"
    )
    raise FlowGrpoError(f"--iteration {checkpoint}: {problem}; {have}")


def finished_checkpoints(run: RunDir) -> dict[int, bool]:
    """Iteration -> whether its finished checkpoint still holds its weights, in order."""
    found = {}
    for number, path in numbered_folders(run.root / CHECKPOINT.folder).items():
        manifest = read_manifest(path)
        if manifest is not None:
            found[number] = "pruned" not in manifest
    return found


def _ranges(numbers: list[int]) -> str:
    """`0-29, 35`: sorted numbers with their consecutive runs joined."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def run(
    config: Config,
    run: RunDir,
    iteration: int,
    engine: RolloutEngine,
    rewards: RewardSet | None = None,
    progress: Progress | None = None,
) -> StageResult:
    """Evaluate the engine's current weights as the policy iteration `iteration` starts from
    (0: the base model) -> RUN/eval/iter-N/ and samples/eval-iter-N.png.

    `rewards`: a RewardSet kept open by the caller (the loop keeps reward models alive across
    iterations); built and closed here when None, and only when there is work to do. An
    evaluation already finished with the same config and weights comes back at once (fresh
    False); one finished with others is an error (delete the folder to redo it). A run without
    test prompts has nothing to evaluate: empty manifest and metrics."""
    from flowgrpo_cli.rewards.commands import build_rewards_from_config

    progress = progress or NullProgress()
    info = dist_info()
    verify_inputs(run.data_dir)
    requests = evaluation_requests(config, run)
    if not requests:
        return StageResult({}, {}, fresh=False)
    identity = {"config": config_hash(config), "policy": engine.version}
    writer = StageWriter(run.eval_dir(iteration), EVAL.name, identity)
    parts = [part_name(r, info.world_size) for r in range(info.world_size)]
    settings = evaluation_settings(config)

    def evaluate_my_prompts() -> dict[str, float]:
        started = time.perf_counter()
        mine = requests[info.rank :: info.world_size]
        progress.start(f"eval iter {iteration}", total=len(mine))
        scorer = rewards if rewards is not None else build_rewards_from_config(config.reward)
        try:
            records = geneval_records(read_split(run, "test"))
            table = _sample_and_score(
                mine, records, engine, scorer, settings, config.sampler.batch_size, progress
            )
        finally:
            if rewards is None:
                scorer.close()
            progress.finish()
        write_table(writer.part_path(parts[info.rank]), table)
        return {"eval/seconds": time.perf_counter() - started}

    def finish(local: dict[str, float]) -> Finished:
        table = read_table([writer.dir / p for p in parts])
        _write_grid(run, iteration, table, requests)
        return Finished(
            metrics=_metrics(table, local["eval/seconds"]),
            parts=parts,
            counts={"images": table.num_rows},
        )

    return run_stage(writer, evaluate_my_prompts, finish)


def _sample_and_score(
    requests: list[SampleRequest],
    records: dict[int, dict],
    engine: RolloutEngine,
    rewards: RewardSet,
    settings: SamplerSettings,
    batch_size: int,
    progress: Progress,
) -> pa.Table:
    """ODE images of `requests`, PNG-encoded and scored: one row per request. `records`:
    prompt_index -> GenEval record of the test prompts that have one."""
    from flowgrpo_cli.models import to_pil, to_png
    from flowgrpo_cli.rewards.base import RewardBatch
    from flowgrpo_cli.store.source_images import decode_batch

    conditioning = engine.encode(requests, settings.guidance_scale)
    tables = []
    for chunk in batches(requests, batch_size):
        pixels = engine.sample(chunk, conditioning, settings).images
        scored = rewards.score(RewardBatch(
            images=to_pil(pixels),
            prompts=[r.prompt for r in chunk],
            ground_truths=[r.ground_truth for r in chunk],
            metadata=[sample_metadata(r.sample_id, r.group_id, records.get(r.prompt_index))
                      for r in chunk],
            source_images=decode_batch([r.source_image for r in chunk]),
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
        progress.advance(len(chunk))
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


def _write_grid(
    run: RunDir, iteration: int, table: pa.Table, requests: list[SampleRequest]
) -> None:
    """samples/eval-iter-N.png: the first GRID_IMAGES images, four a row; an editing run's
    two a row, each after the source image it edits."""
    rows = table.slice(0, GRID_IMAGES).to_pylist()
    items = [GridItem(r["image"], r["prompt"], r["ground_truth"], r["reward"]) for r in rows]
    source_of = {r.sample_id: r.source_image for r in requests}
    sources = [s for r in rows if (s := source_of[r["sample_id"]]) is not None]
    if sources and len(sources) == len(rows):
        pairs = [(source, [item]) for source, item in zip(sources, items, strict=True)]
        grid = make_grid(edit_cells(pairs, 1), columns=4)
    else:
        grid = make_grid(items)
    atomic_write_bytes(run.eval_samples_path(iteration), grid)
