"""OCR reward throughput on rendered text, for the benchmark suite (and its test)."""

from __future__ import annotations

import random
import time

from PIL import Image, ImageDraw, ImageFont

from flowgrpo_cli.rewards.base import RewardBatch
from flowgrpo_cli.rewards.ocr import OcrReward

_WORDS = (
    "open",
    "sale",
    "coffee",
    "hello",
    "world",
    "flow",
    "grpo",
    "market",
    "station",
    "bakery",
    "welcome",
    "exit",
    "garden",
    "library",
    "north",
    "street",
)


def render_text_images(count: int, seed: int = 0) -> RewardBatch:
    """`count` 512x512 images of two words at varied sizes and places, with their texts as
    targets; the same images for the same seed."""
    rng = random.Random(seed)
    images, targets = [], []
    for _ in range(count):
        text = f"{rng.choice(_WORDS)} {rng.choice(_WORDS)}"
        size = rng.randint(32, 48)  # "welcome library" at 48 still fits the width
        image = Image.new("RGB", (512, 512), "white")
        ImageDraw.Draw(image).text(
            (rng.randint(8, 24), rng.randint(24, 440)),
            text,
            fill="black",
            font=ImageFont.load_default(size=size),
        )
        images.append(image)
        targets.append(text)
    return RewardBatch(images, ground_truths=targets)


def ocr_throughput(num_images: int, workers: int) -> float:
    """Images per second the `ocr` reward scores with `workers` processes, after every
    worker has built its engine (a run pays that once, not per iteration)."""
    batch = render_text_images(num_images)
    reward = OcrReward(workers=workers)
    try:
        reward.score(render_text_images(workers, seed=1))  # start the workers, build engines
        start = time.perf_counter()
        reward.score(batch)
        return num_images / (time.perf_counter() - start)
    finally:
        reward.close()
