"""The best held-out evaluation (best.json, kept by retention, `export --best`) and the drift
rule (the training reward rising while the held-out reward falls: a warning, eval/drift, and
eval.stop_on_drift)."""

import json
import math
import textwrap

import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.evaluations import (
    Best,
    EvaluationPoint,
    assess,
    best_of,
    drift_by_evaluation,
    evaluation_points,
    slope,
)
from flowgrpo_cli.store.metrics_log import read_log
from flowgrpo_cli.store.rundir import read_manifest

# ---------------------------------------------------------------------------------------------
# The rules, by hand


def test_least_squares_slopes_worked_by_hand():
    # x = 5, 10, 15: mean 10, deviations -5, 0, 5, sum of squares 50
    assert slope([5, 10, 15], [0.2, 0.5, 0.6]) == pytest.approx((5 * 0.6 - 5 * 0.2) / 50)  # 0.04
    assert slope([5, 10, 15], [0.7, 0.75, 0.6]) == pytest.approx(-0.01)
    # four points: first vs last rose (0.5 -> 0.6), the least-squares line fell:
    # deviations -1.5, -0.5, 0.5, 1.5 (squares 5); -0.75 - 0.4 + 0.1 + 0.9 = -0.15; / 5
    assert slope([1, 2, 3, 4], [0.5, 0.8, 0.2, 0.6]) == pytest.approx(-0.03)
    # uneven spacing (a final evaluation off the eval.every grid): x = 5, 10, 12, mean 9,
    # deviations -4, 1, 3 (squares 26); -4 * 1 + 1 * 2 + 3 * 4 = 10
    assert slope([5, 10, 12], [1.0, 2.0, 4.0]) == pytest.approx(10 / 26)
    # exact: a flat series is 0, neither rose nor fell, whatever float rounding would say
    assert slope([1, 2, 3], [0.1, 0.1, 0.1]) == 0.0
    assert slope([3, 4], [0.3, 0.30000000000000004]) > 0  # the smallest rise counts
    with pytest.raises(ValueError):
        slope([1], [0.5])


def line(iteration, train=None, held_out=None):
    out = {"iteration": iteration}
    if train is not None:
        out["reward/mean"] = train
    if held_out is not None:
        out["eval/reward_mean"] = held_out
    return out


def test_training_reward_is_the_mean_since_the_previous_evaluation():
    """every = 2: the evaluation at 2 pairs with iterations 0-1, at 4 with 2-3; the base (0)
    has no training reward; a final evaluation at 5 with iteration 4 alone."""
    lines = [
        line(0, train=0.1, held_out=0.5),
        line(1, train=0.3),
        line(2, train=0.4, held_out=0.6),
        line(3, train=0.6),
        line(4, train=float("nan"), held_out=0.55),  # not finite: left out of the mean
        line(5, held_out=0.4),
    ]
    points = evaluation_points(lines)
    assert points == [
        EvaluationPoint(0, 0.5, None),
        EvaluationPoint(2, 0.6, pytest.approx(0.2)),  # (0.1 + 0.3) / 2
        EvaluationPoint(4, 0.55, pytest.approx(0.5)),  # (0.4 + 0.6) / 2
        EvaluationPoint(5, 0.4, None),  # iteration 4's reward is NaN: no training reward
    ]
    # window 2 over (2, 4): train 0.2 -> 0.5 rose (slope 0.3 / 2 = 0.15), held-out fell
    drift = assess(points[:3], 2)
    assert drift is not None and drift.drifting and drift.iteration == 4
    assert drift.train_slope == pytest.approx(0.15) and drift.held_out_slope == pytest.approx(
        -0.025
    )
    assert assess(points[:2], 2) is None  # the window would hold the base: not assessed
    assert assess(points, 2) is None  # the last point has no training reward
    assert assess(points[:3], 3) is None  # fewer assessable points than the window
    assert assess(points[:3], 0) is None  # off


def test_drift_needs_both_trends():
    def drift(trains, held_outs, window=3):
        lines = [line(0, held_out=0.5)]
        for k, (t, h) in enumerate(zip(trains, held_outs, strict=True), start=1):
            lines[-1]["reward/mean"] = t  # the iteration before evaluation k (every = 1)
            lines.append(line(k, held_out=h))
        return {n: d.drifting for n, d in drift_by_evaluation(lines, window).items()}

    # t: 0.1, 0.2, 0.3 (+0.1 a step); h: 0.9, 0.8, 0.7 (-0.1): drift at evaluation 3 only
    assert drift([0.1, 0.2, 0.3], [0.9, 0.8, 0.7]) == {3: True}
    assert drift([0.1, 0.2, 0.3], [0.7, 0.8, 0.9]) == {3: False}  # both rose: learning
    assert drift([0.3, 0.2, 0.1], [0.9, 0.8, 0.7]) == {3: False}  # both fell
    assert drift([0.1, 0.1, 0.1], [0.9, 0.8, 0.7]) == {3: False}  # training flat
    # four evaluations, windows (1-3) and (2-4): h = 0.9, 0.8, 0.85, 0.7; slopes of the
    # second window (0.8, 0.85, 0.7): (0.7 - 0.8) / 2 = -0.05
    assert drift([0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.85, 0.7]) == {3: True, 4: True}
    # window 2 is first vs last: (0.8 -> 0.85) rose at 3
    assert drift([0.1, 0.2, 0.3, 0.4], [0.9, 0.8, 0.85, 0.7], 2) == {
        2: True,
        3: False,
        4: True,
    }


def test_best_is_the_highest_and_the_earliest_on_a_tie():
    assert best_of([]) is None
    assert best_of([(0, float("nan"))]) is None
    best = best_of([(0, 0.5), (3, 0.9), (1, 0.9), (2, float("inf")), (4, 0.2)])
    assert best == Best(1, 0.9, 4) and best.checkpoint == 0 and not best.base
    base = best_of([(0, 0.9), (1, 0.5)])
    assert base is not None and base.base and base.checkpoint is None
    assert base.record()["checkpoint"] is None and base.record()["evaluation"] == (
        "eval/iter-000000"
    )


# ---------------------------------------------------------------------------------------------
# Through the loop, with a reward the test controls

PLUGIN = """
import pathlib

RUN = pathlib.Path({run!r})
HELD_OUT = {held_out!r}  # the k-th evaluation's reward


def score(images, prompts, metadata):
    ids = [meta["sample_id"] for meta in metadata]
    if all(i.startswith("eval-") for i in ids):
        done = [p for p in (RUN / "eval").glob("iter-*") if (p / "manifest.json").is_file()]
        return [HELD_OUT[len(done)]] * len(ids)
    # a rollout's sample id is i<iteration>-g<group>-k<index>: the reward rises with the
    # iteration (and differs within a group, so advantages are not all zero)
    return [int(i[1:7]) + 0.01 * int(i.split("-k")[1]) for i in ids]


score.parallel_safe = True
"""


@pytest.fixture
def controlled_run(make_run, tmp_path):
    """(held_out rewards by evaluation, overrides...) -> a run whose held-out reward is
    `held_out[k]` at its k-th evaluation (k finished before it: resumes agree) and whose
    rollout reward is the iteration (+ 0.01 x the image's index in its group)."""

    def make(held_out, *overrides, name="run"):
        plugins = tmp_path / f"plugins-{name}"
        plugins.mkdir()
        module = f"ctl_{name.replace('-', '_')}"
        code = PLUGIN.format(run=str(tmp_path / name), held_out=list(held_out))
        (plugins / f"{module}.py").write_text(textwrap.dedent(code))
        return make_run(
            f'reward.plugin_dirs=["{plugins}"]',
            f'reward.weights={{"{module}:score" = 1.0}}',
            "eval.every=1",
            "eval.num_steps=2",
            "eval.num_prompts=2",
            *overrides,
            name=name,
        )

    return make


def loop(run, *args):
    return CliRunner().invoke(app, ["loop", "--run", str(run.root), *args])


def export(run, out, *args):
    return CliRunner().invoke(app, ["export", str(run.root), str(out), *args])


def text(result) -> str:
    return " ".join(result.output.split())  # rich wraps long lines


def weights_kept(run, iteration) -> bool:
    return "pruned" not in read_manifest(run.checkpoint_dir(iteration))


# evaluations 0 (base) .. 4: the best is eval/iter-000001 after 2 iterations, eval/iter-000003
# (checkpoint iter-000002) after 4
HELD_OUT = [0.5, 0.9, 0.7, 0.95, 0.6]


def test_the_best_is_recorded_kept_and_agrees_after_a_resume(controlled_run):
    _, whole = controlled_run(HELD_OUT, name="whole")
    result = loop(whole, "-n", "4")
    assert result.exit_code == 0, result.output
    record = json.loads(whole.best_path.read_text())
    assert record == {
        "metric": "eval/reward_mean",
        "value": 0.95,
        "evaluation": "eval/iter-000003",
        "updates": 3,
        "base": False,
        "checkpoint": "checkpoints/iter-000002",
        "checkpoint_iteration": 2,
        "evaluations": 5,
    }
    assert (
        "best held-out evaluation: eval/iter-000003, checkpoint iter-000002 (the policy after "
        "3 updates): eval/reward_mean 0.95 (best of 5 evaluations)" in text(result)
    )
    # run.checkpoint_every = 10 keeps only the latest (iter-3): the best's stays too
    assert [weights_kept(whole, n) for n in range(4)] == [False, False, True, True]

    _, resumed = controlled_run(HELD_OUT, name="resumed")
    assert loop(resumed, "-n", "2").exit_code == 0
    first = json.loads(resumed.best_path.read_text())
    assert (first["evaluation"], first["evaluations"]) == ("eval/iter-000001", 3)
    assert [weights_kept(resumed, n) for n in range(2)] == [True, True]  # best, latest
    resumed.best_path.write_text("{stale")  # as a kill before its rewrite could leave it
    assert loop(resumed, "-n", "4").exit_code == 0
    assert resumed.best_path.read_bytes() == whole.best_path.read_bytes()
    # the former best's checkpoint went once a later evaluation beat it
    assert [weights_kept(resumed, n) for n in range(4)] == [False, False, True, True]

    def evals(run):
        keys = ("eval/reward_mean", "eval/drift", "reward/mean")
        return [{k: v for k, v in x.items() if k in keys} for x in read_log(run)]

    assert evals(resumed) == evals(whole)

    # export --best is export -i 2, file for file (the card records --iteration 2)
    tmp = whole.root.parent
    best = export(whole, tmp / "a" / "out", "--best")
    assert best.exit_code == 0, best.output
    assert "best held-out evaluation: eval/iter-000003" in text(best)
    by_number = export(whole, tmp / "b" / "out", "-i", "2")
    assert by_number.exit_code == 0, by_number.output
    files = sorted(p.name for p in (tmp / "a" / "out").iterdir())
    assert files == sorted(p.name for p in (tmp / "b" / "out").iterdir())
    assert "pytorch_lora_weights.safetensors" in files
    for name in files:
        assert (tmp / "a" / "out" / name).read_bytes() == (tmp / "b" / "out" / name).read_bytes()
    result = export(whole, tmp / "c", "--best", "-i", "1")
    assert result.exit_code == 1 and "--best and --iteration 1" in text(result)

    # report and inspect: one line each
    report = CliRunner().invoke(app, ["report", str(whole.root)])
    assert report.exit_code == 0, report.output
    page = (whole.root / "report" / "index.html").read_text()
    assert "Best held-out evaluation: eval/iter-000003, checkpoint iter-000002" in page
    assert "best held-out evaluation: eval/iter-000003" in text(report)
    inspect = CliRunner().invoke(app, ["inspect", str(whole.root)])
    assert inspect.exit_code == 0, inspect.output
    assert "best held-out evaluation: eval/iter-000003, checkpoint iter-000002" in text(inspect)


def test_export_best_refuses_without_a_trained_best(controlled_run, make_run, tmp_path):
    _, untrained = make_run(name="untrained")
    result = export(untrained, tmp_path / "out", "--best")
    assert result.exit_code == 1
    assert "--best:" in text(result) and "no held-out evaluation yet" in text(result)

    # the base model evaluated, nothing beat it: said by the loop, refused by export
    _, base = controlled_run([0.9, 0.5], name="base")
    result = loop(base, "-n", "0")
    assert result.exit_code == 0, result.output
    assert (
        "best held-out evaluation: eval/iter-000000, the base model: eval/reward_mean 0.9 "
        "(best of 1 evaluation; no checkpoint beat the base model)" in text(result)
    )
    assert json.loads(base.best_path.read_text())["base"] is True
    result = export(base, tmp_path / "out", "--best")
    assert result.exit_code == 1
    assert "the best held-out evaluation is the base model's" in text(result)
    assert not (tmp_path / "out").exists()


# held-out: the base 0.5, then 0.9, 0.8, 0.7, ... falling while the training reward rises
FALLING = [0.5, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]


def test_drift_warns_records_and_stops(controlled_run):
    config, run = controlled_run(FALLING, "eval.stop_on_drift=true", name="drift")
    assert config.eval.drift_window == 3  # the default
    result = loop(run, "-n", "6")
    assert result.exit_code == 0, result.output
    # evaluations 1-3: training 0.005 -> 1.005 -> 2.005 (slope +1), held-out 0.9 -> 0.8 ->
    # 0.7 (slope -0.1): one warning, at the third evaluation after the base, and the stop
    out = text(result)
    assert out.count("warning: drift") == 1
    assert (
        "warning: drift at eval/iter-000003: over 3 evaluations (eval/iter-000001 to "
        "eval/iter-000003) the training reward/mean rose (0.005 -> 1.005 -> 2.005, least-squares "
        "slope +1 per iteration) while the held-out eval/reward_mean fell (0.9 -> 0.8 -> 0.7, "
        "slope -0.1 per iteration)" in out
    )
    assert run.current_iteration() == 3  # iterations 0-2 ran, then evaluation 3 drifted
    assert "held-out evaluation of the policy after 3 updates" in out
    assert (
        "stopped (eval.stop_on_drift) at eval/iter-000003, after 3 updates: the held-out reward "
        "fell while the training reward rose; the best held-out evaluation is eval/iter-000001, "
        "checkpoints/iter-000000: `flowgrpo export" in out
    )
    assert "OUT --best` exports it" in out and "--set eval.stop_on_drift=false" in out
    assert "3/6 iterations done" in out
    assert weights_kept(run, 0)  # the best's checkpoint (run.checkpoint_every = 10)
    assert json.loads(run.best_path.read_text())["checkpoint_iteration"] == 0
    drift = {x["iteration"]: x.get("eval/drift") for x in read_log(run)}
    assert drift == {0: None, 1: None, 2: None, 3: 1.0}  # assessed from the third on

    # the same command stops there again, before any work
    again = loop(run, "-n", "6")
    assert again.exit_code == 0, again.output
    assert "stopped (eval.stop_on_drift) at eval/iter-000003" in text(again)
    assert run.current_iteration() == 3
    # switched off (no --allow-config-change: it changes no result), the loop goes on and warns
    on = loop(run, "-n", "4", "--set", "eval.stop_on_drift=false")
    assert on.exit_code == 0, on.output
    assert run.current_iteration() == 4 and "stopped" not in text(on)
    assert "warning: drift at eval/iter-000004" in text(on)
    drift = {x["iteration"]: x.get("eval/drift") for x in read_log(run)}
    assert drift == {0: None, 1: None, 2: None, 3: 1.0, 4: 1.0}
    assert math.isclose(read_log(run)[-1]["eval/reward_mean"], 0.6)


def test_the_drift_keys_leave_the_config_hash_alone():
    from flowgrpo_cli.store.config import config_hash, load_config

    base = load_config(None)
    for key in ("eval.drift_window=0", "eval.drift_window=7", "eval.stop_on_drift=true"):
        assert config_hash(load_config(None, [key])) == config_hash(base), key
    with pytest.raises(Exception, match="must be 0 \\(off\\) or at least 2"):
        load_config(None, ["eval.drift_window=1"])


@pytest.mark.slow
def test_every_rank_stops_on_drift(controlled_run):
    """Two ranks: rank 0 decides and every rank stops with it (none is left waiting in the
    next rollout's collectives)."""
    import subprocess
    import sys

    _, run = controlled_run(FALLING, "eval.stop_on_drift=true", "eval.drift_window=2")
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "loop", "--run", str(run.root), "-n", "6",
         "--nproc", "2"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    # evaluations 1-2: training 0.005 -> 1.005, held-out 0.9 -> 0.8 (window 2: first vs last)
    assert "stopped (eval.stop_on_drift) at eval/iter-000002" in out, out
    assert run.current_iteration() == 2
