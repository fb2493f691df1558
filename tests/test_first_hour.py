"""What a new user meets in their first hour, through the command line as they meet it."""

import shutil
import sys
import tomllib

from typer.testing import CliRunner

from flowgrpo_cli.cli import app

PROMPTS = ["a cat on a sofa", "a red bicycle"]  # no quoted targets: the reward reads none


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_relative_paths_and_plugin_dirs_are_stored_absolute(tmp_path, tiny_model_dir, monkeypatch):
    """A project's run works from any folder, and trains on a plain prompt list."""
    # A project folder with its model, prompts and a reward plugin, all named relative to it.
    project = tmp_path / "project"
    (project / "plugins").mkdir(parents=True)
    (project / "plugins" / "rw_dirs_reward.py").write_text(
        "def score(images, prompts, metadata):\n    return [0.5] * len(images)\n"
    )
    shutil.copytree(tiny_model_dir("sd3"), project / "model")
    (project / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (project / "run.toml").write_text(
        "\n".join([
            '[run]\ndir = "runs/r"',
            '[data]\ntrain = "prompts.txt"\ntest = "prompts.txt"',
            '[model]\npath = "model"\ndtype = "float32"\ndevice = "cpu"\nheight = 64\nwidth = 64',
            "[sampler]\nnum_steps = 2\nbatch_size = 4",
            "[algorithm]\ngroup_size = 2\nprompts_per_iteration = 2",
            "[train]\nlora_rank = 2\nmicro_batch_size = 2",
            "[eval]\nevery = 1\nnum_prompts = 2\nnum_steps = 2",
            '[reward]\nplugin_dirs = ["plugins"]\nweights = {"rw_dirs_reward:score" = 1.0}',
        ])
    )  # fmt: skip
    monkeypatch.setattr(sys, "path", list(sys.path))  # plugin_dirs extends the search path
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.chdir(project)
    result = invoke("prepare", "--config", "run.toml")
    assert result.exit_code == 0, result.output
    stored = tomllib.loads((project / "runs/r/config.toml").read_text())
    assert stored["run"]["dir"] == str(project / "runs/r")
    assert stored["data"]["train"] == stored["data"]["test"] == str(project / "prompts.txt")
    assert stored["model"]["path"] == str(project / "model")
    assert stored["reward"]["plugin_dirs"] == [str(project / "plugins")]
    # Elsewhere, with no PYTHONPATH: the run finds its model, prompts and plugin.
    monkeypatch.chdir(tmp_path)
    result = invoke("loop", "-n", "1", "--run", str(project / "runs/r"))
    assert result.exit_code == 0, result.output
    assert (project / "runs/r/checkpoints/iter-000000/manifest.json").is_file()
    assert (project / "runs/r/eval/iter-000001/metrics.json").is_file()


def test_a_hub_id_stays_a_hub_id(tmp_path, monkeypatch):
    from flowgrpo_cli.store.config import load_config

    monkeypatch.chdir(tmp_path)
    hub = "stabilityai/stable-diffusion-3.5-medium"
    assert load_config(None, [f"model.path={hub}"]).model.path == hub
    (tmp_path / "local-model").mkdir()
    assert load_config(None, ["model.path=local-model"]).model.path == str(tmp_path / "local-model")


def test_config_output_is_the_toml_it_shows(tmp_path):
    from flowgrpo_cli.store.config import load_config

    long = "/some/long/folder/name/of/prompts file.txt"
    result = invoke("config", "--set", f"data.train={long}")
    assert result.exit_code == 0, result.output
    (tmp_path / "c.toml").write_text(result.output)  # `flowgrpo config > c.toml`, long lines kept
    assert load_config(tmp_path / "c.toml").data.train == long


def test_reference_keeps_brackets_and_lists_allowed_values():
    result = invoke("config", "--reference")
    assert result.exit_code == 0, result.output
    assert "[lo, hi]" in result.output  # not eaten as rich markup
    assert "the paper's SDE or CPS; one of 'sde', 'cps'." in result.output
    assert "one of 'flow_grpo', 'grpo_guard', 'mixgrpo', 'nft', 'awm'" in result.output


def test_a_misspelt_override_blames_the_override(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[sampler]\nnum_steps = 3\n")
    for args in (["--set", "samplr.kind=sde"], ["-c", str(toml), "--set", "samplr.kind=sde"]):
        result = invoke("config", *args)
        assert result.exit_code == 1
        assert "--set samplr.kind=sde: unknown section [samplr]; did you mean [sampler]?" in (
            result.output
        ), result.output


def test_version_and_shell_completion(monkeypatch):
    import typer.completion

    from flowgrpo_cli import __version__

    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"flowgrpo {__version__}"
    # typer finds the shell from the parent processes, which a detached test run lacks
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    result = invoke("--show-completion")
    assert result.exit_code == 0 and "complete" in result.output and "flowgrpo" in result.output
