"""Flow-GRPO (Liu et al. 2025): the clipped policy gradient of the SDE trajectory's steps.

Rollout stores the states around each stochastic step and the step's log-prob. The update
recomputes each trained step under the current weights (the velocity, then the step rollout
took, scoring the stored next latent) and takes PPO's clipped ratio of the log-probs, plus
beta times the KL to the reference (algorithm/loss.py). GRPO-Guard and MixGRPO are this
update with another ratio and per-step weight (grpo_guard.py) or a moving window (mixgrpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flowgrpo_cli.algorithm.loss import FLOW_GRPO_FOLDS, LossOutput, kl_std, policy_loss
from flowgrpo_cli.algorithm.sde import STEP_FUNCTIONS, StepOutput
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.training.algorithms.base import Algorithm, MicroBatch, UpdateContext

if TYPE_CHECKING:
    from flowgrpo_cli.algorithm.loss import LossMetrics
    from flowgrpo_cli.models import Conditioning, ModelAdapter
    from flowgrpo_cli.store.config import Config
    from flowgrpo_cli.store.contract import RolloutManifest
    from flowgrpo_cli.store.trajectory import TrajectoryRows


@dataclass(frozen=True)
class RatioTerms:
    """How a variant changes the clipped objective of one step (see policy_loss)."""

    clipped_log_ratio: torch.Tensor | None = None  # [B]; None: logp - logp_old itself
    pg_scale: float = 1.0  # weight of the policy term


@dataclass(frozen=True)
class TrainedStep:
    """One trained step of a micro-batch, recomputed under the current weights."""

    batch: MicroBatch
    position: int  # of the step in the stored trajectory
    out: StepOutput  # under the trained weights, with grad
    old_log_prob: torch.Tensor  # [B]: the rollout's, or recomputed before the first step
    ref_mean: torch.Tensor | None  # the KL reference's step mean, where beta > 0
    sampled: StepOutput | None  # under the weights that sampled, where sampling_step gives it


def stored_step(
    adapter: ModelAdapter,
    rollout: RolloutManifest,
    rows: TrajectoryRows,
    position: int,
    cond: Conditioning,
    device: torch.device,
) -> StepOutput:
    """Trajectory step `position` of `rows` recomputed under the adapter's current weights:
    the velocity, then the step rollout took, scoring the stored next latent (log-prob, mean).

    The one velocity-plus-step of the update: its policy pass, its reference pass (called
    inside the trainer's reference context) and the old-log-prob recompute all come here, with
    the sampler settings and sigmas the rollout manifest recorded.
    """
    sampler = rollout.sampler
    x = rows.latents[:, position].to(device)  # [B, ...]
    sigma = rows.timesteps[:, position].to(device)  # [B]
    v = adapter.velocity(x, sigma, cond, guidance_scale=sampler.guidance_scale)
    return STEP_FUNCTIONS[sampler.kind](
        x,
        v,
        sigma,
        rows.timesteps_next[:, position].to(device),
        noise_level=sampler.noise_level,
        sigma_max_substitute=rollout.sigma_max_substitute,
        next_latents=rows.latents[:, position + 1].to(device),
    )


class FlowGrpo(Algorithm):
    name = "flow_grpo"
    needs_trajectory = True
    folds = FLOW_GRPO_FOLDS

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self._old_log_probs: dict[tuple[int, int], torch.Tensor] | None = None
        self._gap: torch.Tensor | None = None  # |new - stored log-prob| before any step

    def check(self) -> None:
        super().check()
        if self.config.algorithm.train_cfg:
            raise FlowGrpoError(
                f"algorithm.train_cfg is for nft and awm; {self.name} already trains the "
                "sampler's own steps, guidance included: leave it false"
            )

    def no_grad_forwards(self) -> list[str]:
        return ["KL reference"] if self.config.algorithm.beta > 0 else []

    def trained_terms(self) -> tuple[int, str]:
        return len(self.step_schedule(0).trained_positions), "trained step(s)"

    # -- the update ----------------------------------------------------------------------------

    def begin_update(self, context: UpdateContext) -> None:
        self._gap = None
        recompute = self.config.algorithm.recompute_old_logprobs
        self._old_log_probs = _recompute_old_logprobs(context) if recompute else None

    def backward(
        self, context: UpdateContext, batch: MicroBatch, losses: LossMetrics | None
    ) -> None:
        """Accumulate the gradient of the micro-batch's loss over its trained steps, weighted
        so that an optimizer step's gradient is the mean over its samples and steps (over
        every rank); keep |new - stored log-prob| of the first micro-batch: the on-policy gap
        before a step."""
        policy, beta = context.trainer.policy, self.config.algorithm.beta
        rows, cond = batch.rows, batch.cond
        positions = torch.nonzero(rows.trained[0]).flatten().tolist()
        if not positions:
            raise FlowGrpoError(
                f"{context.samples.folder}: no trained step in the stored trajectories"
            )
        weight = batch.weight(len(positions))
        gaps = []
        for position in positions:
            sampled = self.sampling_step(context, batch, position)
            out = stored_step(policy.adapter, context.rollout, rows, position, cond, policy.device)
            stored = rows.log_probs[:, position].to(policy.device)
            old = stored
            if self._old_log_probs is not None:
                old = torch.stack([self._old_log_probs[(i, position)] for i in batch.indices]).to(
                    policy.device
                )
            gaps.append((out.log_prob.detach() - stored).abs())
            ref_mean = None
            if beta > 0:
                with torch.no_grad(), context.trainer.reference_context():
                    ref = stored_step(
                        policy.adapter, context.rollout, rows, position, cond, policy.device
                    )
                    ref_mean = ref.mean
            result = self.step_loss(TrainedStep(batch, position, out, old, ref_mean, sampled))
            (result.loss * weight).backward()
            if losses is not None:
                losses.add(result)
        if self._gap is None:  # the first micro-batch, before any optimizer step
            self._gap = torch.cat(gaps)

    def sampling_step(
        self, context: UpdateContext, batch: MicroBatch, position: int
    ) -> StepOutput | None:
        """The step under the weights that sampled, when the loss needs it (GRPO-Guard);
        computed before the graph of the trained forward exists."""
        return None

    def ratio_terms(self, step: TrainedStep) -> RatioTerms:
        """What the clip acts on and the policy term's weight: Flow-GRPO's own ratio, 1."""
        return RatioTerms()

    def step_loss(self, step: TrainedStep) -> LossOutput:
        """The clipped policy loss of one trained step (+ beta KL)."""
        algorithm, out = self.config.algorithm, step.out
        beta = algorithm.beta
        terms = self.ratio_terms(step)
        return policy_loss(
            out.log_prob,
            step.old_log_prob,
            step.batch.advantages,
            clip_range=algorithm.clip_range,
            beta=beta,
            mean=out.mean if beta > 0 else None,
            ref_mean=step.ref_mean,
            std=kl_std(out, algorithm.kl_convention) if beta > 0 else None,
            clipped_log_ratio=terms.clipped_log_ratio,
            pg_scale=terms.pg_scale,
        )

    def update_metrics(self, context: UpdateContext, summary: dict[str, float]) -> dict[str, float]:
        # The KL's name says which divisor it has (the two differ by 1/|dt| for the SDE).
        summary[f"update/kl_{self.config.algorithm.kl_convention}"] = summary.pop("update/kl")
        if self._gap is not None:
            summary["update/logprob_gap_max"] = float(self._gap.max())
            summary["update/logprob_gap_mean"] = float(self._gap.mean())
        return summary


@torch.no_grad()
def _recompute_old_logprobs(context: UpdateContext) -> dict[tuple[int, int], torch.Tensor]:
    """Old log-probs under the current weights, before any step: (sample, step) -> logp.

    Every rank computes them for every sample: the same forwards on every rank keep FSDP's
    collectives aligned, and the result is small.
    """
    policy, samples = context.trainer.policy, context.samples
    out: dict[tuple[int, int], torch.Tensor] = {}
    micro = context.config.train.micro_batch_size
    for start in range(0, context.num_samples, micro):
        indices = list(range(start, min(start + micro, context.num_samples)))
        rows = samples.rows(indices)
        cond = samples.conditioning_of(rows, policy.device)
        for position in torch.nonzero(rows.trained[0]).flatten().tolist():
            step = stored_step(policy.adapter, context.rollout, rows, position, cond, policy.device)
            for i, index in enumerate(indices):
                out[(index, position)] = step.log_prob[i].cpu()
    return out
