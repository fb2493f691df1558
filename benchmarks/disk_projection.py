"""Disk of a 1,000-iteration run of examples/sd35m_ocr.toml, with and without retention.

    python -m benchmarks.disk_projection          # `just disk-projection`; about a minute

Measured on the tiny SD3 model, scaled to the real shapes: one rollout of the tiny model with
the example's sampler and algorithm settings (64x64 images, 2 prompts x 4 images), then

- trajectory latents: the measured bytes per latent element (4: float32) x SD3.5-M's latent
  (16 x 64 x 64 at 512 px) x the states stored per image (num_steps + 1);
- conditioning: the measured bytes per element x SD3.5-M's text conditioning per prompt
  (CLIP + T5 embeddings [77 + 256, 4096] and the pooled [2048], each with its negative for
  CFG);
- images: an upper bound, the rollout's PNG encoding of a 512 x 512 image of uniform noise
  (which no compression shrinks; any real image is smaller), plus the measured per-image bytes
  of every other column (ids, prompt, per-step sigmas and log-probs);
- scores, advantages, metrics: measured per image.

Checkpoints are not counted (one per iteration: the LoRA weights and the optimizer state).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sd35m_ocr.toml"
ITERATIONS = 1000
REAL_LATENT = (16, 64, 64)  # SD3.5-M's VAE latent at 512 x 512
CLIP_TOKENS, SD3_T5_TOKENS, JOINT_DIM, POOLED_DIM = 77, 256, 4096, 2048  # the pipeline's


def measure(workdir: Path) -> dict[str, float]:
    """Bytes per latent element, per conditioning element and per image (the rest), from one
    tiny rollout and its scores; PNG bytes per pixel at most, from an image of noise."""
    import io

    import numpy as np
    import pyarrow as pa
    import torch

    from flowgrpo_cli.engines import build_engine
    from flowgrpo_cli.models import to_png
    from flowgrpo_cli.models.tiny import build_tiny_pipeline
    from flowgrpo_cli.stages import prepare, rollout, score
    from flowgrpo_cli.store.config import dumps_config, load_config
    from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, RunDir
    from flowgrpo_cli.store.trajectory import open_part
    from flowgrpo_cli.training.policy import load_policy

    model = build_tiny_pipeline("sd35", workdir / "tiny-sd35", seed=0)
    prompts = workdir / "prompts.txt"
    prompts.write_text('A sign that says "OPEN"\nA mug with "42" on it\n')
    run = RunDir(workdir / "run")
    config = load_config(EXAMPLE, [
        f"run.dir={run.root}", f"data.train={prompts}", f"data.test={prompts}",
        f"model.path={model}", "model.dtype=float32", "model.device=cpu", "model.height=64",
        "model.width=64", "algorithm.group_size=4", "algorithm.prompts_per_iteration=2",
        "reward.weights={jpeg_compressibility = 1.0}",
    ])  # fmt: skip
    run.root.mkdir(parents=True)
    run.config_path.write_text(dumps_config(config))
    prepare.run(config, run)
    policy = load_policy(config, torch.device("cpu"))
    rollout.run(config, run, 0, build_engine(config, policy))
    score.run(config, run, 0)

    folder = run.stage_dir(0, ROLLOUT)
    table = pa.concat_tables(
        open_part(p).read_all() for p in sorted(folder.glob("part-*.arrow"))
    )  # fmt: skip
    images = table.num_rows
    latent_elements = math.prod(table.column("latents").type.shape) * images
    latent_bytes = table.column("latents").nbytes
    png_bytes = sum(len(b) for b in table.column("image").to_pylist())
    part_bytes = sum(p.stat().st_size for p in folder.glob("part-*.arrow"))
    conditioning = pa.concat_tables(
        open_part(p).read_all() for p in sorted(folder.glob("conditioning-*.arrow"))
    )  # fmt: skip
    cond_elements = cond_bytes = 0
    for name in conditioning.column_names:
        if name == "group_id":
            continue
        for cell in conditioning.column(name).to_pylist():
            array = np.load(io.BytesIO(cell), allow_pickle=False)
            cond_elements += array.size
            cond_bytes += len(cell)
    scores = sum(p.stat().st_size for p in run.stage_dir(0, SCORE).glob("*.arrow"))
    noise = torch.rand((1, 3, 512, 512), generator=torch.Generator().manual_seed(0))
    return {
        "latent_bytes_per_element": latent_bytes / latent_elements,
        "conditioning_bytes_per_element": cond_bytes / cond_elements,
        "png_bytes_per_pixel": len(to_png(noise)[0]) / (512 * 512),
        "other_bytes_per_image": (part_bytes - latent_bytes - png_bytes) / images,
        "score_bytes_per_image": scores / images,
    }


def project(measured: dict[str, float]) -> list[tuple[str, str, str]]:
    """(what, per iteration, 1,000 iterations) rows for docs/run-directory.md."""
    from flowgrpo_cli.reporting.render import format_bytes
    from flowgrpo_cli.store.config import load_config

    config = load_config(EXAMPLE)
    images = config.algorithm.group_size * config.algorithm.prompts_per_iteration
    groups = config.algorithm.prompts_per_iteration
    states = config.sampler.num_steps + 1  # every step of the example is stochastic
    latents = images * states * math.prod(REAL_LATENT) * measured["latent_bytes_per_element"]
    tokens = CLIP_TOKENS + (config.model.max_sequence_length or SD3_T5_TOKENS)
    per_prompt = 2 * (tokens * JOINT_DIM + POOLED_DIM)  # with the negative prompt's, for CFG
    conditioning = groups * per_prompt * measured["conditioning_bytes_per_element"]
    pixels = config.model.height * config.model.width
    kept = images * (
        pixels * measured["png_bytes_per_pixel"]
        + measured["other_bytes_per_image"]
        + measured["score_bytes_per_image"]
    )
    trajectories = latents + conditioning
    keep = 2  # the default run.keep_trajectories; +1 for the iteration in progress
    return [
        ("trajectory latents", format_bytes(latents), format_bytes(latents * ITERATIONS)),
        ("text conditioning", format_bytes(conditioning), format_bytes(conditioning * ITERATIONS)),
        ("images, scores, the rest", format_bytes(kept), format_bytes(kept * ITERATIONS)),
        ("total, keep_trajectories = -1 (keep all)", format_bytes(trajectories + kept),
         format_bytes((trajectories + kept) * ITERATIONS)),
        (f"total, keep_trajectories = {keep} (the default)", "",
         format_bytes(trajectories * (keep + 1) + kept * ITERATIONS)),
    ]  # fmt: skip


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="flowgrpo-disk-") as scratch:
        measured = measure(Path(scratch))
    print("measured: " + ", ".join(f"{k} {v:.3g}" for k, v in measured.items()))
    print(f"\n| {EXAMPLE.name}, 512 px | per iteration | {ITERATIONS:,} iterations |")
    print("|---|---|---|")
    for row in project(measured):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
