"""Which denoising steps are stochastic (SDE/CPS) and which of those are trained.

Rollout samples the stochastic steps with noise and stores the T + 1 latents around them; the
update recomputes the log-prob of the trained ones. Keeping the stochastic steps one contiguous
run is what lets a trajectory be T + 1 consecutive latents instead of scattered pairs.

Options, all combinable:

- default: every step stochastic, every step but the last trained (its std is tiny and the
  likelihood overflows; the paper trains 9 of 10 steps).
- ``train_fraction``: train only the first ceil(f * K) of the K trainable steps (the noisiest,
  where the image's layout is decided).
- ``window_size`` W (Flow-GRPO-Fast, MixGRPO): only W consecutive steps are stochastic and
  trained, the others are ODE steps. The window's first step is drawn uniformly from
  ``window_range`` = (lo, hi), both inclusive, with the given rng; lo == hi fixes it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from flowgrpo_cli.errors import FlowGrpoError

# ceil(f * K) with this slack, so that 0.3 * 10 = 3.0000000000000004 trains 3 steps, not 4.
_FRACTION_SLACK = 1e-9


@dataclass(frozen=True)
class StepSchedule:
    """Per denoising step: is it stochastic, is it trained (trained implies stochastic)."""

    num_steps: int
    stochastic: tuple[bool, ...]  # [num_steps]
    trained: tuple[bool, ...]  # [num_steps]

    def __post_init__(self) -> None:
        if len(self.stochastic) != self.num_steps or len(self.trained) != self.num_steps:
            raise FlowGrpoError(
                f"a schedule of {self.num_steps} steps needs {self.num_steps} stochastic and "
                f"trained flags, got {len(self.stochastic)} and {len(self.trained)}"
            )
        if any(t and not s for s, t in zip(self.stochastic, self.trained, strict=True)):
            raise FlowGrpoError("a trained step must be stochastic: an ODE step has no log-prob")
        indices = self.stochastic_indices
        if not indices:
            raise FlowGrpoError("a schedule needs at least one stochastic step")
        if indices != tuple(range(indices[0], indices[-1] + 1)):
            raise FlowGrpoError(
                f"stochastic steps {indices} are not one contiguous run: "
                "a trajectory stores the latents around one run of steps"
            )

    @property
    def stochastic_indices(self) -> tuple[int, ...]:
        """Step indices of the stochastic steps, in order (the trajectory's T steps)."""
        return tuple(i for i, s in enumerate(self.stochastic) if s)

    @property
    def trained_indices(self) -> tuple[int, ...]:
        """Step indices of the trained steps, in order."""
        return tuple(i for i, t in enumerate(self.trained) if t)

    @property
    def num_stochastic(self) -> int:
        """T: log-probs and sigmas stored per trajectory; it stores T + 1 latents."""
        return len(self.stochastic_indices)

    @property
    def first_stochastic(self) -> int:
        """Step index of the trajectory's first stored latent (before the first SDE step)."""
        return self.stochastic_indices[0]

    @property
    def trained_positions(self) -> tuple[int, ...]:
        """Positions of the trained steps within the trajectory's T stored steps.

        Trained step at position p goes from stored latent p to stored latent p + 1.
        """
        return tuple(i - self.first_stochastic for i in self.trained_indices)


def build_step_schedule(
    num_steps: int,
    *,
    train_fraction: float = 1.0,
    train_last_step: bool = False,
    window_size: int | None = None,
    window_range: Sequence[int] | None = None,
    rng: random.Random | None = None,
) -> StepSchedule:
    """Build the schedule; see the module docstring for the options.

    window_size None or 0: every step stochastic (the config's 0 means the same).
    window_range None or empty: the window starts at step 0. A random start needs ``rng``;
    seed it per iteration, identically on every rank, so all ranks sample the same window.
    """
    if num_steps < 1:
        raise FlowGrpoError(f"num_steps={num_steps}: must be >= 1")
    if not 0.0 < train_fraction <= 1.0:
        raise FlowGrpoError(f"train_fraction={train_fraction}: must be in (0, 1]")

    window = _window(num_steps, window_size, window_range, train_last_step, rng)
    stochastic = tuple(i in window for i in range(num_steps))
    trainable = [i for i in window if train_last_step or i < num_steps - 1]
    if not trainable:
        raise FlowGrpoError(
            f"no step left to train in a {num_steps}-step schedule: only the last step is "
            "stochastic and train_last_step is off; use more steps or train_last_step=True"
        )
    count = math.ceil(train_fraction * len(trainable) - _FRACTION_SLACK)
    trained_set = set(trainable[:count])
    trained = tuple(i in trained_set for i in range(num_steps))
    return StepSchedule(num_steps=num_steps, stochastic=stochastic, trained=trained)


def _window(
    num_steps: int,
    window_size: int | None,
    window_range: Sequence[int] | None,
    train_last_step: bool,
    rng: random.Random | None,
) -> range:
    """The stochastic steps: all of them, or a validated window of window_size steps."""
    if not window_size:
        if window_range:
            raise FlowGrpoError("window_range is set but window_size is not: set both or neither")
        return range(num_steps)
    if not 1 <= window_size <= num_steps:
        raise FlowGrpoError(
            f"window_size={window_size}: must be in [1, {num_steps}] (the number of steps), "
            "or 0 for no window"
        )
    starts = _window_starts(window_range)
    last_start = num_steps - window_size
    if starts.start < 0 or starts.stop - 1 > last_start:
        raise FlowGrpoError(
            f"window_range=({starts.start}, {starts.stop - 1}): the window's first step must "
            f"stay in [0, {last_start}] so a {window_size}-step window fits in {num_steps} steps"
        )
    if window_size == 1 and num_steps - 1 in starts and not train_last_step:
        raise FlowGrpoError(
            f"window_range=({starts.start}, {starts.stop - 1}) lets a 1-step window fall on the "
            f"last step, which is not trained: end the range at {num_steps - 2} or set "
            "train_last_step=True"
        )
    if len(starts) > 1 and rng is None:
        raise FlowGrpoError(
            f"window_range=({starts.start}, {starts.stop - 1}) draws the window's first step "
            "at random: pass rng"
        )
    # One allowed start draws nothing: the generator's state stays as it was.
    start = rng.choice(starts) if rng is not None and len(starts) > 1 else starts[0]
    return range(start, start + window_size)


def _window_starts(window_range: Sequence[int] | None) -> range:
    """(lo, hi), both inclusive -> range of allowed first steps; None or empty -> step 0."""
    if not window_range:
        return range(1)
    if len(window_range) != 2 or window_range[1] < window_range[0]:
        raise FlowGrpoError(
            f"window_range={list(window_range)}: must be (lo, hi) with lo <= hi, the range of "
            "the window's first step, both inclusive"
        )
    return range(int(window_range[0]), int(window_range[1]) + 1)


WINDOW_ENDS: tuple[str, ...] = ("stay", "shrink", "roll_back")


@dataclass(frozen=True)
class WindowMotion:
    """How MixGRPO's SDE window moves with training (Tencent-Hunyuan/MixGRPO,
    fastvideo/utils/grpo_states.py `GRPOTrainingStates`): its first step starts at `lowest` and
    moves `stride` steps each time it has stayed its stay. The stay at a window start s:

    - progressive: `shift_every` iterations;
    - decay: int(shift_every (1 - p) + shift_every_min p), at least shift_every_min, with
      p = s / (num_steps - 2) (their `max_timesteps`);
    - exp_decay: ceil(shift_every exp(-decay_rate max(0, s - decay_threshold))).

    What happens at the end, `end`:

    - "stay": a move past `highest` stops there, and the window keeps its size (flowgrpo's
      default, where `highest` defaults to num_steps - size - 1);
    - "shrink": their code without `--roll_back`. The window's steps stop before step
      num_steps - 2 (their `get_current_timesteps`: range(s, min(s + size, max_timesteps))),
      so it shrinks as s passes num_steps - 2 - size; a move past `highest` (at most
      num_steps - 3, the last start that keeps a step) stops there;
    - "roll_back": their `--roll_back`, in their scripts: as "shrink", but a move past
      `highest` restarts the window at `lowest` (`roll_back_start`).

    Their code lets s reach num_steps - 2 itself, an empty window on which their update fails
    (`ratio` is never assigned, train_grpo_flux.py); here `highest` stops one step short.
    """

    lowest: int
    highest: int
    shift_every: int
    stride: int
    schedule: str = "progressive"
    shift_every_min: int = 1
    decay_threshold: int = 13
    decay_rate: float = 0.1
    num_steps: int = 0  # decay, shrink and roll_back: their max_timesteps is num_steps - 2
    end: str = "stay"

    def stay(self, start: int) -> int:
        """Iterations the window stays at `start` before it moves."""
        if self.schedule == "progressive":
            return self.shift_every
        if self.schedule == "decay":
            progress = start / max(self.num_steps - 2, 1)
            linear = int(self.shift_every * (1 - progress) + self.shift_every_min * progress)
            return max(self.shift_every_min, linear)
        if self.schedule == "exp_decay":
            excess = max(0, start - self.decay_threshold)
            return max(1, math.ceil(self.shift_every * math.exp(-self.decay_rate * excess)))
        raise FlowGrpoError(
            f"window schedule {self.schedule!r}: must be progressive, decay or exp_decay"
        )

    def start(self, iteration: int) -> int:
        """The window's first step at `iteration`: its start after `iteration` updates."""
        if self.end not in WINDOW_ENDS:
            raise FlowGrpoError(f"window end {self.end!r}: must be one of {list(WINDOW_ENDS)}")
        roll_back = self.end == "roll_back" and self.stride > 0
        if self.schedule == "progressive":  # the closed forms of the walk below
            moves = iteration // self.shift_every
            if roll_back:
                positions = (self.highest - self.lowest) // self.stride + 1
                return self.lowest + (moves % positions) * self.stride
            return min(self.lowest + moves * self.stride, self.highest)
        start, stayed = self.lowest, 0
        for _ in range(iteration):
            if not roll_back and (start >= self.highest or self.stride == 0):
                break  # it stays there for good
            stayed += 1
            if stayed >= self.stay(start):
                start, stayed = start + self.stride, 0
                if start > self.highest:
                    start = self.lowest if roll_back else self.highest
        return start

    def window(self, iteration: int, size: int) -> range:
        """The window's steps at `iteration`: `size` steps from its start, cut before step
        num_steps - 2 unless `end` is "stay"."""
        start = self.start(iteration)
        stop = start + size
        if self.end != "stay":
            stop = min(stop, self.num_steps - 2)
        return range(start, stop)
