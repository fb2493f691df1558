"""DiffusionNFT's loss (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with
Forward Process"), as its authors' train_nft_sd3.py computes it.

A reward becomes an optimality probability r = 0.5 + clip(A, -c, c) / (2c) (c = the advantage
clip, 5), in [0, 1]. With v the trained velocity and v_old the sampling policy's (the anchor),
the implicit positive and negative policies are

    v+ = b v + (1 - b) v_old,        v- = (1 + b) v_old - b v          (b = algorithm.nft_beta)

and each is scored by its x0 prediction x0^ = x_t - t v^ against the rollout's clean latent x0,
with the squared error divided by the (stop-gradient) mean absolute error of the same
prediction, an adaptive weight:

    L+ = mean((x0+ - x0)^2) / sg(mean|x0+ - x0|),   L- likewise with v-
    policy = c * mean_b[ r L+ / b + (1 - r) L- / b ]
    loss = policy + beta * mean((v - v_ref)^2)                          (v_ref: LoRA off)

Minimising r L+ pulls v+ (so v) toward the flow-matching target; minimising (1 - r) L- pulls
v- toward it, which pushes v away: a high reward draws the policy to its sample, a low one
pushes it off. Only v carries gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo_cli.algorithm.forward import velocity_kl
from flowgrpo_cli.algorithm.loss import LossTerms, mean_folds
from flowgrpo_cli.errors import FlowGrpoError


@dataclass(frozen=True)
class NftOutput(LossTerms):
    """loss = policy_loss + beta kl (with grad); kl = mean((v - v_ref)^2), 0 without a
    reference."""

    policy_loss: torch.Tensor  # with grad
    loss_positive: torch.Tensor  # mean of L+ (detached, as are the rest)
    loss_negative: torch.Tensor  # mean of L-
    optimality: torch.Tensor  # mean r


# Every field a batch-size-weighted mean over noise levels and micro-batches (LossMetrics).
NFT_FOLDS = mean_folds(NftOutput)


def optimality(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """r = 0.5 + clip(A, -c, c) / (2c), in [0, 1]."""
    return (0.5 + advantages.float().clamp(-clip, clip) / (2.0 * clip)).clamp(0.0, 1.0)


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    nft_beta: float,
    advantage_clip: float,
    beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
) -> NftOutput:
    """The loss of one noise level for a batch: v, v_old, x_t, x0 [B, ...], t and advantages
    [B]. v_old, x_t, x0 and v_ref are data (no gradient reaches them)."""
    if not nft_beta > 0:
        raise FlowGrpoError(f"nft_beta={nft_beta}: must be > 0")
    if beta > 0 and v_ref is None:
        raise FlowGrpoError(f"beta={beta} needs the reference velocity v_ref")
    dims = tuple(range(1, v.ndim))
    v, v_old = v.float(), v_old.detach().float()
    t_row = t.float().view(-1, *([1] * (v.ndim - 1)))
    r = optimality(advantages, advantage_clip)  # [B]

    def scored(prediction: torch.Tensor) -> torch.Tensor:  # [B]
        error = x_t.float() - t_row * prediction - x0.float()  # x0^ - x0
        weight = error.detach().abs().mean(dim=dims).clamp_min(1e-5)
        return (error**2).mean(dim=dims) / weight

    positive = scored(nft_beta * v + (1.0 - nft_beta) * v_old)
    negative = scored((1.0 + nft_beta) * v_old - nft_beta * v)
    per_sample = (r * positive + (1.0 - r) * negative) / nft_beta
    policy_loss = advantage_clip * per_sample.mean()
    kl = velocity_kl(v, v_ref) if v_ref is not None else torch.zeros((), device=v.device)
    loss = policy_loss + beta * kl if beta > 0 else policy_loss
    return NftOutput(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl.detach(),
        loss_positive=positive.detach().mean(),
        loss_negative=negative.detach().mean(),
        optimality=r.mean(),
        batch_size=v.shape[0],
    )
