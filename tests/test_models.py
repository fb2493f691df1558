"""Model adapters: each family's pieces reproduce its own diffusers pipeline, load offline
through from_pretrained, and fail with messages that say what is wrong."""

import io
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import FAMILIES, Conditioning, family_of, load_adapter, to_png
from flowgrpo_cli.models.tiny import TINY_FAMILIES, build_tiny_pipeline

# Prompts of different lengths, so Qwen-Image pads and masks one of them.
PROMPTS = ['a sign that says "flow grpo"', "a cat"]
NEGATIVES = ["", "blurry, low quality"]
SEEDS = [0, 1]
# Not square, so a swapped height and width cannot pass.
HEIGHT, WIDTH, STEPS = 64, 96, 3

# name: (tiny model, negative prompts, adapter guidance_scale, the pipeline's own keywords)
PIPELINE_CASES = {
    # No negatives given: both sides fall back to "" (SD3's default).
    "sd3-cfg": ("sd3", None, 4.5, {"guidance_scale": 4.5}),
    # guidance 1: no CFG, one forward; the negatives are ignored on both sides.
    "sd3-no-cfg": ("sd3", NEGATIVES, 1.0, {"guidance_scale": 1.0}),
    # SD3.5 Medium's blocks: dual attention and RMS qk-norm.
    "sd35-cfg": ("sd35", None, 4.5, {"guidance_scale": 4.5}),
    # FLUX.1-dev kind: the scale goes in as an embedding; negatives ignored (no true CFG).
    "flux-embedded-guidance": ("flux", NEGATIVES, 3.5, {"guidance_scale": 3.5}),
    # FLUX.1-schnell kind: the scale is true CFG with the negative prompt.
    "flux-true-cfg": ("flux-schnell", NEGATIVES, 4.0, {"true_cfg_scale": 4.0}),
    # Qwen-Image: true CFG, rescaled to the conditional norm.
    "qwenimage-true-cfg": ("qwenimage", NEGATIVES, 4.0, {"true_cfg_scale": 4.0}),
}

# Per family, a guidance_scale that exercises its guidance path.
GUIDED = {"sd3": 4.5, "sd35": 4.5, "flux": 3.5, "flux-schnell": 4.0, "qwenimage": 4.0}
# SD3 and FLUX pad T5 tokens to 256 / 512 by default; shorter keeps the tests fast (and checks
# that the option reaches encode_prompt). Qwen-Image's tokens are the prompt's own: no padding.
MAX_LENGTH = {"sd3": 32, "sd35": 32, "flux": 64, "flux-schnell": 64, "qwenimage": None}


def generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def euler_images(adapter, cond, guidance_scale):
    """Noise level 0: x_next = x + (sigma_next - sigma) v, in float32, then decode."""
    sigmas = adapter.sigmas(STEPS, HEIGHT, WIDTH)
    x = adapter.initial_latents(generators(SEEDS), HEIGHT, WIDTH)
    assert x.dtype == torch.float32
    assert x.shape == (len(SEEDS), *adapter.latent_shape(HEIGHT, WIDTH))
    for i in range(STEPS):
        v = adapter.velocity(x, sigmas[i].expand(len(SEEDS)), cond, guidance_scale=guidance_scale)
        assert v.dtype == torch.float32 and v.shape == x.shape
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return adapter.decode(x)


@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_adapter_reproduces_the_pipeline(case, tiny_adapter):
    tiny, negatives, guidance_scale, pipeline_kwargs = PIPELINE_CASES[case]
    adapter = tiny_adapter(tiny)
    if MAX_LENGTH[tiny] is not None:
        pipeline_kwargs = {**pipeline_kwargs, "max_sequence_length": MAX_LENGTH[tiny]}
    expected = adapter.pipeline(
        prompt=PROMPTS,
        negative_prompt=negatives,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        generator=generators(SEEDS),
        output_type="np",
        **pipeline_kwargs,
    ).images  # [B, H, W, 3] float32 in [0, 1]
    pipeline_sigmas = adapter.pipeline.scheduler.sigmas

    cond = adapter.encode_prompts(
        PROMPTS, negatives, guidance_scale=guidance_scale, max_sequence_length=MAX_LENGTH[tiny]
    )
    images = euler_images(adapter, cond, guidance_scale)  # [B, 3, H, W]

    assert torch.equal(adapter.sigmas(STEPS, HEIGHT, WIDTH), pipeline_sigmas)
    assert images.dtype == torch.float32 and images.shape == (2, 3, HEIGHT, WIDTH)
    assert images.min() >= 0.0 and images.max() <= 1.0
    np.testing.assert_allclose(images.permute(0, 2, 3, 1).numpy(), expected, rtol=0, atol=1e-5)
    # Negatives are encoded exactly when velocity will combine them.
    uses_negatives = case in ("sd3-cfg", "sd35-cfg", "flux-true-cfg", "qwenimage-true-cfg")
    assert ("negative_prompt_embeds" in cond) == uses_negatives


def test_sd3_dynamic_shifting_follows_the_pipeline(tiny_adapter):
    """An SD3 scheduler config with use_dynamic_shifting gets the resolution-dependent mu."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from flowgrpo_cli.models.sd3 import SD3Adapter

    base = tiny_adapter("sd3").pipeline
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        base.scheduler.config, use_dynamic_shifting=True
    )
    pipeline = StableDiffusion3Pipeline(**{**base.components, "scheduler": scheduler})
    pipeline.set_progress_bar_config(disable=True)
    pipeline(
        "x",
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        max_sequence_length=32,
        output_type="latent",
    )
    sigmas = SD3Adapter(pipeline).sigmas(STEPS, HEIGHT, WIDTH)
    assert torch.equal(sigmas, pipeline.scheduler.sigmas)
    assert not torch.equal(sigmas, tiny_adapter("sd3").sigmas(STEPS, HEIGHT, WIDTH))


@pytest.mark.parametrize(("tiny", "guidance_scale"), GUIDED.items())
def test_sampling_reads_device_and_dtypes_once(tiny, guidance_scale, tiny_adapter, monkeypatch):
    """diffusers answers .dtype / .device by walking every submodule; after the adapter's
    first answer, encoding, sampling and decoding never ask again."""
    from diffusers import DiffusionPipeline, ModelMixin

    adapter = tiny_adapter(tiny)
    pipeline = adapter.pipeline
    assert adapter.device == pipeline.device
    assert adapter.transformer_dtype == pipeline.transformer.dtype
    assert adapter.vae_dtype == pipeline.vae.dtype

    def walked(self):
        raise AssertionError("asked diffusers for a device or dtype again")

    for owner, name in [
        (ModelMixin, "dtype"),
        (ModelMixin, "device"),
        (DiffusionPipeline, "device"),
        (DiffusionPipeline, "_execution_device"),
    ]:
        monkeypatch.setattr(owner, name, property(walked))
    cond = adapter.encode_prompts(
        PROMPTS, NEGATIVES, guidance_scale=guidance_scale, max_sequence_length=MAX_LENGTH[tiny]
    )
    with torch.no_grad():
        assert euler_images(adapter, cond, guidance_scale).isfinite().all()


@pytest.mark.parametrize(("tiny", "guidance_scale"), [*GUIDED.items(), ("qwenimage", 1.0)])
def test_velocity_and_noise_do_not_depend_on_the_batch(tiny, guidance_scale, tiny_adapter):
    """One forward agrees across batch sizes to 1e-6 (CPU matmuls block differently by
    batch size). CFG's v_u + g (v_c - v_u) weighs each forward's rounding by up to
    |1 - g| + g = 2g - 1, and the tolerance with it."""
    adapter = tiny_adapter(tiny)
    cond = adapter.encode_prompts(
        PROMPTS, NEGATIVES, guidance_scale=guidance_scale, max_sequence_length=MAX_LENGTH[tiny]
    )
    x = adapter.initial_latents(generators(SEEDS), HEIGHT, WIDTH)
    for i, seed in enumerate(SEEDS):
        assert torch.equal(adapter.initial_latents(generators([seed]), HEIGHT, WIDTH), x[i : i + 1])

    cfg = guidance_scale if "negative_prompt_embeds" in cond else 1.0
    sigma = adapter.sigmas(STEPS, HEIGHT, WIDTH)[1]
    with torch.no_grad():
        batched = adapter.velocity(x, sigma.expand(2), cond, guidance_scale=guidance_scale)
        for i in range(2):
            single = adapter.velocity(
                x[i : i + 1], sigma.expand(1), cond.index(i), guidance_scale=guidance_scale
            )
            assert (batched[i : i + 1] - single).abs().max() <= 1e-6 * max(1, 2 * cfg - 1)


@pytest.mark.parametrize("tiny", ["sd3", "flux", "qwenimage"])
def test_bfloat16_loads_and_returns_float32(tiny, tiny_model_dir):
    adapter = load_adapter(tiny_model_dir(tiny), dtype=torch.bfloat16, device="cpu")
    assert adapter.family == tiny
    assert adapter.transformer.dtype == adapter.transformer_dtype == torch.bfloat16
    guidance_scale = GUIDED[tiny]
    cond = adapter.encode_prompts(
        PROMPTS, None, guidance_scale=guidance_scale, max_sequence_length=MAX_LENGTH[tiny]
    )
    x = adapter.initial_latents(generators(SEEDS), 64, 64)
    with torch.no_grad():
        v = adapter.velocity(x, torch.ones(2), cond, guidance_scale=guidance_scale)
    assert v.dtype == torch.float32 and v.shape == x.shape and v.isfinite().all()


def test_velocity_keeps_gradients_for_training(tiny_adapter):
    adapter = tiny_adapter("sd3")
    cond = adapter.encode_prompts(PROMPTS[:1], None, guidance_scale=4.5, max_sequence_length=32)
    x = adapter.initial_latents(generators([0]), 64, 64).requires_grad_()
    adapter.velocity(x, torch.ones(1), cond, guidance_scale=4.5).square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


_JOINT_ATTENTION = r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
# What the Flow-GRPO reference recipes adapt, per family, as full module-name patterns.
REFERENCE_LORA_MODULES = {
    # SD3: the joint attention only; SD3.5's second attention (attn2) stays frozen.
    "sd3": rf"transformer_blocks\.\d+\.{_JOINT_ATTENTION}",
    # FLUX: also the double-stream blocks' feed-forward layers; the single-stream blocks'
    # attention (to_q / to_k / to_v, no output projection) but not their MLP.
    "flux": rf"transformer_blocks\.\d+\.({_JOINT_ATTENTION}|ff\.net\.(0\.proj|2)"
    rf"|ff_context\.net\.(0\.proj|2))|single_transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v)",
    # Qwen-Image: also both streams' MLPs.
    "qwenimage": rf"transformer_blocks\.\d+\.({_JOINT_ATTENTION}"
    rf"|img_mlp\.net\.(0\.proj|2)|txt_mlp\.net\.(0\.proj|2))",
}


@pytest.mark.parametrize("tiny", ["sd3", "sd35", "flux", "qwenimage"])
def test_default_lora_targets_are_the_reference_recipes(tiny, tiny_model_dir):
    from peft.tuners.tuners_utils import BaseTunerLayer

    from flowgrpo_cli.training.policy import attach_lora

    adapter = load_adapter(tiny_model_dir(tiny), dtype=torch.float32, device="cpu")
    transformer = adapter.transformer
    linears = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    expected = {n for n in linears if re.fullmatch(REFERENCE_LORA_MODULES[adapter.family], n)}
    attach_lora(transformer, rank=2, alpha=4, targets=adapter.default_lora_targets, seed=0)
    adapted = {n for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)}
    assert expected and adapted == expected
    if tiny == "sd35":  # SD3.5 Medium's dual-attention block is there, and left alone
        assert any(".attn2." in n for n in linears)


def test_qwenimage_custom_system_prompt(tiny_adapter):
    adapter = tiny_adapter("qwenimage")
    pipeline = adapter.pipeline
    template = pipeline.prompt_template_encode
    default = adapter.encode_prompts(["a cat"], None, guidance_scale=1.0)
    custom = adapter.encode_prompts(
        ["a cat"], None, guidance_scale=1.0, system_prompt="Render {exactly} the text."
    )
    # The whole new system turn is dropped: one embedding per token of the user turn's rest.
    rest = len(pipeline.tokenizer("a cat<|im_end|>\n<|im_start|>assistant\n").input_ids)
    assert custom["prompt_embeds"].shape[1] == rest
    assert custom["prompt_embeds"].shape[1] != default["prompt_embeds"].shape[1]
    assert pipeline.prompt_template_encode == template  # restored


def test_system_prompt_is_refused_where_there_is_none(tiny_adapter):
    with pytest.raises(FlowGrpoError, match="system prompt"):
        tiny_adapter("sd3").encode_prompts(["a"], None, guidance_scale=1.0, system_prompt="x")


def test_usage_errors(tiny_adapter):
    adapter = tiny_adapter("sd3")
    with pytest.raises(FlowGrpoError, match="2 prompts"):
        adapter.encode_prompts(PROMPTS, [""], guidance_scale=4.5)
    cond = adapter.encode_prompts(PROMPTS, None, guidance_scale=1.0, max_sequence_length=32)
    x = adapter.initial_latents(generators(SEEDS), 64, 64)
    with pytest.raises(FlowGrpoError, match="negative prompt embeddings"):
        adapter.velocity(x, torch.ones(2), cond, guidance_scale=4.5)
    with pytest.raises(FlowGrpoError, match="multiples of 16"):
        adapter.latent_shape(64, 72)


def test_conditioning_rows_repeat_and_padding():
    cond = Conditioning(
        {"prompt_embeds": torch.arange(24.0).view(2, 3, 4), "prompt_embeds_mask": torch.ones(2, 3)}
    )
    assert cond.batch_size == 2
    assert torch.equal(cond.index(1)["prompt_embeds"], cond["prompt_embeds"][1:])
    assert torch.equal(cond.index([1, 0])["prompt_embeds"][0], cond["prompt_embeds"][1])
    assert cond.repeat_interleave(3).batch_size == 6
    assert torch.equal(cond.repeat_interleave(3)["prompt_embeds"][2], cond["prompt_embeds"][0])
    assert cond.to("cpu")["prompt_embeds"].device.type == "cpu"

    short = Conditioning(
        {"prompt_embeds": torch.ones(1, 1, 4), "prompt_embeds_mask": torch.ones(1, 1)}
    )
    both = Conditioning.cat([cond, short])
    assert both["prompt_embeds"].shape == (3, 3, 4)
    assert both["prompt_embeds_mask"][2].tolist() == [1, 0, 0]
    assert both["prompt_embeds"][2, 1:].abs().sum() == 0

    with pytest.raises(ValueError, match="batch size"):
        Conditioning({"a": torch.zeros(2), "b": torch.zeros(3)})


def test_png_helper_rounds_like_diffusers():
    images = torch.rand(2, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    pngs = to_png(images)
    assert len(pngs) == 2
    decoded = np.asarray(Image.open(io.BytesIO(pngs[1])))
    expected = (images[1].permute(1, 2, 0).numpy() * 255).round().astype("uint8")
    np.testing.assert_array_equal(decoded, expected)


# --- finding and loading a model -----------------------------------------------------------


def test_missing_folder(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FlowGrpoError, match="does not exist") as err:
        load_adapter(missing, dtype=torch.float32, device="cpu")
    assert str(missing) in str(err.value)


def test_hub_id_offline_says_who_set_offline_mode_and_how_to_download():
    with pytest.raises(FlowGrpoError) as err:
        load_adapter("nobody-here/no-such-model", dtype=torch.float32, device="cpu")
    message = str(err.value)
    assert "model.path = 'nobody-here/no-such-model'" in message
    assert "HF_HUB_OFFLINE=1 is in effect (set by the test suite)" in message
    assert "hf download nobody-here/no-such-model" in message


def test_folder_without_model_index(tmp_path):
    with pytest.raises(FlowGrpoError, match=r"no model_index\.json") as err:
        load_adapter(tmp_path, dtype=torch.float32, device="cpu")
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"), [("{", "not valid JSON"), ("{}", "no _class_name")]
)
def test_unreadable_model_index(tmp_path, content, message):
    (tmp_path / "model_index.json").write_text(content)
    with pytest.raises(FlowGrpoError, match=message):
        load_adapter(tmp_path, dtype=torch.float32, device="cpu")


def test_unsupported_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2D"]})
    )
    with pytest.raises(FlowGrpoError) as err:
        load_adapter(tmp_path, dtype=torch.float32, device="cpu")
    message = str(err.value)
    assert "'StableDiffusionPipeline'" in message and str(tmp_path) in message
    for supported in ("StableDiffusion3Pipeline", "FluxPipeline", "QwenImagePipeline"):
        assert supported in message


def test_missing_component_folder(tmp_path, tiny_model_dir):
    broken = shutil.copytree(tiny_model_dir("sd3"), tmp_path / "sd3")
    shutil.rmtree(broken / "vae")
    with pytest.raises(FlowGrpoError, match="'vae'") as err:
        load_adapter(broken, dtype=torch.float32, device="cpu")
    assert str(broken / "vae") in str(err.value)


def test_registry_names_every_family():
    import importlib

    assert family_of("QwenImagePipeline") == "qwenimage"
    for family, classes in FAMILIES.items():
        for dotted in classes.values():
            module, name = dotted.split(":")
            assert getattr(importlib.import_module(module), name).family == family


def test_importing_the_registry_does_not_import_diffusers():
    code = (
        "import sys, flowgrpo_cli.models, flowgrpo_cli.models.tiny;"
        "assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiny_builder_is_seeded_and_lists_its_families(tmp_path, tiny_model_dir):
    assert set(TINY_FAMILIES) >= {"sd3", "flux", "qwenimage"}
    again = build_tiny_pipeline("sd3", tmp_path / "again", seed=0)
    other = build_tiny_pipeline("sd3", tmp_path / "other", seed=1)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    first = (tiny_model_dir("sd3") / weights).read_bytes()
    assert (again / weights).read_bytes() == first
    assert (other / weights).read_bytes() != first
    with pytest.raises(FlowGrpoError, match="sd3, sd35, flux"):
        build_tiny_pipeline("sdxl", tmp_path)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_tiny_decoder_draws_from_black_to_white(family, tiny_adapter):
    # An image reward on the tiny model can only climb as far as its decoder reaches; a random
    # VAE left at unit gain paints every latent the same mid grey (pixel std 0.17).
    adapter = tiny_adapter(family)
    shape = (8, *adapter.latent_shape(64, 64))
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    images = adapter.decode(latents)
    assert images.std() > 0.4
    assert (images < 0.05).float().mean() > 0.2
    assert (images > 0.95).float().mean() > 0.2
