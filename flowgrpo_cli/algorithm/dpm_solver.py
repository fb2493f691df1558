"""MixGRPO-Flash's sampler after the SDE window: fewer ODE steps, taken with DPM-Solver++ (2M).

Once the window's last stochastic step is taken, nothing after it is trained, so MixGRPO-Flash
(Tencent-Hunyuan/MixGRPO, fastvideo/utils/sampling_utils.py, `dpm_apply_strategy = "post"`)
finishes the image with fewer, higher-order steps:

- The rest of the schedule is redrawn with fewer points: with the window's last step L of N,
  n = int(max((N - L) r, 1)) points from the sigma after the window down to 0, evenly spaced in
  the scheduler's unshifted time t and shifted as the scheduler shifts,
  sigma = s t / (1 + (s - 1) t) (`compressed_sigmas`). MixGRPO-Flash uses r = 0.4.
- Each of those steps is a multistep DPM-Solver++ step of order 2 ("midpoint"), written for
  flow matching, where x = (1 - sigma) x0 + sigma eps and the data prediction is
  x0 = x - sigma v. With alpha = 1 - sigma and lambda = log(alpha / sigma)
  (`dpm_solver_pp_step`):

      h = lambda_t - lambda_s0,  r0 = (lambda_s0 - lambda_s1) / h,  D1 = (m0 - m1) / r0
      x_t = (sigma_t / sigma_s0) x - alpha_t (exp(-h) - 1) (m0 + D1 / 2)

  with m0 the data prediction at this step (sigma_s0) and m1 the one of the step before
  (sigma_s1), the window's last step for the first step after it. Without a usable previous
  prediction (none, or taken at sigma = 1, where lambda is -inf) and on the last step (to
  sigma 0) it is the first-order step x_t = (sigma_t / sigma_s0) x - alpha_t (exp(-h) - 1) m0,
  which is the Euler step x + (sigma_t - sigma_s0) v exactly, as in MixGRPO.
"""

from __future__ import annotations

import math

import torch

from flowgrpo_cli.errors import FlowGrpoError


def data_prediction(latents: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0 = x - sigma v: the clean latent the velocity points to (float32)."""
    return latents.float() - sigma * velocity.float()


def dpm_solver_pp_step(
    latents: torch.Tensor,
    prediction: torch.Tensor,
    sigma: float,
    sigma_next: float,
    previous: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """One DPM-Solver++ step from `sigma` to `sigma_next` (see the module docstring).

    `prediction`: the data prediction at `sigma`; `previous`: the data prediction of the step
    before and its sigma, for the second-order correction, or None.
    """
    if not 0.0 <= sigma_next < sigma <= 1.0:
        raise FlowGrpoError(f"a DPM-Solver step needs 0 <= sigma_next < sigma <= 1, got {sigma}")
    x = latents.float()
    if sigma_next == 0.0:  # lambda_t = inf: exp(-h) = 0 and the step lands on the prediction
        return prediction.clone()
    alpha_next = 1.0 - sigma_next
    h = _lambda(sigma_next) - _lambda(sigma)
    first_order = (sigma_next / sigma) * x - alpha_next * math.expm1(-h) * prediction
    if previous is None or previous[1] >= 1.0:
        return first_order
    earlier, sigma_before = previous
    if not sigma < sigma_before:
        raise FlowGrpoError(
            f"the previous prediction's sigma {sigma_before} must be above this step's {sigma}"
        )
    r0 = (_lambda(sigma) - _lambda(sigma_before)) / h
    correction = (prediction - earlier) / r0
    return first_order - 0.5 * alpha_next * math.expm1(-h) * correction


def _lambda(sigma: float) -> float:
    """log(alpha / sigma), the half log signal-to-noise ratio (-inf at sigma = 1)."""
    return math.log(1.0 - sigma) - math.log(sigma) if sigma < 1.0 else -math.inf


def compressed_sigmas(
    start: float, remaining_steps: int, ratio: float, shift: float
) -> list[float]:
    """MixGRPO-Flash's schedule after the window: from `start` (the sigma after the window's
    last step) to 0 in int(max((remaining_steps + 1) ratio, 1)) points, at least 2.

    `remaining_steps`: the steps the full schedule takes from `start` to 0 (N - L - 1 for a
    window ending at step L), so MixGRPO's (N - L) is remaining_steps + 1. `shift`: s of the
    scheduler's time shift. MixGRPO keeps one point when the product rounds below 2, which
    never reaches sigma 0; here it is two (one step).
    """
    if not 0.0 < ratio <= 1.0:
        raise FlowGrpoError(f"post_window_compress = {ratio}: must be in (0, 1]")
    if remaining_steps < 1 or not 0.0 < start <= 1.0:
        raise FlowGrpoError(f"nothing to compress: {remaining_steps} steps from sigma {start}")
    points = max(int(max((remaining_steps + 1) * ratio, 1)), 2)
    t_start = start / (shift - (shift - 1.0) * start)  # the inverse of the time shift
    sigmas = [start]
    for index in range(1, points):
        t = t_start * (1.0 - index / (points - 1))
        sigmas.append(shift * t / (1.0 + (shift - 1.0) * t))
    sigmas[-1] = 0.0
    return sigmas
