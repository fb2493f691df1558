"""What every rollout engine shares: the sample request, the engine base class, batching.

The rollout stage hands an engine the requests of its rank and gets back sampled batches and
each group's text conditioning; it does not know which engine runs (flowgrpo_cli.engines names
them by `sampler.engine`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flowgrpo_cli.engines.sampling import SampledBatch
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.contract import SamplerSettings
from flowgrpo_cli.store.source_images import decode_source_image

if TYPE_CHECKING:
    from flowgrpo_cli.training.policy import Policy

GroupConditioning = dict[int, Conditioning]  # group id -> its encoded prompts (one row each)


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
    # The seed of the generator the initial noise is drawn from (sampler.same_noise_per_group:
    # one per group); None: the sample's own generator, which then draws its SDE noise too.
    noise_seed: int | None = None
    # PNG bytes of the image the prompt edits (an editing data set), None for text-to-image:
    # the prompt table's `source_image`, shared by the requests of a group.
    source_image: bytes | None = None


class RolloutEngine(ABC):
    """Samples the policy's current weights; an engine says how (`sample`).

    What every engine does alike is here: it reports the policy's version, encodes the text
    with the policy's own adapter (the rollout stores that conditioning per group and the
    update recomputes log-probs from it, so it is the adapter's whatever samples), and samples
    along the adapter's sigmas.
    """

    def __init__(self, policy: Policy, *, max_sequence_length: int):
        self.policy = policy
        self.max_sequence_length = max_sequence_length or None  # 0: the pipeline's default
        # (steps, height, width, shift) -> sigmas: the adapter rebuilds a scheduler to
        # answer, and the answer never changes for a loaded model.
        self._sigmas: dict[tuple[int, int, int, float], torch.Tensor] = {}

    @property
    def version(self) -> str:
        """Which policy weights the engine samples with (recorded in the rollout manifest)."""
        return self.policy.version

    def encode(self, requests: list[SampleRequest], guidance_scale: float) -> GroupConditioning:
        """Text conditioning per group id (one row each), for the requests' groups, with the
        negative prompts' embeddings when they will be sampled with CFG (guidance_scale > 1),
        and what an editing family encodes of the group's source image. The adapter refuses
        source images for a text-to-image family, and their absence for an editing one."""
        firsts: dict[int, SampleRequest] = {}
        for request in requests:
            firsts.setdefault(request.group_id, request)
        out = {}
        for group_id, request in firsts.items():
            source = request.source_image
            out[group_id] = self.policy.adapter.encode_prompts(
                [request.prompt],
                [request.negative_prompt],
                guidance_scale=guidance_scale,
                max_sequence_length=self.max_sequence_length,
                system_prompt=request.system_prompt or None,
                source_images=None if source is None else [decode_source_image(source)],
            )
        return out

    def sigmas(self, settings: SamplerSettings) -> torch.Tensor:
        """The sigmas [num_steps + 1] a batch with these settings is sampled along (the
        rollout manifest records them, and the update reads them back)."""
        key = (settings.schedule.num_steps, settings.height, settings.width, settings.shift)
        if key not in self._sigmas:
            self._sigmas[key] = self.policy.adapter.sigmas(*key)
        return self._sigmas[key]

    @abstractmethod
    def sample(
        self, requests: list[SampleRequest], encoded: GroupConditioning, settings: SamplerSettings
    ) -> SampledBatch:
        """Trajectories of one batch of requests."""


def batches(requests: list[SampleRequest], size: int) -> Iterator[list[SampleRequest]]:
    for start in range(0, len(requests), size):
        yield requests[start : start + size]


def noise_seeds(requests: list[SampleRequest]) -> list[int] | None:
    """The initial-noise seeds of a batch (sample_batch's `noise_seeds`), or None when every
    sample draws its initial noise from its own generator."""
    seeds = [r.noise_seed for r in requests]
    if all(seed is None for seed in seeds):
        return None
    if any(seed is None for seed in seeds):
        raise ValueError("a batch mixes samples with and without a shared initial noise")
    return [int(seed) for seed in seeds if seed is not None]
