"""SPMD ranks: who am I, the process group, and launching N ranks on this host.

One process per device. `--nproc N` re-runs the same command under torch.distributed's own
launcher (torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR for each child; the parent
only waits. Ranks use gloo on CPU and NCCL on GPU. Nothing here schedules work: every rank
runs the same code on its own slice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

LAUNCHED_ENV = "FLOWGRPO_RANK_PROCESS"  # set in ranks started by our launcher


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return DistInfo(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def is_rank_process() -> bool:
    """True inside a rank started by a launcher (torchrun or Ray), where no re-launch happens."""
    return "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def resolve_device(name: str) -> torch.device:
    """`auto` = this rank's GPU when there is one, else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", dist_info().local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", dist_info().local_rank % torch.cuda.device_count())
    return device


def init_process_group(device: torch.device) -> None:
    """Join the process group of a multi-rank launch (no-op for a single process)."""
    if not is_rank_process() or torch.distributed.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend=backend)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-element list without a process group)."""
    if not torch.distributed.is_initialized():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `flowgrpo ARGV` as `nproc` ranks with torchrun on this host; return the exit code."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "flowgrpo_cli", *argv,
    ]  # fmt: skip
    env = {
        **os.environ,
        LAUNCHED_ENV: "1",
        "OMP_NUM_THREADS": os.environ.get(
            "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc))
        ),
    }
    return subprocess.call(command, env=env)
