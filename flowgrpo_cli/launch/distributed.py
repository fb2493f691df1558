"""SPMD ranks: who am I, the process group, and launching N ranks on this host.

One process per device. `--nproc N` re-runs the same command under torch.distributed's own
launcher (the elastic agent behind torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR for
each child; the parent
only waits. `--ray-address` runs the same command in Ray Train workers instead
(launch/ray_cluster.py), where Ray Train has set those variables and initialised the process group.
Ranks use gloo on CPU and NCCL on GPU. Nothing here schedules work: every rank runs the same
code on its own slice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

# Set in each Ray Train worker (launch/ray_cluster.py): this process is a rank, even of a world
# of one.
RAY_RANK_ENV = "FLOWGRPO_RAY_RANK"


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
    if os.environ.get(RAY_RANK_ENV) == "1":
        return True
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
    """Join the process group of a multi-rank launch (no-op for a single process, and under
    Ray, whose Train workers start with the group initialised)."""
    if not is_rank_process() or torch.distributed.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend=backend)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not torch.distributed.is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run `flowgrpo ARGV` as `nproc` ranks on this host through torch's elastic launcher (the
    API behind torchrun; called directly so our options never meet torchrun's own parser).
    Returns 0, or 1 when a rank failed (its error is printed by the rank itself)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Ranks share the host's cores: without this each would start one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"flowgrpo-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "flowgrpo_cli", *argv)
    except ChildFailedError:
        return 1
    return 0
