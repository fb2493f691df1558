"""Trajectory store: a record maps one to one onto the Arrow schema and back."""

import pyarrow as pa
import pytest
import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.trajectory import (
    TRAJECTORY_COLUMNS,
    ArrowPartWriter,
    TrajectoryRows,
    conditioning_table,
    from_record_batch,
    iter_batches,
    open_part,
    read_conditioning,
    read_table,
    to_record_batch,
    write_table,
)


def make_rows(batch=3, steps=4, shape=(2, 3, 3), offset=0):
    g = torch.Generator().manual_seed(offset)
    return TrajectoryRows(
        sample_ids=[f"i000001-g{offset:06d}-k{k:03d}" for k in range(batch)],
        prompt_indices=[offset] * batch,
        group_ids=[offset] * batch,
        seeds=[2**62 + k for k in range(batch)],
        prompts=['a sign "X"'] * batch,
        ground_truths=["X"] * batch,
        timesteps=torch.rand(batch, steps, generator=g),
        timesteps_next=torch.rand(batch, steps, generator=g),
        trained=torch.tensor([[True] * (steps - 1) + [False]] * batch),
        log_probs=torch.randn(batch, steps, generator=g),
        latents=torch.randn(batch, steps + 1, *shape, generator=g),
        images=[bytes([k]) * 10 for k in range(batch)],
    )


def assert_rows_equal(a: TrajectoryRows, b: TrajectoryRows):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name


def test_round_trip_through_a_file(tmp_path):
    rows = [make_rows(offset=0), make_rows(offset=1)]
    path = tmp_path / "part-00000-of-00001.arrow"
    with ArrowPartWriter(path) as writer:
        for r in rows:
            writer.write(to_record_batch(r))
    assert writer.rows == 6
    assert open_part(path).schema.names == list(TRAJECTORY_COLUMNS)
    back = [from_record_batch(b) for b in iter_batches([path])]
    for a, b in zip(rows, back, strict=True):
        assert_rows_equal(a, b)


def test_selected_columns_and_pandas(tmp_path):
    path = tmp_path / "p.arrow"
    with ArrowPartWriter(path) as writer:
        writer.write(to_record_batch(make_rows()))
    table = read_table([path], ["sample_id", "group_id"])
    assert table.column_names == ["sample_id", "group_id"]
    assert table.to_pandas().shape == (3, 2)


def test_failed_writer_leaves_no_file(tmp_path):
    path = tmp_path / "p.arrow"
    with pytest.raises(RuntimeError), ArrowPartWriter(path) as writer:
        writer.write(to_record_batch(make_rows()))
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_unreadable_part_is_a_clear_error(tmp_path):
    path = tmp_path / "p.arrow"
    path.write_bytes(b"not arrow")
    with pytest.raises(FlowGrpoError, match="not a readable Arrow IPC file"):
        open_part(path)


def test_conditioning_keeps_dtype_and_varying_shapes(tmp_path):
    embeds = torch.randn(2, 5, 4).to(torch.bfloat16)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    path = tmp_path / "c.arrow"
    write_table(path, conditioning_table([7, 9], {"prompt_embeds": embeds, "mask": mask}))
    back = read_conditioning([path])
    assert set(back) == {7, 9}
    assert back[9]["prompt_embeds"].dtype == torch.bfloat16
    assert torch.equal(back[9]["prompt_embeds"], embeds[1])
    assert torch.equal(back[7]["mask"], mask[0]) and back[7]["mask"].dtype == torch.int64
    # rows of different shapes (per-prompt trimmed embeddings) are allowed
    table = pa.concat_tables(
        [
            conditioning_table([1], {"e": torch.zeros(1, 3)}),
            conditioning_table([2], {"e": torch.zeros(1, 5)}),
        ]
    )
    write_table(tmp_path / "v.arrow", table)
    shapes = {g: t["e"].shape for g, t in read_conditioning([tmp_path / "v.arrow"]).items()}
    assert shapes == {1: (3,), 2: (5,)}
