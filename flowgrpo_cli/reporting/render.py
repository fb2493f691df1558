"""Rich renderings of stage results for the terminal (the stages themselves print nothing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowgrpo_cli.store.evaluations import METRIC, TRAIN_METRIC, Best, Drift
from flowgrpo_cli.store.prompts import NO_TARGET, OTHER_REWARD_HINT
from flowgrpo_cli.store.rundir import RunDir

# What the renderings read of objects from the layers above reporting (which it may not import,
# even for typing: tests/test_architecture.py), as protocols those objects satisfy.


class RewardScores(Protocol):
    """Per-image reward results: rewards.rewardset.ScoreResult."""

    @property
    def names(self) -> Sequence[str]: ...
    @property
    def columns(self) -> Mapping[str, Sequence[float | None]]: ...
    @property
    def reward(self) -> Sequence[float | None]: ...
    @property
    def reward_error(self) -> Sequence[str | None]: ...
    @property
    def details(self) -> Mapping[str, Mapping[str, Sequence[object]]]: ...


class IterationLine(Protocol):
    """A finished loop iteration: loop.IterationSummary."""

    @property
    def iteration(self) -> int: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...
    @property
    def seconds(self) -> float: ...


def render_prepare_summary(console: Console, run: RunDir, manifest: dict[str, Any]) -> None:
    summary = manifest["summary"]
    table = Table(title=f"prompts -> {run.data_dir}", show_edge=False)
    for column in (
        "split",
        "prompts",
        "duplicates",
        "target chars min/median/max",
        "target length histogram",
    ):
        table.add_column(column)
    for split, count in manifest["counts"].items():
        stats = summary["target_length"][split]
        lengths = f"{stats['min']}/{stats['median']:g}/{stats['max']}" if stats else "-"
        histogram = "  ".join(f"{k}:{v}" for k, v in stats.get("histogram", {}).items())
        table.add_row(split, str(count), str(len(summary["duplicates"][split])), lengths, histogram)
    console.print(table)
    if summary["skipped_invalid"]:
        console.print(f"[yellow]skipped {summary['skipped_invalid']} invalid row(s)[/]")
    for split, duplicates in summary["duplicates"].items():
        for dup in duplicates[:5]:
            console.print(
                f"[yellow]duplicate in {split}:[/] {', '.join(dup['sources'])}", highlight=False
            )
    if summary["train_test_overlap"]:
        console.print(
            f"[yellow]{len(summary['train_test_overlap'])} prompt(s) appear in both "
            "train and test[/]"
        )


def render_scores(console: Console, manifest: dict[str, Any]) -> None:
    table = Table(title="rewards", show_edge=False)
    for column in ("reward", "mean", "min", "max", "images"):
        table.add_column(column, justify="right")
    for name, stats in manifest["stats"].items():
        cells = [f"{stats[k]:.4f}" if stats[k] is not None else "-" for k in ("mean", "min", "max")]
        table.add_row(name, *cells, str(stats["count"]))
    console.print(table)
    counts = manifest["counts"]
    if counts["failed"]:
        console.print(
            f"[yellow]{counts['failed']} image(s) failed a reward, {counts['dropped']} dropped "
            f"(on_error = {manifest['on_error']}); first: {manifest['first_errors'][:3]}[/]"
        )


def render_metrics(console: Console, title: str, metrics: dict[str, float]) -> None:
    table = Table(title=title, show_edge=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in sorted(metrics):
        table.add_row(key, f"{metrics[key]:.6g}")
    console.print(table)


def render_reward_table(console: Console, images: Sequence[Path], result: RewardScores) -> None:
    table = Table(show_edge=False)
    table.add_column("image")
    for name in result.names:
        table.add_column(name, justify="right")
    table.add_column("reward", justify="right")
    read = result.details.get("ocr", {}).get("text")
    if read is not None:
        table.add_column("OCR read")
    replied = result.details.get("vlm", {}).get("reply")
    if replied is not None:
        table.add_column("VLM reply")
    table.add_column("error")
    for i, image in enumerate(images):
        values = [_number(result.columns[name][i]) for name in result.names]
        row = [str(image), *values, _number(result.reward[i])]
        if read is not None:
            row.append(repr(read[i]) if read[i] is not None else "-")
        if replied is not None:
            row.append(repr(replied[i]) if replied[i] is not None else "-")
        row.append(result.reward_error[i] or "")
        table.add_row(*row)
    console.print(table)
    if any(NO_TARGET in (error or "") for error in result.reward_error):
        console.print(OTHER_REWARD_HINT, highlight=False, markup=False)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def updates(count: int) -> str:
    """`1 update`, `30 updates`: how every output names a policy. Iteration N (0-based) samples
    with the policy after N updates and makes the (N+1)-th, saved as checkpoint iter-N;
    eval/iter-M evaluates the policy after M updates (checkpoint iter-(M-1); M = 0: the base)."""
    return f"{count} update{'' if count == 1 else 's'}"


def checkpoint_name(iteration: int) -> str:
    """`checkpoint iter-000029`: the folder name under checkpoints/."""
    return f"checkpoint iter-{iteration:06d}"


def describe_best(best: Best) -> str:
    """The best held-out evaluation in one line: which, its weights, its value."""
    of = f"best of {best.evaluations} evaluation{'' if best.evaluations == 1 else 's'}"
    if best.checkpoint is None:
        return (
            f"eval/iter-{best.iteration:06d}, the base model: {METRIC} {best.value:.4g} "
            f"({of}; no checkpoint beat the base model)"
        )
    return (
        f"eval/iter-{best.iteration:06d}, {checkpoint_name(best.checkpoint)} (the policy after "
        f"{updates(best.iteration)}): {METRIC} {best.value:.4g} ({of})"
    )


def describe_drift(drift: Drift) -> str:
    """The drift rule's finding in one line: which evaluations, both series and slopes."""
    first, last = drift.points[0].iteration, drift.points[-1].iteration
    trains = " -> ".join(f"{p.train:.4g}" for p in drift.points if p.train is not None)
    held_out = " -> ".join(f"{p.held_out:.4g}" for p in drift.points)
    verb = "rose" if drift.train_slope > 0 else "did not rise"
    held_verb = "fell" if drift.held_out_slope < 0 else "did not fall"
    return (
        f"drift at eval/iter-{last:06d}: over {len(drift.points)} evaluations (eval/iter-"
        f"{first:06d} to eval/iter-{last:06d}) the training {TRAIN_METRIC} {verb} ({trains}, "
        f"least-squares slope {drift.train_slope:+.3g} per iteration) while the held-out "
        f"{METRIC} {held_verb} ({held_out}, slope {drift.held_out_slope:+.3g} per iteration): "
        "the policy may be exploiting the reward (see Troubleshooting, reward hacking)"
    )


def render_iteration(console: Console, summary: IterationLine) -> None:
    """One line per finished loop iteration: the numbers people watch."""
    m = summary.metrics
    parts = [f"[bold]iteration {summary.iteration}[/]", f"{summary.seconds:.1f} s"]
    for key, label in (
        ("reward/mean", "reward"),
        ("update/kl_reference", "kl"),
        ("update/kl_gaussian", "kl (gaussian)"),
        ("update/clipfrac", "clipfrac"),
        ("update/logprob_gap_max", "gap"),
    ):
        if key in m:
            parts.append(f"{label} {m[key]:.4g}")
    evals = {k: v for k, v in m.items() if k.startswith("eval/") and k.endswith("_mean")}
    parts += [f"{k} {v:.4g}" for k, v in sorted(evals.items())]
    console.print(" | ".join(parts), highlight=False)
    failures = getattr(summary, "score_failures", "")
    if failures:  # score/failed_images > 0: say it, as `flowgrpo score` does
        console.print(f"[yellow]  {escape(failures)}[/]", highlight=False)


def render_loop_progress(console: Console, done: int, total: int, seconds: list[float]) -> None:
    """The loop's overall line after each iteration: N/M done and an ETA from the mean
    iteration time of this process (`seconds`, one per iteration it ran)."""
    mean = sum(seconds) / len(seconds) if seconds else 0.0
    line = f"{done}/{total} iterations done"
    if done < total:
        line += f", ETA {format_duration(mean * (total - done))}"
    console.print(f"{line} (mean {mean:.1f} s per iteration)", highlight=False)


def format_duration(seconds: float) -> str:
    """A duration as people read it: 42 s, 3m 20s, 2h 05m."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    return f"{minutes // 60}h {minutes % 60:02d}m"


def format_bytes(count: float) -> str:
    """A size in decimal units: 3.3 GB, 65.5 kB, 619 B."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"
