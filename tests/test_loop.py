"""`flowgrpo loop`: end to end, resumable after SIGKILL at any point, one writer per run."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flowgrpo_cli.loop import run_loop
from flowgrpo_cli.reporting.report import write_report
from flowgrpo_cli.store.metrics_log import read_log
from flowgrpo_cli.store.rundir import ITERATION_STAGES, ROLLOUT, read_manifest, verify_stage

ITERATIONS = 2


def test_two_iterations_end_to_end(make_run):
    config, run = make_run("eval.every=1", "eval.num_steps=2", "eval.num_prompts=2")
    summaries = run_loop(config, run, ITERATIONS)
    assert [s.iteration for s in summaries] == [0, 1]
    for iteration in range(ITERATIONS):
        for stage in ITERATION_STAGES:
            verify_stage(run.stage_dir(iteration, stage))
        verify_stage(run.checkpoint_dir(iteration))
        assert run.samples_path(iteration).is_file()
        rollout = read_manifest(run.stage_dir(iteration, ROLLOUT))
        expected = "base" if iteration == 0 else "iter-000000:"
        assert rollout["policy_version"].startswith(expected)
    for iteration in range(ITERATIONS + 1):  # the base, after 1 and after 2 iterations
        assert (run.root / "samples" / f"eval-iter-{iteration:06d}.png").is_file()
    log = read_log(run)
    assert [line["iteration"] for line in log] == [0, 1, 2]
    assert "update/kl_reference" in log[0] and "eval/reward_mean" in log[0]
    assert set(log[2]) >= {"iteration", "eval/reward_mean"}
    # a re-run has nothing left to do and writes the same log
    assert run_loop(config, run, ITERATIONS) == []
    assert read_log(run) == log
    assert list((run.root / "tensorboard").glob("events.out.tfevents.*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run.root / "tensorboard"))
    board.Reload()
    logged = {event.step for event in board.Scalars("eval/reward_mean")}
    assert logged == {0, 1, 2}  # the base, and after each iteration: the final one too
    page = write_report(run).read_text()
    assert page.count("<img") >= 6 + 5  # plots + iteration and eval grids
    assert (run.root / "report" / "rewards.png").is_file()


def test_zero_iterations_evaluates_the_base_and_trains_nothing(make_run):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    _, run = make_run("eval.every=5", "eval.num_steps=2", "eval.num_prompts=2")
    result = CliRunner().invoke(app, ["loop", "--run", str(run.root), "-n", "0"])
    assert result.exit_code == 0, result.output
    metrics = json.loads((run.eval_dir(0) / "metrics.json").read_text())
    assert metrics["eval/images"] == 2
    reward = metrics["eval/reward_mean"]
    assert f"held-out evaluation of the base model: eval/reward_mean {reward:.4g}" in " ".join(
        result.output.split()
    )
    assert not run.stage_dir(0, ROLLOUT).exists() and run.current_iteration() == 0
    result = CliRunner().invoke(app, ["loop", "--run", str(run.root), "-n", "-1"])
    assert result.exit_code == 1 and "--iterations -1: must be at least 0" in result.output
    # with evaluation off, -n 0 would do nothing at all: an error, not a silent success
    _, quiet = make_run("eval.every=0", name="no-eval")
    result = CliRunner().invoke(app, ["loop", "--run", str(quiet.root), "-n", "0"])
    assert result.exit_code == 1 and "eval.every" in result.output, result.output


def test_rollouts_without_cfg_are_evaluated_with_it(make_run):
    """sampler.guidance_scale = 1 beside eval.guidance_scale > 1 (sample and train the
    conditional velocity, evaluate it as users sample it): the evaluation encodes the negative
    prompts itself, and scores the base exactly as a run that samples with CFG does."""

    def base_reward(*overrides: str, name: str) -> float:
        config, run = make_run(*overrides, "eval.every=1", "eval.num_steps=2",
                               "eval.num_prompts=2", name=name)  # fmt: skip
        run_loop(config, run, 1)
        return json.loads((run.eval_dir(0) / "metrics.json").read_text())["eval/reward_mean"]

    cfg_free = base_reward("sampler.guidance_scale=1.0", "eval.guidance_scale=4.5", name="a")
    guided = base_reward("sampler.guidance_scale=4.5", "eval.guidance_scale=4.5", name="b")
    unguided = base_reward("sampler.guidance_scale=1.0", "eval.guidance_scale=1.0", name="c")
    assert cfg_free == guided != unguided


def test_report_without_metrics_is_a_clear_error(tmp_path):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert "run `flowgrpo loop` first" in result.output


def test_a_long_runs_report_stays_small(tmp_path):
    """200 iterations of grids: a bounded number of thumbnails, linked to the grids."""
    import io

    import numpy as np
    from PIL import Image

    from flowgrpo_cli.reporting.grid import GridItem, make_grid
    from flowgrpo_cli.reporting.report import MAX_GRIDS
    from flowgrpo_cli.store.rundir import RunDir

    run = RunDir(tmp_path / "run")
    samples = run.root / "samples"
    samples.mkdir(parents=True)
    # The loop's own grid of 16 noise images: what the tiny random model draws, and the
    # hardest content to compress that a run makes.
    rng = np.random.default_rng(0)
    items = []
    for _ in range(16):
        buffer = io.BytesIO()
        noise = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(noise).save(buffer, format="PNG")
        items.append(GridItem(buffer.getvalue(), 'a sign that says "OPEN"', "OPEN", 0.5))
    (samples / "grid.png").write_bytes(make_grid(items))
    names = [f"iter-{i:06d}.png" for i in range(200)]
    names += [f"eval-iter-{i:06d}.png" for i in range(0, 201, 10)]
    for name in names:
        (samples / name).hardlink_to(samples / "grid.png")
    (samples / "grid.png").unlink()
    lines = [{"iteration": i, "update/loss": 0.1, "reward/ocr_mean": 0.5} for i in range(200)]
    run.metrics_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    page = write_report(run).read_text()
    assert 2 * MAX_GRIDS <= page.count("data:image/jpeg") <= 2 * MAX_GRIDS
    for first_and_last in ("iter-000000.png", "iter-000199.png", "eval-iter-000200.png"):
        assert f'href="../samples/{first_and_last}"' in page
    assert f"{len(names) - 2 * MAX_GRIDS} more grids in" in page
    assert len(page) < 3_000_000


def loop_command(run_root: Path) -> list[str]:
    return [sys.executable, "-m", "flowgrpo_cli", "loop", "--run", str(run_root),
            "--iterations", str(ITERATIONS)]  # fmt: skip


# `python -m flowgrpo_cli` whose atomic writes into the folder argv[1] stall before the rename:
# a kill "mid-save" then lands there every time, where a poll of a millisecond-long window
# can miss it and let the run finish. Patched before the CLI imports `atomic_file` by name.
_PAUSING_WRITER = """
import contextlib, sys, time
from pathlib import Path
import flowgrpo_cli.store.rundir as rundir
folder = Path(sys.argv.pop(1))
real = rundir.atomic_file

@contextlib.contextmanager
def pausing(path, mode="wb"):
    with real(path, mode) as handle:
        yield handle
        if Path(path).parent == folder:
            handle.flush()
            time.sleep(600)

rundir.atomic_file = pausing
from flowgrpo_cli.cli import main
main()
"""


def run_until(
    run_root: Path,
    marker: Path | Callable[[], bool],
    *,
    pause_in: Path | None = None,
    command: list[str] | None = None,
) -> None:
    """Start the loop, SIGKILL it as soon as `marker` exists (or is true), or let it finish.
    `pause_in`: every file written into that folder stalls before its rename. `command`: the
    loop's command line, if not loop_command(run_root)'s."""
    happened = marker.exists if isinstance(marker, Path) else marker
    command = list(command or loop_command(run_root))
    if pause_in is not None:
        command[1:3] = ["-c", _PAUSING_WRITER, str(pause_in)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if happened():
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()


def final_checkpoint(run_root: Path) -> bytes:
    folder = run_root / "checkpoints" / f"iter-{ITERATIONS - 1:06d}"
    assert read_manifest(folder) is not None
    return (folder / "pytorch_lora_weights.safetensors").read_bytes() + (
        folder / "optimizer.safetensors"
    ).read_bytes()


@pytest.mark.slow
def test_killed_anywhere_resumes_to_the_same_checkpoint(make_run):
    _, reference = make_run(name="reference")
    assert subprocess.run(loop_command(reference.root), capture_output=True).returncode == 0
    _, crashed = make_run(name="crashed")
    iteration = crashed.iteration_dir(1)
    kills = [
        iteration / "rollout" / "pending.json",  # during rollout
        iteration / "rollout" / "manifest.json",  # between rollout and score
        iteration / "scores" / "pending.json",  # during score
        iteration / "update" / "pending.json",  # during update
    ]
    for marker in kills:
        run_until(crashed.root, marker)
    result = subprocess.run(loop_command(crashed.root), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert final_checkpoint(crashed.root) == final_checkpoint(reference.root)
    lines = [json.loads(x) for x in (crashed.root / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [0, 1]


@pytest.mark.slow
def test_a_late_kill_loses_no_log_line_grid_or_temp_file(make_run):
    """Killed while saving the last checkpoint, right after it, and in the final evaluation:
    the re-run ends with every metrics line and grid, and no temporary file anywhere."""
    _, run = make_run("eval.every=2", "eval.num_steps=2", "eval.num_prompts=2")
    last_checkpoint = run.checkpoint_dir(ITERATIONS - 1)
    run_until(run.root, lambda: any(last_checkpoint.glob("*.tmp-*")), pause_in=last_checkpoint)
    assert not (last_checkpoint / "manifest.json").exists()  # the kill landed mid-save
    kills = [
        last_checkpoint / "manifest.json",  # after the last checkpoint, before the log
        run.eval_dir(ITERATIONS) / "pending.json",  # during the final evaluation
    ]
    for marker in kills:
        run_until(run.root, marker)
    assert not (run.root / "samples" / f"iter-{ITERATIONS - 1:06d}.png").exists()
    result = subprocess.run(loop_command(run.root), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    log = read_log(run)
    assert [line["iteration"] for line in log] == [0, 1, 2]
    assert "update/loss" in log[1] and "eval/reward_mean" in log[2]
    assert all(run.samples_path(n).is_file() for n in range(ITERATIONS))
    assert not [p for p in run.root.rglob("*") if ".tmp-" in p.name]
    assert "<img" in write_report(run).read_text()


def loop_holding_the_lock(run):
    """A `flowgrpo loop` process on `run`, returned once it holds the run's lock."""
    holder = subprocess.Popen(loop_command(run.root), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while not run.lock_path.is_file() or not run.lock_path.read_text():
        assert holder.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    return holder


def test_a_second_loop_on_a_locked_run_is_refused(make_run):
    _, run = make_run()
    holder = loop_holding_the_lock(run)
    try:
        result = subprocess.run(loop_command(run.root), capture_output=True, text=True)
        assert result.returncode == 1
        assert f"locked by pid {holder.pid}" in result.stderr
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_loop_as_two_ranks(make_run):
    # Regression: rank 1 once reached the score stage before rank 0 had written the rollout
    # manifest; every stage now ends with a barrier after its manifest.
    _, run = make_run()
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "loop", "--run", str(run.root),
         "--iterations", "1", "--nproc", "2"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(read_manifest(run.stage_dir(0, ROLLOUT))["trajectory_parts"]) == 2
    assert read_manifest(run.checkpoint_dir(0)) is not None


def test_grid_rows_are_as_tall_as_their_scaled_images():
    import io

    from PIL import Image

    from flowgrpo_cli.reporting.grid import CAPTION_LINES, CELL, LINE_HEIGHT, GridItem, make_grid

    def png(width: int, height: int) -> bytes:
        buffer = io.BytesIO()
        Image.new("RGB", (width, height), "black").save(buffer, format="PNG")
        return buffer.getvalue()

    caption = CAPTION_LINES * LINE_HEIGHT + 6
    wide = [GridItem(png(96, 32), 'A sign that says "AB7"', "AB7", 0.5)] * 3
    grid = Image.open(io.BytesIO(make_grid(wide, columns=2)))
    # 96x32 shown 192 wide is 64 tall: two rows of 64 px + caption, no square cells.
    assert grid.size == (2 * CELL, 2 * (64 + caption))
    assert grid.getpixel((10, 10)) == (0, 0, 0) and grid.getpixel((10, 70)) == (255, 255, 255)
    square = Image.open(io.BytesIO(make_grid([GridItem(png(64, 64), "p", "t", None)])))
    assert square.size == (4 * CELL, CELL + caption)


def test_a_command_the_lock_refuses_leaves_the_config_alone(make_run):
    _, run = make_run()
    before = run.config_path.read_bytes()
    holder = loop_holding_the_lock(run)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flowgrpo_cli", "rollout", "--run", str(run.root),
             "--set", "sampler.noise_level=0.3", "--allow-config-change"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert result.returncode == 1 and "locked by pid" in result.stderr
        assert run.config_path.read_bytes() == before
    finally:
        holder.kill()
        holder.wait()
