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

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    PipelinePlacement,
    check_image_size,
    draw_noise,
    negatives_for,
    pack_latents,
    refuse_system_prompt,
    scheduler_sigmas,
    sequence_length_kwargs,
    shift_factor,
    unpack_latents,
    uses_cfg,
)
from flowgrpo_cli.models.guidance import apply_cfg


@dataclass(frozen=True)
class FluxAdapter(PipelinePlacement):
    pipeline: FluxPipeline
    family: ClassVar[str] = "flux"

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's FLUX recipe: attention and the double-stream blocks' feed-forward
        layers (image and text streams); the single-stream blocks' MLP stays frozen."""
        feed_forward = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
        return [*JOINT_ATTENTION_LORA_TARGETS, *feed_forward]

    @property
    def guidance_embeds(self) -> bool:
        """Guidance-distilled (FLUX.1-dev): guidance_scale is a transformer input."""
        return bool(self.transformer.config.guidance_embeds)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        factor = self.pipeline.vae_scale_factor
        # 2x2 packing needs an even latent grid.
        check_image_size(height, width, factor * 2)
        return (self.transformer.config.in_channels // 4, height // factor, width // factor)

    def _true_cfg(self, guidance_scale: float) -> bool:
        return not self.guidance_embeds and guidance_scale > 1.0

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None,
        *,
        guidance_scale: float,
        max_sequence_length: int | None = None,
        system_prompt: str | None = None,
    ) -> Conditioning:
        refuse_system_prompt(self.family, system_prompt)
        length = sequence_length_kwargs(max_sequence_length)
        # The text ids the pipeline returns are all zeros: velocity makes them from the length.
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, **length
        )
        # [B, L (512 by default), 4096 on FLUX.1] T5 tokens, [B, 768] pooled CLIP
        tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if self._true_cfg(guidance_scale):
            negatives = negatives_for(prompts, negative_prompts)
            negative_embeds, negative_pooled, _ = self.pipeline.encode_prompt(
                prompt=negatives, prompt_2=None, device=self.device, **length
            )
            tensors["negative_prompt_embeds"] = negative_embeds
            tensors["negative_pooled_prompt_embeds"] = negative_pooled
        return Conditioning(tensors)

    def initial_latents(
        self, generators: list[torch.Generator], height: int, width: int
    ) -> torch.Tensor:
        # The pipeline draws [B, C, h, w] and packs it afterwards: the same numbers.
        return draw_noise(generators, self.latent_shape(height, width), self.device)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        linear = np.linspace(1.0, 1 / num_steps, num_steps)
        return scheduler_sigmas(self.pipeline, num_steps, sigmas=linear, mu=self._mu(height, width))

    def time_shift(self, height: int, width: int) -> float:
        return shift_factor(self.pipeline.scheduler.config, self._mu(height, width))

    def _mu(self, height: int, width: int) -> float:
        """The resolution-dependent shift exponent."""
        config = self.pipeline.scheduler.config
        _, h, w = self.latent_shape(height, width)
        return calculate_shift(
            (h // 2) * (w // 2),  # packed tokens
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
    ) -> torch.Tensor:
        true_cfg = self._true_cfg(guidance_scale) and uses_cfg(cond, guidance_scale, self.family)
        dtype, device = self.transformer_dtype, latents.device
        b, _, h, w = latents.shape
        tokens = pack_latents(latents.to(dtype))  # [B, (h/2)(w/2), 4C]
        # The pipeline casts t = sigma * 1000 to the latents' dtype, then divides by 1000.
        num_train_timesteps = self.pipeline.scheduler.config.num_train_timesteps
        sigma = sigma.to(device, torch.float32).expand(b)  # [B]
        timestep = (sigma * num_train_timesteps).to(dtype) / 1000
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), guidance_scale, device=device, dtype=torch.float32)
        image_ids = _image_ids(h // 2, w // 2, device, dtype)  # [(h/2)(w/2), 3]

        def forward(embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
            return self.transformer(
                hidden_states=tokens,
                timestep=timestep,
                guidance=guidance,
                pooled_projections=pooled.to(device, dtype),
                encoder_hidden_states=embeds.to(device, dtype),
                txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
                img_ids=image_ids,
                return_dict=False,
            )[0].float()  # [B, (h/2)(w/2), 4C]

        v = forward(cond["prompt_embeds"], cond["pooled_prompt_embeds"])
        if true_cfg:
            v_neg = forward(cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"])
            v = apply_cfg(v_neg, v, guidance_scale)
        return unpack_latents(v, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(scaled.to(self.device, self.vae_dtype), return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image.float(), output_type="pt")


def _image_ids(rows: int, cols: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Position ids (0, row, col) of the patch tokens, row-major: FLUX's 2-D RoPE input."""
    grid = torch.zeros(rows, cols, 3)
    grid[..., 1] = torch.arange(rows)[:, None]
    grid[..., 2] = torch.arange(cols)[None, :]
    return grid.reshape(rows * cols, 3).to(device=device, dtype=dtype)
