"""Advantage Weighted Matching's loss (Xue et al. 2025), as its authors' train_sd3_awm.py
computes it.

The log-likelihood of a sample is replaced by a weighted flow-matching loss at a re-noised
x_t = (1 - t) x0 + t eps: with m = mean((v - (eps - x0))^2) and p = algorithm.awm_power
(their generalised-Huber weighting, 0.25),

    logp = -((m + 1e-10)^p - (1e-10)^p) t / p

and the policy gradient is the advantage-weighted gradient of it, A' = clip(A, -c, c) / c,
times algorithm.awm_negative_weight where A < 0 (1, the paper's, unless set):

    pg = mean_b[ -A' exp(logp - sg(logp)) ]       (= -A' logp in value of its gradient)
    loss = pg + beta mean((v - v_ref)^2) + anchor_kl mean((v - v_anchor)^2)

The reference writes pg as PPO's clipped objective with the old log-prob taken from the same
forward (its default, on-policy), so the ratio is exactly 1 and the clip never acts; this is
that objective without the clip that cannot bind. A positive advantage lowers the sample's
flow-matching error (pulls v toward eps - x0); a negative one raises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo_cli.algorithm.forward import velocity_kl
from flowgrpo_cli.algorithm.loss import LossTerms, mean_folds
from flowgrpo_cli.errors import FlowGrpoError

_HUBER_EPS = 1e-10


@dataclass(frozen=True)
class AwmOutput(LossTerms):
    """loss = pg_loss + beta kl + anchor_kl kl_anchor (with grad); kl = mean((v - v_ref)^2),
    0 without a reference (detached, as the rest)."""

    pg_loss: torch.Tensor  # with grad (its value is -mean A', its gradient the method's)
    kl_anchor: torch.Tensor  # mean((v - v_anchor)^2); 0 without an anchor
    fm_loss: torch.Tensor  # mean m, the plain flow-matching error
    log_prob: torch.Tensor  # mean logp


AWM_FOLDS = mean_folds(AwmOutput)


def awm_log_prob(
    v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, power: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [B], m [B]): logp = -((m + eps)^p - eps^p) t / p, m = mean((v - target)^2) per
    sample."""
    m = ((v.float() - target.detach().float()) ** 2).mean(dim=tuple(range(1, v.ndim)))
    return -((m + _HUBER_EPS) ** power - _HUBER_EPS**power) * t.float() / power, m


def awm_loss(
    v: torch.Tensor,
    target: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    power: float,
    advantage_clip: float,
    negative_weight: float = 1.0,
    beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    anchor_kl: float = 0.0,
    v_anchor: torch.Tensor | None = None,
) -> AwmOutput:
    """The loss of one noise level for a batch: v, target = eps - x0 [B, ...]; t, A [B]."""
    if beta > 0 and v_ref is None:
        raise FlowGrpoError(f"beta={beta} needs the reference velocity v_ref")
    if anchor_kl > 0 and v_anchor is None:
        raise FlowGrpoError(f"anchor_kl={anchor_kl} needs the anchor's velocity v_anchor")
    log_prob, m = awm_log_prob(v, target, t, power)  # [B]
    weight = advantages.detach().float().clamp(-advantage_clip, advantage_clip) / advantage_clip
    # Raising a sample's flow-matching error has no floor, unlike lowering it: scaled down,
    # the below-average samples push the policy away from themselves less.
    weight = torch.where(weight < 0, weight * negative_weight, weight)
    pg_loss = (-weight * torch.exp(log_prob - log_prob.detach())).mean()
    zero = torch.zeros((), device=v.device)
    kl = velocity_kl(v, v_ref) if v_ref is not None else zero
    kl_anchor = velocity_kl(v, v_anchor) if v_anchor is not None else zero
    loss = pg_loss
    if beta > 0:
        loss = loss + beta * kl
    if anchor_kl > 0:
        loss = loss + anchor_kl * kl_anchor
    return AwmOutput(
        loss=loss,
        pg_loss=pg_loss,
        kl=kl.detach(),
        kl_anchor=kl_anchor.detach(),
        fm_loss=m.detach().mean(),
        log_prob=log_prob.detach().mean(),
        batch_size=v.shape[0],
    )
