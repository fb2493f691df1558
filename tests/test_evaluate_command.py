"""`flowgrpo evaluate`: the loop's held-out evaluation of any finished checkpoint, or of the
base model, as a command of its own; and the one shape every stage module shares."""

import inspect
import json
import shutil

from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.metrics_log import read_log

runner = CliRunner()
EVAL = ("eval.every=1", "eval.num_steps=2", "eval.num_prompts=2", "run.checkpoint_every=1")


def flowgrpo(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def flat(output: str) -> str:
    return " ".join(output.split())


def recorded(run, m: int) -> dict:
    """What eval/iter-M holds: metrics (less the time taken), identity, part and grid bytes."""
    folder = run.eval_dir(m)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics.pop("eval/seconds")
    return {
        "metrics": metrics,
        "identity": json.loads((folder / "manifest.json").read_text())["identity"],
        "parts": {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.arrow"))},
        "grid": run.eval_samples_path(m).read_bytes(),
    }


def forget(run, m: int) -> None:
    shutil.rmtree(run.eval_dir(m))
    run.eval_samples_path(m).unlink()


def without_seconds(log: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "eval/seconds"} for line in log]


def test_evaluate_gives_the_loops_numbers_for_ema_weights(make_run):
    """A 2-iteration run with EMA (evaluated through the trainer, as the loop does): the
    command redraws the loop's evaluations of checkpoint 0 and of the base bit for bit, a
    re-run of a finished one is reported, not recomputed, and bad input is a clean error."""
    _, run = make_run(*EVAL, "train.ema_decay=0.9")
    result = flowgrpo("loop", "--run", run.root, "-n", "2")
    assert result.exit_code == 0, result.output
    loop = {m: recorded(run, m) for m in (0, 1, 2)}
    log = read_log(run)
    assert loop[1]["identity"]["policy"].endswith("+ema")

    forget(run, 1)
    result = flowgrpo("evaluate", "--run", run.root, "--iteration", "0")
    assert result.exit_code == 0, result.output
    assert recorded(run, 1) == loop[1]
    assert (
        "held-out evaluation of checkpoint iter-000000 (the policy after 1 update), its EMA "
        f"weights -> {run.eval_dir(1)}" in flat(result.output)
    )
    forget(run, 0)
    result = flowgrpo("evaluate", "--run", run.root, "--base")
    assert result.exit_code == 0, result.output
    assert recorded(run, 0) == loop[0]
    assert f"held-out evaluation of the base model -> {run.eval_dir(0)}" in flat(result.output)
    assert without_seconds(read_log(run)) == without_seconds(log)  # for `flowgrpo report`

    # the default is the latest checkpoint (1), whose evaluation the loop made: reported as is
    folder = run.eval_dir(2)
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    seconds = json.loads((folder / "metrics.json").read_text())["eval/seconds"]
    result = flowgrpo("evaluate", "--run", run.root)
    assert result.exit_code == 0, result.output
    assert "was already evaluated with the same config and weights: not recomputed" in flat(
        result.output
    )
    assert f"{seconds:.6g}" in result.output  # the recorded metrics, not new ones
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps

    result = flowgrpo("evaluate", "--run", run.root, "--iteration", "5")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        f"--iteration 5: {run.checkpoint_dir(5)} does not exist; checkpoints with weights: "
        "iterations 0-1" in flat(result.output)
    )


def test_base_then_loop_then_a_checkpoint_without_ema(make_run):
    """`--base` on a run that has not trained: the loop then finds that evaluation and keeps it
    (same identity), the report and inspect show it as the base's; a checkpoint's evaluation
    by the command equals the loop's (plain weights)."""
    _, run = make_run(*EVAL)
    result = flowgrpo("evaluate", "--run", run.root, "--base")
    assert result.exit_code == 0, result.output
    base = recorded(run, 0)
    assert base["identity"]["policy"] == "base"
    metrics = (run.eval_dir(0) / "metrics.json").read_bytes()
    assert [line["iteration"] for line in read_log(run)] == [0]
    result = flowgrpo("report", run.root)
    assert result.exit_code == 0, result.output
    assert "<td>0 (base model)</td>" in (run.root / "report" / "index.html").read_text()
    result = flowgrpo("inspect", run.root)
    assert result.exit_code == 0, result.output
    assert "eval/iter-000000 (the base model): done (images 2)" in flat(result.output)

    result = flowgrpo("loop", "--run", run.root, "-n", "1")
    assert result.exit_code == 0, result.output
    assert (run.eval_dir(0) / "metrics.json").read_bytes() == metrics  # kept, not redone
    loop = recorded(run, 1)
    forget(run, 1)
    result = flowgrpo("evaluate", "--run", run.root)  # the latest checkpoint: iter-000000
    assert result.exit_code == 0, result.output
    assert recorded(run, 1) == loop
    assert "checkpoint iter-000000 (the policy after 1 update) ->" in flat(result.output)
    result = flowgrpo("inspect", run.root)
    assert "eval/iter-000001 (the policy after 1 update): done" in flat(result.output)


def test_evaluate_refuses_bad_input_cleanly(make_run, tmp_path):
    missing = tmp_path / "nowhere"
    result = flowgrpo("evaluate", "--run", missing)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{missing} is not a run directory (it has no config.toml)" in flat(result.output)
    assert not missing.exists()
    _, run = make_run(*EVAL)
    result = flowgrpo("evaluate", "--run", run.root, "--base", "--iteration", "0")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--base and --iteration 0 name two policies: give one" in flat(result.output)
    result = flowgrpo("evaluate", "--run", run.root)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "has no finished checkpoint yet" in flat(result.output)
    assert "evaluate the base model with --base" in flat(result.output)
    result = flowgrpo("evaluate", "--run", run.root, "-i", "2")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "the run has no checkpoint with weights" in flat(result.output)
    result = flowgrpo("evaluate", "--run", run.root, "-i", "-1")
    assert result.exit_code == 1 and "must be at least 0" in flat(result.output)
    assert not run.eval_dir(0).parent.exists()  # nothing was evaluated


def test_prepare_returns_a_stage_result(make_run):
    from flowgrpo_cli.launch.stage import StageResult
    from flowgrpo_cli.stages import prepare

    config, run = make_run()  # prepared once already
    result = prepare.run(config, run)
    assert isinstance(result, StageResult) and not result.fresh
    assert result.manifest["counts"] == {"train": 6, "test": 6}
    assert result.manifest["summary"]["skipped_invalid"] == 0
    assert result.metrics == {
        "data/train_prompts": 6.0,
        "data/test_prompts": 6.0,
        "data/skipped_invalid": 0.0,
    }
    shutil.rmtree(run.data_dir)
    again = prepare.run(config, run)
    assert again.fresh and again.manifest == result.manifest and again.metrics == result.metrics
    cli = flowgrpo("prepare", "--run", run.root)
    assert cli.exit_code == 0, cli.output
    assert "already prepared from the same prompts and config: left as it was" in flat(cli.output)


def test_every_stage_module_has_the_same_run():
    """run(config, run, ...) -> StageResult in every stage module (stages/__init__.py)."""
    import flowgrpo_cli.stages as stages
    from flowgrpo_cli.stages import evaluate, prepare, rollout, score, update

    assert stages.StageRun
    for module in (prepare, rollout, score, update, evaluate):
        signature = inspect.signature(module.run)
        assert list(signature.parameters)[:2] == ["config", "run"], module.__name__
        assert signature.return_annotation == "StageResult", module.__name__


def test_evaluate_as_two_ranks(make_run):
    """--nproc 2: each rank draws its share of the prompts (one part each) from the same
    seeds; another batch split moves a pixel by at most one level."""
    import io
    import subprocess
    import sys

    import numpy as np
    import pyarrow as pa
    import pytest
    from PIL import Image

    def drawn(run) -> tuple[int, dict]:
        parts = sorted(run.eval_dir(0).glob("part-*.arrow"))
        rows = pa.concat_tables(pa.ipc.open_file(p).read_all() for p in parts).to_pylist()
        pixels = {r["sample_id"]: np.asarray(Image.open(io.BytesIO(r["image"]))) for r in rows}
        return len(parts), {k: v.astype(int) for k, v in pixels.items()}

    _, one = make_run(*EVAL, "eval.num_prompts=3", name="one")
    assert flowgrpo("evaluate", "--run", one.root, "--base").exit_code == 0
    _, two = make_run(*EVAL, "eval.num_prompts=3", name="two")
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "evaluate", "--run", str(two.root), "--base",
         "--nproc", "2"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (count_one, alone), (count_two, split) = drawn(one), drawn(two)
    assert (count_one, count_two) == (1, 2) and alone.keys() == split.keys()
    assert max(np.abs(alone[k] - split[k]).max() for k in alone) <= 1
    metrics = [json.loads((r.eval_dir(0) / "metrics.json").read_text()) for r in (one, two)]
    assert metrics[1]["eval/images"] == 3
    assert metrics[1]["eval/reward_mean"] == pytest.approx(metrics[0]["eval/reward_mean"], abs=1e-3)
