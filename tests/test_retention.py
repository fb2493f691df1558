"""run.keep_trajectories: finished iterations lose their latents, nothing a user reads."""

import shutil

import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.metrics_log import read_log
from flowgrpo_cli.store.retention import prune_finished, recover
from flowgrpo_cli.store.rundir import (
    ROLLOUT,
    SCORE,
    UPDATE,
    manifest_hash,
    read_manifest,
    verify_stage,
)
from flowgrpo_cli.store.trajectory import open_part


def loop(run, *args):
    return CliRunner().invoke(app, ["loop", "--run", str(run.root), *args])


def folder_bytes(folder):
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_finished_iterations_keep_images_and_lose_latents(make_run):
    _, run = make_run("run.keep_trajectories=1", "run.checkpoint_every=1")
    result = loop(run, "-n", "3")
    assert result.exit_code == 0, result.output
    # The plan's summary opens the run (its numbers: tests/test_plan.py).
    output = " ".join(result.output.split())
    assert "plan (" in output and "memory per device at most" in output
    assert "per iteration," in output and "for 3 iterations under run.keep_trajectories" in output
    for iteration, pruned in [(0, True), (1, True), (2, False)]:
        folder = run.stage_dir(iteration, ROLLOUT)
        manifest = verify_stage(folder)  # the pruned parts match their manifest
        assert ("pruned" in manifest) is pruned
        part = open_part(folder / manifest["trajectory_parts"][0])
        assert ("latents" in part.schema.names) is not pruned
        assert {"image", "log_probs", "prompt", "seed"} <= set(part.schema.names)
        assert part.num_record_batches and part.get_batch(0).num_rows == 4
        conditioning = folder / manifest["conditioning_parts"][0]
        assert conditioning.exists() is not pruned
        assert not list(folder.parent.glob("rollout.*"))  # no staging or replaced folder
    record = read_manifest(run.stage_dir(0, ROLLOUT))["pruned"]
    assert record["bytes_before"] - record["bytes_after"] > 65_536  # latents + conditioning
    # The rollout keeps the identity the score and update recorded: both stay finished.
    score = read_manifest(run.stage_dir(0, SCORE))
    assert score["identity"]["rollout"] == manifest_hash(run.stage_dir(0, ROLLOUT))
    for command in (["score", "-i", "0"], ["update", "-i", "0"]):
        result = CliRunner().invoke(app, [*command, "--run", str(run.root)])
        assert result.exit_code == 0, result.output
    # inspect reads a pruned iteration; the loop continues the run.
    result = CliRunner().invoke(app, ["inspect", str(run.stage_dir(0, ROLLOUT))])
    assert result.exit_code == 0, result.output
    assert "latents pruned (run.keep_trajectories)" in " ".join(result.output.split())
    result = loop(run, "-n", "4")
    assert result.exit_code == 0, result.output
    assert "pruned" in read_manifest(run.stage_dir(2, ROLLOUT))
    # Only redoing a pruned iteration's update is impossible, and says so.
    shutil.rmtree(run.checkpoint_dir(3))
    shutil.rmtree(run.checkpoint_dir(2))
    shutil.rmtree(run.stage_dir(2, UPDATE))
    result = CliRunner().invoke(app, ["update", "-i", "2", "--run", str(run.root)])
    assert result.exit_code == 1 and "run.keep_trajectories" in result.output


def test_keep_all_and_keep_none(make_run):
    _, run = make_run()
    assert loop(run, "-n", "2", "--set", "run.keep_trajectories=-1").exit_code == 0
    assert prune_finished(run, -1).iterations == []
    assert not any("pruned" in read_manifest(run.stage_dir(i, ROLLOUT)) for i in (0, 1))
    before = folder_bytes(run.root)
    done = prune_finished(run, 0)
    assert done.iterations == [0, 1]
    # the parts shrank by bytes_freed; the manifests grew by their pruning record
    assert 0.99 * done.bytes_freed < before - folder_bytes(run.root) < done.bytes_freed
    assert prune_finished(run, 0).iterations == []  # a second pass finds nothing to do


def test_a_killed_prune_is_finished_or_undone(make_run, tmp_path):
    _, run = make_run()
    assert loop(run, "-n", "1", "--set", "run.keep_trajectories=-1").exit_code == 0
    original = tmp_path / "original"
    shutil.copytree(run.stage_dir(0, ROLLOUT), original)
    prune_finished(run, 0)
    pruned = tmp_path / "pruned"
    shutil.copytree(run.stage_dir(0, ROLLOUT), pruned)
    for killed in ("while_pruning", "between_renames", "before_cleanup"):
        folder = tmp_path / killed / "rollout"
        staging, replaced = (
            folder.with_name("rollout.pruning"),
            folder.with_name("rollout.replaced"),
        )
        if killed == "while_pruning":  # a half-written staging folder beside the original
            shutil.copytree(original, folder)
            shutil.copytree(pruned, staging)
            (staging / "manifest.json").unlink()
        elif killed == "between_renames":  # the original moved aside, the pruned one not in place
            shutil.copytree(original, replaced)
            shutil.copytree(pruned, staging)
        else:  # the pruned one in place, the original not yet deleted
            shutil.copytree(pruned, folder)
            shutil.copytree(original, replaced)
        recover(folder)
        assert not staging.exists() and not replaced.exists(), killed
        manifest = verify_stage(folder)
        assert ("pruned" in manifest) is (killed != "while_pruning"), killed
        assert manifest_hash(folder) == manifest_hash(original), killed


def test_keep_trajectories_is_checked():
    from flowgrpo_cli.store.config import load_config

    with pytest.raises(FlowGrpoError, match=r"run\.keep_trajectories"):
        load_config(None, ["run.keep_trajectories=-2"])


def test_kept_checkpoints_and_a_restart_that_redoes_iterations(make_run, tmp_path):
    _, run = make_run("run.keep_checkpoints=2", "run.checkpoint_every=1")
    assert loop(run, "-n", "3").exit_code == 0
    for iteration, pruned in [(0, True), (1, False), (2, False)]:
        folder = run.checkpoint_dir(iteration)
        manifest = verify_stage(folder)
        assert ("pruned" in manifest) is pruned
        names = {p.name for p in folder.iterdir()}
        weights = {"manifest.json", "pytorch_lora_weights.safetensors", "optimizer.safetensors"}
        assert names == {"manifest.json"} if pruned else names >= weights
    assert run.current_iteration() == 3  # pruned checkpoints still count as finished
    result = CliRunner().invoke(app, ["export", str(run.root), str(tmp_path / "x"), "-i", "0"])
    assert result.exit_code == 1 and "run.keep_checkpoints" in result.output
    result = loop(run, "-n", "3", "--restart-from", "1")
    assert result.exit_code == 1 and "whose weights were deleted" in result.output
    result = loop(run, "-n", "3", "--restart-from", "4")
    assert result.exit_code == 1 and "finished iterations 0 to 2" in result.output

    # Restarting from 2 deletes iteration 2 and redoes it: the same checkpoint, bytes and all.
    weights = run.checkpoint_dir(2) / "pytorch_lora_weights.safetensors"
    before = weights.read_bytes()
    result = loop(run, "-n", "3", "--restart-from", "2")
    assert result.exit_code == 0, result.output
    assert "iteration 2 |" in result.output  # it ran again
    assert weights.read_bytes() == before
    assert [line["iteration"] for line in read_log(run)] == [0, 1, 2]
