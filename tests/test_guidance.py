"""Classifier-free guidance against hand values, with and without Qwen-Image's rescale."""

import math

import torch

from flowgrpo_cli.models.guidance import apply_cfg


def test_cfg_hand_values():
    # [1, 2] + 4.5 * ([3, 0] - [1, 2]) = [1 + 9, 2 - 9]
    v = apply_cfg(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), 4.5)
    assert v.tolist() == [10.0, -7.0]


def test_scale_one_is_the_conditional_velocity():
    cond, uncond = torch.tensor([0.3, -1.7]), torch.tensor([5.0, 2.0])
    torch.testing.assert_close(apply_cfg(uncond, cond, 1.0), cond)


def test_rescale_to_cond_norm_token_by_token():
    # [B=1, tokens=2, channels=2], scale 2.
    uncond = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])
    cond = torch.tensor([[[0.0, 1.0], [3.0, 4.0]]])
    v = apply_cfg(uncond, cond, 2.0, rescale_to_cond_norm=True)
    # token 1: [1, 0] + 2 [-1, 1] = [-1, 2], norm sqrt 5, rescaled to |cond| = 1.
    # token 2: [6, 8], norm 10, rescaled to |cond| = 5: [3, 4].
    r5 = math.sqrt(5)
    torch.testing.assert_close(v, torch.tensor([[[-1 / r5, 2 / r5], [3.0, 4.0]]]))


def test_rescale_norm_dim_picks_the_channel_axis():
    gen = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(2, 5, 3, generator=gen), torch.randn(2, 5, 3, generator=gen)
    channels_last = apply_cfg(uncond, cond, 4.0, rescale_to_cond_norm=True)
    channels_first = apply_cfg(
        uncond.transpose(1, 2), cond.transpose(1, 2), 4.0, rescale_to_cond_norm=True, norm_dim=1
    )
    torch.testing.assert_close(channels_first.transpose(1, 2), channels_last)
    torch.testing.assert_close(channels_last.norm(dim=-1), cond.norm(dim=-1))


def test_a_zero_combined_token_stays_zero():
    zero = torch.zeros(1, 2, 3)
    v = apply_cfg(zero, zero, 4.5, rescale_to_cond_norm=True)
    assert torch.equal(v, zero)


def test_combines_in_float32():
    gen = torch.Generator().manual_seed(1)
    uncond, cond = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)
    got = apply_cfg(uncond.bfloat16(), cond.bfloat16(), 4.5, rescale_to_cond_norm=True)
    want = apply_cfg(
        uncond.bfloat16().float(), cond.bfloat16().float(), 4.5, rescale_to_cond_norm=True
    )
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
