"""The exported checkpoint is the trained policy: diffusers' load_lora_weights() reproduces it.

A user takes away checkpoints/iter-N and loads it with `pipe.load_lora_weights(folder)` (the
EMA weights from `folder / "ema"`). These tests train a LoRA with alpha != r for a few optimizer
steps on each family's tiny pipeline, load the checkpoint the way a user does, and compare the
transformer's output and the noise-0 image with the policy that was trained.
"""

import numpy as np
import pytest
import torch
from flowgrpo_cli.stages import rollout
from helpers import do_iteration, policy_for

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.training.policy import EMA_FOLDER, load_weights

# SD3.5's block kinds (dual attention, whose attn2 the default targets leave frozen), FLUX, Qwen.
FAMILIES = ["sd35", "flux", "qwenimage"]
PROMPTS = ['A sign that says "OPEN"', 'A mug with "42"']
GUIDANCE = 4.0


def velocities(adapter, cond) -> torch.Tensor:
    """The transformer's (CFG-combined) velocity at a high and a mid-range sigma, [2, 2, ...]."""
    x = torch.randn(2, *adapter.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    return torch.stack([
        adapter.velocity(x, torch.full((2,), sigma), cond, guidance_scale=GUIDANCE)
        for sigma in (1.0, 0.5)
    ])  # fmt: skip


def noise_zero_images(adapter, cond) -> torch.Tensor:
    """Our sampler at noise level 0 (the ODE), as evaluation draws images: [2, 3, 64, 64]."""
    settings = rollout.SamplerSettings(
        kind="sde", noise_level=0.0, guidance_scale=GUIDANCE, height=64, width=64,
        schedule=build_step_schedule(3),
    )  # fmt: skip
    return sample_batch(adapter, cond, [11, 12], settings, adapter.sigmas(3, 64, 64)).images


def pipeline_images(pipe, family) -> torch.Tensor:
    """The diffusers pipeline's own __call__, same seeds and steps: [2, 3, 64, 64]."""
    kwargs = (
        {"true_cfg_scale": GUIDANCE, "negative_prompt": [""] * 2} if family == "qwenimage" else {}
    )
    images = pipe(
        prompt=PROMPTS, num_inference_steps=3, guidance_scale=GUIDANCE, height=64, width=64,
        generator=[torch.Generator().manual_seed(s) for s in (11, 12)], output_type="np",
        **kwargs,
    ).images  # fmt: skip
    return torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2)


def load_pipeline(folder, lora=None):
    """The base pipeline as a user loads it, with a LoRA folder loaded the way they would."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loaded_by_diffusers_is_the_trained_policy(make_run, tiny_model_dir, family):
    # alpha / r = 3: a loader that took alpha = r would run the LoRA at a third of its strength.
    config, run = make_run(
        "train.lora_rank=4", "train.lora_alpha=12", "train.lr=0.05", "train.ema_decay=0.5",
        family=family,
    )  # fmt: skip
    _, trainer = do_iteration(config, run)
    assert trainer.state.optimizer_steps == 2
    policy = trainer.policy
    wrap = type(policy.adapter)  # our adapter around the user's pipeline: the same forward call
    cond = policy.adapter.encode_prompts(PROMPTS, None, guidance_scale=GUIDANCE)
    base = velocities(wrap(load_pipeline(tiny_model_dir(family))), cond)
    trained, images = velocities(policy.adapter, cond), noise_zero_images(policy.adapter, cond)
    with trainer.ema_weights():
        ema, ema_images = velocities(policy.adapter, cond), noise_zero_images(policy.adapter, cond)
    # The comparison means something: the LoRA moves the output, and the EMA is another model.
    assert (trained - base).abs().max().item() > 1e-2
    assert (ema - trained).abs().max().item() > 1e-3

    checkpoint = run.checkpoint_dir(0)
    for folder, ours, our_images in [
        (checkpoint, trained, images),
        (checkpoint / EMA_FOLDER, ema, ema_images),
    ]:
        pipe = load_pipeline(tiny_model_dir(family), folder)
        assert (velocities(wrap(pipe), cond) - ours).abs().max().item() < 1e-6
        assert (pipeline_images(pipe, family) - our_images).abs().max().item() < 1e-5


def test_a_checkpoint_of_another_lora_alpha_is_refused(make_run):
    config, run = make_run("train.lora_alpha=12")
    do_iteration(config, run)
    other, _ = make_run("train.lora_alpha=4", name="other")
    with pytest.raises(FlowGrpoError, match="lora_alpha = 12, the policy's adapter has"):
        load_weights(policy_for(other, run), run.checkpoint_dir(0))
