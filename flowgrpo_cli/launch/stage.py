"""The skeleton every stage runs through, the same on every rank (SPMD).

    begin (rank 0 prepares the folder) -> work (every rank writes its parts) -> barrier ->
    rank 0 finishes (metrics.json, then the manifest) -> barrier -> return

A stage already finished with the same identity is not redone: its manifest and recorded
metrics come back at once. Every rank returns only after rank 0 has written the manifest, which
is what the next stage reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import barrier, broadcast_object, dist_info
from flowgrpo_cli.store.rundir import (
    METRICS,
    StageWriter,
    atomic_write_json,
    read_manifest,
    read_metrics,
    verify_stage,
)


@dataclass(frozen=True)
class Finished:
    """What rank 0 records once every rank's parts are written."""

    metrics: dict[str, float]
    parts: list[str]  # files of the folder the manifest lists (size and sha256)
    counts: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # further manifest keys


@dataclass(frozen=True)
class StageResult:
    manifest: dict[str, Any]  # {} on ranks other than 0 (the file is on disk for all)
    metrics: dict[str, float]  # rank 0: the stage's; other ranks: their own share's
    fresh: bool  # False when the stage had been finished before and was not redone


def verify_inputs(*stage_dirs: Path) -> None:
    """Check every part of the finished stages a stage reads against their manifests before
    any rank uses them: rank 0 reads each part once, and every rank learns the outcome (so no
    rank waits in a collective for one that stopped)."""
    error = None
    if dist_info().is_main:
        try:
            for folder in stage_dirs:
                verify_stage(folder)
        except FlowGrpoError as err:
            error = str(err)
    error = broadcast_object(error)
    if error is not None:
        raise FlowGrpoError(error)


def run_stage(
    writer: StageWriter,
    work: Callable[[], dict[str, float]],
    finish: Callable[[dict[str, float]], Finished],
) -> StageResult:
    """Run one stage: `work` on every rank (returns that rank's metrics), then `finish` on
    rank 0 with rank 0's metrics, once every rank's parts are on disk."""
    info = dist_info()
    # Rank 0 alone prepares the folder (it may delete stale parts); the others wait for it.
    if not broadcast_object(writer.begin() if info.is_main else None):
        return StageResult(read_manifest(writer.dir) or {}, read_metrics(writer.dir), False)
    local = work()
    barrier()  # every rank's parts are written
    if not info.is_main:
        barrier()  # until rank 0 has written the manifest
        return StageResult({}, local, True)
    done = finish(local)
    atomic_write_json(writer.dir / METRICS, done.metrics)
    manifest = writer.finish(done.parts, counts=done.counts, extra=done.extra)
    barrier()
    return StageResult(manifest, done.metrics, True)
