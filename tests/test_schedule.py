"""Which steps are stochastic and trained, for each option, against hand-written schedules."""

import random

import pytest

from flowgrpo_cli.algorithm.schedule import StepSchedule, build_step_schedule
from flowgrpo_cli.errors import FlowGrpoError

T, F = True, False


def test_default_every_step_stochastic_all_but_the_last_trained():
    s = build_step_schedule(10)
    assert s.stochastic == (T,) * 10
    assert s.trained == (T,) * 9 + (F,)  # the paper trains 9 of 10
    assert s.stochastic_indices == tuple(range(10)) and s.num_stochastic == 10
    assert s.trained_indices == tuple(range(9))
    assert s.first_stochastic == 0 and s.trained_positions == tuple(range(9))


def test_train_last_step():
    assert build_step_schedule(4, train_last_step=True).trained == (T, T, T, T)


@pytest.mark.parametrize(
    ("fraction", "count"),
    [(1.0, 9), (0.5, 5), (0.3, 3), (0.1, 1), (0.01, 1), (2 / 9, 2)],
    # ceil(f * 9): 4.5 -> 5, 2.7 -> 3, 0.9 -> 1, 0.09 -> 1; 2/9 * 9 = 2.0000000000000004 -> 2
)
def test_train_fraction_trains_the_first_ceil_share(fraction, count):
    s = build_step_schedule(10, train_fraction=fraction)
    assert s.stochastic == (T,) * 10
    assert s.trained_indices == tuple(range(count))


def test_fixed_window():
    s = build_step_schedule(10, window_size=3, window_range=(2, 2))
    assert s.stochastic == (F, F, T, T, T, F, F, F, F, F)
    assert s.trained == s.stochastic  # the last step is outside the window
    assert s.first_stochastic == 2 and s.trained_positions == (0, 1, 2)


def test_window_without_range_starts_at_step_zero():
    s = build_step_schedule(6, window_size=2)
    assert s.stochastic == (T, T, F, F, F, F)


def test_window_at_the_end_does_not_train_the_last_step():
    s = build_step_schedule(5, window_size=2, window_range=(3, 3))
    assert s.stochastic == (F, F, F, T, T)
    assert s.trained == (F, F, F, T, F)
    assert s.trained_positions == (0,)


def _window_starts(seed, draws=400):
    rng = random.Random(seed)
    return [
        build_step_schedule(10, window_size=2, window_range=(1, 4), rng=rng).first_stochastic
        for _ in range(draws)
    ]


def test_random_window_start_is_uniform_over_the_range_and_reproducible():
    starts = _window_starts(0)
    assert set(starts) == {1, 2, 3, 4}  # both ends of the range included
    assert all(70 <= starts.count(k) <= 130 for k in (1, 2, 3, 4))  # 100 expected each
    assert _window_starts(0) == starts
    assert _window_starts(1) != starts


def test_window_with_train_fraction():
    s = build_step_schedule(10, window_size=4, window_range=(3, 3), train_fraction=0.5)
    assert s.stochastic_indices == (3, 4, 5, 6)
    assert s.trained_indices == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_steps": 0}, "num_steps=0"),
        ({"num_steps": 10, "train_fraction": 0.0}, r"must be in \(0, 1\]"),
        ({"num_steps": 10, "train_fraction": 1.5}, r"must be in \(0, 1\]"),
        ({"num_steps": 1}, "no step left to train"),
        ({"num_steps": 10, "window_size": 11}, r"must be in \[1, 10\]"),
        ({"num_steps": 10, "window_size": 3, "window_range": (0, 8)}, r"stay in \[0, 7\]"),
        ({"num_steps": 10, "window_size": 3, "window_range": (4, 2)}, "lo <= hi"),
        ({"num_steps": 10, "window_size": 3, "window_range": (1, 2, 3)}, "must be"),
        ({"num_steps": 10, "window_size": 1, "window_range": (7, 9)}, "end the range at 8"),
        ({"num_steps": 10, "window_size": 2, "window_range": (0, 4)}, "pass rng"),
        ({"num_steps": 10, "window_range": (0, 4)}, "window_size is not"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs, message):
    with pytest.raises(FlowGrpoError, match=message):
        build_step_schedule(**kwargs)


def test_schedule_invariants_are_checked():
    with pytest.raises(FlowGrpoError, match="contiguous"):
        StepSchedule(num_steps=3, stochastic=(T, F, T), trained=(F, F, F))
    with pytest.raises(FlowGrpoError, match="must be stochastic"):
        StepSchedule(num_steps=2, stochastic=(T, F), trained=(F, T))
    with pytest.raises(FlowGrpoError, match="needs 3"):
        StepSchedule(num_steps=3, stochastic=(T, T), trained=(T, F))
