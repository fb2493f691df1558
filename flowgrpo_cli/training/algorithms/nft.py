"""DiffusionNFT (Zheng et al. 2025): rollout samples with the anchor, a soft-updated copy of
the weights, and the loss contrasts the trained velocity against the anchor's on re-noised
clean latents (the math: algorithm/nft.py)."""

from __future__ import annotations

import torch

from flowgrpo_cli.algorithm.forward import nft_timestep_indices
from flowgrpo_cli.algorithm.nft import NFT_FOLDS, NftOutput, nft_loss
from flowgrpo_cli.training.algorithms.forward_process import ForwardProcess, NoiseLevel


class Nft(ForwardProcess):
    name = "nft"
    samples_with_anchor = True
    # DiffusionNFT's default decay (its `decay_type` 1); its OCR recipe uses [75, 0.0075, 0.999].
    default_anchor_decay = (0.0, 0.001, 0.5)
    folds = NFT_FOLDS

    def default_timestep_count(self, num_steps: int) -> int:
        return max(1, int(num_steps * 0.99))

    def timestep_indices(
        self, num_steps: int, count: int, generator: torch.Generator
    ) -> torch.Tensor:
        return nft_timestep_indices(num_steps, count, generator)

    def uses_anchor_velocity(self) -> bool:
        return True  # v_old of the implicit positive and negative policies

    def level_loss(self, level: NoiseLevel) -> NftOutput:
        algorithm = self.config.algorithm
        assert level.v_anchor is not None  # uses_anchor_velocity
        return nft_loss(
            level.v, level.v_anchor, level.x_t, level.x0, level.t, level.advantages,
            nft_beta=algorithm.nft_beta, advantage_clip=algorithm.advantage_clip,
            beta=algorithm.beta, v_ref=level.v_ref,
        )  # fmt: skip
