"""Targets and prompts of the toy OCR task: 3-4 symbols, rendered black on white at 32x96.

Targets are drawn from 28 symbols that Pillow's built-in font keeps apart (A-Z and 0-9 without
the look-alikes O/0, I/1/L, S/5 and Q). Each prompt wraps its target in double quotes, as the
OCR reward expects. One fixed seed draws the held-out targets first, then the pre-training
targets, all distinct, so the two never share a target.

Writes prompts/train.txt (the first N_TRAIN_FILE pre-training targets) and prompts/test.txt
(the held-out targets) next to this file; pretrain.py draws the same lists in memory.

Run (standard library only, output is byte-identical on every run):
    python examples/toy_ocr/toy_prompts.py
"""

from __future__ import annotations

import random
from pathlib import Path

ALPHABET = "ABCDEFGHJKMNPRTUVWXYZ2346789"
LENGTHS = (3, 4)
TEMPLATES = (
    'A sign that says "{}"',
    'A poster reading "{}"',
    'A label with the text "{}"',
    'Black letters spelling "{}"',
    'A white card printed with "{}"',
)
SEED = 20261209
N_TEST = 100
N_PRETRAIN = 20_000
N_TRAIN_FILE = 2_000
PROMPT_DIR = Path(__file__).resolve().parent / "prompts"


def draw_targets(n_test: int = N_TEST, n_train: int = N_PRETRAIN) -> tuple[list[str], list[str]]:
    """(held-out, pre-training) targets: distinct strings, lengths 3 and 4 equally likely."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    targets: list[str] = []
    while len(targets) < n_test + n_train:
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.choice(LENGTHS)))
        if text not in seen:
            seen.add(text)
            targets.append(text)
    return targets[:n_test], targets[n_test:]


def prompt_for(target: str, template: int) -> str:
    return TEMPLATES[template % len(TEMPLATES)].format(target)


def file_prompts(targets: list[str]) -> list[str]:
    """One prompt per target, the templates taken in turn: what the prompt files hold."""
    return [prompt_for(target, i) for i, target in enumerate(targets)]


def write_prompt_files(out_dir: Path = PROMPT_DIR) -> tuple[Path, Path]:
    test, train = draw_targets()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.txt", out_dir / "test.txt"
    for path, targets in zip(paths, (train[:N_TRAIN_FILE], test), strict=True):
        text = "".join(f"{line}\n" for line in file_prompts(targets))
        path.write_text(text, encoding="utf-8", newline="\n")
    return paths


if __name__ == "__main__":
    for path in write_prompt_files():
        print(f"wrote {path} ({len(path.read_text().splitlines())} prompts)")
