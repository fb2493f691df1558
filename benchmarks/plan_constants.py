"""Measure the activation constants `flowgrpo plan` uses (flowgrpo_cli/planning/memory.py).

    python -m benchmarks.plan_constants > flowgrpo_cli/planning/constants.json
    # about 5 minutes on one core; the JSON is what the planner reads

The meta device counts weights exactly, but not what a forward pass keeps alive. This script
runs small real models on the CPU (random weights; each family's real head size and MLP
ratio, fewer heads and layers) and counts, with a dispatch mode that follows every storage an
operator allocates until it is freed (weights, buffers and inputs excluded), in float32 and in
bfloat16:

- saved:  the bytes alive after a forward with gradient (what backward will read), per token
          and per transformer block, for image and text tokens apart: two layer counts give
          the per-block part, three token mixes split it between image and text tokens;
- extra:  the peak during backward above (saved + the gradients), per token;
- work:   the peak of a forward without gradient (rollout, evaluation, the KL reference),
          per token;
- vae:    the peak of a VAE decode without gradient, per output pixel;
- clip:   the peak of a CLIP vision forward without gradient, per image token.

The update's two cases are measured as it runs them: LoRA (the family's default targets,
base frozen) and full (every weight trainable), each with and without gradient
checkpointing. Every value is in units of (inner width x bytes per element), so it carries
over to the real widths; the printed JSON is flowgrpo_cli/planning/constants.json.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

# CPU SDPA picks the flash kernel for these shapes (logsumexp saved, no L x L matrix), as the
# GPU kernels do; one thread keeps the run short on a shared machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def live_bytes_mode(ignore):
    """A TorchDispatchMode counting the bytes of storages allocated inside it while alive."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.refs: dict[int, weakref.ref] = {}
            self.ignore = {t.untyped_storage()._cdata for t in ignore}

        def _on_free(self, key: int, size: int):
            def callback(_ref) -> None:
                if self.refs.pop(key, None) is not None:
                    self.live -= size

            return callback

        def reset_peak(self) -> None:
            self.peak = self.live

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self.refs or key in self.ignore:
                    continue
                size = storage.nbytes()
                self.refs[key] = weakref.ref(storage, self._on_free(key, size))
                self.live += size
                self.peak = max(self.peak, self.live)
            return out

    return LiveBytes()


# Block kinds: (builder of a transformer with `layers` blocks of that kind, inner width,
# default LoRA targets, tokens from an image of `side` latent pixels).
def _sd3(layers: int, dual: bool):
    from diffusers import SD3Transformer2DModel

    # The last block is always SD3's context_pre_only one: differences of two layer counts
    # leave only blocks of the measured kind.
    return SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=layers + 1,
        attention_head_dim=64, num_attention_heads=4, joint_attention_dim=128,
        caption_projection_dim=256, pooled_projection_dim=64, pos_embed_max_size=64,
        dual_attention_layers=tuple(range(layers)) if dual else (), qk_norm="rms_norm",
    )  # fmt: skip


def _flux(double: int, single: int):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=double, num_single_layers=single,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=128,
        pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    )  # fmt: skip


def _qwen(layers: int):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=layers,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=128,
        axes_dims_rope=(16, 56, 56),
    )  # fmt: skip


JOINT = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
         "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]  # fmt: skip
KINDS = {
    "sd3": (lambda n: _sd3(n, False), "sd3", JOINT),
    "sd35_dual": (lambda n: _sd3(n, True), "sd3", JOINT),
    "flux_double": (lambda n: _flux(n, 1), "flux",
                    [*JOINT, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                     "ff_context.net.2"]),
    "flux_single": (lambda n: _flux(1, n), "flux",
                    [*JOINT, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                     "ff_context.net.2"]),
    "qwen": (_qwen, "qwen", [*JOINT, "img_mlp.net.0.proj", "img_mlp.net.2",
                             "txt_mlp.net.0.proj", "txt_mlp.net.2"]),
}  # fmt: skip
INNER = 256
BATCH = 2


def _inputs(family: str, model, side: int, text: int, dtype):
    """(kwargs of one forward, image tokens, text tokens) for a latent of side x side."""
    import torch

    g = torch.Generator().manual_seed(0)
    t = torch.rand(BATCH, generator=g)
    if family == "sd3":
        x = torch.randn(BATCH, 16, side, side, generator=g, dtype=dtype)
        kwargs = dict(hidden_states=x, timestep=t * 1000,
                      encoder_hidden_states=torch.randn(BATCH, text, 128, dtype=dtype),
                      pooled_projections=torch.randn(BATCH, 64, dtype=dtype))  # fmt: skip
        return kwargs, (side // 2) ** 2, text
    tokens = (side // 2) ** 2
    x = torch.randn(BATCH, tokens, 64, generator=g, dtype=dtype)
    if family == "flux":
        ids = torch.zeros(tokens, 3)
        ids[:, 1] = torch.arange(tokens) // (side // 2)
        ids[:, 2] = torch.arange(tokens) % (side // 2)
        kwargs = dict(hidden_states=x, timestep=t, guidance=torch.full((BATCH,), 3.5),
                      pooled_projections=torch.randn(BATCH, 64, dtype=dtype),
                      encoder_hidden_states=torch.randn(BATCH, text, 128, dtype=dtype),
                      txt_ids=torch.zeros(text, 3), img_ids=ids)  # fmt: skip
        return kwargs, tokens, text
    kwargs = dict(hidden_states=x, timestep=t,
                  encoder_hidden_states=torch.randn(BATCH, text, 128, dtype=dtype),
                  encoder_hidden_states_mask=None,
                  img_shapes=[[(1, side // 2, side // 2)]] * BATCH)  # fmt: skip
    return kwargs, tokens, text


def _run(kind: str, layers: int, side: int, text: int, mode: str, gc: bool, dtype) -> dict:
    """Bytes saved after forward, backward's extra peak, and a no-grad forward's peak."""
    import torch

    build, family, targets = KINDS[kind]
    torch.manual_seed(0)
    model = build(layers).to(dtype)
    model.requires_grad_(mode == "full")
    if mode == "lora":
        from peft import LoraConfig

        model.add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    if gc:
        model.enable_gradient_checkpointing()
    model.train()
    kwargs, image_tokens, text_tokens = _inputs(family, model, side, text, dtype)
    fixed = [*model.parameters(), *model.buffers()]
    fixed += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    with live_bytes_mode(fixed) as mode_:
        out = model(**kwargs, return_dict=False)[0]
        saved = mode_.live
        mode_.reset_peak()
        out.float().square().mean().backward()
        grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                    if p.grad is not None)  # fmt: skip
        extra = mode_.peak - saved - grads
    del out
    model.eval()
    with torch.no_grad(), live_bytes_mode(fixed) as mode_:
        model(**kwargs, return_dict=False)
        work = mode_.peak
    return {"saved": saved, "extra": max(extra, 0), "work": work,
            "image_tokens": image_tokens * BATCH, "text_tokens": text_tokens * BATCH}  # fmt: skip


def block_constants(kind: str, mode: str, gc: bool, dtype) -> dict[str, float]:
    """Per (token x inner width x element size): saved per block for image and text tokens,
    the fixed part outside the blocks, backward's extra and the no-grad work."""
    import torch

    unit = INNER * torch.tensor([], dtype=dtype).element_size()
    side, text = 16, 32
    runs = {}
    for name, (s, t) in {"base": (side, text), "image": (side * 2, text),
                         "text": (side, text * 4)}.items():  # fmt: skip
        one = _run(kind, 1, s, t, mode, gc, dtype)
        three = _run(kind, 3, s, t, mode, gc, dtype)
        runs[name] = (one, three)

    def per_block(name: str) -> float:
        one, three = runs[name]
        return (three["saved"] - one["saved"]) / 2

    base, image, text_ = per_block("base"), per_block("image"), per_block("text")
    b_one = runs["base"][0]
    d_image = runs["image"][0]["image_tokens"] - b_one["image_tokens"]
    d_text = runs["text"][0]["text_tokens"] - b_one["text_tokens"]
    per_image = (image - base) / d_image / unit
    per_text = (text_ - base) / d_text / unit
    tokens = b_one["image_tokens"] + b_one["text_tokens"]
    outside = (b_one["saved"] - base) / tokens / unit
    three = runs["base"][1]
    return {
        "saved_image": round(per_image, 2),
        "saved_text": round(per_text, 2),
        "saved_outside": round(max(outside, 0.0), 2),
        "backward_extra": round(three["extra"] / tokens / unit, 2),
        "work": round(three["work"] / tokens / unit, 2),
    }


def vae_constant(family: str, dtype) -> float:
    """Peak bytes of a no-grad decode per output pixel / element size (real VAE widths)."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLQwenImage

    from flowgrpo_cli.planning.architectures import known_architectures

    torch.manual_seed(0)
    if family == "qwen":  # the published VAEs: the same configs `flowgrpo plan` counts
        vae = AutoencoderKLQwenImage.from_config(
            known_architectures()["qwen-image"]["configs"]["vae"]
        )
        z = torch.randn(1, 16, 1, 16, 16)
    else:
        vae = AutoencoderKL.from_config(known_architectures()["sd3.5-medium"]["configs"]["vae"])
        z = torch.randn(1, 16, 16, 16)
    vae = vae.to(dtype).eval()
    z = z.to(dtype)
    with torch.no_grad(), live_bytes_mode([*vae.parameters(), *vae.buffers(), z]) as mode:
        vae.decode(z, return_dict=False)
    pixels = (z.shape[-1] * 8) ** 2
    return round(mode.peak / pixels / torch.tensor([], dtype=dtype).element_size(), 1)


def clip_constant(dtype) -> float:
    """Peak of a no-grad CLIP vision forward per image token / (width x element size)."""
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=4,
        num_hidden_layers=3,
        image_size=224,
        patch_size=14,
    )
    model = CLIPVisionModelWithProjection(config).to(dtype).eval()
    pixels = torch.randn(4, 3, 224, 224, dtype=dtype)
    with torch.no_grad(), live_bytes_mode([*model.parameters(), *model.buffers(), pixels]) as m:
        model(pixel_values=pixels)
    tokens = 4 * ((224 // 14) ** 2 + 1)
    return round(m.peak / tokens / 256 / torch.tensor([], dtype=dtype).element_size(), 1)


def main() -> int:
    import torch
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the `.to(dtype)` casts warn on every model
    torch.set_num_threads(1)
    out: dict = {"blocks": {}, "vae": {}, "clip": {}}
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        for kind in KINDS:
            for mode in ("lora", "full"):
                for gc in (False, True):
                    key = f"{kind}/{mode}/{'gc' if gc else 'nogc'}/{dtype_name}"
                    out["blocks"][key] = block_constants(kind, mode, gc, dtype)
                    print(key, out["blocks"][key], file=sys.stderr, flush=True)
        for family in ("sd3", "qwen"):
            out["vae"][f"{family}/{dtype_name}"] = vae_constant(family, dtype)
        out["clip"][dtype_name] = clip_constant(dtype)
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
