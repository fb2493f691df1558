"""Update: on-policy start, the right direction, KL, checkpoints diffusers loads, errors."""

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
import torch
from helpers import (
    do_iteration,
    do_rollout,
    do_score,
    do_update,
    policy_for,
    recompute_log_probs,
    rewrite_part,
)
from safetensors.torch import load_file

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, UPDATE, read_manifest
from flowgrpo_cli.store.trajectory import read_table, write_table
from flowgrpo_cli.training.policy import load_weights
from flowgrpo_cli.training.trainer import Trainer


def test_first_micro_batch_is_on_policy_and_files_are_written(make_run):
    config, run = make_run()
    result, _ = do_iteration(config, run)
    metrics = result.metrics
    assert metrics["update/logprob_gap_max"] < 1e-6
    assert metrics["update/optimizer_steps"] == 2.0
    checkpoint = run.checkpoint_dir(0)
    assert read_manifest(checkpoint)["counts"] == {"iteration": 0}
    names = {p.name for p in checkpoint.iterdir()}
    assert {
        "pytorch_lora_weights.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    } <= names
    advantages = read_table([run.stage_dir(0, UPDATE) / "advantages.arrow"]).to_pydict()
    assert len(advantages["sample_id"]) == 4
    assert sum(advantages["advantage"]) == pytest.approx(0.0, abs=1e-5)
    saved = json.loads((run.stage_dir(0, UPDATE) / "metrics.json").read_text())
    assert saved["update/logprob_gap_max"] == metrics["update/logprob_gap_max"]
    assert run.current_iteration() == 1


def test_one_step_moves_log_probs_toward_the_advantage(make_run):
    config, run = make_run(
        "algorithm.prompts_per_iteration=1", "algorithm.beta=0", "train.steps_per_epoch=1",
        "train.lr=1e-3",
    )  # fmt: skip
    policy = policy_for(config, run)
    do_rollout(config, run, policy=policy)
    do_score(config, run)
    before, rows = recompute_log_probs(policy, config, run)
    do_update(config, run, policy=policy)
    after, _ = recompute_log_probs(policy, config, run)
    advantages = read_table([run.stage_dir(0, UPDATE) / "advantages.arrow"]).to_pydict()
    sign = dict(zip(advantages["sample_id"], np.sign(advantages["advantage"]), strict=True))
    trained = rows.trained[0]
    moved = (after - before)[:, trained].sum(dim=1)
    assert sorted(sign.values()) == [-1.0, 1.0]
    for sample_id, delta in zip(rows.sample_ids, moved.tolist(), strict=True):
        assert np.sign(delta) == sign[sample_id], (sample_id, delta)


def test_kl_is_exactly_zero_with_a_fresh_adapter(make_run):
    config, run = make_run("algorithm.beta=0.04", "train.steps_per_epoch=1")
    result, _ = do_iteration(config, run)
    assert result.metrics["update/kl_reference"] == 0.0  # B = 0: the policy is the reference


def test_kl_convention_names_the_metric(make_run):
    config, run = make_run("algorithm.kl_convention=gaussian", "train.lr=0.05")
    metrics = do_iteration(config, run)[0].metrics
    assert metrics["update/kl_gaussian"] > 0.0  # the second step runs off the reference
    assert "update/kl_reference" not in metrics and "update/kl" not in metrics


@pytest.fixture
def flat_rewards(tmp_path, monkeypatch) -> None:
    """A reward plugin module `flat_rewards` on sys.path: `group_one_flat` scores brightness
    except in group 1 of an iteration, whose images all get 0.5; `constant` gives 0.5 to all."""
    (tmp_path / "flat_rewards.py").write_text(
        textwrap.dedent("""
        from PIL import ImageStat

        def group_one_flat(images, prompts, metadata):
            return [
                0.5 if "-g0001-" in meta["sample_id"]
                else ImageStat.Stat(image.convert("L")).mean[0] / 255.0
                for image, meta in zip(images, metadata)
            ]

        def constant(images, prompts, metadata):
            return [0.5] * len(images)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
def gradients(monkeypatch) -> list[dict]:
    """The accumulated gradients of every optimizer step taken while the test runs."""
    recorded = []
    step = Trainer.step

    def recording_step(self):
        recorded.append({n: p.grad.clone() for n, p in self.parameters.items()})
        return step(self)

    monkeypatch.setattr(Trainer, "step", recording_step)
    return recorded


def test_zero_advantage_samples_are_left_out_of_the_optimizer_batches(
    make_run, flat_rewards, gradients
):
    # Group 1 scores flat, so its advantages are 0 (per-group std keeps group 0's the same as in
    # a run without group 1). Two epochs of one step each: the second has a non-zero KL, which
    # the dropped samples must not add to either.
    common = [
        'reward.weights={"flat_rewards:group_one_flat" = 1.0}', "algorithm.advantage_std=group",
        "train.steps_per_epoch=1", "train.inner_epochs=2", "train.lr=0.05",
    ]  # fmt: skip
    steps = {}
    for name, extra in [
        ("flat_group_dropped", ["algorithm.prompts_per_iteration=2"]),
        ("never_had_it", ["algorithm.prompts_per_iteration=1"]),
        ("flat_group_kept", ["algorithm.prompts_per_iteration=2",
                             "algorithm.drop_zero_advantage=false"]),
    ]:  # fmt: skip
        config, run = make_run(*common, *extra, name=name)
        metrics = do_iteration(config, run)[0].metrics
        steps[name] = (metrics, gradients[-2:])
    dropped, dropped_grads = steps["flat_group_dropped"]
    assert dropped["advantage/zero_frac"] == 0.5
    assert dropped["update/samples_trained"] == 2.0
    assert dropped["update/optimizer_steps"] == 2.0
    assert dropped["update/optimizer_steps_skipped"] == 0.0
    _, reference_grads = steps["never_had_it"]
    kept, kept_grads = steps["flat_group_kept"]
    assert kept["update/samples_trained"] == 4.0
    for step in range(2):
        for name, grad in reference_grads[step].items():
            assert torch.equal(dropped_grads[step][name], grad), (step, name)
    # Kept, the flat group halves the policy-gradient mean: another gradient.
    differences = [(kept_grads[0][n] - g).abs().max() for n, g in reference_grads[0].items()]
    assert max(differences) > 1e-4


def test_an_iteration_with_every_advantage_zero_skips_its_steps(make_run, flat_rewards):
    config, run = make_run('reward.weights={"flat_rewards:constant" = 1.0}')
    metrics = do_iteration(config, run)[0].metrics
    assert metrics["advantage/zero_frac"] == 1.0
    assert metrics["update/samples_trained"] == 0.0
    assert metrics["update/optimizer_steps"] == 0.0
    assert metrics["update/optimizer_steps_skipped"] == 2.0  # train.steps_per_epoch
    # The iteration still ends with a checkpoint (the unchanged weights) to go on from.
    weights = load_file(run.checkpoint_dir(0) / "pytorch_lora_weights.safetensors")
    assert all(not v.any() for k, v in weights.items() if "lora_B" in k)
    do_rollout(config, run, 1)


def test_recomputed_old_logprobs_ema_warmup_and_checkpointing(make_run):
    config, run = make_run(
        "algorithm.recompute_old_logprobs=true", "train.ema_decay=0.9", "train.warmup_steps=4",
        "train.gradient_checkpointing=true",
    )  # fmt: skip
    result, _ = do_iteration(config, run)
    assert result.metrics["update/logprob_gap_max"] < 1e-6
    assert result.metrics["update/lr"] == pytest.approx(config.train.lr * 2 / 4)
    assert (run.checkpoint_dir(0) / "ema" / "pytorch_lora_weights.safetensors").is_file()


def test_second_iteration_resumes_from_the_checkpoint(make_run):
    config, run = make_run()
    do_iteration(config, run, 0)
    do_rollout(config, run, 1)
    manifest = read_manifest(run.stage_dir(1, ROLLOUT))
    assert manifest["policy_version"].startswith("iter-000000:")
    do_score(config, run, 1)
    result, trainer = do_update(config, run, 1)
    assert trainer.state.optimizer_steps == 4
    assert result.metrics["update/logprob_gap_max"] < 1e-6


def test_moments_of_a_parameter_without_gradient_stay_absent_on_resume(make_run):
    """Qwen-Image's last block discards its text stream, so that block's to_add_out LoRA gets
    no gradient and no Adam moments. Resuming from the checkpoint once failed on the missing
    moments; then it saved zero moments for them. Now a resumed run saves the uninterrupted
    run's optimizer state, byte for byte."""
    from flowgrpo_cli.loop import run_loop

    config, straight = make_run("sampler.guidance_scale=1.0", family="qwenimage", name="a")
    run_loop(config, straight, 2)
    config, resumed = make_run("sampler.guidance_scale=1.0", family="qwenimage", name="b")
    run_loop(config, resumed, 1)
    run_loop(config, resumed, 2)  # from checkpoints/iter-000000, as a new process starts
    path = straight.checkpoint_dir(1) / "optimizer.safetensors"
    moments = {key.rsplit(".", 4)[0] for key in load_file(path)}  # state.<block>.attn.<module>
    assert "state.transformer_blocks.1.attn.to_add_out" not in moments  # the last block's
    assert "state.transformer_blocks.0.attn.to_add_out" in moments
    assert (resumed.checkpoint_dir(1) / path.name).read_bytes() == path.read_bytes()


def test_checkpoint_into_a_different_model_is_a_clear_error(make_run):
    config, run = make_run()
    do_iteration(config, run)
    other, _ = make_run('train.lora_targets=["to_q"]', name="other")
    with pytest.raises(FlowGrpoError, match="does not match the model's LoRA layers"):
        load_weights(policy_for(other, run), run.checkpoint_dir(0))


def test_full_fine_tuning_with_a_reference_copy(make_run):
    config, run = make_run("train.mode=full", "algorithm.beta=0.04", "train.lr=1e-5")
    result, _ = do_iteration(config, run)
    assert result.metrics["update/logprob_gap_max"] < 1e-6
    weights = load_file(run.checkpoint_dir(0) / "transformer.safetensors")
    policy = policy_for(config, run, 1)  # loads those weights back
    assert policy.version.startswith("iter-000000:")
    assert len(weights) == len(policy.transformer.state_dict())


def test_missing_scores_are_refused(make_run):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    part = run.stage_dir(0, SCORE) / "part-00000-of-00001.arrow"
    table = read_table([part])
    rewrite_part(part.parent, part.name, lambda path: write_table(path, table.slice(0, 3)))
    with pytest.raises(FlowGrpoError, match="no score for 1 sample"):
        do_update(config, run)


def test_non_finite_rewards_stop_before_a_checkpoint(make_run):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    part = run.stage_dir(0, SCORE) / "part-00000-of-00001.arrow"
    table = read_table([part])
    rewards = table.column("reward").to_pylist()
    rewards[2] = float("inf")
    index = table.column_names.index("reward")
    altered = table.set_column(index, "reward", pa.array(rewards, pa.float64()))
    rewrite_part(part.parent, part.name, lambda path: write_table(path, altered))
    with pytest.raises(FlowGrpoError, match="not finite"):
        do_update(config, run)
    assert read_manifest(run.checkpoint_dir(0)) is None


def test_rollout_from_another_config_is_refused(make_run):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    changed, _ = make_run("sampler.noise_level=0.5", name="changed")
    with pytest.raises(FlowGrpoError, match="another config or model"):
        do_update(changed, run)


@pytest.mark.slow
def test_two_processes_train_the_same_weights_as_one(make_run):
    config, run = make_run("sampler.batch_size=2")  # two record batches per part
    do_rollout(config, run)
    do_score(config, run)
    copies = {n: run.root.parent / f"nproc{n}" for n in (1, 2)}
    for nproc, folder in copies.items():
        shutil.copytree(run.root, folder)
        result = subprocess.run(
            [sys.executable, "-m", "flowgrpo_cli", "update", "--run", str(folder),
             "--nproc", str(nproc)], capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    one, two = (load_file(f / "checkpoints/iter-000000/pytorch_lora_weights.safetensors")
                for f in copies.values())  # fmt: skip
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    # FSDP2's bfloat16 mixed-precision policy trains too (close to, not equal to, float32)
    mixed = run.root.parent / "mixed"
    shutil.copytree(run.root, mixed)
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "update", "--run", str(mixed), "--nproc", "2",
         "--set", "train.mixed_precision=bfloat16", "--allow-config-change"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    bf16 = load_file(mixed / "checkpoints/iter-000000/pytorch_lora_weights.safetensors")
    assert max((one[k] - bf16[k]).abs().max().item() for k in one) < 1e-2
