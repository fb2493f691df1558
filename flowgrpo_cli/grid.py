"""Image grids with a caption under each image: prompt, target text and reward."""

from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

CELL = 192  # images are shown at this width; small models' 64 px images are scaled up
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
    caption_height = CAPTION_LINES * LINE_HEIGHT + 6
    cell_height = CELL + caption_height
    canvas = Image.new("RGB", (columns * CELL, rows * cell_height), "white")
    draw = ImageDraw.Draw(canvas)
    for index, item in enumerate(items):
        x, y = (index % columns) * CELL, (index // columns) * cell_height
        image = Image.open(io.BytesIO(item.png)).convert("RGB")
        canvas.paste(image.resize((CELL, CELL * image.height // image.width)), (x, y))
        reward = "-" if item.reward is None else f"{item.reward:.3f}"
        lines = [f"target: {item.target}", f"reward: {reward}"]
        lines += textwrap.wrap(item.prompt, width=34)[: CAPTION_LINES - len(lines)]
        for n, line in enumerate(lines):
            draw.text((x + 4, y + CELL + 3 + n * LINE_HEIGHT), line, fill="black", font=font)
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()
