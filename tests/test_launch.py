"""Launching ranks as a GPU user does: the device check before any rank starts, an error that
every rank raises printed once, torchrun, and bfloat16 mixed precision in one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from flowgrpo_cli.cli import app


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    ("device", "gpus", "nproc", "message"),
    [
        ("cuda", 1, 8, "8 ranks need one GPU each, but 1 GPU is visible"),
        ("auto", 2, 8, "8 ranks need one GPU each, but 2 GPUs are visible"),
        ("cuda", 0, 1, "model.device = 'cuda', but no CUDA device is visible"),
        ("cuda:3", 2, 1, "model.device = 'cuda:3', but only 2 GPUs are visible"),
        ("cuda:0", 2, 2, "puts all 2 ranks on one GPU"),
    ],
)
def test_too_few_gpus_stop_the_launch_before_any_rank_starts(
    tmp_path, monkeypatch, device, gpus, nproc, message
):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(
        "flowgrpo_cli.launch.distributed.launch_local",
        lambda *_: pytest.fail("ranks were started"),
    )
    run = tmp_path / "run"
    result = invoke(
        "loop", "-n", "1", "--run", str(run), "--nproc", str(nproc),
        "--set", f"model.device={device!r}".replace("'", '"'),
    )  # fmt: skip
    assert result.exit_code == 1
    assert message in result.output
    assert result.output.count("error:") == 1
    assert not run.exists()  # nothing written: the corrected command starts clean


def test_cpu_ranks_need_no_gpu(monkeypatch):
    from flowgrpo_cli.launch.distributed import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    check_devices("cpu", 8)
    check_devices("auto", 8)  # auto without a GPU is the CPU


def _flowgrpo(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", *args],
        capture_output=True, text=True, timeout=600, **kwargs,
    )  # fmt: skip


def test_an_error_every_rank_raises_is_printed_once(tmp_path):
    missing = tmp_path / "no-model"
    result = _flowgrpo(
        "rollout", "--run", str(tmp_path / "run"), "--nproc", "2",
        "--set", f"model.path={missing}", "--set", "model.device=cpu",
    )  # fmt: skip
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert output.count(f"Model folder {missing} does not exist") == 1, output
    assert "exitcode" not in output  # the elastic agent's own failure log stays quiet
    assert "Traceback" not in output


def test_different_rank_errors_are_each_named():
    from flowgrpo_cli.cli import _rank_errors

    assert _rank_errors({0: "a", 1: "a"}) == "a"
    assert (
        _rank_errors({0: "a", 1: "b", 2: "a"}) == "the ranks failed:\n  ranks 0, 2: a\n  rank 1: b"
    )
    assert "traceback is above" in _rank_errors({})


@pytest.mark.slow
def test_torchrun_trains_what_nproc_trains(make_run):
    """`torchrun ... -m flowgrpo_cli loop --run-dir R` is the same run as `--nproc 2`: rank 0
    takes the lock and stores the config, and the checkpoint is the same to the byte."""
    config, run = make_run()
    shutil.rmtree(run.root)  # a fresh run: the launch itself stores the config
    config_file = run.root.parent / "run.toml"
    from flowgrpo_cli.store.config import dumps_config

    config_file.write_text(dumps_config(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {name: run.root.parent / name for name in ("nproc", "torchrun")}
    result = _flowgrpo("loop", "-n", "1", "--config", str(config_file), "--run-dir",
                       str(runs["nproc"]), "--nproc", "2", env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "localhost:0", "-m", "flowgrpo_cli", "loop", "-n", "1",
         "--config", str(config_file), "--run-dir", str(runs["torchrun"])],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not (runs["torchrun"] / "run.lock").exists() or _lock_is_free(runs["torchrun"])
    stored = [(folder / "config.toml").read_text() for folder in runs.values()]
    assert stored[0].replace("/nproc", "/torchrun") == stored[1]
    weights = [
        load_file(folder / "checkpoints/iter-000000/pytorch_lora_weights.safetensors")
        for folder in runs.values()
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _lock_is_free(run: Path) -> bool:
    from flowgrpo_cli.store.rundir import RunLock

    with RunLock(run):
        return True


def test_bfloat16_mixed_precision_computes_in_bfloat16_in_one_process(make_run):
    """train.mixed_precision = "bfloat16" changes the arithmetic of a single process (it
    used to be honoured under FSDP only), and rollout and update still agree on it."""
    metrics = {}
    for precision in ("none", "bfloat16"):
        _, run = make_run(f"train.mixed_precision={precision!r}".replace("'", '"'), name=precision)
        result = invoke("loop", "-n", "1", "--run", str(run.root))
        assert result.exit_code == 0, result.output
        lines = (run.root / "metrics.jsonl").read_text().splitlines()
        metrics[precision] = json.loads(lines[0])
    full, mixed = metrics["none"], metrics["bfloat16"]
    # the same noise drew other images: bfloat16 arithmetic, close to float32's
    assert mixed["reward/mean"] != full["reward/mean"]
    assert mixed["reward/mean"] == pytest.approx(full["reward/mean"], rel=0.05)
    assert mixed["update/grad_norm"] != pytest.approx(full["update/grad_norm"], rel=1e-4)
    # the same autocast in rollout and update: still on-policy
    assert full["update/logprob_gap_max"] == mixed["update/logprob_gap_max"] == 0.0


def test_full_modes_reference_autocasts_its_own_forward():
    """compute_in_bfloat16 binds the forward to its module, so the deepcopy the trainer keeps
    as full mode's frozen reference computes with the reference's weights, not the policy's."""
    import copy

    from flowgrpo_cli.training.policy import compute_in_bfloat16

    policy = torch.nn.Linear(4, 4)
    compute_in_bfloat16(policy, torch.device("cpu"))
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        reference.weight.zero_()
        reference.bias.zero_()
    x = torch.randn(2, 4)
    assert policy(x).dtype == torch.bfloat16
    assert reference(x).abs().max() == 0
    assert policy(x).abs().max() > 0
