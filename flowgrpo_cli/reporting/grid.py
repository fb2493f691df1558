"""Image grids with a caption under each image: prompt, target text and reward. An editing
run's grids start each row with the source image its results edit (`edit_cells`)."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

CELL = 192  # images are shown at this width; small models' 64 px images are scaled up
# The training grid of each iteration, samples/iter-N.png: the first images of the first groups.
GRID_GROUPS, GRID_PER_GROUP = 4, 4
CAPTION_LINES = 5
LINE_HEIGHT = 13
SOURCE_CAPTION = "source image"


@dataclass(frozen=True)
class GridItem:
    png: bytes
    prompt: str
    target: str
    reward: float | None
    source: bool = False  # an edit's source image: captioned SOURCE_CAPTION and its prompt


def edit_cells(
    rows: Sequence[tuple[bytes, Sequence[GridItem]]], width: int
) -> list[GridItem | None]:
    """The cells of an editing run's grid, drawn `width + 1` to a row: each row its source
    image (PNG) and then its results, blank cells after fewer than `width` of them."""
    cells: list[GridItem | None] = []
    for source, results in rows:
        if not results or len(results) > width:
            raise ValueError(f"a row holds 1 to {width} results, not {len(results)}")
        cells.append(GridItem(source, results[0].prompt, "", None, source=True))
        cells += [*results, *[None] * (width - len(results))]
    return cells


def make_grid(items: Sequence[GridItem | None], columns: int = 4) -> bytes:
    """A PNG of the items in rows of `columns`, each with its caption below (None: a blank
    cell)."""
    if not any(items):
        raise ValueError("make_grid needs at least one image")
    font = ImageFont.load_default(size=11)
    rows = (len(items) + columns - 1) // columns
    images = [None if item is None else Image.open(io.BytesIO(item.png)).convert("RGB")
              for item in items]  # fmt: skip
    # Every image at the cell width; rows as tall as the tallest (a 32x96 image is 64 px).
    image_height = max(CELL * image.height // image.width for image in images if image)
    caption_height = CAPTION_LINES * LINE_HEIGHT + 6
    cell_height = image_height + caption_height
    canvas = Image.new("RGB", (columns * CELL, rows * cell_height), "white")
    draw = ImageDraw.Draw(canvas)
    for index, (item, image) in enumerate(zip(items, images, strict=True)):
        if item is None or image is None:
            continue
        x, y = (index % columns) * CELL, (index // columns) * cell_height
        canvas.paste(image.resize((CELL, CELL * image.height // image.width)), (x, y))
        if item.source:
            lines = [SOURCE_CAPTION]
        else:
            reward = "-" if item.reward is None else f"{item.reward:.3f}"
            lines = [f"target: {item.target}", f"reward: {reward}"]
        lines += textwrap.wrap(item.prompt, width=34)[: CAPTION_LINES - len(lines)]
        top = y + image_height + 3
        for n, line in enumerate(lines):
            draw.text((x + 4, top + n * LINE_HEIGHT), line, fill="black", font=font)
    out = io.BytesIO()
    canvas.save(out, format="PNG")
    return out.getvalue()
