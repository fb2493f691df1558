"""Rollout engines: what turns sample requests into trajectories.

The rollout stage hands an engine the requests of its rank and gets back sampled batches and
each group's text conditioning; it does not know which engine runs. `DiffusersEngine` runs the
policy in this process with flowgrpo_cli.sampling. Engines are chosen by `sampler.engine`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from flowgrpo_cli.config import Config
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.policy import Policy
from flowgrpo_cli.sampling import SampledBatch, SamplerSettings, sample_batch


@dataclass(frozen=True)
class SampleRequest:
    sample_id: str
    prompt_index: int
    group_id: int
    seed: int
    prompt: str
    ground_truth: str
    negative_prompt: str
    system_prompt: str


class RolloutEngine(Protocol):
    @property
    def version(self) -> str:
        """Which policy weights the engine samples with (recorded in the rollout manifest)."""
        ...

    def encode(self, requests: list[SampleRequest]) -> dict[int, Conditioning]:
        """Text conditioning per group id (one row each), for the requests' groups."""
        ...

    def sample(
        self,
        requests: list[SampleRequest],
        conditioning: dict[int, Conditioning],
        settings: SamplerSettings,
    ) -> SampledBatch:
        """Trajectories of one batch of requests."""
        ...


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
        guidance_scale: float,
        merge_lora: bool = False,
    ):
        self.policy = policy
        self.max_sequence_length = max_sequence_length or None
        self.guidance_scale = guidance_scale
        self.merge_lora = merge_lora
        if merge_lora:
            policy.check_mergeable()
        # (steps, height, width) -> sigmas: the adapter rebuilds a scheduler to answer, and
        # the answer never changes for a loaded model.
        self._sigmas: dict[tuple[int, int, int], torch.Tensor] = {}

    @property
    def version(self) -> str:
        return self.policy.version

    def encode(self, requests: list[SampleRequest]) -> dict[int, Conditioning]:
        firsts: dict[int, SampleRequest] = {}
        for request in requests:
            firsts.setdefault(request.group_id, request)
        out = {}
        for group_id, request in firsts.items():
            out[group_id] = self.policy.adapter.encode_prompts(
                [request.prompt],
                [request.negative_prompt],
                guidance_scale=self.guidance_scale,
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
        key = (settings.schedule.num_steps, settings.height, settings.width)
        if key not in self._sigmas:
            self._sigmas[key] = adapter.sigmas(*key)
        sigmas = self._sigmas[key]
        weights = self.policy.lora_merged() if self.merge_lora else contextlib.nullcontext()
        with weights:
            return sample_batch(adapter, cond, [r.seed for r in requests], settings, sigmas)


def batches(requests: list[SampleRequest], size: int) -> Iterator[list[SampleRequest]]:
    for start in range(0, len(requests), size):
        yield requests[start : start + size]


def _vllm_omni_engine(policy: Policy, **kwargs) -> RolloutEngine:
    """flowgrpo_cli.vllm_engine, imported only when chosen: it needs .venv-vllm."""
    from flowgrpo_cli.vllm_engine import VllmOmniEngine

    return VllmOmniEngine(policy, **kwargs)


ENGINES: dict[str, Callable[..., RolloutEngine]] = {
    "diffusers": DiffusersEngine,
    "vllm-omni": _vllm_omni_engine,
}


def build_engine(config: Config, policy: Policy) -> RolloutEngine:
    """The rollout engine `sampler.engine` names, set up from the config."""
    return engine_class(config.sampler.engine)(
        policy,
        max_sequence_length=config.model.max_sequence_length,
        guidance_scale=config.sampler.guidance_scale,
        merge_lora=config.sampler.merge_lora,
    )


def engine_class(name: str) -> Callable[..., RolloutEngine]:
    if name not in ENGINES:
        raise FlowGrpoError(
            f"sampler.engine = {name!r} is not available (engines: {', '.join(ENGINES)})"
        )
    if name == "vllm-omni":  # say how to install it before the caller loads a policy
        from flowgrpo_cli.vllm_engine import require_vllm_omni

        require_vllm_omni()
    return ENGINES[name]
