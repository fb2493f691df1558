"""Write the editing sample: flat-coloured shapes on plain backgrounds and one instruction each.

    python examples/edit/make_edits.py      # rewrites the jsonl files and images/

A format sample for the editing recipes (examples/flux_kontext.toml; counting_*.jsonl for
examples/qwenimage_edit.toml), small enough to keep in
the repository: each row of the jsonl files names its source image by a path relative to the
file, the layout `flowgrpo prepare` reads (docs/stages.md). Deterministic: the same files on
every run. Train on a real editing data set instead (see README.md).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
SIZE = 256
COLOURS = {
    "red": (200, 40, 40), "blue": (40, 70, 200), "green": (40, 150, 60),
    "yellow": (230, 200, 40), "purple": (130, 60, 160), "orange": (235, 130, 30),
}  # fmt: skip
BACKGROUNDS = {"white": (245, 245, 240), "grey": (150, 150, 150), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")


def draw(shape: str, colour: str, background: str) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), BACKGROUNDS[background])
    pen = ImageDraw.Draw(image)
    low, high = SIZE // 4, 3 * SIZE // 4
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse((low, low, high, high), fill=fill)
    elif shape == "square":
        pen.rectangle((low, low, high, high), fill=fill)
    else:
        pen.polygon([(SIZE // 2, low), (high, high), (low, high)], fill=fill)
    return image


def instruction(rng: random.Random, shape: str, colour: str, background: str) -> str:
    other_colour = rng.choice([c for c in COLOURS if c != colour])
    other_shape = rng.choice([s for s in SHAPES if s != shape])
    other_background = rng.choice([b for b in BACKGROUNDS if b != background])
    return rng.choice(
        [
            f"Make the {colour} {shape} {other_colour}.",
            f"Turn the {shape} into a {colour} {other_shape}.",
            f"Change the {background} background to {other_background}.",
            f"Add a small {other_colour} {other_shape} in the top left corner.",
            f"Remove the {colour} {shape} and keep the {background} background.",
        ]
    )


# Counting edits, as flow_grpo's counting-edit task asks them: each row is a GenEval counting
# record (what `geneval` scores the result against) with the source image beside it.
COUNTS = ("two", "three", "four")
OBJECTS = (("apple", "apples"), ("orange", "oranges"), ("sports ball", "sports balls"))


def counting_row(rng: random.Random, image: str) -> dict:
    number = rng.randrange(len(COUNTS))
    count = number + 2
    name, plural = rng.choice(OBJECTS)
    prompt = f"Replace the shape with {COUNTS[number]} {plural}."
    return {
        "tag": "counting",
        "include": [{"class": name, "count": count}],
        "exclude": [{"class": name, "count": count + 1}],
        "prompt": prompt,
        "image": image,
    }


def main() -> None:
    rng, counting_rng = random.Random(0), random.Random(1)
    (HERE / "images").mkdir(exist_ok=True)
    for split, count in (("train", 12), ("test", 4)):
        rows = []
        for i in range(count):
            shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
            background = rng.choice(list(BACKGROUNDS))
            name = f"images/{split}-{i:03d}.png"
            draw(shape, colour, background).save(HERE / name, optimize=True)
            rows.append({"prompt": instruction(rng, shape, colour, background), "image": name})
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (HERE / f"{split}.jsonl").write_text(lines)
        counting = [counting_row(counting_rng, row["image"]) for row in rows]
        lines = "".join(json.dumps(row) + "\n" for row in counting)
        (HERE / f"counting_{split}.jsonl").write_text(lines)


if __name__ == "__main__":
    main()
