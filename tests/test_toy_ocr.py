"""The toy OCR example: its prompt files, its RL config, pre-training (shortened) and rescoring.

A few steps of each pre-training phase into a temporary folder, then the saved pipeline loads
through flowgrpo's adapter and draws a 32x96 image, the way `flowgrpo loop` will use it.
"""

import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo_cli.store.config import load_config
from flowgrpo_cli.store.prompts import read_prompt_file

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "examples" / "toy_ocr"


def _import(name: str, monkeypatch):
    """Import examples/toy_ocr/NAME.py as `toy_ocr_NAME`; its siblings import by plain name."""
    monkeypatch.syspath_prepend(str(TOY))
    # pretrain.py sets this default before torch loads; keep it out of later tests' env.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    spec = importlib.util.spec_from_file_location(f"toy_ocr_{name}", TOY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_prompt_files_are_current_and_disjoint(tmp_path, monkeypatch):
    prompts = _import("toy_prompts", monkeypatch)
    assert len(prompts.ALPHABET) == len(set(prompts.ALPHABET)) == 28
    assert not set("OIL0S15Q") & set(prompts.ALPHABET)
    # The committed files are what the generator writes today.
    for path in prompts.write_prompt_files(tmp_path):
        assert path.read_bytes() == (TOY / "prompts" / path.name).read_bytes(), path.name
    train = read_prompt_file(TOY / "prompts" / "train.txt")
    test = read_prompt_file(TOY / "prompts" / "test.txt")
    assert not train.problems and not test.problems
    assert (len(train.rows), len(test.rows)) == (prompts.N_TRAIN_FILE, prompts.N_TEST)
    train_targets = {row.ground_truth for row in train.rows}
    test_targets = {row.ground_truth for row in test.rows}
    assert len(test_targets) == prompts.N_TEST
    # Held out from pre-training too, not just from train.txt.
    assert not test_targets & set(prompts.draw_targets()[1])
    assert train_targets <= set(prompts.draw_targets()[1])
    assert all(set(t) <= set(prompts.ALPHABET) and len(t) in (3, 4) for t in test_targets)
    # Validation and RL-only targets: never pre-trained on, apart from each other and the test.
    seen = set(prompts.draw_targets()[1]) | test_targets
    val = {row.ground_truth for row in read_prompt_file(TOY / "prompts" / "val.txt").rows}
    rl = {row.ground_truth for row in read_prompt_file(TOY / "prompts" / "rl.txt").rows}
    assert (len(val), len(rl)) == (prompts.N_VAL, prompts.N_RL)
    assert not (val & seen or rl & seen or val & rl)


@pytest.mark.parametrize("name", ["rl", "rl_awm", "rl_nft", "rl_grpo_guard", "rl_mixgrpo"])
def test_rl_config_validates_and_points_at_the_example(name):
    config = load_config(TOY / f"{name}.toml")
    assert config.algorithm.name == (name[3:] or "flow_grpo")
    assert config.eval.num_steps == 20  # one evaluation: the same steps, prompts and noise, at
    # the CFG scale chosen on validation (AWM's policy is sampled CFG-free and reads best at 1.5)
    assert config.eval.guidance_scale == (1.5 if name == "rl_awm" else 4.0)
    assert (config.model.height, config.model.width) == (32, 96)
    assert config.model.max_sequence_length == 32
    assert config.reward.weights == {"ocr": 1.0}
    for path in (config.model.path, config.data.train, config.data.test):
        assert (ROOT / path).exists(), path
    assert (ROOT / config.model.path / "model_index.json").is_file()


def test_learning_curve_counts_training_time_before_each_evaluation(tmp_path, monkeypatch):
    learn = _import("learn", monkeypatch)
    stages = {"rollout/seconds": 30.0, "score/seconds": 6.0, "update/seconds": 24.0}  # 1 min
    lines = [
        {"iteration": 0, **stages, "eval/ocr_mean": 0.3, "eval/ocr_exact": 0.01},
        {"iteration": 1, **stages, "update/seconds": 84.0},  # 2 min: eval time is not in it
        {"iteration": 2, "eval/ocr_mean": 0.4, "eval/ocr_exact": 0.05},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    curve = learn.rl_curve(tmp_path)
    assert curve == [learn.Point(0.0, 0.3, 0.01, 0), learn.Point(3.0, 0.4, 0.05, 2)]
    assert learn.accuracy_by(curve, 2.9) == curve[0] and learn.accuracy_by(curve, 3) == curve[1]
    learn.write_table({"awm": curve}, [1, 3, 5], tmp_path / "learn.md")
    row = (tmp_path / "learn.md").read_text().splitlines()[2]
    assert row == "| awm | 0.300 | 0.400 | - | 0.400 (5%) at 3.0 min |"  # stopped before 5


def test_summary_gives_gains_minutes_to_ten_points_and_rate_against_pretraining(monkeypatch):
    learn = _import("learn", monkeypatch)
    P = learn.Point
    curves = {
        # best 0.52 at 8 min: +12.0 points; +10 first at 8 min (0.45 at 4 is +5); 12 / 8 = 1.5
        "awm": [P(0, 0.40, 0.01, 0), P(4, 0.45, 0.02, 8), P(8, 0.52, 0.09, 16)],
        # best 0.60 at 2 min: +20.0; +10 first at 1 min (0.52 - 0.40 = 0.12); 20 / 2 = 10;
        # awm's rate against it: 1.5 / 10 = 0.15
        "pretrain": [P(0, 0.40, 0.01, 0), P(1, 0.52, 0.05, 100), P(2, 0.60, 0.20, 200)],
        # never above its start: best is minute 0, no rate
        "flow_grpo": [P(0, 0.50, 0.03, 0), P(5, 0.48, 0.02, 10)],
    }
    curves["awm"].append(P(11, 0.90, 0.5, 22))  # past the 10-minute budget: left out
    rows = learn.summary_rows(curves, minutes=10)
    assert rows[2] == "| awm | 0.400 | +12.0 (9%) | 8.0 min | 8.0 | +1.50 | 0.15x |"
    assert rows[3] == "| pretrain | 0.400 | +20.0 (20%) | 2.0 min | 1.0 | +10.00 | 1.00x |"
    assert rows[4] == "| flow_grpo | 0.500 | +0.0 (3%) | 0.0 min | never | - | - |"


def test_chart_labels_name_an_arms_cfg_scales_and_levels_parse(tmp_path, monkeypatch):
    learn = _import("learn", monkeypatch)
    for arm, sampled, scored in (("awm", 1.0, 1.5), ("nft", 4.0, 4.0)):
        (tmp_path / arm).mkdir()
        scales = f"[sampler]\nguidance_scale = {sampled}\n[eval]\nguidance_scale = {scored}\n"
        (tmp_path / arm / "config.toml").write_text(scales)
    assert learn.arm_label("awm", tmp_path) == "awm, sampled at CFG 1, scored at 1.5"
    assert learn.arm_label("nft", tmp_path) == "nft"  # the usual CFG 4 goes unsaid
    assert learn.arm_label("pretrain", tmp_path) == "pretrain"
    assert learn.level("base, CFG 4=0.567") == ("base, CFG 4", 0.567)
    for bad in ("0.567", "base=", "base=high", "base=1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=ACCURACY"):
            learn.level(bad)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A pre-training run of a few steps (first one, then resumed for one more): its folder."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        pretrain = _import("pretrain", monkeypatch)
        out = tmp_path_factory.mktemp("toy-ocr") / "pretrain"
        args = [
            *("--out", str(out), "--vae-steps", "2", "--vae-batch-size", "4", "--minutes", "5"),
            *("--num-train", "16", "--batch-size", "8", "--threads", "1"),
            *("--eval-every", "1", "--eval-prompts", "1"),
        ]
        pretrain.main([*args, "--max-steps", "1"])
        with pytest.raises(SystemExit, match="--resume"):  # never mixes two runs in one folder
            pretrain.main([*args, "--max-steps", "2"])
        pretrain.main([*args, "--max-steps", "2", "--resume"])  # reuses the VAE and latents
    return out


def test_pretrain_export_then_render_through_the_adapter(pretrained, tmp_path, monkeypatch):
    from safetensors import safe_open

    from flowgrpo_cli.models import load_adapter

    out = pretrained
    # A checkpoint per evaluation, each with its scores; the last one copied to model/.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00001", "step-00002"]
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert {"exact_cfg4", "reward_cfg4", "exact_cfg1", "reward_cfg1"} <= records[-1].keys()
    model = out / "model"
    assert json.loads((model / "pretraining.json").read_text())["step"] == 2
    assert list(model.rglob("*.safetensors")) and not list(model.rglob("*.bin"))
    vae_config = json.loads((model / "vae" / "config.json").read_text())
    assert vae_config["scaling_factor"] != 1.0  # set from the latents' statistics
    scheduler = json.loads((model / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["shift"] == 1.0

    # Exported as the committed base is: float16 files, loaded by flowgrpo as float32.
    export_base = _import("export_base", monkeypatch)
    base = tmp_path / "base"
    export_base.main([str(model), str(base)])
    weights = base / "transformer" / "diffusion_pytorch_model.safetensors"
    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118
    assert json.loads((base / "pretraining.json").read_text())["step"] == 2
    adapter = load_adapter(base, dtype=torch.float32, device="cpu")
    assert adapter.transformer.dtype == torch.float32
    assert adapter.family == "sd3"
    assert adapter.latent_shape(32, 96) == (4, 8, 24)
    cond = adapter.encode_prompts(
        ['A sign that says "AB7"'], None, guidance_scale=4.0, max_sequence_length=32
    )
    assert cond["prompt_embeds"].shape == (1, 64, 128)  # 32 CLIP + 32 T5 tokens
    generator = torch.Generator().manual_seed(0)
    latents = adapter.initial_latents([generator], 32, 96)
    sigmas = adapter.sigmas(4, 32, 96)
    for sigma, sigma_next in itertools.pairwise(sigmas):
        v = adapter.velocity(latents, sigma.expand(1), cond, guidance_scale=4.0)
        latents = latents + (sigma_next - sigma) * v
    image = adapter.decode(latents)
    assert image.shape == (1, 3, 32, 96)
    assert torch.isfinite(image).all() and image.min() >= 0.0 and image.max() <= 1.0

    # The adapter's pieces reproduce the pipeline's own sampler on the saved folder.
    reference = adapter.pipeline(
        prompt='A sign that says "AB7"',
        height=32,
        width=96,
        num_inference_steps=4,
        guidance_scale=4.0,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert torch.allclose(image, reference, atol=1e-4)


def test_pretrain_init_from_continues_an_exported_pipeline(pretrained, tmp_path, monkeypatch):
    from diffusers import StableDiffusion3Pipeline

    pretrain = _import("pretrain", monkeypatch)
    source = pretrained / "model"
    out = tmp_path / "continued"

    def run(init_from: Path, *more: str) -> None:
        pretrain.main(
            [
                *("--out", str(out), "--init-from", str(init_from), "--threads", "1"),
                *("--num-train", "16", "--batch-size", "8", "--eval-every", "0"),
                *("--eval-prompts", "1", *more),
            ]
        )

    run(source, "--max-steps", "1")
    before = StableDiffusion3Pipeline.from_pretrained(source)
    after = StableDiffusion3Pipeline.from_pretrained(out / "model")
    # The VAE and the scale its latents were trained at are kept, not re-trained or re-fitted.
    for key in ("scaling_factor", "shift_factor"):
        assert after.vae.config[key] == before.vae.config[key]
    for name, value in before.vae.state_dict().items():
        assert torch.equal(after.vae.state_dict()[name], value), name
    # The transformer starts from the source's weights: one step (EMA) moves it only slightly.
    moved = [
        (after.transformer.state_dict()[name] - value).abs().max().item()
        for name, value in before.transformer.state_dict().items()
    ]
    assert 0 < max(moved) < 0.05
    # Resuming with another --init-from is refused, as any other results-changing option.
    with pytest.raises(SystemExit, match="--init-from"):
        run(out / "model", "--max-steps", "2", "--resume")
    with pytest.raises(SystemExit, match="not a pipeline folder"):
        pretrain.main(["--out", str(tmp_path / "x"), "--init-from", str(tmp_path)])


@pytest.mark.parametrize("text", ["WWWW", "MMM", "7JT2"])
def test_render_never_crops_a_glyph(monkeypatch, text):
    import random

    from PIL import Image, ImageDraw

    pretrain = _import("pretrain", monkeypatch)
    font, pad = pretrain._font(), 40
    for seed in range(20):
        image = pretrain.render(text, random.Random(seed))
        assert image.size == (96, 32)
        # The same text at the same place on a canvas with a wide margin: no ink outside.
        x, y = pretrain.placement(text, random.Random(seed))
        big = Image.new("L", (96 + 2 * pad, 32 + 2 * pad), 255)
        ImageDraw.Draw(big).text((x + pad, y + pad), text, fill=0, font=font)
        ink = torch.from_numpy(np.array(big)) < 255
        inside = ink[pad : pad + 32, pad : pad + 96]
        assert ink.sum() == inside.sum() > 0
        assert (torch.from_numpy(np.array(image.convert("L"))) < 255).equal(inside)


def test_one_rl_iteration_on_the_pretrained_model_then_evaluate(pretrained, tmp_path, monkeypatch):
    """`just toy-ocr`'s wiring, shortened: loop with rl.toml and the OCR reward on a freshly
    pre-trained base (held-out evaluation before and after), report, then evaluate.py with the
    LoRA checkpoint loaded through diffusers."""
    run = tmp_path / "rl"
    overrides = [
        f"model.path={pretrained / 'model'}",
        "algorithm.prompts_per_iteration=2",
        "algorithm.group_size=2",
        "sampler.num_steps=3",
        "eval.num_prompts=2",
        "eval.num_steps=3",
        "eval.every=1",
        # Two pre-training steps draw no readable text: every reward is 0, every group flat.
        # Keep those samples so that the update still takes its steps.
        "algorithm.drop_zero_advantage=false",
    ]
    sets = [arg for item in overrides for arg in ("--set", item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flowgrpo = [sys.executable, "-m", "flowgrpo_cli"]
    loop = [*flowgrpo, "loop", "--config", str(TOY / "rl.toml"), "--run", str(run), "-n", "1"]
    result = subprocess.run([*loop, *sets], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval/ocr_mean" in r]
    assert [r["iteration"] for r in evals] == [0, 1]  # the base, then after one update
    assert all(0.0 <= r["eval/ocr_exact"] <= r["eval/ocr_mean"] <= 1.0 for r in evals)
    assert 0.0 <= log[0]["reward/ocr_mean"] <= 1.0 and log[0]["update/optimizer_steps"] > 0
    checkpoint = run / "checkpoints" / "iter-000000"
    assert (checkpoint / "pytorch_lora_weights.safetensors").is_file()
    report = subprocess.run([*flowgrpo, "report", str(run)], env=env, capture_output=True)
    assert report.returncode == 0, report.stderr[-3000:]

    # Rescored at the run's own scale, the exported checkpoints repeat the loop's evaluations.
    rescore = _import("rescore", monkeypatch)
    curves = rescore.rescore(run, [4.0, 1.0], stride=1, threads=1)
    in_loop = [(r["eval/ocr_mean"], r["eval/ocr_exact"]) for r in evals]
    assert [(p.accuracy, p.exact) for p in curves[4.0]] == in_loop
    saved = (run / "rescored" / "cfg1" / "curve.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in saved] == [p.step for p in curves[1.0]] == [0, 1]
    assert not any((run / "rescored" / "exports").iterdir())  # only the scores stay

    evaluate = _import("evaluate", monkeypatch)
    base = evaluate.score(pretrained / "model", (4.0, 1.0), group_size=2, num_prompts=2)
    tuned = evaluate.score(
        pretrained / "model", (4.0, 1.0), group_size=2, lora=checkpoint, num_prompts=2
    )
    for result in (base, tuned):
        assert {"exact_cfg4", "reward_cfg4", "exact_cfg1", "groups_differing_cfg1"} <= result.keys()
        assert all(0.0 <= value <= 1.0 for value in result.values())
