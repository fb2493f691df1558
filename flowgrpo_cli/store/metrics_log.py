"""RUN/metrics.jsonl, one line per iteration, rebuilt from the stage folders.

Every stage writes its own metrics.json next to its manifest; the log is derived from them, so
a resumed run never duplicates or loses a line. The experiment trackers are fed from it
(reporting.trackers). The drift rule's `eval/drift` is derived from the lines themselves.
"""

from __future__ import annotations

import json
from typing import Any

from flowgrpo_cli import untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.evaluations import DRIFT_METRIC, drift_by_evaluation
from flowgrpo_cli.store.rundir import ITERATION_STAGES, RunDir, atomic_write_bytes, read_metrics


def iteration_metrics(run: RunDir, iteration: int) -> dict[str, Any]:
    line: dict[str, Any] = {"iteration": iteration}
    for stage in ITERATION_STAGES:
        line.update(read_metrics(run.stage_dir(iteration, stage)))
    line.update(read_metrics(run.eval_dir(iteration)))
    return line


def rebuild(run: RunDir, last_iteration: int, *, drift_window: int) -> list[dict[str, Any]]:
    """Rewrite metrics.jsonl for iterations 0..last_iteration; returns the lines.

    Each evaluation's line that the drift rule assesses (`drift_window` > 0, eval.drift_window;
    store.evaluations) gets `eval/drift`: 1 when the training reward rose while the held-out
    reward fell over the window ending there, else 0."""
    lines = [iteration_metrics(run, n) for n in range(last_iteration + 1)]
    lines = [line for line in lines if len(line) > 1]
    if drift_window:
        drifts = drift_by_evaluation(lines, drift_window)
        for line in lines:
            drift = drifts.get(line["iteration"])
            if drift is not None:
                line[DRIFT_METRIC] = float(drift.drifting)
    text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
    atomic_write_bytes(run.metrics_path, text.encode())
    return lines


def read_log(run: RunDir) -> list[dict[str, Any]]:
    """The log's lines; a line that is not a JSON object with an integer `iteration` (a
    truncated or edited file) is a FlowGrpoError naming the file and line."""
    path = run.metrics_path
    if not path.is_file():
        return []
    lines = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = untrusted.loads(raw)
        except untrusted.BadJSON as err:
            raise FlowGrpoError(
                f"{path}:{number}: {err}; delete the line or the file (the loop rebuilds it "
                "from the stage folders)"
            ) from None
        iteration = line.get("iteration") if isinstance(line, dict) else None
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise FlowGrpoError(
                f"{path}:{number}: expected a JSON object with an integer `iteration`, got "
                f"{raw[:80].decode('utf-8', 'replace')!r}"
            )
        lines.append(line)
    return lines
