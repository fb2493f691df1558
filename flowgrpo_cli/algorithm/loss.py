"""The Flow-GRPO policy loss of one trained step, and its metrics.

ratio = exp(logp - logp_old); pg = mean(max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))): PPO's
pessimistic clipped objective, with the tiny eps (1e-4) Flow-GRPO uses because a step's
log-prob moves a lot for a small change of the mean. The KL to the reference policy has the
form of the KL between two Gaussians of equal std d: (mean - ref_mean)^2 / (2 d^2), averaged
over latent elements, then over the batch. loss = pg + beta * kl.

Which d is `algorithm.kl_convention` (see kl_std): the reference code divides by the SDE's
std_dev_t, the exact KL of one step by the step's std = std_dev_t sqrt(-dt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from flowgrpo_cli.algorithm.sde import StepOutput
from flowgrpo_cli.errors import FlowGrpoError


@dataclass(frozen=True)
class LossTerms:
    """What every algorithm's loss output holds (scalar tensors): LossMetrics folds these and
    the fields its `folds` name; the update renames `kl` after the algorithm's convention."""

    loss: torch.Tensor  # to backpropagate, with grad
    kl: torch.Tensor  # 0 without a reference
    batch_size: int


@dataclass(frozen=True)
class LossOutput(LossTerms):
    """Flow-GRPO's loss of one step (loss = pg_loss + beta * kl; kl with grad) and its metrics."""

    pg_loss: torch.Tensor  # with grad
    approx_kl: torch.Tensor  # 0.5 mean(dlogp^2), detached (as are the rest)
    clipfrac: torch.Tensor  # share of samples with |ratio - 1| > eps
    clipfrac_above: torch.Tensor  # ratio > 1 + eps
    clipfrac_below: torch.Tensor  # ratio < 1 - eps
    ratio_mean: torch.Tensor  # of the ratio the clip acts on (GRPO-Guard: normalised)
    raw_ratio_mean: torch.Tensor  # of exp(logp - logp_old) itself
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    log_ratio_max_abs: torch.Tensor  # on-policy gap: ~0 before the first optimizer step


def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    clipped_log_ratio: torch.Tensor | None = None,
    pg_scale: float = 1.0,
) -> LossOutput:
    """Loss of one trained step for a batch: log-probs and advantages [B].

    mean / ref_mean [B, ...] are the step means under the policy and the reference (LoRA off),
    std [B] the KL's divisor d, kl_std(step, convention). They are needed when beta > 0; given
    with beta = 0 the KL is only measured. Old log-probs, advantages, ref_mean and std are
    treated as data.

    GRPO-Guard (algorithm.grpo_guard) passes `clipped_log_ratio`, the normalised log-ratio
    the ratio and its clip are taken of, and `pg_scale`, its per-step weight of the policy
    term; approx_kl and the on-policy gap stay those of logp - logp_old.
    """
    if not clip_range > 0.0:
        raise FlowGrpoError(f"clip_range={clip_range}: must be > 0 (Flow-GRPO uses 1e-4)")
    if not beta >= 0.0:
        raise FlowGrpoError(f"beta={beta}: must be >= 0 (0 = no KL term)")
    _check_batch(log_prob, old_log_prob, advantages)

    logp = log_prob.float()  # [B]
    adv = advantages.detach().float()  # [B]
    log_ratio = logp - old_log_prob.detach().float()  # [B]
    ratio = torch.exp(log_ratio if clipped_log_ratio is None else clipped_log_ratio)  # [B]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    pg_loss = torch.maximum(unclipped, clipped).mean() * pg_scale

    kl = _kl(mean, ref_mean, std, beta, logp)
    # Skip the KL term at beta = 0 so that an infinite KL (std 0) cannot turn the loss into NaN.
    loss = pg_loss + beta * kl if beta > 0.0 else pg_loss

    with torch.no_grad():
        r = ratio.detach()
        lr = log_ratio.detach()
        above = (r > 1.0 + clip_range).float()
        below = (r < 1.0 - clip_range).float()
        return LossOutput(
            loss=loss,
            pg_loss=pg_loss,
            kl=kl,
            approx_kl=0.5 * (lr**2).mean(),
            clipfrac=(above + below).mean(),
            clipfrac_above=above.mean(),
            clipfrac_below=below.mean(),
            ratio_mean=r.mean(),
            raw_ratio_mean=torch.exp(lr).mean(),
            ratio_min=r.min(),
            ratio_max=r.max(),
            log_ratio_max_abs=lr.abs().max(),
            batch_size=logp.numel(),
        )


def _kl(
    mean: torch.Tensor | None,
    ref_mean: torch.Tensor | None,
    std: torch.Tensor | None,
    beta: float,
    logp: torch.Tensor,
) -> torch.Tensor:
    """mean_b [ mean_CHW((mean - ref_mean)^2) / (2 std_b^2) ], or 0 without a reference."""
    given = [t is not None for t in (mean, ref_mean, std)]
    if not any(given):
        if beta > 0.0:
            raise FlowGrpoError(
                f"beta={beta} needs the step means under the policy and the reference and the "
                "KL divisor: pass mean, ref_mean and std, or set beta=0"
            )
        return torch.zeros((), dtype=torch.float32, device=logp.device)
    if mean is None or ref_mean is None or std is None:
        raise FlowGrpoError("pass mean, ref_mean and std together (the KL needs all three)")
    if mean.shape != ref_mean.shape or mean.shape[0] != logp.numel():
        raise FlowGrpoError(
            f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} must have one "
            f"shape, with the batch of {logp.numel()} first"
        )
    diff = mean.float() - ref_mean.detach().float()  # [B, ...]
    per_sample = (diff**2).mean(dim=tuple(range(1, diff.ndim)))  # [B]
    return (per_sample / (2.0 * std.detach().float() ** 2)).mean()


def kl_std(step: StepOutput, convention: str) -> torch.Tensor:
    """The d [B] the KL of `step` divides by under `algorithm.kl_convention`.

    "reference": the Flow-GRPO code's std_dev_t, a sqrt(sigma / (1 - s)) for the SDE, without
    the step's sqrt(-dt). Every published beta (0.04 for OCR) was tuned with it.
    "gaussian": the step's own std, which makes the term the exact KL between the policy's and
    the reference's Gaussian steps; for the SDE it is the reference's value / |dt|, a factor
    that grows toward the high-noise steps. Both are the step std for CPS.
    """
    if convention == "reference":
        return step.std_dev_t
    if convention == "gaussian":
        return step.std
    raise FlowGrpoError(f"kl_convention={convention!r}: choose 'reference' or 'gaussian'")


def _check_batch(*tensors: torch.Tensor) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if len(set(shapes)) != 1 or len(shapes[0]) != 1:
        raise FlowGrpoError(
            f"log_prob, old_log_prob and advantages have shapes {shapes}: "
            "each must be [B], one value per sample"
        )


# LossOutput field -> how LossMetrics folds it over trained steps and micro-batches.
FLOW_GRPO_FOLDS: dict[str, str] = {
    "loss": "mean",
    "pg_loss": "mean",
    "kl": "mean",
    "approx_kl": "mean",
    "clipfrac": "mean",
    "clipfrac_above": "mean",
    "clipfrac_below": "mean",
    "ratio_mean": "mean",
    "ratio_min": "min",
    "ratio_max": "max",
    "log_ratio_max_abs": "max",
}
# GRPO-Guard reports the ratio before its normalisation too.
GRPO_GUARD_FOLDS: dict[str, str] = {**FLOW_GRPO_FOLDS, "raw_ratio_mean": "mean"}
# "mean" accumulates batch-size-weighted sums, divided by the total weight in summary().
_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": torch.add,
    "min": torch.minimum,
    "max": torch.maximum,
}


def mean_folds(output: type[LossTerms]) -> dict[str, str]:
    """The folds of a loss output whose every field is a batch-size-weighted mean."""
    return {f.name: "mean" for f in fields(output) if f.name != "batch_size"}


class LossMetrics:
    """Folds loss outputs of many steps and micro-batches into `update/...` floats.

    `folds` names the output's fields and how each folds ("mean", "min", "max"; Flow-GRPO's
    LossOutput by default, or algorithm.nft.NFT_FOLDS, ...). Means are weighted by batch size
    (a short last micro-batch counts for what it holds); ratio_min and ratio_max are the
    extremes over everything added. Values stay tensors until summary(), so adding a step
    never waits for the device.
    """

    def __init__(self, folds: dict[str, str] | None = None) -> None:
        self._folds = folds or FLOW_GRPO_FOLDS
        self._weight = 0
        self._folded: dict[str, torch.Tensor] = {}

    def add(self, out: LossTerms) -> None:
        self._weight += out.batch_size
        for name, fold in self._folds.items():
            value = getattr(out, name).detach().float()
            if fold == "mean":
                value = value * out.batch_size
            previous = self._folded.get(name)
            self._folded[name] = value if previous is None else _COMBINE[fold](previous, value)

    def all_reduce(self) -> None:
        """Fold in every rank's metrics (a no-op without a process group), so the summary
        describes the whole update rather than one rank's share of it."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        ops = {
            "mean": torch.distributed.ReduceOp.SUM,
            "min": torch.distributed.ReduceOp.MIN,
            "max": torch.distributed.ReduceOp.MAX,
        }
        # NCCL reduces device tensors only; gloo takes CPU ones.
        nccl = torch.distributed.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        weight = torch.tensor(float(self._weight), device=device)
        torch.distributed.all_reduce(weight, op=ops["mean"])
        self._weight = int(weight.item())
        for name, fold in self._folds.items():
            value = self._folded[name].detach().float().to(device).clone()
            torch.distributed.all_reduce(value, op=ops[fold])
            self._folded[name] = value

    def summary(self) -> dict[str, float]:
        """`update/<field>` -> float; empty when nothing was added."""
        means = {name for name, fold in self._folds.items() if fold == "mean"}
        return {
            f"update/{name}": (value / self._weight if name in means else value).item()
            for name, value in self._folded.items()
        }
