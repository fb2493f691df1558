"""The toy OCR example: its prompt files, its RL config, and pre-training, shortened.

A few steps of each pre-training phase into a temporary folder, then the saved pipeline loads
through flowgrpo's adapter and draws a 32x96 image, the way `flowgrpo loop` will use it.
"""

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo_cli.config import load_config
from flowgrpo_cli.prompts import read_prompt_file

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


def test_rl_config_validates_and_points_at_the_example():
    config = load_config(TOY / "rl.toml")
    assert (config.model.height, config.model.width) == (32, 96)
    assert config.model.max_sequence_length == 32
    assert config.reward.weights == {"ocr": 1.0}
    for path in (config.model.path, config.data.train, config.data.test):
        assert (ROOT / path).exists(), path
    assert (ROOT / config.model.path / "model_index.json").is_file()


def test_pretrain_then_render_through_the_adapter(tmp_path, monkeypatch):
    from flowgrpo_cli.models import load_adapter

    pretrain = _import("pretrain", monkeypatch)
    out = tmp_path / "run"
    torch.manual_seed(0)  # nothing below may depend on it: the script seeds its own generators
    pretrain.main(
        [
            "--out",
            str(out),
            "--vae-steps",
            "2",
            "--vae-batch-size",
            "4",
            "--max-steps",
            "2",
            "--minutes",
            "5",
            "--num-train",
            "16",
            "--batch-size",
            "8",
            "--eval-every",
            "1",
            "--eval-prompts",
            "2",
            "--threads",
            "1",
        ]
    )
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

    adapter = load_adapter(model, dtype=torch.float32, device="cpu")
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
