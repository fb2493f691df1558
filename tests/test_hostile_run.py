"""A hostile user and their run folder (issue 40, "Integrity II").

Each probe is replayed through the CLI where a user meets it (in this process through typer's
runner, or as a real `python -m flowgrpo_cli` where a kill, a second process or an rlimit is
needed), and checked the same way: exit code 1, no traceback, one line `error: ...` naming the
file, key or path, nothing outside the run touched and nothing of the run lost.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from helpers import do_iteration
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.config import dumps_config
from flowgrpo_cli.store.rundir import ROLLOUT, RunDir, read_manifest


def cli(*args: object):
    """`flowgrpo ARGS` in this process; a traceback (any exception but the CLI's own exit)
    fails the test with it."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        error = result.exception
        pytest.fail("traceback: " + "".join(traceback.format_exception(error)[-2:]))
    return result


def flowgrpo(*args: object, preexec_fn=None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m flowgrpo_cli ARGS` as a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", *map(str, args)],
        capture_output=True, text=True, preexec_fn=preexec_fn, timeout=timeout,
    )  # fmt: skip


def error_line(output: str, exit_code: int, *needles: str) -> str:
    """The one `error: ...` line of a refused command, which holds every needle."""
    assert exit_code == 1, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], output
    return lines[0]


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (not following links): file bytes, link targets, folders."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[key] = "dir"
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "special"
    return found


def dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------------------------------------
# 1. The lock


def test_a_run_lock_that_links_elsewhere_is_refused_and_its_target_kept(make_run, tmp_path):
    _, run = make_run()
    precious = tmp_path / "elsewhere" / "precious.txt"
    precious.parent.mkdir()
    precious.write_text("years of notes")
    run.lock_path.unlink(missing_ok=True)
    run.lock_path.symlink_to(precious)
    result = cli("loop", "--run", run.root, "-n", "1")
    error_line(result.output, result.exit_code, str(run.lock_path), "symbolic link")
    assert precious.read_text() == "years of notes"
    assert run.lock_path.is_symlink()  # the user's link is theirs to remove
    assert not run.iterations()


@pytest.mark.parametrize("kind", ["hard link", "folder", "fifo"])
def test_a_run_lock_that_is_not_its_own_regular_file_is_refused(make_run, tmp_path, kind):
    _, run = make_run()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    run.lock_path.unlink(missing_ok=True)
    if kind == "hard link":
        os.link(precious, run.lock_path)
    elif kind == "folder":
        run.lock_path.mkdir()
        (run.lock_path / "inside.txt").write_text("keep me too")
    else:
        os.mkfifo(run.lock_path)  # opened O_NONBLOCK: no hang waiting for a writer
    before = tree(run.root)
    result = cli("prepare", "--run", run.root)
    error_line(result.output, result.exit_code, str(run.lock_path))
    assert precious.read_text() == "keep me"
    assert tree(run.root) == before


def _loop_holding_the_lock(run: RunDir) -> subprocess.Popen:
    """A `flowgrpo loop` process on `run`, returned once it holds the run's lock."""
    holder = subprocess.Popen(
        [sys.executable, "-m", "flowgrpo_cli", "loop", "--run", str(run.root), "-n", "1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not run.lock_path.is_file() or not run.lock_path.read_text():
        assert holder.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return holder


def test_deleting_run_lock_does_not_unlock_a_live_loop(make_run):
    _, run = make_run()
    holder = _loop_holding_the_lock(run)
    try:
        run.lock_path.unlink()
        result = cli("prepare", "--run", run.root)
        error_line(result.output, result.exit_code, "is locked by")
    finally:
        holder.kill()
        holder.wait()
    result = cli("prepare", "--run", run.root)  # the holder ended: so did its lock
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------------------------------------
# 2. The temp-file sweep


def test_taking_the_lock_removes_only_this_runs_temp_files(make_run):
    _, parent = make_run(name="parent")
    child = parent.root / "child"  # another run, nested in this one, writing right now
    (child / "iter-000000" / "rollout").mkdir(parents=True)
    (child / "config.toml").write_text("")
    nested = parent.root / "samples" / "kept-run"  # a run inside a folder this run owns
    nested.mkdir(parents=True)
    (nested / "run.lock").write_text("")
    kept = [
        child / "iter-000000" / "rollout" / "part-00000-of-00001.arrow.tmp-9900",
        nested / "metrics.jsonl.tmp-9900",
        parent.root / "notes" / "draft.txt.tmp-9900",  # a folder the run does not own
        parent.root / "notes.tmp-draft",  # not a name atomic_file makes
    ]
    removed = [  # what writers of this run that were killed mid-write leave
        parent.stage_dir(0, ROLLOUT) / "part-00000-of-00001.arrow.tmp-9901",
        parent.checkpoint_dir(0) / "ema" / "pytorch_lora_weights.safetensors.tmp-9902",
        parent.root / "metrics.jsonl.tmp-9903",
        parent.samples_path(0).with_name("iter-000000.png.tmp-9904"),
        parent.eval_dir(0) / "part-00000-of-00001.arrow.tmp-9905",
        parent.data_dir / "train.parquet.tmp-9906",
        parent.root / "report" / f"index.html.tmp-{dead_pid()}",
    ]
    for path in kept + removed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    result = cli("prepare", "--run", parent.root)
    assert result.exit_code == 0, result.output
    assert [p.exists() for p in kept] == [True] * len(kept)
    assert [p.exists() for p in removed] == [False] * len(removed)


def test_a_report_writing_now_keeps_its_temp_file_and_a_killed_ones_go(make_run):
    _, run = make_run()
    run.metrics_path.write_text(json.dumps({"iteration": 0, "rollout/reward_mean": 0.5}) + "\n")
    report = run.root / "report"
    report.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        writing = report / f"rewards.png.tmp-{live.pid}"  # a report that runs right now
        killed = report / f"index.html.tmp-{dead_pid()}"
        writing.write_bytes(b"x")
        killed.write_bytes(b"x")
        result = cli("prepare", "--run", run.root)  # a command taking the lock
        assert result.exit_code == 0, result.output
        assert writing.exists() and not killed.exists()
        killed.write_bytes(b"x")
        result = cli("report", run.root)  # a report takes no lock: it sweeps its own
        assert result.exit_code == 0, result.output
        assert writing.exists() and not killed.exists()
    finally:
        live.kill()
        live.wait()


# `python -m flowgrpo_cli` whose copy of the weights stalls once done: a kill lands mid-export.
_STALLING_EXPORT = """
import shutil, sys, time
from pathlib import Path
real = shutil.copyfile
def stalling(source, target, *args, **kwargs):
    real(source, target, *args, **kwargs)
    print("copied", flush=True)
    time.sleep(600)
shutil.copyfile = stalling
from flowgrpo_cli.cli import main
main()
"""


def test_a_rerun_of_a_killed_export_leaves_no_temp_folder(make_run, tmp_path):
    config, run = make_run()
    do_iteration(config, run)
    out = tmp_path / "exports" / "lora"
    killed = subprocess.Popen(
        [sys.executable, "-c", _STALLING_EXPORT, "export", str(run.root), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert killed.stdout.readline().strip() == "copied"
    finally:
        killed.kill()
        killed.wait()
    assert [p.name for p in out.parent.iterdir()] != []  # the killed export's temp folder
    result = cli("export", run.root, out)
    assert result.exit_code == 0, result.output
    assert [p.name for p in out.parent.iterdir()] == ["lora"]


# ---------------------------------------------------------------------------------------------
# 3. Config and run folder


def test_a_failed_command_keeps_the_runs_config(make_run, tmp_path):
    config, run = make_run()
    before = run.config_path.read_bytes()
    result = cli("loop", "--run", run.root, "-n", "1", "--set", "model.path=/bad",
                 "--allow-config-change")  # fmt: skip
    error_line(result.output, result.exit_code, "/bad")
    assert run.config_path.read_bytes() == before
    # A run where nothing was computed yet takes a changed config without the flag; a failed
    # command must leave that one as it was too.
    fresh = RunDir(tmp_path / "fresh")
    fresh.root.mkdir()
    fresh.config_path.write_text(dumps_config(config).replace(str(run.root), str(fresh.root)))
    before_fresh = tree(fresh.root)
    result = cli("rollout", "--run", fresh.root, "--set", "model.path=/bad")
    error_line(result.output, result.exit_code, "/bad")
    assert tree(fresh.root) == before_fresh


def test_a_run_that_lost_its_config_is_an_error_not_the_defaults(make_run, tmp_path):
    _, run = make_run()
    saved = tmp_path / "saved.toml"
    run.config_path.rename(saved)
    result = cli("loop", "--run", run.root, "-n", "1")
    error_line(result.output, result.exit_code, str(run.config_path), "--config")
    assert not run.config_path.exists() and not run.iterations()
    result = cli("prepare", "--run", run.root, "--config", saved)  # the way back
    assert result.exit_code == 0, result.output
    assert run.config_path.read_bytes() == saved.read_bytes()


def test_a_set_value_with_a_newline_is_refused(make_run):
    _, run = make_run()
    before = run.config_path.read_bytes()
    result = cli("config", "--run", run.root,
                 "--set", "sampler.noise_level=0.3\nsampler.num_steps=7")  # fmt: skip
    error_line(result.output, result.exit_code, "--set", "sampler.noise_level", "newline")
    result = cli("prepare", "--run", run.root, "--set", 'run.name="a\nb"')
    error_line(result.output, result.exit_code, "--set", "run.name")
    assert run.config_path.read_bytes() == before


@pytest.mark.slow
def test_a_run_begun_with_one_process_resumes_with_two(make_run):
    _, run = make_run()
    result = cli("rollout", "--run", run.root)  # then killed, say, before its score
    assert result.exit_code == 0, result.output
    rollout = read_manifest(run.stage_dir(0, ROLLOUT))
    result = flowgrpo("loop", "--run", run.root, "-n", "1", "--nproc", "2")
    assert result.returncode == 0, result.stderr
    assert read_manifest(run.checkpoint_dir(0)) is not None
    assert read_manifest(run.stage_dir(0, ROLLOUT)) == rollout  # kept, not redone


# ---------------------------------------------------------------------------------------------
# 4. Tracebacks no more


def _limit_file_size() -> None:  # in the child, before exec: `ulimit -f 20` with SIGXFSZ off
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_a_file_size_limit_is_a_storage_error(make_run):
    _, run = make_run()
    result = flowgrpo("loop", "--run", run.root, "-n", "1", preexec_fn=_limit_file_size)
    line = error_line(result.stderr, result.returncode, "File too large", str(run.root))
    assert "ulimit" in line
    assert not [p for p in run.root.rglob("*") if ".tmp-" in p.name]


def test_a_run_path_too_long_is_an_error(make_run, tmp_path):
    config, _ = make_run()
    config_file = tmp_path / "run.toml"
    config_file.write_text(dumps_config(config))
    root = str(tmp_path / "/".join(["a" * 200] * 19))
    root = root + "/" + "b" * (4060 - len(root) - 1)
    result = cli("loop", "-c", config_file, "--run", root, "-n", "1")
    error_line(result.output, result.exit_code, "File name too long", "shorter")


def test_tiny_model_onto_an_existing_file_is_an_error(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    result = cli("tiny-model", target)
    error_line(result.output, result.exit_code, str(target))
    assert target.read_text() == "mine"


@pytest.mark.parametrize("linked", ["iteration", "checkpoint"])
def test_restart_over_a_linked_folder_deletes_nothing_outside_the_run(make_run, tmp_path, linked):
    _, run = make_run()
    outside = tmp_path / "outside" / "iter-000000"
    (outside / "rollout").mkdir(parents=True)
    (outside / "rollout" / "part-00000-of-00001.arrow").write_bytes(b"someone else's")
    (outside / "manifest.json").write_text("{}")
    link = run.iteration_dir(0) if linked == "iteration" else run.checkpoint_dir(0)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path / "outside")
    result = cli("loop", "--run", run.root, "-n", "1", "--restart-from", "0")
    error_line(result.output, result.exit_code, str(link), "link")
    assert tree(tmp_path / "outside") == before
    assert link.is_symlink()
