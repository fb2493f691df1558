"""What an algorithm is to the stages around it: one object, chosen by `algorithm.name`.

Rollout, score, advantages, the run directory, resume and FSDP are shared. An algorithm says
what rollout must store for it (the SDE trajectory, or the clean latent alone), which weights
sample (the trained ones or its anchor), where the SDE window sits at an iteration, whether it
keeps an anchor, and it brings the gradient of one update micro-batch and its metrics. The
stages and the trainer ask these questions of the object and never of the algorithm's name.

The update stage calls, per update:

    algorithm.begin_update(context)          # once, before the first optimizer step
    algorithm.backward(context, micro_batch, losses)   # per micro-batch, then trainer.step()
    algorithm.update_metrics(context, losses.summary())

A new algorithm is a module beside these with one subclass, an entry in the registry
(`training/algorithms/__init__.py`), and the config keys it adds.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from flowgrpo_cli.algorithm.schedule import StepSchedule, build_step_schedule
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.seeding import derive_seed

if TYPE_CHECKING:
    from flowgrpo_cli.algorithm.loss import LossMetrics
    from flowgrpo_cli.models import Conditioning
    from flowgrpo_cli.store.config import Config
    from flowgrpo_cli.store.contract import RolloutManifest
    from flowgrpo_cli.store.trajectory import TrajectoryRows
    from flowgrpo_cli.training.policy import Policy
    from flowgrpo_cli.training.samples import StoredSamples

AnchorSchedule = tuple[float, float, float]  # [start, slope, max] (algorithm.anchor.anchor_decay)


class TrainerHandle(Protocol):
    """What an algorithm's update uses of the trainer (training/trainer.py `Trainer`)."""

    policy: Policy

    def anchor_weights(self) -> AbstractContextManager[None]:
        """The anchor swapped into the trained parameters."""
        ...

    def reference_context(self) -> AbstractContextManager[None]:
        """The reference's velocity: LoRA disabled, or the frozen copy (full mode)."""
        ...


@dataclass(frozen=True)
class UpdateContext:
    """What one iteration's update hands its algorithm."""

    config: Config
    iteration: int
    trainer: TrainerHandle
    rollout: RolloutManifest
    samples: StoredSamples  # the trained samples, read from the rollout parts on demand
    num_samples: int  # trained samples of the iteration (all ranks)


@dataclass(frozen=True)
class MicroBatch:
    """One rank's share of one optimizer step's samples."""

    indices: list[int]  # into the iteration's trained samples; [0] for a stand-in
    rows: TrajectoryRows
    cond: Conditioning  # on the policy's device
    advantages: torch.Tensor  # [B], on the policy's device
    batch_size: int  # samples of the whole optimizer step (every rank)
    world_size: int
    epoch: int
    # False: a zero-weighted stand-in for a rank with no samples left in this optimizer step;
    # it runs the same forwards so that FSDP's collectives stay aligned, and adds no metrics.
    real: bool

    def weight(self, terms: int = 1) -> float:
        """The scale of each of `terms` per-sample-mean losses that makes the optimizer
        step's gradient the mean over its samples (every rank) and those terms."""
        if not self.real:
            return 0.0
        return len(self.indices) * self.world_size / (self.batch_size * terms)


class Algorithm:
    """The base of every algorithm: the facts it declares and the defaults most keep."""

    name: ClassVar[str]
    # Rollout stores the states around each stochastic step and their log-probs; else the
    # clean latent alone (and any sampler, ODE included, will do).
    needs_trajectory: ClassVar[bool]
    # Rollout samples with the anchor, not with the trained weights.
    samples_with_anchor: ClassVar[bool] = False
    # The anchor's decay schedule; None: no anchor (see algorithm/anchor.py).
    default_anchor_decay: ClassVar[AnchorSchedule | None] = None
    # algorithm.anchor_decay may set it; False: the anchor is part of the algorithm itself.
    anchor_decay_configurable: ClassVar[bool] = True
    # Its SDE window slides with training (MixGRPO), so sampler.window_end means something.
    slides_window: ClassVar[bool] = False
    # Its loss output's fields -> how the update's metrics fold them (algorithm/loss.py).
    folds: ClassVar[dict[str, str]]

    def __init__(self, config: Config) -> None:
        self.config = config

    # -- checks and rollout ------------------------------------------------------------------

    def check(self) -> None:
        """Refuse settings this algorithm would ignore, or that undo each other; rollout and
        update call it first."""
        self.anchor_schedule()
        if self.config.sampler.window_end != "stay" and not self.slides_window:
            raise FlowGrpoError(
                f"sampler.window_end = {self.config.sampler.window_end!r} says where a sliding "
                f'window ends (algorithm.name = "mixgrpo"); {self.name} does not slide one: '
                "remove the key"
            )
        section = self.config.algorithm
        if section.reward_aggregation == "normalize_each" and section.advantage_std == "none":
            raise FlowGrpoError(
                'algorithm.reward_aggregation = "normalize_each" divides each reward by its std, '
                'which algorithm.advantage_std = "none" turns off: set advantage_std to "group" '
                '(GDPO\'s) or "global", or leave reward_aggregation = "weighted_sum"'
            )
        self.check_ode_solver()

    def check_ode_solver(self) -> None:
        """sampler.ode_solver takes the rollout's deterministic steps, never a stochastic one
        (the trajectory algorithms' log-probs are of sampler.kind's step itself): refuse it
        where every step is stochastic, saying what would give it steps to take."""
        sampler = self.config.sampler
        if sampler.ode_solver == "euler" or sampler.noise_level == 0:
            return
        if 0 < sampler.window_size < sampler.num_steps:  # the steps outside the window
            return
        chosen = f"sampler.ode_solver = {sampler.ode_solver!r}"
        stochastic = (
            f"sampler.noise_level = {sampler.noise_level:g} with "
            + (f"a window of all {sampler.num_steps} steps" if sampler.window_size else "no window")
            + " makes every step stochastic"
        )
        if self.needs_trajectory:
            raise FlowGrpoError(
                f"{chosen} takes deterministic steps only: {self.name} trains the stochastic "
                f"steps, whose log-probs are of the {sampler.kind!r} step itself, and "
                f"{stochastic}: set sampler.window_size below sampler.num_steps (the steps "
                "outside the window are ODE steps) or leave ode_solver = 'euler'"
            )
        raise FlowGrpoError(
            f"{chosen} takes deterministic steps only, and {stochastic}: {self.name} trains on "
            "the clean latent alone, so set sampler.noise_level = 0 for an ODE rollout taken "
            "with it (DiffusionNFT's), or leave ode_solver = 'euler'"
        )

    def anchor_schedule(self) -> AnchorSchedule | None:
        """The anchor's decay schedule, or None when the algorithm keeps no anchor."""
        section, default = self.config.algorithm, self.default_anchor_decay
        if section.anchor_decay and (default is None or not self.anchor_decay_configurable):
            kept = "no anchor" if default is None else "the weights that sampled as its anchor"
            raise FlowGrpoError(
                f"algorithm.anchor_decay = {list(section.anchor_decay)} sets the anchor of nft "
                f"and awm only; {self.name} keeps {kept}: remove the key"
            )
        if default is None:
            return None
        if not section.anchor_decay:
            return default
        start, slope, most = section.anchor_decay  # the config checks it holds three
        return (start, slope, most)

    def step_schedule(self, iteration: int) -> StepSchedule:
        """Which of the sampler's steps are SDE and which are trained at `iteration`."""
        sampler = self.config.sampler
        return build_step_schedule(
            sampler.num_steps,
            train_fraction=sampler.train_fraction,
            train_last_step=sampler.train_last_step,
            window_size=sampler.window_size or None,
            window_range=self.window_range(iteration),
            rng=random.Random(derive_seed(self.config.run.seed, iteration, "window")),
        )

    def window_range(self, iteration: int) -> tuple[int, int] | None:
        """The range the SDE window's start is drawn from at `iteration` (None: anywhere)."""
        window_range = self.config.sampler.window_range
        return (window_range[0], window_range[1]) if window_range else None

    def trained_terms(self) -> tuple[int, str]:
        """How many loss terms each image adds to an update, and what they are (planning)."""
        raise NotImplementedError

    def trained_guidance(self, guidance_scale: float, guidance_embeds: bool) -> float:
        """The guidance scale of the velocity the update trains, given the rollout's: the
        sampled one, whose step log-probabilities the trajectory algorithms score."""
        return guidance_scale

    # -- the update ----------------------------------------------------------------------------

    def begin_update(self, context: UpdateContext) -> None:
        """Before the iteration's first optimizer step (every rank)."""

    def backward(
        self, context: UpdateContext, batch: MicroBatch, losses: LossMetrics | None
    ) -> None:
        """Accumulate the micro-batch's gradient; add its loss outputs to `losses` unless None
        (a stand-in)."""
        raise NotImplementedError

    def update_metrics(self, context: UpdateContext, summary: dict[str, float]) -> dict[str, float]:
        """The update's loss metrics, from `losses.summary()` after the last step."""
        return summary

    # -- planning --------------------------------------------------------------------------------

    def no_grad_forwards(self) -> list[str]:
        """The forwards without gradient each trained term adds (anchor, KL reference)."""
        raise NotImplementedError
