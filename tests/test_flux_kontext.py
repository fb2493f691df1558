"""FLUX.1-Kontext: the adapter reproduces diffusers' FluxKontextPipeline on the tiny Kontext model
(built offline, loaded through load_adapter), and the family refuses what it cannot edit."""

import json

import pytest
import torch
from test_qwenimage_edit import (
    HEIGHT,
    NEGATIVES,
    PROMPTS,
    SEEDS,
    STEPS,
    WIDTH,
    settings,
    sources,
)  # fmt: skip

from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError

# The edit test module's prompts, seeds and sources: 120 x 90 sources round down to 112 x 80
# (ratio 1.4), whose nearest Kontext resolution is 1184 x 880; the output, 64 x 96, is neither
# square nor the source's size.
SOURCE_SIZE = (1184, 880)


@pytest.fixture(scope="module")
def true_cfg_adapter(tiny_model_dir):
    """The Kontext pipeline around a transformer without guidance embeds (FLUX.1-schnell's
    tiny components), where guidance_scale is true CFG with the negative prompts."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    from flowgrpo_cli.models.flux_kontext import FluxKontextAdapter

    schnell = FluxPipeline.from_pretrained(tiny_model_dir("flux-schnell"), dtype=torch.float32)
    pipeline = FluxKontextPipeline(**schnell.components)
    pipeline.set_progress_bar_config(disable=True)
    return FluxKontextAdapter(pipeline)


@pytest.mark.parametrize(
    ("guidance", "guidance_scale"), [("embedded", 2.5), ("true_cfg", 4.0), ("true_cfg", 1.0)]
)
def test_noise_level_zero_equals_the_kontext_pipeline(
    tiny_adapter, true_cfg_adapter, guidance, guidance_scale
):
    adapter = tiny_adapter("flux_kontext") if guidance == "embedded" else true_cfg_adapter
    assert adapter.guidance_embeds == (guidance == "embedded")
    images = sources()
    cond = adapter.encode_prompts(
        PROMPTS, NEGATIVES, guidance_scale=guidance_scale, source_images=images
    )
    # Encoded once, kept with the text: [B, C, h', w'] latents of the resized source.
    width, height = SOURCE_SIZE
    assert cond["image_latents"].shape == (2, 16, height // 8, width // 8)
    assert ("negative_prompt_embeds" in cond) == (guidance == "true_cfg" and guidance_scale > 1)
    sigmas = adapter.sigmas(STEPS, HEIGHT, WIDTH)
    ours = sample_batch(adapter, cond, SEEDS, settings(guidance_scale), sigmas).images

    # The pipeline called on the same batch: one source image and one generator per prompt.
    # max_area = height * width keeps the output at height x width (the pipeline scales the
    # size it is given to max_area, 1024 x 1024 unless told).
    cfg = {"negative_prompt": NEGATIVES} if guidance == "true_cfg" else {}
    scale = "true_cfg_scale" if guidance == "true_cfg" else "guidance_scale"
    theirs = adapter.pipeline(
        image=images, prompt=PROMPTS, height=HEIGHT, width=WIDTH, max_area=HEIGHT * WIDTH,
        num_inference_steps=STEPS, output_type="np", **{scale: guidance_scale}, **cfg,
        generator=[torch.Generator().manual_seed(seed) for seed in SEEDS],
    ).images  # fmt: skip
    assert torch.equal(adapter.pipeline.scheduler.sigmas, sigmas)
    theirs = torch.from_numpy(theirs).permute(0, 3, 1, 2)
    assert ours.shape == theirs.shape == (2, 3, HEIGHT, WIDTH)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_the_source_is_resized_as_the_pipeline_does(tiny_adapter):
    adapter = tiny_adapter("flux_kontext")
    # Wide, tall and square sources go to the preferred resolution nearest their ratio.
    sizes = {(120, 90): (1184, 880), (90, 120): (880, 1184), (64, 64): (1024, 1024)}
    for size, resized in sizes.items():
        assert adapter.resized_source(sources(size)[0]).size == resized
    with pytest.raises(FlowGrpoError, match=r"12 x 9 pixels is too small"):
        adapter.resized_source(sources((12, 9))[0])


def test_source_tokens_follow_with_first_position_id_1(tiny_adapter):
    adapter = tiny_adapter("flux_kontext")
    tokens = torch.zeros(1, 6, 64)
    ids = adapter._transformer_inputs(tokens, [(2, 3), (1, 2)], 2.5)["img_ids"]
    expected = [[0, r, c] for r in range(2) for c in range(3)] + [[1, 0, 0], [1, 0, 1]]
    assert ids.tolist() == expected


def test_kontext_refuses_prompts_without_source_images(tiny_adapter):
    with pytest.raises(FlowGrpoError, match="prompts came without one"):
        tiny_adapter("flux_kontext").encode_prompts(["a"], None, guidance_scale=2.5)
    with pytest.raises(FlowGrpoError, match=r"generates from text alone.*flux_kontext"):
        tiny_adapter("flux").encode_prompts(
            ["a"], None, guidance_scale=2.5, source_images=sources()[:1]
        )


def test_tiny_kontext_folder_reads_like_the_released_one(tiny_model_dir, tiny_adapter):
    folder = tiny_model_dir("flux_kontext")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"
    assert index["image_encoder"] == index["feature_extractor"] == [None, None]
    assert json.loads((folder / "transformer/config.json").read_text())["guidance_embeds"]
    # The reference's Kontext recipe adapts the single-stream blocks' MLP input too.
    assert tiny_adapter("flux_kontext").default_lora_targets[-1] == "proj_mlp"
