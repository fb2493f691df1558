"""`flowgrpo prepare`: prompt files -> RUN/data/{train,test}.parquet.

Reads the training prompts (and test prompts, or splits a seeded share off the training
file), checks every row, and writes the two tables every later stage reads. The output is
byte-identical for the same inputs and config.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.geneval_rules import colour_requests
from flowgrpo_cli.rewards.imports import add_plugin_dirs
from flowgrpo_cli.rewards.registry import reward_needing
from flowgrpo_cli.store.config import STAGE_SECTIONS, Config, DataSection, config_hash
from flowgrpo_cli.store.prompts import (
    PromptRow,
    format_problems,
    other_reward_hint,
    read_prompt_file,
)
from flowgrpo_cli.store.rundir import (
    PREPARE,
    RunDir,
    StageWriter,
    atomic_file,
    require_manifest,
    sha256_file,
)

if TYPE_CHECKING:
    from flowgrpo_cli.launch.stage import StageResult

SPLITS = ("train", "test")
COLUMNS = (
    "prompt_index", "prompt", "ground_truth", "negative_prompt", "system_prompt", "source",
    "geneval",
)  # fmt: skip
# An editing data set's tables add `source_image` (PNG) and `source_sha256`, in row groups of
# this many rows: rollout and score read the images of a few prompts by prompt_index, and the
# row groups' statistics let them skip the rest.
IMAGE_ROW_GROUP = 64


def _load(
    path: Path, data: DataSection, needs_target: str | None, needs_record: str | None
) -> tuple[list[PromptRow], int]:
    # colour_requests parses a GenEval record, raising a FlowGrpoError that names a bad key.
    parsed = read_prompt_file(
        path, needs_target, needs_record, check_record=colour_requests,
        max_image_pixels=data.max_image_pixels, source_size=data.source_size,
    )  # fmt: skip
    if parsed.problems and not data.skip_invalid:
        raise FlowGrpoError(
            f"{len(parsed.problems)} invalid prompt row(s) in {path} "
            f"(pass --skip-invalid to skip them):\n  "
            f"{format_problems(parsed.problems)}{other_reward_hint(parsed.problems)}"
        )
    if not parsed.rows:
        raise FlowGrpoError(f"{path}: no valid prompts")
    return parsed.rows, len(parsed.problems)


def _check_source_images(rows: list[PromptRow], needs_source: str | None) -> None:
    """Every prompt with a source image (an editing data set) or none (text-to-image); a
    reward that reads source images needs the former."""
    with_image = next((row for row in rows if row.source_image is not None), None)
    without = next((row for row in rows if row.source_image is None), None)
    if with_image is not None and without is not None:
        raise FlowGrpoError(
            f"{without.source}: no `image` for {without.prompt[:60]!r}, but {with_image.source} "
            "has one: in an editing data set every prompt names its source image"
        )
    if with_image is None and needs_source is not None:
        raise FlowGrpoError(
            f"{rows[0].source}: no `image` for {rows[0].prompt[:60]!r}; the `{needs_source}` "
            "reward reads source images (an editing data set: give every prompt an `image`)"
        )


def _split(
    rows: list[PromptRow], fraction: float, seed: int
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Hold out round(fraction * n) rows chosen by `seed`; both halves keep file order."""
    held = round(fraction * len(rows))
    if fraction > 0 and (held == 0 or held == len(rows)):
        raise FlowGrpoError(
            f"data.test_fraction = {fraction} of {len(rows)} prompts leaves an "
            "empty split; give a test file or change the fraction"
        )
    chosen = set(random.Random(seed).sample(range(len(rows)), held))
    train = [row for i, row in enumerate(rows) if i not in chosen]
    test = [row for i, row in enumerate(rows) if i in chosen]
    return train, test


def _sample_key(row: PromptRow) -> tuple[str, str | None]:
    """What makes two rows the same task: the prompt, and an edit's source image (one
    instruction given for two images is two edits)."""
    return row.prompt, row.source_image.sha256 if row.source_image is not None else None


def _duplicates(rows: list[PromptRow]) -> list[dict[str, Any]]:
    counts = Counter(_sample_key(row) for row in rows)
    firsts: dict[tuple[str, str | None], list[str]] = {}
    for row in rows:
        if counts[_sample_key(row)] > 1:
            firsts.setdefault(_sample_key(row), []).append(row.source)
    return [{"prompt": key[0], "sources": sources} for key, sources in firsts.items()]


def _table(rows: list[PromptRow], data: Any):  # -> pyarrow.Table
    import pyarrow as pa

    columns = {
        "prompt_index": pa.array(range(len(rows)), pa.int64()),
        "prompt": pa.array([r.prompt for r in rows], pa.string()),
        "ground_truth": pa.array([r.ground_truth for r in rows], pa.string()),
        "negative_prompt": pa.array(
            [r.negative_prompt or data.negative_prompt for r in rows], pa.string()
        ),
        "system_prompt": pa.array([data.system_prompt] * len(rows), pa.string()),
        "source": pa.array([r.source for r in rows], pa.string()),
        "geneval": pa.array([r.geneval for r in rows], pa.string()),  # JSON, or null
    }
    sources = [r.source_image for r in rows if r.source_image is not None]
    if sources:  # an editing data set (_check_source_images: every row has one)
        columns["source_image"] = pa.array([s.png for s in sources], pa.binary())
        columns["source_sha256"] = pa.array([s.sha256 for s in sources], pa.string())
    return pa.table(columns)


def _digest(hashes: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def _length_stats(rows: list[PromptRow]) -> dict[str, Any]:
    lengths = [len(row.ground_truth) for row in rows if row.ground_truth is not None]
    if not lengths:
        return {}
    edges = [(1, 5), (6, 10), (11, 20), (21, 30), (31, None)]
    histogram = {
        (f"{lo}-{hi}" if hi else f"{lo}+"): sum(
            lo <= n and (hi is None or n <= hi) for n in lengths
        )
        for lo, hi in edges
    }
    return {
        "min": min(lengths),
        "median": statistics.median(lengths),
        "max": max(lengths),
        "histogram": histogram,
    }


def _metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """What the manifest records, as numbers: prompts per split and rows skipped."""
    counts = manifest["counts"]
    return {
        **{f"data/{split}_prompts": float(counts[split]) for split in SPLITS},
        "data/skipped_invalid": float(manifest["summary"]["skipped_invalid"]),
    }


def run(config: Config, run: RunDir) -> StageResult:
    """Write the data tables, unless already written for the same inputs (fresh False then).

    The manifest holds the split sizes (`counts`) and the `summary` `flowgrpo prepare` prints:
    rows skipped, duplicates per split, prompts in both splits, target lengths. Runs in one
    process (rank 0 of a launch calls it alone)."""
    import pyarrow.parquet as pq

    data = config.data
    if not data.train:
        raise FlowGrpoError(
            "no training prompts: set data.train in the config (or --set data.train=FILE), "
            "or run `flowgrpo prepare --train FILE` first"
        )
    train_path = Path(data.train)
    test_path = Path(data.test) if data.test else None
    # Prompts need a target only when a configured reward reads one (OCR): then it is named;
    # likewise a GenEval record.
    add_plugin_dirs(config.reward.plugin_dirs)
    needs_target = reward_needing(config.reward.weights, "ground_truths", config.reward)
    needs_record = reward_needing(config.reward.weights, "geneval", config.reward)
    needs_source = reward_needing(config.reward.weights, "source_images", config.reward)
    inputs = {str(p): sha256_file(p) for p in (train_path, test_path) if p and p.is_file()}
    # Read and check the prompts before the data folder exists: bad input leaves no trace.
    train, skipped = _load(train_path, data, needs_target, needs_record)
    if test_path is not None:
        test, skipped_test = _load(test_path, data, needs_target, needs_record)
        skipped += skipped_test
        _check_source_images(train + test, needs_source)
    else:
        _check_source_images(train, needs_source)
        train, test = _split(train, data.test_fraction, config.run.seed)
    # The source images are files of their own: their hashes are inputs too.
    images = [r.source_image.sha256 for r in train + test if r.source_image is not None]
    identity = {
        "config": config_hash(config, STAGE_SECTIONS[PREPARE.name]),
        "inputs": inputs,
        "targets_needed_by": needs_target,  # another reward set may accept other rows
        # only when set: runs prepared before GenEval records (or source images) keep their
        # identity
        **({"records_needed_by": needs_record} if needs_record else {}),
        **({"source_images": _digest(images)} if images else {}),
    }
    if data.train_prompts:
        train = train[: data.train_prompts]
    splits = {"train": train, "test": test}
    # The tables too are made before the data folder exists: a row Arrow cannot hold must
    # fail here, not leave a half-made data folder that makes the run refuse a new config.
    tables = {name: _table(rows, data) for name, rows in splits.items()}
    # Only now: launch.stage loads torch (seconds), which an error above need not wait for.
    from flowgrpo_cli.launch.stage import StageResult

    writer = StageWriter(run.data_dir, PREPARE.name, identity)
    if not writer.begin():
        manifest = require_manifest(run.data_dir, PREPARE.command)
        return StageResult(manifest, _metrics(manifest), fresh=False)

    test_keys = {_sample_key(row) for row in test}
    overlap = sorted({row.prompt for row in train if _sample_key(row) in test_keys})
    for name, table in tables.items():
        row_group = IMAGE_ROW_GROUP if "source_image" in table.column_names else None
        with atomic_file(writer.part_path(f"{name}.parquet")) as handle:
            pq.write_table(table, handle, compression="zstd", row_group_size=row_group)
    summary = {
        "skipped_invalid": skipped,
        "duplicates": {name: _duplicates(rows) for name, rows in splits.items()},
        "train_test_overlap": overlap,
        "target_length": {name: _length_stats(rows) for name, rows in splits.items()},
    }
    counts = {name: len(rows) for name, rows in splits.items()}
    manifest = writer.finish([f"{name}.parquet" for name in SPLITS], counts, {"summary": summary})
    return StageResult(manifest, _metrics(manifest), fresh=True)
