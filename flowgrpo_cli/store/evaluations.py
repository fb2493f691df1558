"""A run's held-out evaluations over time: the best one so far (RUN/best.json) and drift, the
training reward rising while the held-out reward falls (reward hacking's signature).

Both are derived from what finished stage folders hold, each `eval/iter-N/metrics.json`'s
`eval/reward_mean` and each update's `reward/mean`, never from a loop's memory: a killed and
resumed loop computes exactly what an uninterrupted one did, and every command that needs the
best (retention, `flowgrpo export --best`, `report`, `inspect`) derives it again rather than
trust a file that could be stale.

**Best.** Of the finished evaluations eval/iter-N whose policy still counts as done (N = 0,
the base model, or checkpoint iter-(N-1) finished), the one with the highest
`eval/reward_mean`, the earliest on a tie; a value that is not finite never counts. N = 0
means no checkpoint beat the base model. `write_best` records it in RUN/best.json.

**Drift** at an evaluation, over a window of W >= 2 evaluations (`eval.drift_window`):

- the points are the last W evaluations up to it, at iterations e_1 < ... < e_W; each has
  h_k, its `eval/reward_mean`, and t_k, the mean `reward/mean` of iterations e_(k-1) to
  e_k - 1 (the rollouts between the previous evaluation and this one; for a run's first
  evaluation, every iteration before it);
- with fewer than W evaluations, or one among the last W without a training reward (the base
  model's, e = 0, has none), it is not assessed;
- the training reward rose when the least-squares slope of t_k against e_k is > 0, the held-out
  reward fell when the slope of h_k against e_k is < 0; slope = sum((e_k - mean e)(y_k)) /
  sum((e_k - mean e)^2), computed in exact fractions, so a flat series is 0 (neither);
- drift = rose and fell.

Example, every = 5, W = 3: evaluations at 5, 10, 15 with t = 0.2, 0.5, 0.6 and h = 0.7, 0.75,
0.6: slopes (5 * 0.6 - 5 * 0.2) / 50 = +0.04 and (5 * 0.6 - 5 * 0.7) / 50 = -0.01: drift.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from flowgrpo_cli.store.rundir import (
    EVAL,
    RunDir,
    atomic_write_json,
    numbered_folders,
    read_metrics,
)

METRIC = "eval/reward_mean"  # what "best" and "fell" are judged by
TRAIN_METRIC = "reward/mean"  # the rollouts' mean reward, from the update's metrics
DRIFT_METRIC = "eval/drift"  # 1 or 0 in an evaluation's line of metrics.jsonl, once assessed


@dataclass(frozen=True)
class Best:
    iteration: int  # eval/iter-N: the policy after N updates (0: the base model)
    value: float  # its eval/reward_mean
    evaluations: int  # how many evaluations it was chosen from

    @property
    def base(self) -> bool:
        return self.iteration == 0

    @property
    def checkpoint(self) -> int | None:
        """The checkpoint evaluated (checkpoints/iter-(N-1)); None for the base model."""
        return None if self.base else self.iteration - 1

    def record(self) -> dict[str, Any]:
        """best.json's content."""
        checkpoint = self.checkpoint
        return {
            "metric": METRIC,
            "value": self.value,
            "evaluation": f"{EVAL.folder}/iter-{self.iteration:06d}",
            "updates": self.iteration,
            "base": self.base,
            "checkpoint": None if checkpoint is None else f"checkpoints/iter-{checkpoint:06d}",
            "checkpoint_iteration": checkpoint,
            "evaluations": self.evaluations,
        }


def best_of(rewards: Iterable[tuple[int, float]]) -> Best | None:
    """The highest (iteration, value) pair, the earliest iteration on a tie, as a Best; pairs
    whose value is not finite do not count. None when none counts."""
    counted = [(n, v) for n, v in rewards if _finite(v)]
    if not counted:
        return None
    n, value = max(counted, key=lambda pair: (pair[1], -pair[0]))  # earliest on a tie
    return Best(n, float(value), len(counted))


def evaluation_rewards(run: RunDir) -> list[tuple[int, float]]:
    """(N, eval/reward_mean) of each finished eval/iter-N whose policy counts as done (N = 0
    or checkpoint iter-(N-1) finished), in order; evaluations without the metric are left out."""
    finished = run.current_iteration()  # checkpoints 0 .. finished - 1
    found = []
    for n, folder in numbered_folders(run.root / EVAL.folder).items():
        if n > finished:
            continue
        value = read_metrics(folder).get(METRIC)
        if value is not None and _finite(value):
            found.append((n, float(value)))
    return found


def best_evaluation(run: RunDir) -> Best | None:
    """The best held-out evaluation the run holds now (see the module docstring)."""
    return best_of(evaluation_rewards(run))


def write_best(run: RunDir) -> Best | None:
    """Record the best evaluation in RUN/best.json (atomically; removed when there is none)."""
    best = best_evaluation(run)
    if best is None:
        run.best_path.unlink(missing_ok=True)
    else:
        atomic_write_json(run.best_path, best.record())
    return best


@dataclass(frozen=True)
class EvaluationPoint:
    iteration: int  # eval/iter-N
    held_out: float  # its eval/reward_mean
    train: float | None  # mean reward/mean since the previous evaluation; None: no iteration


@dataclass(frozen=True)
class Drift:
    """The drift rule over one window of evaluations (the module docstring)."""

    points: tuple[EvaluationPoint, ...]
    train_slope: float  # least-squares slope of the training reward per iteration
    held_out_slope: float  # of the held-out eval/reward_mean

    @property
    def iteration(self) -> int:
        """The evaluation the window ends at."""
        return self.points[-1].iteration

    @property
    def drifting(self) -> bool:
        return self.train_slope > 0 and self.held_out_slope < 0


def slope(xs: Sequence[int], ys: Sequence[float]) -> float:
    """The least-squares slope of ys against xs, computed exactly (0 for a flat ys)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"slope: needs two or more (x, y) pairs, got {len(xs)} and {len(ys)}")
    mean = Fraction(sum(xs), len(xs))
    deviations = [x - mean for x in xs]
    spread = sum(d * d for d in deviations)
    if spread == 0:
        raise ValueError("slope: every x is the same")
    return float(sum(d * Fraction(y) for d, y in zip(deviations, ys, strict=True)) / spread)


def evaluation_points(lines: Iterable[Mapping[str, Any]]) -> list[EvaluationPoint]:
    """The evaluations of metrics.jsonl's lines, in order, each with its training reward."""
    train: dict[int, float] = {}
    held_out: dict[int, float] = {}
    for line in lines:
        n = line["iteration"]
        if _finite(line.get(TRAIN_METRIC)):
            train[n] = float(line[TRAIN_METRIC])
        if _finite(line.get(METRIC)):
            held_out[n] = float(line[METRIC])
    points, previous = [], 0
    for n in sorted(held_out):
        since = [train[i] for i in range(previous, n) if i in train]
        points.append(EvaluationPoint(n, held_out[n], sum(since) / len(since) if since else None))
        previous = n
    return points


def assess(points: Sequence[EvaluationPoint], window: int) -> Drift | None:
    """The drift rule over the last `window` points (None: not assessed, see the module
    docstring)."""
    if window < 2 or len(points) < window:
        return None
    last = tuple(points[-window:])
    trains = [p.train for p in last]
    if any(t is None for t in trains):
        return None
    xs = [p.iteration for p in last]
    return Drift(last, slope(xs, [t for t in trains if t is not None]),
                 slope(xs, [p.held_out for p in last]))  # fmt: skip


def drift_by_evaluation(lines: Iterable[Mapping[str, Any]], window: int) -> dict[int, Drift]:
    """Evaluation iteration -> the drift rule's window ending there, for each one assessed."""
    points = evaluation_points(lines)
    found = {}
    for end in range(len(points)):
        drift = assess(points[: end + 1], window)
        if drift is not None:
            found[drift.iteration] = drift
    return found


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
