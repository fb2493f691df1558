"""The diffusers engine: the policy's own pipeline, in this process, through its adapter and
flowgrpo_cli.engines.sampling: the very modules the update trains."""

from __future__ import annotations

import contextlib

from flowgrpo_cli.engines.base import (
    GroupConditioning,
    RolloutEngine,
    SampleRequest,
    noise_seeds,
)
from flowgrpo_cli.engines.sampling import SampledBatch, sample_batch
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.contract import SamplerSettings
from flowgrpo_cli.training.policy import Policy


class DiffusersEngine(RolloutEngine):
    """Samples with the policy's diffusers pipeline in this process.

    merge_lora: sample with the LoRA update folded into the base weights (Policy.lora_merged):
    one matmul per adapted layer instead of three, for a log-prob gap of float32 rounding.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        max_sequence_length: int,
        merge_lora: bool = False,
    ):
        super().__init__(policy, max_sequence_length=max_sequence_length)
        self.merge_lora = merge_lora
        if merge_lora:
            policy.check_mergeable()

    def sample(
        self, requests: list[SampleRequest], encoded: GroupConditioning, settings: SamplerSettings
    ) -> SampledBatch:
        adapter = self.policy.adapter
        cond = Conditioning.cat([encoded[r.group_id] for r in requests]).to(self.policy.device)
        sigmas = self.sigmas(settings)
        weights = self.policy.lora_merged() if self.merge_lora else contextlib.nullcontext()
        with weights:
            return sample_batch(
                adapter, cond, [r.seed for r in requests], settings, sigmas,
                noise_seeds=noise_seeds(requests),
            )  # fmt: skip
