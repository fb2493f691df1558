"""Sampling one batch of trajectories: the denoising loop every rollout engine runs.

The loop owns nothing but the order of calls: the adapter gives noise, sigmas, velocities and
images; algorithm.sde gives the steps; algorithm.schedule says which steps are stochastic;
algorithm.dpm_solver gives the deterministic steps where the settings choose DPM-Solver++ (2M)
over Euler (`ode_solver`: every deterministic step; `post_window_solver`: those after the SDE
window). The previous step's data prediction it needs is carried across every step, a
stochastic one included, as MixGRPO-Flash carries the window's last one.
Each sample draws its initial noise and every step's noise from its own generator, seeded per
sample, so a sample is the same whatever batch or rank it was drawn in. With
sampler.same_noise_per_group the initial noise comes from a generator seeded per group instead
(`noise_seeds`), and the sample's own generator draws its step noise alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowgrpo_cli.algorithm.dpm_solver import compressed_sigmas, data_prediction, dpm_solver_pp_step
from flowgrpo_cli.algorithm.sde import STEP_FUNCTIONS, ode_step
from flowgrpo_cli.models import Conditioning, ModelAdapter
from flowgrpo_cli.store.contract import SamplerSettings


@dataclass(frozen=True)
class SampledBatch:
    """B samples, T stochastic steps (T = 0 when sampled without noise)."""

    latents: torch.Tensor  # [B, T+1, *latent_shape] float32, states around the stochastic steps
    log_probs: torch.Tensor  # [B, T] float32
    timesteps: torch.Tensor  # [B, T] float32: sigma of each stochastic step
    timesteps_next: torch.Tensor  # [B, T] float32
    images: torch.Tensor  # [B, 3, H, W] float32 in [0, 1]
    final_latents: torch.Tensor  # [B, *latent_shape] float32: the clean latent decoded


@torch.no_grad()
def sample_batch(
    adapter: ModelAdapter,
    cond: Conditioning,
    seeds: list[int],
    settings: SamplerSettings,
    sigmas: torch.Tensor,
    noise_seeds: list[int] | None = None,
) -> SampledBatch:
    """Denoise len(seeds) samples from noise to images along `sigmas` ([N + 1], ending in 0).

    `noise_seeds` (settings.same_noise_per_group): sample i's initial noise is drawn from a
    generator seeded with noise_seeds[i], so samples with one noise seed start alike; None:
    from its own generator, seeds[i], before that generator's step noise."""
    if (noise_seeds is not None) != settings.same_noise_per_group:
        raise ValueError(
            f"same_noise_per_group is {settings.same_noise_per_group} but noise seeds were "
            f"{'given' if noise_seeds is not None else 'not given'}"
        )
    device = cond[next(iter(cond.tensors))].device
    generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]
    x = _initial_latents(adapter, settings, generators, noise_seeds).to(device)
    schedule = settings.schedule
    stochastic = (
        schedule.stochastic if settings.noise_level > 0 else (False,) * len(schedule.stochastic)
    )
    step_fn = STEP_FUNCTIONS[settings.kind]
    # The window's last stochastic step; past the end when there is none.
    window_end = max((i for i, s in enumerate(stochastic) if s), default=len(stochastic))
    step_sigmas = _step_sigmas(adapter, settings, window_end, sigmas)
    # DPM-Solver++ (2M) on every deterministic step (ode_solver), or on those after the window
    # alone (post_window_solver, MixGRPO-Flash); the stochastic steps are always step_fn's.
    dpm_everywhere = settings.ode_solver == "dpm++2m"
    dpm = dpm_everywhere or settings.post_window_solver == "dpm++2m"
    batch = len(seeds)
    states: list[torch.Tensor] = []
    log_probs: list[torch.Tensor] = []
    sigma_now: list[float] = []
    sigma_next: list[float] = []
    # the data prediction of the step before, for DPM-Solver++ (2M)
    previous: tuple[torch.Tensor, float] | None = None
    for i in range(len(step_sigmas) - 1):
        sigma, following = step_sigmas[i], step_sigmas[i + 1]
        # Per-sample float32 sigmas, exactly the values the update reads back from the store.
        sigma_batch = torch.full((batch,), sigma, dtype=torch.float32, device=device)
        following_batch = torch.full((batch,), following, dtype=torch.float32, device=device)
        v = adapter.velocity(x, sigma_batch, cond, guidance_scale=settings.guidance_scale)
        prediction = data_prediction(x, v, sigma) if dpm else None
        if stochastic[i]:
            if not states:
                states.append(x)
            out = step_fn(
                x,
                v,
                sigma_batch,
                following_batch,
                noise_level=settings.noise_level,
                sigma_max_substitute=float(sigmas[1]),
                generators=generators,
            )
            states.append(out.next_latents)
            log_probs.append(out.log_prob)
            sigma_now.append(sigma)
            sigma_next.append(following)
            x = out.next_latents
        elif prediction is not None and (dpm_everywhere or i > window_end):
            x = dpm_solver_pp_step(x, prediction, sigma, following, previous)
        else:
            x = ode_step(x, v, sigma_batch, following_batch).next_latents
        previous = (prediction, sigma) if prediction is not None else None
    if not states:  # no stochastic step: store the final latent alone
        states.append(x)
    steps = len(log_probs)
    return SampledBatch(
        latents=torch.stack(states, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if steps else torch.zeros(batch, 0),
        timesteps=torch.tensor(sigma_now, dtype=torch.float32).expand(batch, steps).clone(),
        timesteps_next=torch.tensor(sigma_next, dtype=torch.float32).expand(batch, steps).clone(),
        images=adapter.decode(x),
        final_latents=x.float(),
    )


def _initial_latents(
    adapter: ModelAdapter,
    settings: SamplerSettings,
    generators: list[torch.Generator],
    noise_seeds: list[int] | None,
) -> torch.Tensor:
    """The batch's initial noise: from each sample's generator, or one draw per noise seed."""
    if noise_seeds is None:
        return adapter.initial_latents(generators, settings.height, settings.width)
    if len(noise_seeds) != len(generators):
        raise ValueError(f"{len(noise_seeds)} noise seeds for {len(generators)} samples")
    distinct = list(dict.fromkeys(noise_seeds))
    drawn = adapter.initial_latents(
        [torch.Generator(device="cpu").manual_seed(seed) for seed in distinct],
        settings.height,
        settings.width,
    )
    return drawn[[distinct.index(seed) for seed in noise_seeds]]


def _step_sigmas(
    adapter: ModelAdapter, settings: SamplerSettings, window_end: int, sigmas: torch.Tensor
) -> list[float]:
    """The sigmas the loop steps through: the schedule's, with the part after the SDE window
    (its last step `window_end`) redrawn with fewer points when `post_window_compress` < 1
    (MixGRPO-Flash). Never more steps than the schedule's, so `stochastic[i]` covers every
    step."""
    full = [float(s) for s in sigmas]
    remaining = len(full) - 2 - window_end  # steps from the window's end to sigma 0
    if settings.post_window_compress >= 1.0 or remaining < 1:  # no window: remaining < 0
        return full
    shift = adapter.time_shift(settings.height, settings.width, settings.shift)
    tail = compressed_sigmas(full[window_end + 1], remaining, settings.post_window_compress, shift)
    return full[: window_end + 1] + tail
