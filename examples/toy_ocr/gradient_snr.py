"""How much of an update's gradient is signal: per-sample gradients of a finished run's
iterations, through the algorithm's own `backward`, and their signal-to-noise ratio.

For iteration k the policy is put back where that iteration's update started (checkpoint k-1,
anchor and all), and each trained sample's gradient g_i is taken alone, the loss weighted as
the update weights it. With N samples, g = mean g_i is the direction of the iteration's first
optimizer step, and

    SNR = |g|^2 / (tr Cov(g_i) / N)      (the mean's squared length over its own variance)
    split-half cosine = cos(mean of one random half, mean of the other)

An SNR below 1 says the step is mostly noise; a split-half cosine near 0 says two halves of
the same batch disagree on where to go. Adam rescales the step, so its size says little; its
direction is what these measure.

    python examples/toy_ocr/gradient_snr.py runs/overfit-flow_grpo --iterations 0,10,20

The run must keep the iterations' trajectories (`--set run.keep_trajectories=-1`) and their
starting checkpoints (`run.checkpoint_every = 1`, as the toy configs set it).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from flowgrpo_cli.launch.distributed import dist_info
from flowgrpo_cli.stages.update import load_iteration
from flowgrpo_cli.store.runconfig import resolve_run
from flowgrpo_cli.store.rundir import ROLLOUT
from flowgrpo_cli.training.algorithms import algorithm_for
from flowgrpo_cli.training.algorithms.base import MicroBatch, UpdateContext
from flowgrpo_cli.training.policy import checkpoint_for, load_policy, load_weights
from flowgrpo_cli.training.samples import StoredSamples
from flowgrpo_cli.training.trainer import Trainer


def per_sample_gradients(run_dir: Path, iteration: int) -> tuple[str, torch.Tensor]:
    """(algorithm name, [N, P] gradients of the iteration's trained samples, one row each)."""
    resolved = resolve_run(None, [], run_dir, write=False)
    config, run = resolved.config, resolved.run
    policy = load_policy(config, torch.device("cpu"))
    trainer = Trainer(config, policy)
    start = checkpoint_for(run, iteration)
    if start is not None:
        load_weights(policy, start)
        trainer.load(start)
    data = load_iteration(config, run, iteration, trainer.sampling_version())
    rollout_dir = run.stage_dir(iteration, ROLLOUT)
    samples = StoredSamples(rollout_dir, data.rollout, data.locations)
    count = len(data.sample_ids)
    context = UpdateContext(config, iteration, trainer, data.rollout, samples, count)
    algorithm = algorithm_for(config)
    algorithm.begin_update(context)
    policy.transformer.train()
    rows = []
    for index in range(count):
        sample = samples.rows([index])
        batch = MicroBatch(
            indices=[index],
            rows=sample,
            cond=samples.conditioning_of(sample, policy.device),
            advantages=data.advantages[[index]],
            batch_size=1,
            world_size=dist_info().world_size,
            epoch=0,
            real=True,
        )
        algorithm.backward(context, batch, None)
        grads = [p.grad.flatten() for p in trainer.parameters.values() if p.grad is not None]
        rows.append(torch.cat(grads).clone())
        trainer.optimizer.zero_grad(set_to_none=True)
    return config.algorithm.name, torch.stack(rows)


def signal_to_noise(grads: torch.Tensor, seed: int = 0) -> dict[str, float]:
    n = grads.shape[0]
    mean = grads.mean(dim=0)
    noise = ((grads - mean) ** 2).sum(dim=1).mean() * n / (n - 1)  # tr Cov, unbiased
    order = list(range(n))
    random.Random(seed).shuffle(order)
    half_a, half_b = grads[order[: n // 2]].mean(0), grads[order[n // 2 :]].mean(0)
    cosine = torch.nn.functional.cosine_similarity(half_a, half_b, dim=0)
    return {
        "samples": float(n),
        "snr": float(mean.square().sum() / (noise / n)),
        "split_half_cosine": float(cosine),
        "mean_grad_norm": float(mean.norm()),
        "per_sample_grad_norm": float(grads.norm(dim=1).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders")
    parser.add_argument("--iterations", default="0", help="comma-separated, e.g. 0,10,20")
    parser.add_argument("--out", type=Path, help="append one JSON line per measurement here")
    args = parser.parse_args()
    torch.manual_seed(0)
    for run_dir in args.runs:
        for iteration in (int(k) for k in args.iterations.split(",")):
            name, grads = per_sample_gradients(run_dir, iteration)
            line = {"run": str(run_dir), "algorithm": name, "iteration": iteration,
                    **signal_to_noise(grads)}  # fmt: skip
            print(json.dumps(line), flush=True)
            if args.out:
                with args.out.open("a") as out:
                    out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
