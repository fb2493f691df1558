"""The `hpsv2` reward: Human Preference Score v2 and v2.1 (Wu et al., 2023).

HPSv2 fine-tunes open_clip's ViT-H-14 (laion2B-s32B-b79K) on human preference pairs. Its
released scorer (hpsv2/img_score.py) takes the image and prompt features that open_clip's
forward returns, each normalised to norm 1, and keeps the diagonal of
`image_features @ text_features.T`:

    hpsv2 = cos(image, prompt)        no logit scale, no constant; about 0.2-0.3

The checkpoints (xswu/HPSv2: HPS_v2_compressed.pt, HPS_v2.1_compressed.pt) are open_clip
state dicts under "state_dict". open_clip itself needs torchvision, whose PyPI wheels are built
against the CUDA torch and do not import beside the CPU torch (transformers, which imports
torchvision whenever it is installed, then fails too). So the state dict is renamed onto
transformers' CLIPModel, the same ViT-H/14 (GELU, pre-LN blocks, class-token and end-of-text
pooling, bias-free projections: laion's CLIP-ViT-H-14 on the Hub is that same conversion), with
the architecture's head counts and the BPE tokenizer read from `base`.

Images are prepared as the released scorer's `preprocess_val` does (light_augmentation=True):
RGB as floats in [0, 1], the longer side resized to 224 (bicubic with antialiasing, on the
float tensor: torchvision's tensor path), zero-padded (black) to a centred square, normalised
with OpenAI CLIP's mean and std.
"""

from __future__ import annotations

import html
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import Need, RewardBatch
from flowgrpo_cli.rewards.clip import (
    ClipModel,
    _ClipReward,
    paired_cosine,
    reward_device_and_dtype,
)
from flowgrpo_cli.rewards.hub import load_pretrained, resolve_file, resolve_folder
from flowgrpo_cli.store.config import HPSV2_FILES, RewardSection

if TYPE_CHECKING:
    import torch
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

KEY = "[reward.hpsv2]"
# open_clip's OPENAI_DATASET_MEAN / _STD, which its ViT-H-14 laion2b_s32b_b79k config keeps.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# open_clip key -> transformers CLIPModel key, outside the transformer blocks.
_RENAMED = {
    "logit_scale": "logit_scale",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    **{f"visual.ln_pre.{p}": f"vision_model.pre_layrnorm.{p}" for p in ("weight", "bias")},
    **{f"visual.ln_post.{p}": f"vision_model.post_layernorm.{p}" for p in ("weight", "bias")},
    **{f"ln_final.{p}": f"text_model.final_layer_norm.{p}" for p in ("weight", "bias")},
}
# open_clip's projections are [width, embed] matrices used as `x @ proj`; nn.Linear stores the
# transpose.
_TRANSPOSED = {
    "visual.proj": "visual_projection.weight",
    "text_projection": "text_projection.weight",
}
_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")
_BLOCK_PARTS = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


def open_clip_to_transformers(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """An open_clip CLIP state dict renamed to transformers' CLIPModel keys, and the keys it
    does not know. nn.MultiheadAttention's packed `in_proj_weight` / `in_proj_bias` ([3 W, W]
    and [3 W], query rows first, then key, then value) become q_proj, k_proj and v_proj."""
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for key, value in state.items():
        if key in _RENAMED:
            out[_RENAMED[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.T.contiguous()
        elif block := _BLOCK.fullmatch(key):
            tower = "vision_model" if block[1] else "text_model"
            layer, rest = f"{tower}.encoder.layers.{block[2]}", block[3]
            module, _, param = rest.rpartition(".")
            if module == "attn" and param in ("in_proj_weight", "in_proj_bias"):
                kind = param.removeprefix("in_proj_")
                for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                    out[f"{layer}.self_attn.{name}_proj.{kind}"] = part
            elif module in _BLOCK_PARTS:
                out[f"{layer}.{_BLOCK_PARTS[module]}.{param}"] = value
            else:
                unknown.append(key)
        else:
            unknown.append(key)
    return out, unknown


def load_hpsv2(path: Path, config: CLIPConfig) -> CLIPModel:
    """The CLIPModel of `config` (its activations set to GELU, as open_clip's ViT-H-14 has
    them) holding the open_clip checkpoint at `path` (`{"state_dict": ...}`, or the state dict
    itself), in the checkpoint's dtype, on the CPU."""
    import torch
    from accelerate import init_empty_weights
    from transformers import CLIPModel

    where = f"{KEY} checkpoint: {path}"
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise FlowGrpoError(
            f"{where} cannot be read as a torch checkpoint: {_short(err)}"
        ) from None
    state: Any = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise FlowGrpoError(f"{where} holds no state dict of tensors (expected 'state_dict')")
    converted, unknown = open_clip_to_transformers(state)
    cast("CLIPTextConfig", config.text_config).hidden_act = "gelu"
    cast("CLIPVisionConfig", config.vision_config).hidden_act = "gelu"
    with init_empty_weights():  # parameters on the meta device, until the checkpoint's
        model = CLIPModel(config)
    missing = sorted(set(model.state_dict()) - set(converted))
    if missing or unknown:
        raise FlowGrpoError(
            f"{where} is not an open_clip CLIP state dict: {_some(unknown)} not expected, "
            f"{_some(missing)} of the CLIPModel missing"
        )
    try:
        model.load_state_dict(converted, strict=True, assign=True)
    except RuntimeError as err:  # a shape that the base's architecture does not have
        raise FlowGrpoError(
            f"{where} does not fit the base's architecture: {_short(err)}"
        ) from None
    return model


def _some(keys: list[str]) -> str:
    return f"{len(keys)} keys" + (f" ({', '.join(keys[:3])}, ...)" if keys else "")


def _short(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


def hps_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """float32 [3, size, size]: HPSv2's evaluation transform of one image."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float().div(255)
    height, width = x.shape[1:]
    scale = size / max(height, width)
    if scale != 1.0:
        resized = [round(height * scale), round(width * scale)]
        x = F.interpolate(
            x[None], size=resized, mode="bicubic", align_corners=False, antialias=True
        )[0]
    # The released transform pads only after a resize; an image whose longer side is already
    # `size` but is not square would not fit the model there, so it is padded here too.
    pad_h, pad_w = size - x.shape[1], size - x.shape[2]
    x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    return (x - mean) / std


class HpsModel(ClipModel):
    """HPSv2's ViT-H/14 on transformers' CLIPModel: images through HPSv2's transform, prompts
    through the base's CLIP tokenizer (open_clip's BPE vocabulary, 77 tokens; the same ids as
    open_clip's tokenizer, ftfy's repair of mis-decoded text aside)."""

    def __init__(self, options: RewardSection) -> None:
        import torch
        from transformers import AutoTokenizer, CLIPConfig

        table = options.hpsv2
        self.device, self.dtype = reward_device_and_dtype(options)
        self.batch_size = options.batch_size
        self.version = table.version
        base = resolve_folder(table.base, table.base_revision, "config.json", f"{KEY} base")
        self.model_source = self.processor_source = base
        path, self.checkpoint_record = resolve_file(
            table.checkpoint,
            table.checkpoint_revision,
            HPSV2_FILES[table.version],
            f"{KEY} checkpoint",
        )
        config = load_pretrained(CLIPConfig, base)
        self.image_size = config.vision_config.image_size
        self.model = load_hpsv2(path, config)
        # nn.Module.to, in place: PreTrainedModel's wrapper of it hides its signature from mypy.
        torch.nn.Module.to(self.model, self.device, self.dtype)
        self.model.eval().requires_grad_(False)
        self.processor = load_pretrained(AutoTokenizer, base)  # called as ClipModel calls it

    def text_embeddings(self, texts: list[str]) -> torch.Tensor:
        # open_clip's tokenizer unescapes HTML entities twice before the BPE ("&amp;amp;" is
        # "&"); its other cleaning (white space, lower case) is the CLIP tokenizer's too.
        return super().text_embeddings([html.unescape(html.unescape(t)).strip() for t in texts])

    def pixels(self, images: list[Image.Image]) -> torch.Tensor:
        import torch

        return torch.stack([hps_pixels(image, self.image_size) for image in images])

    def info(self) -> dict[str, str]:
        return {
            "checkpoint": self.checkpoint_record,
            "version": self.version,
            "base": self.model_source.record,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class HpsV2Reward(_ClipReward):
    name = "hpsv2"
    needs: frozenset[Need] = frozenset({"images", "prompts"})

    def __init__(self, options: RewardSection) -> None:
        self.clip = HpsModel(options)

    def _values(self, batch: RewardBatch) -> torch.Tensor:
        assert batch.prompts is not None  # RewardSet checks `needs`
        return paired_cosine(self.clip, batch.images, batch.prompts)


def build_hpsv2(section: RewardSection) -> HpsV2Reward:
    return HpsV2Reward(section)
