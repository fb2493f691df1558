"""Copy a pre-training checkpoint into the committed base folder, weights in float16.

float16 halves the folder (15 MB -> 7.5 MB) for a rounding of the weights of about 5e-4
relative; flowgrpo loads it as float32 (model.dtype) and every number in the docs was
measured on this exported folder, not on the float32 checkpoint.

Run:
    python examples/toy_ocr/export_base.py runs/toy-ocr-pretrain/checkpoints/step-02750 \\
        examples/toy_ocr/base
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch


def export(checkpoint: Path, out: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    if not (checkpoint / "model_index.json").is_file():
        raise SystemExit(f"{checkpoint} is not a pipeline folder (no model_index.json)")
    pipeline = StableDiffusion3Pipeline.from_pretrained(checkpoint, dtype=torch.float16)
    shutil.rmtree(out, ignore_errors=True)
    pipeline.save_pretrained(out, safe_serialization=True)
    shutil.copy(checkpoint / "pretraining.json", out / "pretraining.json")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoints/step-NNNNN of pretrain.py")
    parser.add_argument("out", type=Path, help="Folder to (re)write.")
    args = parser.parse_args(argv)
    export(args.checkpoint, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
