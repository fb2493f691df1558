"""grpo_guard, nft (DiffusionNFT) and awm (Advantage Weighted Matching): their losses against
values worked out by hand from the papers' formulas, the direction of their gradients, their
noise-level draws and anchor schedule, what rollout stores for them, and their updates end to
end."""

import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import do_rollout, do_score, do_update, policy_for, stored_rows
from safetensors.torch import load_file

from flowgrpo_cli.algorithm.anchor import anchor_decay
from flowgrpo_cli.algorithm.awm import awm_loss
from flowgrpo_cli.algorithm.forward import awm_timestep_indices, nft_timestep_indices, noised
from flowgrpo_cli.algorithm.grpo_guard import normalized_log_ratio, step_weight
from flowgrpo_cli.algorithm.loss import policy_loss
from flowgrpo_cli.algorithm.nft import nft_loss, optimality
from flowgrpo_cli.algorithm.schedule import WindowMotion
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.loop import run_loop
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.rundir import ROLLOUT
from flowgrpo_cli.store.trajectory import STEP_COLUMNS, from_record_batch, iter_batches, open_part
from flowgrpo_cli.training.algorithms import algorithm_for

ONE = (1, 1)  # a batch of one sample whose latent is a single element


def scalar(value: float) -> torch.Tensor:
    return torch.full(ONE, value)


def test_optimality_is_the_clipped_advantage_mapped_to_0_1():
    a = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 7.0])
    assert optimality(a, 5.0).tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0]


def test_noised_latent_interpolates_data_and_noise():
    x0, eps = torch.tensor([[1.0], [1.0]]), torch.tensor([[3.0], [3.0]])
    assert noised(x0, eps, torch.tensor([0.5, 0.25])).flatten().tolist() == [2.0, 1.5]


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, s: float) -> torch.Tensor:
    """The step's log-prob as sde_step takes it: log N(x; mean, s^2) averaged per sample."""
    density = -((x - mean) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)
    return density.mean(dim=1)


def test_ratio_norm_by_hand():
    # one element: mu_old = 0, mu = 0.1, s = 0.5, eps = 1, so x = 0.5.
    # logp - logp_old = (-(0.4^2) + 0.5^2) / (2 * 0.25) = 0.18; bias = 0.01 / 0.5 = 0.02;
    # (0.18 + 0.02) * 0.5 = 0.1 = eps * (mu - mu_old).
    x, mu, mu_old = torch.tensor([[0.5]]), torch.tensor([[0.1]]), torch.tensor([[0.0]])
    logp, old = gaussian_log_prob(x, mu, 0.5), gaussian_log_prob(x, mu_old, 0.5)
    log_r = normalized_log_ratio(logp, old, mu, mu_old, torch.tensor([0.5]))
    assert log_r.item() == pytest.approx(0.1, rel=1e-5)


def test_ratio_norm_is_the_noise_times_the_mean_shift_whatever_the_step_std():
    generator = torch.Generator().manual_seed(0)
    mu_old = torch.randn(3, 64, generator=generator)
    mu = mu_old + 0.01 * torch.randn(3, 64, generator=generator)
    eps = torch.randn(3, 64, generator=generator)
    for s in (0.02, 0.3):  # the raw log-ratio scales as 1/s; the normalised one does not
        x = mu_old + s * eps
        log_r = normalized_log_ratio(
            gaussian_log_prob(x, mu, s), gaussian_log_prob(x, mu_old, s), mu, mu_old,
            torch.full((3,), s),
        )  # fmt: skip
        torch.testing.assert_close(log_r, (eps * (mu - mu_old)).mean(dim=1), rtol=1e-4, atol=1e-6)


def test_guard_weights_the_policy_term_by_one_over_dt():
    assert step_weight(torch.tensor([0.9, 0.9]), torch.tensor([0.5, 0.5])) == pytest.approx(2.5)
    # ratio exp(0.2) > 1 + eps with A = 1: pg = -clip(ratio) = -(1 + 0.1); times 2.5
    out = policy_loss(
        torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([1.0]), clip_range=0.1,
        clipped_log_ratio=torch.tensor([0.2]), pg_scale=2.5,
    )  # fmt: skip
    assert out.loss.item() == pytest.approx(-1.1 * 2.5)
    assert (out.ratio_mean.item(), out.raw_ratio_mean.item()) == pytest.approx((math.exp(0.2), 1.0))


@pytest.mark.parametrize(
    ("iteration", "expected"),
    [(0, 0), (24, 0), (25, 1), (49, 1), (50, 2), (500, 5)],  # MixGRPO: every 25, stride 1
)
def test_the_mixgrpo_window_slides_then_stays(iteration, expected):
    motion = WindowMotion(lowest=0, highest=5, shift_every=25, stride=1)
    assert motion.start(iteration) == expected


def test_mixgrpo_decay_shortens_the_stays_linearly():
    """MixGRPO's decay on 25 steps (p = s / 23), stays from 10 down to 1: at s = 0,
    int(10) = 10; at s = 1, int(10 * 22/23 + 1/23) = int(9.61) = 9; at s = 2, int(9.22) = 9."""
    motion = WindowMotion(lowest=0, highest=3, shift_every=10, stride=1, schedule="decay",
                          shift_every_min=1, num_steps=25)  # fmt: skip
    assert [motion.stay(s) for s in (0, 1, 2, 23)] == [10, 9, 9, 1]
    starts = [motion.start(k) for k in range(40)]
    assert starts == [0] * 10 + [1] * 9 + [2] * 9 + [3] * 12


def test_mixgrpo_exp_decay_shortens_the_stays_past_the_threshold():
    """ceil(5 exp(-0.1 max(0, s - 13))): 5 up to s = 15 (ceil(4.09)), 4 at 16 (ceil(3.70)),
    3 at 20 (ceil(2.48)), 1 at 30 (ceil(0.91))."""
    motion = WindowMotion(lowest=14, highest=17, shift_every=5, stride=1, schedule="exp_decay")
    assert [motion.stay(s) for s in (10, 15, 16, 20, 30)] == [5, 5, 4, 3, 1]
    starts = [motion.start(k) for k in range(20)]
    assert starts == [14] * 5 + [15] * 5 + [16] * 4 + [17] * 6
    frozen = WindowMotion(lowest=2, highest=9, shift_every=1, stride=0, schedule="exp_decay")
    assert frozen.start(50) == 2  # stride 0 (MixGRPO-Flash*): the window never moves


def test_mixgrpo_rollout_windows_move_with_the_iteration(make_run):
    config, _ = make_run("algorithm.name=mixgrpo", "sampler.num_steps=6",
                         "sampler.window_size=2", "sampler.window_shift_every=2")  # fmt: skip
    windows = [algorithm_for(config).step_schedule(k).stochastic_indices for k in range(10)]
    # [0, num_steps - window_size - 1] = [0, 3]: the window never reaches the last step
    assert windows == [(0, 1)] * 2 + [(1, 2)] * 2 + [(2, 3)] * 2 + [(3, 4)] * 4
    decaying, _ = make_run("algorithm.name=mixgrpo", "sampler.num_steps=6",
                           "sampler.window_size=2", "sampler.window_shift_every=3",
                           "sampler.window_schedule=decay", name="decay")  # fmt: skip
    windows = [algorithm_for(decaying).step_schedule(k).stochastic_indices[0] for k in range(10)]
    # p = s / 4: stays int(3), int(2.5), int(2) (at least window_shift_every_min = 1)
    assert windows == [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    unset, _ = make_run("algorithm.name=mixgrpo", name="unset")
    with pytest.raises(FlowGrpoError, match=r"set sampler\.window_size"):
        algorithm_for(unset).step_schedule(0)


def nft_case(v: float, advantage: float, **kw):
    # x0 = 1, eps = 3, t = 0.5: x_t = 2; v_old = 1; b = 0.5; c = 5.
    v_t = scalar(v).requires_grad_()
    out = nft_loss(
        v_t, scalar(1.0), scalar(2.0), scalar(1.0), torch.tensor([0.5]),
        torch.tensor([advantage]), nft_beta=0.5, advantage_clip=5.0, **kw,
    )  # fmt: skip
    return out, v_t


def test_nft_loss_by_hand():
    # v = 4: v+ = 0.5*4 + 0.5*1 = 2.5, x0+ = 2 - 0.5*2.5 = 0.75, error -0.25:
    #   L+ = 0.0625 / 0.25 = 0.25.  v- = 1.5*1 - 0.5*4 = -0.5, x0- = 2.25, error 1.25:
    #   L- = 1.5625 / 1.25 = 1.25.
    # A = 5 (r = 1): 5 * (1 * 0.25) / 0.5 = 2.5.  A = 2.5 (r = 0.75): 5 * (0.1875 + 0.3125) /
    # 0.5 = 5.0.
    out, _ = nft_case(4.0, 5.0)
    assert out.loss.item() == pytest.approx(2.5)
    assert out.loss_positive.item() == pytest.approx(0.25)
    assert out.loss_negative.item() == pytest.approx(1.25)
    assert nft_case(4.0, 2.5)[0].loss.item() == pytest.approx(5.0)
    # the velocity KL: (v - v_ref)^2 = (4 - 2)^2 = 4, weight 0.1
    with_kl = nft_case(4.0, 5.0, beta=0.1, v_ref=scalar(2.0))[0]
    assert with_kl.loss.item() == pytest.approx(2.5 + 0.4)
    assert with_kl.kl.item() == pytest.approx(4.0)


def test_nft_gradient_by_hand_and_its_direction():
    # r = 1, v = 4: d/dv [5 * L+ / 0.5], L+ = err^2 / sg|err|, d err / dv = -t b = -0.25:
    # 10 * 2 * (-0.25) * (-0.25) / 0.25 = 5.
    out, v = nft_case(4.0, 5.0)
    out.loss.backward()
    assert v.grad.item() == pytest.approx(5.0)
    # At v = v_old (where each update starts: the anchor is the policy) both implicit policies
    # are v_old, err = x_t - t v_old - x0 = 0.5, and the gradient is 2 c t sign(err) (1 - 2r)
    # = 5 (1 - 2r): a reward above the group's mean (r > 1/2) moves v up, from v_old = 1 toward
    # the target eps - x0 = 2; one below moves it away; r = 1/2 leaves it.
    for advantage, r in [(5.0, 1.0), (2.5, 0.75), (0.0, 0.5), (-5.0, 0.0)]:
        out, v = nft_case(1.0, advantage)
        out.loss.backward()
        assert v.grad.item() == pytest.approx(5.0 * (1 - 2 * r), abs=1e-6)


def awm_case(v: float, advantage: float, **kw):
    # target eps - x0 = 1, t = 0.5, p = 0.25, c = 5.
    v_t = scalar(v).requires_grad_()
    out = awm_loss(
        v_t, scalar(1.0), torch.tensor([0.5]), torch.tensor([advantage]), power=0.25,
        advantage_clip=5.0, **kw,
    )  # fmt: skip
    return out, v_t


def test_awm_loss_and_gradient_by_hand():
    # v = 3: m = 4; logp = -((4 + 1e-10)^0.25 - 1e-10^0.25) 0.5 / 0.25 = -2 (sqrt 2 - 0.01)
    out, v = awm_case(3.0, 2.5)
    assert out.log_prob.item() == pytest.approx(-2 * (math.sqrt(2) - 1e-10**0.25), rel=1e-6)
    assert out.fm_loss.item() == pytest.approx(4.0)
    assert out.pg_loss.item() == pytest.approx(-0.5)  # -A' with A' = 2.5 / 5, the ratio is 1
    # d pg / dv = -A' d logp / dv = 0.5 * 0.25 m^-0.75 * 2 (v - target) * t / p
    out.loss.backward()
    expected = 0.5 * 0.25 * 4**-0.75 * 2 * 2 * 0.5 / 0.25
    assert v.grad.item() == pytest.approx(expected, rel=1e-5)
    assert v.grad.item() > 0  # a positive advantage lowers v toward the target 1
    out, v = awm_case(3.0, -2.5)
    out.loss.backward()
    assert v.grad.item() < 0  # a negative one raises the sample's error


def test_awm_negative_weight_scales_only_negative_advantages():
    # A = -2.5: A' = -0.5, times 0.5 = -0.25; pg = -A' = 0.25, gradient half the unscaled one
    out, v = awm_case(3.0, -2.5, negative_weight=0.5)
    assert out.pg_loss.item() == pytest.approx(0.25)
    out.loss.backward()
    expected = -0.25 * 0.25 * 4**-0.75 * 2 * 2 * 0.5 / 0.25
    assert v.grad.item() == pytest.approx(expected, rel=1e-5)
    out, v = awm_case(3.0, -2.5, negative_weight=0.0)
    out.loss.backward()
    assert v.grad.item() == 0.0  # below-average samples teach nothing
    out, v = awm_case(3.0, 2.5, negative_weight=0.0)
    assert out.pg_loss.item() == pytest.approx(-0.5)  # positive advantages are untouched


def test_awm_kl_terms_by_hand():
    out, _ = awm_case(3.0, 2.5, beta=0.1, v_ref=scalar(2.0), anchor_kl=1.0,
                      v_anchor=scalar(3.5))  # fmt: skip
    # -0.5 + 0.1 * (3 - 2)^2 + 1.0 * (3 - 3.5)^2
    assert out.loss.item() == pytest.approx(-0.5 + 0.1 + 0.25)
    assert (out.kl.item(), out.kl_anchor.item()) == pytest.approx((1.0, 0.25))


def _fm_loss_by_hand(config, run, guided: bool) -> float:
    """The mean flow-matching error of the update's draws under the initial weights, of the
    conditional velocity v or of v_neg + g (v - v_neg), v_neg a plain forward of the negative
    prompt's embeddings: the guidance put together here, not by the adapter's CFG batch."""
    rows, stored = stored_rows(run)
    adapter = policy_for(config, run).adapter
    sigmas = adapter.sigmas(config.sampler.num_steps, config.model.height, config.model.width)
    errors = []
    for i, sid in enumerate(rows.sample_ids):
        tensors = {k: v.unsqueeze(0) for k, v in stored[rows.group_ids[i]].items()}
        positive = Conditioning({k: tensors[k] for k in ("prompt_embeds", "pooled_prompt_embeds")})
        negative = Conditioning({k: tensors[f"negative_{k}"] for k in positive.tensors})
        x0 = rows.latents[i : i + 1, -1]
        draws = algorithm_for(config).draw(0, 0, sid, tuple(x0.shape[1:]), config.sampler.num_steps)
        for index, noise in zip(draws.indices, draws.noise, strict=True):
            t = sigmas[index].reshape(1)
            x_t = noised(x0, noise[None], t)
            with torch.no_grad():
                v = adapter.velocity(x_t, t, positive, guidance_scale=1.0)
                if guided:
                    v_neg = adapter.velocity(x_t, t, negative, guidance_scale=1.0)
                    v = v_neg + config.sampler.guidance_scale * (v - v_neg)
            errors.append(((v - (noise[None] - x0)) ** 2).mean().item())
    return sum(errors) / len(errors)


@pytest.mark.parametrize("train_cfg", [False, True])
def test_awm_trains_the_guided_velocity_with_train_cfg(make_run, train_cfg):
    """The images are sampled with CFG 4.5; the update's flow-matching error is that of the
    conditional velocity by default and of the guided one with algorithm.train_cfg."""
    config, run = make_run(
        "algorithm.name=awm", "sampler.noise_level=0", "sampler.guidance_scale=4.5",
        "algorithm.beta=0", "algorithm.anchor_kl=0", "algorithm.drop_zero_advantage=false",
        "train.steps_per_epoch=1", f"algorithm.train_cfg={str(train_cfg).lower()}",
    )  # fmt: skip
    do_rollout(config, run)
    do_score(config, run)
    result, _ = do_update(config, run)  # one optimizer step, after every micro-batch
    measured = result.metrics["update/fm_loss"]
    assert measured == pytest.approx(_fm_loss_by_hand(config, run, guided=train_cfg), rel=1e-4)
    other = _fm_loss_by_hand(config, run, guided=not train_cfg)
    assert measured != pytest.approx(other, rel=1e-2)


def test_train_cfg_is_refused_where_it_cannot_apply(make_run):
    """Refused before anything is sampled, and by the update too (a rollout made before)."""
    config, run = make_run(*FORWARD, name="made_before")
    do_rollout(config, run)
    do_score(config, run)
    for name in ("flow_grpo", "grpo_guard", "mixgrpo"):
        config, fresh = make_run(*SETTINGS.get(name, ()), f"algorithm.name={name}",
                                 "algorithm.train_cfg=true", name=name)  # fmt: skip
        with pytest.raises(FlowGrpoError, match=f"train_cfg is for nft and awm; {name}"):
            do_rollout(config, fresh)
        with pytest.raises(FlowGrpoError, match=f"train_cfg is for nft and awm; {name}"):
            do_update(config, run)
    config, _ = make_run("algorithm.name=awm", "algorithm.train_cfg=true", name="awm")
    awm = algorithm_for(config)
    with pytest.raises(FlowGrpoError, match="sampled with guidance_scale 1, without CFG"):
        awm.trained_guidance(1.0, guidance_embeds=False)
    assert awm.trained_guidance(4.5, guidance_embeds=False) == 4.5
    # Without train_cfg: the conditional velocity, or the embedded scale of a distilled model;
    # a trajectory algorithm trains the velocity it sampled with.
    config, _ = make_run("algorithm.name=awm", name="awm-plain")
    assert algorithm_for(config).trained_guidance(4.5, guidance_embeds=False) == 1.0
    assert algorithm_for(config).trained_guidance(3.5, guidance_embeds=True) == 3.5
    config, _ = make_run(name="flow-grpo-plain")
    assert algorithm_for(config).trained_guidance(4.5, guidance_embeds=False) == 4.5


def test_nft_draws_distinct_steps_of_the_grid():
    for seed in range(20):
        picks = nft_timestep_indices(10, 9, torch.Generator().manual_seed(seed)).tolist()
        assert len(set(picks)) == 9 and all(0 <= p < 10 for p in picks)


def test_awm_draws_one_step_per_stratum():
    # 14 steps, 6 draws: bounds linspace(1, int(12.6), 7) = [1, 2, 4, 6, 8, 10, 12] (truncated)
    seen = set()
    for seed in range(50):
        picks = awm_timestep_indices(14, 6, torch.Generator().manual_seed(seed)).tolist()
        for pick, (low, high) in zip(picks, [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)],
                                     strict=True):  # fmt: skip
            assert low <= pick < high
        seen.update(picks)
    assert seen == set(range(1, 12))  # never sigma = 1 (step 0) nor the last tenth


@pytest.mark.parametrize(
    ("schedule", "steps", "expected"),
    [
        ((0.0, 0.001, 0.5), 0, 0.0),
        ((0.0, 0.001, 0.5), 300, 0.3),
        ((0.0, 0.001, 0.5), 900, 0.5),
        ((75.0, 0.0075, 0.999), 74, 0.0),  # DiffusionNFT's OCR schedule
        ((75.0, 0.0075, 0.999), 175, 0.75),
        ((75.0, 0.0075, 0.999), 10_000, 0.999),
    ],
)
def test_anchor_decay_schedule(schedule, steps, expected):
    assert anchor_decay(schedule, steps) == pytest.approx(expected)


FORWARD = ("sampler.guidance_scale=1.0", "eval.guidance_scale=1.0", "algorithm.beta=0.0001")
# What each algorithm needs beyond the shared tiny run (mixgrpo: a window that moves every
# iteration, from step 0 to step 1 of the run's 3).
SETTINGS = {
    "grpo_guard": FORWARD,
    "mixgrpo": (*FORWARD, "sampler.window_size=1", "sampler.window_shift_every=1"),
    "nft": FORWARD,
    "awm": FORWARD,
}


def test_forward_methods_store_the_clean_latent_alone(make_run):
    """Same seeds and sampler: the nft part holds exactly the last state of flow_grpo's."""
    config, run = make_run(*FORWARD, "algorithm.name=nft", name="nft")
    reference_config, reference = make_run(*FORWARD, name="flow_grpo")
    do_rollout(config, run)
    do_rollout(reference_config, reference)
    part = run.stage_dir(0, ROLLOUT) / "part-00000-of-00001.arrow"
    full_part = reference.stage_dir(0, ROLLOUT) / part.name
    assert not set(STEP_COLUMNS) & set(open_part(part).schema.names)
    ours = from_record_batch(next(iter_batches([part])))
    full = from_record_batch(next(iter_batches([full_part])))
    assert ours.log_probs.shape == (4, 0) and ours.latents.shape[1] == 1
    assert torch.equal(ours.latents[:, 0], full.latents[:, -1])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_resumed_run_ends_with_the_uninterrupted_runs_checkpoint(make_run, name):
    """Two iterations in one go, or one and then a fresh process-like start from the
    checkpoint (anchor included): the same bytes, anchor and optimizer state included."""
    config, straight = make_run(*SETTINGS[name], f"algorithm.name={name}", name="straight")
    run_loop(config, straight, 2)
    config, resumed = make_run(*SETTINGS[name], f"algorithm.name={name}", name="resumed")
    run_loop(config, resumed, 1)
    run_loop(config, resumed, 2)
    files = ["pytorch_lora_weights.safetensors", "optimizer.safetensors"]
    if name != "mixgrpo":  # the others keep an anchor
        files.append("anchor/pytorch_lora_weights.safetensors")
    for file in files:
        a = (straight.checkpoint_dir(1) / file).read_bytes()
        assert a == (resumed.checkpoint_dir(1) / file).read_bytes(), file


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo_guard", "nft", "awm"])  # mixgrpo updates as flow_grpo
def test_two_processes_train_the_same_weights_and_anchor_as_one(make_run, name):
    """Each sample draws its noise levels and noises from its own generator, so splitting the
    batches over ranks changes nothing: FSDP2's step equals the single-process one."""
    # grpo_guard's anchor always follows the weights (decay 0); nft's and awm's lag them here
    decay = [] if name == "grpo_guard" else ["algorithm.anchor_decay=[0, 0.2, 0.5]"]
    config, run = make_run(*SETTINGS[name], f"algorithm.name={name}", "sampler.batch_size=2",
                           *decay)  # fmt: skip
    do_rollout(config, run)
    do_score(config, run)
    two = run.root.parent / "nproc2"
    shutil.copytree(run.root, two)
    do_update(config, run)  # one process: this one
    result = subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", "update", "--run", str(two), "--nproc", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for file in ("pytorch_lora_weights.safetensors", "anchor/pytorch_lora_weights.safetensors"):
        one = load_file(run.checkpoint_dir(0) / file)
        other = load_file(two / "checkpoints/iter-000000" / file)
        assert one.keys() == other.keys()
        assert max((one[k] - other[k]).abs().max().item() for k in one) < 1e-5, file


# Per algorithm, what the learning check changes: grpo_guard samples as the demo does (SDE,
# CFG); nft and awm roll out CFG-free with the ODE and take one optimizer step per iteration.
LEARNING = {
    "grpo_guard": ("sampler.noise_level=1.0", "sampler.guidance_scale=4.5",
                   "algorithm.clip_range=0.2"),
    "mixgrpo": ("sampler.noise_level=1.0", "sampler.guidance_scale=4.5",
                "algorithm.clip_range=0.2", "sampler.window_size=2",
                "sampler.window_shift_every=6"),
    "nft": (*FORWARD, "sampler.noise_level=0", "train.steps_per_epoch=1"),
    "awm": (*FORWARD, "sampler.noise_level=0", "train.steps_per_epoch=1"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LEARNING))
def test_a_short_run_raises_the_reward(make_run, name, monkeypatch):
    """Brightness (the demo's reward) on the tiny model, 32 images per iteration, 12
    iterations: the mean rollout reward of the last 3 beats the same 3 iterations of an
    untrained twin (lr 1e-9, so Adam moves no weight by more than about 1e-8). Both runs draw
    the same noise, so what differs is what training changed; a before/after comparison of
    one run is not enough, since mixgrpo's moving window alone shifts its reward by +3e-3.
    Measured: grpo_guard +0.047, mixgrpo +0.0067 (2 of the 4 steps in its window), nft +0.0086,
    awm +0.012; all deterministic here."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "examples" / "plugins"))
    last_three = {}
    for lr in ("3e-2", "1e-9"):
        config, run = make_run(
            *LEARNING[name], f"algorithm.name={name}", "sampler.num_steps=4",
            "sampler.batch_size=16", "algorithm.group_size=8", "algorithm.prompts_per_iteration=4",
            "algorithm.beta=0", "algorithm.anchor_kl=0", f"train.lr={lr}", "train.lora_rank=8",
            "train.lora_alpha=16", "train.micro_batch_size=8", "model.max_sequence_length=32",
            'reward.weights={"brightness:score" = 1.0}', name=f"lr-{lr}",
        )  # fmt: skip
        rewards = [s.metrics["reward/mean"] for s in run_loop(config, run, 12)]
        last_three[lr] = sum(rewards[-3:]) / 3
    assert last_three["3e-2"] - last_three["1e-9"] > 4e-3, last_three


@pytest.mark.slow
def test_nft_killed_anywhere_resumes_to_the_same_checkpoint(make_run):
    """SIGKILLed while sampling with the anchor and while updating (which moves it): the
    re-run ends with the uninterrupted run's bytes, anchor included.
    (nft carries the most state of the algorithms; the stage machinery is the one test_loop
    kills flow_grpo in.)"""
    from test_loop import ITERATIONS, loop_command, run_until

    config, reference = make_run(*FORWARD, "algorithm.name=nft", name="reference")
    run_loop(config, reference, ITERATIONS)
    _, crashed = make_run(*FORWARD, "algorithm.name=nft", name="crashed")
    iteration = crashed.iteration_dir(ITERATIONS - 1)
    for marker in ("rollout/pending.json", "update/pending.json"):
        run_until(crashed.root, iteration / marker)
    result = subprocess.run(loop_command(crashed.root), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    last = f"checkpoints/iter-{ITERATIONS - 1:06d}"
    files = ["pytorch_lora_weights.safetensors", "anchor/pytorch_lora_weights.safetensors",
             "optimizer.safetensors"]  # fmt: skip
    for file in files:
        crashed_bytes = (crashed.root / last / file).read_bytes()
        assert crashed_bytes == (reference.root / last / file).read_bytes(), file
