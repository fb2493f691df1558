"""One denoising step of a flow-matching sampler, with the log-prob Flow-GRPO trains on.

Sigma runs from 1 (pure noise) to 0 (data); the model predicts the velocity v = noise - x0, so
dt = sigma_next - sigma < 0 and the deterministic (Euler) step is x + v * dt. The stochastic
kinds turn that step into a Gaussian x_next ~ N(mean, std^2), which is what gives GRPO a
likelihood to optimise:

- "sde" (the Flow-GRPO paper): the reverse-time SDE with diffusion a * sqrt(sigma / (1 - sigma)).
  It keeps the flow's marginals (up to the O(1/steps) discretisation error).
- "cps" (coefficients-preserving sampling): re-noises the predicted x0 with the exact noise
  coefficient of the next sigma. It keeps the marginals only where x0 is predicted exactly; a
  fixed share of the noise is redrawn at every step, so with a posterior-mean x0 the samples'
  spread shrinks (tests/test_sde.py measures it on Gaussian data).

Every function here upcasts to float32 and returns float32, whatever the model dtype: rollout
and update must compute bit-identical means for the policy ratio to start at exactly 1.
Sigmas are python floats (one value for the batch) or [B] tensors (one per sample).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from flowgrpo_cli.errors import FlowGrpoError

Sigma = float | torch.Tensor


@dataclass(frozen=True)
class StepOutput:
    """x_next ~ N(mean, std^2): the drawn (or given) latent and its log-prob."""

    next_latents: torch.Tensor  # [B, ...] float32, shape of the input latents
    log_prob: torch.Tensor  # [B] float32: mean over non-batch dims of the log density
    mean: torch.Tensor  # [B, ...] float32
    std: torch.Tensor  # [B] float32: std of x_next itself (0 for a deterministic step)
    # [B] float32: what the reference code calls std_dev_t and divides its KL by. For "sde" the
    # diffusion a * sqrt(sigma / (1 - s)), without the step's sqrt(-dt); for "cps" equal to std.
    std_dev_t: torch.Tensor


class StepFunction(Protocol):
    """The call shape shared by every stochastic step kind (see STEP_FUNCTIONS)."""

    def __call__(
        self,
        latents: torch.Tensor,
        velocity: torch.Tensor,
        sigma: Sigma,
        sigma_next: Sigma,
        *,
        noise_level: float,
        sigma_max_substitute: float,
        next_latents: torch.Tensor | None = None,
        generators: Sequence[torch.Generator] | None = None,
    ) -> StepOutput: ...


def per_sample_noise(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str
) -> torch.Tensor:
    """Standard normal noise [B, ...] float32, row b drawn from generators[b] alone.

    Drawing each row from its own generator makes a sample's noise independent of which other
    samples share its batch, so a rollout gives the same images at any batch size. Each row is
    drawn on its generator's device (a CPU generator gives the same numbers on any machine) and
    then moved to ``device``.
    """
    batch, *rest = shape
    if len(generators) != batch:
        raise FlowGrpoError(
            f"got {len(generators)} generators for a batch of {batch}: pass one per sample"
        )
    rows = [
        torch.randn(rest, generator=g, device=g.device, dtype=torch.float32).to(device)
        for g in generators
    ]
    return torch.stack(rows)


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    noise_level: float,
    sigma_max_substitute: float,
    next_latents: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
) -> StepOutput:
    """The paper's SDE step.

    diffusion = a * sqrt(sigma / (1 - s)), s = sigma except at sigma = 1, where s is the
    schedule's second sigma (``sigma_max_substitute``) so the first step stays finite.
    mean = x (1 + diffusion^2 dt / (2 sigma)) + v (1 + diffusion^2 (1 - sigma) / (2 sigma)) dt,
    i.e. the Euler step plus the score correction (score = -(x + (1 - sigma) v) / sigma) that
    keeps the marginals when noise of variance diffusion^2 * (-dt) is added.

    Training passes the stored ``next_latents`` to get their log-prob under the current model;
    sampling passes one generator per sample instead.
    """
    _check_noise_level(noise_level)
    # 0 is allowed: a one-step schedule's second sigma is the final 0.
    if not 0.0 <= sigma_max_substitute < 1.0:
        raise FlowGrpoError(
            f"sigma_max_substitute={sigma_max_substitute}: must be in [0, 1), "
            "the schedule's second sigma"
        )
    _check_shapes(latents, velocity)
    x, v = latents.float(), velocity.float()  # [B, ...]
    sigma_b = _per_sample(sigma, x, "sigma")  # [B]
    dt_b = _per_sample(sigma_next, x, "sigma_next") - sigma_b  # [B], negative
    s = torch.where(sigma_b >= 1.0, torch.full_like(sigma_b, sigma_max_substitute), sigma_b)
    diffusion = noise_level * torch.sqrt(sigma_b / (1.0 - s))  # [B]

    sig, dt, g2 = _per_row(sigma_b, x), _per_row(dt_b, x), _per_row(diffusion**2, x)
    mean = x * (1.0 + g2 * dt / (2.0 * sig)) + v * (1.0 + g2 * (1.0 - sig) / (2.0 * sig)) * dt
    std = diffusion * torch.sqrt(-dt_b)  # [B]
    x_next = _draw_or_take(mean, std, next_latents, generators)
    log_prob = _gaussian_log_prob(x_next, mean, std)
    return StepOutput(
        next_latents=x_next, log_prob=log_prob, mean=mean, std=std, std_dev_t=diffusion
    )


def cps_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: Sigma,
    sigma_next: Sigma,
    *,
    noise_level: float,
    sigma_max_substitute: float | None = None,
    next_latents: torch.Tensor | None = None,
    generators: Sequence[torch.Generator] | None = None,
) -> StepOutput:
    """Coefficients-preserving sampling step.

    std = sigma_next sin(a pi / 2); x0 = x - sigma v, x1 = x + (1 - sigma) v (predicted data and
    noise); mean = x0 (1 - sigma_next) + x1 sqrt(sigma_next^2 - std^2), so mean + std * eps has
    exactly the noise coefficient sigma_next. The log-prob is -mean((x_next - mean)^2), the
    Gaussian's without its constants and variance, as the CPS authors train it.
    ``sigma_max_substitute`` is accepted only so both kinds share one call shape: std here
    never divides by 1 - sigma.
    """
    _check_noise_level(noise_level)
    _check_shapes(latents, velocity)
    x, v = latents.float(), velocity.float()  # [B, ...]
    sigma_b = _per_sample(sigma, x, "sigma")  # [B]
    sigma_next_b = _per_sample(sigma_next, x, "sigma_next")  # [B]
    std = sigma_next_b * math.sin(noise_level * math.pi / 2.0)  # [B]

    sig, sig_next = _per_row(sigma_b, x), _per_row(sigma_next_b, x)
    x0 = x - sig * v
    x1 = x + (1.0 - sig) * v
    # Clamped at 0: for a = 1 the difference is 0 up to rounding, and sqrt of -1e-9 is NaN.
    noise_coef = torch.sqrt((sig_next**2 - _per_row(std, x) ** 2).clamp_min(0.0))
    mean = x0 * (1.0 - sig_next) + x1 * noise_coef
    x_next = _draw_or_take(mean, std, next_latents, generators)
    log_prob = -((x_next.detach() - mean) ** 2).mean(dim=_non_batch_dims(x))  # [B]
    return StepOutput(next_latents=x_next, log_prob=log_prob, mean=mean, std=std, std_dev_t=std)


def ode_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: Sigma, sigma_next: Sigma
) -> StepOutput:
    """The deterministic Euler step x + v dt (evaluation, and the steps outside an SDE window)."""
    _check_shapes(latents, velocity)
    x, v = latents.float(), velocity.float()  # [B, ...]
    dt_b = _per_sample(sigma_next, x, "sigma_next") - _per_sample(sigma, x, "sigma")  # [B]
    mean = x + _per_row(dt_b, x) * v
    zeros = torch.zeros_like(dt_b)  # [B]
    return StepOutput(next_latents=mean, log_prob=zeros, mean=mean, std=zeros, std_dev_t=zeros)


# Config `sampler.kind` -> the step used on stochastic steps.
STEP_FUNCTIONS: dict[str, StepFunction] = {"sde": sde_step, "cps": cps_step}


def check_noise_level(kind: str, noise_level: float, sigmas: Sequence[float]) -> None:
    """Refuse a noise level the step cannot take on this schedule, before anything is sampled.

    "cps": std = sigma_next sin(a pi / 2) is largest at a = 1 and repeats beyond, so a is in
    [0, 1]. "sde": the mean scales the latent by 1 + a^2 dt / (2 (1 - s)) (see sde_step);
    once that factor reaches 0 the discretised step no longer follows the SDE (it flips the
    latent's sign), so a must stay below sqrt(2 (1 - s) / -dt) on every step.
    """
    key = "sampler.noise_level"
    if not noise_level >= 0.0:
        raise FlowGrpoError(f"{key} = {noise_level}: must be >= 0 (0 = the Euler ODE step)")
    if kind == "cps":
        if noise_level > 1.0:
            raise FlowGrpoError(
                f"{key} = {noise_level}: must be in [0, 1] for cps (std = sigma_next "
                "sin(a pi / 2) is largest at 1)"
            )
        return
    substitute = sigmas[1]
    limits = []  # (largest a, sigma, sigma_next) per step
    for sigma, following in itertools.pairwise(sigmas):
        s = substitute if sigma >= 1.0 else sigma
        limits.append((math.sqrt(2.0 * (1.0 - s) / (sigma - following)), sigma, following))
    limit, sigma, following = min(limits)
    if noise_level >= limit:
        raise FlowGrpoError(
            f"{key} = {noise_level}: too large for this schedule; the SDE step from sigma "
            f"{sigma:.4g} to {following:.4g} would scale the latent by "
            f"{1.0 - (noise_level / limit) ** 2:.3g} (it must stay > 0), so a < {limit:.3f} "
            f"here (sampler.num_steps = {len(sigmas) - 1})"
        )


def _check_noise_level(noise_level: float) -> None:
    if not noise_level >= 0.0:
        raise FlowGrpoError(f"noise_level={noise_level}: must be >= 0 (0 = the Euler ODE step)")


def _check_shapes(latents: torch.Tensor, velocity: torch.Tensor) -> None:
    # Broadcasting a [B, C, H, W] velocity against other latents would go unnoticed otherwise.
    if latents.shape != velocity.shape:
        raise FlowGrpoError(
            f"velocity has shape {tuple(velocity.shape)}, latents {tuple(latents.shape)}: "
            "they must match"
        )


def _per_sample(value: Sigma, x: torch.Tensor, name: str) -> torch.Tensor:
    """A float, a 0-d or a [B] tensor -> [B] float32 on x's device."""
    batch = x.shape[0]
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t.expand(batch)
    if t.shape != (batch,):
        raise FlowGrpoError(
            f"{name} has shape {tuple(t.shape)}: pass a float or one value per sample, ({batch},)"
        )
    return t


def _per_row(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1], broadcastable against x."""
    return t.view(-1, *([1] * (x.ndim - 1)))


def _non_batch_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _draw_or_take(
    mean: torch.Tensor,
    std: torch.Tensor,
    next_latents: torch.Tensor | None,
    generators: Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """The given next latents (training) or mean + std * eps with per-sample noise (sampling)."""
    if (next_latents is None) == (generators is None):
        raise FlowGrpoError(
            "pass exactly one of next_latents (to score a stored step) "
            "or generators (to sample, one per sample)"
        )
    if next_latents is not None:
        if next_latents.shape != mean.shape:
            raise FlowGrpoError(
                f"next_latents has shape {tuple(next_latents.shape)}, "
                f"the latents {tuple(mean.shape)}: they must match"
            )
        return next_latents.float()
    assert generators is not None  # exactly one of the two was given
    noise = per_sample_noise(mean.shape, generators, mean.device)  # [B, ...]
    return mean + _per_row(std, mean) * noise


def _gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) averaged over non-batch dims -> [B]; 0 where std = 0.

    x is detached: the stored latent is data, the gradient flows through the mean. A sample with
    std 0 (a = 0) was drawn deterministically and has no likelihood to train, so it gets 0 like
    the ODE step; std is replaced by 1 there first so no inf/NaN leaks into the gradient.
    """
    random_step = std > 0  # [B]
    safe_std = torch.where(random_step, std, torch.ones_like(std))
    s = _per_row(safe_std, x)
    log_norm = torch.log(s) + 0.5 * math.log(2.0 * math.pi)
    density = -((x.detach() - mean) ** 2) / (2.0 * s**2) - log_norm  # [B, ...]
    log_prob = density.mean(dim=_non_batch_dims(x))  # [B]
    return torch.where(random_step, log_prob, torch.zeros_like(log_prob))
