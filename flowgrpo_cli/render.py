"""Rich renderings of stage results for the terminal (the stages themselves print nothing)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from flowgrpo_cli.rundir import RunDir


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
