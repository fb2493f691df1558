"""The samples an update trains on, read micro-batch by micro-batch from the memory-mapped
rollout parts, with the text conditioning rollout stored once per group."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.contract import RolloutManifest
from flowgrpo_cli.store.trajectory import (
    TrajectoryRows,
    from_record_batch,
    open_part,
    read_conditioning,
)


class StoredSamples:
    """Rows of the rollout's parts by position in the update's list of trained samples."""

    def __init__(
        self,
        rollout_dir: Path,
        rollout: RolloutManifest,
        locations: list[tuple[int, int, int]],  # per sample: (part, record batch, row)
    ) -> None:
        self.folder = rollout_dir
        self.readers = [open_part(rollout_dir / name) for name in rollout.trajectory_parts]
        self.conditioning = read_conditioning(
            [rollout_dir / name for name in rollout.conditioning_parts]
        )
        self.locations = locations

    def rows(self, indices: list[int]) -> TrajectoryRows:
        """The rows of `indices`, in that order."""
        by_batch: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for position, index in enumerate(indices):
            part, batch, row = self.locations[index]
            by_batch[(part, batch)].append((position, row))
        pieces: list[pa.RecordBatch] = []
        positions: list[int] = []
        for (part, batch), entries in by_batch.items():
            record = self.readers[part].get_batch(batch)
            pieces.append(record.take(pa.array([row for _, row in entries])))
            positions.extend(position for position, _ in entries)
        merged = pa.Table.from_batches(pieces).combine_chunks()
        # Grouping by record batch reordered the rows; put them back in the order asked for.
        in_order = merged.take(pa.array(np.argsort(positions)))
        return from_record_batch(in_order.to_batches()[0])

    def conditioning_of(self, rows: TrajectoryRows, device: torch.device) -> Conditioning:
        return Conditioning.cat(
            [
                Conditioning({k: v.unsqueeze(0) for k, v in self.conditioning[g].items()})
                for g in rows.group_ids
            ]
        ).to(device)
