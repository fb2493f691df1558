"""The clipped policy loss, its KL and its metrics against hand values."""

import dataclasses
import math

import pytest
import torch

from flowgrpo_cli.algorithm.loss import LossMetrics, LossOutput, kl_std, policy_loss
from flowgrpo_cli.algorithm.sde import cps_step, sde_step
from flowgrpo_cli.errors import FlowGrpoError


def test_clipped_loss_hand_values():
    new = torch.tensor([0.1, -0.1], requires_grad=True)
    out = policy_loss(new, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=1e-4)
    # ratios e^0.1 = 1.10517 and e^-0.1 = 0.90484, both outside [1 - 1e-4, 1 + 1e-4].
    # Sample 1 (A = 1): max(-1.10517, -1.0001) = -1.0001; sample 2 (A = -1):
    # max(0.90484, 0.9999) = 0.9999; mean = -1e-4.
    torch.testing.assert_close(out.loss, torch.tensor(-1e-4))
    torch.testing.assert_close(out.pg_loss, torch.tensor(-1e-4))
    assert out.clipfrac.item() == 1.0
    assert out.clipfrac_above.item() == 0.5 and out.clipfrac_below.item() == 0.5
    torch.testing.assert_close(out.ratio_mean, torch.tensor(math.cosh(0.1)))
    torch.testing.assert_close(out.ratio_min, torch.tensor(math.exp(-0.1)))
    torch.testing.assert_close(out.ratio_max, torch.tensor(math.exp(0.1)))
    torch.testing.assert_close(out.approx_kl, torch.tensor(0.005))  # 0.5 * mean(0.01, 0.01)
    torch.testing.assert_close(out.log_ratio_max_abs, torch.tensor(0.1))
    assert out.kl.item() == 0.0 and out.batch_size == 2
    # Both samples moved past the clip in the direction their advantage favours: no gradient.
    out.loss.backward()
    assert new.grad.tolist() == [0.0, 0.0]


def test_on_policy_ratio_is_one_and_gradient_is_minus_a_over_b():
    old = torch.tensor([-1.3, 0.2, 5.0])
    new = old.clone().requires_grad_()
    advantages = torch.tensor([0.5, -2.0, 1.0])
    out = policy_loss(new, old, advantages, clip_range=1e-4)
    assert out.ratio_min.item() == 1.0 and out.ratio_max.item() == 1.0
    assert out.clipfrac.item() == 0.0 and out.log_ratio_max_abs.item() == 0.0
    out.loss.backward()
    torch.testing.assert_close(new.grad, -advantages / 3)


def test_ratio_inside_the_clip_range_keeps_its_gradient():
    # log ratio 5e-5: ratio 1.00005 is inside [0.9999, 1.0001]; d(-A ratio)/dlogp = -A ratio.
    new = torch.tensor([5e-5], requires_grad=True)
    out = policy_loss(new, torch.zeros(1), torch.tensor([2.0]), clip_range=1e-4)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([-2.0 * math.exp(5e-5)]))
    assert out.clipfrac.item() == 0.0


def test_kl_hand_values_and_gradient():
    mean = torch.tensor([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    ref_mean = torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    std = torch.tensor([1.0, 2.0])
    logp = torch.zeros(2)
    out = policy_loss(
        logp, logp, torch.ones(2), clip_range=1e-4, beta=0.04, mean=mean, ref_mean=ref_mean, std=std
    )
    # sample 1: mean(1, 4) / (2 * 1) = 1.25; sample 2: mean(0, 4) / (2 * 4) = 0.25; kl = 0.75.
    torch.testing.assert_close(out.kl, torch.tensor(0.75))
    # pg = mean(-A * 1) = -1 at ratio 1.
    torch.testing.assert_close(out.loss, torch.tensor(-1.0 + 0.04 * 0.75))
    out.loss.backward()
    # d kl / d mean = (mean - ref) / (elements * std^2) / B = [[1, 2] / 4, [0, -2] / 16]
    expected = 0.04 * torch.tensor([[0.25, 0.5], [0.0, -0.125]])
    torch.testing.assert_close(mean.grad, expected)


def test_kl_equals_the_gaussian_kl_divergence():
    gen = torch.Generator().manual_seed(0)
    mean, ref_mean = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    std = torch.tensor([0.3, 0.1, 0.05])
    out = policy_loss(
        torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_range=1e-4, beta=1.0,
        mean=mean, ref_mean=ref_mean, std=std,
    )  # fmt: skip
    s = std.view(3, 1, 1, 1)
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean, s), torch.distributions.Normal(ref_mean, s)
    )
    torch.testing.assert_close(out.kl, kl.mean(dim=(1, 2, 3)).mean())


def test_kl_is_measured_but_not_added_when_beta_is_zero():
    ones = torch.ones(2, 3)
    out = policy_loss(
        torch.zeros(2), torch.zeros(2), torch.ones(2), clip_range=1e-4,
        mean=ones, ref_mean=torch.zeros(2, 3), std=torch.ones(2),
    )  # fmt: skip
    torch.testing.assert_close(out.kl, torch.tensor(0.5))
    torch.testing.assert_close(out.loss, out.pg_loss)


def step_kl(sigma, sigma_next, convention, *, substitute=0.9, a=0.7):
    """KL of one SDE step whose policy velocity exceeds the reference's by 1 everywhere."""
    x, v = torch.ones(1, 4), torch.full((1, 4), 0.5)
    step = {"noise_level": a, "sigma_max_substitute": substitute, "next_latents": x}
    out = sde_step(x, v + 1.0, sigma, sigma_next, **step)
    ref = sde_step(x, v, sigma, sigma_next, **step)
    logp = torch.zeros(1)
    return policy_loss(
        logp, logp, torch.zeros(1), clip_range=1e-4, beta=0.04,
        mean=out.mean, ref_mean=ref.mean, std=kl_std(out, convention),
    ).kl  # fmt: skip


def test_kl_conventions_hand_values_at_sigma_one():
    # sigma = 1 -> 0.9: s = 0.9 (the second sigma), std_dev_t^2 = 0.49 * 1 / 0.1 = 4.9; the
    # velocity's coefficient is 1 + 4.9 * (1 - 1) / 2 = 1, so the means differ by 1 * dt = -0.1.
    # reference: 0.01 / (2 * 4.9) = 1.0204e-3; gaussian divides by 2 * 4.9 * |dt| = 0.98 instead.
    torch.testing.assert_close(step_kl(1.0, 0.9, "reference"), torch.tensor(0.01 / 9.8))
    torch.testing.assert_close(step_kl(1.0, 0.9, "gaussian"), torch.tensor(0.01 / 0.98))


def test_kl_conventions_hand_values_mid_range():
    # sigma = 0.5 -> 0.4: std_dev_t^2 = 0.49 * 0.5 / 0.5 = 0.49; coefficient 1 + 0.49 * 0.5 / 1
    # = 1.245, so the means differ by 1.245 * -0.1 = -0.1245 (squared 0.01550025).
    torch.testing.assert_close(step_kl(0.5, 0.4, "reference"), torch.tensor(0.01550025 / 0.98))
    # The exact Gaussian KL is 1/|dt| = 10 times the reference's on this step.
    torch.testing.assert_close(step_kl(0.5, 0.4, "gaussian"), torch.tensor(0.01550025 / 0.098))


def test_kl_conventions_agree_for_cps():
    x, v = torch.ones(2, 4), torch.full((2, 4), 0.5)
    out = cps_step(x, v, 0.5, 0.25, noise_level=0.5, next_latents=x)
    assert torch.equal(kl_std(out, "reference"), kl_std(out, "gaussian"))
    with pytest.raises(FlowGrpoError, match="choose 'reference' or 'gaussian'"):
        kl_std(out, "exact")


def reference_code_loss(x, v, v_ref, x_next, sigma, sigma_next, sigma_max, a, adv, old, eps, beta):
    """One step's training loss as the Flow-GRPO reference code computes it: its
    sde_step_with_logprob (per-sample sigmas viewed as [B, 1, 1, 1]) and train_sd3.py's loss,
    formula for formula, written out independently of flowgrpo_cli."""
    sigma, sigma_next = sigma.view(-1, 1, 1, 1), sigma_next.view(-1, 1, 1, 1)
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * a

    def step_mean(velocity):
        return (
            x * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )

    mean, mean_ref = step_mean(v), step_mean(v_ref)
    scale = std_dev_t * torch.sqrt(-1 * dt)
    log_prob = (
        -((x_next - mean) ** 2) / (2 * scale**2)
        - torch.log(scale)
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    ).mean(dim=(1, 2, 3))
    ratio = torch.exp(log_prob - old)
    policy = torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps, 1 + eps)))
    kl = torch.mean(((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2))
    return policy + beta * kl, kl


def test_reference_convention_with_beta_0_04_is_the_reference_codes_loss():
    # A recorded step: three samples at sigma 1 (the second-sigma rule), 0.7 and 0.3 of a
    # 10-step shift-3 schedule, the policy's velocity moved off the reference's, old log-probs
    # 0.3 below the new ones for two samples (clipped) and equal for one.
    gen = torch.Generator().manual_seed(7)
    x, v_ref = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    v = (v_ref + 0.3 * torch.randn(3, 4, 2, 2, generator=gen)).requires_grad_()
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.3]), torch.tensor([0.9643, 0.6, 0.2])
    a, sigma_max, eps, beta = 0.7, 0.9643, 1e-4, 0.04
    step = {"noise_level": a, "sigma_max_substitute": sigma_max}
    x_next = sde_step(x, v_ref, sigma, sigma_next, **step, generators=[
        torch.Generator().manual_seed(s) for s in range(3)
    ]).next_latents  # fmt: skip
    out = sde_step(x, v, sigma, sigma_next, **step, next_latents=x_next)
    ref_mean = sde_step(x, v_ref, sigma, sigma_next, **step, next_latents=x_next).mean
    old = out.log_prob.detach() - torch.tensor([0.3, 0.0, -0.3])
    adv = torch.tensor([1.2, -0.4, 0.7])
    ours = policy_loss(
        out.log_prob, old, adv, clip_range=eps, beta=beta,
        mean=out.mean, ref_mean=ref_mean, std=kl_std(out, "reference"),
    )  # fmt: skip
    (our_grad,) = torch.autograd.grad(ours.loss, v)
    theirs, their_kl = reference_code_loss(x, v, v_ref, x_next, sigma, sigma_next, sigma_max, a,
                                           adv, old, eps, beta)  # fmt: skip
    (their_grad,) = torch.autograd.grad(theirs, v)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(ours.kl, their_kl)
    torch.testing.assert_close(our_grad, their_grad)
    # The exact Gaussian KL of the same step is another, much larger number (1/|dt| per sample).
    gaussian = policy_loss(
        out.log_prob.detach(), old, adv, clip_range=eps, beta=beta,
        mean=out.mean.detach(), ref_mean=ref_mean, std=kl_std(out, "gaussian"),
    ).kl  # fmt: skip
    assert gaussian > 9 * their_kl


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_range": 0.0}, "clip_range=0.0"),
        ({"clip_range": 1e-4, "beta": -1.0}, "must be >= 0"),
        ({"clip_range": 1e-4, "beta": 0.04}, "pass mean, ref_mean and std"),
        ({"clip_range": 1e-4, "mean": torch.zeros(2, 3)}, "together"),
    ],
)
def test_bad_arguments_say_what_is_allowed(kwargs, message):
    with pytest.raises(FlowGrpoError, match=message):
        policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), **kwargs)
    with pytest.raises(FlowGrpoError, match="each must be"):
        policy_loss(torch.zeros(2), torch.zeros(3), torch.ones(2), clip_range=1e-4)


def test_metrics_accumulate_weighted_by_batch_size():
    metrics = LossMetrics()
    assert metrics.summary() == {}
    # batch of 2: ratios e^0.1, e^-0.1, clipfrac 1; batch of 1: ratio e^0.2, clipfrac 1.
    metrics.add(
        policy_loss(torch.tensor([0.1, -0.1]), torch.zeros(2), torch.ones(2), clip_range=1e-4)
    )
    metrics.add(policy_loss(torch.tensor([0.2]), torch.zeros(1), torch.ones(1), clip_range=1e-4))
    s = metrics.summary()
    # every field but grpo_guard's raw_ratio_mean, which only GRPO_GUARD_FOLDS reports
    metric_fields = {f.name for f in dataclasses.fields(LossOutput)} - {
        "batch_size",
        "raw_ratio_mean",
    }
    assert set(s) == {f"update/{name}" for name in metric_fields}
    assert s["update/clipfrac"] == 1.0
    assert s["update/clipfrac_above"] == pytest.approx(2 / 3)  # (0.5 * 2 + 1 * 1) / 3
    assert s["update/ratio_mean"] == pytest.approx(
        (math.exp(0.1) + math.exp(-0.1) + math.exp(0.2)) / 3
    )
    assert s["update/ratio_min"] == pytest.approx(math.exp(-0.1))
    assert s["update/ratio_max"] == pytest.approx(math.exp(0.2))
    assert s["update/approx_kl"] == pytest.approx((0.005 * 2 + 0.02 * 1) / 3)
    assert s["update/log_ratio_max_abs"] == pytest.approx(0.2)
