"""Reading prompt files: the paper's OCR text format, jsonl, csv and parquet.

Every row keeps where it came from (`file:line`), so each problem can be reported at its line;
a file with problems is an error listing them all, unless the caller asks to skip invalid rows.
The OCR target is the first quoted span of the prompt ("..." or “...”) unless the file gives
a `ground_truth` column.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from flowgrpo_cli.errors import FlowGrpoError

# The first quoted span: straight double quotes, or curly ones opened with “ and closed with ”.
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".csv", ".parquet")
_MAX_LISTED = 10


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    ground_truth: str
    negative_prompt: str | None
    source: str  # "file:line", for messages and traceability


@dataclass(frozen=True)
class PromptProblem:
    source: str
    message: str


@dataclass(frozen=True)
class PromptFile:
    rows: list[PromptRow]
    problems: list[PromptProblem]


def extract_target(prompt: str) -> str | None:
    """The text inside the first quoted span, or None when there is none (or it is empty)."""
    match = _QUOTED.search(prompt)
    if match is None:
        return None
    target = match.group(1) if match.group(1) is not None else match.group(2)
    return target if target.strip() else None


def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise FlowGrpoError(
            f"{path}:{line}:{column}: not UTF-8 (byte 0x{data[err.start]:02x}); "
            "save the file as UTF-8"
        ) from None


def _row(
    prompt: object, ground_truth: object, negative: object, source: str
) -> PromptRow | PromptProblem:
    if not isinstance(prompt, str) or not prompt.strip():
        return PromptProblem(source, "empty prompt")
    prompt = prompt.strip()
    if isinstance(ground_truth, str) and ground_truth.strip():
        target = ground_truth.strip()
    elif ground_truth not in (None, "") and not _is_missing(ground_truth):
        return PromptProblem(source, f"ground_truth must be text, got {ground_truth!r}")
    else:
        target = extract_target(prompt)
        if target is None:
            return PromptProblem(source, f"no quoted target text in {_clip(prompt)!r}")
    negative_text = negative if isinstance(negative, str) and negative.strip() else None
    return PromptRow(prompt, target, negative_text, source)


def _is_missing(value: object) -> bool:
    return isinstance(value, float) and value != value  # pandas' NaN for an empty cell


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _read_txt(path: Path) -> list[PromptRow | PromptProblem]:
    lines = _decode(path).splitlines()
    return [
        _row(line, None, None, f"{path}:{number}") for number, line in enumerate(lines, start=1)
    ]


def _read_jsonl(path: Path) -> list[PromptRow | PromptProblem]:
    out: list[PromptRow | PromptProblem] = []
    for number, line in enumerate(_decode(path).splitlines(), start=1):
        source = f"{path}:{number}"
        if not line.strip():
            out.append(PromptProblem(source, "empty line"))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            out.append(PromptProblem(f"{source}:{err.colno}", f"invalid JSON: {err.msg}"))
            continue
        if not isinstance(obj, dict) or "prompt" not in obj:
            out.append(PromptProblem(source, "expected a JSON object with a `prompt` key"))
            continue
        out.append(_row(obj["prompt"], obj.get("ground_truth"), obj.get("negative_prompt"), source))
    return out


def _read_table(path: Path) -> list[PromptRow | PromptProblem]:
    import pandas as pd

    if path.suffix == ".csv":
        _decode(path)  # a clear message, with line and column, for a non-UTF-8 file
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
        first_line = 2  # line 1 is the header
    else:
        try:
            frame = pd.read_parquet(path)
        except Exception as err:  # pyarrow raises several types for a broken file
            raise FlowGrpoError(f"{path}: cannot read as parquet ({err})") from None
        first_line = 0  # parquet has rows, not lines: report the row index
    if "prompt" not in frame.columns:
        raise FlowGrpoError(f"{path}: no `prompt` column (columns: {', '.join(frame.columns)})")
    label = "" if path.suffix == ".csv" else "row "
    return [
        _row(
            rec.get("prompt"),
            rec.get("ground_truth"),
            rec.get("negative_prompt"),
            f"{path}:{label}{index + first_line}",
        )
        for index, rec in enumerate(frame.to_dict("records"))
    ]


def read_prompt_file(path: Path) -> PromptFile:
    """Parse one prompt file; raises FlowGrpoError for a file it cannot read at all."""
    if not path.is_file():
        raise FlowGrpoError(f"prompt file {path} does not exist")
    readers = {
        ".txt": _read_txt,
        ".jsonl": _read_jsonl,
        ".csv": _read_table,
        ".parquet": _read_table,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise FlowGrpoError(
            f"{path}: unsupported prompt file type {path.suffix!r} "
            f"(supported: {', '.join(SUPPORTED_SUFFIXES)})"
        )
    items = reader(path)
    rows = [item for item in items if isinstance(item, PromptRow)]
    problems = [item for item in items if isinstance(item, PromptProblem)]
    return PromptFile(rows, problems)


def format_problems(problems: list[PromptProblem]) -> str:
    listed = [f"{p.source}: {p.message}" for p in problems[:_MAX_LISTED]]
    more = len(problems) - len(listed)
    if more:
        listed.append(f"... and {more} more")
    return "\n  ".join(listed)
