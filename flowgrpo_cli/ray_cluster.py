"""The Ray backend: a command's ranks on a Ray cluster, and the score stage as a Ray task pool.

`--ray-address ADDRESS` (or `distributed.backend = "ray"`) runs rollout, score, update and loop
as `distributed.nproc` ranks placed by Ray, exactly as `--nproc` does on one host, except that:

- Ray Train's TorchTrainer starts the ranks (one worker actor each, with
  `distributed.cpus_per_worker` CPUs and `distributed.gpus_per_worker` GPUs) and sets up the
  torch.distributed process group itself (gloo, or NCCL when workers have GPUs): it sets
  RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR in each worker and calls init_process_group.
  Each worker then runs the very command the user typed, in-process (the entry function the
  CLI passes in, its `run_in_rank`),
  marked as a rank (`distributed.RAY_RANK_ENV`) so it neither re-launches nor joins a group
  of its own. No scheduler or RPC of ours: Ray places, health-checks and tears down.
- The launching process holds the run lock (`_run_ranks`) and only waits. A rank that raises
  or dies fails the whole command with that rank's error; everything the stages finished is on
  disk, so the same command run again resumes.
- With `distributed.score_tasks > 0`, `score` (and the loop's score stage) hands each missing
  rollout part to a Ray task with its own resources (`score_cpus`, `score_gpus`,
  `score_resource`): an OCR pool on CPU nodes, a reward model on its own GPU, apart from the
  training ranks. Each task writes its score part atomically; the stage's manifest is written
  by the process that asked, as always.

Ray is an optional extra (`pip install 'flowgrpo[ray]'`): nothing here imports it at module
level, and every entry point says how to install it when it is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowgrpo_cli.errors import FlowGrpoError

if TYPE_CHECKING:
    from flowgrpo_cli.launch.stage import StageResult
    from flowgrpo_cli.reporting.progress import Progress
    from flowgrpo_cli.stages.score import PartsScorer
    from flowgrpo_cli.store.config import Config
    from flowgrpo_cli.store.rundir import RunDir

INSTALL_HINT = "pip install 'flowgrpo[ray]'  (or: pip install 'ray[train]')"
# Variables of the launching shell that the ranks and score tasks get too (Ray workers start
# with the environment of the `ray start` of their node, not the user's): Hugging Face access
# and cache settings, and flowgrpo's own. Everything else (CUDA_*, NCCL_*, OMP_NUM_THREADS,
# PYTHONPATH) is per node: set it before `ray start`.
FORWARDED_ENV_PREFIXES = ("HF_", "HUGGING_FACE_", "TRANSFORMERS_", "FLOWGRPO_")
# Ray Train's own bookkeeping (a storage-check marker; we report no Ray checkpoints) goes to
# RUN/.ray/<name>/ on the storage every node sees, and is removed when the command ends.
RAY_STORAGE_DIR = ".ray"
_PROBE_TIMEOUT_S = 5.0


def import_ray() -> Any:
    """The `ray` module with Ray Train, or a FlowGrpoError that says how to install it."""
    try:
        import ray
        import ray.train.torch
    except ImportError as err:
        raise FlowGrpoError(
            f'the Ray backend (--ray-address, distributed.backend = "ray") needs Ray Train, '
            f"which cannot be imported ({err}); install it with: {INSTALL_HINT}"
        ) from None
    return ray


def ray_address_for(config: Config, option: str | None) -> str | None:
    """The cluster to run on: `--ray-address` if given, else distributed.ray_address when
    distributed.backend is "ray" ("" = `auto`); None = not the Ray backend."""
    if option is not None:
        return option or "auto"
    section = config.distributed
    if section.backend == "ray":
        return section.ray_address or "auto"
    return None


# ---------------------------------------------------------------------------------------------
# Connecting


def _probe(address: str) -> None:
    """Fail fast on a HOST:PORT nobody answers on, which `ray.init` retries for minutes.
    `auto` (Ray fails at once when no cluster runs here) and `ray://` are left to Ray."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise FlowGrpoError(
            f"Ray address {address!r}: expected HOST:PORT (the head's GCS port, 6379 unless "
            "`ray start --head --port` said otherwise) or `auto`"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as err:
        raise FlowGrpoError(
            f"cannot reach the Ray cluster at {address}: {err.strerror or err}. Is "
            f"`ray start --head` running on {host}, and is port {port} open from here?"
        ) from None


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


@contextmanager
def connected(address: str) -> Iterator[Any]:
    """This process as a Ray driver on the cluster at `address`, disconnected on exit."""
    ray = import_ray()
    _probe(address)
    try:
        ray.init(
            address=address,
            runtime_env={"env_vars": _forwarded_env()},
            log_to_driver=True,  # the ranks' output (rank 0 prints the results) shows here
            logging_level="WARNING",
        )
    except (ConnectionError, ray.exceptions.AuthenticationError) as err:
        if _refused_token(err):
            hint = (
                "the cluster uses token authentication and refused this machine's token: copy "
                "the head's ~/.ray/auth_token to this machine, or set RAY_AUTH_TOKEN"
            )
        elif address == "auto":
            hint = (
                "no Ray cluster runs on this machine (and RAY_ADDRESS is not set): start one "
                "with `ray start --head`, or pass the head's HOST:PORT"
            )
        else:
            hint = "is `ray start --head` running there?"
        raise FlowGrpoError(f"cannot connect to the Ray cluster at {address}: {hint}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _refused_token(err: BaseException | None) -> bool:
    """Whether Ray's connection error comes from token authentication (Ray wraps it)."""
    while err is not None:
        if type(err).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _check_resources(ray: Any, address: str, workers: int, cpus: float, gpus: float) -> None:
    """Refuse a launch the cluster can never place, rather than wait for it forever."""
    total = ray.cluster_resources()
    short = [
        f"{need:g} {kind}s ({workers} x {each:g}), the cluster has {total.get(kind, 0.0):g}"
        for kind, each in (("CPU", cpus), ("GPU", gpus))
        if (need := workers * each) > total.get(kind, 0.0) + 1e-9
    ]
    if short:
        raise FlowGrpoError(
            f"the Ray cluster at {address} cannot hold {workers} rank(s): they need "
            + "; ".join(short)
            + ". Lower --nproc / distributed.nproc or the per-worker resources "
            "(distributed.cpus_per_worker, distributed.gpus_per_worker), or add nodes"
        )


# ---------------------------------------------------------------------------------------------
# Ranks through Ray Train


def launch_ray(
    argv: Sequence[str],
    entry: Callable[[list[str]], None],
    *,
    nproc: int,
    address: str,
    cpus_per_worker: float,
    gpus_per_worker: float,
    run_root: Path,
) -> None:
    """Run `flowgrpo ARGV` as `nproc` ranks on the Ray cluster at `address` and wait: each
    rank calls `entry(argv)` (the CLI's run_in_rank, passed in so this module needs no CLI).

    Raises FlowGrpoError naming the rank(s) that failed and why (their exception, or that the
    worker process died); the stages' finished outputs stay, so re-running resumes.
    """
    with connected(address) as ray:
        from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
        from ray.train.torch import TorchTrainer

        _check_resources(ray, address, nproc, cpus_per_worker, gpus_per_worker)
        resources = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            resources["GPU"] = gpus_per_worker
        storage = Path(run_root).resolve() / RAY_STORAGE_DIR
        name = f"flowgrpo-{socket.gethostname()}-{os.getpid()}-{int(time.time())}"
        trainer = TorchTrainer(
            _rank_main,
            train_loop_config={"argv": list(argv), "cwd": os.getcwd(), "entry": entry},
            scaling_config=ScalingConfig(
                num_workers=nproc, use_gpu=gpus_per_worker > 0, resources_per_worker=resources
            ),
            run_config=RunConfig(
                name=name,
                storage_path=str(storage),
                # A dead rank fails the command; the user re-runs it (stages resume), rather
                # than Ray restarting every rank behind their back.
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        try:
            trainer.fit()
        except TrainingFailedError as err:
            raise FlowGrpoError(describe_failure(err)) from None
        finally:
            shutil.rmtree(storage / name, ignore_errors=True)
            with suppress(OSError):
                storage.rmdir()  # only when no other command's folder is left in it


def _rank_main(config: dict[str, Any]) -> None:
    """One Ray Train worker = one rank: run the user's command in this process.

    Ray Train has already initialised the process group and set RANK / WORLD_SIZE /
    LOCAL_RANK; RAY_RANK_ENV tells the command it is a rank (even a world of one), so it runs
    its body instead of launching ranks again and takes no run lock.
    """
    from flowgrpo_cli.launch.distributed import RAY_RANK_ENV

    os.environ[RAY_RANK_ENV] = "1"
    # Ray starts workers in a folder of its own; the command's relative paths (--config,
    # --run, paths inside the config) mean what they meant where the user typed it.
    cwd = config["cwd"]
    if os.path.isdir(cwd):
        os.chdir(cwd)
    else:
        print(
            f"flowgrpo: {cwd} (the launching folder) does not exist on {socket.gethostname()}; "
            "relative paths resolve against " + os.getcwd(),
            file=sys.stderr,
        )
    config["entry"](config["argv"])


def describe_failure(err: BaseException) -> str:
    """What failed, rank by rank: a FlowGrpoError as is (ranks with the same message share a
    line), a dead worker as such, anything else with the traceback Ray recorded."""
    failures: dict[int, BaseException] = getattr(err, "worker_failures", None) or {}
    if not failures:
        return f"the Ray run failed: {err}"
    by_message: dict[str, list[int]] = {}
    resumable = bug = False
    for rank, failure in sorted(failures.items()):
        if isinstance(failure, FlowGrpoError):
            message = str(failure)
        elif _worker_died(failure):
            message = "its worker process died (killed, out of memory, or crashed): " + (
                _death_detail(failure)
            )
            resumable = True
        else:
            message = f"{type(failure).__name__}: {failure}"
            resumable = bug = True
        by_message.setdefault(message, []).append(rank)
    lines = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {message}"
        for message, ranks in by_message.items()
    ]
    text = "\n  ".join(["a Ray rank failed", *lines])
    if bug:  # a bug, not a user error: keep the traceback Ray recorded
        text += f"\nRay's report:\n{err}"
    if resumable:
        text += "\nFinished outputs are kept: run the same command again to resume."
    return text


def _worker_died(failure: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    if isinstance(failure, ActorDiedError | ActorUnavailableError):
        return True
    return type(failure).__name__ == "WorkerHealthCheckFailedError"


def _death_detail(failure: BaseException) -> str:
    """Where the process ran and how Ray says it ended, from Ray's long report."""
    text = str(failure)
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.strip().rstrip(",").partition("=")
        if sep and key in ("hostname", "pid"):
            fields[key] = value.strip("'")
    where = f"pid {fields.get('pid', '?')} on {fields.get('hostname', '?')}: " if fields else ""
    start = text.find("Worker exit type:")
    if start < 0:
        return where + (text.strip().splitlines() or ["no detail"])[0]
    detail = text[start:].split(" Some common causes")[0]  # Ray's generic advice follows
    return where + " ".join(detail.split())


# ---------------------------------------------------------------------------------------------
# The score stage as a Ray task pool


def score_on_pool(
    config: Config,
    run: RunDir,
    iteration: int,
    *,
    address: str,
    progress: Progress | None = None,
) -> StageResult:
    """`flowgrpo score` with distributed.score_tasks > 0: this process connects to the
    cluster, scores the iteration's missing parts as Ray tasks and writes the manifest."""
    from flowgrpo_cli.stages import score

    with connected(address):
        scorer = parts_scorer(config, run, iteration)
        return score.run(config, run, iteration, progress=progress, parts_scorer=scorer)


def pool_scorer_in_rank(config: Config, run: RunDir, iteration: int) -> PartsScorer | None:
    """For the loop: the task pool when this rank runs under Ray and score_tasks > 0, else
    None (the ranks score their own parts)."""
    if config.distributed.score_tasks <= 0:
        return None
    from flowgrpo_cli.launch.distributed import RAY_RANK_ENV

    if os.environ.get(RAY_RANK_ENV) != "1":
        return None
    return parts_scorer(config, run, iteration)


def parts_scorer(config: Config, run: RunDir, iteration: int) -> PartsScorer:
    """A function that scores iteration `iteration`'s rollout parts, by name, as Ray tasks
    (at most distributed.score_tasks at once) and returns the number of images scored. Needs
    a connected Ray: the launching process's, or a Ray Train worker's."""
    section = config.distributed
    root = Path(run.root).resolve()  # tasks may run on other nodes, in other folders

    def score_parts(names: list[str], progress: Progress) -> int:
        import ray

        task = ray.remote(_score_part_task).options(
            num_cpus=section.score_cpus,
            num_gpus=section.score_gpus,
            resources={section.score_resource: 1} if section.score_resource else None,
            max_retries=0,  # a dead task fails the stage; a re-run scores what is missing
        )
        waiting = list(names)
        running: dict[Any, str] = {}
        scored = 0
        progress.start(f"score {len(names)} part(s) on Ray", total=len(names), unit="parts")
        try:
            while waiting or running:
                while waiting and len(running) < section.score_tasks:
                    name = waiting.pop(0)
                    running[task.remote(config, str(root), iteration, name)] = name
                done, _ = ray.wait(list(running), num_returns=1)
                name = running.pop(done[0])
                try:
                    scored += ray.get(done[0])
                except Exception as err:
                    raise FlowGrpoError(_describe_task_failure(name, err)) from None
                progress.advance(1)
        finally:
            for ref in running:
                ray.cancel(ref, force=True)
            progress.finish()
        return scored

    return score_parts


def _score_part_task(config: Config, root: str, iteration: int, name: str) -> int:
    """One Ray task: score rollout part `name` into its score part (written atomically)."""
    from flowgrpo_cli.rewards import build_rewards_from_config
    from flowgrpo_cli.stages import score
    from flowgrpo_cli.store.rundir import ROLLOUT, RunDir

    run = RunDir(Path(root))
    if not run.stage_dir(iteration, ROLLOUT).is_dir():
        raise FlowGrpoError(
            f"{run.stage_dir(iteration, ROLLOUT)} does not exist on {socket.gethostname()}: "
            "put the run on storage every node mounts at the same path"
        )
    with build_rewards_from_config(config.reward) as rewards:
        return score.score_part(config, run, iteration, name, rewards)


def _describe_task_failure(name: str, err: BaseException) -> str:
    from ray.exceptions import RayTaskError, WorkerCrashedError

    cause = err.cause if isinstance(err, RayTaskError) else err
    if isinstance(cause, FlowGrpoError):
        return f"scoring {name} on Ray failed: {cause}"
    if isinstance(err, WorkerCrashedError):
        detail = "its worker process died (killed, out of memory, or crashed)"
    else:  # a bug: str(RayTaskError) holds the task's traceback
        detail = str(err)
    return (
        f"scoring {name} on Ray failed: {detail}\nParts already scored are kept: run the same "
        "command again to score the rest"
    )
