"""Group-relative advantages: one scalar per image, from the whole iteration's rewards.

A = (r - mean of r's group) / (std + eps), std the population std (ddof 0) of per-image
rewards, or with Bessel's correction (ddof 1, n - 1 in the divisor, as MixGRPO's torch
`.std()`): over the whole iteration on every rank ("global", the paper's default), over the
group ("group"), or not at all ("none", Dr. GRPO: A = r - group mean). A group of one has
nothing to compare with and gets 0. A is clipped to +-clip.

With several rewards, `algorithm.reward_aggregation` says what r is:

- "weighted_sum" (the default): the score stage's weighted total per image, sum_k w_k r_k,
  and A as above (`compute_advantages`);
- "normalize_each" (GDPO, Liu et al. 2026, "Group reward-Decoupled Normalization Policy
  Optimization"): each reward k gets its own group-relative advantage A_k, by the same rule,
  std and eps as above; the weighted sum S = sum_k w_k A_k is then divided by its std over the
  whole iteration (the paper's batch-wise normalisation), and clipped (`normalize_each`). A
  reward that is constant in a group gives A_k = 0 there, as a flat group does above.

The statistics take one reward per image, never a per-timestep expanded tensor: the advantage
of an image must not depend on how many of its steps are trained. The update broadcasts A over
the trained steps afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from flowgrpo_cli.errors import FlowGrpoError

StdMode = Literal["global", "group", "none"]


@dataclass(frozen=True)
class _Groups:
    index: torch.Tensor  # [N] int64: each image's group, renumbered 0..G-1
    sizes: torch.Tensor  # [G] int64

    @property
    def num_groups(self) -> int:
        return self.sizes.numel()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[N] -> [G] per-group sums."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.index, values)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """[N] -> [G] per-group means."""
        return self.sum(values) / self.sizes.to(values.dtype)

    def reduce(self, values: torch.Tensor, op: Literal["amax", "amin"]) -> torch.Tensor:
        """[N] -> [G] per-group max or min."""
        out = torch.zeros(self.num_groups, dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index, values, op, include_self=False)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std_mode: StdMode = "global",
    eps: float = 1e-4,
    clip: float | None = 5.0,
    ddof: int = 0,
) -> torch.Tensor:
    """Advantages [N] float32 for rewards [N] and group ids [N] (the whole iteration's).

    Statistics run in float64 so that a reward of one image cannot shift another's advantage
    by rounding; ``clip=None`` turns clipping off. ``ddof`` 1 divides the summed squares by
    n - 1 instead of n (a single reward, which has none to spare, keeps a std of 0).
    """
    _check_rewards(rewards, group_ids)
    _check_settings(std_mode, eps, clip, ddof)
    advantages = _group_relative(rewards, _group(group_ids), std_mode, eps, ddof)
    return _clipped(advantages, clip)


@dataclass(frozen=True)
class DecoupledAdvantages:
    """What `normalize_each` gives: the advantages trained with, and each reward's own."""

    advantages: torch.Tensor  # [N] float32, clipped
    per_reward: dict[str, torch.Tensor]  # name -> [N] float32: A_k, before weighting


def normalize_each(
    columns: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: torch.Tensor,
    *,
    std_mode: StdMode = "global",
    eps: float = 1e-4,
    clip: float | None = 5.0,
    ddof: int = 0,
) -> DecoupledAdvantages:
    """GDPO's advantages for per-reward columns (name -> rewards [N]) and group ids [N].

    A_k = (r_k - mean of r_k's group) / (std of r_k + eps), with `compute_advantages`'s std
    (`std_mode`, `ddof`) and eps; S = sum_k weights[k] A_k; A = S / (std of S over every
    image + eps), then clipped. The paper also subtracts S's mean over the batch: every A_k sums
    to 0 over each group (its divisor is the same for a whole group), so that mean is 0 and
    subtracting it would only add rounding, and turn the exact 0 of a group flat in every reward
    (which algorithm.drop_zero_advantage leaves out) into a rounding residue.
    """
    if not columns:
        raise FlowGrpoError("normalize_each needs at least one reward column")
    missing = sorted(set(columns) - set(weights))
    if missing:
        raise FlowGrpoError(
            f"reward(s) {missing} have scores but no weight in [reward] weights: the scores "
            "are of another config; score again with this one"
        )
    if std_mode == "none":
        raise FlowGrpoError(
            "std_mode='none' divides by no std, so normalising each reward by its own would be "
            "undone: pass 'group' or 'global'"
        )
    _check_settings(std_mode, eps, clip, ddof)
    groups = _group(group_ids)
    per_reward = {}
    for name, values in columns.items():
        _check_rewards(values, group_ids)
        per_reward[name] = _group_relative(values, groups, std_mode, eps, ddof)  # [N] float64
    weighted = torch.stack([weights[name] * a for name, a in per_reward.items()]).sum(dim=0)
    if not torch.isfinite(weighted).all():  # weights near 1e308
        raise FlowGrpoError(
            "the weighted sum of the rewards' advantages overflows: scale the weights in "
            "[reward] weights down"
        )
    advantages = weighted / _std_of_all(weighted, eps, ddof)  # [N]
    return DecoupledAdvantages(
        advantages=_clipped(advantages, clip),
        per_reward={name: a.to(torch.float32) for name, a in per_reward.items()},
    )


def _check_settings(std_mode: str, eps: float, clip: float | None, ddof: int) -> None:
    if std_mode not in _DENOMINATORS:
        raise FlowGrpoError(f"std_mode={std_mode!r}: must be one of {sorted(_DENOMINATORS)}")
    if ddof not in (0, 1):
        raise FlowGrpoError(f"ddof={ddof}: must be 0 (population std) or 1 (Bessel's)")
    if not eps >= 0.0:
        raise FlowGrpoError(f"eps={eps}: must be >= 0")
    if clip is not None and not clip > 0.0:
        raise FlowGrpoError(f"clip={clip}: must be > 0, or None for no clipping")


def _group_relative(
    rewards: torch.Tensor, groups: _Groups, std_mode: str, eps: float, ddof: int
) -> torch.Tensor:
    """(r - group mean) / the std_mode's denominator, [N] float64, unclipped."""
    r = rewards.to(torch.float64)  # [N]
    centered = r - groups.mean(r)[groups.index]  # [N]; exactly 0 for a group of one
    denominator = _DENOMINATORS[std_mode](r, centered, groups, eps, ddof)
    # Sums of rewards near 1e308, or squares of rewards past 1e154, overflow to inf; an inf
    # std would quietly turn every advantage into 0.
    if not (torch.isfinite(centered).all() and torch.isfinite(denominator).all()):
        raise FlowGrpoError(
            f"rewards up to {r.abs().max().item():.3g} in magnitude overflow the group "
            "statistics; scale the reward down (its weight in [reward] weights)"
        )
    return centered / denominator


def _clipped(advantages: torch.Tensor, clip: float | None) -> torch.Tensor:
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages.to(torch.float32)


def _std_of_all(values: torch.Tensor, eps: float, ddof: int) -> torch.Tensor:
    """The std of every value, plus eps (a scalar)."""
    if values.numel() <= ddof:  # one value: no spread, and nothing to divide by
        return torch.full((), eps, dtype=values.dtype)
    return values.std(correction=ddof) + eps


def _global_std(
    r: torch.Tensor, centered: torch.Tensor, groups: _Groups, eps: float, ddof: int
) -> torch.Tensor:
    return _std_of_all(r, eps, ddof)  # scalar


def _group_std(
    r: torch.Tensor, centered: torch.Tensor, groups: _Groups, eps: float, ddof: int
) -> torch.Tensor:
    # [G]: a group of one has a sum of 0, and keeps a divisor of at least 1
    group_var = groups.sum(centered**2) / (groups.sizes - ddof).clamp(min=1).to(r.dtype)
    return group_var.sqrt()[groups.index] + eps  # [N]


def _no_std(
    r: torch.Tensor, centered: torch.Tensor, groups: _Groups, eps: float, ddof: int
) -> torch.Tensor:
    return torch.ones_like(r)  # Dr. GRPO: no division, so no eps either


_Denominator = Callable[[torch.Tensor, torch.Tensor, _Groups, float, int], torch.Tensor]
_DENOMINATORS: dict[str, _Denominator] = {
    "global": _global_std,
    "group": _group_std,
    "none": _no_std,
}


def data_metrics(
    rewards_by_name: dict[str, torch.Tensor],
    total: torch.Tensor,
    group_ids: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip: float | None = 5.0,
    per_reward_advantages: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """The iteration's data metrics, from the whole iteration's tensors (all [N]).

    reward/{name}_{mean,std,min,max} per reward, reward/{mean,std,min,max} of the weighted
    total, reward/zero_std_group_ratio (groups whose total rewards are all equal, a group of
    one included: they give no learning signal), advantage/{mean,std,min,max},
    advantage/clipped_frac (|A| at the clip) and advantage/zero_frac (A exactly 0: the samples
    the update leaves out under algorithm.drop_zero_advantage). Stds are population stds.
    `per_reward_advantages` (normalize_each's A_k by reward name) adds
    advantage/{name}_{mean,std,min,max}, and a group then counts as flat only when every
    reward is: one flat in the total alone still has a signal.
    """
    metrics: dict[str, float] = {}
    for name, values in rewards_by_name.items():
        metrics.update(_stats(f"reward/{name}_", values))
    metrics.update(_stats("reward/", total))

    groups = _group(group_ids)
    signals = rewards_by_name.values() if per_reward_advantages is not None else [total]
    flat = torch.ones(groups.num_groups, dtype=torch.bool)  # [G]
    for values in signals:
        v = values.to(torch.float64)
        flat &= groups.reduce(v, "amax") == groups.reduce(v, "amin")
    metrics["reward/zero_std_group_ratio"] = flat.double().mean().item()

    metrics.update(_stats("advantage/", advantages))
    for name, values in (per_reward_advantages or {}).items():
        metrics.update(_stats(f"advantage/{name}_", values))
    a = advantages.to(torch.float64)
    clipped = (a.abs() >= clip).double().mean().item() if clip is not None else 0.0
    metrics["advantage/clipped_frac"] = clipped
    metrics["advantage/zero_frac"] = (a == 0).double().mean().item()
    return metrics


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.detach().to(torch.float64)
    return {
        f"{prefix}mean": v.mean().item(),
        f"{prefix}std": v.std(correction=0).item(),
        f"{prefix}min": v.min().item(),
        f"{prefix}max": v.max().item(),
    }


def _group(group_ids: torch.Tensor) -> _Groups:
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return _Groups(index=index, sizes=sizes)


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.ndim != 1:
        raise FlowGrpoError(
            f"rewards has shape {tuple(rewards.shape)}: pass one reward per image, [N] "
            "(expand to timesteps only after computing advantages)"
        )
    if group_ids.shape != rewards.shape:
        raise FlowGrpoError(
            f"group_ids has shape {tuple(group_ids.shape)}, rewards {tuple(rewards.shape)}: "
            "pass one group id per reward"
        )
    if rewards.numel() == 0:
        raise FlowGrpoError("no rewards: an iteration needs at least one scored image")
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise FlowGrpoError(f"group_ids has dtype {group_ids.dtype}: must be an integer dtype")
    bad = (~torch.isfinite(rewards)).sum().item()
    if bad:
        raise FlowGrpoError(
            f"{bad} of {rewards.numel()} rewards are not finite: drop the images whose reward "
            "failed (reward_error) before computing advantages"
        )
