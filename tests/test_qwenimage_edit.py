"""Qwen-Image-Edit: the adapter reproduces diffusers' QwenImageEditPipeline on the tiny edit
model (built offline, loaded through load_adapter), and the families refuse the wrong input."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.contract import SamplerSettings

PROMPTS = ["make the sky red", "add a small cat"]
NEGATIVES = ["", "blurry"]
SEEDS = [3, 4]
# Output not square and not the source's size; the sources are 4:3 (resized to 1184 x 896).
HEIGHT, WIDTH, STEPS = 64, 96, 3


def sources(size=(120, 90)):
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        for _ in PROMPTS
    ]


def settings(guidance_scale):
    return SamplerSettings(
        kind="sde", noise_level=0.0, guidance_scale=guidance_scale, height=HEIGHT, width=WIDTH,
        schedule=build_step_schedule(STEPS),
    )  # fmt: skip


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0])
def test_noise_level_zero_equals_the_edit_pipeline(tiny_adapter, guidance_scale):
    adapter = tiny_adapter("qwenimage_edit")
    images = sources()
    cond = adapter.encode_prompts(
        PROMPTS, NEGATIVES, guidance_scale=guidance_scale, source_images=images
    )
    # Encoded once, kept with the text: [B, C, h', w'] latents of the resized source.
    assert cond["image_latents"].shape == (2, 16, 896 // 8, 1184 // 8)
    sigmas = adapter.sigmas(STEPS, HEIGHT, WIDTH)
    ours = sample_batch(adapter, cond, SEEDS, settings(guidance_scale), sigmas).images

    # The pipeline called as it is meant to be, one source image (a PIL image, which it
    # resizes for the text encoder; a list it would hand over unresized) with its prompt.
    expected = []
    for i, seed in enumerate(SEEDS):
        cfg = {"negative_prompt": NEGATIVES[i]} if guidance_scale > 1 else {}
        expected.append(adapter.pipeline(
            image=images[i], prompt=PROMPTS[i], true_cfg_scale=guidance_scale, height=HEIGHT,
            width=WIDTH, num_inference_steps=STEPS, output_type="np",
            generator=torch.Generator().manual_seed(seed), **cfg,
        ).images)  # fmt: skip
    assert torch.equal(adapter.pipeline.scheduler.sigmas, sigmas)
    theirs = torch.from_numpy(np.concatenate(expected)).permute(0, 3, 1, 2)
    assert ours.shape == theirs.shape == (2, 3, HEIGHT, WIDTH)
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.parametrize(("family", "guidance"), [("qwenimage_edit", 1.0), ("flux_kontext", 2.5)])
def test_the_source_image_changes_the_velocity_and_rows_stack(tiny_adapter, family, guidance):
    adapter = tiny_adapter(family)
    first, second = sources()
    rows = [
        adapter.encode_prompts([PROMPTS[0]], None, guidance_scale=guidance, source_images=[image])
        for image in (first, second)
    ]
    cond = Conditioning.cat(rows)  # one row per group, stacked for a batch
    x = adapter.initial_latents([torch.Generator().manual_seed(0)] * 2, HEIGHT, WIDTH)
    v = adapter.velocity(x, torch.full((2,), 0.5), cond, guidance_scale=guidance)
    assert v.shape == x.shape
    assert not torch.allclose(v[0], v[1])  # same prompt and noise, other source image


def test_source_images_of_another_aspect_ratio_do_not_batch(tiny_adapter):
    adapter = tiny_adapter("qwenimage_edit")
    wide = adapter.encode_prompts(["a"], None, guidance_scale=1.0, source_images=sources()[:1])
    tall = adapter.encode_prompts(
        ["a"], None, guidance_scale=1.0, source_images=sources((90, 120))[:1]
    )
    with pytest.raises(FlowGrpoError, match=r"image_latents.*aspect ratio"):
        Conditioning.cat([wide, tall])


def test_families_refuse_the_wrong_input(tiny_adapter):
    with pytest.raises(FlowGrpoError, match="prompts came without one"):
        tiny_adapter("qwenimage_edit").encode_prompts(["a"], None, guidance_scale=1.0)
    with pytest.raises(FlowGrpoError, match="generates from text alone"):
        tiny_adapter("qwenimage").encode_prompts(
            ["a"], None, guidance_scale=1.0, source_images=sources()[:1]
        )


def test_custom_system_prompt_keeps_the_image_in_the_user_turn(tiny_adapter):
    adapter = tiny_adapter("qwenimage_edit")
    template = adapter.pipeline.prompt_template_encode
    image = sources()[:1]
    cond = adapter.encode_prompts(
        ["a"], None, guidance_scale=1.0, system_prompt="Edit {it}.", source_images=image
    )
    # What stays after the dropped system turn: the vision tokens (the processor expands the
    # image placeholder), the instruction and the closing tokens.
    rest = "<|vision_start|><|image_pad|><|vision_end|>a<|im_end|>\n<|im_start|>assistant\n"
    resized = adapter.resized_source(image[0])
    expanded = adapter.pipeline.processor(text=[rest], images=[resized])["input_ids"]
    assert cond["prompt_embeds"].shape[1] == len(expanded[0])
    assert adapter.pipeline.prompt_template_encode == template  # restored


def test_tiny_edit_folder_reads_like_the_released_one(tiny_model_dir):
    folder = tiny_model_dir("qwenimage_edit")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
