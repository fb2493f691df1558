"""What the command line prints: help texts, hints, progress, and no library noise."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from flowgrpo_cli.cli import app


def invoke(*args: str, **kwargs):
    return CliRunner().invoke(app, list(args), **kwargs)


def _flat(text: str) -> str:
    """Help output without whitespace and table borders: a wrapped phrase reads whole."""
    return re.sub(r"[\s│]", "", text)


def test_help_texts_keep_their_square_brackets():
    group = typer.main.get_command(app)
    checked = 0
    for name, command in group.commands.items():
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        tokens = {t for text in texts for t in re.findall(r"\[[^\]\s]+\]", text)}
        if not tokens:
            continue
        output = _flat(invoke(name, "--help").output)
        for token in tokens:
            assert token in output, f"`flowgrpo {name} --help` lost {token}"
            checked += 1
    assert checked >= 2  # the [reward] of serve-reward's and reward's --reward and --config


@pytest.mark.parametrize(
    ("key", "suggested"),
    [
        ("train.learning_rate", "train.lr"),
        ("sampler.learning_rate", "train.lr"),
        ("sampler.cfg", "sampler.guidance_scale"),
        ("eval.cfg_scale", "eval.guidance_scale"),
        ("train.num_inference_steps", "sampler.num_steps"),
        ("train.group_size", "algorithm.group_size"),
    ],
)
def test_an_unknown_set_key_suggests_the_key_users_mean(key, suggested):
    result = invoke("config", "--set", f"{key}=1")
    assert result.exit_code == 1
    assert f"did you mean `{suggested}`?" in result.output, result.output


def test_prompts_without_a_quoted_target_suggest_a_reward_that_needs_none(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("a cat on a sofa\na red bicycle\n")
    result = invoke("prepare", "--run", str(tmp_path / "run"), "--train", str(plain),
                    "--test", str(plain))  # fmt: skip
    assert result.exit_code == 1
    assert "jpeg_compressibility" in result.output and "plugin" in result.output, result.output


def _complete(words: str) -> list[str]:
    env = {"_FLOWGRPO_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1))}  # fmt: skip
    result = CliRunner().invoke(app, [], env=env, prog_name="flowgrpo")
    return result.output.split()


def test_shell_completion_offers_the_set_keys():
    offered = _complete("flowgrpo rollout --set sampler.no")
    assert "sampler.noise_level=" in offered, offered
    every = _complete("flowgrpo loop --set ")
    assert {"train.lr=", "reward.remote.url=", "run.dir="} <= set(every)


def test_loop_prints_overall_progress_and_labels_its_score_bar(make_run):
    _, run = make_run()
    result = invoke("loop", "--run", str(run.root), "--iterations", "2")
    assert result.exit_code == 0, result.output
    assert re.search(r"1/2 iterations done, ETA \d", result.output), result.output
    assert "2/2 iterations done" in result.output
    assert "score part-" not in result.output
    assert "score iter 1" in result.output


def _run_cli(*args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "flowgrpo_cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_tiny_model_prints_no_library_warnings_or_shard_bars(tmp_path):
    output = _run_cli("tiny-model", "--family", "sd3", str(tmp_path / "tiny"))
    assert "requires torchvision" not in output, output
    assert "Writing model shards" not in output, output
    assert "tiny sd3 pipeline" in output


def test_trackers_print_no_run_summary_and_say_goodbye_once(make_run, tmp_path):
    # Looked up, not imported: trackio reads TRACKIO_DIR once, at its first import, and
    # test_trackers imports it in this process with a folder of its own.
    for module in ("trackio", "wandb"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    _, run = make_run('log.trackers=["trackio", "wandb"]', "log.project=fg-out")
    env = {"TRACKIO_DIR": str(tmp_path / "trackio"), "WANDB_MODE": "offline"}
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # not under ~
        env[variable] = str(tmp_path / variable.lower())
    output = _run_cli("loop", "--run", str(run.root), "--iterations", "1", env=env)
    assert output.count("Uploading logs") == 1, output
    assert "Run summary" not in output and "Run history" not in output, output
