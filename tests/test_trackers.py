"""log.trackers: TensorBoard, trackio and W&B get each iteration's metrics, grids and config."""

import sys

import pytest

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.loop import run_loop
from flowgrpo_cli.reporting.trackers import active_trackers
from flowgrpo_cli.store.metrics_log import read_log

EVAL = ("eval.every=1", "eval.num_steps=2", "eval.num_prompts=2")


def test_every_tracker_gets_every_iteration_with_its_grids(make_run, tmp_path, monkeypatch):
    # trackio reads TRACKIO_DIR once, when first imported: set it first, then check it held.
    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    trackio = pytest.importorskip("trackio")
    assert store == trackio.utils.TRACKIO_DIR, "trackio was imported earlier"
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # not under ~
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    trackers = 'log.trackers=["tensorboard", "trackio", "wandb"]'
    config, run = make_run(*EVAL, trackers, "log.project=fg-test", "train.lr=0.01")
    run_loop(config, run, 2)
    log = {line["iteration"]: line for line in read_log(run)}
    assert sorted(log) == [0, 1, 2]

    # trackio, read back from its local store: every line, at its step, with both grids.
    from trackio.sqlite_storage import SQLiteStorage

    logged = {row["step"]: row for row in SQLiteStorage.get_logs("fg-test", "run")}
    assert sorted(logged) == [0, 1, 2]
    for step, line in log.items():
        for key, value in line.items():
            if key != "iteration":
                assert logged[step][key] == pytest.approx(value), (step, key)
        assert logged[step]["samples/eval"]["_type"] == "trackio.image"
    assert "samples/train" in logged[0] and "samples/train" not in logged[2]
    config_logged = SQLiteStorage.get_run_config("fg-test", "run")
    assert config_logged["train.lr"] == 0.01 and config_logged["run.keep_trajectories"] == 2

    # TensorBoard: scalars at every step, the grids as images, the config as hyperparameters.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run.root / "tensorboard"), size_guidance={"images": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("eval/reward_mean")] == [0, 1, 2]
    assert [e.step for e in board.Images("samples/train")] == [0, 1]
    assert "_hparams_/experiment" in board.summary_metadata

    # W&B, offline: one run in RUN/wandb, its id from the run folder, holding the metrics, the
    # config and both grids of each step (this wandb has no reader of its offline files).
    (offline,) = (run.root / "wandb").glob("offline-run-*")
    records = next(offline.glob("run-*.wandb")).read_bytes()
    for key in ("eval/reward_mean", "update/loss", "train.lr", "run.keep_trajectories"):
        assert key.encode() in records, key
    grids = sorted(p.name.split("_")[0] for p in offline.glob("files/media/images/samples/*"))
    assert grids == ["eval"] * 3 + ["train"] * 2


def test_a_missing_tracker_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(FlowGrpoError, match=r"pip install 'flowgrpo\[wandb\]'"):
        active_trackers(["tensorboard", "wandb"])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert active_trackers(["tensorboard"]) == []  # the default list: skipped when missing


def test_an_unknown_tracker_is_a_config_error():
    from flowgrpo_cli.store.config import load_config

    with pytest.raises(FlowGrpoError, match="unknown trackers"):
        load_config(None, ['log.trackers=["mlflow"]'])
