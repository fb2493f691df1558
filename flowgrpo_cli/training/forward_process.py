"""One micro-batch of nft or awm: re-noise each sample's clean latent at its drawn noise levels,
run the policy (and the anchor and reference, without gradient), backpropagate the loss.

The loss of each noise level is a mean over the micro-batch, scaled by `weight` so that an
optimizer step's gradient is the mean over its samples and noise levels (over every rank), as
the flow_grpo update does over trained steps. Training is CFG-free by default, as in both
papers: one conditional forward (a guidance-distilled FLUX.1-dev keeps its embedded guidance
input). algorithm.train_cfg trains the guided velocity the images were sampled with instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo_cli.algorithm.awm import awm_loss
from flowgrpo_cli.algorithm.forward import awm_timestep_indices, nft_timestep_indices, noised
from flowgrpo_cli.algorithm.loss import LossMetrics
from flowgrpo_cli.algorithm.nft import nft_loss
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.config import Config
from flowgrpo_cli.store.contract import RolloutManifest
from flowgrpo_cli.store.seeding import derive_seed
from flowgrpo_cli.store.trajectory import TrajectoryRows
from flowgrpo_cli.training.trainer import Trainer


def training_guidance(config: Config, guidance_scale: float, guidance_embeds: bool) -> float:
    """The guidance scale of the trained velocity, given the rollout's: 1 (the conditional
    velocity) unless algorithm.train_cfg or a guidance-distilled model's embedded input."""
    if not config.algorithm.train_cfg:
        return guidance_scale if guidance_embeds else 1.0
    if guidance_scale <= 1.0:
        raise FlowGrpoError(
            f"algorithm.train_cfg: the images were sampled with guidance_scale "
            f"{guidance_scale:g}, without CFG, so there is no guided velocity to train: "
            "set sampler.guidance_scale > 1 or leave train_cfg false"
        )
    return guidance_scale


def train_timestep_count(config: Config, num_steps: int) -> int:
    """algorithm.train_timesteps, or the algorithm's own count when it is 0."""
    chosen = config.algorithm.train_timesteps
    if chosen:
        return chosen
    return max(1, int(num_steps * 0.99)) if config.algorithm.name == "nft" else 6


@dataclass(frozen=True)
class Draws:
    """One sample's noise levels (indices into the rollout's sigma grid) and noises."""

    indices: torch.Tensor  # [K] int64
    noise: torch.Tensor  # [K, *latent_shape] float32


def draw(
    config: Config, iteration: int, epoch: int, sample_id: str, shape: tuple[int, ...],
    num_steps: int,
) -> Draws:  # fmt: skip
    """The sample's draws for this epoch, from a generator of its own (any rank, any batch)."""
    generator = torch.Generator().manual_seed(
        derive_seed(config.run.seed, iteration, "forward", epoch, sample_id)
    )
    count = train_timestep_count(config, num_steps)
    pick = nft_timestep_indices if config.algorithm.name == "nft" else awm_timestep_indices
    indices = pick(num_steps, count, generator)
    noise = torch.randn((len(indices), *shape), generator=generator, dtype=torch.float32)
    return Draws(indices, noise)


def backward_micro_batch(
    config: Config,
    trainer: Trainer,
    rollout: RolloutManifest,
    rows: TrajectoryRows,
    cond: Conditioning,
    advantages: torch.Tensor,
    *,
    iteration: int,
    epoch: int,
    weight: float,
    losses: LossMetrics | None,
) -> None:
    """Accumulate the micro-batch's gradient; add its metrics to `losses` unless None (a
    zero-weighted stand-in)."""
    algorithm, policy = config.algorithm, trainer.policy
    adapter, device = policy.adapter, policy.device
    x0 = rows.latents[:, -1].to(device)  # the clean latent, all rollout keeps for these
    grid = torch.tensor(rollout.sigmas[:-1], dtype=torch.float32)  # [T]: the steps' sigmas
    draws = [
        draw(config, iteration, epoch, sid, tuple(x0.shape[1:]), len(grid))
        for sid in rows.sample_ids
    ]
    guidance = training_guidance(
        config, rollout.sampler.guidance_scale, getattr(adapter, "guidance_embeds", False)
    )
    count = len(draws[0].indices)

    def velocity(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return adapter.velocity(x_t, t, cond, guidance_scale=guidance)

    for j in range(count):
        t = grid[torch.stack([d.indices[j] for d in draws])].to(device)  # [B]
        noise = torch.stack([d.noise[j] for d in draws]).to(device)  # [B, ...]
        x_t = noised(x0, noise, t)
        # The no-gradient forwards first: the anchor is swapped into the trained parameters,
        # which must be back in place before the graph of the trained forward saves them.
        v_anchor = v_ref = None
        if algorithm.name == "nft" or algorithm.anchor_kl > 0:
            with torch.no_grad(), trainer.anchor_weights():
                v_anchor = velocity(x_t, t)
        if algorithm.beta > 0:
            with torch.no_grad(), trainer.reference_context():
                v_ref = velocity(x_t, t)
        v = velocity(x_t, t)
        if algorithm.name == "nft":
            out = nft_loss(
                v, v_anchor, x_t, x0, t, advantages,
                nft_beta=algorithm.nft_beta, advantage_clip=algorithm.advantage_clip,
                beta=algorithm.beta, v_ref=v_ref,
            )  # fmt: skip
        else:
            out = awm_loss(
                v, noise - x0, t, advantages,
                power=algorithm.awm_power, advantage_clip=algorithm.advantage_clip,
                negative_weight=algorithm.awm_negative_weight,
                beta=algorithm.beta, v_ref=v_ref, anchor_kl=algorithm.anchor_kl,
                v_anchor=v_anchor,
            )  # fmt: skip
        (out.loss * (weight / count)).backward()
        if losses is not None:
            losses.add(out)
