"""`source_similarity`: how much of its source image an edit keeps, for an editing data set.

    source_similarity = < e(result) / |e(result)|, e(source) / |e(source)| >

the cosine of the two images' embeddings in an image encoder (`[reward.source_similarity]`):

- backbone "dino" (default): DINOv2 (facebook/dinov2-base), e = its final layer-normed CLS
  token (Dinov2Model's pooler_output), the image feature DINOv2 is evaluated on for retrieval
  and the DINO score of subject-driven generation and editing benchmarks uses (with DINO v1);
- backbone "clip": CLIP (openai/clip-vit-large-patch14), e = the projected image embedding
  (`get_image_features`): CLIP-I.

Each image goes through the model's own processor (DINOv2's: the shorter side to 256, a
224 x 224 centre crop; CLIP's: 224, centre crop), so the result and its source are compared at
the same scale whatever their sizes. The value is the raw cosine, in [-1, 1] (close to 1 for
an image and itself), as editing benchmarks report CLIP-I and DINO, and as `clipscore` is:
an affine map to [0, 1] would change nothing the advantages see but their scale against the
other rewards, which the weight already sets.

Embeddings are float32 before they are normalised (the model may run in float16). The images
of one prompt share its source image (one PIL object, as the score stage decodes it): each
distinct source object is embedded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from PIL import Image

from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.clip import ClipModel, Source, embed_in_batches, reward_device_and_dtype
from flowgrpo_cli.rewards.hub import check_model_type, load_pretrained, resolve_folder
from flowgrpo_cli.store.config import SOURCE_SIMILARITY_MODELS, RewardSection

if TYPE_CHECKING:
    import torch

KEY = "reward.source_similarity"


class ImageEncoder(Protocol):
    def image_embeddings(self, images: list[Image.Image]) -> torch.Tensor: ...  # [N, D], unit

    def info(self) -> dict[str, str]: ...

    def close(self) -> None: ...


class DinoModel:
    """A Dinov2Model and its image processor on `[reward] device` in `[reward] dtype`,
    embedding `[reward] batch_size` images per forward (the CLS feature, norm 1)."""

    def __init__(self, source: Source, options: RewardSection, key: str) -> None:
        from transformers import AutoImageProcessor, Dinov2Model

        self.device, self.dtype = reward_device_and_dtype(options)
        self.batch_size = options.batch_size
        self.source = resolve_folder(*source, "config.json", f"[{key}] model")
        check_model_type(self.source, "dinov2", f"[{key}] model")
        self.model = load_pretrained(Dinov2Model, self.source, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)
        self.processor = load_pretrained(AutoImageProcessor, self.source)

    def image_embeddings(self, images: list[Image.Image]) -> torch.Tensor:
        """float32 [N, D], each row of norm 1."""
        return embed_in_batches(images, self.batch_size, self._features)

    def _features(self, images: list[Image.Image]) -> torch.Tensor:
        chunk = [image.convert("RGB") for image in images]
        pixels = self.processor(images=chunk, return_tensors="pt")["pixel_values"]
        return self.model(pixel_values=pixels.to(self.device, self.dtype)).pooler_output

    def info(self) -> dict[str, str]:
        return {"model": self.source.record, "dtype": str(self.dtype).removeprefix("torch.")}

    def close(self) -> None:
        del self.model  # frees the GPU memory once the reward is dropped


class SourceSimilarityReward:
    name = "source_similarity"
    needs: frozenset[Need] = frozenset({"images", "source_images"})
    parallel_safe = True  # torch releases the GIL in its kernels

    def __init__(self, options: RewardSection) -> None:
        table = options.source_similarity
        self.backbone = table.backbone
        source = (table.model or SOURCE_SIMILARITY_MODELS[table.backbone], table.revision)
        self.encoder: ImageEncoder = (
            ClipModel(source, source, options, KEY)
            if table.backbone == "clip"
            else DinoModel(source, options, KEY)
        )

    def score(self, batch: RewardBatch) -> RewardOutput:
        assert batch.source_images is not None  # RewardSet checks `needs`
        values = paired_image_cosine(self.encoder, batch.images, batch.source_images)
        return RewardOutput(scores=[ImageScore.checked(value) for value in values.tolist()])

    @property
    def info(self) -> dict[str, str]:
        return {"backbone": self.backbone, **self.encoder.info()}

    def close(self) -> None:
        self.encoder.close()


def paired_image_cosine(
    encoder: ImageEncoder, images: list[Image.Image], sources: list[Image.Image]
) -> torch.Tensor:
    """cos(image i, source i) for every i, float32 [N]; each distinct source object is
    embedded once."""
    import torch

    unique: list[Image.Image] = []
    row_of: dict[int, int] = {}  # id(source) -> its row among the distinct sources
    for source in sources:
        if id(source) not in row_of:
            row_of[id(source)] = len(unique)
            unique.append(source)
    rows = torch.tensor([row_of[id(source)] for source in sources])
    return (encoder.image_embeddings(images) * encoder.image_embeddings(unique)[rows]).sum(-1)


def build_source_similarity(section: RewardSection) -> SourceSimilarityReward:
    return SourceSimilarityReward(section)
