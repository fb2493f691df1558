"""sampler.ode_solver (and eval.ode_solver): DPM-Solver++ (2M) on every deterministic step of a
rollout. An ODE-only rollout equals diffusers' DPMSolverMultistepScheduler on the tiny models;
around an SDE window it takes the ODE steps and leaves the stochastic ones alone; nft and awm
train on it; it is refused where no step is deterministic; old configs keep their hashes."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from helpers import do_rollout, do_update, stored_rows

from flowgrpo_cli.algorithm.dpm_solver import data_prediction, dpm_solver_pp_step
from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.algorithm.sde import ode_step, sde_step
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.engines.vllm_omni import job_settings, sampler_job
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.loop import run_loop
from flowgrpo_cli.stages import evaluate, rollout
from flowgrpo_cli.store.config import STAGE_SECTIONS, config_hash, load_config
from flowgrpo_cli.store.contract import RolloutManifest, SamplerSettings
from flowgrpo_cli.store.rundir import ROLLOUT, read_manifest
from flowgrpo_cli.training.algorithms import algorithm_for

PROMPT = 'A sign that says "OPEN"'
SEEDS = [3, 4]


def _ode_settings(num_steps: int, solver: str, guidance: float = 4.0) -> SamplerSettings:
    return SamplerSettings(
        kind="sde", noise_level=0.0, guidance_scale=guidance, height=64, width=64,
        schedule=build_step_schedule(num_steps), ode_solver=solver,
    )  # fmt: skip


def _diffusers_dpm(adapter, cond, sigmas: torch.Tensor, guidance: float) -> torch.Tensor:
    """The same seeds denoised by diffusers' multistep DPM-Solver++ of order 2 (flow-matching
    config, midpoint, lower-order final), stepping along our sigmas."""
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0,
        solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint",
        lower_order_final=True, final_sigmas_type="zero",
    )  # fmt: skip
    steps = len(sigmas) - 1
    scheduler.set_timesteps(steps)
    scheduler.sigmas = sigmas.clone()  # the same sigmas, ending in 0
    scheduler.set_begin_index(0)
    generators = [torch.Generator().manual_seed(seed) for seed in SEEDS]
    x = adapter.initial_latents(generators, 64, 64)
    for i in range(steps):
        sigma = torch.full((len(SEEDS),), float(sigmas[i]))
        with torch.no_grad():
            v = adapter.velocity(x, sigma, cond, guidance_scale=guidance)
        x = scheduler.step(v, scheduler.timesteps[i], x).prev_sample
    return x


@pytest.mark.parametrize(("family", "num_steps"), [("sd3", 10), ("flux", 6)])
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # diffusers'
def test_an_ode_rollout_with_dpm_equals_diffusers_multistep_dpm_solver(
    tiny_adapter, family, num_steps
):
    """DiffusionNFT rolls out 10 steps of this solver on SD3.5-M; on the tiny models the
    final latent is diffusers' to float32 rounding, and Euler's is visibly not."""
    adapter = tiny_adapter(family)
    cond = adapter.encode_prompts([PROMPT] * len(SEEDS), None, guidance_scale=4.0)
    sigmas = adapter.sigmas(num_steps, 64, 64)
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    ours = sample_batch(adapter, cond, SEEDS, _ode_settings(num_steps, "dpm++2m"), sigmas)
    euler = sample_batch(adapter, cond, SEEDS, _ode_settings(num_steps, "euler"), sigmas)
    theirs = _diffusers_dpm(adapter, cond, sigmas, guidance=4.0)
    gap = (ours.final_latents - theirs).abs().max().item()
    print(f"{family}, {num_steps} steps: max |ours - diffusers| = {gap:.2g}")
    torch.testing.assert_close(ours.final_latents, theirs, atol=1e-5, rtol=1e-5)
    assert (euler.final_latents - theirs).abs().max().item() > 1e-3
    assert ours.log_probs.shape == (len(SEEDS), 0)  # no stochastic step: nothing else stored
    assert torch.equal(ours.latents[:, -1], ours.final_latents)


def _window_settings(**changes) -> SamplerSettings:
    """8 steps, a 2-step SDE window at steps 3-4: 3 ODE steps before it, 3 after."""
    return SamplerSettings(
        kind="sde", noise_level=0.7, guidance_scale=4.0, height=64, width=64,
        schedule=build_step_schedule(8, window_size=2, window_range=(3, 3)), **changes,
    )  # fmt: skip


def test_around_a_window_the_solver_takes_the_ode_steps_alone(tiny_adapter):
    """The window's first state is 3 DPM-Solver++ steps from the noise; the window's own
    steps are the SDE step from there (their log-probs recomputed from the stored states);
    post_window_solver leaves the steps before the window Euler's."""
    adapter = tiny_adapter("sd3")
    cond = adapter.encode_prompts([PROMPT] * len(SEEDS), None, guidance_scale=4.0)
    sigmas = adapter.sigmas(8, 64, 64)
    ours = sample_batch(adapter, cond, SEEDS, _window_settings(ode_solver="dpm++2m"), sigmas)
    post = sample_batch(
        adapter, cond, SEEDS, _window_settings(post_window_solver="dpm++2m"), sigmas
    )
    euler = sample_batch(adapter, cond, SEEDS, _window_settings(), sigmas)

    generators = [torch.Generator().manual_seed(seed) for seed in SEEDS]
    x = dpm_x = adapter.initial_latents(generators, 64, 64)
    previous = None
    for i in range(3):
        s, following = float(sigmas[i]), float(sigmas[i + 1])
        batch = torch.full((len(SEEDS),), s)
        v = adapter.velocity(dpm_x, batch, cond, guidance_scale=4.0)
        prediction = data_prediction(dpm_x, v, s)
        dpm_x = dpm_solver_pp_step(dpm_x, prediction, s, following, previous)
        previous = (prediction, s)
        v = adapter.velocity(x, batch, cond, guidance_scale=4.0)
        x = ode_step(x, v, batch, torch.full((len(SEEDS),), following)).next_latents
    torch.testing.assert_close(ours.latents[:, 0], dpm_x, atol=1e-6, rtol=1e-6)
    assert torch.equal(post.latents[:, 0], euler.latents[:, 0])  # post: Euler before
    torch.testing.assert_close(euler.latents[:, 0], x, atol=1e-6, rtol=1e-6)
    assert (ours.latents[:, 0] - euler.latents[:, 0]).abs().max().item() > 1e-4
    # The window: the SDE step, whose log-prob the stored states reproduce.
    assert torch.equal(ours.timesteps, euler.timesteps)
    for t in range(2):
        state = ours.latents[:, t]
        v = adapter.velocity(state, ours.timesteps[:, t], cond, guidance_scale=4.0)
        step = sde_step(
            state, v, ours.timesteps[:, t], ours.timesteps_next[:, t], noise_level=0.7,
            sigma_max_substitute=float(sigmas[1]), next_latents=ours.latents[:, t + 1],
        )  # fmt: skip
        torch.testing.assert_close(step.log_prob, ours.log_probs[:, t], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Refused where it cannot apply


@pytest.mark.parametrize("name", ["flow_grpo", "grpo_guard", "mixgrpo"])
def test_trajectory_algorithms_refuse_it_without_an_ode_step(make_run, name):
    """Every step stochastic (a window of all 3 steps): nothing for the solver to take, and the
    stochastic steps must stay the SDE step their log-probs are of. Rollout and update say so."""
    config, run = make_run(
        f"algorithm.name={name}", "sampler.ode_solver=dpm++2m", "sampler.window_size=3",
        name=name,
    )  # fmt: skip
    message = f"takes deterministic steps only: {name} trains the stochastic steps"
    with pytest.raises(FlowGrpoError, match=message):
        do_rollout(config, run)
    with pytest.raises(FlowGrpoError, match=message):
        do_update(config, run)


def test_flow_grpo_without_a_window_is_told_to_set_one(make_run):
    config, run = make_run("sampler.ode_solver=dpm++2m")
    with pytest.raises(FlowGrpoError, match=r"no window makes every step stochastic: set "
                       r"sampler\.window_size below sampler\.num_steps"):  # fmt: skip
        do_rollout(config, run)


def test_forward_methods_are_told_to_roll_out_without_noise(make_run):
    config, run = make_run("algorithm.name=nft", "sampler.ode_solver=dpm++2m")
    with pytest.raises(FlowGrpoError, match=r"nft trains on the clean latent alone, so set "
                       r"sampler\.noise_level = 0"):  # fmt: skip
        do_rollout(config, run)


def test_it_and_post_window_solver_together_are_refused(make_run):
    config, _ = make_run(
        "algorithm.name=mixgrpo", "sampler.window_size=1", "sampler.ode_solver=dpm++2m",
        "sampler.post_window_solver=dpm++2m",
    )  # fmt: skip
    with pytest.raises(FlowGrpoError, match=r"remove sampler\.post_window_solver"):
        rollout.sampler_settings(config, 0)


def test_a_window_leaves_ode_steps_to_take(make_run):
    """A trajectory algorithm with a window: accepted, and recorded in the settings."""
    config, _ = make_run(
        "algorithm.name=mixgrpo", "sampler.window_size=1", "sampler.ode_solver=dpm++2m"
    )
    algorithm_for(config).check()
    assert rollout.sampler_settings(config, 0).ode_solver == "dpm++2m"


# ---------------------------------------------------------------------------------------------
# nft and awm train on it


@pytest.mark.parametrize(
    ("name", "extra"),
    [("nft", ("algorithm.nft_beta=0.1",)), ("awm", ("algorithm.train_timesteps=2",))],
)
def test_forward_methods_train_two_iterations_on_dpm_rollouts(make_run, name, extra):
    """ODE rollouts taken with DPM-Solver++ (2M), as DiffusionNFT's: two iterations of the
    loop, evaluated with eval.ode_solver too; the manifest records the solver, and the stored
    clean latent is the solver's, not Euler's."""
    shared = (
        f"algorithm.name={name}", "sampler.noise_level=0", "sampler.num_steps=4",
        "sampler.guidance_scale=1.0", "algorithm.beta=0.0001",
        "algorithm.drop_zero_advantage=false", *extra,
    )  # fmt: skip
    config, run = make_run(
        *shared, "sampler.ode_solver=dpm++2m", "eval.every=2", "eval.num_steps=3",
        "eval.guidance_scale=1.0", "eval.ode_solver=dpm++2m", name=name,
    )  # fmt: skip
    summaries = run_loop(config, run, 2)
    assert [s.iteration for s in summaries] == [0, 1]
    for iteration in range(2):
        manifest = RolloutManifest.read(run.stage_dir(iteration, ROLLOUT))
        assert manifest.sampler.ode_solver == "dpm++2m"
        assert (run.checkpoint_dir(iteration) / "manifest.json").exists()
        assert math.isfinite(summaries[iteration].metrics["update/loss"])
    assert read_manifest(run.eval_dir(0))["counts"]["images"] > 0
    assert evaluate.evaluation_settings(config).ode_solver == "dpm++2m"
    # The same first rollout with Euler's steps: the same seeds, another clean latent.
    euler_config, euler_run = make_run(*shared, name=f"{name}-euler")
    do_rollout(euler_config, euler_run)
    dpm_rows, _ = stored_rows(run, 0)
    euler_rows, _ = stored_rows(euler_run, 0)
    assert dpm_rows.sample_ids == euler_rows.sample_ids
    assert dpm_rows.latents.shape[1] == 1  # the clean latent alone
    assert (dpm_rows.latents - euler_rows.latents).abs().max().item() > 1e-4


# ---------------------------------------------------------------------------------------------
# Config, manifest and engines


# Hashes of configs without paths, computed before these keys existed (flowgrpo e5f1c0b):
# runs made then keep their identity, post_window_solver's MixGRPO-Flash config included.
OLD_HASHES = {
    (): ("dbe6feaca0e2d3aa", "ec52520da77c4fad"),
    ("algorithm.name=nft", "sampler.noise_level=0", "sampler.num_steps=10"): (
        "41b99f219b94fbf5", "8a66cb0ea636b83a",
    ),
    ("algorithm.name=awm", "sampler.noise_level=0", "sampler.num_steps=14"): (
        "c5f486fa50b6a180", "38c894a3155d527f",
    ),
    (
        "algorithm.name=mixgrpo", "sampler.window_size=4", "sampler.num_steps=25",
        "sampler.post_window_solver=dpm++2m", "sampler.post_window_compress=0.4",
    ): ("79ca519ff5166b9e", "85f25c7772f6f6b0"),
}  # fmt: skip


@pytest.mark.parametrize("overrides", list(OLD_HASHES))
def test_configs_from_before_keep_their_hashes(overrides):
    config = load_config(None, list(overrides))
    assert config.sampler.ode_solver == "euler" and config.eval.ode_solver == "euler"
    whole, rollout_sections = OLD_HASHES[overrides]
    assert config_hash(config) == whole
    assert config_hash(config, STAGE_SECTIONS[ROLLOUT.name]) == rollout_sections
    for key in ("sampler.ode_solver", "eval.ode_solver"):  # each new key, set, counts
        assert config_hash(load_config(None, [*overrides, f"{key}=dpm++2m"])) != whole
    with_eval = load_config(None, [*overrides, "eval.ode_solver=dpm++2m"])
    assert config_hash(with_eval, STAGE_SECTIONS[ROLLOUT.name]) == rollout_sections


def test_an_unknown_solver_is_refused_with_the_choices():
    with pytest.raises(FlowGrpoError, match=r"`sampler\.ode_solver` = 'dpm3' is not one of "
                       r"'euler', 'dpm\+\+2m'"):  # fmt: skip
        load_config(None, ["sampler.ode_solver=dpm3"])


def test_evaluation_settings_take_eval_ode_solver_not_the_samplers(make_run):
    config, _ = make_run("algorithm.name=nft", "sampler.noise_level=0",
                         "sampler.ode_solver=dpm++2m")  # fmt: skip
    settings = evaluate.evaluation_settings(config)
    assert settings.ode_solver == "euler" and settings.noise_level == 0.0
    assert settings.schedule.num_steps == config.eval.num_steps


def test_the_vllm_omni_job_carries_every_sampler_setting():
    """The vllm-omni engine runs flowgrpo's own sampler from a JSON job: every field of the
    settings (the solvers included) comes back as it was sent."""
    settings = dataclasses.replace(
        _window_settings(ode_solver="dpm++2m"), post_window_compress=0.5, kind="cps",
        noise_level=0.3, guidance_scale=2.5,
    )  # fmt: skip
    sigmas = torch.linspace(1, 0, 9)
    job = sampler_job(settings, sigmas)
    assert job["sigmas"] == [float(s) for s in sigmas]
    back = job_settings(job, height=settings.height, width=settings.width)
    assert back == settings
    names = {f.name for f in dataclasses.fields(SamplerSettings)} - {"schedule", "height", "width"}
    assert names <= job.keys()


def test_the_model_card_says_its_diffusers_code_steps_with_euler(make_run):
    """An export's card redraws an evaluation image with the pipeline's own Euler steps; with
    eval.ode_solver = dpm++2m it says the evaluation took other steps."""
    from flowgrpo_cli.model_card import model_card

    config, run = make_run("eval.ode_solver=dpm++2m")
    card = model_card(config, run, 0, ema=False, merged=False, command="")
    assert "taken with the multistep DPM-Solver++ of order 2 (eval.ode_solver" in card
    assert "close to the evaluation's, but not equal" in card
    config, run = make_run(name="euler")
    card = model_card(config, run, 0, ema=False, merged=False, command="")
    assert "plain Euler steps" in card and "DPM-Solver++" not in card
