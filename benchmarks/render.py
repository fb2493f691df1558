"""The results as a console table (rich) and as markdown for docs/performance.md."""

from __future__ import annotations

import io

from benchmarks.common import Report, Row, Section

COLUMNS = ("benchmark", "measured A", "measured B", "ratio A/B", "goal", "met", "note")


def _cells(row: Row) -> list[str]:
    return [row.benchmark, row.a, row.b, row.ratio, row.goal, row.met, row.note]


def console_table(report: Report) -> str:
    from rich.table import Table

    table = Table(title="flowgrpo benchmarks", show_lines=True)
    for name in COLUMNS:
        table.add_column(name, overflow="fold", max_width=70 if name == "note" else None)
    for row in report.rows:
        table.add_row(*_cells(row))
    return _render(table)


def console_section(section: Section) -> str:
    from rich.table import Table

    table = Table(title=section.title)
    for name in section.header:
        table.add_column(name)
    for row in section.rows:
        table.add_row(*(cell.replace("**", "") for cell in row))
    return _render(table)


def _render(renderable) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=180, force_terminal=False, color_system=None).print(renderable)
    return buffer.getvalue()


def _md_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    def clean(cell: str) -> str:
        return cell.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(clean(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: Report, info: dict[str, str], chosen: list[str], reps: int) -> str:
    out = [
        "# flowgrpo benchmarks",
        "",
        f"Measured {info['date']} with `just bench` (`python -m benchmarks`), "
        f"commit {info['commit']}.",
        "",
        f"- Machine: {info['cpu']}, {info['cores']}; torch {info['torch']}, "
        f"Python {info['python']}; {info['threads']}.",
        f"- Load: {info['load']} (a shared machine: compare ratios, not absolute times).",
        f"- Method: each comparison alternates its sides in the same process (A B, B A, ...), "
        f"{reps} timed rounds after one untimed warm-up round; A and B are medians, the "
        "ratio is the median of the per-round ratios A_i / B_i; in parentheses the same "
        "ratio of process CPU times (`time.process_time`; subprocesses: `RUSAGE_CHILDREN`), "
        "which time lost to other processes does not inflate (nor fsync waits). Nothing is "
        "asserted.",
        f"- Benchmarks run: {', '.join(chosen)}; total {info['duration']}.",
        "",
        _md_table(COLUMNS, [_cells(row) for row in report.rows]),
        "",
    ]
    for section in report.sections:
        out += [f"### {section.title}", "", _md_table(section.header, section.rows), ""]
        if section.text:
            out += [section.text, ""]
    return "\n".join(out)
