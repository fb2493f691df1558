"""The diffusers engine: the policy's own pipeline, in this process, through its adapter and
flowgrpo_cli.engines.sampling: the very modules the update trains."""

from __future__ import annotations

import contextlib

import torch

from flowgrpo_cli.engines.base import SampleRequest
from flowgrpo_cli.engines.sampling import SampledBatch, SamplerSettings, sample_batch
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.training.policy import Policy


class DiffusersEngine:
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
        self.policy = policy
        self.max_sequence_length = max_sequence_length or None
        self.merge_lora = merge_lora
        if merge_lora:
            policy.check_mergeable()
        # (steps, height, width) -> sigmas: the adapter rebuilds a scheduler to answer, and
        # the answer never changes for a loaded model.
        self._sigmas: dict[tuple[int, int, int], torch.Tensor] = {}

    @property
    def version(self) -> str:
        return self.policy.version

    def sigmas(self, settings: SamplerSettings) -> torch.Tensor:
        key = (settings.schedule.num_steps, settings.height, settings.width)
        if key not in self._sigmas:
            self._sigmas[key] = self.policy.adapter.sigmas(*key)
        return self._sigmas[key]

    def encode(
        self, requests: list[SampleRequest], guidance_scale: float
    ) -> dict[int, Conditioning]:
        firsts: dict[int, SampleRequest] = {}
        for request in requests:
            firsts.setdefault(request.group_id, request)
        out = {}
        for group_id, request in firsts.items():
            out[group_id] = self.policy.adapter.encode_prompts(
                [request.prompt],
                [request.negative_prompt],
                guidance_scale=guidance_scale,
                max_sequence_length=self.max_sequence_length,
                system_prompt=request.system_prompt or None,
            )
        return out

    def sample(
        self,
        requests: list[SampleRequest],
        conditioning: dict[int, Conditioning],
        settings: SamplerSettings,
    ) -> SampledBatch:
        adapter = self.policy.adapter
        cond = Conditioning.cat([conditioning[r.group_id] for r in requests]).to(self.policy.device)
        sigmas = self.sigmas(settings)
        weights = self.policy.lora_merged() if self.merge_lora else contextlib.nullcontext()
        with weights:
            return sample_batch(adapter, cond, [r.seed for r in requests], settings, sigmas)
