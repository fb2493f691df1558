"""MixGRPO-Flash's sampler after the SDE window: DPM-Solver++ (2M) steps on a compressed
schedule, checked by hand, against Euler, and against the exact flow of Gaussian data; then in
the rollout sampler and through a training iteration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from helpers import do_iteration

from flowgrpo_cli.algorithm.dpm_solver import (
    compressed_sigmas,
    data_prediction,
    dpm_solver_pp_step,
)
from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.algorithm.sde import ode_step
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.stages import rollout
from flowgrpo_cli.store.contract import RolloutManifest, SamplerSettings
from flowgrpo_cli.store.rundir import ROLLOUT


def test_the_first_order_step_is_the_euler_step():
    generator = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 4, 5, generator=generator), torch.randn(3, 4, 5, generator=generator)
    for sigma, following in [(1.0, 0.9), (0.6, 0.4), (0.3, 0.0)]:
        got = dpm_solver_pp_step(x, data_prediction(x, v, sigma), sigma, following)
        euler = ode_step(x, v, torch.full((3,), sigma), torch.full((3,), following)).next_latents
        torch.testing.assert_close(got, euler, atol=1e-6, rtol=1e-6)


def test_the_second_order_step_by_hand():
    # sigma 0.8 -> 0.6 -> 0.4; x = 1, data predictions m1 = 0.3 (at 0.8), m0 = 0.5 (at 0.6).
    # lambda = log((1 - s) / s): -log 4, -log 1.5, log 1.5, so h = 2 log 1.5,
    # r0 = (log 4 - log 1.5) / (2 log 1.5) = 1.2095113, exp(-h) = 1 / 2.25.
    # first order: (0.4 / 0.6) 1 + 0.6 (1 - 1 / 2.25) 0.5 = 2/3 + 1/6 = 0.8333333
    # correction: 0.5 * 0.6 * (1 - 1 / 2.25) * (0.5 - 0.3) / 1.2095113 = 0.0275592
    x, m0, m1 = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([0.3])
    assert dpm_solver_pp_step(x, m0, 0.6, 0.4).item() == pytest.approx(0.8333333, abs=1e-6)
    second = dpm_solver_pp_step(x, m0, 0.6, 0.4, previous=(m1, 0.8))
    assert second.item() == pytest.approx(0.8608925, abs=1e-6)
    # No usable history: the prediction before was made at sigma 1 (lambda = -inf).
    assert dpm_solver_pp_step(x, m0, 0.6, 0.4, previous=(m1, 1.0)).item() == pytest.approx(
        0.8333333, abs=1e-6
    )
    # The last step lands on the data prediction.
    assert dpm_solver_pp_step(x, m0, 0.6, 0.0, previous=(m1, 0.8)).item() == 0.5


def _gaussian_velocity(x: torch.Tensor, sigma: float, mean: float, std: float) -> torch.Tensor:
    """E[eps - x0 | x_sigma = x] for x0 ~ N(mean, std^2), x_sigma = (1 - sigma) x0 + sigma eps."""
    variance = (1 - sigma) ** 2 * std**2 + sigma**2
    centred = x - (1 - sigma) * mean
    return sigma / variance * centred - (mean + (1 - sigma) * std**2 / variance * centred)


def _shifted(points: int, shift: float = 3.0) -> list[float]:
    """SD3's schedule: shift(t) at `points` times evenly spaced from 1 to 0."""
    ts = [1 - i / (points - 1) for i in range(points)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def _errors(steps: int) -> tuple[float, float]:
    """Euler's and DPM-Solver++'s largest error against the exact flow of Gaussian data,
    x_sigma = (1 - sigma) mean + sqrt(V(sigma)) z, from sigma 1 to sigma 0.25 on SD3's
    shift-3 schedule. It stops above 0: the step to 0 is first order in both (it lands on
    the data prediction) and would hide the difference."""
    mean, std = 0.7, 0.2
    z = torch.linspace(-2, 2, 9, dtype=torch.float64)
    sigmas = [3 * t / (1 + 2 * t) for t in (1 - 0.9 * i / steps for i in range(steps + 1))]
    end = sigmas[-1]
    exact = (1 - end) * mean + math.sqrt((1 - end) ** 2 * std**2 + end**2) * z
    euler, dpm, previous = z.clone(), z.clone(), None
    for sigma, following in itertools.pairwise(sigmas):
        euler = euler + (following - sigma) * _gaussian_velocity(euler, sigma, mean, std)
        prediction = data_prediction(dpm, _gaussian_velocity(dpm, sigma, mean, std), sigma)
        dpm = dpm_solver_pp_step(dpm, prediction, sigma, following, previous).double()
        previous = (prediction.double(), sigma)
    return (euler - exact).abs().max().item(), (dpm - exact).abs().max().item()


def test_dpm_solver_converges_at_second_order_euler_at_first():
    euler_20, dpm_20 = _errors(20)
    euler_40, dpm_40 = _errors(40)
    assert 1.8 < euler_20 / euler_40 < 2.2  # halving the step halves Euler's error
    assert 3.5 < dpm_20 / dpm_40 < 4.5  # and quarters the second-order solver's
    assert dpm_40 < euler_40 / 5


def test_compressed_sigmas_match_mixgrpo_flash_on_its_schedule():
    """MixGRPO-Flash: 25 steps on shift(linspace(1, 0, 26)), window ending at step 3, ratio 0.4:
    int((26 - 1 - 3) * 0.4) = 8 points from linspace(1, 0, 26)[4] = 0.84, shifted."""
    full = _shifted(26)
    theirs = [3 * t / (1 + 2 * t) for t in [0.84 * (1 - i / 7) for i in range(8)]]
    ours = compressed_sigmas(full[4], remaining_steps=25 - 4, ratio=0.4, shift=3.0)
    assert ours == pytest.approx(theirs, abs=1e-7)
    assert ours[0] == full[4] and ours[-1] == 0.0
    # Unshifted (s = 1): evenly spaced sigmas; a ratio that rounds below 2 points keeps 2.
    assert compressed_sigmas(0.5, 7, 0.5, 1.0) == pytest.approx([0.5, 1 / 3, 1 / 6, 0.0])
    assert compressed_sigmas(0.5, 2, 0.2, 1.0) == [0.5, 0.0]
    assert compressed_sigmas(0.5, 3, 1.0, 1.0) == pytest.approx([0.5, 1 / 3, 1 / 6, 0.0])


def test_bad_arguments_are_refused():
    with pytest.raises(FlowGrpoError, match=r"post_window_compress = 0.0: must be in \(0, 1\]"):
        compressed_sigmas(0.5, 3, 0.0, 3.0)
    with pytest.raises(FlowGrpoError, match="sigma_next < sigma"):
        dpm_solver_pp_step(torch.zeros(1), torch.zeros(1), 0.4, 0.6)
    assert math.isfinite(dpm_solver_pp_step(torch.ones(1), torch.ones(1), 1.0, 0.5).item())


# ---------------------------------------------------------------------------------------------
# In the rollout sampler


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_time_shift_is_the_one_each_familys_schedule_applies(tiny_adapter, family):
    """Undoing sigma = s t / (1 + (s - 1) t) with the adapter's s gives the evenly spaced
    times every family's scheduler starts from, so a compressed tail lies on the same grid."""
    adapter = tiny_adapter(family)
    shift = adapter.time_shift(64, 64)
    sigmas = adapter.sigmas(8, 64, 64).double()[:-1]  # the final 0 is appended, not shifted
    times = sigmas / (shift - (shift - 1) * sigmas)
    steps = times[:-1] - times[1:]
    torch.testing.assert_close(steps, steps.mean().expand_as(steps), atol=1e-5, rtol=0)


def test_a_schedule_stretched_to_a_terminal_sigma_is_not_compressed(tiny_adapter):
    """Qwen-Image's scheduler stretches the shifted sigmas to shift_terminal, so s alone does
    not say where a redrawn point lies: compressing there is refused, with the reason."""
    with pytest.raises(FlowGrpoError, match=r"shift_terminal = 0\.02"):
        tiny_adapter("qwenimage").time_shift(64, 64)


def _flash_settings(solver: str, compress: float) -> SamplerSettings:
    return SamplerSettings(
        kind="sde", noise_level=0.7, guidance_scale=4.0, height=64, width=64,
        schedule=build_step_schedule(8, window_size=2, window_range=(0, 0)),
        post_window_solver=solver, post_window_compress=compress,
    )  # fmt: skip


class _CountingAdapter:
    """The adapter, counting its transformer calls."""

    def __init__(self, adapter):
        self.adapter, self.calls = adapter, 0

    def velocity(self, *args, **kwargs):
        self.calls += 1
        return self.adapter.velocity(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.adapter, name)


def test_flash_changes_only_the_steps_after_the_window(tiny_adapter):
    """The window's states and log-probs are Euler's bit for bit; the image is not; and the
    compressed tail takes the transformer calls its schedule says (8 steps, window 0-1:
    int(7 * 0.5) = 3 points from the sigma after the window to 0, so 2 steps)."""
    adapter = tiny_adapter("sd3")
    cond = adapter.encode_prompts(['A sign that says "OPEN"'] * 2, None, guidance_scale=4.0)
    sigmas = adapter.sigmas(8, 64, 64)

    def sample(solver, compress):
        counting = _CountingAdapter(adapter)
        out = sample_batch(counting, cond, [3, 4], _flash_settings(solver, compress), sigmas)
        return out, counting.calls

    (euler, euler_calls), (dpm, dpm_calls), (flash, flash_calls) = (
        sample("euler", 1.0), sample("dpm++2m", 1.0), sample("dpm++2m", 0.5)
    )  # fmt: skip
    assert (euler_calls, dpm_calls, flash_calls) == (8, 8, 2 + 2)
    for other in (dpm, flash):
        assert torch.equal(other.latents, euler.latents)
        assert torch.equal(other.log_probs, euler.log_probs)
        assert torch.equal(other.timesteps_next, euler.timesteps_next)
        assert (other.images - euler.images).abs().max().item() > 1e-4
    # The same schedule with Euler's steps, to compare the solvers at equal cost.
    euler_short, _ = sample("euler", 0.5)
    assert (euler_short.images - flash.images).abs().max().item() > 1e-4


def test_flash_needs_a_window_to_act_after(make_run):
    config, _ = make_run("sampler.post_window_solver=dpm++2m")
    with pytest.raises(FlowGrpoError, match=r"set sampler\.window_size"):
        rollout.sampler_settings(config, 0)
    config, _ = make_run("sampler.post_window_compress=0.4", "sampler.window_size=1",
                         "sampler.noise_level=0", name="ode")  # fmt: skip
    with pytest.raises(FlowGrpoError, match="noise_level > 0"):
        rollout.sampler_settings(config, 0)


def test_a_flash_rollout_records_its_solver_and_trains(make_run):
    """mixgrpo with MixGRPO-Flash's solver, through rollout, score and update: the manifest
    says how the images were sampled, and reads back the same."""
    config, run = make_run(
        "algorithm.name=mixgrpo", "sampler.num_steps=6", "sampler.window_size=2",
        "sampler.post_window_solver=dpm++2m", "sampler.post_window_compress=0.4",
    )  # fmt: skip
    do_iteration(config, run)
    manifest = RolloutManifest.read(run.stage_dir(0, ROLLOUT))
    assert manifest.sampler == rollout.sampler_settings(config, 0)
    assert manifest.sampler.post_window_solver == "dpm++2m"
    assert (run.checkpoint_dir(0) / "manifest.json").exists()
