"""Every file a stage reads is checked against the size and XXH3 digest its manifest recorded: one
flipped byte in any of them stops the next stage (and `inspect`) with the file's name. Names
read from files (part names, sample ids) never lead outside their folder."""

import json

import pyarrow as pa
import pytest
from helpers import (
    do_iteration,
    do_rollout,
    do_score,
    do_update,
    flip_one_byte,
    policy_for,
    rewrite_part,
)
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, UPDATE, verify_stage

PART = "part-00000-of-00001.arrow"


def rollout_part(config, run):
    do_rollout(config, run)
    return run.stage_dir(0, ROLLOUT) / PART, lambda: do_score(config, run)


def conditioning_part(config, run):
    do_rollout(config, run)
    part = run.stage_dir(0, ROLLOUT) / PART.replace("part-", "conditioning-")
    return part, lambda: do_score(config, run)


def score_part(config, run):
    do_rollout(config, run)
    do_score(config, run)
    return run.stage_dir(0, SCORE) / PART, lambda: do_update(config, run)


def checkpoint_weights(config, run):
    do_iteration(config, run)
    path = run.checkpoint_dir(0) / "pytorch_lora_weights.safetensors"
    return path, lambda: policy_for(config, run, 1)  # what rollout and update load


def optimizer_state(config, run):
    do_iteration(config, run)
    return run.checkpoint_dir(0) / "optimizer.safetensors", lambda: policy_for(config, run, 1)


def data_file(config, run):
    return run.data_dir / "train.parquet", lambda: do_rollout(config, run)


@pytest.mark.parametrize(
    "setup",
    [rollout_part, conditioning_part, score_part, checkpoint_weights, optimizer_state, data_file],
)
def test_a_flipped_byte_stops_the_stage_that_reads_it(make_run, setup):
    config, run = make_run()
    path, next_stage = setup(config, run)
    flip_one_byte(path)
    with pytest.raises(FlowGrpoError, match=f"{path.name}: checksum differs .* delete"):
        next_stage()
    result = CliRunner().invoke(app, ["inspect", str(path.parent)])
    assert "checksum differs" in result.output.replace("\n", " ")


def test_inspect_catches_altered_advantages(make_run):
    config, run = make_run()
    do_iteration(config, run)
    path = run.stage_dir(0, UPDATE) / "advantages.arrow"
    flip_one_byte(path)
    result = CliRunner().invoke(app, ["inspect", str(path.parent)])
    assert "advantages.arrow: checksum differs" in result.output.replace("\n", "")


def test_a_sample_id_cannot_write_outside_the_images_folder(make_run, tmp_path):
    from flowgrpo_cli.store.trajectory import read_table, write_table

    config, run = make_run()
    do_rollout(config, run)
    part = run.stage_dir(0, ROLLOUT) / PART
    table = read_table([part])
    ids = table.column("sample_id").to_pylist()
    for bad in ("../../escaped", "/abs/escaped"):
        altered = table.set_column(
            table.column_names.index("sample_id"), "sample_id", pa.array([bad, *ids[1:]])
        )
        # re-hashed as its writer would: inspect verifies the part before it reads it
        rewrite_part(part.parent, PART, lambda path, table=altered: write_table(path, table))
        images = tmp_path / "images"
        result = CliRunner().invoke(app, ["inspect", str(part), "--images", str(images)])
        assert result.exit_code == 1 and "not a plain file name" in result.output
        assert not list(tmp_path.rglob("escaped*"))


def test_a_manifest_naming_a_part_outside_its_folder_is_refused(make_run):
    config, run = make_run()
    do_rollout(config, run)
    folder = run.stage_dir(0, ROLLOUT)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["trajectory_parts"] = ["../../outside/x.arrow"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FlowGrpoError, match="not a name flowgrpo writes"):
        do_score(config, run)
    manifest["parts"][0]["name"] = "../../outside/x.arrow"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FlowGrpoError, match="outside"):
        verify_stage(folder)
