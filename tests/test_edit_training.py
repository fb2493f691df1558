"""Every training path on the edit family, on the tiny qwenimage_edit model with an editing
data set: each algorithm's 2-iteration loop, full fine-tuning, a run killed mid-rollout that
resumes to the uninterrupted run's bytes, and the update sharded over two processes (FSDP2)
equal to one.

Source images are resized to 64 x 64 here rather than the pipeline's 1 MP
(helpers.small_edit_sources, also in the subprocesses): what these paths do with the source
latents (stored with each group by the rollout, read back by the update) is the same at any
size, and at 1 MP one forward takes a second on one core."""

import math
import shutil
import subprocess
import sys

import pytest
from helpers import do_rollout, do_score, do_update, small_edit_sources
from safetensors.torch import load_file
from test_edit_data import edit_jsonl

from flowgrpo_cli.loop import run_loop

# What each algorithm needs beyond the shared tiny run, as tests/test_algorithms.py runs them:
# mixgrpo's window moving every iteration; flow_grpo with true CFG (the source's tokens in the
# conditional and the negative forward), the others without (a forward a step).
ALGORITHMS = {
    "flow_grpo": ("sampler.guidance_scale=2.0",),
    "grpo_guard": (),
    "mixgrpo": ("sampler.window_size=1", "sampler.window_shift_every=1"),
    "nft": ("algorithm.beta=0.0001",),
    "awm": ("algorithm.beta=0.0001",),
}
LORA = "pytorch_lora_weights.safetensors"
# `python -c SMALL_SOURCES_CLI ARGS...`: `flowgrpo ARGS...` with small_edit_sources' size.
SMALL_SOURCES_CLI = (
    "import flowgrpo_cli.models.qwenimage_edit as edit\n"
    "edit.SOURCE_AREA = 64 * 64\n"
    "from flowgrpo_cli.cli import main\n"
    "main()\n"
)


@pytest.fixture
def edit_run(make_run, tmp_path):
    """(overrides..., name=) -> (Config, RunDir) of a tiny qwenimage_edit run on 4 edits."""
    train = edit_jsonl(tmp_path)

    def make(*overrides: str, name: str = "run"):
        return make_run(
            f"data.train={train}", f"data.test={train}", "sampler.guidance_scale=1.0",
            "eval.guidance_scale=1.0", *overrides, family="qwenimage_edit", name=name,
        )  # fmt: skip

    return make


@pytest.mark.parametrize(
    ("name", "mode"), [*((name, "lora") for name in ALGORITHMS), ("flow_grpo", "full")]
)
def test_two_iterations_of_each_algorithm_train_the_edit_model(edit_run, name, mode):
    """Each algorithm, and full fine-tuning: two iterations whose updates start on-policy
    (the trajectory algorithms recompute the stored log-probs from the stored source latents),
    step (a finite loss, a gradient) and move the weights the checkpoint holds."""
    lr = "train.lr=0.05" if mode == "lora" else "train.lr=1e-3"
    config, run = edit_run(
        *ALGORITHMS[name], f"algorithm.name={name}", f"train.mode={mode}", lr,
        "run.checkpoint_every=1",  # both checkpoints keep their weights
    )  # fmt: skip
    with small_edit_sources():
        summaries = run_loop(config, run, 2)
    assert [s.iteration for s in summaries] == [0, 1]
    for summary in summaries:
        assert math.isfinite(summary.metrics["update/loss"])
        assert summary.metrics["update/grad_norm"] > 0
        if name not in ("nft", "awm"):  # the forward-process algorithms keep no log-probs
            assert summary.metrics["update/logprob_gap_max"] < 1e-6
    weights = LORA if mode == "lora" else "transformer.safetensors"
    first, second = (load_file(run.checkpoint_dir(n) / weights) for n in (0, 1))
    assert first.keys() == second.keys()
    assert max((first[k] - second[k]).abs().max().item() for k in first) > 0


@pytest.mark.slow
def test_an_edit_run_killed_mid_rollout_resumes_to_the_same_bytes(edit_run):
    """SIGKILLed while its second rollout stores the source latents with each group: the
    re-run redoes that rollout, resumes the optimizer from the first checkpoint, and ends with
    the uninterrupted run's weights and optimizer state, byte for byte."""
    from test_loop import ITERATIONS, loop_command, run_until

    config, reference = edit_run(name="reference")
    with small_edit_sources():
        run_loop(config, reference, ITERATIONS)
    _, crashed = edit_run(name="crashed")
    command = [sys.executable, "-c", SMALL_SOURCES_CLI, *loop_command(crashed.root)[3:]]
    rollout = crashed.iteration_dir(ITERATIONS - 1) / "rollout"
    run_until(crashed.root, rollout / "pending.json", command=command)
    assert not (rollout / "manifest.json").exists()  # the kill landed mid-rollout
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    last = f"checkpoints/iter-{ITERATIONS - 1:06d}"
    for file in (LORA, "optimizer.safetensors"):
        ours, theirs = (run.root / last / file for run in (crashed, reference))
        assert ours.read_bytes() == theirs.read_bytes(), file


@pytest.mark.slow
def test_two_processes_train_the_edit_model_as_one(edit_run):
    """The update of an edit run sharded over two processes (FSDP2) trains the weights one
    process trains: each rank reads its groups' source latents from the rollout."""
    config, run = edit_run("sampler.batch_size=2")
    with small_edit_sources():
        do_rollout(config, run)
    do_score(config, run)
    two = run.root.parent / "nproc2"
    shutil.copytree(run.root, two)
    do_update(config, run)
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "update", "--run", str(two), "--nproc", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    one = load_file(run.checkpoint_dir(0) / LORA)
    other = load_file(two / "checkpoints/iter-000000" / LORA)
    assert one.keys() == other.keys()
    assert max((one[k] - other[k]).abs().max().item() for k in one) < 1e-5
    assert max(t.abs().max().item() for k, t in one.items() if "lora_B" in k) > 0  # it trained
