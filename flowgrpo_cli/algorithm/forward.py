"""The forward process the nft and awm losses train on: which noise levels, and the re-noised
latent x_t = (1 - t) x0 + t eps, whose flow-matching target is v* = eps - x0.

Noise levels come from the rollout's own sigma grid (the T sigmas it stepped from), as in both
reference implementations; each sample draws its own from a generator seeded by its id, so
the draws do not depend on which rank or micro-batch the sample lands in.
"""

from __future__ import annotations

import itertools

import torch

from flowgrpo_cli.errors import FlowGrpoError


def nft_timestep_indices(num_steps: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """DiffusionNFT: `count` distinct grid steps in random order (a permutation's first ones)."""
    if not 1 <= count <= num_steps:
        raise FlowGrpoError(
            f"algorithm.train_timesteps = {count}: nft draws distinct steps of the rollout's "
            f"{num_steps}; choose 1..{num_steps}"
        )
    return torch.randperm(num_steps, generator=generator)[:count]


def awm_timestep_indices(num_steps: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """AWM's stratified draw ("discrete_wo_init"): one step from each of `count` strata of
    grid indices [1, int(0.9 T)], bounds linspace(1, int(0.9 T), count + 1) truncated, so
    neither sigma = 1 nor the last tenth of the steps is trained. A stratum that truncation
    left empty gives its lower bound."""
    last = int(num_steps * 0.9)
    if last < 1:
        raise FlowGrpoError(
            f"awm needs at least 2 rollout steps to draw noise levels from, got {num_steps}"
        )
    bounds = torch.linspace(1, last, count + 1).long().tolist()
    picks = []
    for low, high in itertools.pairwise(bounds):
        picks.append(int(torch.randint(low, max(high, low + 1), (1,), generator=generator)))
    return torch.tensor(picks)


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t eps, t [B] per sample, in float32."""
    t = t.float().view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - t) * x0.float() + t * noise.float()


def velocity_kl(v: torch.Tensor, v_other: torch.Tensor) -> torch.Tensor:
    """mean((v - v_other)^2) over every element: the velocity-space KL both methods use."""
    return ((v.float() - v_other.detach().float()) ** 2).mean()
