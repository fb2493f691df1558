"""The algorithms `algorithm.name` selects, and what each asks of the stages around it.

Rollout, score, advantages, the run directory, resume and FSDP are shared; an algorithm says
what rollout must store for it and which weights sample, and brings its own loss
(algorithm.loss for flow_grpo, algorithm.nft, algorithm.awm).

- flow_grpo: the SDE trajectory with per-step log-probs; the clipped ratio of those.
- grpo_guard: flow_grpo with GRPO-Guard's normalised ratio and per-step weights; it keeps the
  weights the iteration started from (an anchor that never lags) for the old step means.
- mixgrpo: flow_grpo's loss on an SDE window that slides along the steps as training goes
  (ODE steps outside it): MixGRPO's progressive window (algorithm.schedule).
- nft (DiffusionNFT, Zheng et al. 2025) and awm (Advantage Weighted Matching, Xue et al. 2025)
  are forward-process methods: they re-noise the final clean latent and train a flow-matching
  loss, so rollout keeps that latent alone, and any sampler (ODE included) will do. Both keep
  an *anchor*, a copy of the weights that follows them slowly: nft samples with it and
  contrasts against it, awm adds a KL to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowgrpo_cli.algorithm.awm import AWM_FOLDS
from flowgrpo_cli.algorithm.loss import FLOW_GRPO_FOLDS, GRPO_GUARD_FOLDS
from flowgrpo_cli.algorithm.nft import NFT_FOLDS
from flowgrpo_cli.errors import FlowGrpoError


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    needs_trajectory: bool  # rollout stores the states around each stochastic step + log-probs
    samples_with_anchor: bool  # rollout samples with the anchor, not the trained weights
    # [start, slope, max] of the anchor's decay (see anchor_decay); None: no anchor
    default_anchor_decay: tuple[float, float, float] | None
    folds: dict[str, str]  # its loss output's fields -> how update/... metrics fold them
    progressive_window: bool = False  # the SDE window moves with training (mixgrpo)
    # algorithm.anchor_decay sets the anchor's decay (nft, awm); False: the anchor is part of
    # the algorithm itself (grpo_guard's is always the weights that sampled)
    anchor_decay_configurable: bool = True


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "flow_grpo": AlgorithmSpec("flow_grpo", True, False, None, FLOW_GRPO_FOLDS),
    # The anchor with decay 0 is the weights each iteration starts from, which sampled: the
    # old means RatioNorm needs are recomputed with it rather than stored by rollout.
    "grpo_guard": AlgorithmSpec(
        "grpo_guard",
        True,
        False,
        (0.0, 0.0, 0.0),
        GRPO_GUARD_FOLDS,
        anchor_decay_configurable=False,
    ),
    "mixgrpo": AlgorithmSpec("mixgrpo", True, False, None, FLOW_GRPO_FOLDS, True),
    # DiffusionNFT's default decay (its `decay_type` 1); its OCR recipe uses [75, 0.0075, 0.999].
    "nft": AlgorithmSpec("nft", False, True, (0.0, 0.001, 0.5), NFT_FOLDS),
    # AWM's `kl_ema_decay_type = "linear"` with kl_ema_decay 0.3.
    "awm": AlgorithmSpec("awm", False, False, (0.0, 0.001, 0.3), AWM_FOLDS),
}


def spec(name: str) -> AlgorithmSpec:
    return ALGORITHMS[name]


def anchor_schedule(section: Any) -> tuple[float, float, float] | None:
    """The [algorithm] section's anchor decay schedule, or None when the algorithm keeps none."""
    algorithm = spec(section.name)
    default = algorithm.default_anchor_decay
    if section.anchor_decay and (default is None or not algorithm.anchor_decay_configurable):
        kept = "no anchor" if default is None else "the weights that sampled as its anchor"
        raise FlowGrpoError(
            f"algorithm.anchor_decay = {list(section.anchor_decay)} sets the anchor of nft and "
            f"awm only; {section.name} keeps {kept}: remove the key"
        )
    if default is None:
        return None
    return tuple(section.anchor_decay) if section.anchor_decay else default


def anchor_decay(schedule: tuple[float, float, float], optimizer_steps: int) -> float:
    """d after n optimizer steps: 0 before `start`, then min(slope (n - start), max).

    anchor <- d anchor + (1 - d) weights after each update: d = 0 makes the anchor the
    weights themselves (on-policy), d near 1 makes it trail them far behind.
    """
    start, slope, most = schedule
    if optimizer_steps < start:
        return 0.0
    return min(slope * (optimizer_steps - start), most)
