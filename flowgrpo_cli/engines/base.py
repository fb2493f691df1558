"""What every rollout engine shares: the sample request, the engine protocol, batching.

The rollout stage hands an engine the requests of its rank and gets back sampled batches and
each group's text conditioning; it does not know which engine runs (flowgrpo_cli.engines names
them by `sampler.engine`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from flowgrpo_cli.engines.sampling import SampledBatch, SamplerSettings
from flowgrpo_cli.models import Conditioning


@dataclass(frozen=True)
class SampleRequest:
    sample_id: str
    prompt_index: int
    group_id: int
    seed: int
    prompt: str
    ground_truth: str | None  # None: the prompt has no target
    negative_prompt: str
    system_prompt: str


class RolloutEngine(Protocol):
    @property
    def version(self) -> str:
        """Which policy weights the engine samples with (recorded in the rollout manifest)."""
        ...

    def encode(
        self, requests: list[SampleRequest], guidance_scale: float
    ) -> dict[int, Conditioning]:
        """Text conditioning per group id (one row each), for the requests' groups, with the
        negative prompts' embeddings when they will be sampled with CFG (guidance_scale > 1)."""
        ...

    def sigmas(self, settings: SamplerSettings) -> torch.Tensor:
        """The sigmas [num_steps + 1] a batch with these settings is sampled along (the
        rollout manifest records them, and the update reads them back)."""
        ...

    def sample(
        self,
        requests: list[SampleRequest],
        conditioning: dict[int, Conditioning],
        settings: SamplerSettings,
    ) -> SampledBatch:
        """Trajectories of one batch of requests."""
        ...


def batches(requests: list[SampleRequest], size: int) -> Iterator[list[SampleRequest]]:
    for start in range(0, len(requests), size):
        yield requests[start : start + size]
