"""`flowgrpo inspect` and `flowgrpo reward`: the tools for looking at runs and rewards."""

from helpers import do_rollout, do_score, flip_one_byte
from PIL import Image, ImageDraw, ImageFont
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE

runner = CliRunner()


def test_inspect_run_iteration_stage_and_part(make_run, tmp_path):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    result = runner.invoke(app, ["inspect", str(run.root)])
    assert result.exit_code == 0, result.output
    assert "current iteration: 0" in result.output and "done" in result.output
    result = runner.invoke(app, ["inspect", str(run.iteration_dir(0))])
    assert "rollout" in result.output and "scores" in result.output
    rollout = run.stage_dir(0, ROLLOUT)
    result = runner.invoke(app, ["inspect", str(rollout), "--images", str(tmp_path / "png")])
    assert result.exit_code == 0, result.output
    assert "rows: 4 in 1 part(s)" in result.output
    assert "groups: 2 (sizes [2])" in result.output
    assert "log-prob per stored step" in result.output
    assert "latents" in result.output
    assert len(list((tmp_path / "png").glob("*.png"))) == 4
    assert len((tmp_path / "png" / "prompts.tsv").read_text().splitlines()) == 5
    part = run.stage_dir(0, SCORE) / "part-00000-of-00001.arrow"
    result = runner.invoke(app, ["inspect", str(part)])
    assert "jpeg_compressibility: double" in result.output


def test_inspect_verifies_each_part_against_its_manifest(make_run):
    config, run = make_run()
    do_rollout(config, run)
    do_score(config, run)
    scores = run.stage_dir(0, SCORE)
    result = runner.invoke(app, ["inspect", str(scores)])
    assert "1 part(s) match their recorded size and checksum" in result.output
    flip_one_byte(scores / "part-00000-of-00001.arrow")
    result = runner.invoke(app, ["inspect", str(scores)])
    assert "checksum differs from the manifest" in result.output.replace("\n", " ")


def test_inspect_a_missing_path(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "none")])
    assert result.exit_code == 1 and "does not exist" in result.output


def render(path, text):
    image = Image.new("RGB", (512, 128), "white")
    ImageDraw.Draw(image).text((20, 30), text, fill="black", font=ImageFont.load_default(size=48))
    image.save(path)
    return path


def test_reward_command_prints_scores_and_what_ocr_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short names keep the table's rows on one line
    good = render("good.png", "OPEN")
    bad = render("bad.png", "OPFN")
    result = runner.invoke(
        app, ["reward", "--reward", "ocr", "--reward", "jpeg_compressibility=0.5",
              "--prompt", 'A sign that says "OPEN"', str(good), str(bad)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if ".png" in line}
    assert "1.0000" in lines[str(good)] and "'OPEN'" in lines[str(good)]
    assert "0.7500" in lines[str(bad)]  # one wrong character of four


def test_reward_command_errors(tmp_path):
    image = render(tmp_path / "a.png", "X")
    result = runner.invoke(app, ["reward", "--reward", "ocrr", "--prompt", '"X"', str(image)])
    assert result.exit_code == 1 and "did you mean 'ocr'" in result.output
    result = runner.invoke(app, ["reward", "--prompt", "p", str(tmp_path / "none.png")])
    assert result.exit_code == 1 and "none.png" in result.output
