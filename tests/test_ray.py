"""The Ray backend (ray_cluster.py) on a local Ray cluster this module starts and stops.

One cluster for the whole module: 2 CPUs, its temp dir, HOME and token inside the module's tmp
folder, a fresh auth token in the environment (nothing under ~/.ray). The commands run as
subprocesses that join it with `--ray-address`, as a user's would, and are compared with the
same commands under torch's launcher (`--nproc 2`).

A rank is killed for real: the test reward plugin below SIGKILLs its own process when it runs
in rank 1 while the marker file exists (and removes the marker, so the re-run goes through).

Each Ray command pays for Ray Train's start (controller and helper actors, one process per
worker): these are the slowest tests of the suite, hence few commands, each checking much.
Skipped without the `ray` extra.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is an optional extra (flowgrpo[ray])")

PROMPTS = [
    'A shop sign that reads "OPEN" in red neon.',
    'A mug printed with "Best Dad" on its side.',
    'A poster saying "Hello World" on a brick wall.',
    'A road sign showing "STOP" at dusk.',
]
PLUGIN_MODULE = "fg_ray_test_plugin"
PLUGIN = '''"""Reward 0 for every image. Logs who scored (the rank, or `task` in a Ray task) to
$FLOWGRPO_TEST_SCORE_LOG; in rank 1, SIGKILLs the rank while $FLOWGRPO_TEST_KILL exists (a
plugin runs in a worker process of the rank's own: the rank is its parent).
(FLOWGRPO_* variables of the command reach Ray workers: ray_cluster forwards them.)"""
import os
import signal


def score(images, prompts, metadata):
    who = os.environ.get("RANK", "task")
    marker = os.environ.get("FLOWGRPO_TEST_KILL", "")
    if who == "1" and marker and os.path.exists(marker):
        os.unlink(marker)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    log = os.environ.get("FLOWGRPO_TEST_SCORE_LOG")
    if log:
        with open(log, "a") as out:
            out.write(who + "\\n")
    return [0.0] * len(images)
'''


def lock_is_free(run_root) -> bool:
    """No process holds the run's lock (the file may stay, empty: the OS lock is what counts)."""
    from flowgrpo_cli.store.rundir import RunLock

    with RunLock(run_root):
        return True


# Owns the cluster: starts it, prints its address, stops it when its stdin closes.
HEAD = """
import sys
import ray
context = ray.init(num_cpus=2, _temp_dir=sys.argv[1], include_dashboard=False, log_to_driver=False)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""
LORA = "pytorch_lora_weights.safetensors"
# A Unix socket path (Ray's temp dir + session folder + sockets/plasma_store) must stay
# under 108 bytes.
MAX_TEMP_DIR = 40


@dataclass(frozen=True)
class Cluster:
    address: str
    base: Path  # the module's tmp folder: every file of the cluster is under it


def _our_pids(token: str) -> list[int]:
    """Processes started with this module's auth token in their environment: the cluster's."""
    needle = f"RAY_AUTH_TOKEN={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _outside_state() -> dict[str, float | None]:
    """Where Ray writes when not told otherwise: nothing of it may change."""
    home = Path(os.path.expanduser("~"))
    paths = [home / ".ray", home / "ray_results", Path(tempfile.gettempdir()) / "ray"]
    return {str(p): (p.stat().st_mtime if p.exists() else None) for p in paths}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster (2 CPUs) for this module, stopped and checked for leftovers after."""
    if not HAS_RAY:
        pytest.skip("Ray is an optional extra (flowgrpo[ray])")
    base = tmp_path_factory.mktemp("ray")
    temp_dir, own_temp = base / "t", None
    if len(str(temp_dir)) > MAX_TEMP_DIR:  # a long --basetemp: fall back to a short folder
        temp_dir = own_temp = Path(tempfile.mkdtemp(prefix="fgray-"))
    plugins = base / "plugins"
    plugins.mkdir()
    (plugins / f"{PLUGIN_MODULE}.py").write_text(PLUGIN)
    token = secrets.token_hex(16)
    before = _outside_state()
    env = {
        "HOME": str(base / "home"),  # Ray and the libraries it loads write under ~
        "RAY_TMPDIR": str(temp_dir),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,  # a token in the environment: nothing written to ~/.ray
        "RAY_USAGE_STATS_ENABLED": "0",
        # Ray workers get the environment of the raylet this process starts: the plugin's
        # folder must be importable there.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])),
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():  # for this module's commands too: same HOME, token
            patch.setenv(key, value)
        # The cluster's owner is a process of its own, so that this one imports no Ray (whose
        # settings, token mode included, are read once per process).
        head = subprocess.Popen(
            [sys.executable, "-c", HEAD, str(temp_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            address = None
            for line in head.stdout:  # the address, once the cluster is up
                if re.fullmatch(r"\S+:\d+", line.strip()):
                    address = line.strip()
                    break
            assert address, "the Ray head did not start"
            yield Cluster(address, base)
        finally:
            head.stdin.close()  # the head calls ray.shutdown() and exits
            head.wait(timeout=120)
            deadline = time.monotonic() + 60
            while (left := _our_pids(token)) and time.monotonic() < deadline:
                time.sleep(0.5)
            found = subprocess.run(["pgrep", "-f", "raylet"], capture_output=True, text=True)
            raylets = [pid for pid in map(int, found.stdout.split()) if pid in left]
            for pid in left:  # clean up (the assertions below still fail): only ours
                os.kill(pid, signal.SIGKILL)
            if own_temp is not None:
                shutil.rmtree(own_temp, ignore_errors=True)
    assert raylets == [], f"this module's raylet still ran after shutdown: {raylets}"
    assert left == [], f"Ray processes of this module still ran after shutdown: {left}"
    assert _outside_state() == before, "Ray wrote outside the test's tmp folder"


@pytest.fixture(scope="module")
def prepared_run(ray_cluster, tiny_model_dir) -> Path:
    """A prepared run (data only) whose config scores with the test plugin: copy it."""
    from flowgrpo_cli.stages import prepare
    from flowgrpo_cli.store.config import dumps_config, load_config
    from flowgrpo_cli.store.rundir import RunDir

    base = ray_cluster.base
    prompts = base / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    root = base / "prepared"
    config = load_config(
        None,
        [
            f"run.dir={root}",
            f"data.train={prompts}",
            f"data.test={prompts}",
            f"model.path={tiny_model_dir('sd3')}",
            "model.dtype=float32",
            "model.device=cpu",
            "model.height=64",
            "model.width=64",
            "sampler.num_steps=3",
            "sampler.batch_size=4",
            "algorithm.group_size=2",
            "algorithm.prompts_per_iteration=2",
            "train.lora_rank=4",
            "train.lora_alpha=8",
            "train.micro_batch_size=2",
            f'reward.weights={{jpeg_compressibility = 1.0, "{PLUGIN_MODULE}:score" = 1.0}}',
            f'reward.plugin_dirs=["{base / "plugins"}"]',  # prepare reads the plugin's needs
            "eval.every=0",
        ],
    )
    run = RunDir(root)
    root.mkdir()
    run.config_path.write_text(dumps_config(config))
    prepare.run(config, run)
    return root


def flowgrpo(*args: str | Path, **env: str | Path) -> subprocess.CompletedProcess:
    """`flowgrpo ARGS` in a subprocess, with extra environment variables."""
    return subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **{k: str(v) for k, v in env.items()}},
    )


def scorers(log: Path) -> set[str]:
    """Who called the test reward: rank numbers, `task` for Ray score tasks."""
    return set(log.read_text().split()) if log.exists() else set()


def copy_run(source: Path, dest: Path, *, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(source, dest)
    for name in drop:
        shutil.rmtree(dest / name)
    return dest


def lora_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    first = load_file(a / "checkpoints" / "iter-000000" / LORA)
    second = load_file(b / "checkpoints" / "iter-000000" / LORA)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


def stage_parts(root: Path, stage: str) -> dict[str, bytes]:
    folder = root / "iter-000000" / stage
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.arrow"))}


@pytest.fixture(scope="module")
def torch_run(ray_cluster, prepared_run) -> Path:
    """Iteration 0 by `loop --nproc 2` under torch's launcher: the reference."""
    root = copy_run(prepared_run, ray_cluster.base / "torch")
    log = ray_cluster.base / "torch-scorers"
    result = flowgrpo("loop", "--run", root, "--iterations", "1", "--nproc", "2",
                      FLOWGRPO_TEST_SCORE_LOG=log)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert scorers(log) == {"0", "1"}
    return root


@needs_ray
@pytest.mark.slow
def test_loop_on_ray_survives_a_killed_rank_and_equals_torchs(ray_cluster, prepared_run, torch_run):
    """`loop --iterations 1` with 2 Ray workers: rank 1 is SIGKILLed while scoring, the
    command fails saying so; the re-run finishes the iteration. The rollout and score files
    equal the torch launcher's (`--nproc 2`), so both updates had the same inputs, and their
    LoRA weights agree: `update` under Ray equals `update --nproc 2`."""
    base = ray_cluster.base
    root = copy_run(prepared_run, base / "ray-loop")
    command = ("loop", "--run", root, "--iterations", "1", "--nproc", "2",
               "--ray-address", ray_cluster.address)  # fmt: skip
    marker, log = base / "kill-rank-1", base / "ray-loop-scorers"
    marker.touch()
    killed = flowgrpo(*command, FLOWGRPO_TEST_KILL=marker, FLOWGRPO_TEST_SCORE_LOG=log)
    assert killed.returncode == 1, killed.stdout + killed.stderr
    assert not marker.exists(), "rank 1 never scored"
    error = killed.stderr[killed.stderr.rindex("error:") :]
    assert "rank 1: its worker process died" in error
    assert "run the same command again to resume" in error
    iteration = root / "iter-000000"
    assert (iteration / "rollout" / "manifest.json").is_file()  # killed in the score stage:
    assert not (iteration / "scores" / "manifest.json").exists()
    assert lock_is_free(root) and not (root / ".ray").exists()
    assert scorers(log) <= {"0"}  # rank 0 may have scored its part before the group stopped

    # The re-run also moves scoring off the ranks, to a Ray task (0.5 CPU each for the 2
    # ranks, 0.5 for the task, on this 2-CPU cluster): rank 0 hands it the missing part.
    pool = ("--set", "distributed.score_tasks=2", "--set", "distributed.score_cpus=0.5",
            "--set", "distributed.cpus_per_worker=0.5")  # fmt: skip
    resumed = flowgrpo(*command, *pool, FLOWGRPO_TEST_SCORE_LOG=log)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "task" in scorers(log) and "1" not in scorers(log)
    assert (root / "checkpoints" / "iter-000000" / "manifest.json").is_file()
    assert lock_is_free(root) and not (root / ".ray").exists()
    for stage in ("rollout", "scores"):
        assert stage_parts(root, stage) == stage_parts(torch_run, stage)
    assert lora_diff(root, torch_run) < 1e-5


@needs_ray
def test_score_as_a_ray_task_pool(ray_cluster, torch_run):
    root = copy_run(torch_run, ray_cluster.base / "ray-pool",
                    drop=("checkpoints", "iter-000000/update", "iter-000000/scores"))  # fmt: skip
    log = ray_cluster.base / "pool-scorers"
    pool = ("--ray-address", ray_cluster.address, "--set", "distributed.score_tasks=2")
    result = flowgrpo("score", "--run", root, *pool, FLOWGRPO_TEST_SCORE_LOG=log)
    assert result.returncode == 0, result.stdout + result.stderr
    assert scorers(log) == {"task"}  # no rank: the launching process asked Ray tasks
    assert (root / "iter-000000" / "scores" / "manifest.json").is_file()
    assert stage_parts(root, "scores") == stage_parts(torch_run, "scores")  # one per part


# ---------------------------------------------------------------------------------------------
# Errors a user meets (no cluster needed)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@needs_ray
def test_an_unreachable_cluster_is_an_error_naming_its_address(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    result = CliRunner().invoke(app, ["update", "--run", str(tmp_path / "run"),
                                      "--ray-address", address])  # fmt: skip
    assert result.exit_code == 1
    assert f"cannot reach the Ray cluster at {address}" in result.output
    assert lock_is_free(tmp_path / "run")


def test_without_ray_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if not installed
    for option in (["--ray-address", "auto"], ["--set", 'distributed.backend="ray"']):
        result = CliRunner().invoke(app, ["rollout", "--run", str(tmp_path / "run"), *option])
        assert result.exit_code == 1, result.output
        assert "pip install 'flowgrpo[ray]'" in result.output


@needs_ray
def test_a_rank_error_names_the_rank_and_a_dead_worker_says_so():
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError

    from flowgrpo_cli.ray_cluster import describe_failure

    same = FlowGrpoError("data/train.parquet: missing")
    text = describe_failure(WorkerGroupError("snippets", {0: same, 1: same}))
    assert text == "a Ray rank failed\n  ranks 0, 1: data/train.parquet: missing"
    text = describe_failure(WorkerGroupError("snippets", {0: same, 1: ActorDiedError()}))
    assert "rank 0: data/train.parquet: missing" in text
    assert "rank 1: its worker process died" in text
    assert "run the same command again to resume" in text


def test_a_launch_the_cluster_cannot_hold_is_refused():
    from flowgrpo_cli.ray_cluster import _check_resources

    class FakeRay:
        @staticmethod
        def cluster_resources():
            return {"CPU": 2.0}

    _check_resources(FakeRay, "head:6379", 2, 1.0, 0.0)
    with pytest.raises(FlowGrpoError, match=r"cannot hold 2 rank\(s\): they need 2 GPUs"):
        _check_resources(FakeRay, "head:6379", 2, 1.0, 1.0)
