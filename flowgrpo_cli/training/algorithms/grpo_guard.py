"""GRPO-Guard (Wang et al. 2025): Flow-GRPO with RatioNorm's normalised ratio and a per-step
weight of 1 / (-dt) on the policy term (the math: algorithm/grpo_guard.py).

RatioNorm needs each step's mean under the weights that sampled. Those are the weights the
iteration started from, so the anchor here is them: a copy with decay 0, refreshed after every
update, never configurable. The old means are recomputed with it rather than stored by rollout.
"""

from __future__ import annotations

import torch

from flowgrpo_cli.algorithm.grpo_guard import normalized_log_ratio, step_weight
from flowgrpo_cli.algorithm.loss import GRPO_GUARD_FOLDS
from flowgrpo_cli.algorithm.sde import StepOutput
from flowgrpo_cli.training.algorithms.base import MicroBatch, UpdateContext
from flowgrpo_cli.training.algorithms.flow_grpo import (
    FlowGrpo,
    RatioTerms,
    TrainedStep,
    stored_step,
)


class GrpoGuard(FlowGrpo):
    name = "grpo_guard"
    default_anchor_decay = (0.0, 0.0, 0.0)
    anchor_decay_configurable = False
    folds = GRPO_GUARD_FOLDS

    def no_grad_forwards(self) -> list[str]:
        return [*super().no_grad_forwards(), "anchor"]

    def sampling_step(
        self, context: UpdateContext, batch: MicroBatch, position: int
    ) -> StepOutput | None:
        policy = context.trainer.policy
        with torch.no_grad(), context.trainer.anchor_weights():
            return stored_step(
                policy.adapter, context.rollout, batch.rows, position, batch.cond, policy.device
            )

    def ratio_terms(self, step: TrainedStep) -> RatioTerms:
        """RatioNorm's log-ratio, and the policy term weighted by 1 / (-dt)."""
        assert step.sampled is not None  # sampling_step always gives it
        out, rows, position = step.out, step.batch.rows, step.position
        return RatioTerms(
            clipped_log_ratio=normalized_log_ratio(
                out.log_prob, step.old_log_prob, out.mean, step.sampled.mean, out.std
            ),
            pg_scale=step_weight(rows.timesteps[:, position], rows.timesteps_next[:, position]),
        )
