"""What a new user meets in their first hour, through the command line as they meet it."""

import shutil
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app

PROMPTS = ["a cat on a sofa", "a red bicycle"]  # no quoted targets: the reward reads none


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def _project(tmp_path, tiny_model_dir) -> Path:
    """A project folder with its model, prompts and a reward plugin, all named relative to
    its config file, run.toml."""
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
    return project


def test_relative_paths_and_plugin_dirs_are_stored_absolute(tmp_path, tiny_model_dir, monkeypatch):
    """A project's run works from any folder, and trains on a plain prompt list."""
    project = _project(tmp_path, tiny_model_dir)
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


def test_a_config_file_runs_from_any_working_directory(tmp_path, tiny_model_dir, monkeypatch):
    """Input paths in a config file are relative to the file; the run folder, an output, and
    `--set` paths to the working directory."""
    project = _project(tmp_path, tiny_model_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "other-prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(elsewhere)
    result = invoke(
        "loop", "-n", "1", "--config", "../project/run.toml",
        "--set", "data.test=other-prompts.txt",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    stored = tomllib.loads((elsewhere / "runs/r/config.toml").read_text())
    assert stored["data"]["train"] == str(project / "prompts.txt")
    assert stored["data"]["test"] == str(elsewhere / "other-prompts.txt")
    assert stored["model"]["path"] == str(project / "model")
    assert stored["reward"]["plugin_dirs"] == [str(project / "plugins")]
    assert (elsewhere / "runs/r/checkpoints/iter-000000/manifest.json").is_file()


EXAMPLES = Path(__file__).parent.parent / "examples"
GENERATED = {EXAMPLES / "geneval" / "train_metadata.jsonl"}


@pytest.mark.parametrize(
    "example", sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.toml"))
)
def test_every_example_finds_its_files_from_any_working_directory(example, tmp_path, monkeypatch):
    from flowgrpo_cli.store.config import load_config

    monkeypatch.chdir(tmp_path)
    config = load_config(EXAMPLES / example)
    # a recipe writes a git-ignored training file: `just geneval-train` for sd35m_geneval.toml
    assert Path(config.data.train).is_file() or Path(config.data.train) in GENERATED
    assert not config.data.test or Path(config.data.test).is_file()
    assert all(Path(folder).is_dir() for folder in config.reward.plugin_dirs)
    model = Path(config.model.path)
    # a hub id, or a folder of the repository (the demo's tiny model is built by `just demo`)
    assert not model.is_absolute() or model.is_relative_to(EXAMPLES.parent)
    assert Path(config.run.dir).is_relative_to(tmp_path)


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


REPO = Path(__file__).parent.parent


@pytest.mark.skipif(
    shutil.which("just") is None or not (REPO / ".venv/.flowgrpo-installed").is_file(),
    reason="needs `just` and the venv `just setup` makes (`just test` has both)",
)
def test_just_flowgrpo_reaches_the_hub_and_a_gated_model_says_what_to_do(tmp_path):
    """`just flowgrpo` leaves the Hub on (only tests and demos run offline): a gated model is
    asked for, and the error says how to get access. The Hub is a local stand-in that
    answers every request as the Hub answers for a gated repository."""
    import http.server
    import os
    import subprocess
    import threading

    asked = []

    class GatedHub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            asked.append(self.path)
            self.send_response(403)
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to model some-org/gated is restricted.")
            self.end_headers()

        do_GET = do_HEAD

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), GatedHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "FLOWGRPO_OFFLINE_SOURCE")
    }
    env.update(
        HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}", HF_HOME=str(tmp_path / "hf")
    )
    try:
        result = subprocess.run(
            ["just", "--justfile", str(REPO / "Justfile"), "flowgrpo", "rollout",
             "--run", str(tmp_path / "run"), "--set", "model.path=some-org/gated",
             "--set", "model.device=cpu"],
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
    finally:
        server.shutdown()
    assert result.returncode != 0
    assert asked, "the Hub was never asked: offline mode is on"
    assert "some-org/gated is a gated repository: accept its licence at" in result.stderr
    assert "hf auth login" in result.stderr
    assert "Traceback" not in result.stderr
