"""`flowgrpo plan` on the terminal: memory per stage, disk, passes, as rich tables."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowgrpo_cli.planning import RunPlan
from flowgrpo_cli.reporting.render import format_bytes


def render_plan(console: Console, plan: RunPlan) -> None:
    console.print(
        f"[bold]plan[/] of {escape(plan.architecture)}: {plan.config_summary}, "
        f"{plan.nproc} process(es), {plan.iterations} iterations",
        highlight=False,
    )
    for stage, memory in plan.memory.items():
        table = Table(title=f"{stage}: memory per device", show_edge=False, title_justify="left")
        table.add_column("what")
        table.add_column("bytes", justify="right")
        for label, size in memory.items:
            table.add_row(escape(label), format_bytes(size))
        table.add_row("[bold]peak[/]", f"[bold]{format_bytes(memory.total_bytes)}[/]")
        console.print(table)
    table = Table(title="disk", show_edge=False, title_justify="left")
    table.add_column("what")
    table.add_column("per iteration", justify="right")
    table.add_column(f"{plan.iterations} iterations", justify="right")
    for (label, per_iteration), (_, total) in zip(
        plan.disk_per_iteration, plan.disk_total, strict=True
    ):
        table.add_row(escape(label), format_bytes(per_iteration), format_bytes(total))
    table.add_row(
        "[bold]total[/]",
        f"[bold]{format_bytes(plan.disk_per_iteration_bytes)}[/]",
        f"[bold]{format_bytes(plan.disk_total_bytes)}[/]",
    )
    console.print(table)
    table = Table(title="transformer passes", show_edge=False, title_justify="left")
    for column in ("stage", "images", "forwards", "backwards", "per device (fwd / bwd)", "what"):
        table.add_column(column, justify="left" if column in ("stage", "what") else "right")
    for stage, passes in plan.passes.items():
        share = passes.per_gpu(plan.nproc)
        label = stage if stage != "evaluate" else f"evaluate (x{plan.evaluations} in the run)"
        table.add_row(
            label,
            f"{passes.images:,}",
            f"{passes.forwards:,}",
            f"{passes.backwards:,}",
            f"{share['forwards']:,.0f} / {share['backwards']:,.0f}",
            passes.note,
        )
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {escape(note)}", highlight=False)
    for line in plan.summary_lines():
        console.print(escape(line), highlight=False)
