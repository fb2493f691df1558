"""The clipped policy loss, its KL and its metrics against hand values."""

import dataclasses
import math

import pytest
import torch

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.loss import LossMetrics, LossOutput, policy_loss


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
    metric_fields = {f.name for f in dataclasses.fields(LossOutput)} - {"batch_size"}
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
