"""Group-relative advantages and data metrics against hand values."""

import math

import pytest
import torch

from flowgrpo_cli.algorithm.advantages import compute_advantages, data_metrics
from flowgrpo_cli.errors import FlowGrpoError

REWARDS = torch.tensor([1.0, 3.0, 0.0, 2.0])
GROUPS = torch.tensor([7, 7, 4, 4])  # groups a, a, b, b (ids need not be 0..G-1 nor sorted)


def test_no_std_is_reward_minus_group_mean():
    a = compute_advantages(REWARDS, GROUPS, std_mode="none")
    assert a.tolist() == [-1.0, 1.0, -1.0, 1.0]  # group means 2 and 1
    assert a.dtype == torch.float32


def test_group_std():
    # Population std of {1, 3} and of {0, 2} is 1.
    a = compute_advantages(REWARDS, GROUPS, std_mode="group")
    u = 1 / (1 + 1e-4)
    torch.testing.assert_close(a, torch.tensor([-u, u, -u, u]))


def test_global_std_is_the_population_std_of_all_rewards():
    # mean 1.5, squared deviations 0.25 + 2.25 + 2.25 + 0.25 = 5, / 4 -> std sqrt(1.25)
    # = 1.118034 (ddof 1 would give 1.290994).
    a = compute_advantages(REWARDS, GROUPS, std_mode="global")
    u = 1 / (1.118034 + 1e-4)
    torch.testing.assert_close(a, torch.tensor([-u, u, -u, u]))


@pytest.mark.parametrize("std_mode", ["global", "group", "none"])
def test_a_group_of_one_gets_zero(std_mode):
    a = compute_advantages(
        torch.tensor([1.0, 3.0, 9.0]), torch.tensor([0, 0, 1]), std_mode=std_mode
    )
    assert a[2].item() == 0.0
    assert a[0].item() < 0 < a[1].item()


@pytest.mark.parametrize("std_mode", ["global", "group", "none"])
def test_advantages_do_not_depend_on_the_number_of_timesteps(std_mode):
    per_image = compute_advantages(REWARDS, GROUPS, std_mode=std_mode)  # [N]
    for steps in (1, 3, 10):
        # Even a caller who flattened a per-timestep copy [N * T] gets the per-image values:
        # the statistics are population ones (a ddof-1 std would shrink as T grows).
        flat = compute_advantages(
            REWARDS.repeat_interleave(steps), GROUPS.repeat_interleave(steps), std_mode=std_mode
        )
        torch.testing.assert_close(flat.view(4, steps), per_image[:, None].expand(4, steps))
    with pytest.raises(FlowGrpoError, match="one reward per image"):
        compute_advantages(REWARDS[:, None].expand(-1, 10), GROUPS)


def test_clipping():
    # 99 zeros and a one in one group: mean 0.01, population std sqrt(0.01 * 0.99).
    rewards = torch.tensor([0.0] * 99 + [1.0])
    groups = torch.zeros(100, dtype=torch.int64)
    denominator = math.sqrt(0.0099) + 1e-4
    raw = compute_advantages(rewards, groups, std_mode="group", clip=None)
    assert raw[-1].item() == pytest.approx(0.99 / denominator, rel=1e-6)  # 9.94
    clipped = compute_advantages(rewards, groups, std_mode="group", clip=5.0)
    assert clipped[-1].item() == 5.0
    assert clipped[0].item() == pytest.approx(-0.01 / denominator, rel=1e-6)


def test_permuting_images_permutes_advantages():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=gen)
    groups = torch.arange(24) // 6
    perm = torch.randperm(24, generator=gen)
    a = compute_advantages(rewards, groups)
    torch.testing.assert_close(compute_advantages(rewards[perm], groups[perm]), a[perm])


@pytest.mark.parametrize(
    ("rewards", "groups", "kwargs", "message"),
    [
        (torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]), {}, "1 of 2 rewards"),
        (REWARDS, GROUPS, {"std_mode": "batch"}, "must be one of"),
        (REWARDS, GROUPS.float(), {}, "integer dtype"),
        (REWARDS, GROUPS[:3], {}, "one group id per reward"),
        (REWARDS, GROUPS, {"clip": 0.0}, "must be > 0"),
        (torch.tensor([]), torch.tensor([], dtype=torch.int64), {}, "no rewards"),
    ],
)
def test_bad_arguments_say_what_is_allowed(rewards, groups, kwargs, message):
    with pytest.raises(FlowGrpoError, match=message):
        compute_advantages(rewards, groups, **kwargs)


def test_data_metrics_hand_values():
    ocr = torch.tensor([1.0, 3.0, 0.0, 2.0, 4.0, 4.0, 7.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4])  # group 2 all equal, group 3 of one
    advantages = torch.tensor([-5.0, 5.0, -1.0, 1.0, 0.0, 0.0, 0.0, -1.0, 1.0])
    m = data_metrics({"ocr": ocr}, 0.5 * ocr, groups, advantages, clip=5.0)
    assert m["reward/ocr_mean"] == pytest.approx(3.0)  # 27 / 9
    # squared deviations 4 + 0 + 9 + 1 + 1 + 1 + 16 + 4 + 4 = 40, / 9
    assert m["reward/ocr_std"] == pytest.approx(math.sqrt(40 / 9))
    assert (m["reward/ocr_min"], m["reward/ocr_max"]) == (0.0, 7.0)
    assert m["reward/mean"] == pytest.approx(1.5) and m["reward/max"] == 3.5
    assert m["reward/zero_std_group_ratio"] == pytest.approx(2 / 5)  # groups 2 and 3
    assert m["advantage/mean"] == 0.0 and m["advantage/min"] == -5.0
    assert m["advantage/std"] == pytest.approx(math.sqrt(54 / 9))
    assert m["advantage/clipped_frac"] == pytest.approx(2 / 9)
