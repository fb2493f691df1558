"""JPEG (in)compressibility against the size of a JPEG file written to disk here."""

import random

import pytest
from PIL import Image

from flowgrpo_cli.rewards import RewardBatch, build_rewards


def noise(seed: int) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (64, 48), bytes(rng.randrange(256) for _ in range(64 * 48 * 3)))


def file_kb(image: Image.Image, path) -> float:
    image.save(path, format="JPEG", quality=95)
    return path.stat().st_size / 1000


def test_values_are_minus_and_plus_file_kb_over_500(tmp_path):
    images = [Image.new("RGB", (64, 48), (200, 30, 30)), noise(0), noise(1).convert("L")]
    # Grayscale is scored as RGB, like the generated images the reward sees.
    sizes = [file_kb(image.convert("RGB"), tmp_path / f"{i}.jpg") for i, image in enumerate(images)]
    weights = {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5}
    with build_rewards(weights) as rewards:
        result = rewards.score(RewardBatch(images))
    assert result.columns["jpeg_compressibility"] == pytest.approx([-s / 500 for s in sizes])
    assert result.columns["jpeg_incompressibility"] == pytest.approx([s / 500 for s in sizes])
    assert result.reward == pytest.approx([-s / 1000 for s in sizes])
    flat, noisy, _ = result.columns["jpeg_compressibility"]
    assert flat > noisy  # noise compresses worse


def test_an_image_jpeg_cannot_hold_is_an_error_not_a_value():
    with build_rewards({"jpeg_incompressibility": 1.0}) as rewards:
        result = rewards.score(RewardBatch([Image.new("RGB", (0, 0))]))
    assert result.columns["jpeg_incompressibility"] == [None]
    assert result.reward == [None]
    assert result.reward_error[0].startswith("jpeg_incompressibility: ValueError: ")
