"""Stable Diffusion 3 / 3.5: StableDiffusion3Pipeline, split into adapter pieces.

Mirrors StableDiffusion3Pipeline.__call__ (diffusers 0.42): two CLIP encoders and T5 give
the token and pooled embeddings; CFG runs the negative and positive prompts as one batch
[uncond; cond] through one forward; the timestep is the scheduler's t = sigma * 1000; the
schedule is the scheduler's static shift (3.0 for SD3.5), unless its config asks for
resolution-dependent shifting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

# From its module: mypy reads `from diffusers import StableDiffusion3Pipeline` as a dummy class.
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
    StableDiffusion3Pipeline,
)

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    ModelAdapter,
    SequenceLength,
    check_image_size,
)
from flowgrpo_cli.models.guidance import apply_cfg

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class SD3Adapter(ModelAdapter):
    pipeline: StableDiffusion3Pipeline
    family: ClassVar[str] = "sd3"
    default_max_shift: ClassVar[float] = 1.16

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's SD3 recipe: the joint attention only (not SD3.5's attn2)."""
        return list(JOINT_ATTENTION_LORA_TARGETS)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        factor = self.pipeline.vae_scale_factor
        config = self.transformer.config
        check_image_size(height, width, factor * config.patch_size)
        # SD3's positional embedding is a table cropped to the image: a larger image has no
        # rows in it (diffusers raises a ValueError in the first forward).
        if config.get("pos_embed_max_size"):
            largest = config.pos_embed_max_size * config.patch_size * factor
            if max(height, width) > largest:
                raise FlowGrpoError(
                    f"model.height x model.width = {height}x{width} is larger than this SD3 "
                    f"transformer can draw: at most {largest} px a side (its pos_embed_max_size "
                    f"{config.pos_embed_max_size} x patch {config.patch_size} x VAE {factor}); "
                    "set model.height and model.width to at most that"
                )
        return (config.in_channels, height // factor, width // factor)

    def _encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str] | None,
        length: SequenceLength,
        sources: Sequence[Image.Image] | None,  # None: encode_prompts refuses any here
    ) -> dict[str, torch.Tensor]:
        cfg = negatives is not None
        embeds, negative_embeds, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            # diffusers annotates prompt_2 and prompt_3 without None, yet reads None as "the
            # same as prompt" (`prompt_2 or prompt`), as the pipeline's __call__ passes it.
            prompt_2=None,  # type: ignore[arg-type]
            prompt_3=None,  # type: ignore[arg-type]
            device=self.device,
            do_classifier_free_guidance=cfg,
            negative_prompt=negatives,
            **length,
        )
        # [B, 77 + T5 length, 4096 on SD3.5] tokens (CLIP padded to T5's width), [B, 2048] pooled
        tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            tensors["negative_prompt_embeds"] = negative_embeds
            tensors["negative_pooled_prompt_embeds"] = negative_pooled
        return tensors

    def _image_tokens(self, height: int, width: int) -> int:
        _, h, w = self.latent_shape(height, width)
        patch = self.transformer.config.patch_size
        return (h // patch) * (w // patch)

    def _velocity(
        self, latents: torch.Tensor, t: torch.Tensor, cond: Conditioning, scale: float, cfg: bool
    ) -> torch.Tensor:
        dtype, device = self.transformer_dtype, latents.device
        hidden = latents.to(dtype)  # [B, C, h, w]
        timestep = t  # the pipeline's timestep is the scheduler's t itself, in float32
        embeds = cond["prompt_embeds"]  # [B, L, D]
        pooled = cond["pooled_prompt_embeds"]  # [B, P]
        if cfg:
            # One forward over [uncond; cond], the pipeline's batch layout.
            hidden = torch.cat([hidden, hidden])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        out = self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds.to(device, dtype),
            pooled_projections=pooled.to(device, dtype),
            return_dict=False,
        )[0].float()  # [B or 2B, C, h, w]
        if not cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return apply_cfg(v_uncond, v_cond, scale)
