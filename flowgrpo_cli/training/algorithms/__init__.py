"""The algorithms `algorithm.name` selects, one object each (the protocol: base.py).

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

from typing import TYPE_CHECKING

from flowgrpo_cli.training.algorithms.awm import Awm
from flowgrpo_cli.training.algorithms.base import Algorithm
from flowgrpo_cli.training.algorithms.flow_grpo import FlowGrpo
from flowgrpo_cli.training.algorithms.grpo_guard import GrpoGuard
from flowgrpo_cli.training.algorithms.mixgrpo import MixGrpo
from flowgrpo_cli.training.algorithms.nft import Nft

if TYPE_CHECKING:
    from flowgrpo_cli.store.config import Config

ALGORITHMS: dict[str, type[Algorithm]] = {
    algorithm.name: algorithm for algorithm in (FlowGrpo, GrpoGuard, MixGrpo, Nft, Awm)
}


def algorithm_for(config: Config) -> Algorithm:
    """The object of the config's algorithm.name (the config's own check keeps the name to
    one of ALGORITHMS)."""
    return ALGORITHMS[config.algorithm.name](config)
