"""Config validation: every error kind names the key, where it was set, and what is allowed."""

from pathlib import Path

import pytest

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import (
    Config,
    config_diff,
    config_hash,
    dumps_config,
    iter_reference,
    load_config,
)
from flowgrpo_cli.store.runconfig import resolve_run


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def error_of(path, overrides=()) -> str:
    with pytest.raises(FlowGrpoError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_defaults_are_the_paper_settings():
    config = load_config(None)
    assert config.sampler.noise_level == 0.7
    assert config.algorithm.group_size == 24
    assert config.algorithm.prompts_per_iteration == 48
    assert config.algorithm.beta == 0.04
    assert config.algorithm.clip_range == 1e-4
    assert config.train.lr == 3e-4
    assert (config.train.lora_rank, config.train.lora_alpha) == (32, 64)


def test_unknown_key_names_file_line_and_closest_key(tmp_path):
    path = write(tmp_path, "[run]\nseed = 1\n\n[sampler]\nnum_steps = 4\nnoise_levl = 0.5\n")
    message = error_of(path)
    assert f"{path}:6" in message
    assert "unknown key `sampler.noise_levl`" in message
    assert "did you mean `sampler.noise_level`" in message


def test_unknown_section_suggests_the_closest(tmp_path):
    message = error_of(write(tmp_path, "[samplr]\nkind = 'sde'\n"))
    assert "unknown section [samplr]" in message and "did you mean [sampler]" in message
    assert f"{tmp_path / 'run.toml'}:1" in message


def test_wrong_type_names_key_and_expected_type(tmp_path):
    message = error_of(write(tmp_path, "[algorithm]\ngroup_size = 'four'\n"))
    assert "`algorithm.group_size` = 'four' is not an integer" in message
    assert ":2" in message


def test_bool_is_not_an_integer(tmp_path):
    assert "is not an integer" in error_of(write(tmp_path, "[algorithm]\ngroup_size = true\n"))


def test_literal_lists_allowed_values(tmp_path):
    message = error_of(write(tmp_path, "[sampler]\nkind = 'ddim'\n"))
    assert "one of 'sde', 'cps'" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[algorithm]\ngroup_size = 1\n", "`algorithm.group_size` = 1 must be >= 2"),
        ("[sampler]\nnoise_level = -0.1\n", "`sampler.noise_level` = -0.1 must be >= 0.0"),
        ("[train]\nema_decay = 1.0\n", "must be in [0, 1)"),
        ("[sampler]\nwindow_range = [5, 2]\n", "0 <= lo <= hi"),
        ("[sampler]\ntrain_fraction = 0\n", "must be in (0, 1]"),
    ],
)
def test_out_of_range_values(tmp_path, text, expected):
    assert expected in error_of(write(tmp_path, text))


def test_all_errors_reported_at_once(tmp_path):
    message = error_of(write(tmp_path, "[algorithm]\ngroup_size = 0\nbeta = -1\n"))
    assert "group_size" in message and "beta" in message


def test_invalid_toml_is_a_clear_error(tmp_path):
    assert "not valid TOML" in error_of(write(tmp_path, "[run\nseed = 1\n"))


def test_missing_file():
    assert "does not exist" in error_of(Path("/nonexistent/run.toml"))


def test_overrides_parse_toml_values_and_bare_strings():
    config = load_config(
        None,
        [
            "sampler.noise_level=0.8",
            "model.path=runs/tiny model",
            "sampler.window_range=[1, 3]",
            "train.gradient_checkpointing=true",
            "reward.weights={ocr = 0.5, jpeg_compressibility = 0.1}",
        ],
    )
    assert config.sampler.noise_level == 0.8
    # a bare string; no hub id has a space, so it is a folder, made absolute
    assert config.model.path == str(Path.cwd() / "runs/tiny model")
    assert config.sampler.window_range == [1, 3]
    assert config.train.gradient_checkpointing is True
    assert config.reward.weights == {"ocr": 0.5, "jpeg_compressibility": 0.1}


def test_bad_override_names_the_argument():
    assert "--set sampler.noise_level=-1" in error_of(None, ["sampler.noise_level=-1"])
    with pytest.raises(FlowGrpoError, match="expected KEY=VALUE"):
        load_config(None, ["sampler.noise_level"])


def test_int_accepted_for_float():
    assert load_config(None, ["sampler.noise_level=1"]).sampler.noise_level == 1.0


def test_paths_expand_home_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGRPO_TEST_ROOT", str(tmp_path))
    monkeypatch.setenv("HOME", "/home/someone")
    config = load_config(None, ["model.path=$FLOWGRPO_TEST_ROOT/model", "data.train=~/p.txt"])
    assert config.model.path == f"{tmp_path}/model"
    assert config.data.train == "/home/someone/p.txt"


def test_dump_round_trips(tmp_path):
    config = load_config(
        None,
        [
            'reward.weights={ocr = 1.0, "my.mod:fn" = 0.5}',
            'data.negative_prompt=say "no"',
            "sampler.window_range=[0, 4]",
        ],
    )
    path = tmp_path / "resolved.toml"
    path.write_text(dumps_config(config))
    assert load_config(path) == config


def test_hash_ignores_runtime_only_keys():
    base = load_config(None)
    assert config_hash(base) == config_hash(load_config(None, ["distributed.nproc=4"]))
    assert config_hash(base) != config_hash(load_config(None, ["sampler.noise_level=0.5"]))
    assert config_diff(base, load_config(None, ["sampler.noise_level=0.5"])) == [
        "sampler.noise_level: 0.7 -> 0.5"
    ]


def test_every_key_has_help():
    keys = list(iter_reference())
    assert len(keys) > 40
    assert all(meaning for _, _, meaning in keys)


def test_run_refuses_a_changed_config_with_a_diff(tmp_path):
    run_dir = tmp_path / "run"
    first = resolve_run(None, ["sampler.noise_level=0.5"], run_dir)
    assert not first.run.config_path.exists()  # written only by a command holding the lock
    first.store_config()
    (run_dir / "data").mkdir()  # something was computed with it
    with pytest.raises(FlowGrpoError) as info:
        resolve_run(None, ["sampler.noise_level=0.9"], run_dir)
    assert "sampler.noise_level: 0.5 -> 0.9" in str(info.value)
    assert "--allow-config-change" in str(info.value)
    # runtime-only changes pass; an explicit change replaces the stored config
    assert resolve_run(None, ["distributed.nproc=2"], run_dir).config.distributed.nproc == 2
    resolve_run(None, ["sampler.noise_level=0.9"], run_dir, allow_change=True).store_config()
    assert resolve_run(None, [], run_dir).config.sampler.noise_level == 0.9


def test_a_run_with_nothing_computed_takes_a_new_config(tmp_path):
    """A first command that failed (loop without prompts) must not block the right one."""
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    run_dir, prompts = tmp_path / "run", tmp_path / "p.txt"
    prompts.write_text('A sign "OPEN"\nA mug "Best"\n')
    runner = CliRunner()
    failed = runner.invoke(app, ["loop", "-n", "2", "--run", str(run_dir)])
    assert failed.exit_code == 1 and "flowgrpo prepare --train FILE" in failed.output
    assert not run_dir.exists()  # a failed first command leaves no folder behind
    failed = runner.invoke(app, ["rollout", "--run", str(run_dir)])
    assert failed.exit_code == 1 and "model.path is not set" in failed.output
    assert not run_dir.exists()
    # in a folder that existed, only what the failed command wrote goes
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    failed = runner.invoke(app, ["prepare", "--run", str(run_dir), "--train", str(tmp_path)])
    assert failed.exit_code == 1
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    result = runner.invoke(app, ["prepare", "--run", str(run_dir), "--train", str(prompts),
                                 "--test", str(prompts)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert resolve_run(None, [], run_dir).config.data.train == str(prompts)


def test_stored_config_is_used_when_none_is_given(tmp_path):
    run_dir = tmp_path / "run"
    resolve_run(None, ["algorithm.group_size=3"], run_dir).store_config()
    assert resolve_run(None, [], run_dir).config.algorithm.group_size == 3
    assert isinstance(resolve_run(None, [], run_dir).config, Config)


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[1].glob("examples/**/*.toml")))
def test_example_configs_validate(path):
    config = load_config(path)
    assert config.model.path
