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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

# From its module: mypy reads `from diffusers import QwenImagePipeline` as a dummy class.
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

from flowgrpo_cli.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    Conditioning,
    PackedLatentAdapter,
    SequenceLength,
)

if TYPE_CHECKING:
    from PIL import Image


@dataclass(frozen=True)
class QwenImageAdapter(PackedLatentAdapter):
    pipeline: QwenImagePipeline
    family: ClassVar[str] = "qwenimage"
    cfg_rescale: ClassVar[bool] = True

    @property
    def default_lora_targets(self) -> list[str]:
        """The reference's Qwen-Image recipe: attention and both streams' MLPs."""
        mlp = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
        return [*JOINT_ATTENTION_LORA_TARGETS, *mlp]

    def _encode_prompts(
        self,
        prompts: list[str],
        negatives: list[str] | None,
        length: SequenceLength,
        sources: Sequence[Image.Image] | None,  # None: encode_prompts refuses any here
    ) -> dict[str, torch.Tensor]:
        tensors = self._encode("prompt", prompts, length)
        if negatives is not None:
            tensors |= self._encode("negative_prompt", negatives, length)
        return tensors

    def _encode(
        self, name: str, prompts: list[str], length: SequenceLength, **image: Any
    ) -> dict[str, torch.Tensor]:
        """encode_prompt of `prompts` under `name`; `image`: the edit pipeline's keyword for
        the source images its text encoder sees with the prompts."""
        embeds, mask = self.pipeline.encode_prompt(
            prompt=prompts, device=self.device, **length, **image
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

        system_prompt None keeps the pipeline's own template (its image-description system
        prompt); a string replaces that system prompt in the same chat template (the rest of
        the template, the edit pipeline's image placeholder in the user turn included, stays).
        The pipeline drops the template's leading tokens (system turn and user header) from
        the encoder output, by a fixed count that fits its own template; for a new system
        prompt that count is the token length of the new template's leading part.
        """
        if system_prompt is None:
            yield
            return
        pipeline = self.pipeline
        escaped = system_prompt.replace("{", "{{").replace("}", "}}")
        user = "<|im_start|>user\n"
        rest = pipeline.prompt_template_encode.split("<|im_end|>", 1)[1]
        template = f"<|im_start|>system\n{escaped}<|im_end|>{rest}"
        prefix = template[: template.index(user) + len(user)].replace("{{", "{").replace("}}", "}")
        saved = (pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx)
        pipeline.prompt_template_encode = template
        pipeline.prompt_template_encode_start_idx = len(pipeline.tokenizer(prefix).input_ids)
        try:
            yield
        finally:
            pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx = saved

    def _transformer_inputs(
        self, tokens: torch.Tensor, grids: list[tuple[int, int]], scale: float
    ) -> dict[str, Any]:
        # One frame of rows x cols tokens per grid, per sample.
        return {"img_shapes": [[(1, *grid) for grid in grids]] * tokens.shape[0]}

    def _text_inputs(self, cond: Conditioning, prefix: str, tokens: torch.Tensor) -> dict[str, Any]:
        mask = cond[f"{prefix}prompt_embeds_mask"]
        embeds = cond[f"{prefix}prompt_embeds"]
        return {
            # The pipeline passes no mask when nothing is padded.
            "encoder_hidden_states_mask": None if bool(mask.all()) else mask.to(tokens.device),
            "encoder_hidden_states": embeds.to(tokens.device, tokens.dtype),
        }

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
