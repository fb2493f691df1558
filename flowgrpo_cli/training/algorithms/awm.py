"""Advantage Weighted Matching (Xue et al. 2025): the flow-matching loss of re-noised clean
latents weighted by advantage, with an optional KL to an anchor that trails the weights (the
math: algorithm/awm.py)."""

from __future__ import annotations

import torch

from flowgrpo_cli.algorithm.awm import AWM_FOLDS, AwmOutput, awm_loss
from flowgrpo_cli.algorithm.forward import awm_timestep_indices
from flowgrpo_cli.training.algorithms.forward_process import ForwardProcess, NoiseLevel


class Awm(ForwardProcess):
    name = "awm"
    # AWM's `kl_ema_decay_type = "linear"` with kl_ema_decay 0.3.
    default_anchor_decay = (0.0, 0.001, 0.3)
    folds = AWM_FOLDS

    def default_timestep_count(self, num_steps: int) -> int:
        return 6

    def timestep_indices(
        self, num_steps: int, count: int, generator: torch.Generator
    ) -> torch.Tensor:
        return awm_timestep_indices(num_steps, count, generator)

    def uses_anchor_velocity(self) -> bool:
        return self.config.algorithm.anchor_kl > 0

    def level_loss(self, level: NoiseLevel) -> AwmOutput:
        algorithm = self.config.algorithm
        return awm_loss(
            level.v, level.noise - level.x0, level.t, level.advantages,
            power=algorithm.awm_power, advantage_clip=algorithm.advantage_clip,
            negative_weight=algorithm.awm_negative_weight,
            beta=algorithm.beta, v_ref=level.v_ref, anchor_kl=algorithm.anchor_kl,
            v_anchor=level.v_anchor,
        )  # fmt: skip
