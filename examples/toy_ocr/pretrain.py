"""Pre-train the toy OCR base model: a 3.6M-parameter StableDiffusion3Pipeline that draws text.

Everything is trained from scratch on the CPU, on 32x96 images of 3-4 symbols rendered black on
white with Pillow's built-in font (targets and prompts: toy_prompts.py):

1. VAE (AutoencoderKL, 4x down per side, 4 latent channels): L1 + MSE + a small KL on fresh
   renders. Its scaling and shift factors are then set from the latents of the pre-training
   set, encoded once (posterior means).
2. Transformer and the three text encoders jointly, with plain flow matching
   (x_t = (1 - t) x0 + t eps, target eps - x0, logit-normal t, timestep t * 1000), the
   conditioning through the pipeline's own encode_prompt, 10% blank prompts so CFG works, and
   an EMA of the weights for evaluation and saving.

Every --eval-every steps the EMA weights render the held-out prompts (20 Euler steps, CFG 4
and without CFG), RapidOCR reads them with the OCR reward's settings, and the pipeline is saved
as a checkpoint, so a run stopped at any time leaves usable models. --minutes counts training
time only (evaluation and saving excluded), so the budget means the same on a busy machine.

Run (about 5.5 min of VAE, 1.5 min of encoding, then --minutes of transformer training on 2
free cores; measured numbers in examples/toy_ocr/PRETRAINING.md):
    nice -n 19 python examples/toy_ocr/pretrain.py --out runs/toy-ocr-pretrain --minutes 45

--init-from FOLDER continues from an exported pipeline instead (the committed base, say): its
VAE and latent scaling are kept as they are, the transformer and text encoders train on with a
fresh optimizer and warm-up, and the EMA starts from the loaded weights.

Writes into --out: checkpoints/step-NNNNN/ (a diffusers pipeline folder with pretraining.json,
the evaluation and options that made it), model/ (the last one), eval.jsonl (one line per
evaluation). Load any of them with flowgrpo_cli.models.load_adapter or
StableDiffusion3Pipeline.from_pretrained; always pass height=32, width=96 and
max_sequence_length=32.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: on a shared machine, threads spinning for a busy core slow tiny
# ops down many times over (tests/conftest.py); passive waiting gives the core back.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import functools
import json
import random
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from toy_prompts import TEMPLATES, draw_targets, file_prompts, prompt_for

HEIGHT, WIDTH = 32, 96
MAX_TOKENS = 32  # both tokenizers; pass max_sequence_length=32 to the pipeline
FONT_SIZE = 24
SHIFT_X, SHIFT_Y = 3, 2  # random placement around the centre, in pixels
BLANK_PROMPT_RATE = 0.1
EVAL_STEPS = 20
EVAL_GUIDANCE = (4.0, 1.0)


@dataclass(frozen=True)
class Options:
    out: Path
    minutes: float = 45.0
    max_steps: int = 0
    vae_steps: int = 300
    seed: int = 0
    eval_every: int = 250
    num_train: int = 20_000
    eval_prompts: int = 100
    batch_size: int = 64
    vae_batch_size: int = 32
    vae_lr: float = 1e-3
    lr: float = 5e-4
    warmup_steps: int = 200
    ema_decay: float = 0.998
    threads: int = 0
    resume: bool = False
    init_from: Path | None = None


# Options that change what is trained; a resumed run must keep them.
RESULT_OPTIONS = (
    "seed",
    "vae_steps",
    "num_train",
    "batch_size",
    "vae_batch_size",
    "vae_lr",
    "lr",
    "warmup_steps",
    "ema_decay",
    "init_from",
)


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Run folder (created).")
    parser.add_argument(
        "--minutes", type=float, default=45.0, help="Training time budget of the transformer phase."
    )
    parser.add_argument(
        "--max-steps", type=int, default=0, help="Stop after this many steps; 0 = no limit."
    )
    parser.add_argument("--vae-steps", type=int, default=300, help="VAE training steps.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of weights, noise and renders.")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=250,
        help="Steps between held-out evaluations and checkpoints; 0 = only at the end.",
    )
    parser.add_argument(
        "--num-train", type=int, default=20_000, help="Pre-training targets (latents encoded)."
    )
    parser.add_argument("--eval-prompts", type=int, default=100, help="Held-out prompts scored.")
    parser.add_argument("--batch-size", type=int, default=64, help="Transformer batch size.")
    parser.add_argument("--vae-batch-size", type=int, default=32, help="VAE batch size.")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default.")
    parser.add_argument(
        "--init-from",
        type=Path,
        help="Continue pre-training an exported pipeline folder (the committed base): its VAE "
        "and scaling factors are kept (no VAE training), the transformer and text encoders "
        "train on with a fresh optimizer and warm-up.",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Continue the run in --out from its last checkpoint (raise --minutes or "
        "--max-steps to train further); the VAE and latents are reused.",
    )
    args = parser.parse_args(argv)
    return Options(
        out=args.out,
        minutes=args.minutes,
        max_steps=args.max_steps,
        vae_steps=args.vae_steps,
        seed=args.seed,
        eval_every=args.eval_every,
        num_train=args.num_train,
        eval_prompts=args.eval_prompts,
        batch_size=args.batch_size,
        vae_batch_size=args.vae_batch_size,
        threads=args.threads,
        resume=args.resume,
        init_from=args.init_from,
    )


# ---------------------------------------------------------------------------------------------
# Data


@functools.cache
def _font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=FONT_SIZE)


def placement(text: str, rng: random.Random) -> tuple[int, int]:
    """Where render() draws `text`: centred, shifted at random, never cropping ink."""
    left, top, right, bottom = _font().getbbox(text)
    x = (WIDTH - (right - left)) // 2 - left + rng.randint(-SHIFT_X, SHIFT_X)
    y = (HEIGHT - (bottom - top)) // 2 - top + rng.randint(-SHIFT_Y, SHIFT_Y)
    return min(max(x, -left), WIDTH - right), min(max(y, -top), HEIGHT - bottom)


def render(text: str, rng: random.Random) -> Image.Image:
    """Black text on white at 32x96."""
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    ImageDraw.Draw(image).text(placement(text, rng), text, fill="black", font=_font())
    return image


def to_tensor(images: Sequence[Image.Image]) -> torch.Tensor:
    """PIL images -> float32 [B, 3, H, W] in [-1, 1], the VAE's input range."""
    pixels = np.stack([np.asarray(image, dtype=np.float32) for image in images])
    return torch.from_numpy(pixels).permute(0, 3, 1, 2) / 127.5 - 1.0


# ---------------------------------------------------------------------------------------------
# The pipeline: components built from configs, tokenizers from in-memory vocabularies


# Character-level tokenizers, no merges: printable ASCII only for CLIP (95 characters, not the
# tiny models' 256 byte characters), 32 tokens for both.
_ASCII = [chr(code) for code in range(ord("!"), ord("~") + 1)]


def build_pipeline(seed: int):
    """A freshly initialised pipeline; the scaling factors are set after the VAE is trained."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowgrpo_cli.models.tiny import char_clip_tokenizer, char_t5_tokenizer

    clip_tokenizer = char_clip_tokenizer(_ASCII, MAX_TOKENS)
    t5_tokenizer = char_t5_tokenizer()
    clip_config = CLIPTextConfig(
        vocab_size=len(clip_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_TOKENS,
        projection_dim=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    t5_config = T5Config(
        vocab_size=len(t5_tokenizer),
        d_model=128,  # = the two CLIP widths side by side, so no padding of their embeddings
        d_kv=32,
        d_ff=256,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=8,
        relative_attention_max_distance=MAX_TOKENS,
        dropout_rate=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D"] * 3,
            up_block_types=["UpDecoderBlock2D"] * 3,
            block_out_channels=[32, 64, 64],  # 3 levels: 4x down per side, latents 4x8x24
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=32,
            mid_block_add_attention=False,
            sample_size=HEIGHT,
        )
        transformer = SD3Transformer2DModel(
            sample_size=HEIGHT // 4,
            patch_size=2,  # 4 x 12 = 48 image tokens
            in_channels=4,
            out_channels=4,
            num_layers=4,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=128,
            caption_projection_dim=128,
            pooled_projection_dim=64,  # the two CLIP projections (32 each)
            pos_embed_max_size=16,
            qk_norm="rms_norm",
        )
        text_encoders = [CLIPTextModelWithProjection(clip_config) for _ in range(2)]
        t5 = T5EncoderModel(t5_config)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=text_encoders[0],
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoders[1],
        tokenizer_2=char_clip_tokenizer(_ASCII, MAX_TOKENS),
        text_encoder_3=t5,
        tokenizer_3=t5_tokenizer,
    )


def check_prompt_lengths(pipeline) -> None:
    """Every template with the longest target must fit the 32 tokens of both tokenizers."""
    longest = "W" * 4
    for template in range(len(TEMPLATES)):
        prompt = prompt_for(longest, template)
        for tokenizer in (pipeline.tokenizer, pipeline.tokenizer_3):
            count = len(tokenizer(prompt).input_ids)
            if count > MAX_TOKENS:
                raise ValueError(f"{prompt!r} takes {count} tokens; at most {MAX_TOKENS} fit")


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------
# Evaluation: render held-out prompts, read them back with the OCR reward's engine


@dataclass(frozen=True)
class Read:
    """One rendered image read back: what OCR saw, its reward, and whether it is exact."""

    text: str
    reward: float
    exact: bool


@torch.no_grad()
def render_and_read(
    pipeline, prompts: list[str], targets: list[str], *, guidance_scale: float, seeds: list[int]
) -> list[Read]:
    """One image per prompt (Euler, EVAL_STEPS, noise from seeds[i]), read by the engine and
    scored exactly as the `ocr` reward scores it."""
    from flowgrpo_cli.rewards.ocr import normalize, ocr_score, read_text

    images = []
    for start in range(0, len(prompts), 50):
        batch = prompts[start : start + 50]
        generators = [torch.Generator().manual_seed(s) for s in seeds[start : start + 50]]
        images += pipeline(
            prompt=batch,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=EVAL_STEPS,
            guidance_scale=guidance_scale,
            max_sequence_length=MAX_TOKENS,
            generator=generators,
        ).images
    reads = []
    for image, target in zip(images, targets, strict=True):
        text = read_text(image).text or ""
        exact = normalize(text) == normalize(target)
        reads.append(Read(text=text, reward=ocr_score(text, target), exact=exact))
    return reads


def evaluate(
    pipeline, prompts: list[str], targets: list[str], *, guidance_scale: float, seed: int
) -> dict[str, float]:
    """Exact-match rate and mean OCR reward of one image per prompt, the noise of prompt i
    drawn from seed + i."""
    seeds = [seed + i for i in range(len(prompts))]
    reads = render_and_read(pipeline, prompts, targets, guidance_scale=guidance_scale, seeds=seeds)
    return {
        "exact": sum(r.exact for r in reads) / len(reads),
        "reward": sum(r.reward for r in reads) / len(reads),
    }


# ---------------------------------------------------------------------------------------------
# The recipe


class Pretrainer:
    def __init__(self, options: Options) -> None:
        if options.num_train < options.batch_size:
            raise ValueError(f"--num-train {options.num_train} < --batch-size")
        if not 0 < options.eval_prompts <= 100:
            raise ValueError("--eval-prompts must be in 1..100 (the held-out set)")
        if options.init_from and not (options.init_from / "model_index.json").is_file():
            raise SystemExit(f"--init-from {options.init_from}: not a pipeline folder")
        self.options = options
        self.out = options.out
        self.rng = random.Random(options.seed)  # renders, templates, blank prompts
        self.generator = torch.Generator().manual_seed(options.seed)  # batches, t, noise
        test, train = draw_targets(n_train=options.num_train)
        self.train_targets = train
        self.eval_targets = test[: options.eval_prompts]
        self.eval_prompts = file_prompts(test)[: options.eval_prompts]
        self.prepared_path = self.out / "prepared.pt"  # trained VAE and encoded latents
        self.state_path = self.out / "state.pt"  # training progress at the last checkpoint
        self._check_out_folder()
        self.start = time.monotonic()

    def _check_out_folder(self) -> None:
        """A fresh run needs an empty --out; a resumed one the same results-changing options."""
        options = self.options
        saved = [p for p in (self.prepared_path, self.state_path) if p.exists()]
        if not options.resume:
            if saved or (self.out / "checkpoints").exists():
                raise SystemExit(
                    f"{self.out} holds a run already: pass --resume to continue it, or choose "
                    "another --out"
                )
            return
        if not saved:
            return  # nothing to resume: start from the beginning
        stored = torch.load(saved[0], weights_only=True)["options"]
        now = self._result_options()
        changed = [
            f"--{name.replace('_', '-')}: {stored.get(name)} in the run, {now[name]} now"
            for name in RESULT_OPTIONS
            if stored.get(name) != now[name]
        ]
        if changed:
            listed = "\n  ".join(changed)
            raise SystemExit(f"{self.out} was trained with other options:\n  {listed}")

    def _result_options(self) -> dict[str, float | int | str | None]:
        values = {name: getattr(self.options, name) for name in RESULT_OPTIONS}
        return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}

    def log(self, message: str) -> None:
        elapsed = (time.monotonic() - self.start) / 60
        print(f"[{elapsed:6.1f} min] {message}", flush=True)

    def setup(self) -> None:
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        for library in (diffusers_logging, transformers_logging):
            library.set_verbosity_error()
        if self.options.threads:
            torch.set_num_threads(self.options.threads)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.options.init_from:
            from diffusers import StableDiffusion3Pipeline

            self.pipeline = StableDiffusion3Pipeline.from_pretrained(
                self.options.init_from, dtype=torch.float32
            )
            self.log(f"continuing the pre-training of {self.options.init_from}")
        else:
            self.pipeline = build_pipeline(self.options.seed)
        self.pipeline.set_progress_bar_config(disable=True)
        check_prompt_lengths(self.pipeline)
        counts = {
            name: parameter_count(getattr(self.pipeline, name))
            for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "transformer")
        }
        self.log(f"parameters: {counts}, total {sum(counts.values()) / 1e6:.3f}M")

    def train_vae(self) -> None:
        options, vae = self.options, self.pipeline.vae
        optimizer = torch.optim.AdamW(vae.parameters(), lr=options.vae_lr)
        for step in range(1, options.vae_steps + 1):
            texts = self.rng.choices(self.train_targets, k=options.vae_batch_size)
            x = to_tensor([render(text, self.rng) for text in texts])  # [B, 3, 32, 96]
            posterior = vae.encode(x).latent_dist
            recon = vae.decode(posterior.sample(generator=self.generator)).sample
            kl = posterior.kl().mean()  # summed over the 768 latent dims, mean over the batch
            loss = F.l1_loss(recon, x) + F.mse_loss(recon, x) + 1e-6 * kl
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            optimizer.step()
            if step % 50 == 0 or step == options.vae_steps:
                self.log(f"vae step {step}: loss {loss.item():.4f} kl {kl.item():.1f}")
        vae.requires_grad_(False)
        vae.eval()
        self._check_vae()

    @torch.no_grad()
    def _check_vae(self) -> None:
        """How many held-out renders OCR still reads after a VAE round trip."""
        from flowgrpo_cli.rewards.ocr import normalize, read_text

        vae = self.pipeline.vae
        rng = random.Random(-1)
        x = to_tensor([render(text, rng) for text in self.eval_targets])
        recon = vae.decode(vae.encode(x).latent_dist.mode()).sample
        images = self.pipeline.image_processor.postprocess(recon, output_type="pil")
        reads = [normalize(read_text(image).text or "") for image in images]
        correct = sum(r == t.lower() for r, t in zip(reads, self.eval_targets, strict=True))
        self.log(f"vae: OCR reads {correct}/{len(reads)} held-out reconstructions exactly")

    def prepare(self) -> None:
        """Train the VAE and encode the latents, or load both from an earlier run of --out."""
        if self.prepared_path.exists():
            prepared = torch.load(self.prepared_path, weights_only=True)
            vae = self.pipeline.vae
            vae.load_state_dict(prepared["vae"])
            vae.register_to_config(
                scaling_factor=prepared["scaling_factor"], shift_factor=prepared["shift_factor"]
            )
            vae.requires_grad_(False)
            vae.eval()
            self.latents = prepared["latents"]
            self.rng.setstate(_rng_state(prepared["rng"]))
            self.generator.set_state(prepared["generator"])
            self.log(f"loaded the VAE and {len(self.latents)} latents from {self.prepared_path}")
            return
        vae = self.pipeline.vae
        if self.options.init_from:  # trained already: keep it and the factors it was scaled with
            vae.requires_grad_(False)
            vae.eval()
            self._check_vae()
        else:
            self.train_vae()
        self.encode_latents(set_factors=not self.options.init_from)
        _atomic_save(
            {
                "options": self._result_options(),
                "vae": vae.state_dict(),
                "scaling_factor": vae.config.scaling_factor,
                "shift_factor": vae.config.shift_factor,
                "latents": self.latents,
                "rng": list(self.rng.getstate()),
                "generator": self.generator.get_state(),
            },
            self.prepared_path,
        )

    @torch.no_grad()
    def encode_latents(self, *, set_factors: bool) -> None:
        """Scaled latents [N, 4, 8, 24] of one render per pre-training target; set_factors
        first sets the VAE's scaling and shift factors from their statistics."""
        vae = self.pipeline.vae
        means = []
        for start in range(0, len(self.train_targets), 256):
            texts = self.train_targets[start : start + 256]
            x = to_tensor([render(text, self.rng) for text in texts])
            means.append(vae.encode(x).latent_dist.mode())
        latents = torch.cat(means)
        if set_factors:
            shift = latents.mean().item()
            scale = 1.0 / (latents - shift).std().item()
            vae.register_to_config(scaling_factor=scale, shift_factor=shift)
        scale, shift = vae.config.scaling_factor, vae.config.shift_factor
        self.latents = (latents - shift) * scale
        self.log(f"encoded {len(latents)} latents: scaling_factor {scale:.4f}, shift {shift:.4f}")

    def setup_training(self) -> None:
        pipeline = self.pipeline
        self.modules = [
            pipeline.transformer,
            pipeline.text_encoder,
            pipeline.text_encoder_2,
            pipeline.text_encoder_3,
        ]
        self.params = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.options.lr, betas=(0.9, 0.99), weight_decay=0.01
        )
        warmup = self.options.warmup_steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        self.ema = [p.detach().clone() for p in self.params]
        self.step = 0
        self.train_seconds = 0.0
        if self.options.resume and self.state_path.exists():
            self._load_state()

    def _save_state(self) -> None:
        """Everything training needs to go on exactly as if it had not stopped."""
        _atomic_save(
            {
                "options": self._result_options(),
                "step": self.step,
                "train_seconds": self.train_seconds,
                "params": [p.detach() for p in self.params],
                "ema": self.ema,
                "optimizer": self.optimizer.state_dict(),
                "lr_schedule": self.lr_schedule.state_dict(),
                "rng": list(self.rng.getstate()),
                "generator": self.generator.get_state(),
            },
            self.state_path,
        )

    def _load_state(self) -> None:
        state = torch.load(self.state_path, weights_only=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, state["params"])
            torch._foreach_copy_(self.ema, state["ema"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.rng.setstate(_rng_state(state["rng"]))
        self.generator.set_state(state["generator"])
        self.step, self.train_seconds = state["step"], state["train_seconds"]
        self.log(f"resumed at step {self.step} ({self.train_seconds / 60:.1f} min trained)")

    def train_step(self) -> float:
        options, pipeline = self.options, self.pipeline
        batch = options.batch_size
        idx = torch.randint(len(self.latents), (batch,), generator=self.generator)
        prompts = [
            ""
            if self.rng.random() < BLANK_PROMPT_RATE
            else prompt_for(self.train_targets[i], self.rng.randrange(len(TEMPLATES)))
            for i in idx.tolist()
        ]
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            max_sequence_length=MAX_TOKENS,
        )  # [B, 64, 128] (32 CLIP + 32 T5 tokens), [B, 64]
        x0 = self.latents[idx]  # [B, 4, 8, 24]
        t = torch.sigmoid(torch.randn(batch, generator=self.generator))  # logit-normal, [B]
        noise = torch.randn(x0.shape, generator=self.generator)
        t_ = t.view(batch, 1, 1, 1)
        x_t = (1 - t_) * x0 + t_ * noise
        velocity = pipeline.transformer(
            hidden_states=x_t,
            timestep=t * 1000,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = F.mse_loss(velocity, noise - x0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.lr_schedule.step()
        self.step += 1
        # EMA with the usual warm-up, so early checkpoints are not dominated by the init.
        decay = min(options.ema_decay, (1 + self.step) / (10 + self.step))
        with torch.no_grad():
            torch._foreach_lerp_(self.ema, [p.detach() for p in self.params], 1 - decay)
        return loss.item()

    @contextlib.contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA weights in the pipeline for the duration; the trained ones restored after."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            torch._foreach_copy_(self.params, self.ema)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, trained)

    def checkpoint(self) -> Path:
        """Evaluate and save the EMA weights; returns the checkpoint folder."""
        metrics: dict[str, float] = {}
        with self.ema_weights():
            for guidance in EVAL_GUIDANCE:
                result = evaluate(
                    self.pipeline,
                    self.eval_prompts,
                    self.eval_targets,
                    guidance_scale=guidance,
                    seed=10_000,
                )
                metrics |= {f"{key}_cfg{guidance:g}": value for key, value in result.items()}
            folder = self.out / "checkpoints" / f"step-{self.step:05d}"
            self.pipeline.save_pretrained(folder, safe_serialization=True)
        record = {
            "step": self.step,
            "train_minutes": round(self.train_seconds / 60, 2),
            "wall_minutes": round((time.monotonic() - self.start) / 60, 2),
            **{key: round(value, 4) for key, value in metrics.items()},
        }
        info = {**record, "options": {k: str(v) for k, v in asdict(self.options).items()}}
        (folder / "pretraining.json").write_text(json.dumps(info, indent=2) + "\n")
        with (self.out / "eval.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._save_state()
        self.log("eval " + " ".join(f"{k}={v}" for k, v in record.items()))
        return folder

    def train(self) -> None:
        options = self.options
        budget = options.minutes * 60
        losses: list[float] = []
        last = None
        while self.train_seconds < budget and not (0 < options.max_steps <= self.step):
            began = time.monotonic()
            losses.append(self.train_step())
            self.train_seconds += time.monotonic() - began
            if self.step % 50 == 0:
                rate = self.step / self.train_seconds
                self.log(
                    f"step {self.step}: loss {sum(losses) / len(losses):.4f} "
                    f"({rate:.2f} steps/s, {self.train_seconds / 60:.1f} min trained)"
                )
                losses = []
            if options.eval_every and self.step % options.eval_every == 0:
                last = self.checkpoint()
        if last is None or not last.name.endswith(f"{self.step:05d}"):
            last = self.out / "checkpoints" / f"step-{self.step:05d}"
            if not last.exists():  # a resumed run with nothing left to train has it already
                last = self.checkpoint()
        final = self.out / "model"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(last, final)
        self.log(f"done: {self.step} steps in {self.train_seconds / 60:.1f} min; saved {final}")

    def run(self) -> None:
        self.setup()
        self.prepare()
        self.setup_training()
        self.train()


def _rng_state(saved: list) -> tuple:
    """random.Random state from its saved form (tuples become lists through torch.save)."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def _atomic_save(obj: object, path: Path) -> None:
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    partial.replace(path)


def main(argv: Sequence[str] | None = None) -> None:
    Pretrainer(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
