"""Score a toy OCR pipeline on the held-out prompts, and how much a GRPO group would learn.

For each CFG scale: exact match and mean OCR reward of one image per prompt (the same noise as
pretrain.py's evaluations), then --group-size images per prompt with fresh noise: the share of
groups whose rewards differ (a group of equal rewards has zero advantage and teaches nothing),
the mean reward spread (standard deviation) within a group, and the share of groups with at
least one exact image.

Run (a base folder, optionally with a LoRA checkpoint of `flowgrpo update` loaded into it
through diffusers' own load_lora_weights):
    python examples/toy_ocr/evaluate.py examples/toy_ocr/base
    python examples/toy_ocr/evaluate.py examples/toy_ocr/base \
        --lora runs/toy-ocr/checkpoints/iter-000059
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from pretrain import EVAL_GUIDANCE, render_and_read
from toy_prompts import draw_targets, file_prompts

EVAL_SEED = 10_000  # pretrain.py's evaluations draw prompt i's noise from EVAL_SEED + i
GROUP_SEED = 20_000


def score(
    folder: Path,
    guidance_scales: Sequence[float],
    group_size: int,
    lora: Path | None = None,
    num_prompts: int = 100,
) -> dict[str, float]:
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(folder, dtype=torch.float32)
    if lora is not None:
        pipeline.load_lora_weights(lora)
    pipeline.set_progress_bar_config(disable=True)
    targets, _ = draw_targets()
    targets = targets[:num_prompts]
    prompts = file_prompts(targets)
    out: dict[str, float] = {}
    for guidance in guidance_scales:
        tag = f"cfg{guidance:g}"
        seeds = [EVAL_SEED + i for i in range(len(prompts))]
        reads = render_and_read(pipeline, prompts, targets, guidance_scale=guidance, seeds=seeds)
        out[f"exact_{tag}"] = statistics.fmean(r.exact for r in reads)
        out[f"reward_{tag}"] = statistics.fmean(r.reward for r in reads)
        if group_size < 2:
            continue
        g = group_size
        seeds = [GROUP_SEED + i for i in range(len(prompts) * g)]
        reads = render_and_read(
            pipeline,
            [p for p in prompts for _ in range(g)],
            [t for t in targets for _ in range(g)],
            guidance_scale=guidance,
            seeds=seeds,
        )
        groups = [reads[i : i + g] for i in range(0, len(reads), g)]
        rewards = [[r.reward for r in group] for group in groups]
        out[f"group_reward_{tag}"] = statistics.fmean(r for group in rewards for r in group)
        out[f"group_exact_{tag}"] = statistics.fmean(r.exact for group in groups for r in group)
        out[f"groups_differing_{tag}"] = statistics.fmean(len(set(r)) > 1 for r in rewards)
        out[f"group_spread_{tag}"] = statistics.fmean(statistics.pstdev(r) for r in rewards)
        out[f"groups_any_exact_{tag}"] = statistics.fmean(
            any(r.exact for r in group) for group in groups
        )
    return {key: round(value, 4) for key, value in out.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="A pipeline folder pretrain.py saved.")
    parser.add_argument("--lora", type=Path, help="A flowgrpo checkpoint folder to load into it.")
    parser.add_argument("--group-size", type=int, default=4, help="Images per prompt; 1 = none.")
    parser.add_argument("--prompts", type=int, default=100, help="Held-out prompts, 1-100.")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default.")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 1 <= args.prompts <= 100:
        parser.error(f"--prompts {args.prompts}: the held-out set has 100 prompts")
    result = score(args.folder, EVAL_GUIDANCE, args.group_size, args.lora, args.prompts)
    print(json.dumps({"model": str(args.folder), "lora": str(args.lora or ""), **result}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
