"""RUN/metrics.jsonl, one line per iteration, rebuilt from the stage folders.

Every stage writes its own metrics.json next to its manifest; the log is derived from them, so
a resumed run never duplicates or loses a line. The experiment trackers are fed from it
(reporting.trackers).
"""

from __future__ import annotations

import json
from typing import Any

from flowgrpo_cli.store.rundir import ITERATION_STAGES, RunDir, atomic_write_bytes, read_metrics


def iteration_metrics(run: RunDir, iteration: int) -> dict[str, Any]:
    line: dict[str, Any] = {"iteration": iteration}
    for stage in ITERATION_STAGES:
        line.update(read_metrics(run.stage_dir(iteration, stage)))
    line.update(read_metrics(run.eval_dir(iteration)))
    return line


def rebuild(run: RunDir, last_iteration: int) -> list[dict[str, Any]]:
    """Rewrite metrics.jsonl for iterations 0..last_iteration; returns the lines."""
    lines = [iteration_metrics(run, n) for n in range(last_iteration + 1)]
    lines = [line for line in lines if len(line) > 1]
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
    atomic_write_bytes(run.metrics_path, text.encode())
    return lines


def read_log(run: RunDir) -> list[dict[str, Any]]:
    if not run.metrics_path.is_file():
        return []
    return [json.loads(line) for line in run.metrics_path.read_text().splitlines() if line]
