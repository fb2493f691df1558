"""FLUX.1-Kontext: FluxKontextPipeline, split into adapter pieces.

Mirrors FluxKontextPipeline.__call__ (diffusers 0.42) with its defaults, on top of FLUX.1's
pieces (flowgrpo_cli.models.flux): the source image is resized to the Kontext training
resolution nearest its aspect ratio (`PREFERRED_KONTEXT_RESOLUTIONS`, about 1 MP; the
pipeline's `_auto_resize`), and the VAE encodes it (the mode of its latent distribution,
shifted and scaled as FLUX latents are). Those latents, packed into 2x2 patch tokens, follow
the noisy latents' tokens in the transformer's sequence with position ids (1, row, col), where
the generated tokens have (0, row, col); the output is cut back to the generated tokens before
guidance and the step. The text encoders never see the image. Everything else (schedule, with
its mu from the generated tokens alone; embedded guidance, one knob as for FLUX.1; decode) is
FLUX.1's.

Output size: the pipeline scales the height and width it is given to its `max_area` (1024 x
1024 by default) at their aspect ratio, so `height=512, width=512` alone gives 1024 x 1024
images. flowgrpo generates at model.height x model.width exactly: the pipeline's images when
it is also given `max_area = height * width` (as flow_grpo's Kontext trainer passes it).

The source image is encoded once per prompt: its latents (`image_latents`, [B, C, h', w'])
live in the conditioning beside the text embeddings, so the rollout stores them with each
group and the update reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

# From its module: mypy reads `from diffusers import FluxKontextPipeline` as a dummy class.
from diffusers.pipelines.flux.pipeline_flux_kontext import (
    PREFERRED_KONTEXT_RESOLUTIONS,
    FluxKontextPipeline,
)

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.flux import FLUX_LORA_TARGETS, FluxAdapter

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class FluxKontextAdapter(FluxAdapter):
    # Not a FluxPipeline subclass, but it has every attribute the FLUX.1 pieces use.
    pipeline: FluxKontextPipeline  # type: ignore[assignment]
    family: ClassVar[str] = "flux_kontext"
    takes_source_image: ClassVar[bool] = True
    # Every preferred Kontext resolution is about 1 MP (1024 x 1024 for a square source).
    source_pixels: ClassVar[int] = 1024 * 1024

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's Kontext recipe (flow_grpo's train_flux_kontext.py): FLUX.1's
        targets plus the single-stream blocks' MLP input projection."""
        return [*FLUX_LORA_TARGETS, "proj_mlp"]

    def resized_source(self, image: Image.Image) -> Image.Image:
        """The source image at the pipeline's size for it: the preferred Kontext resolution
        whose aspect ratio is nearest the image's (sides multiples of the VAE factor x 2)."""
        processor = self.pipeline.image_processor
        multiple = self.pipeline.vae_scale_factor * 2
        # The pipeline takes the aspect ratio of the size rounded down to that multiple.
        height, width = processor.get_default_height_width(image)
        if height == 0 or width == 0:
            raise FlowGrpoError(
                f"A source image of {image.size[0]} x {image.size[1]} pixels is too small for "
                f"FluxKontextPipeline, which rounds its sides down to multiples of {multiple} "
                f"pixels: give source images at least {multiple} x {multiple}."
            )
        ratio = width / height
        _, width, height = min((abs(ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        height, width = height // multiple * multiple, width // multiple * multiple
        return processor.resize(image.convert("RGB"), height, width)

    def _encode_source(self, image: Image.Image) -> torch.Tensor:
        vae = self.pipeline.vae
        width, height = image.size
        pixels = self.pipeline.image_processor.preprocess(image, height, width)  # [1, 3, H, W]
        encoded = vae.encode(pixels.to(self.device, self.vae_dtype))
        latents = encoded.latent_dist.mode()  # the pipeline's sample_mode="argmax"
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor
