"""Image grids with a caption under each image: prompt, target text and reward."""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

CELL = 192  # images are shown at this width; small models' 64 px images are scaled up
# The training grid of each iteration, samples/iter-N.png: the first images of the first groups.
GRID_GROUPS, GRID_PER_GROUP = 4, 4
CAPTION_LINES = 5
LINE_HEIGHT = 13


@dataclass(frozen=True)
class GridItem:
    png: bytes
    prompt: str
    target: str
    reward: float | None


def make_grid(items: list[GridItem], columns: int = 4) -> bytes:
    """A PNG of the items in rows of `columns`, each with its caption below."""
    if not items:
        raise ValueError("make_grid needs at least one image")
    font = ImageFont.load_default(size=11)
    rows = (len(items) + columns - 1) // columns
    images = [Image.open(io.BytesIO(item.png)).convert("RGB") for item in items]
    # Every image at the cell width; rows as tall as the tallest (a 32x96 image is 64 px).
    image_height = max(CELL * image.height // image.width for image in images)
    caption_height = CAPTION_LINES * LINE_HEIGHT + 6
    cell_height = image_height + caption_height
    canvas = Image.new("RGB", (columns * CELL, rows * cell_height), "white")
    draw = ImageDraw.Draw(canvas)
    for index, (item, image) in enumerate(zip(items, images, strict=True)):
        x, y = (index % columns) * CELL, (index // columns) * cell_height
        canvas.paste(image.resize((CELL, CELL * image.height // image.width)), (x, y))
        reward = "-" if item.reward is None else f"{item.reward:.3f}"
        lines = [f"target: {item.target}", f"reward: {reward}"]
        lines += textwrap.wrap(item.prompt, width=34)[: CAPTION_LINES - len(lines)]
        top = y + image_height + 3
        for n, line in enumerate(lines):
            draw.text((x + 4, top + n * LINE_HEIGHT), line, fill="black", font=font)
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()
