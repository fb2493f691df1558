"""Qwen-Image-Edit: QwenImageEditPipeline, split into adapter pieces.

Mirrors QwenImageEditPipeline.__call__ (diffusers 0.42), on top of Qwen-Image's pieces
(flowgrpo_cli.models.qwenimage): the source image is resized to about 1 MP at its own aspect
ratio (sides multiples of 32, `calculate_dimensions`); the Qwen2.5-VL text encoder reads it with
the instruction (the processor expands its image tokens into the chat template, whose leading
64 tokens are dropped); the VAE encodes it (the mode of its latent distribution, normalized by
the VAE's latents mean and std). Those latents, packed into 2x2 patch tokens, follow the noisy
latents' tokens in the transformer's sequence (`img_shapes` lists both grids), and the output
is cut back to the generated tokens before CFG and the step. Everything else (schedule, true
CFG with its norm rescale, decode) is Qwen-Image's.

The source image is encoded once per prompt, with the prompt: its latents (`image_latents`,
[B, C, h', w']) live in the conditioning beside the text embeddings, so the rollout stores them
with each group and the update reads them back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

# From its module: mypy reads `from diffusers import QwenImageEditPipeline` as a dummy class.
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
    QwenImageEditPipeline,
    calculate_dimensions,
)
from transformers import Qwen2VLProcessor

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.base import SequenceLength
from flowgrpo_cli.models.qwenimage import QwenImageAdapter

if TYPE_CHECKING:
    from PIL import Image

#: The area the pipeline resizes every source image to (its `calculate_dimensions` target).
SOURCE_AREA = 1024 * 1024


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video half.

    The edit pipeline hands its processor text and images, never videos; transformers' video
    processor needs torchvision, which a CPU-only torch often lacks, and the processor will not
    even be built without one. This one is the same processor with image and text halves only.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(folder: Path) -> ImageOnlyQwen2VLProcessor:
    """The checkpoint's `processor` folder, loaded as an image-only processor.

    The image half is transformers' PIL implementation of Qwen2VLImageProcessor, whatever
    `image_processor_type` the folder names: it needs no torchvision (the torchvision one
    resizes with its own rounding, so pixel values can differ from it in the last bits).
    """
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    if not folder.is_dir():
        raise FlowGrpoError(f"{folder}: the edit pipeline's processor folder is missing")
    return ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
        tokenizer=Qwen2Tokenizer.from_pretrained(folder),
    )


def name_released_processor(folder: Path) -> None:
    """Name the processor of a saved pipeline folder as the released checkpoint does
    (transformers' Qwen2VLProcessor), not as the image-only subclass it was loaded or built
    as: diffusers then loads the folder with transformers' own class (load_adapter loads the
    processor itself either way), and nothing in it needs flowgrpo."""
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config_file = folder / "processor" / "processor_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        config["processor_class"] = "Qwen2VLProcessor"
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class QwenImageEditAdapter(QwenImageAdapter):
    # Not a QwenImagePipeline subclass, but it has every attribute the Qwen-Image pieces use.
    pipeline: QwenImageEditPipeline  # type: ignore[assignment]
    family: ClassVar[str] = "qwenimage_edit"
    takes_source_image: ClassVar[bool] = True
    source_pixels: ClassVar[int] = SOURCE_AREA

    def _encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str] | None,
        length: SequenceLength,
        sources: Sequence[Image.Image] | None,
    ) -> dict[str, torch.Tensor]:
        if sources is None:  # encode_prompts refuses this first
            raise ValueError("qwenimage_edit encodes prompts with their source images")
        # The text encoder reads the resized source with the prompt, and with the negative.
        tensors = self._encode("prompt", prompts, length, image=list(sources))
        if negatives is not None:
            tensors |= self._encode("negative_prompt", negatives, length, image=list(sources))
        return tensors

    def save_pretrained(self, folder: Path) -> None:
        super().save_pretrained(folder)
        name_released_processor(folder)

    def resized_source(self, image: Image.Image) -> Image.Image:
        """The source image at the pipeline's size for it: about 1 MP at its aspect ratio."""
        width, height, _ = calculate_dimensions(SOURCE_AREA, image.size[0] / image.size[1])
        return self.pipeline.image_processor.resize(image.convert("RGB"), height, width)

    def _encode_source(self, image: Image.Image) -> torch.Tensor:
        """VAE latents [1, C, h', w'] of a resized source image, as the pipeline's
        prepare_latents makes them (before it packs them)."""
        vae = self.pipeline.vae
        width, height = image.size
        pixels = self.pipeline.image_processor.preprocess(image, height, width)  # [1, 3, H, W]
        frames = pixels.unsqueeze(2).to(self.device, self.vae_dtype)  # [1, 3, 1 frame, H, W]
        latents = vae.encode(frames).latent_dist.mode()  # the pipeline's sample_mode="argmax"
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        return ((latents - mean) / std)[:, :, 0]
