"""Every read of a run's files is verified, and what a hostile tester found ends in one line.

A file damaged after its manifest was written stops the command that reads it with an error
naming the file, whether the manifest still holds the old checksum (caught by the checksum) or
was re-hashed to match (caught by reading the content: not parquet, not safetensors, not JSON,
a missing key, wrong shapes). `flowgrpo inspect` verifies at every level it is pointed at and
exits 1 on damage; its image dump never overwrites one image with another. A too-large image
for SD3, W&B without a login and an upload without a network are one-line errors too.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import do_iteration, do_rollout, do_score, flip_one_byte, rewrite_part
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, UPDATE
from flowgrpo_cli.store.trajectory import read_table, write_table

runner = CliRunner()
PART = "part-00000-of-00001.arrow"


def flowgrpo(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *needles: str) -> str:
    """The command failed as a user error: exit 1, no traceback, every needle in the text."""
    text = result.output.replace("\n", " ")
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in text, (needle, result.output)
    return text


def garbage(path) -> None:
    path.write_bytes(b"this is not what flowgrpo wrote\n" * 8)


def safetensors_with(tensors: dict, metadata: dict | None = None):
    from safetensors.torch import save

    def write(path):
        path.write_bytes(save(tensors, metadata=metadata))

    return write


# ---------------------------------------------------------------------------------------------
# 1. Damage after the manifest was written


@pytest.mark.parametrize("rehash", [True, False], ids=["rehashed", "stale-manifest"])
def test_damaged_train_data_stops_rollout_naming_the_file(make_run, rehash):
    _, run = make_run()
    if rehash:
        rewrite_part(run.data_dir, "train.parquet", garbage)
    else:
        garbage(run.data_dir / "train.parquet")
    result = flowgrpo("rollout", "--run", run.root)
    expected = "not a readable parquet file" if rehash else "the manifest says"  # its size
    one_line_error(result, "train.parquet", expected)
    assert not run.iteration_dir(0).exists() or not list(run.iteration_dir(0).rglob("*.arrow"))


def test_train_data_with_a_null_prompt_names_the_column(make_run):
    _, run = make_run()

    def null_prompt(path):
        table = pq.read_table(path)
        column = table.column_names.index("prompt")
        prompts = table.column("prompt").to_pylist()
        table = table.set_column(column, "prompt", pa.array([None, *prompts[1:]], pa.string()))
        pq.write_table(table, path)

    rewrite_part(run.data_dir, "train.parquet", null_prompt)
    result = flowgrpo("rollout", "--run", run.root)
    one_line_error(result, "train.parquet", "prompt")


@pytest.mark.parametrize("rehash", [True, False], ids=["rehashed", "stale-manifest"])
def test_damaged_test_data_stops_the_evaluation_naming_the_file(make_run, rehash):
    _, run = make_run("eval.every=1", "eval.num_steps=2", "eval.num_prompts=2")

    def without_prompt_column(path):
        pq.write_table(pq.read_table(path).drop_columns(["prompt"]), path)

    if rehash:
        rewrite_part(run.data_dir, "test.parquet", without_prompt_column)
    else:
        without_prompt_column(run.data_dir / "test.parquet")
    result = flowgrpo("loop", "--run", run.root, "-n", "0")
    expected = "lacks column(s) ['prompt']" if rehash else "the manifest says"  # its size
    one_line_error(result, "test.parquet", expected)


@pytest.fixture
def trained_run(make_run):
    """A tiny LoRA run after one iteration: checkpoints/iter-000000 holds its files."""
    config, run = make_run()
    do_iteration(config, run)
    return config, run


LORA = "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize(
    ("name", "damage", "command", "expected"),
    [
        (LORA, garbage, "rollout", "not a safetensors file"),
        (LORA, safetensors_with({"transformer.nothing.weight": torch.zeros(2)}),
         "rollout", "does not match the model's LoRA layers"),
        ("optimizer.safetensors", garbage, "update", "not a safetensors file"),
        ("optimizer.safetensors", safetensors_with({"state.x.exp_avg": torch.ones(3)}),
         "update", "param_groups"),
        ("trainer_state.json", garbage, "update", "not valid JSON"),
        ("trainer_state.json", lambda p: p.write_text('{"iteration": 0}'), "update",
         "optimizer_steps"),
        ("trainer_state.json", lambda p: p.write_text("[1, 2]"), "update", "not a JSON object"),
    ],
    ids=["lora-garbage", "lora-wrong-keys", "optimizer-garbage", "optimizer-no-groups",
         "state-garbage", "state-missing-key", "state-a-list"],
)  # fmt: skip
def test_a_rehashed_but_garbled_checkpoint_file_is_named(trained_run, name, damage, command,
                                                         expected):  # fmt: skip
    _, run = trained_run
    checkpoint = run.checkpoint_dir(0)
    rewrite_part(checkpoint, name, damage)
    args = ["--iteration", "1"] if command == "update" else []
    result = flowgrpo(command, "--run", run.root, *args)
    one_line_error(result, name, expected)


def test_optimizer_state_of_the_wrong_shapes_is_named(trained_run):
    from flowgrpo_cli.training.trainer import _optimizer_from_file

    _, run = trained_run
    checkpoint = run.checkpoint_dir(0)
    state = _optimizer_from_file(checkpoint / "optimizer.safetensors")

    def reshaped(path):
        from safetensors.torch import save

        tensors = {
            f"state.{param}.{field}": (
                torch.zeros(7, 5) if field == "exp_avg" else value.contiguous()
            )
            for param, fields in state["state"].items()
            for field, value in fields.items()
        }
        path.write_bytes(
            save(tensors, metadata={"param_groups": json.dumps(state["param_groups"])})
        )

    rewrite_part(checkpoint, "optimizer.safetensors", reshaped)
    result = flowgrpo("update", "--run", run.root, "--iteration", "1")
    one_line_error(result, "optimizer.safetensors", "shape")


@pytest.mark.parametrize("name", [LORA, "optimizer.safetensors", "trainer_state.json"])
def test_a_checkpoint_file_altered_after_its_manifest_is_named(trained_run, name):
    _, run = trained_run
    flip_one_byte(run.checkpoint_dir(0) / name)
    result = flowgrpo("update", "--run", run.root, "--iteration", "1")
    one_line_error(result, name, "checksum differs")


@pytest.mark.parametrize("rehash", [True, False], ids=["rehashed", "stale-manifest"])
def test_full_mode_weights_damaged_are_named(make_run, rehash):
    config, run = make_run('train.mode="full"', "algorithm.beta=0")
    do_iteration(config, run)
    name = "transformer.safetensors"
    if rehash:
        rewrite_part(run.checkpoint_dir(0), name, garbage)
    else:
        flip_one_byte(run.checkpoint_dir(0) / name)
    result = flowgrpo("rollout", "--run", run.root)
    one_line_error(result, name, "not a safetensors file" if rehash else "checksum differs")


def test_export_reads_the_weights_it_hands_on(trained_run, tmp_path):
    _, run = trained_run
    rewrite_part(run.checkpoint_dir(0), LORA, garbage)
    out = tmp_path / "out"
    result = flowgrpo("export", run.root, out)
    one_line_error(result, LORA, "not a safetensors file")
    assert not out.exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [("reward-as-text", "column `reward` holds string, not numbers"),
     ("no-reward", "lacks column(s) ['reward']")],
)  # fmt: skip
def test_update_names_a_rehashed_score_part_it_cannot_use(make_run, change, expected):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)

    def write(path):
        table = read_table([path])
        if change == "no-reward":
            table = table.drop_columns(["reward"])
        else:
            column = table.column_names.index("reward")
            table = table.set_column(column, "reward", pa.array(["x"] * table.num_rows))
        write_table(path, table)

    rewrite_part(run.stage_dir(0, SCORE), PART, write)
    result = flowgrpo("update", "--run", run.root)
    one_line_error(result, "scores", expected)


# ---------------------------------------------------------------------------------------------
# 2. Rebuilding a missing training grid


def scores_with_other_ids(path):
    table = read_table([path])
    ids = [f"other-{n}" for n in range(table.num_rows)]
    column = table.column_names.index("sample_id")
    write_table(path, table.set_column(column, "sample_id", pa.array(ids, pa.string())))


@pytest.mark.parametrize("rehash", [True, False], ids=["rehashed", "stale-manifest"])
def test_rebuilding_a_grid_verifies_the_score_part(trained_run, rehash):
    _, run = trained_run
    scores = run.stage_dir(0, SCORE)
    if rehash:
        rewrite_part(scores, PART, scores_with_other_ids)
        expected = ("no score for sample", PART)
    else:
        scores_with_other_ids(scores / PART)
        expected = (f"{PART}: ", "the manifest says")  # its size differs
    result = flowgrpo("loop", "--run", run.root, "-n", "1")
    one_line_error(result, *expected)
    assert not run.samples_path(0).exists()


def test_rebuilding_a_grid_verifies_the_rollout_part(trained_run):
    _, run = trained_run
    flip_one_byte(run.stage_dir(0, ROLLOUT) / PART)
    result = flowgrpo("loop", "--run", run.root, "-n", "1")
    one_line_error(result, f"{PART}: checksum differs")


# ---------------------------------------------------------------------------------------------
# 3. flowgrpo inspect


@pytest.fixture
def damaged_scores(make_run):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    flip_one_byte(run.stage_dir(0, SCORE) / PART)
    return run


def test_inspect_stage_exits_1_on_damage(damaged_scores):
    result = flowgrpo("inspect", damaged_scores.stage_dir(0, SCORE))
    one_line_error(result, f"{PART}: checksum differs")


def test_inspect_run_verifies_every_finished_stage(damaged_scores):
    result = flowgrpo("inspect", damaged_scores.root)
    one_line_error(result, "scores", f"{PART}: checksum differs")


def test_inspect_iteration_verifies_its_stages(damaged_scores):
    result = flowgrpo("inspect", damaged_scores.iteration_dir(0))
    one_line_error(result, f"{PART}: checksum differs")


def test_inspect_part_verifies_it_against_its_stage_manifest(damaged_scores):
    result = flowgrpo("inspect", damaged_scores.stage_dir(0, SCORE) / PART)
    one_line_error(result, f"{PART}: checksum differs")


def test_inspect_of_intact_run_iteration_and_part_exits_0(make_run):
    config, run = make_run()
    do_iteration(config, run)
    for path in (run.root, run.iteration_dir(0), run.stage_dir(0, ROLLOUT) / PART,
                 run.stage_dir(0, UPDATE), run.checkpoint_dir(0), run.data_dir):  # fmt: skip
        result = flowgrpo("inspect", path)
        assert result.exit_code == 0, (path, result.output)
    result = flowgrpo("inspect", run.root)
    assert "match their recorded size and checksum" in result.output


def test_inspect_images_onto_an_existing_file(make_run, tmp_path):
    config, run = make_run()
    do_rollout(config, run)
    target = tmp_path / "taken.txt"
    target.write_text("keep me")
    result = flowgrpo("inspect", run.stage_dir(0, ROLLOUT), "--images", target)
    one_line_error(result, str(target), "not a folder")
    assert target.read_text() == "keep me"


def rollout_with_ids(config, run, ids):
    do_rollout(config, run)
    folder = run.stage_dir(0, ROLLOUT)

    def write(path):
        table = read_table([path])
        column = table.column_names.index("sample_id")
        write_table(path, table.set_column(column, "sample_id", pa.array(ids, pa.string())))

    rewrite_part(folder, PART, write)
    return folder


def test_inspect_images_with_a_300_character_sample_id(make_run, tmp_path):
    config, run = make_run()
    long = "s" * 300
    folder = rollout_with_ids(config, run, [long, "a", "b", "c"])
    images = tmp_path / "png"
    result = flowgrpo("inspect", folder, "--images", images)
    assert result.exit_code == 0, result.output
    pngs = sorted(p.name for p in images.glob("*.png"))
    assert len(pngs) == 4 and all(len(name) < 120 for name in pngs)
    tsv = (images / "prompts.tsv").read_text()
    assert long in tsv  # the full id stays findable beside its shortened file name


def test_inspect_images_never_overwrites_on_duplicate_or_null_ids(make_run, tmp_path):
    config, run = make_run()
    folder = rollout_with_ids(config, run, ["same", "same", None, None])
    images = tmp_path / "png"
    result = flowgrpo("inspect", folder, "--images", images)
    assert result.exit_code == 0, result.output
    assert len(list(images.glob("*.png"))) == 4
    assert f"4 images -> {images}" in result.output.replace("\n", "")


# ---------------------------------------------------------------------------------------------
# 4. The remaining tracebacks


def test_sd3_width_beyond_its_position_table(make_run):
    _, run = make_run()
    result = flowgrpo("rollout", "--run", run.root, "--set", "model.width=8000",
                      "--allow-config-change")  # fmt: skip
    one_line_error(result, "model.width", "8000", "512")
    assert not run.iteration_dir(0).exists()


def test_wandb_without_a_login_is_refused_before_any_work(make_run, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    _, run = make_run()
    result = flowgrpo("loop", "--run", run.root, "-n", "1", "--set", 'log.trackers=["wandb"]',
                      "--allow-config-change")  # fmt: skip
    one_line_error(result, "wandb login", "WANDB_API_KEY", "WANDB_MODE=offline")
    assert not run.iteration_dir(0).exists() and not (run.root / "wandb").exists()


def test_push_to_hub_without_a_network(trained_run, tmp_path, monkeypatch):
    from huggingface_hub import constants

    _, run = trained_run
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    out = tmp_path / "out"
    result = flowgrpo("export", run.root, out, "--push-to-hub", "me/tiny-lora")
    text = one_line_error(result, "--push-to-hub me/tiny-lora", str(out))
    assert "cannot reach" in text
    assert (out / LORA).is_file()
