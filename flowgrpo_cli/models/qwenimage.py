"""Qwen-Image: QwenImagePipeline, split into adapter pieces.

Mirrors QwenImagePipeline.__call__ (diffusers 0.42): the text encoder is the chat model
Qwen2.5-VL; each prompt is wrapped in a chat template with a system prompt, encoded, and the
template's leading tokens are dropped, leaving one embedding per prompt token (as long as the
longest prompt of the batch, with a mask). Latents enter the transformer as 2x2 patch tokens;
the transformer takes t / 1000 (t = sigma * 1000 cast to the model dtype); the schedule is
linspace(1, 1/N, N) shifted by mu (and stretched to the scheduler's terminal sigma).

guidance_scale > 1 is the pipeline's true CFG (its `true_cfg_scale`): a second forward with
the negative prompt, combined as v_neg + g (v - v_neg), then each token rescaled to the norm
of its conditional velocity.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    PipelinePlacement,
    check_image_size,
    draw_noise,
    negatives_for,
    pack_latents,
    scheduler_sigmas,
    sequence_length_kwargs,
    shift_factor,
    unpack_latents,
    uses_cfg,
)
from flowgrpo_cli.models.guidance import apply_cfg


@dataclass(frozen=True)
class QwenImageAdapter(PipelinePlacement):
    pipeline: QwenImagePipeline
    family: ClassVar[str] = "qwenimage"

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's Qwen-Image recipe: attention and both streams' MLPs."""
        mlp = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
        return [*JOINT_ATTENTION_LORA_TARGETS, *mlp]

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        factor = self.pipeline.vae_scale_factor
        # 2x2 packing needs an even latent grid.
        check_image_size(height, width, factor * 2)
        return (self.transformer.config.in_channels // 4, height // factor, width // factor)

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
        """system_prompt None keeps the pipeline's own template (its image-description
        system prompt); a string replaces that system prompt in the same chat template."""
        with self._system_prompt(system_prompt):
            tensors = self._encode("prompt", prompts, max_sequence_length)
            if guidance_scale > 1.0:
                negatives = negatives_for(prompts, negative_prompts)
                tensors |= self._encode("negative_prompt", negatives, max_sequence_length)
        return Conditioning(tensors)

    def _encode(
        self, name: str, prompts: list[str], max_sequence_length: int | None
    ) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, **sequence_length_kwargs(max_sequence_length)
        )
        # embeds [B, L, D], L the longest prompt's token count. The pipeline returns no mask
        # when no prompt is padded; keep one anyway so conditionings of separate batches can
        # be padded and stacked (Conditioning.cat). velocity drops it again where it is all ones.
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {f"{name}_embeds": embeds, f"{name}_embeds_mask": mask}

    @contextmanager
    def _system_prompt(self, system_prompt: str | None) -> Iterator[None]:
        """Swap the pipeline's chat template for one with `system_prompt`, during encoding.

        The pipeline drops the template's leading tokens (system turn and user header) from
        the encoder output, by a fixed count that fits its own template; for a new system
        prompt that count is the token length of the new template's leading part.
        """
        if system_prompt is None:
            yield
            return
        pipeline = self.pipeline
        escaped = system_prompt.replace("{", "{{").replace("}", "}}")
        template = (
            f"<|im_start|>system\n{escaped}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        prefix = template.split("{}")[0].format()
        saved = (pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx)
        pipeline.prompt_template_encode = template
        pipeline.prompt_template_encode_start_idx = len(pipeline.tokenizer(prefix).input_ids)
        try:
            yield
        finally:
            pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx = saved

    def initial_latents(
        self, generators: list[torch.Generator], height: int, width: int
    ) -> torch.Tensor:
        # The pipeline draws [B, 1 frame, C, h, w] and packs it: the same numbers as [B, C, h, w].
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
        cfg = uses_cfg(cond, guidance_scale, self.family)
        dtype, device = self.transformer_dtype, latents.device
        b, _, h, w = latents.shape
        tokens = pack_latents(latents.to(dtype))  # [B, (h/2)(w/2), 4C]
        # The pipeline casts t = sigma * 1000 to the latents' dtype, then divides by 1000.
        num_train_timesteps = self.pipeline.scheduler.config.num_train_timesteps
        sigma = sigma.to(device, torch.float32).expand(b)  # [B]
        timestep = (sigma * num_train_timesteps).to(dtype) / 1000
        image_shapes = [[(1, h // 2, w // 2)]] * b  # one frame of (h/2) x (w/2) tokens each

        def forward(embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.transformer(
                hidden_states=tokens,
                timestep=timestep,
                # The pipeline passes no mask when nothing is padded.
                encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(device),
                encoder_hidden_states=embeds.to(device, dtype),
                img_shapes=image_shapes,
                return_dict=False,
            )[0].float()  # [B, (h/2)(w/2), 4C]

        v = forward(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        if cfg:
            v_uncond = forward(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
            # Norms per token: over the channels of the packed layout, as the pipeline does.
            v = apply_cfg(v_uncond, v, guidance_scale, rescale_to_cond_norm=True, norm_dim=-1)
        return unpack_latents(v, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        frames = latents.unsqueeze(2).to(self.device, self.vae_dtype)  # [B, C, 1 frame, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(frames.device, frames.dtype)
        # Divide by the reciprocal of the std, as the pipeline does, to match it bit for bit.
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(
            frames.device, frames.dtype
        )
        image = vae.decode(frames / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return self.pipeline.image_processor.postprocess(image.float(), output_type="pt")
