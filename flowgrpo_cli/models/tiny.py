"""Tiny random pipelines of each family, built offline from configs.

Tests and the CPU demo need a real checkpoint folder of every family without downloading one.
Each builder makes the family's components at toy sizes (a few MB), writes them with
save_pretrained (safetensors), and returns the folder: the adapters then load it through
DiffusionPipeline.from_pretrained, the very path a real checkpoint takes.

The tokenizers are made from in-memory vocabularies (transformers 5 accepts them), so no
tokenizer file is fetched either. Weights are random: the images are noise, but every shape,
dtype and code path is the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flowgrpo_cli.errors import FlowGrpoError

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline

# SD3: the scheduler's static shift of SD3.5. FLUX / Qwen-Image: resolution-dependent shift, with
# the values of their released scheduler configs (Qwen-Image also stretches to a terminal sigma).
_SD3_SCHEDULER = {"shift": 3.0}
_FLUX_SCHEDULER = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "base_shift": 0.5,
    "max_shift": 1.15,
}
_QWENIMAGE_SCHEDULER = {
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}

# The special tokens Qwen2.5-VL's chat template and vision config refer to, in id order after
# the 256 byte tokens; the text encoder's config must name the same ids.
_QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def _byte_characters() -> list[str]:
    """The 256 printable characters byte-level BPE uses for the 256 byte values.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255 so that
    every byte has a visible, non-whitespace character (the GPT-2 / CLIP / Qwen convention).
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def char_clip_tokenizer(characters: list[str] | None = None, max_length: int = 77):
    """A CLIPTokenizer with one token per character (alone and as a word end), no merges;
    `characters` defaults to the 256 byte characters, so any text tokenizes."""
    from transformers import CLIPTokenizer

    # bos 0, eos 1 (also the pad), then every character alone and as a word end.
    pieces = ["<|startoftext|>", "<|endoftext|>"]
    for char in characters or _byte_characters():
        pieces += [char, char + "</w>"]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def char_t5_tokenizer():
    """A T5Tokenizer with one piece per printable ASCII character (alone and word-initial)."""
    from transformers import T5Tokenizer

    pieces = ["<pad>", "</s>", "<unk>", "▁"]
    for code in range(ord(" ") + 1, ord("~") + 1):
        pieces += [chr(code), "▁" + chr(code)]
    return T5Tokenizer(vocab=[(piece, 0.0) for piece in pieces], extra_ids=0)


def _qwen_tokenizer():
    from transformers import Qwen2Tokenizer

    vocab = {char: i for i, char in enumerate(_byte_characters())}
    for token in _QWEN_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIAL_TOKENS[1:])})
    return tokenizer


def _clip_config(*, projection_dim: int = 32):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection_dim,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _t5_encoder():
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=256,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
        )
    )


_DECODER_OUTPUT_GAIN = 16.0


def _autoencoder_kl(*, scaling_factor: float, shift_factor: float):
    # From its module: mypy reads `from diffusers import AutoencoderKL` as diffusers' dummy class.
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    # Four levels: the 8x spatial compression of the real SD3 / FLUX VAEs.
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[8, 8, 8, 8],
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        sample_size=64,
    )
    # A random decoder's last GroupNorm hands conv_out activations of unit scale, so its images
    # sit in a grey band (pixel std 0.17 on random latents) that no latent can leave: an image
    # reward then has almost nothing to climb. A trained VAE draws from black to white; raising
    # that norm's gain gives the tiny one the same reach (pixel std 0.46, most pixels near 0 or 1).
    with torch.no_grad():
        vae.decoder.conv_norm_out.weight.mul_(_DECODER_OUTPUT_GAIN)
    return vae


def _build_sd3(*, sd35: bool):
    """sd35=True gives SD3.5 Medium's block kinds: a dual-attention block (a second, image-only
    attention `attn2`) and RMS-normed queries and keys; False, SD3 Medium's plain MM-DiT."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    transformer = SD3Transformer2DModel(
        sample_size=8,  # the pipeline's default image size: 8 latents * 8 = 64 px
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=64,
        pooled_projection_dim=64,  # the two CLIP projections (32 each) concatenated
        pos_embed_max_size=32,  # 32 patches of 2 latents of 8 px: images up to 512 px
        dual_attention_layers=(0,) if sd35 else (),
        qk_norm="rms_norm" if sd35 else None,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**_SD3_SCHEDULER),
        vae=_autoencoder_kl(scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_clip_config()),
        tokenizer=char_clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config()),
        tokenizer_2=char_clip_tokenizer(),
        text_encoder_3=_t5_encoder(),
        tokenizer_3=char_t5_tokenizer(),
    )


def _flux_components(*, guidance_embeds: bool) -> dict[str, Any]:
    """What FluxPipeline and FluxKontextPipeline share: all of their components.
    guidance_embeds=True is FLUX.1-dev and Kontext-dev (guidance-distilled: the scale is a
    transformer input); False is FLUX.1-schnell's architecture, where guidance can only be
    true CFG."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel

    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=64,  # T5 d_model
        pooled_projection_dim=32,  # CLIP hidden size
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),  # sums to the head dim
    )
    return {
        "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(**_FLUX_SCHEDULER),
        "vae": _autoencoder_kl(scaling_factor=0.3611, shift_factor=0.1159),
        "text_encoder": CLIPTextModel(_clip_config()),
        "tokenizer": char_clip_tokenizer(),
        "text_encoder_2": _t5_encoder(),
        "tokenizer_2": char_t5_tokenizer(),
    }


def _build_flux(*, guidance_embeds: bool):
    from diffusers import FluxPipeline

    return FluxPipeline(**_flux_components(guidance_embeds=guidance_embeds))


def _build_flux_kontext():
    """FLUX.1-Kontext-dev: FLUX.1-dev's components in the edit pipeline. Its optional
    image_encoder and feature_extractor (IP-Adapter) stay unset, as in the released folder."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**_flux_components(guidance_embeds=True))


def _qwen_components() -> dict[str, Any]:
    """What QwenImagePipeline and QwenImageEditPipeline share: the Qwen2.5-VL text encoder
    (with its vision tower, which the edit pipeline feeds the source image), its tokenizer,
    the transformer, the VAE and the scheduler."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _qwen_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list(_QWEN_SPECIAL_TOKENS))
    special = dict(zip(_QWEN_SPECIAL_TOKENS, ids, strict=True))
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": 320,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 2048,
                # Multimodal RoPE splits the 8 rotary frequencies of a head (dim 16) into
                # temporal, height and width sections.
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [1, 1, 2],
                },
                "bos_token_id": special["<|endoftext|>"],
                "eos_token_id": special["<|im_end|>"],
                "pad_token_id": special["<|endoftext|>"],
            },
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 4,
                "out_hidden_size": 32,
                "fullatt_block_indexes": [0],
            },
            image_token_id=special["<|image_pad|>"],
            video_token_id=special["<|video_pad|>"],
            vision_start_token_id=special["<|vision_start|>"],
            vision_end_token_id=special["<|vision_end|>"],
        )
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,  # the text encoder's hidden size
        axes_dims_rope=(8, 4, 4),  # sums to the head dim
    )
    # latents_mean / latents_std keep the released VAE's values, so decode's de-normalization
    # is exercised with non-trivial numbers.
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )
    return {
        "transformer": transformer,
        "scheduler": FlowMatchEulerDiscreteScheduler(**_QWENIMAGE_SCHEDULER),
        "vae": vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
    }


def _build_qwenimage():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**_qwen_components())


# The tiny vision tower sees the source image at most this size (in pixels, a multiple of
# its 28-pixel merged patches): 16 image tokens in the prompt. The released processor allows
# up to 12.8 MP, which the pipeline's 1 MP source image stays under.
_EDIT_VISION_PIXELS = 112 * 112


def _build_qwenimage_edit():
    """Qwen-Image-Edit: the Qwen-Image components plus the processor that turns the prompt
    and its source image into the text encoder's inputs (image tokens expanded in the text)."""
    from diffusers import QwenImageEditPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from flowgrpo_cli.models.qwenimage_edit import ImageOnlyQwen2VLProcessor

    components = _qwen_components()
    size = {"shortest_edge": 28 * 28, "longest_edge": _EDIT_VISION_PIXELS}
    processor = ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(size=size), tokenizer=components["tokenizer"]
    )
    return QwenImageEditPipeline(**components, processor=processor)


_BUILDERS: dict[str, Callable[[], DiffusionPipeline]] = {
    "sd3": lambda: _build_sd3(sd35=False),
    "sd35": lambda: _build_sd3(sd35=True),
    "flux": lambda: _build_flux(guidance_embeds=True),
    "flux-schnell": lambda: _build_flux(guidance_embeds=False),
    "qwenimage": _build_qwenimage,
    "qwenimage_edit": _build_qwenimage_edit,
    "flux_kontext": _build_flux_kontext,
}

#: What `build_tiny_pipeline` can build: one per family, plus SD3.5's block kinds and FLUX
#: without guidance embeds.
TINY_FAMILIES: tuple[str, ...] = tuple(_BUILDERS)


def build_tiny_pipeline(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Build a tiny random pipeline of `family`, save it into `out_dir` and return the folder.

    The same seed gives the same weights, so two builds of one family are interchangeable.
    """
    if family not in _BUILDERS:
        raise FlowGrpoError(
            f"Unknown tiny model family {family!r}; choose one of: {', '.join(TINY_FAMILIES)}."
        )
    from flowgrpo_cli.loading import quiet_loading

    quiet_loading()  # no torchvision fallback warnings, no "Writing model shards" bars
    # Random init draws from the global generator: seed it, and restore the caller's state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipeline = _BUILDERS[family]()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    if family == "qwenimage_edit":
        from flowgrpo_cli.models.qwenimage_edit import name_released_processor

        name_released_processor(out_dir)
    return out_dir


def build_tiny_clip(out_dir: Path, *, seed: int = 0, projection_dim: int = 16) -> Path:
    """A tiny random CLIPModel and its CLIPProcessor, saved as a released CLIP checkpoint is
    (config, safetensors, processor and tokenizer files): what the CLIP rewards load."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowgrpo_cli.loading import quiet_loading

    quiet_loading()
    tokenizer = char_clip_tokenizer()
    text = _clip_config(projection_dim=projection_dim).to_dict()
    text["vocab_size"] = len(tokenizer)
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
    }  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPModel(config)
    size = vision["image_size"]
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir


def build_tiny_dinov2(out_dir: Path, *, seed: int = 0, image_size: int = 32) -> Path:
    """A tiny random Dinov2Model and its image processor, saved as facebook/dinov2-base is
    (config, safetensors, a BitImageProcessor config: resize the shorter side, centre crop,
    ImageNet mean and std): what `source_similarity` loads with backbone = "dino"."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    from flowgrpo_cli.loading import quiet_loading

    quiet_loading()  # the processor's torchvision fallback warning
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        image_size=image_size, patch_size=8,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Dinov2Model(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = BitImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], do_convert_rgb=True,
    )  # fmt: skip
    processor.save_pretrained(out_dir)
    return out_dir


def save_tiny_aesthetic_head(path: Path, embedding_dim: int, *, seed: int = 0) -> Path:
    """A random aesthetic predictor for `embedding_dim`-wide CLIP embeddings, saved as the
    released one is (torch.save of the MLP's state dict, keys `layers.N.weight`)."""
    from flowgrpo_cli.rewards.clip import aesthetic_head

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = aesthetic_head(embedding_dim)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({f"layers.{key}": value for key, value in head.state_dict().items()}, path)
    return path


def build_tiny_mask2former(out_dir: Path, *, seed: int = 0, image_size: int = 64) -> Path:
    """A tiny random Mask2Former for COCO instance segmentation (a 4-stage Swin backbone, the
    80 COCO classes as GenEval names them) and its image processor, saved as the released
    facebook/mask2former-swin-*-coco-instance checkpoints are: what the geneval reward loads."""
    from flowgrpo_cli.loading import quiet_loading
    from flowgrpo_cli.rewards.geneval_rules import COCO_CLASSES

    quiet_loading()  # before the import: the processor's torchvision fallback warns there
    from transformers import (
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        Mask2FormerImageProcessor,
        SwinConfig,
    )

    backbone = SwinConfig(
        image_size=image_size, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2], window_size=4,
    )  # fmt: skip
    backbone.out_features = ["stage1", "stage2", "stage3", "stage4"]  # Mask2Former reads all 4
    config = Mask2FormerConfig(
        backbone_config=backbone, num_queries=10, hidden_dim=32, mask_feature_size=32,
        feature_size=32, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
        dim_feedforward=64, encoder_feedforward_dim=64,
        id2label=dict(enumerate(COCO_CLASSES)),
        label2id={name: index for index, name in enumerate(COCO_CLASSES)},
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Mask2FormerForUniversalSegmentation(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    processor = Mask2FormerImageProcessor(
        size={"shortest_edge": image_size, "longest_edge": image_size}, size_divisor=32
    )
    processor.save_pretrained(out_dir)
    return out_dir
