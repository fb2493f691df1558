"""Stable Diffusion 3 / 3.5: StableDiffusion3Pipeline, split into adapter pieces.

Mirrors StableDiffusion3Pipeline.__call__ (diffusers 0.42): two CLIP encoders and T5 give
the token and pooled embeddings; CFG runs the negative and positive prompts as one batch
[uncond; cond] through one forward; the timestep is the scheduler's t = sigma * 1000; the
schedule is the scheduler's static shift (3.0 for SD3.5), unless its config asks for
resolution-dependent shifting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    PipelinePlacement,
    check_image_size,
    draw_noise,
    negatives_for,
    refuse_system_prompt,
    scheduler_sigmas,
    sequence_length_kwargs,
    shift_factor,
    uses_cfg,
)
from flowgrpo_cli.models.guidance import apply_cfg


@dataclass(frozen=True)
class SD3Adapter(PipelinePlacement):
    pipeline: StableDiffusion3Pipeline
    family: ClassVar[str] = "sd3"

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

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
        cfg = guidance_scale > 1.0
        embeds, negative_embeds, pooled, negative_pooled = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=cfg,
            negative_prompt=negatives_for(prompts, negative_prompts) if cfg else None,
            **sequence_length_kwargs(max_sequence_length),
        )
        # [B, 77 + T5 length, 4096 on SD3.5] tokens (CLIP padded to T5's width), [B, 2048] pooled
        tensors = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if cfg:
            tensors["negative_prompt_embeds"] = negative_embeds
            tensors["negative_pooled_prompt_embeds"] = negative_pooled
        return Conditioning(tensors)

    def initial_latents(
        self, generators: list[torch.Generator], height: int, width: int
    ) -> torch.Tensor:
        return draw_noise(generators, self.latent_shape(height, width), self.device)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        mu = self._mu(height, width)
        if mu is None:
            return scheduler_sigmas(self.pipeline, num_steps)
        return scheduler_sigmas(self.pipeline, num_steps, mu=mu)

    def time_shift(self, height: int, width: int) -> float:
        return shift_factor(self.pipeline.scheduler.config, self._mu(height, width))

    def _mu(self, height: int, width: int) -> float | None:
        """The resolution-dependent shift exponent, or None for SD3.5's static shift."""
        config = self.pipeline.scheduler.config
        if not config.get("use_dynamic_shifting", False):
            return None
        _, h, w = self.latent_shape(height, width)
        patch = self.transformer.config.patch_size
        return calculate_shift(
            (h // patch) * (w // patch),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.16),
        )

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
    ) -> torch.Tensor:
        cfg = uses_cfg(cond, guidance_scale, self.family)
        dtype, device = self.transformer_dtype, latents.device
        hidden = latents.to(dtype)  # [B, C, h, w]
        # The pipeline's timestep is the scheduler's t = sigma * num_train_timesteps, in float32.
        num_train_timesteps = self.pipeline.scheduler.config.num_train_timesteps
        sigma = sigma.to(device, torch.float32).expand(latents.shape[0])  # [B]
        timestep = sigma * num_train_timesteps
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
        return apply_cfg(v_uncond, v_cond, guidance_scale)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        scaled = latents / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(scaled.to(self.device, self.vae_dtype), return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image.float(), output_type="pt")
