"""Rewards computed by a CLIP model: `pickscore`, `clipscore` and `aesthetic`.

Each loads the released model through transformers' CLIPModel (a local folder or a hub id,
see hub.py), on `[reward] device` in `[reward] dtype`, and scores `[reward] batch_size`
images per forward pass. Embeddings are taken to float32 before they are normalised, so a
float16 model changes the embeddings, not the precision of the score arithmetic.

    pickscore  = exp(logit_scale) * cos(image, prompt) / 26     PickScore_v1 (CLIP-H/14);
               flow_grpo's scorer divides by 26 to bring it near [0, 1]; so does this one,
               so that a weight copied from its configs means the same.
    clipscore  = cos(image, prompt)                             CLIP ViT-L/14; DiffusionNFT's
               scorer returns logits / 100, the same number for OpenAI's CLIP (logit
               scale 100). Not Hessel et al.'s CLIP-S (2.5 * max(cos, 0)).
    aesthetic  = MLP(image embedding / its norm)                 LAION's improved aesthetic
               predictor (sac+logos+ava1-l14-linearMSE) on CLIP ViT-L/14; about 1-10.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.hub import (
    check_model_type,
    load_pretrained,
    resolve_file,
    resolve_folder,
)
from flowgrpo_cli.store.config import RewardSection

if TYPE_CHECKING:
    import torch

PICKSCORE_SCALE = 26.0  # flow_grpo's normalisation of PickScore
MAX_TEXT_TOKENS = 77  # CLIP's context; longer prompts are truncated, as the scorers do
# The aesthetic predictor's layers: Linear(d, 1024), Dropout, Linear(1024, 128), Dropout,
# Linear(128, 64), Dropout, Linear(64, 16), Linear(16, 1), no activations (a linear model
# trained with MSE); the Dropouts keep the released state dict's indices (layers.0, .2, ...).
AESTHETIC_WIDTHS = (1024, 128, 64, 16, 1)
AESTHETIC_DROPOUTS = (0.2, 0.2, 0.1)


Source = tuple[str, str]  # a config table's model (a folder or hub id) and its revision


class ClipModel:
    """A CLIPModel and its processor on one device, embedding images and texts in batches;
    `options` is the config's [reward] table (device, dtype, batch_size); `key` and `field`
    name the config key of `source` in messages (`[reward.pickscore] model`)."""

    def __init__(
        self,
        source: Source,
        processor: Source,
        options: RewardSection,
        key: str,
        field: str = "model",
    ) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.device, self.dtype = reward_device_and_dtype(options)
        self.batch_size = options.batch_size
        self.model_source = resolve_folder(*source, "config.json", f"[{key}] {field}")
        check_model_type(self.model_source, "clip", f"[{key}] {field}")
        self.processor_source = (
            resolve_folder(*processor, "preprocessor_config.json", f"[{key}] processor")
            if processor != source
            else self.model_source
        )
        self.model = load_pretrained(CLIPModel, self.model_source, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.processor = load_pretrained(AutoProcessor, self.processor_source)

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.detach().float().exp())

    def image_embeddings(self, images: list[Image.Image]) -> torch.Tensor:
        """float32 [N, D], each row of norm 1."""
        return embed_in_batches(images, self.batch_size, self._image_features)

    def _image_features(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = self.pixels(images)
        out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
        return out.pooler_output

    def pixels(self, images: list[Image.Image]) -> torch.Tensor:
        """[N, 3, H, W] float32: the model's processor on the RGB images."""
        chunk = [image.convert("RGB") for image in images]
        return self.processor(images=chunk, return_tensors="pt")["pixel_values"]

    def text_embeddings(self, texts: list[str]) -> torch.Tensor:
        """float32 [N, D], each row of norm 1."""
        import torch

        parts = []
        for start in range(0, len(texts), self.batch_size):
            tokens = self.processor(
                text=texts[start : start + self.batch_size],
                padding=True,
                truncation=True,
                max_length=MAX_TEXT_TOKENS,
                return_tensors="pt",
            )
            with torch.inference_mode():
                out = self.model.get_text_features(
                    input_ids=tokens["input_ids"].to(self.device),
                    attention_mask=tokens["attention_mask"].to(self.device),
                )
            parts.append(_normalized(out.pooler_output))
        return torch.cat(parts)

    def info(self) -> dict[str, str]:
        info = {"model": self.model_source.record, "dtype": str(self.dtype).removeprefix("torch.")}
        if self.processor_source is not self.model_source:
            info["processor"] = self.processor_source.record
        return info

    def close(self) -> None:
        del self.model  # frees the GPU memory once the reward is dropped


def reward_device_and_dtype(options: RewardSection) -> tuple[torch.device, torch.dtype]:
    """`[reward] device` and `dtype`; dtype auto: float16 on a GPU, float32 on the CPU."""
    import torch

    from flowgrpo_cli.launch.distributed import resolve_device

    device = resolve_device(options.device)
    if options.dtype == "auto":
        return device, torch.float16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, options.dtype)  # a name the config's Literal checked


def embed_in_batches(
    images: list[Image.Image],
    batch_size: int,
    embed: Callable[[list[Image.Image]], torch.Tensor],
) -> torch.Tensor:
    """float32 [N, D], each row of norm 1: `embed` ([n, D] features of n images, any dtype)
    on `batch_size` images at a time, without autograd."""
    import torch

    parts = []
    for start in range(0, len(images), batch_size):
        with torch.inference_mode():
            parts.append(_normalized(embed(images[start : start + batch_size])))
    return torch.cat(parts)


def _normalized(embeddings: torch.Tensor) -> torch.Tensor:
    embeddings = embeddings.float()
    return embeddings / embeddings.norm(dim=-1, keepdim=True)


class _ClipReward:
    """A reward that reads a CLIP model: scoring, one value per image, and closing."""

    name: str
    needs: frozenset[Need]
    # torch releases the GIL in its kernels, so scoring overlaps with OCR's pool or a server.
    parallel_safe = True
    clip: ClipModel

    def score(self, batch: RewardBatch) -> RewardOutput:
        values = self._values(batch).tolist()
        return RewardOutput(scores=[ImageScore.checked(value) for value in values])

    def _values(self, batch: RewardBatch) -> torch.Tensor:
        raise NotImplementedError

    @property
    def info(self) -> dict[str, str]:
        return self.clip.info()

    def close(self) -> None:
        self.clip.close()


class PickScoreReward(_ClipReward):
    name = "pickscore"
    needs: frozenset[Need] = frozenset({"images", "prompts"})

    def __init__(self, options: RewardSection) -> None:
        pick = options.pickscore
        source, processor = (pick.model, pick.revision), (pick.processor, pick.processor_revision)
        self.clip = ClipModel(source, processor, options, "reward.pickscore")

    def _values(self, batch: RewardBatch) -> torch.Tensor:
        assert batch.prompts is not None  # RewardSet checks `needs`
        cosine = paired_cosine(self.clip, batch.images, batch.prompts)
        return self.clip.logit_scale * cosine / PICKSCORE_SCALE


class ClipScoreReward(_ClipReward):
    name = "clipscore"
    needs: frozenset[Need] = frozenset({"images", "prompts"})

    def __init__(self, options: RewardSection) -> None:
        source = (options.clipscore.model, options.clipscore.revision)
        self.clip = ClipModel(source, source, options, "reward.clipscore")

    def _values(self, batch: RewardBatch) -> torch.Tensor:
        assert batch.prompts is not None
        return paired_cosine(self.clip, batch.images, batch.prompts)


def paired_cosine(clip: ClipModel, images: list[Image.Image], texts: list[str]) -> torch.Tensor:
    """cos(image i, text i) for every i."""
    return (clip.image_embeddings(images) * clip.text_embeddings(texts)).sum(dim=-1)


class AestheticReward(_ClipReward):
    name = "aesthetic"
    needs: frozenset[Need] = frozenset({"images"})

    def __init__(self, options: RewardSection) -> None:
        table = options.aesthetic
        source = (table.model, table.revision)
        self.clip = ClipModel(source, source, options, "reward.aesthetic")
        path, self._head_record = resolve_file(
            table.head, table.head_revision, table.head_file, "[reward.aesthetic] head"
        )
        self.head = load_aesthetic_head(path, self.clip.model.config.projection_dim)

    def _values(self, batch: RewardBatch) -> torch.Tensor:
        import torch

        with torch.inference_mode():
            return self.head(self.clip.image_embeddings(batch.images)).squeeze(-1)

    @property
    def info(self) -> dict[str, str]:
        return {**self.clip.info(), "head": self._head_record}


def aesthetic_head(embedding_dim: int) -> torch.nn.Sequential:
    """The predictor's architecture (float32, eval mode) with random weights."""
    from torch import nn

    widths = (embedding_dim, *AESTHETIC_WIDTHS)
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(width_in, width_out))
        if index < len(AESTHETIC_DROPOUTS):
            layers.append(nn.Dropout(AESTHETIC_DROPOUTS[index]))
    return nn.Sequential(*layers).eval()


def load_aesthetic_head(path: Any, embedding_dim: int) -> torch.nn.Sequential:
    """The released head: a state dict of `layers.N.weight/bias` saved with torch.save."""
    import torch

    head = aesthetic_head(embedding_dim)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = {key.removeprefix("layers."): value for key, value in state.items()}
        head.load_state_dict(state)
    except (RuntimeError, OSError, AttributeError, KeyError) as err:
        raise FlowGrpoError(
            f"[reward.aesthetic] head: {path} is not an aesthetic predictor for "
            f"{embedding_dim}-dimensional CLIP embeddings: {' '.join(str(err).split())[:300]}"
        ) from None
    return head.requires_grad_(False)


def build_pickscore(section: RewardSection) -> PickScoreReward:
    return PickScoreReward(section)


def build_clipscore(section: RewardSection) -> ClipScoreReward:
    return ClipScoreReward(section)


def build_aesthetic(section: RewardSection) -> AestheticReward:
    return AestheticReward(section)
