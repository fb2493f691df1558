"""MixGRPO (Li et al. 2025): Flow-GRPO's loss on an SDE window that slides along the steps as
training goes, ODE steps outside it (the window's motion: algorithm/schedule.py)."""

from __future__ import annotations

from flowgrpo_cli.algorithm.schedule import WindowMotion
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.training.algorithms.flow_grpo import FlowGrpo


class MixGrpo(FlowGrpo):
    name = "mixgrpo"

    def check(self) -> None:
        super().check()
        self._require_window()

    def _require_window(self) -> None:
        if not self.config.sampler.window_size:
            raise FlowGrpoError(
                'algorithm.name = "mixgrpo" slides an SDE window: set sampler.window_size '
                "(its paper: 4 of 25 steps)"
            )

    def window_range(self, iteration: int) -> tuple[int, int] | None:
        """The window's start at `iteration`, where MixGRPO's progressive motion has it."""
        self._require_window()
        sampler = self.config.sampler
        configured = super().window_range(iteration)
        lowest, highest = configured or (0, sampler.num_steps - sampler.window_size - 1)
        motion = WindowMotion(
            lowest=lowest,
            highest=max(lowest, highest),
            shift_every=sampler.window_shift_every,
            stride=sampler.window_stride,
            schedule=sampler.window_schedule,
            shift_every_min=sampler.window_shift_every_min,
            decay_threshold=sampler.window_decay_threshold,
            decay_rate=sampler.window_decay_rate,
            num_steps=sampler.num_steps,
        )
        start = motion.start(iteration)
        return (start, start)
