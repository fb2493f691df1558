"""The forward-process methods, nft and awm: re-noise each sample's clean latent at drawn noise
levels, run the policy (and the anchor and reference, without gradient), backpropagate a
flow-matching-style loss. Rollout keeps the clean latent alone, and any sampler will do.

The loss of each noise level is a mean over the micro-batch, scaled so that an optimizer
step's gradient is the mean over its samples and noise levels (over every rank), as the
flow_grpo update does over trained steps. Training is CFG-free by default, as in both papers:
one conditional forward (a guidance-distilled FLUX.1-dev keeps its embedded guidance input).
algorithm.train_cfg trains the guided velocity the images were sampled with instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flowgrpo_cli.algorithm.forward import noised
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.training.algorithms.base import Algorithm, MicroBatch, UpdateContext

if TYPE_CHECKING:
    from flowgrpo_cli.algorithm.loss import LossMetrics, LossTerms


@dataclass(frozen=True)
class Draws:
    """One sample's noise levels (indices into the rollout's sigma grid) and noises."""

    indices: torch.Tensor  # [K] int64
    noise: torch.Tensor  # [K, *latent_shape] float32


@dataclass(frozen=True)
class NoiseLevel:
    """One noise level of a micro-batch: the clean latents re-noised, and the velocities there
    (tensors [B, ...] unless said otherwise)."""

    x0: torch.Tensor  # the clean latent
    noise: torch.Tensor
    t: torch.Tensor  # [B] the noise level: x_t = (1 - t) x0 + t noise
    x_t: torch.Tensor
    advantages: torch.Tensor  # [B]
    v: torch.Tensor  # the trained velocity, with grad
    v_anchor: torch.Tensor | None  # where uses_anchor_velocity()
    v_ref: torch.Tensor | None  # the KL reference's, where beta > 0


class ForwardProcess(Algorithm):
    """What nft and awm share; each brings its noise-level draw and its loss of one level."""

    needs_trajectory = False

    # -- what each method says ---------------------------------------------------------------

    def default_timestep_count(self, num_steps: int) -> int:
        """Noise levels per sample when algorithm.train_timesteps is 0."""
        raise NotImplementedError

    def timestep_indices(
        self, num_steps: int, count: int, generator: torch.Generator
    ) -> torch.Tensor:
        """`count` indices into the `num_steps` sigmas of the rollout's grid."""
        raise NotImplementedError

    def uses_anchor_velocity(self) -> bool:
        raise NotImplementedError

    def level_loss(self, level: NoiseLevel) -> LossTerms:
        """The method's loss output of one level: `loss` with grad, and its `folds` fields."""
        raise NotImplementedError

    # -- shared ----------------------------------------------------------------------------------

    def train_timestep_count(self, num_steps: int) -> int:
        """algorithm.train_timesteps, or the method's own count when it is 0."""
        return self.config.algorithm.train_timesteps or self.default_timestep_count(num_steps)

    def trained_guidance(self, guidance_scale: float, guidance_embeds: bool) -> float:
        """1 (the conditional velocity) unless algorithm.train_cfg or a guidance-distilled
        model's embedded input."""
        if not self.config.algorithm.train_cfg:
            return guidance_scale if guidance_embeds else 1.0
        if guidance_scale <= 1.0:
            raise FlowGrpoError(
                f"algorithm.train_cfg: the images were sampled with guidance_scale "
                f"{guidance_scale:g}, without CFG, so there is no guided velocity to train: "
                "set sampler.guidance_scale > 1 or leave train_cfg false"
            )
        return guidance_scale

    def trained_terms(self) -> tuple[int, str]:
        return self.train_timestep_count(self.config.sampler.num_steps), "noise level(s)"

    def no_grad_forwards(self) -> list[str]:
        anchor = ["anchor"] if self.uses_anchor_velocity() else []
        return anchor + (["KL reference"] if self.config.algorithm.beta > 0 else [])

    def draw(
        self, iteration: int, epoch: int, sample_id: str, shape: tuple[int, ...], num_steps: int
    ) -> Draws:
        """The sample's draws for this epoch, from a generator of its own (any rank, any
        batch)."""
        generator = torch.Generator().manual_seed(
            derive_seed(self.config.run.seed, iteration, "forward", epoch, sample_id)
        )
        count = self.train_timestep_count(num_steps)
        indices = self.timestep_indices(num_steps, count, generator)
        noise = torch.randn((len(indices), *shape), generator=generator, dtype=torch.float32)
        return Draws(indices, noise)

    def backward(
        self, context: UpdateContext, batch: MicroBatch, losses: LossMetrics | None
    ) -> None:
        trainer, rollout, rows = context.trainer, context.rollout, batch.rows
        adapter, device = trainer.policy.adapter, trainer.policy.device
        x0 = rows.latents[:, -1].to(device)  # the clean latent, all rollout keeps for these
        grid = torch.tensor(rollout.sigmas[:-1], dtype=torch.float32)  # [T]: the steps' sigmas
        draws = [
            self.draw(context.iteration, batch.epoch, sid, tuple(x0.shape[1:]), len(grid))
            for sid in rows.sample_ids
        ]
        guidance = self.trained_guidance(
            rollout.sampler.guidance_scale, getattr(adapter, "guidance_embeds", False)
        )
        count = len(draws[0].indices)
        weight = batch.weight()

        def velocity(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return adapter.velocity(x_t, t, batch.cond, guidance_scale=guidance)

        for j in range(count):
            t = grid[torch.stack([d.indices[j] for d in draws])].to(device)  # [B]
            noise = torch.stack([d.noise[j] for d in draws]).to(device)  # [B, ...]
            x_t = noised(x0, noise, t)
            # The no-gradient forwards first: the anchor is swapped into the trained
            # parameters, which must be back in place before the graph of the trained forward
            # saves them.
            v_anchor = v_ref = None
            if self.uses_anchor_velocity():
                with torch.no_grad(), trainer.anchor_weights():
                    v_anchor = velocity(x_t, t)
            if self.config.algorithm.beta > 0:
                with torch.no_grad(), trainer.reference_context():
                    v_ref = velocity(x_t, t)
            level = NoiseLevel(
                x0, noise, t, x_t, batch.advantages, velocity(x_t, t), v_anchor, v_ref
            )
            out = self.level_loss(level)
            (out.loss * (weight / count)).backward()
            if losses is not None:
                losses.add(out)

    def update_metrics(self, context: UpdateContext, summary: dict[str, float]) -> dict[str, float]:
        # A mean squared velocity difference, not a divergence of step distributions.
        summary["update/kl_velocity"] = summary.pop("update/kl")
        return summary
