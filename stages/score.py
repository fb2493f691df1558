"""`flowgrpo score`: rollout -> RUN/iter-N/scores/, one score part per rollout part.

Each score part has one row per image: `sample_id`, one float column per reward, the weighted
`reward`, and `reward_error`. A reward that fails on an image leaves that reward's value empty
and says why in `reward_error`; `reward.on_error` then drops the sample, its whole group (the
score stage leaves `reward` empty for every dropped sample, and the update skips those), or
stops the stage. Groups never span parts, so the policy is applied part by part, and a re-run
after a crash scores only the parts still missing. A `parts_scorer` (ray_cluster.py: a
pool of Ray tasks apart from the training ranks) may score the missing parts instead of the
ranks: it calls `score_part` for each, wherever it runs.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from flowgrpo_cli.launch.distributed import dist_info
from flowgrpo_cli.launch.stage import Finished, StageResult, run_stage, verify_inputs
from flowgrpo_cli.reporting.progress import NullProgress, Progress
from flowgrpo_cli.store.config import STAGE_SECTIONS, Config, config_hash
from flowgrpo_cli.store.contract import RolloutManifest
from flowgrpo_cli.store.datatable import geneval_records, read_split, source_images
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, RunDir, StageWriter, manifest_hash
from flowgrpo_cli.store.trajectory import iter_batches, open_part, read_table, write_table

# Schema metadata key of a score part: what scored it (RewardSet.info), as JSON.
REWARD_INFO = "flowgrpo.rewards"
_READ_COLUMNS = ["sample_id", "group_id", "prompt_index", "prompt", "ground_truth", "image"]
# Scores the named rollout parts (each with `score_part`) and returns the number of images.
PartsScorer = Callable[[list[str], Progress], int]


def _reward_batches(path, records: dict[int, dict], sources: dict[int, bytes], progress: Progress):
    """The part's images in batches; `records`: prompt_index -> GenEval record, put in the
    metadata of every image of a prompt that has one; `sources`: prompt_index -> its source
    image (PNG) in an editing data set, handed to the rewards as `source_images`."""
    from PIL import Image

    from flowgrpo_cli.rewards.base import RewardBatch, sample_metadata
    from flowgrpo_cli.store.source_images import decode_batch

    for batch in iter_batches([path], _READ_COLUMNS):
        rows = batch.to_pylist()
        yield RewardBatch(
            images=[Image.open(io.BytesIO(r["image"])).convert("RGB") for r in rows],
            prompts=[r["prompt"] for r in rows],
            ground_truths=[r["ground_truth"] for r in rows],
            metadata=[
                sample_metadata(r["sample_id"], r["group_id"], records.get(r["prompt_index"]))
                for r in rows
            ],
            source_images=decode_batch([sources.get(r["prompt_index"]) for r in rows]),
        )
        progress.advance(len(rows))  # the batch was scored before the generator resumes


def _score_table(scored, sample_ids: list[str], reward_info: dict) -> pa.Table:
    result, keep = scored.result, scored.outcome.keep
    columns: dict[str, pa.Array] = {"sample_id": pa.array(sample_ids, pa.string())}
    for name in result.names:
        columns[name] = pa.array(result.columns[name], pa.float64())
    columns["reward"] = pa.array(
        [r if k else None for r, k in zip(result.reward, keep, strict=True)], pa.float64()
    )
    columns["reward_error"] = pa.array(result.reward_error, pa.string())
    return pa.table(columns).replace_schema_metadata({REWARD_INFO: json.dumps(reward_info)})


def _label(iteration: int, name: str) -> str:
    """`score iter 3`, and which part when the rollout has several: `score iter 3 part 2/4`."""
    found = re.fullmatch(r"part-(\d+)-of-(\d+)\.arrow", name)
    if found is None or int(found[2]) == 1:
        return f"score iter {iteration}"
    return f"score iter {iteration} part {int(found[1]) + 1}/{int(found[2])}"


def score_part(
    config: Config, run: RunDir, iteration: int, name: str, rewards, progress=None
) -> int:
    """Score rollout part `name` into the score part of the same name (written atomically);
    returns its number of images."""
    from flowgrpo_cli.rewards.commands import score_batches

    progress = progress or NullProgress()
    rollout_dir, stage_dir = run.stage_dir(iteration, ROLLOUT), run.stage_dir(iteration, SCORE)
    part = read_table([rollout_dir / name], ["sample_id", "prompt_index"])
    sample_ids = part.column("sample_id").to_pylist()
    progress.start(_label(iteration, name), total=len(sample_ids))
    records = geneval_records(read_split(run, "train"))  # rollout's prompt_index is a row
    sources = source_images(run, "train", part.column("prompt_index").to_pylist())
    batches = _reward_batches(rollout_dir / name, records, sources, progress)
    scored = score_batches(rewards, batches, config.reward.on_error)
    progress.finish()
    write_table(stage_dir / name, _score_table(scored, sample_ids, rewards.info))
    return len(sample_ids)


def run(
    config: Config,
    run: RunDir,
    iteration: int,
    rewards=None,
    progress: Progress | None = None,
    parts_scorer: PartsScorer | None = None,
) -> StageResult:
    """Score this rank's rollout parts. `rewards`: a RewardSet kept open by the caller (the
    loop keeps OCR engines alive across iterations); built and closed here when None.
    `parts_scorer`: rank 0 hands it every missing part instead (the other ranks wait)."""
    from flowgrpo_cli.rewards.commands import build_rewards_from_config

    progress = progress or NullProgress()
    info = dist_info()
    rollout_dir = run.stage_dir(iteration, ROLLOUT)
    parts = RolloutManifest.read(rollout_dir).trajectory_parts
    identity = {
        "config": config_hash(config, STAGE_SECTIONS[SCORE.name]),
        "rollout": manifest_hash(rollout_dir),
    }
    writer = StageWriter(run.stage_dir(iteration, SCORE), SCORE.name, identity)

    def score_my_parts() -> dict[str, float]:
        nonlocal rewards
        verify_inputs(rollout_dir)
        if parts_scorer is not None:
            mine = list(parts) if info.is_main else []
        else:
            mine = [name for i, name in enumerate(parts) if i % info.world_size == info.rank]
        missing = [name for name in mine if not writer.has_part(name)]
        started = time.perf_counter()
        scored_images = 0
        if parts_scorer is not None:
            scored_images = parts_scorer(missing, progress) if missing else 0
        elif missing:
            own_rewards = rewards is None
            if own_rewards:
                rewards = build_rewards_from_config(config.reward)
            try:
                for name in missing:
                    scored_images += score_part(config, run, iteration, name, rewards, progress)
            finally:
                if own_rewards:
                    rewards.close()
        seconds = time.perf_counter() - started
        return {
            "score/seconds": seconds,
            "score/images_per_s": scored_images / seconds if scored_images else 0.0,
        }

    def finish(metrics: dict[str, float]) -> Finished:
        table = read_table([writer.dir / name for name in parts])
        names = [c for c in table.column_names if c not in ("sample_id", "reward", "reward_error")]
        errors = [e for e in table.column("reward_error").to_pylist() if e]
        dropped = table.column("reward").null_count
        metrics = {
            **metrics,
            "score/failed_images": float(len(errors)),
            "score/dropped_samples": float(dropped),
        }
        return Finished(
            metrics=metrics,
            parts=list(parts),
            counts={"images": table.num_rows, "failed": len(errors), "dropped": dropped},
            extra={"rewards": names, "weights": config.reward.weights,
                   "reward_info": _reward_info([writer.dir / name for name in parts]),
                   "on_error": config.reward.on_error, "first_errors": errors[:5],
                   "stats": _stats(table, names)},
        )  # fmt: skip

    return run_stage(writer, score_my_parts, finish)


def _reward_info(paths: list[Path]) -> dict:
    """What scored the parts (their RewardSet.info). Parts scored by different processes
    record the same unless a model changed between them; then each distinct record is
    kept with the parts it scored."""
    records: dict[str, list[str]] = {}
    for path in paths:
        metadata = open_part(path).schema.metadata or {}
        records.setdefault(metadata.get(REWARD_INFO.encode(), b"{}").decode(), []).append(path.name)
    if len(records) == 1:
        return json.loads(next(iter(records)))
    return {
        "differs_by_part": [{"parts": names, **json.loads(text)} for text, names in records.items()]
    }


def _stats(table: pa.Table, names: list[str]) -> dict[str, dict[str, float | None]]:
    import pyarrow.compute as pc

    out = {}
    for name in [*names, "reward"]:
        column = table.column(name)
        valid = column.length() - column.null_count
        out[name] = {
            # Each value divided first: the sum of finite scores near 1e308 would overflow.
            "mean": pc.sum(pc.divide(column, float(valid))).as_py() if valid else None,
            "min": pc.min(column).as_py() if valid else None,
            "max": pc.max(column).as_py() if valid else None,
            "count": valid,
        }
    return out
