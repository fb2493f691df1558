"""The sampler steps against hand values, torch.distributions, and exact Gaussian flows."""

import itertools
import math

import pytest
import torch

from flowgrpo_cli.algorithm.sde import (
    STEP_FUNCTIONS,
    cps_step,
    ode_step,
    per_sample_noise,
    sde_step,
)
from flowgrpo_cli.errors import FlowGrpoError

A = 0.7  # the paper's noise level


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def _random(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --- single steps: hand values and independent formulas -------------------------------------


def test_ode_step_hand_values():
    x = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[0.5, -1.0]])
    out = ode_step(x, v, 0.8, 0.6)  # dt = -0.2: x + v dt = [0.9, 2.2]
    torch.testing.assert_close(out.next_latents, torch.tensor([[0.9, 2.2]]))
    torch.testing.assert_close(out.mean, out.next_latents)
    assert out.log_prob.tolist() == [0.0] and out.std.tolist() == [0.0]


def test_sde_step_matches_normal_density_and_score_form():
    x, v = _random((3, 2, 4, 4), 0), _random((3, 2, 4, 4), 1)
    x_next = _random((3, 2, 4, 4), 2)
    sigma = torch.tensor([0.9, 0.5, 0.2])  # one sigma per sample
    sigma_next = torch.tensor([0.8, 0.4, 0.0])
    out = sde_step(
        x, v, sigma, sigma_next, noise_level=A, sigma_max_substitute=0.95, next_latents=x_next
    )

    dt = (sigma_next - sigma).view(3, 1, 1, 1)
    sig = sigma.view(3, 1, 1, 1)
    g = A * torch.sqrt(sig / (1 - sig))  # diffusion coefficient, no sample at sigma = 1 here
    # The reverse SDE written as Euler step + score correction, score = -(x + (1 - s) v) / s:
    # an arrangement of the drift independent of the implementation's.
    score = -(x + (1 - sig) * v) / sig
    expected_mean = x + (v - 0.5 * g**2 * score) * dt
    expected_std = (g * torch.sqrt(-dt)).flatten()
    torch.testing.assert_close(out.mean, expected_mean)
    torch.testing.assert_close(out.std, expected_std)

    normal = torch.distributions.Normal(expected_mean, expected_std.view(3, 1, 1, 1))
    expected_log_prob = normal.log_prob(x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected_log_prob)
    assert torch.equal(out.next_latents, x_next)


def test_sde_log_prob_of_a_sampled_latent_matches_normal_density():
    x, v = _random((2, 8), 3), _random((2, 8), 4)
    out = sde_step(
        x, v, 0.6, 0.5, noise_level=A, sigma_max_substitute=0.95, generators=_gens([1, 2])
    )
    normal = torch.distributions.Normal(out.mean, out.std.view(2, 1))
    torch.testing.assert_close(out.log_prob, normal.log_prob(out.next_latents).mean(dim=1))


def test_sde_step_at_sigma_one_uses_the_substitute():
    # s = 0.9 instead of 1: std = a sqrt(1 / (1 - 0.9)) sqrt(0.1) = a exactly.
    x, v = torch.ones(1, 4), torch.ones(1, 4)
    out = sde_step(x, v, 1.0, 0.9, noise_level=A, sigma_max_substitute=0.9, next_latents=x)
    torch.testing.assert_close(out.std, torch.tensor([A]))
    # mean = x (1 + a^2 / 0.1 * -0.1 / 2) + v (1 + 0) * -0.1 = 1 - 0.245 - 0.1
    torch.testing.assert_close(out.mean, torch.full((1, 4), 0.655))


def test_noise_level_zero_is_exactly_the_euler_step():
    x, v = _random((2, 3, 4), 5), _random((2, 3, 4), 6)
    euler = ode_step(x, v, 0.7, 0.55)
    sde = sde_step(
        x, v, 0.7, 0.55, noise_level=0.0, sigma_max_substitute=0.9, generators=_gens([1, 2])
    )
    assert torch.equal(sde.next_latents, euler.next_latents)
    assert torch.equal(sde.mean, euler.mean)
    assert sde.log_prob.tolist() == [0.0, 0.0]  # deterministic: no likelihood, no NaN
    cps = cps_step(x, v, 0.7, 0.55, noise_level=0.0, generators=_gens([1, 2]))
    # x0 (1 - s') + x1 s' = x + v (s' - s): the Euler step up to rounding.
    torch.testing.assert_close(cps.next_latents, euler.next_latents)


def test_cps_step_hand_values():
    x, v = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    # sigma 0.5 -> 0.25: x0 = 1 - 0.5 * 0.5 = 0.75, x1 = 1 + 0.5 * 0.5 = 1.25.
    # a = 0.5: std = 0.25 sin(pi / 4) = 0.1767767, sqrt(0.25^2 - std^2) = 0.1767767,
    # mean = 0.75 * 0.75 + 1.25 * 0.1767767 = 0.7834709; log_prob(1) = -(1 - 0.7834709)^2.
    out = cps_step(x, v, 0.5, 0.25, noise_level=0.5, next_latents=torch.tensor([[1.0]]))
    torch.testing.assert_close(out.std, torch.tensor([0.1767767]))
    torch.testing.assert_close(out.mean, torch.tensor([[0.7834709]]))
    torch.testing.assert_close(out.log_prob, torch.tensor([-0.0468849]))
    # a = 1: all of the noise is fresh, mean = x0 (1 - 0.25) = 0.5625.
    full = cps_step(x, v, 0.5, 0.25, noise_level=1.0, next_latents=x)
    torch.testing.assert_close(full.mean, torch.tensor([[0.5625]]))


def test_steps_compute_in_float32_whatever_the_input_dtype():
    x, v = _random((2, 6), 7).bfloat16(), _random((2, 6), 8).bfloat16()
    for fn in STEP_FUNCTIONS.values():
        out = fn(x, v, 0.6, 0.4, noise_level=A, sigma_max_substitute=0.9, generators=_gens([3, 4]))
        ref = fn(x.float(), v.float(), 0.6, 0.4, noise_level=A, sigma_max_substitute=0.9,
                 generators=_gens([3, 4]))  # fmt: skip
        for got, want in ((out.next_latents, ref.next_latents), (out.log_prob, ref.log_prob)):
            assert got.dtype == torch.float32
            assert torch.equal(got, want)


def test_log_prob_gradient_flows_through_the_mean_not_the_stored_latent():
    x, v = _random((2, 5), 9), _random((2, 5), 10).requires_grad_()
    x_next = _random((2, 5), 11).requires_grad_()
    for fn in STEP_FUNCTIONS.values():
        out = fn(x, v, 0.6, 0.4, noise_level=A, sigma_max_substitute=0.9, next_latents=x_next)
        out.log_prob.sum().backward()
        assert v.grad is not None and v.grad.abs().sum() > 0
        assert x_next.grad is None
        v.grad = None


# --- per-sample generators ------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(STEP_FUNCTIONS))
def test_samples_do_not_depend_on_batching(kind):
    fn = STEP_FUNCTIONS[kind]
    seeds = [11, 22, 33]
    x, v = _random((3, 2, 4, 4), 12), _random((3, 2, 4, 4), 13)
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9, 0.6, 0.2])
    kw = {"noise_level": A, "sigma_max_substitute": 0.9}
    batched = fn(x, v, sigma, sigma_next, generators=_gens(seeds), **kw)
    for i, seed in enumerate(seeds):
        one = fn(x[i : i + 1], v[i : i + 1], sigma[i : i + 1], sigma_next[i : i + 1],
                 generators=_gens([seed]), **kw)  # fmt: skip
        assert torch.equal(one.next_latents[0], batched.next_latents[i])
        assert torch.equal(one.log_prob[0], batched.log_prob[i])


def test_per_sample_noise_rows_come_from_their_own_generator():
    noise = per_sample_noise((2, 3, 5), _gens([5, 6]), "cpu")
    assert noise.shape == (2, 3, 5) and noise.dtype == torch.float32
    assert torch.equal(noise[1], torch.randn((3, 5), generator=torch.Generator().manual_seed(6)))


# --- bad arguments --------------------------------------------------------------------------


def test_bad_arguments_say_what_is_allowed():
    x = torch.zeros(2, 3)
    kw = {"noise_level": A, "sigma_max_substitute": 0.9}
    with pytest.raises(FlowGrpoError, match="one per sample"):
        sde_step(x, x, 0.5, 0.4, generators=_gens([1]), **kw)
    with pytest.raises(FlowGrpoError, match="exactly one of next_latents"):
        sde_step(x, x, 0.5, 0.4, **kw)
    with pytest.raises(FlowGrpoError, match="exactly one of next_latents"):
        sde_step(x, x, 0.5, 0.4, next_latents=x, generators=_gens([1, 2]), **kw)
    with pytest.raises(FlowGrpoError, match="must be >= 0"):
        cps_step(x, x, 0.5, 0.4, noise_level=-0.1, next_latents=x)
    with pytest.raises(FlowGrpoError, match=r"\[0, 1\)"):
        sde_step(x, x, 1.0, 0.9, noise_level=A, sigma_max_substitute=1.0, next_latents=x)
    with pytest.raises(FlowGrpoError, match="velocity has shape"):
        ode_step(x, torch.zeros(1, 3), 0.5, 0.4)
    with pytest.raises(FlowGrpoError, match=r"one value per sample, \(2,\)"):
        sde_step(x, x, torch.tensor([0.5, 0.4, 0.3]), 0.2, next_latents=x, **kw)


# --- marginals: 1-D Gaussian data, whose flow is known in closed form -----------------------
# Data x0 ~ N(mu, s^2), noise e ~ N(0, 1), x_t = (1 - t) x0 + t e (t = sigma). The marginal is
# N((1 - t) mu, V_t), V_t = (1 - t)^2 s^2 + t^2, and the exact velocity E[e - x0 | x_t = x] is
# v(x, t) = -mu + k_t (x - (1 - t) mu), k_t = (t - (1 - t) s^2) / V_t.

MU, S = 1.5, 0.5
NUM_STEPS = 100
ROWS = 4  # samples; every latent element is an independent 1-D particle
# Enough particles to resolve a 20% error in the drift, and just under torch's parallel grain
# size (32768 elements), so each op runs on one thread: on shared CPUs threads would contend.
PARTICLES = 32000


def _velocity(x, t, s=S):
    var = (1 - t) ** 2 * s**2 + t**2
    k = (t - (1 - t) * s**2) / var
    return -MU + k * (x - (1 - t) * MU)


def _sigmas(n, shift=3.0):
    """The SD3 schedule: t from 1 to 0 in n steps, shifted."""
    ts = [1 - i / n for i in range(n + 1)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts]


def _integrate(step, sigmas, particles, s=S, seed=0, until=None):
    gens = _gens(range(seed, seed + ROWS))
    x = per_sample_noise((ROWS, particles // ROWS), gens, "cpu")  # [ROWS, P] float32
    for i in range(until or len(sigmas) - 1):
        x = step(x, _velocity(x, sigmas[i], s), sigmas[i], sigmas[i + 1], gens)
    return x


def _sde(x, v, sigma, sigma_next, gens, sigma_max_substitute):
    return sde_step(
        x, v, sigma, sigma_next, noise_level=A,
        sigma_max_substitute=sigma_max_substitute, generators=gens,
    ).next_latents  # fmt: skip


def _marginal_tolerances(particles, steps):
    """4 standard errors of the sample mean / variance, plus the O(1/n) weak error of the
    discretisation (measured about 3.4 s^2 / n for this schedule; 5 s^2 / n bounds it)."""
    mean_tol = 4 * S / math.sqrt(particles)
    var_tol = 4 * S**2 * math.sqrt(2 / particles) + 5 * S**2 / steps
    return mean_tol, var_tol


def test_sde_keeps_the_flow_marginals():
    sigmas, particles = _sigmas(NUM_STEPS), PARTICLES
    x = _integrate(lambda *a: _sde(*a, sigmas[1]), sigmas, particles)
    mean_tol, var_tol = _marginal_tolerances(particles, NUM_STEPS)
    assert abs(x.mean().item() - MU) < mean_tol
    assert abs(x.var(correction=0).item() - S**2) < var_tol


def _mutant(correction_scale=1.0, drop_one_minus_sigma=False, sigma_max_substitute=0.0):
    """The SDE step with a wrong drift: the score correction scaled, or (1 - sigma) dropped
    from the velocity's coefficient (mean += diffusion^2 dt v / 2 = -std^2 v / 2)."""

    def step(x, v, sigma, sigma_next, gens):
        right = sde_step(
            x, v, sigma, sigma_next, noise_level=A,
            sigma_max_substitute=sigma_max_substitute, next_latents=x,
        )  # fmt: skip
        euler = ode_step(x, v, sigma, sigma_next).mean
        mean = euler + correction_scale * (right.mean - euler)
        if drop_one_minus_sigma:
            mean = mean - 0.5 * right.std[:, None] ** 2 * v
        return mean + right.std[:, None] * per_sample_noise(x.shape, gens, "cpu")

    return step


@pytest.mark.parametrize(
    "wrong",
    [
        {"correction_scale": 0.0},  # Euler plus noise: no score correction
        {"correction_scale": -1.0},  # correction with the wrong sign
        {"correction_scale": 0.8},
        {"correction_scale": 1.2},
        {"drop_one_minus_sigma": True},
    ],
)
def test_marginal_check_catches_a_wrong_drift(wrong):
    sigmas, particles = _sigmas(NUM_STEPS), PARTICLES
    x = _integrate(_mutant(**wrong, sigma_max_substitute=sigmas[1]), sigmas, particles)
    mean_tol, var_tol = _marginal_tolerances(particles, NUM_STEPS)
    mean_ok = abs(x.mean().item() - MU) < mean_tol
    var_ok = abs(x.var(correction=0).item() - S**2) < var_tol
    assert not (mean_ok and var_ok)


def _cps(x, v, sigma, sigma_next, gens):
    return cps_step(x, v, sigma, sigma_next, noise_level=A, generators=gens).next_latents


def test_cps_keeps_exact_marginals_when_x0_is_known():
    # Point-mass data (s = 0): the velocity reveals x0 and the noise exactly, and CPS's
    # coefficients then give x_next ~ N((1 - s') mu, s'^2) exactly, at any step count.
    sigmas, particles = _sigmas(10), PARTICLES
    for i in range(1, 10):
        x = _integrate(_cps, sigmas, particles, s=0.0, until=i)
        sigma = sigmas[i]
        assert abs(x.mean().item() - (1 - sigma) * MU) < 4 * sigma / math.sqrt(particles)
        var_tol = 4 * sigma**2 * math.sqrt(2 / particles)
        assert abs(x.var(correction=0).item() - sigma**2) < var_tol
    final = _integrate(_cps, sigmas, particles, s=0.0)
    torch.testing.assert_close(final, torch.full_like(final, MU))


def _cps_exact_moments(sigmas, s):
    """Mean and variance after the CPS chain on Gaussian data, by propagating the two moments
    through each step's affine map x -> C x + D plus noise (python floats, no torch)."""
    m, var = 0.0, 1.0
    for t, t_next in itertools.pairwise(sigmas):
        k = (t - (1 - t) * s**2) / ((1 - t) ** 2 * s**2 + t**2)
        b = -MU - k * (1 - t) * MU  # v = k x + b
        std = t_next * math.sin(A * math.pi / 2)
        q = math.sqrt(max(t_next**2 - std**2, 0.0))
        c = (1 - t * k) * (1 - t_next) + (1 + (1 - t) * k) * q
        d = -t * b * (1 - t_next) + (1 - t) * b * q
        m, var = c * m + d, c * c * var + std**2
    return m, var


def test_cps_on_gaussian_data_matches_its_exact_moments():
    sigmas, particles = _sigmas(NUM_STEPS), PARTICLES
    x = _integrate(_cps, sigmas, particles)
    exact_mean, exact_var = _cps_exact_moments(sigmas, S)
    assert exact_mean == pytest.approx(MU)  # CPS keeps the mean...
    assert abs(x.mean().item() - exact_mean) < 4 * S / math.sqrt(particles)
    assert abs(x.var(correction=0).item() - exact_var) < 4 * exact_var * math.sqrt(2 / particles)
    # ...but not the variance: its x0 is a posterior mean, and a fixed share of the noise is
    # redrawn at every step however small, so the spread shrinks (0.17 instead of 0.25).
    assert exact_var < 0.75 * S**2
