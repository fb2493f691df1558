"""Frictions a user meets through the CLI (issue 46): each test goes through `flowgrpo ...`."""

from __future__ import annotations

import json
import os
import stat

from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from tests.conftest import PROMPTS
from tests.helpers import do_iteration


def _flowgrpo(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _first_command_sets(tmp_path, tiny_model_dir) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sets = [
        f"data.train={prompts}", f"data.test={prompts}", f"model.path={tiny_model_dir('sd3')}",
        "model.dtype=float32", "model.device=cpu", "model.height=64", "model.width=64",
        "sampler.num_steps=3", "sampler.batch_size=4", "algorithm.group_size=2",
        "algorithm.prompts_per_iteration=2", "train.micro_batch_size=2",
        "reward.weights={jpeg_compressibility = 1.0}", "eval.every=0",
    ]  # fmt: skip
    return [arg for value in sets for arg in ("--set", value)]


# Item 2: a failed first command leaves nothing behind, so the corrected command just works.


def test_failed_first_loop_on_the_lora_rank_leaves_nothing(tmp_path, tiny_model_dir, make_run):
    config, trained = make_run("train.lora_rank=4", "train.lora_alpha=8", name="donor")
    do_iteration(config, trained)
    lora = trained.checkpoint_dir(0)
    root = tmp_path / "new"
    sets = _first_command_sets(tmp_path, tiny_model_dir)
    lora_sets = ["--set", "train.lora_alpha=8", "--set", f"model.init_lora={lora}"]
    failed = _flowgrpo("loop", "--run", root, "-n", "1", *sets, *lora_sets,
                       "--set", "train.lora_rank=8")  # fmt: skip
    assert failed.exit_code == 1, failed.output
    assert "rank" in failed.output
    assert not root.exists(), sorted(p.name for p in root.iterdir())
    fixed = _flowgrpo("loop", "--run", root, "-n", "1", *sets, *lora_sets,
                      "--set", "train.lora_rank=4")  # fmt: skip
    assert fixed.exit_code == 0, fixed.output
    assert (root / "checkpoints/iter-000000/manifest.json").is_file()


def test_failed_first_loop_on_a_wrong_model_path_leaves_nothing(tmp_path, tiny_model_dir):
    root = tmp_path / "new"
    sets = _first_command_sets(tmp_path, tiny_model_dir)
    failed = _flowgrpo("loop", "--run", root, "-n", "1", *sets,
                       "--set", f"model.path={tmp_path / 'no-such-model'}")  # fmt: skip
    assert failed.exit_code == 1, failed.output
    assert not root.exists(), sorted(p.name for p in root.iterdir())
    fixed = _flowgrpo("loop", "--run", root, "-n", "1", *sets)
    assert fixed.exit_code == 0, fixed.output


# Item 3: reward failures are shown in the loop's per-iteration line.

PLUGIN = """
def score(images, prompts, metadata):
    if any(int(m["sample_id"].rsplit("k", 1)[1]) == 1 for m in metadata):  # 2nd of a group
        raise ValueError("cannot read this one")
    return [1.0] * len(images)
"""


def test_loop_line_says_how_many_images_failed_scoring(tmp_path, make_run):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "flaky.py").write_text(PLUGIN)
    _, run = make_run(f"reward.plugin_dirs=[{str(plugins)!r}]",
                           'reward.weights={"flaky:score" = 1.0}')  # fmt: skip
    result = _flowgrpo("loop", "--run", run.root, "-n", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "2 of 4 images failed scoring (reward.on_error = drop_sample)" in text, text
    assert "cannot read this one" in text


# Item 4: exports get the umask's mode, and a plain export's card reports its own evaluation.


def test_export_folder_gets_the_umasks_mode(tmp_path, make_run):
    config, run = make_run()
    do_iteration(config, run)
    old = os.umask(0o022)
    try:
        result = _flowgrpo("export", run.root, tmp_path / "out")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    for path in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_plain_export_card_does_not_borrow_the_emas_evaluation(tmp_path, make_run):
    _, run = make_run("train.ema_decay=0.9", "eval.every=1", "eval.num_prompts=2")
    assert _flowgrpo("loop", "--run", run.root, "-n", "1").exit_code == 0
    ema_reward = json.loads((run.eval_dir(1) / "metrics.json").read_text())
    ema_reward = f"{ema_reward['eval/reward_mean']:.4f}"
    assert _flowgrpo("export", run.root, tmp_path / "plain").exit_code == 0
    card = (tmp_path / "plain/README.md").read_text()
    assert "these weights were not evaluated" in card, card
    assert f"| after 1 update (checkpoint iter-000000) | {ema_reward} |" not in card
    assert _flowgrpo("export", run.root, tmp_path / "ema", "--ema").exit_code == 0
    card = (tmp_path / "ema/README.md").read_text()
    assert f"| after 1 update (checkpoint iter-000000) | {ema_reward} |" in card, card


# Item 5: not every checkpoint's weights are kept by default; the latest always is.


def test_checkpoint_every_keeps_every_kth_and_the_latest(make_run, tmp_path):
    _, run = make_run("run.checkpoint_every=2")
    result = _flowgrpo("loop", "--run", run.root, "-n", "3")
    assert result.exit_code == 0, result.output
    weights = [(run.checkpoint_dir(n) / "pytorch_lora_weights.safetensors").is_file()
               for n in range(3)]  # fmt: skip
    assert weights == [False, True, True]
    refused = _flowgrpo("export", run.root, tmp_path / "out", "-i", "0")
    assert refused.exit_code == 1
    assert "run.checkpoint_every" in " ".join(refused.output.split()), refused.output
    assert _flowgrpo("export", run.root, tmp_path / "out", "-i", "1").exit_code == 0


def test_checkpoints_are_thinned_by_default(make_run):
    from flowgrpo_cli.store.config import Config

    assert Config().run.checkpoint_every > 1
    assert Config().run.keep_checkpoints == 0


# Item 7: one numbering in export, the loop's evaluation note, the model card and the report.


def test_outputs_name_checkpoint_and_updates_the_same_way(tmp_path, make_run):
    _, run = make_run("eval.every=1", "eval.num_prompts=2")
    result = _flowgrpo("loop", "--run", run.root, "-n", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "policy after 1 update (checkpoint iter-000000, eval/iter-000001)" in text, text
    exported = _flowgrpo("export", run.root, tmp_path / "out")
    assert exported.exit_code == 0, exported.output
    text = " ".join(exported.output.split())
    assert "checkpoint iter-000000 (the policy after 1 update)" in text, text
    card = (tmp_path / "out/README.md").read_text()
    assert "checkpoint iter-000000: the policy after 1 update" in card, card
    assert "| after 1 update (checkpoint iter-000000) |" in card, card
    assert _flowgrpo("report", run.root).exit_code == 0
    page = (run.root / "report/index.html").read_text()
    assert "the policy after N updates" in page
    assert "<td>1 (final evaluation)</td>" in page


def test_ocr_on_a_prompt_without_quoted_text_suggests_another_reward(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.chdir(tmp_path)  # a short image name: the error fits its table cell
    Image.new("RGB", (64, 64), "white").save("w.png")
    result = _flowgrpo("reward", "--prompt", "a cat on a sofa", "w.png")
    assert result.exit_code == 0, result.output
    assert "ocr: no quoted target text in the prompt" in result.output
    assert "reward.weights={jpeg_compressibility = 1.0}" in " ".join(result.output.split())


def test_anchor_decay_where_the_algorithm_has_no_settable_anchor_is_refused(make_run):
    for algorithm, kept in (("grpo_guard", "the weights that sampled"), ("flow_grpo", "no anchor")):
        sets = (f"algorithm.name={algorithm}", "algorithm.anchor_decay=[0, 0.1, 0.5]")
        _, run = make_run(*sets, name=algorithm)
        result = _flowgrpo("loop", "--run", run.root, "-n", "1")
        assert result.exit_code == 1, result.output
        message = " ".join(result.output.split())
        assert "algorithm.anchor_decay = [0.0, 0.1, 0.5] sets the anchor of nft and awm" in message
        assert f"{algorithm} keeps {kept}" in message
