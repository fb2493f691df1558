"""Disk per iteration of everything a run writes, and for a whole run under its retention.

Exact where the format fixes the size (float32 latents and conditioning, safetensors of the
trained weights and AdamW's moments); upper bounds where it does not (PNG images: 3 bytes a
pixel, what an image of noise takes, which no compression shrinks); estimates for the small
files (ids, per-step columns, scores, metrics, manifests), whose sizes are a few hundred
bytes an image or a few kB an iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowgrpo_cli.planning.architectures import Architecture
from flowgrpo_cli.planning.memory import Shapes, cfg_layout, evaluation_prompts
from flowgrpo_cli.reporting.grid import (
    CAPTION_LINES,
    CELL,
    GRID_GROUPS,
    GRID_PER_GROUP,
    LINE_HEIGHT,
)
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.training.algorithms import algorithm_for

NPY_HEADER = 128  # np.save's header of each conditioning cell
ROW_BYTES = 200  # a rollout row's ids, prompt and target text, Arrow offsets (estimate)
STEP_BYTES = 13  # per stochastic step: sigma, next sigma, log-prob (float32) and `trained`
SCORE_ROW_BYTES = 40  # sample_id and Arrow offsets of a score row, plus 8 bytes per reward
ADVANTAGE_ROW_BYTES = 50  # advantages.arrow: sample_id, group, reward, advantage
ITERATION_FILES = 20_000  # metrics.json, four manifests, the metrics.jsonl line (estimate)
SAFETENSORS_ENTRY = 120  # header bytes per tensor of a safetensors file (name, dtype, shape)


@dataclass(frozen=True)
class DiskItem:
    label: str
    per_iteration: int
    run_total: int


def png_upper_bound(height: int, width: int) -> int:
    """Bytes of an RGB PNG that does not compress at all: 3 bytes a pixel, a filter byte a
    row, the chunks' headers (the bound benchmarks/disk_projection.py measures on noise)."""
    return 3 * height * width + height + 200


def grid_bytes(height: int, width: int, items: int) -> int:
    """samples/iter-N.png (reporting.grid): `items` images CELL px wide at 3 bytes a pixel
    (the bound), their white caption strips at a quarter byte a pixel (an estimate)."""
    image = CELL * (CELL * height // width)
    caption = CELL * (CAPTION_LINES * LINE_HEIGHT + 6)
    return items * (3 * image + caption // 4) + 1_000


def checkpoint_bytes(config: Config, s: Shapes) -> tuple[int, int]:
    """(weights file, optimizer file) of one checkpoint (training.trainer.save)."""
    # + the LoRA config diffusers reads, as JSON metadata (training.policy.write_weights)
    weights = s.trained * s.trained_bytes + s.trained_tensors * SAFETENSORS_ENTRY + 2_000
    # exp_avg and exp_avg_sq in the weights' dtype, and a float32 `step` per tensor
    optimizer = 2 * s.trained * s.trained_bytes + s.trained_tensors * (4 + 3 * SAFETENSORS_ENTRY)
    return weights, optimizer


def disk_items(
    config: Config, arch: Architecture, s: Shapes, iterations: int
) -> tuple[list[DiskItem], list[str]]:
    """Every kind of file a run writes: bytes per iteration and for `iterations` under
    run.keep_trajectories / run.keep_checkpoints / run.checkpoint_every; plus notes on what
    is assumed."""
    from flowgrpo_cli.stages.rollout import latent_bytes_per_iteration

    algorithm = config.algorithm
    images = algorithm.group_size * algorithm.prompts_per_iteration
    n = iterations
    notes = []
    shape = arch.latent_shape(config.model.height, config.model.width)
    latents = latent_bytes_per_iteration(config, shape)
    per_forward, forwards = cfg_layout(arch, config.sampler.guidance_scale)
    negative = 2 if per_forward * forwards > 1 else 1
    # embeddings + pooled (Qwen-Image: + mask) per prompt and negative; an edit family's
    # source latents once per prompt
    cells = 2 * negative + (s.source_elements > 0)
    conditioning = algorithm.prompts_per_iteration * (
        s.conditioning(negative) * 4 + cells * NPY_HEADER
    )
    keep = config.run.keep_trajectories
    kept = n if keep < 0 else min(n, keep + 1)  # the kept ones and the one in progress
    method = algorithm_for(config)
    steps = sum(method.step_schedule(0).stochastic) if method.needs_trajectory else 0
    png = png_upper_bound(config.model.height, config.model.width)
    rows = images * (png + ROW_BYTES + STEP_BYTES * steps)
    rewards = len(config.reward.weights) + 1
    scores = images * (SCORE_ROW_BYTES + 8 * rewards)
    small = images * ADVANTAGE_ROW_BYTES + ITERATION_FILES
    weights, optimizer = checkpoint_bytes(config, s)
    copies = 1 + (config.train.ema_decay > 0) + (method.default_anchor_decay is not None)
    checkpoint = copies * weights + optimizer + 2_000
    from flowgrpo_cli.store.retention import kept_checkpoints

    keep_checkpoints, every = config.run.keep_checkpoints, config.run.checkpoint_every
    # what stays at the end, plus the previous latest, kept until the next update finishes,
    # plus the best held-out evaluation's, which retention keeps whatever the limits
    best = 1 if config.eval.every > 0 else 0
    checkpoints = min(n, len(kept_checkpoints(n, keep_checkpoints, every)) + 1 + best)

    cells = min(GRID_GROUPS, algorithm.prompts_per_iteration) * min(
        GRID_PER_GROUP, algorithm.group_size
    )
    grid = grid_bytes(config.model.height, config.model.width, cells)
    trackers = grid if "tensorboard" in config.log.trackers else 0
    what = "LoRA weights" if config.train.mode == "lora" else "transformer weights"
    copies_note = " + EMA" * (config.train.ema_decay > 0) + " + anchor" * (
        copies - 1 - (config.train.ema_decay > 0)
    )
    items = [
        DiskItem(
            f"trajectory latents (float32, {steps + 1} state(s) per image; kept for "
            f"{kept} iteration(s): run.keep_trajectories = {keep})",
            latents,
            latents * kept,
        ),
        DiskItem(
            f"{s.conditioning_name} (float32, once per prompt"
            f"{' + negative' if negative > 1 else ''}; kept as the latents)",
            conditioning,
            conditioning * kept,
        ),
        DiskItem(
            f"{images} images (PNG, at most 3 bytes/pixel) and their rollout rows", rows, rows * n
        ),
        DiskItem(
            "scores, advantages, metrics, manifests (estimate)",
            scores + small,
            (scores + small) * n,
        ),
        DiskItem(
            f"checkpoint: {what}{copies_note} ({s.trained / 1e6:,.1f}M x "
            f"{'float32' if s.trained_bytes == 4 else config.model.dtype}), AdamW state "
            f"(kept: {'all' if every == 1 else f'every {every}-th and the latest'}"
            f"{'' if keep_checkpoints == 0 else f', at most {keep_checkpoints}'}"
            f"{' + the best evaluated' if best else ''})",
            checkpoint,
            checkpoint * checkpoints,
        ),
        DiskItem(
            "sample grid samples/iter-N.png" + (" (+ its copy in TensorBoard)" if trackers else ""),
            grid + trackers,
            (grid + trackers) * n,
        ),
    ]
    if config.eval.every:
        prompts, source = evaluation_prompts(config)
        evaluations = n // config.eval.every + 1
        from flowgrpo_cli.stages.evaluate import GRID_IMAGES

        eval_grid = grid_bytes(config.model.height, config.model.width, min(prompts, GRID_IMAGES))
        eval_trackers = eval_grid if trackers else 0
        one = prompts * (png + ROW_BYTES) + eval_grid + eval_trackers + ITERATION_FILES
        items.append(
            DiskItem(
                f"evaluation every {config.eval.every}: {prompts} images ({source}) + grid",
                math.ceil(one / config.eval.every),
                one * evaluations,
            )
        )
        if source.startswith("assumed"):
            notes.append(f"evaluation prompts: {source}")
    return items, notes
