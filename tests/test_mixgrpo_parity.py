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
from helpers import do_rollout, do_score, stored_rows

from flowgrpo_cli.algorithm.advantages import compute_advantages
from flowgrpo_cli.algorithm.schedule import WindowMotion
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.stages import rollout, update
from flowgrpo_cli.store.config import config_hash, load_config
from flowgrpo_cli.store.contract import RolloutManifest
from flowgrpo_cli.store.rundir import ROLLOUT
from flowgrpo_cli.store.seeding import derive_seed
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


# -- the fixed shift -------------------------------------------------------------------------


def test_fixed_shift_sigmas_are_diffusers_with_that_shift(tiny_adapter):
    """FLUX.1-dev's scheduler config, 25 steps. sampler.shift = 3: diffusers'
    FlowMatchEulerDiscreteScheduler(shift=3) on FluxPipeline's linspace(1, 1/25, 25), which is
    their sd3_time_shift(3, linspace(1, 0, 26)). Step 12 (t = 0.52): 3 * 0.52 / (1 + 2 * 0.52)
    = 1.56 / 2.04 = 0.76471. The model's own schedule at 720 x 720: 2025 tokens,
    mu = 0.5 + (2025 - 256) * 0.65 / 3840 = 0.79944, e^mu = 2.22436,
    sigma = 2.22436 / (2.22436 + 1 / 0.52 - 1) = 0.70672."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = tiny_adapter("flux")
    fixed = adapter.sigmas(25, 720, 720, shift=3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 25, 25))
    assert torch.equal(fixed, scheduler.sigmas.to(torch.float32))
    t = torch.linspace(1, 0, 26, dtype=torch.float64)
    torch.testing.assert_close(fixed.double(), 3 * t / (1 + 2 * t), rtol=0, atol=1e-6)
    assert fixed[12].item() == pytest.approx(1.56 / 2.04, abs=1e-6)
    assert adapter.sigmas(25, 720, 720)[12].item() == pytest.approx(0.70672, abs=1e-5)
    assert torch.equal(adapter.sigmas(25, 64, 64, shift=3.0), fixed)  # not by resolution
    assert adapter.time_shift(720, 720, shift=3.0) == 3.0


def test_a_fixed_shift_equal_to_sd3s_own_changes_nothing(tiny_adapter):
    adapter = tiny_adapter("sd3")  # SD3.5's scheduler: a static shift of 3 already
    assert torch.equal(adapter.sigmas(10, 64, 64, shift=3.0), adapter.sigmas(10, 64, 64))
    assert not torch.equal(adapter.sigmas(10, 64, 64, shift=1.0), adapter.sigmas(10, 64, 64))


def test_rollout_samples_along_the_fixed_shift(make_run, tiny_adapter):
    config, run = make_run("sampler.shift=3.0", family="flux")
    do_rollout(config, run)
    manifest = RolloutManifest.read(run.stage_dir(0, ROLLOUT))
    expected = tiny_adapter("flux").sigmas(3, 64, 64, shift=3.0)
    assert manifest.sampler.shift == 3.0
    assert manifest.sigmas == tuple(expected.tolist())
    rows, _ = stored_rows(run)
    assert torch.equal(rows.timesteps[0], expected[:-1])


# -- one initial noise per group -------------------------------------------------------------


def initial_noise(adapter, seed: int) -> torch.Tensor:
    return adapter.initial_latents([torch.Generator().manual_seed(seed)], 64, 64)[0]


@pytest.mark.parametrize("name", ["flow_grpo", "grpo_guard", "mixgrpo"])
def test_one_initial_noise_per_group_through_rollout(make_run, tiny_adapter, name):
    config, run = make_run(f"algorithm.name={name}", "sampler.same_noise_per_group=true",
                           "algorithm.group_size=3", "sampler.batch_size=2",
                           "sampler.window_size=2", "sampler.window_shift_every=100")  # fmt: skip
    do_rollout(config, run)
    rows, _ = stored_rows(run)
    first, second = rows.latents[:, 0], rows.latents[:, 1]  # the window starts at step 0
    adapter = tiny_adapter("sd3")
    for i, (group, prompt) in enumerate(zip(rows.group_ids, rows.prompt_indices, strict=True)):
        seed = derive_seed(config.run.seed, 0, prompt, "initial_noise")
        assert torch.equal(first[i], initial_noise(adapter, seed))
        for j, other in enumerate(rows.group_ids):
            assert torch.equal(first[i], first[j]) == (group == other)
            if j != i:  # each image keeps its own SDE noise
                assert not torch.equal(second[i], second[j])
    manifest = RolloutManifest.read(run.stage_dir(0, ROLLOUT))
    assert manifest.sampler.same_noise_per_group


@pytest.mark.parametrize("name", ["nft", "awm"])
def test_one_initial_noise_per_group_for_the_forward_process_methods(make_run, name):
    config, run = make_run(f"algorithm.name={name}", "sampler.same_noise_per_group=true",
                           "algorithm.group_size=3")  # fmt: skip
    do_rollout(config, run)
    rows, _ = stored_rows(run)  # the clean latents alone: the SDE noise tells them apart
    clean = rows.latents[:, 0]
    assert len({clean[i].sum().item() for i in range(len(rows.sample_ids))}) == 6


def test_the_default_draws_each_images_own_initial_noise(make_run, tiny_adapter):
    config, run = make_run("algorithm.group_size=3")
    do_rollout(config, run)
    rows, _ = stored_rows(run)
    adapter = tiny_adapter("sd3")
    for i, seed in enumerate(rows.seeds):
        assert torch.equal(rows.latents[i, 0], initial_noise(adapter, seed))


def test_the_group_noise_does_not_depend_on_rank_or_batch(make_run):
    config, run = make_run("sampler.same_noise_per_group=true", "algorithm.group_size=3")
    together = rollout.build_requests(config, run, 0, [0, 1])
    apart = rollout.build_requests(config, run, 0, [1]) + rollout.build_requests(
        config, run, 0, [0]
    )
    seeds = {r.sample_id: r.noise_seed for r in together}
    assert seeds == {r.sample_id: r.noise_seed for r in apart}
    assert len(set(seeds.values())) == 2  # one per group
    again, run_b = make_run("sampler.same_noise_per_group=true", "algorithm.group_size=3",
                            "sampler.batch_size=1", name="batch1")  # fmt: skip
    do_rollout(config, run)
    do_rollout(again, run_b)
    a, b = stored_rows(run)[0], stored_rows(run_b)[0]
    assert torch.equal(a.latents[:, 0], b.latents[:, 0])
    # later states: the same noise, through forwards batched differently (float32 rounding)
    assert (a.latents - b.latents).abs().max() < 1e-4


def test_one_noise_per_group_needs_step_noise(make_run):
    config, _ = make_run("sampler.same_noise_per_group=true", "sampler.noise_level=0")
    with pytest.raises(FlowGrpoError, match="noise_level > 0"):
        rollout.sampler_settings(config, 0)


# -- configs that do not set the new keys ----------------------------------------------------

# config_hash of each example before these keys existed (commit e5f1c0b), its paths as the file
# writes them. The FLUX MixGRPO recipes are left out: they set these keys, on purpose; and
# sd35m_ocr_nft.toml, which now rolls out with sampler.ode_solver (tests/test_ode_solver.py);
# and the toy trajectory configs (rl, rl_grpo_guard, rl_mixgrpo), which now sample with CPS.
HASHES_BEFORE = {
    "defaults": "dbe6feaca0e2d3aa",
    "examples/flux_dev_ocr.toml": "b67da2d598b5ff37",
    "examples/qwen_image_ocr.toml": "9d9a499525bd15b3",
    "examples/sd35m_ocr.toml": "9a70315720f6af25",
    "examples/sd35m_ocr_awm.toml": "0c6bc908fc52270a",
    "examples/sd35m_ocr_grpo_guard.toml": "3506385523e5b384",
    "examples/sd35m_ocr_pickscore.toml": "02b8d532f1498ad6",
    "examples/tiny.toml": "20d0f3c1bf345653",
    "examples/toy_ocr/rl_awm.toml": "14ec0ed024ec5b7e",
    "examples/toy_ocr/rl_nft.toml": "61417422924e721b",
}
NEW_KEYS_AT_DEFAULT = (
    'sampler.window_end="stay"',
    "sampler.shift=0.0",
    "sampler.same_noise_per_group=false",
    "algorithm.advantage_std_ddof=0",
)


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


# -- the authors' recipe, end to end -----------------------------------------------------------


def test_their_recipe_trains_through_the_shrinking_window_and_back(make_run):
    """Every option at once on the tiny FLUX: 6 steps (max_timesteps 4), a 3-step window
    moving every iteration; windows [0, 1, 2], [1, 2, 3], [2, 3], [3], then back to
    [0, 1, 2]. Each iteration trains the steps of its window."""
    from flowgrpo_cli.loop import run_loop

    config, run = make_run(
        "algorithm.name=mixgrpo", "sampler.num_steps=6", "sampler.window_size=3",
        "sampler.window_shift_every=1", "sampler.window_end=roll_back", "sampler.shift=3.0",
        "sampler.same_noise_per_group=true", "algorithm.advantage_std=group",
        "algorithm.advantage_std_ddof=1", "algorithm.drop_zero_advantage=false",
        family="flux",
    )  # fmt: skip
    run_loop(config, run, 5)
    windows = []
    for k in range(5):
        manifest = RolloutManifest.read(run.stage_dir(k, ROLLOUT))
        windows.append(list(manifest.sampler.schedule.trained_indices))
        assert (
            manifest.sampler.schedule.stochastic_indices
            == manifest.sampler.schedule.trained_indices
        )
        assert manifest.sigmas[1] == pytest.approx(3 * (5 / 6) / (1 + 2 * (5 / 6)), abs=1e-6)
    assert windows == [[0, 1, 2], [1, 2, 3], [2, 3], [3], [0, 1, 2]]
    rows, _ = stored_rows(run, 3)  # the one-step window's trajectory, still kept
    assert rows.log_probs.shape[1] == 1 and rows.trained.all()
    assert run.checkpoint_dir(4).exists()
