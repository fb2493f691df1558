"""MixGRPO as its authors run it (Tencent-Hunyuan/MixGRPO, scripts/finetune/
finetune_flux_grpo_MixGRPO*.sh, fastvideo/train_grpo_flux.py, fastvideo/utils/grpo_states.py):
the options that reproduce their recipe, against values worked out by hand and a port of their
window's state machine, and a check that configs which do not set them hash as before."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import do_rollout, do_score

from flowgrpo_cli.algorithm.advantages import compute_advantages
from flowgrpo_cli.algorithm.schedule import WindowMotion
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.stages import update
from flowgrpo_cli.store.config import config_hash, load_config
from flowgrpo_cli.store.contract import RolloutManifest
from flowgrpo_cli.store.rundir import ROLLOUT
from flowgrpo_cli.training.algorithms import algorithm_for

REPO = Path(__file__).resolve().parents[1]

# -- the window ------------------------------------------------------------------------------


class TheirWindow:
    """A port of GRPOTrainingStates (fastvideo/utils/grpo_states.py) as their scripts build it
    (train_grpo_flux.py: cur_timestep 0, max_timesteps = sampling_steps - 2, prog_overlap on):
    `update_iteration` for progressive, decay and exp_decay, and `get_current_timesteps`."""

    def __init__(
        self, iters: int, size: int, steps: int, strategy: str = "progressive", *,
        overlap_step: int = 1, min_iters: int = 1, roll_back: bool = False,
    ) -> None:  # fmt: skip
        self.iters, self.size, self.max = iters, size, steps - 2
        self.strategy, self.overlap_step, self.roll_back = strategy, overlap_step, roll_back
        self.min_iters, self.cur, self.in_group = min_iters, 0, 0

    def current(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.size, self.max)))

    def _iters(self) -> float:
        if self.strategy == "decay":  # max_iters_per_group = iters here
            progress = self.cur / self.max
            return max(self.min_iters, int(self.iters * (1 - progress) + self.min_iters * progress))
        if self.strategy == "exp_decay":
            return float(np.ceil(self.iters * np.exp(-0.1 * max(0, self.cur - 13))))
        return self.iters

    def update(self) -> None:
        self.in_group += 1
        if self.in_group >= self._iters():
            self.in_group = 0
            self.cur += self.overlap_step
        if self.cur > self.max:
            if self.roll_back:
                self.cur, self.in_group = 0, 0
            else:
                self.cur = self.max


def their_windows(count: int, *args, **kwargs) -> list[list[int]]:
    """Their window at each of `count` iterations (get_current_timesteps, then update)."""
    states, out = TheirWindow(*args, **kwargs), []
    for _ in range(count):
        out.append(states.current())
        states.update()
    return out


def motion(end: str, steps: int = 8, size: int = 3, **kw) -> WindowMotion:
    highest = steps - size - 1 if end == "stay" else steps - 3  # MixGrpo's defaults
    return WindowMotion(lowest=0, highest=highest, num_steps=steps, end=end, **kw)


# 8 steps (their max_timesteps = 6), a 3-step window moving one step every 2 iterations.
BY_HAND = {
    "stay": [[0, 1, 2]] * 2 + [[1, 2, 3]] * 2 + [[2, 3, 4]] * 2 + [[3, 4, 5]] * 2
    + [[4, 5, 6]] * 8,
    "shrink": [[0, 1, 2]] * 2 + [[1, 2, 3]] * 2 + [[2, 3, 4]] * 2 + [[3, 4, 5]] * 2
    + [[4, 5]] * 2 + [[5]] * 6,
    "roll_back": [[0, 1, 2]] * 2 + [[1, 2, 3]] * 2 + [[2, 3, 4]] * 2 + [[3, 4, 5]] * 2
    + [[4, 5]] * 2 + [[5]] * 2 + [[0, 1, 2]] * 2 + [[1, 2, 3]] * 2,
}  # fmt: skip


@pytest.mark.parametrize("end", sorted(BY_HAND))
def test_window_positions_by_hand(end):
    walk = motion(end, shift_every=2, stride=1)
    assert [list(walk.window(k, 3)) for k in range(16)] == BY_HAND[end]


@pytest.mark.parametrize("end", sorted(BY_HAND))
def test_mixgrpo_trains_the_windows_by_hand(make_run, end):
    config, _ = make_run("algorithm.name=mixgrpo", "sampler.num_steps=8",
                         "sampler.window_size=3", "sampler.window_shift_every=2",
                         f"sampler.window_end={end}", name=end)  # fmt: skip
    method = algorithm_for(config)
    method.check()
    schedules = [method.step_schedule(k) for k in range(16)]
    assert [list(s.stochastic_indices) for s in schedules] == BY_HAND[end]
    assert [list(s.trained_indices) for s in schedules] == BY_HAND[end]


@pytest.mark.parametrize("strategy", ["progressive", "decay", "exp_decay"])
@pytest.mark.parametrize("stride", [1, 2, 0])
def test_the_window_is_theirs_without_the_empty_ones(strategy, stride):
    """With --roll_back, their window is ours once the windows on which their update fails
    are left out: at s = num_steps - 2 it is empty, `ratio` is never assigned and
    train_one_step raises. Without it, theirs is ours until that empty window, where ours
    stays at its last step."""
    steps, size, iters = 25, 4, 3 if strategy == "progressive" else 12
    kw = {"schedule": strategy, "shift_every_min": 1, "decay_threshold": 13, "decay_rate": 0.1}
    count = 400
    theirs = their_windows(count, iters, size, steps, strategy, overlap_step=stride,
                           roll_back=True)  # fmt: skip
    ours = motion("roll_back", steps, size, shift_every=iters, stride=stride, **kw)
    mine = [list(ours.window(k, size)) for k in range(count)]
    kept = [w for w in theirs if w]
    assert mine[: len(kept)] == kept
    if stride == 1:  # 1 step per move lands on the empty window; 2 steps jump past it
        assert len(kept) < count
    theirs = their_windows(count, iters, size, steps, strategy, overlap_step=stride)
    ours = motion("shrink", steps, size, shift_every=iters, stride=stride, **kw)
    mine = [list(ours.window(k, size)) for k in range(count)]
    first_empty = next((k for k, w in enumerate(theirs) if not w), count)
    assert mine[:first_empty] == theirs[:first_empty]
    assert all(w == mine[first_empty - 1] for w in mine[first_empty:])


def test_their_script_window_reaches_its_end_after_500_iterations():
    """finetune_flux_grpo_MixGRPO.sh: 25 steps, window 4, iters_per_group 25, stride 1. The
    window first shrinks at iteration 21 * 25 = 525 ([21, 22]); their update fails at
    23 * 25 = 575; with --roll_back, flowgrpo restarts it there."""
    walk = motion("roll_back", 25, 4, shift_every=25, stride=1)
    assert list(walk.window(499, 4)) == [19, 20, 21, 22]
    assert list(walk.window(500, 4)) == [20, 21, 22]
    assert list(walk.window(525, 4)) == [21, 22]
    assert list(walk.window(574, 4)) == [22]
    assert list(walk.window(575, 4)) == [0, 1, 2, 3]
    assert their_windows(576, 25, 4, 25, roll_back=True)[575] == []


def test_window_end_is_refused_where_it_means_nothing(make_run):
    config, _ = make_run("sampler.window_size=2", "sampler.window_end=roll_back")
    with pytest.raises(FlowGrpoError, match="window_end"):
        algorithm_for(config).check()
    config, _ = make_run("algorithm.name=mixgrpo", "sampler.num_steps=8",
                         "sampler.window_size=3", "sampler.window_range=[0, 6]",
                         "sampler.window_end=shrink", name="far")  # fmt: skip
    with pytest.raises(FlowGrpoError, match="at or below 5"):
        algorithm_for(config).check()


# -- advantages ------------------------------------------------------------------------------


def test_bessel_std_advantages_by_hand():
    """Group 0, [1, 2, 3, 6]: mean 3, squares 4 + 1 + 0 + 9 = 14, std sqrt(14 / 3) with
    n - 1 (sqrt(14 / 4) with n). Group 1 is flat and group 2 has one image: both 0."""
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 5.0, 7.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    for ddof, variance in ((1, 14 / 3), (0, 14 / 4)):
        got = compute_advantages(rewards, groups, std_mode="group", ddof=ddof, clip=None)
        std = math.sqrt(variance) + 1e-4
        expected = [-2 / std, -1 / std, 0.0, 3 / std, 0.0, 0.0, 0.0]
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))


def test_bessel_std_over_the_iteration_by_hand():
    """[1, 3] and [5, 7]: group means 2 and 6, so A = +-1 / std; the iteration's mean is 4,
    its squares 9 + 1 + 1 + 9 = 20: std sqrt(20 / 3) with n - 1, sqrt(5) with n."""
    rewards, groups = torch.tensor([1.0, 3.0, 5.0, 7.0]), torch.tensor([0, 0, 1, 1])
    for ddof, std in ((1, math.sqrt(20 / 3)), (0, math.sqrt(5))):
        got = compute_advantages(rewards, groups, std_mode="global", ddof=ddof)
        a = 1 / (std + 1e-4)
        torch.testing.assert_close(got, torch.tensor([-a, a, -a, a]))
    one = compute_advantages(torch.tensor([2.0]), torch.tensor([0]), std_mode="global", ddof=1)
    assert one.tolist() == [0.0]


def test_a_group_of_12_scales_by_sqrt_11_over_12():
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    groups = torch.zeros(12, dtype=torch.long)
    bessel = compute_advantages(rewards, groups, std_mode="group", ddof=1, eps=0.0, clip=None)
    population = compute_advantages(rewards, groups, std_mode="group", eps=0.0, clip=None)
    torch.testing.assert_close(bessel, population * math.sqrt(11 / 12))


def test_the_update_takes_the_bessel_std(make_run):
    """Groups of 2 images, rewards a and b: A = +-(|a - b| / 2) / (|a - b| / sqrt(2) + 1e-4),
    about +-1 / sqrt(2), where the population std gives about +-1."""
    config, run = make_run("algorithm.advantage_std=group", "algorithm.advantage_std_ddof=1")
    do_rollout(config, run)
    do_score(config, run)
    version = RolloutManifest.read(run.stage_dir(0, ROLLOUT)).policy_version
    data = update.load_iteration(config, run, 0, version)
    by_group: dict[int, list[tuple[float, float]]] = {}
    for group, reward, advantage in zip(*(data.table.column(c).to_pylist()
                                          for c in ("group_id", "reward", "advantage")),
                                        strict=True):  # fmt: skip
        by_group.setdefault(group, []).append((reward, advantage))
    assert sorted(len(pairs) for pairs in by_group.values()) == [2, 2]
    for (a, advantage_a), (b, advantage_b) in by_group.values():
        expected = (a - b) / 2 / (abs(a - b) / math.sqrt(2) + 1e-4)
        assert advantage_a == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert advantage_b == pytest.approx(-expected, rel=1e-5, abs=1e-6)


# -- configs that do not set the new keys ----------------------------------------------------

# config_hash of each example before these keys existed (commit e5f1c0b), its paths as the file
# writes them. The FLUX MixGRPO recipes are left out: they set these keys, on purpose.
HASHES_BEFORE = {
    "defaults": "dbe6feaca0e2d3aa",
    "examples/flux_dev_ocr.toml": "b67da2d598b5ff37",
    "examples/qwen_image_ocr.toml": "9d9a499525bd15b3",
    "examples/sd35m_ocr.toml": "9a70315720f6af25",
    "examples/sd35m_ocr_awm.toml": "0c6bc908fc52270a",
    "examples/sd35m_ocr_grpo_guard.toml": "3506385523e5b384",
    "examples/sd35m_ocr_nft.toml": "e7167b002ecedfe6",
    "examples/sd35m_ocr_pickscore.toml": "02b8d532f1498ad6",
    "examples/tiny.toml": "20d0f3c1bf345653",
    "examples/toy_ocr/rl.toml": "4e14a8dd89d29352",
    "examples/toy_ocr/rl_awm.toml": "14ec0ed024ec5b7e",
    "examples/toy_ocr/rl_grpo_guard.toml": "2b21917b75169c29",
    "examples/toy_ocr/rl_mixgrpo.toml": "fd3fe8951092ee00",
    "examples/toy_ocr/rl_nft.toml": "61417422924e721b",
}
NEW_KEYS_AT_DEFAULT = ('sampler.window_end="stay"', "algorithm.advantage_std_ddof=0")


def as_written(section, folder: Path):
    """The config with its paths as written: relative to the file's folder (inputs) or to
    the working directory (run.dir), so a hash does not depend on where the checkout is."""
    changes = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            changes[f.name] = as_written(value, folder)
        elif f.metadata.get("path"):
            base = Path.cwd() if f.metadata["path"] == "output" else folder

            def relative(path: str, base: Path = base) -> str:
                return os.path.relpath(path, base) if path and os.path.isabs(path) else path

            changes[f.name] = (
                [relative(p) for p in value] if isinstance(value, list) else relative(value)
            )
    return dataclasses.replace(section, **changes)


@pytest.mark.parametrize("name", sorted(HASHES_BEFORE))
def test_configs_without_the_new_keys_hash_as_before(name, monkeypatch):
    monkeypatch.chdir(REPO)
    path = None if name == "defaults" else REPO / name
    folder = REPO if path is None else path.parent
    assert config_hash(as_written(load_config(path), folder)) == HASHES_BEFORE[name]
    with_keys = load_config(path, NEW_KEYS_AT_DEFAULT)
    assert config_hash(as_written(with_keys, folder)) == HASHES_BEFORE[name]
