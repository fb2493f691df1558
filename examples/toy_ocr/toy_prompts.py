"""Targets and prompts of the toy OCR task: 3-4 symbols, rendered black on white at 32x96.

Targets are drawn from 28 symbols that Pillow's built-in font keeps apart (A-Z and 0-9 without
the look-alikes O/0, I/1/L, S/5 and Q). Each prompt wraps its target in double quotes, as the
OCR reward expects. One fixed seed draws the held-out targets first, then the pre-training
targets, all distinct, so the two never share a target.

Writes prompts/train.txt (the first N_TRAIN_FILE pre-training targets), prompts/test.txt (the
held-out targets) and prompts/val.txt (N_VAL validation targets, drawn after the pre-training
ones: like the held-out targets never seen in pre-training, and kept apart from them so that RL
settings are chosen without looking at the held-out score) and prompts/rl.txt (N_RL targets
after those: RL prompts no pre-training image was drawn for) next to this file; pretrain.py
draws the same lists in memory.

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
N_VAL = 100
N_RL = 2_000
PROMPT_DIR = Path(__file__).resolve().parent / "prompts"


def _draw(count: int) -> list[str]:
    """The first `count` targets of the fixed sequence: distinct strings, lengths 3 and 4
    equally likely (a longer draw extends a shorter one)."""
    rng = random.Random(SEED)
    seen: set[str] = set()
    targets: list[str] = []
    while len(targets) < count:
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.choice(LENGTHS)))
        if text not in seen:
            seen.add(text)
            targets.append(text)
    return targets


def draw_targets(n_test: int = N_TEST, n_train: int = N_PRETRAIN) -> tuple[list[str], list[str]]:
    """(held-out, pre-training) targets."""
    targets = _draw(n_test + n_train)
    return targets[:n_test], targets[n_test:]


def draw_validation_targets(n_val: int = N_VAL) -> list[str]:
    """Validation targets: the next ones after the default pre-training draw."""
    return _draw(N_TEST + N_PRETRAIN + n_val)[-n_val:]


def draw_rl_targets(n_rl: int = N_RL) -> list[str]:
    """RL-only targets: the next ones after the validation targets, so no image of them was
    ever trained on, as for the held-out ones."""
    return _draw(N_TEST + N_PRETRAIN + N_VAL + n_rl)[-n_rl:]


def prompt_for(target: str, template: int) -> str:
    return TEMPLATES[template % len(TEMPLATES)].format(target)


def file_prompts(targets: list[str]) -> list[str]:
    """One prompt per target, the templates taken in turn: what the prompt files hold."""
    return [prompt_for(target, i) for i, target in enumerate(targets)]


def write_prompt_files(out_dir: Path = PROMPT_DIR) -> tuple[Path, ...]:
    test, train = draw_targets()
    out_dir.mkdir(parents=True, exist_ok=True)
    names = "train.txt", "test.txt", "val.txt", "rl.txt"
    paths = tuple(out_dir / name for name in names)
    chosen = train[:N_TRAIN_FILE], test, draw_validation_targets(), draw_rl_targets()
    for path, targets in zip(paths, chosen, strict=True):
        text = "".join(f"{line}\n" for line in file_prompts(targets))
        path.write_text(text, encoding="utf-8", newline="\n")
    return paths


if __name__ == "__main__":
    for path in write_prompt_files():
        print(f"wrote {path} ({len(path.read_text().splitlines())} prompts)")
