"""GRPO-Guard's RatioNorm and step reweighting ("GRPO-Guard: Mitigating
Implicit Over-Optimization in Flow Matching via Regulated Clipping"), as its authors' code
(flow_grpo PR #175, scripts/train_sd3_GRPO_Guard.py) computes them, with the bias taken per
sample as the first author corrected it (flow_grpo issue #244; Flow-Factory and verl-omni do
the same).

With s the step's std (std_dev_t sqrt(-dt)) and mu, mu_old the step means under the policy
and under the weights that sampled, the log-ratio of a Gaussian step is biased negative by
mean((mu - mu_old)^2) / (2 s^2), and scaled by 1/s, which differs from step to step. RatioNorm
removes both:

    log r = s (logp - logp_old + mean_d((mu - mu_old)^2) / (2 s^2))      = mean_d(eps (mu - mu_old))

(the right side since x_next = mu_old + s eps), and the clipped objective of Flow-GRPO is
taken of r. The policy term of each step is then weighted by 1 / (-dt), which makes the
gradient's scale the same at every step. The KL term, when beta > 0, is Flow-GRPO's, unweighted.
"""

from __future__ import annotations

import torch


def normalized_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """log r [B] of RatioNorm: log-probs and std [B], means [B, ...] (old ones are data)."""
    s = std.detach().float()
    bias = ((mean.float() - old_mean.detach().float()) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return (log_prob.float() - old_log_prob.detach().float() + bias / (2.0 * s**2)) * s


def step_weight(sigma: torch.Tensor, sigma_next: torch.Tensor) -> float:
    """1 / (-dt) of a trained step (one dt for the batch: every sample is at the same step)."""
    return float(1.0 / (sigma - sigma_next).float().mean())
