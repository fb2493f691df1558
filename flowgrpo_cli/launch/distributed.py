"""SPMD ranks: who am I, the process group, and launching N ranks on this host.

One process per device. `--nproc N` re-runs the same command under torch.distributed's own
launcher (the elastic agent behind torchrun), which sets RANK / WORLD_SIZE / MASTER_ADDR for
each child; the parent
only waits. `--ray-address` runs the same command in Ray Train workers instead
(ray_cluster.py), where Ray Train has set those variables and initialised the process group.
Ranks use gloo on CPU and NCCL on GPU. Nothing here schedules work: every rank runs the same
code on its own slice.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.rank_errors import ERROR_DIR_ENV, LOCAL_RANK_ENV, read_rank_errors

# Set in each Ray Train worker (ray_cluster.py): this process is a rank, even of a world
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


def launched_by_flowgrpo() -> bool:
    """True in a rank that `--nproc` or `--ray-address` started (not torchrun)."""
    return os.environ.get(RAY_RANK_ENV) == "1" or os.environ.get(LOCAL_RANK_ENV) == "1"


def check_devices(name: str, ranks: int) -> None:
    """Refuse, before any rank starts, `ranks` one-per-GPU ranks on fewer GPUs than that, or
    a CUDA device that is not there. `auto` without any GPU means the CPU, which any number of
    ranks may share."""
    if not (name == "auto" or name.startswith("cuda")):
        return
    count = torch.cuda.device_count()
    if count == 0:
        if name == "auto":
            return
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise FlowGrpoError(
            f"model.device = {name!r}, but no CUDA device is visible (torch {torch.__version__}, "
            f'{build}{_visible_devices()}); set model.device = "cpu" or "auto" to run on the CPU'
        )
    if ":" in name:
        index = torch.device(name).index
        if index is not None and index >= count:
            raise FlowGrpoError(
                f"model.device = {name!r}, but only {_gpus(count)} visible{_visible_devices()}"
            )
        if ranks > 1:
            raise FlowGrpoError(
                f"model.device = {name!r} puts all {ranks} ranks on one GPU; set model.device "
                '= "cuda" (rank r takes GPU r) for more than one rank'
            )
        return
    if ranks > count:
        raise FlowGrpoError(
            f"{ranks} ranks need one GPU each, but {_gpus(count)} visible"
            f"{_visible_devices()}: pass --nproc {count} (or set distributed.nproc = {count})"
        )


def _gpus(count: int) -> str:
    return "1 GPU is" if count == 1 else f"{count} GPUs are"


def _visible_devices() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"


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


def launch_local(nproc: int, argv: list[str]) -> dict[int, str] | None:
    """Run `flowgrpo ARGV` as `nproc` ranks on this host through torch's elastic launcher (the
    API behind torchrun; called directly so our options never meet torchrun's own parser).

    Returns None when every rank succeeded, else rank -> the one-line error it raised (empty
    when the failed ranks raised none: a crash, whose traceback the rank printed itself).
    """
    import logging
    import tempfile

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
    # The agent logs each failed rank's exit code; the ranks' own errors say more.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="flowgrpo-rank-errors-") as errors:
        saved = {key: os.environ.get(key) for key in (LOCAL_RANK_ENV, ERROR_DIR_ENV)}
        os.environ.update({LOCAL_RANK_ENV: "1", ERROR_DIR_ENV: errors})
        try:
            elastic_launch(config, sys.executable)("-m", "flowgrpo_cli", *argv)
        except ChildFailedError:
            return read_rank_errors(Path(errors))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return None
