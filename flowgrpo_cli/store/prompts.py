"""Reading prompt files: the paper's OCR text format, jsonl, csv and parquet.

Every row keeps where it came from (`file:line`), so each problem can be reported at its line;
a file with problems is an error listing them all, unless the caller asks to skip invalid rows.
The target (the text an OCR reward reads for) is the first quoted span of the prompt ("..." or
“...”) unless the file gives a `ground_truth` column; a prompt may have none, and is then
refused only when a reward that needs targets will score it (`needs_target`). A jsonl row
that is a GenEval metadata record (it has GenEval's `include` key) keeps the record, checked
by the caller's `check_record` (prepare passes the geneval reward's rules); a reward that
reads records refuses rows without one (`needs_record`). A row of an editing data set names its
source image in an `image` column (jsonl, csv, parquet: a path relative to the file; parquet
also the image's bytes, plain or as Hugging Face's `{bytes, path}` struct); each image is read
and checked (flowgrpo_cli.store.source_images), and a bad one is a problem of its row.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flowgrpo_cli import untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import MAX_IMAGE_PIXELS
from flowgrpo_cli.store.source_images import SourceImage, load_source_image

# The first quoted span: straight double quotes, or curly ones opened with “ and closed with ”.
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".csv", ".parquet")
GENEVAL_KEYS = ("tag", "include", "exclude", "prompt")  # what a GenEval record keeps
_MAX_LISTED = 10


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    ground_truth: str | None  # None: no target (fine unless a reward needs one)
    negative_prompt: str | None
    source: str  # "file:line", for messages and traceability
    geneval: str | None = None  # the row's GenEval record, compact JSON with sorted keys
    # An editing data set's source image as the file gives it: a path (resolved against the
    # file's folder) or a parquet cell's bytes; read and checked into `source_image`.
    image: Path | bytes | None = None
    source_image: SourceImage | None = None


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


def _lines(path: Path) -> list[str | PromptProblem]:
    """The file's lines, split on "\n" only (a "\r" before it is dropped), each decoded as UTF-8
    on its own: a line that is not UTF-8 is a problem at its line and column, not the end of
    the file. Form feeds, vertical tabs and U+2028 are characters inside a line, as they are
    to an editor that counts lines the way compilers and `wc -l` do."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")
    pieces = data.split(b"\n")
    if pieces[-1] == b"":  # the newline ending the last line
        pieces.pop()
    out: list[str | PromptProblem] = []
    for number, raw in enumerate(pieces, start=1):
        try:
            out.append(raw.removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as err:
            out.append(PromptProblem(
                f"{path}:{number}:{err.start + 1}",
                f"not UTF-8 (byte 0x{raw[err.start]:02x}); save the file as UTF-8",
            ))  # fmt: skip
    return out


def _row(
    prompt: object, ground_truth: object, negative: object, source: str
) -> PromptRow | PromptProblem:
    for key, value in (("prompt", prompt), ("ground_truth", ground_truth),
                       ("negative_prompt", negative)):  # fmt: skip
        if value is not None and not isinstance(value, str) and not _is_missing(value):
            return PromptProblem(source, f"{key} is not a string: {_clip(repr(value))}")
    if not isinstance(prompt, str) or not prompt.strip():
        return PromptProblem(source, "empty prompt")
    prompt = prompt.strip()
    target: str | None
    if isinstance(ground_truth, str) and ground_truth.strip():
        target = ground_truth.strip()
    else:
        target = extract_target(prompt)
    negative_text = negative if isinstance(negative, str) and negative.strip() else None
    return PromptRow(prompt, target, negative_text, source)


def _is_missing(value: object) -> bool:
    return isinstance(value, float) and value != value  # pandas' NaN for an empty cell


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _read_txt(path: Path) -> list[PromptRow | PromptProblem]:
    return [
        line if isinstance(line, PromptProblem) else _row(line, None, None, f"{path}:{number}")
        for number, line in enumerate(_lines(path), start=1)
    ]


def _read_jsonl(path: Path) -> list[PromptRow | PromptProblem]:
    out: list[PromptRow | PromptProblem] = []
    for number, line in enumerate(_lines(path), start=1):
        source = f"{path}:{number}"
        if isinstance(line, PromptProblem):
            out.append(line)
            continue
        if not line.strip():
            out.append(PromptProblem(source, "empty line"))
            continue
        try:
            obj = untrusted.loads(line)
        except untrusted.BadJSON as err:
            if err.column is not None:  # not JSON: where the parser stopped
                where, what = f"{source}:{err.column}", str(err).replace("not JSON", "invalid JSON")
            else:  # too deep, a huge number, a lone surrogate
                where, what = source, str(err)
            out.append(PromptProblem(where, what))
            continue
        if not isinstance(obj, dict) or "prompt" not in obj:
            out.append(PromptProblem(source, "expected a JSON object with a `prompt` key"))
            continue
        row = _row(obj["prompt"], obj.get("ground_truth"), obj.get("negative_prompt"), source)
        if isinstance(row, PromptRow) and "include" in obj:  # GenEval's metadata format
            record = {key: obj[key] for key in GENEVAL_KEYS if key in obj}
            text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            row = dataclasses.replace(row, geneval=text)
        out.append(_with_image(row, obj.get("image"), path))
    return out


def _read_csv(path: Path) -> list[PromptRow | PromptProblem]:
    """RFC 4180 CSV with a header row, parsed strictly: a stray quote is an error at its lines
    rather than a silent merge of two rows, and a field running over several lines (what an
    unbalanced quote that closes later looks like) is a problem of its row."""
    import csv

    lines = _lines(path)
    # The csv module refuses fields over 128 KiB; the file is in memory already, so a field
    # as long as the whole file costs nothing more (a long prompt is not a broken quote).
    longest = sum(len(line) + 1 for line in lines if isinstance(line, str))
    csv.field_size_limit(max(csv.field_size_limit(), longest))
    undecodable = {n: line for n, line in enumerate(lines, 1) if isinstance(line, PromptProblem)}
    reader = csv.reader(
        [("" if isinstance(line, PromptProblem) else line) + "\n" for line in lines], strict=True
    )
    records: list[tuple[int, list[str]]] = []
    while True:
        first = reader.line_num + 1
        try:
            records.append((first, next(reader)))
        except StopIteration:
            break
        except csv.Error as err:
            raise FlowGrpoError(
                f"{path}:{first}: malformed CSV in lines {first}-{reader.line_num} ({err}); "
                "check for an unbalanced quote (a quote inside a field is written twice)"
            ) from None
    if not records or 1 in undecodable:
        raise FlowGrpoError(f"{path}:1: no header row (the column names, `prompt` among them)")
    header = records[0][1]
    if "prompt" not in header:
        raise FlowGrpoError(f"{path}: no `prompt` column (columns: {', '.join(header)})")
    out: list[PromptRow | PromptProblem] = []
    for first, fields in records[1:]:
        source = f"{path}:{first}"
        if first in undecodable:
            out.append(undecodable[first])
        elif not fields:
            out.append(PromptProblem(source, "empty line"))
        elif len(fields) != len(header):
            out.append(PromptProblem(source, f"{len(fields)} fields, the header has {len(header)}"))
        elif any("\n" in field for field in fields):
            last = first + sum(field.count("\n") for field in fields)
            out.append(PromptProblem(
                source, f"a quoted field runs over lines {first}-{last}; is a quote unbalanced?"
            ))  # fmt: skip
        else:
            rec = dict(zip(header, fields, strict=True))
            row = _row(rec["prompt"], rec.get("ground_truth"), rec.get("negative_prompt"), source)
            out.append(_with_image(row, rec.get("image"), path))
    return out


def _read_parquet(path: Path) -> list[PromptRow | PromptProblem]:
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except Exception as err:  # pyarrow raises several types for a broken file
        raise FlowGrpoError(f"{path}: cannot read as parquet ({err})") from None
    if "prompt" not in frame.columns:
        raise FlowGrpoError(f"{path}: no `prompt` column (columns: {', '.join(frame.columns)})")
    records = frame.to_dict("records")
    rows = [  # parquet has rows, not lines: report the row index
        _row(r.get("prompt"), r.get("ground_truth"), r.get("negative_prompt"), f"{path}:row {n}")
        for n, r in enumerate(records)
    ]
    return [_with_image(row, r.get("image"), path) for row, r in zip(rows, records, strict=True)]


def _with_image(
    row: PromptRow | PromptProblem, value: object, path: Path
) -> PromptRow | PromptProblem:
    """`row` with the source image its `image` field names (read later: `_loaded_image`): a
    path relative to the prompt file `path`, or a parquet cell's bytes, plain or in Hugging
    Face's `{bytes, path}` struct. No value, or an empty one, is a row without an image."""
    if not isinstance(row, PromptRow) or value is None or value == "" or _is_missing(value):
        return row
    if isinstance(value, dict):  # Hugging Face datasets' Image feature
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes):
        return dataclasses.replace(row, image=value)
    if isinstance(value, str) and value:
        return dataclasses.replace(row, image=path.parent / value)
    return PromptProblem(row.source, f"image is not a path or image bytes: {_clip(repr(value))}")


def _loaded_image(
    item: PromptRow | PromptProblem, max_pixels: int, size: Sequence[int]
) -> PromptRow | PromptProblem:
    if not isinstance(item, PromptRow) or item.image is None:
        return item
    try:
        image = load_source_image(item.image, max_pixels, size)
    except FlowGrpoError as err:
        return PromptProblem(item.source, str(err))
    return dataclasses.replace(item, source_image=image)


def read_prompt_file(
    path: Path,
    needs_target: str | None = None,
    needs_record: str | None = None,
    check_record: Callable[[dict], object] | None = None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    source_size: Sequence[int] = (),
) -> PromptFile:
    """Parse one prompt file; raises FlowGrpoError for a file it cannot read at all.
    `needs_target` names the reward that needs every prompt to have a target, if any: a row
    without one is then a problem that says so; `needs_record` likewise for GenEval records.
    `check_record` raises FlowGrpoError for a GenEval record that is not well formed: that
    row is then a problem with its message. A source image that is missing, unreadable or
    over `max_image_pixels` is a problem of its row too; the others are resized to
    `source_size` ([width, height]) when it is given."""
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise FlowGrpoError(f"prompt file {path} {what}")
    readers = {
        ".txt": _read_txt,
        ".jsonl": _read_jsonl,
        ".csv": _read_csv,
        ".parquet": _read_parquet,
    }
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise FlowGrpoError(
            f"{path}: unsupported prompt file type {path.suffix!r} "
            f"(supported: {', '.join(SUPPORTED_SUFFIXES)})"
        )
    items = [_loaded_image(item, max_image_pixels, source_size) for item in reader(path)]
    if needs_target is not None:
        items = [_require_target(item, needs_target) for item in items]
    if check_record is not None:
        items = [_checked_record(item, check_record) for item in items]
    if needs_record is not None:
        items = [_require_record(item, needs_record) for item in items]
    rows = [item for item in items if isinstance(item, PromptRow)]
    problems = [item for item in items if isinstance(item, PromptProblem)]
    return PromptFile(rows, problems)


def _require_target(item: PromptRow | PromptProblem, reward: str) -> PromptRow | PromptProblem:
    if not isinstance(item, PromptRow) or item.ground_truth is not None:
        return item
    return PromptProblem(
        item.source,
        f"{NO_TARGET} in {_clip(item.prompt)!r}; the `{reward}` reward needs one "
        '(quote it in the prompt, "like this", or give a ground_truth column)',
    )


def _checked_record(
    item: PromptRow | PromptProblem, check: Callable[[dict], object]
) -> PromptRow | PromptProblem:
    if not isinstance(item, PromptRow) or item.geneval is None:
        return item
    try:
        check(json.loads(item.geneval))
    except FlowGrpoError as err:
        return PromptProblem(item.source, str(err))
    return item


def _require_record(item: PromptRow | PromptProblem, reward: str) -> PromptRow | PromptProblem:
    if not isinstance(item, PromptRow) or item.geneval is not None:
        return item
    return PromptProblem(
        item.source,
        f"no GenEval record for {_clip(item.prompt)!r}; the `{reward}` reward needs one "
        "(a jsonl row in GenEval's metadata format: tag, include, exclude, prompt)",
    )


NO_TARGET = "no quoted target text"


OTHER_REWARD_HINT = (
    "prompts without text to render need a reward that reads no target: "
    "--set 'reward.weights={jpeg_compressibility = 1.0}' ({geneval = 1.0} for GenEval "
    "metadata), `remote`, or a plugin "
    "(module:function; see `flowgrpo reward --help`)"
)


def other_reward_hint(problems: list[PromptProblem]) -> str:
    """For rows refused for want of a target: how to train on prompts without text."""
    if not any(p.message.startswith(NO_TARGET) for p in problems):
        return ""
    return f"\n  {OTHER_REWARD_HINT}"


def format_problems(problems: list[PromptProblem]) -> str:
    listed = [f"{p.source}: {p.message}" for p in problems[:_MAX_LISTED]]
    more = len(problems) - len(listed)
    if more:
        listed.append(f"... and {more} more")
    return "\n  ".join(listed)
