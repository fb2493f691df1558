"""The prepared prompt tables, RUN/data/{train,test}.parquet, read back and checked.

Rollout and evaluation read them after their checksums were verified; a file whose bytes match
a re-hashed manifest but that is not what `flowgrpo prepare` writes (not parquet, a column
missing, a value of another type) is still refused with the file, the row and the column named.
An editing data set's source images are read apart (`source_images`), for the prompts asked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, TypedDict

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import RunDir


class PromptTableRow(TypedDict):
    """One row of a prompt table as read_split returns it (checked against COLUMNS)."""

    prompt_index: int
    prompt: str
    ground_truth: str | None
    negative_prompt: str | None
    system_prompt: str | None
    geneval: str | None  # the GenEval record as JSON; None without one, or in older runs


# The columns the stages read, and what each value may be (None: a null is allowed).
COLUMNS: dict[str, tuple[type, ...]] = {
    "prompt_index": (int,),
    "prompt": (str,),
    "ground_truth": (str, type(None)),
    "negative_prompt": (str, type(None)),
    "system_prompt": (str, type(None)),
    "geneval": (str, type(None)),
}
# Columns a run prepared by an older version lacks: read as nulls.
_OPTIONAL = ("geneval",)


def read_split(run: RunDir, split: str) -> list[PromptTableRow]:
    """The rows of data/SPLIT.parquet (`train` or `test`), with the columns stages read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, redo = run.data_dir / f"{split}.parquet", _redo(run)
    try:
        present = set(pq.read_schema(path).names)  # COLUMNS alone: no source images
        table = pq.read_table(path, columns=[c for c in COLUMNS if c in present])
    except (pa.ArrowException, OSError) as err:
        raise FlowGrpoError(f"{path}: not a readable parquet file ({err}); {redo}") from None
    for column in _OPTIONAL:
        if column not in table.column_names:
            table = table.append_column(column, pa.nulls(table.num_rows, pa.string()))
    missing = sorted(set(COLUMNS) - set(table.column_names))
    if missing:
        raise FlowGrpoError(f"{path} lacks column(s) {missing}: {redo}")
    rows = table.select(list(COLUMNS)).to_pylist()  # PromptTableRow each, once checked
    for number, row in enumerate(rows):
        for column, kinds in COLUMNS.items():
            value = row[column]
            if not isinstance(value, kinds) or isinstance(value, bool):
                wanted = " or ".join(k.__name__ for k in kinds if k is not type(None))
                wanted += " or null" if type(None) in kinds else ""
                raise FlowGrpoError(
                    f"{path}: row {number}, column `{column}` is {value!r}, not a {wanted}; {redo}"
                )
    return rows


def source_images(run: RunDir, split: str, indices: Iterable[int]) -> dict[int, bytes]:
    """prompt_index -> the PNG bytes of its source image, for the prompts `indices` of
    data/SPLIT.parquet; {} for a text-to-image data set (no `source_image` column). Reads the
    row groups that hold those prompts alone (prepare keeps them small)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, wanted = run.data_dir / f"{split}.parquet", sorted(set(indices))
    try:
        if not wanted or "source_image" not in pq.read_schema(path).names:
            return {}
        table = pq.read_table(
            path, columns=["prompt_index", "source_image"],
            filters=[("prompt_index", "in", wanted)],
        )  # fmt: skip
    except (pa.ArrowException, OSError) as err:
        raise FlowGrpoError(f"{path}: not a readable parquet file ({err}); {_redo(run)}") from None
    found = dict(zip(*table.to_pydict().values(), strict=True))
    for index in wanted:
        if not isinstance(found.get(index), bytes):
            raise FlowGrpoError(f"{path}: prompt_index {index} has no source image; {_redo(run)}")
    return found


def has_source_images(run: RunDir) -> bool:
    """Whether the run's prompts are an editing data set's (data/train.parquet has the
    `source_image` column); False when the table is missing or unreadable."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return "source_image" in pq.read_schema(run.data_dir / "train.parquet").names
    except (pa.ArrowException, OSError):
        return False


def _redo(run: RunDir) -> str:
    return f"delete {run.data_dir} and run `flowgrpo prepare` again"


def geneval_records(rows: list[PromptTableRow]) -> dict[int, dict[str, Any]]:
    """prompt_index -> its GenEval record, for the rows that have one (the score and evaluate
    stages hand them to the rewards; trajectories carry only the prompt_index)."""
    return {
        row["prompt_index"]: json.loads(row["geneval"])
        for row in rows
        if row["geneval"] is not None
    }
