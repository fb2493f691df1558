"""MixGRPO (Li et al. 2025): Flow-GRPO's loss on an SDE window that slides along the steps as
training goes, ODE steps outside it (the window's motion: algorithm/schedule.py)."""

from __future__ import annotations

from flowgrpo_cli.algorithm.schedule import StepSchedule, WindowMotion, build_step_schedule
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.training.algorithms.flow_grpo import FlowGrpo


class MixGrpo(FlowGrpo):
    name = "mixgrpo"
    slides_window = True

    def check(self) -> None:
        super().check()
        self.motion()

    def step_schedule(self, iteration: int) -> StepSchedule:
        """The window at `iteration`, where the motion has it; with `sampler.window_end`
        "shrink" or "roll_back" it may hold fewer than window_size steps near the end."""
        sampler = self.config.sampler
        window = self.motion().window(iteration, sampler.window_size)
        return build_step_schedule(
            sampler.num_steps,
            train_fraction=sampler.train_fraction,
            train_last_step=sampler.train_last_step,
            window_size=len(window),
            window_range=(window.start, window.start),
        )

    def window_range(self, iteration: int) -> tuple[int, int] | None:
        """The window's start at `iteration`, where MixGRPO's motion has it."""
        start = self.motion().start(iteration)
        return (start, start)

    def motion(self) -> WindowMotion:
        """The window's motion, from the sampler keys; refuses a window it cannot slide."""
        sampler = self.config.sampler
        if not sampler.window_size:
            raise FlowGrpoError(
                'algorithm.name = "mixgrpo" slides an SDE window: set sampler.window_size '
                "(its paper: 4 of 25 steps)"
            )
        steps, size = sampler.num_steps, sampler.window_size
        cut = sampler.window_end != "stay"  # the window stops before step num_steps - 2
        last = steps - 3 if cut else steps - size - 1
        lowest, highest = super().window_range(0) or (0, last)
        highest = max(lowest, highest)
        if cut and highest > steps - 3:
            raise FlowGrpoError(
                f"sampler.window_range = [{lowest}, {highest}] with sampler.window_end = "
                f"{sampler.window_end!r}: the window's steps stop before step {steps - 2} "
                f"(num_steps - 2, as MixGRPO's max_timesteps), so its start must stay at or "
                f"below {steps - 3}"
            )
        return WindowMotion(
            lowest=lowest,
            highest=highest,
            shift_every=sampler.window_shift_every,
            stride=sampler.window_stride,
            schedule=sampler.window_schedule,
            shift_every_min=sampler.window_shift_every_min,
            decay_threshold=sampler.window_decay_threshold,
            decay_rate=sampler.window_decay_rate,
            num_steps=steps,
            end=sampler.window_end,
        )
