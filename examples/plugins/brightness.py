"""An example reward plugin: the mean brightness of each image, from 0 (black) to 1 (white).

Name this folder in the config's `reward.plugin_dirs` and `brightness:score` in its weights
table (examples/tiny.toml does):

    [reward]
    plugin_dirs = ["plugins"]   # relative to the config file

    [reward.weights]
    ocr = 1.0
    "brightness:score" = 0.1
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageStat


def score(
    images: list[Image.Image], prompts: list[str], metadata: list[dict[str, Any]]
) -> list[float]:
    """One value per image, in order; prompts and metadata are not needed here."""
    return [ImageStat.Stat(image.convert("L")).mean[0] / 255.0 for image in images]


# Pure Pillow, no shared state: safe to run in a thread beside the other rewards.
score.parallel_safe = True
