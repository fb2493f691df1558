"""The trajectory store: rollout and score parts as Arrow IPC files, memory-mapped on read.

A rollout part holds one row per generated image (`TRAJECTORY_COLUMNS`); the rollout's
conditioning part holds one row per prompt group with the text conditioning the update needs,
stored once per prompt rather than per image (the update then needs no text encoder: on real
models that is several GB of weights it never loads). A score part holds one row per image:
`sample_id`, one float column per reward, the weighted `reward`, and `reward_error`.

Readers stream record batches from memory-mapped files, so no stage holds a whole iteration's
latents in memory.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import atomic_file

TRAJECTORY_COLUMNS = (
    "sample_id",  # unique in the run: i{iteration}-g{group}-k{index in group}
    "prompt_index",  # row of data/train.parquet
    "group_id",  # one per prompt per iteration
    "seed",  # the sample's generator seed: initial noise and every step's noise
    "prompt",
    "ground_truth",
    "timesteps",  # float32[T]: sigma of each stochastic step
    "timesteps_next",  # float32[T]: the sigma each of those steps goes to
    "trained",  # bool[T]: whether the update trains that step
    "log_probs",  # float32[T]: log-prob of the sampled next latent under the rollout policy
    "latents",  # float32[T+1, *latent_shape]: the states around the stochastic steps
    "image",  # PNG bytes
)
# The per-step columns. A rollout without stochastic steps (T = 0: nft, awm) leaves them out,
# and its `latents` holds the clean latent alone: Arrow has no fixed-size list of width 0.
STEP_COLUMNS = ("timesteps", "timesteps_next", "trained", "log_probs")


@dataclass(frozen=True)
class TrajectoryRows:
    """A batch of trajectory rows in memory (tensors on CPU). Shapes: B rows, T steps."""

    sample_ids: list[str]
    prompt_indices: list[int]
    group_ids: list[int]
    seeds: list[int]
    prompts: list[str]
    ground_truths: list[str | None]
    timesteps: torch.Tensor  # [B, T] float32
    timesteps_next: torch.Tensor  # [B, T] float32
    trained: torch.Tensor  # [B, T] bool
    log_probs: torch.Tensor  # [B, T] float32
    latents: torch.Tensor  # [B, T+1, *latent_shape] float32
    images: list[bytes]  # PNG


def _fixed_list(values: np.ndarray, pa_type: pa.DataType) -> pa.FixedSizeListArray:
    width = values.shape[1]
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa_type), width)


def _tensor_column(values: torch.Tensor) -> pa.ExtensionArray:
    return pa.FixedShapeTensorArray.from_numpy_ndarray(
        np.ascontiguousarray(values.detach().to(torch.float32).cpu().numpy())
    )


def to_record_batch(rows: TrajectoryRows) -> pa.RecordBatch:
    steps = {}
    if rows.log_probs.shape[1]:  # see STEP_COLUMNS
        steps = {
            "timesteps": _fixed_list(rows.timesteps.numpy().astype(np.float32), pa.float32()),
            "timesteps_next": _fixed_list(
                rows.timesteps_next.numpy().astype(np.float32), pa.float32()
            ),
            "trained": _fixed_list(rows.trained.numpy().astype(bool), pa.bool_()),
            "log_probs": _fixed_list(rows.log_probs.numpy().astype(np.float32), pa.float32()),
        }
    return pa.record_batch(
        {
            "sample_id": pa.array(rows.sample_ids, pa.string()),
            "prompt_index": pa.array(rows.prompt_indices, pa.int64()),
            "group_id": pa.array(rows.group_ids, pa.int64()),
            "seed": pa.array(rows.seeds, pa.int64()),
            "prompt": pa.array(rows.prompts, pa.string()),
            "ground_truth": pa.array(rows.ground_truths, pa.string()),
            **steps,
            "latents": _tensor_column(rows.latents),
            "image": pa.array(rows.images, pa.binary()),
        }
    )


def fixed_list_tensor(column: pa.Array, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fixed-size-list column as a [rows, width] tensor (a copy, safe to modify)."""
    width = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(np.array(flat, copy=True)).reshape(-1, width).to(dtype)


def tensor_column(column: pa.Array) -> torch.Tensor:
    """A fixed-shape tensor column as a [rows, *shape] tensor (a copy, safe to modify)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return torch.from_numpy(np.array(column.to_numpy_ndarray(), copy=True))


def from_record_batch(batch: pa.RecordBatch) -> TrajectoryRows:
    if "log_probs" not in batch.schema.names:  # no stochastic step: see STEP_COLUMNS
        empty = torch.zeros(batch.num_rows, 0)
        steps = {"timesteps": empty, "timesteps_next": empty,
                 "trained": empty.bool(), "log_probs": empty}  # fmt: skip
    else:
        steps = {
            "timesteps": fixed_list_tensor(batch.column("timesteps")),
            "timesteps_next": fixed_list_tensor(batch.column("timesteps_next")),
            "trained": fixed_list_tensor(batch.column("trained"), torch.bool),
            "log_probs": fixed_list_tensor(batch.column("log_probs")),
        }
    return TrajectoryRows(
        sample_ids=batch.column("sample_id").to_pylist(),
        prompt_indices=batch.column("prompt_index").to_pylist(),
        group_ids=batch.column("group_id").to_pylist(),
        seeds=batch.column("seed").to_pylist(),
        prompts=batch.column("prompt").to_pylist(),
        ground_truths=batch.column("ground_truth").to_pylist(),
        **steps,
        latents=tensor_column(batch.column("latents")),
        images=batch.column("image").to_pylist(),
    )


# ---------------------------------------------------------------------------------------------
# Files


class ArrowPartWriter:
    """Streams record batches into one Arrow IPC file, made visible atomically on close."""

    def __init__(self, path: Path):
        self.path = path
        self._file_cm = atomic_file(path, "wb")
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self.rows = 0

    def __enter__(self) -> ArrowPartWriter:
        self._handle = self._file_cm.__enter__()
        return self

    def write(self, batch: pa.RecordBatch) -> None:
        if self._writer is None:
            self._writer = pa.ipc.new_file(self._handle, batch.schema)
        self._writer.write_batch(batch)
        self.rows += batch.num_rows

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._writer is not None and exc_type is None:
            self._writer.close()
        self._file_cm.__exit__(exc_type, exc, tb)


def write_table(path: Path, table: pa.Table) -> None:
    """Write a small table as one Arrow IPC file, atomically."""
    with ArrowPartWriter(path) as writer:
        for batch in table.to_batches():
            writer.write(batch)
        if table.num_rows == 0:
            writer.write(pa.RecordBatch.from_pylist([], schema=table.schema))


def open_part(path: Path) -> pa.ipc.RecordBatchFileReader:
    try:
        return pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except (pa.ArrowInvalid, OSError) as err:
        raise FlowGrpoError(f"{path}: not a readable Arrow IPC file ({err})") from None


def iter_batches(
    paths: Sequence[Path], columns: Sequence[str] | None = None
) -> Iterator[pa.RecordBatch]:
    """Record batches of every part in order, memory-mapped, optionally only some columns."""
    for path in paths:
        reader = open_part(path)
        missing = [c for c in columns or () if c not in reader.schema.names]
        if missing:
            raise FlowGrpoError(
                f"{path} lacks column(s) {missing}: not a part this stage writes (damaged, "
                "replaced, or from another flowgrpo version)"
            )
        for index in range(reader.num_record_batches):
            batch = reader.get_batch(index)
            yield batch.select(list(columns)) if columns is not None else batch


def plain_columns(table: pa.Table) -> pa.Table:
    """The table with each fixed-shape tensor column (`latents`) as the flat fixed-size list it
    is stored as, its shape kept in the field's metadata: what Hugging Face `datasets` reads
    (it has no type for Arrow's tensor extension): `datasets.Dataset(plain_columns(table))`."""
    for index, field in enumerate(table.schema):
        if isinstance(field.type, pa.FixedShapeTensorType):
            storage = pa.chunked_array(
                [chunk.storage for chunk in table.column(index).chunks],
                type=field.type.storage_type,
            )
            shape = {b"shape": json.dumps(list(field.type.shape)).encode()}
            plain = pa.field(field.name, field.type.storage_type, metadata=shape)
            table = table.set_column(index, plain, storage)
    return table


def read_table(paths: Sequence[Path], columns: Sequence[str] | None = None) -> pa.Table:
    """Small columns of every part as one table (never ask for `latents` or `image` here)."""
    batches = list(iter_batches(paths, columns))
    if not batches:
        raise FlowGrpoError(f"no rows in {', '.join(map(str, paths))}")
    return pa.Table.from_batches(batches)


# ---------------------------------------------------------------------------------------------
# Conditioning, one row per prompt group


def _npy_bytes(value: torch.Tensor) -> bytes:
    array = value.detach().cpu()
    if array.is_floating_point():
        array = array.to(torch.float32)  # numpy has no bfloat16; float32 holds it exactly
    buffer = io.BytesIO()
    np.save(buffer, array.numpy(), allow_pickle=False)
    return buffer.getvalue()


def conditioning_table(group_ids: list[int], tensors: dict[str, torch.Tensor]) -> pa.Table:
    """One row per group; each named conditioning tensor ([G, ...]) becomes a column of .npy
    cells, so shapes may differ between prompts (Qwen-Image trims its embeddings per prompt)."""
    fields = [pa.field("group_id", pa.int64())]
    columns: list[pa.Array] = [pa.array(group_ids, pa.int64())]
    for name, value in tensors.items():
        meta = {"torch_dtype": str(value.dtype).removeprefix("torch.")}
        fields.append(pa.field(name, pa.binary(), metadata=meta))
        columns.append(pa.array([_npy_bytes(row) for row in value], pa.binary()))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def read_conditioning(paths: Sequence[Path]) -> dict[int, dict[str, torch.Tensor]]:
    """group_id -> {name: tensor in its original dtype}, from every conditioning part."""
    table = read_table(paths)
    out: dict[int, dict[str, torch.Tensor]] = {}
    names = [f.name for f in table.schema if f.name != "group_id"]
    dtypes = {
        name: getattr(torch, table.schema.field(name).metadata[b"torch_dtype"].decode())
        for name in names
    }
    cells = {name: table.column(name).to_pylist() for name in names}
    for row, gid in enumerate(table.column("group_id").to_pylist()):
        out[gid] = {
            name: torch.from_numpy(np.load(io.BytesIO(cells[name][row]), allow_pickle=False)).to(
                dtypes[name]
            )
            for name in names
        }
    return out
