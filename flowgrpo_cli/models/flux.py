"""FLUX.1: FluxPipeline, split into adapter pieces.

Mirrors FluxPipeline.__call__ (diffusers 0.42): CLIP gives the pooled embedding and T5 the
tokens; latents enter the transformer as 2x2 patch tokens with (0, row, col) position ids,
text tokens with zero ids; the transformer takes t / 1000 (t = sigma * 1000 cast to the model
dtype); the schedule is linspace(1, 1/N, N) shifted by mu, which grows with the token count.

Guidance, with one knob as for every family:
- guidance-distilled transformers (config.guidance_embeds, FLUX.1-dev) take guidance_scale as
  an input embedding, in the one forward; the pipeline calls this `guidance_scale` too.
- otherwise (FLUX.1-schnell's architecture) guidance_scale > 1 is the pipeline's true CFG
  (its `true_cfg_scale`): a second forward with the negative prompt, v_neg + g (v - v_neg).
The pipeline also allows true CFG on top of embedded guidance; that would need a second
scale, and Flow-GRPO on FLUX.1-dev trains with embedded guidance alone, so it is not offered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

# From its module: mypy reads `from diffusers import FluxPipeline` as a dummy class.
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    PackedLatentAdapter,
    SequenceLength,
)

if TYPE_CHECKING:
    from PIL import Image


FLUX_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    *("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"),
)


@dataclass(frozen=True)
class FluxAdapter(PackedLatentAdapter):
    pipeline: FluxPipeline
    family: ClassVar[str] = "flux"

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's FLUX recipe: attention and the double-stream blocks' feed-forward
        layers (image and text streams); the single-stream blocks' MLP stays frozen."""
        return list(FLUX_LORA_TARGETS)

    @property
    def guidance_embeds(self) -> bool:
        """Guidance-distilled (FLUX.1-dev): guidance_scale is a transformer input."""
        return bool(self.transformer.config.guidance_embeds)

    def runs_cfg(self, guidance_scale: float) -> bool:
        """True CFG only without guidance embeds: FLUX.1-dev takes the scale as an input."""
        return not self.guidance_embeds and guidance_scale > 1.0

    def _encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str] | None,
        length: SequenceLength,
        sources: Sequence[Image.Image] | None,  # the text encoders never see a source image
    ) -> dict[str, torch.Tensor]:
        # The text ids the pipeline returns are all zeros: velocity makes them from the length.
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, **length
        )
        # [B, L (512 by default), 4096 on FLUX.1] T5 tokens, [B, 768] pooled CLIP
        tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if negatives is not None:
            negative_embeds, negative_pooled, _ = self.pipeline.encode_prompt(
                prompt=negatives, prompt_2=None, device=self.device, **length
            )
            tensors["negative_prompt_embeds"] = negative_embeds
            tensors["negative_pooled_prompt_embeds"] = negative_pooled
        return tensors

    def _transformer_inputs(
        self, tokens: torch.Tensor, grids: list[tuple[int, int]], scale: float
    ) -> dict[str, Any]:
        guidance = None
        if self.guidance_embeds:
            batch = tokens.shape[0]
            guidance = torch.full((batch,), scale, device=tokens.device, dtype=torch.float32)
        # One grid here; FLUX.1-Kontext appends its source image's, told apart by the first id.
        image_ids = torch.cat(
            [_image_ids(i, *grid, tokens.device, tokens.dtype) for i, grid in enumerate(grids)]
        )  # [sum of rows x cols, 3]
        return {"guidance": guidance, "img_ids": image_ids}

    def _text_inputs(self, cond: Conditioning, prefix: str, tokens: torch.Tensor) -> dict[str, Any]:
        embeds = cond[f"{prefix}prompt_embeds"]
        device, dtype = tokens.device, tokens.dtype
        return {
            "pooled_projections": cond[f"{prefix}pooled_prompt_embeds"].to(device, dtype),
            "encoder_hidden_states": embeds.to(device, dtype),
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
        }


def _image_ids(
    index: int, rows: int, cols: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Position ids (index, row, col) of the patch tokens, row-major: FLUX's RoPE input. The
    generated image's index is 0; FluxKontextPipeline gives its source image's tokens 1."""
    grid = torch.full((rows, cols, 3), float(index))
    grid[..., 1] = torch.arange(rows)[:, None]
    grid[..., 2] = torch.arange(cols)[None, :]
    return grid.reshape(rows * cols, 3).to(device=device, dtype=dtype)
