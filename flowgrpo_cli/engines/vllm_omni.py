"""The vllm-omni rollout engine: Flow-GRPO trajectories sampled by vllm-omni's Qwen-Image runtime.

`VllmOmniEngine` is a RolloutEngine (flowgrpo_cli.engines.base) like DiffusersEngine; the rollout
stage cannot tell them apart. What runs where:

- Text conditioning is encoded in this process by the policy's own adapter, exactly as the
  diffusers engine encodes it: the rollout stores it per group and the update recomputes
  log-probs from it, so it must be our adapter's, not a second encoder's.
- Denoising runs inside vllm-omni, in `FlowGrpoQwenImagePipeline`, a subclass of vllm-omni's
  QwenImagePipeline loaded as its custom pipeline. Its forward runs flowgrpo's own sampler,
  `sampling.sample_batch`, through our `QwenImageAdapter` (initial noise, packing, timestep
  cast, true CFG, decode) put over vllm-omni's modules: the step math (`sde.STEP_FUNCTIONS`,
  and DPM-Solver++ where `sampler.ode_solver` / `post_window_solver` choose it),
  the step schedule, CFG and per-sample seeding are the very code the diffusers engine runs.
  The sigmas are this process's adapter's (`RolloutEngine.sigmas`, sampler.shift included),
  sent with the job; a request's initial-noise seed (sampler.same_noise_per_group) travels
  beside its seed.
  Only the modules are vllm-omni's: its transformer (fused projections, attention backends,
  LoRA layers, parallelism) and its VAE.
- Per request (one image), the pipeline returns the T + 1 latents, T log-probs and the sigmas
  of the stochastic steps as vllm-omni's trajectory outputs, and the image.
- The policy's LoRA weights reach vllm-omni through its LoRA request path: whenever the
  policy's version differs from the adapter last exported, its LoRA tensors are written as a
  PEFT adapter folder and sent with a new adapter id; every request carries the adapter of
  the version recorded in the manifest, and the pipeline reports the adapter of the requests
  it ran, which is checked, so a rollout cannot silently use stale weights.

vllm-omni pins its own diffusers and transformers, so it lives in its own environment
(`just setup-vllm`). This module imports vllm-omni only when an engine is built.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch

from flowgrpo_cli.algorithm.schedule import StepSchedule
from flowgrpo_cli.engines.base import GroupConditioning, RolloutEngine, SampleRequest
from flowgrpo_cli.engines.sampling import SampledBatch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models import Conditioning
from flowgrpo_cli.store.contract import SamplerSettings
from flowgrpo_cli.training.policy import Policy

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

#: The pipeline class vllm-omni loads (`custom_pipeline_args`), resolved via `__getattr__`.
PIPELINE_CLASS = f"{__name__}.FlowGrpoQwenImagePipeline"
#: Key of flowgrpo's job in the sampling params' `extra_args`, and of its per-sample data in
#: each prompt; requests without it (vllm-omni's warm-up) run the stock pipeline.
JOB_KEY = "flowgrpo"
#: Extra arguments for `vllm_omni.Omni(...)` as a JSON object (e.g. parallelism settings).
OMNI_KWARGS_ENV = "FLOWGRPO_VLLM_OMNI_KWARGS"
INSTALL_HINT = (
    "the vllm-omni engine needs vllm-omni, which pins its own diffusers and transformers and "
    "so lives in its own environment: run `just setup-vllm` (it creates .venv-vllm with torch "
    "2.13, vllm 0.30 and vllm-omni 0.30 and installs flowgrpo there), then run flowgrpo from "
    "it: .venv-vllm/bin/flowgrpo rollout ... --set sampler.engine=vllm-omni"
)
_CONDITIONING_KEYS = (
    "prompt_embeds",
    "prompt_embeds_mask",
    "negative_prompt_embeds",
    "negative_prompt_embeds_mask",
)


#: The vllm-omni release the custom pipeline is written against (its forward(req) signature,
#: DiffusionOutput's trajectory fields, the LoRA request path).
TESTED_VLLM_OMNI = "0.30"


def require_vllm_omni() -> None:
    """Raise FlowGrpoError with the install instructions when vllm-omni cannot be imported."""
    try:
        import vllm_omni
    except ImportError as err:
        raise FlowGrpoError(f"{INSTALL_HINT} ({err})") from None
    found = getattr(vllm_omni, "__version__", "")
    if not found.startswith(TESTED_VLLM_OMNI + "."):
        warnings.warn(
            f"vllm-omni {found} is installed; flowgrpo's engine is tested with "
            f"{TESTED_VLLM_OMNI}.x (`just setup-vllm` installs it)",
            stacklevel=2,
        )


@dataclass(frozen=True)
class _ExportedAdapter:
    version: str  # the policy version the weights were exported at
    name: str  # the LoRA request's name: unique per export
    request: Any  # vllm LoRARequest


class VllmOmniEngine(RolloutEngine):
    """Samples with vllm-omni; encodes text and tracks weights with the in-process policy.

    `omni_kwargs` go to `vllm_omni.Omni` (after those of $FLOWGRPO_VLLM_OMNI_KWARGS). vllm-omni
    starts on the first `sample` call, with `max_num_seqs` = that batch's size unless given,
    so a sampler batch is one forward batch, as in the diffusers engine.
    """

    def __init__(
        self,
        policy: Policy,
        *,
        max_sequence_length: int,
        merge_lora: bool = False,
        omni_kwargs: dict[str, Any] | None = None,
    ):
        require_vllm_omni()
        if merge_lora:
            raise FlowGrpoError(
                "sampler.merge_lora applies to sampler.engine = 'diffusers'; vllm-omni receives "
                "the LoRA weights through its own LoRA path: leave merge_lora off"
            )
        if policy.adapter.family != "qwenimage":
            raise FlowGrpoError(
                f"sampler.engine = 'vllm-omni' samples Qwen-Image pipelines only; this model is "
                f"{policy.adapter.family}: use sampler.engine = 'diffusers'"
            )
        if policy.mode != "lora":
            raise FlowGrpoError(
                "sampler.engine = 'vllm-omni' passes the policy's weights to vllm-omni as a LoRA "
                f"adapter; train.mode = {policy.mode!r} is not supported: use train.mode = "
                "'lora' or sampler.engine = 'diffusers'"
            )
        # Text conditioning is the policy adapter's (RolloutEngine.encode), exactly as the
        # diffusers engine makes it.
        super().__init__(policy, max_sequence_length=max_sequence_length)
        self._omni_kwargs = {**_env_omni_kwargs(), **(omni_kwargs or {})}
        self._omni: Any = None
        self._adapter: _ExportedAdapter | None = None
        self._exports = 0
        self._lora_root = Path(tempfile.mkdtemp(prefix="flowgrpo-vllm-lora-"))
        weakref.finalize(self, shutil.rmtree, self._lora_root, True)

    check_available = staticmethod(require_vllm_omni)  # engine_class() calls it when chosen

    def sample(
        self, requests: list[SampleRequest], encoded: GroupConditioning, settings: SamplerSettings
    ) -> SampledBatch:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        omni = self._start(batch_size=len(requests))
        adapter = self._current_adapter()
        job = sampler_job(settings, self.sigmas(settings))
        params = OmniDiffusionSamplingParams(
            height=settings.height,
            width=settings.width,
            num_inference_steps=settings.schedule.num_steps,
            lora_request=adapter.request,
            extra_args={JOB_KEY: job},
        )
        prompts = []
        for request in requests:
            cond = encoded[request.group_id]  # [1, L, D] per tensor
            prompt: dict[str, object] = {"prompt": request.prompt}
            prompt |= {k: cond[k].cpu() for k in _CONDITIONING_KEYS if k in cond}
            job_of_prompt: dict[str, object] = {
                "sample_id": request.sample_id,
                "seed": request.seed,
            }
            if request.noise_seed is not None:  # sampler.same_noise_per_group
                job_of_prompt["noise_seed"] = request.noise_seed
            prompt[JOB_KEY] = job_of_prompt
            prompts.append(prompt)
        outputs = omni.generate(prompts, params, use_tqdm=False)
        by_id = {_metadata_of(out).get("sample_id"): out for out in outputs}
        missing = [r.sample_id for r in requests if r.sample_id not in by_id]
        if missing:
            raise RuntimeError(f"vllm-omni returned no output for samples {missing[:3]}")
        rows = [by_id[r.sample_id] for r in requests]
        used = {_metadata_of(out).get("adapter") for out in rows}
        if used != {adapter.name}:
            raise RuntimeError(
                f"vllm-omni sampled with LoRA adapter(s) {sorted(map(str, used))}, but the policy "
                f"is at {adapter.name!r}: refusing a rollout with stale weights"
            )
        return _sampled_batch(rows)

    def close(self) -> None:
        """Shut vllm-omni down and delete the exported adapters."""
        if self._omni is not None:
            self._omni.close()
            self._omni = None
        shutil.rmtree(self._lora_root, ignore_errors=True)

    # -- internals ---------------------------------------------------------------------------

    def _start(self, *, batch_size: int) -> Any:
        if self._omni is not None:
            return self._omni
        from vllm_omni.entrypoints.omni import Omni

        pipeline = self.policy.adapter.pipeline
        model = getattr(pipeline, "name_or_path", None) or pipeline.config.get("_name_or_path")
        if not model:
            raise FlowGrpoError("the policy's pipeline does not say where it was loaded from")
        dtype = str(self.policy.transformer.dtype).removeprefix("torch.")
        kwargs = {
            "dtype": dtype,
            # One forward per sampler batch: admit up to batch_size requests together, and
            # wait briefly for all of them (else the first request runs alone, then the rest).
            "max_num_seqs": batch_size,
            "request_batch_max_wait_ms": 50.0,
            **self._omni_kwargs,
            "custom_pipeline_args": {"pipeline_class": PIPELINE_CLASS},
        }
        self._omni = Omni(model=str(model), **kwargs)
        return self._omni

    def _current_adapter(self) -> _ExportedAdapter:
        """The LoRA request of the policy's current weights, exported when its version moved."""
        version = self.policy.version
        if self._adapter is None or self._adapter.version != version:
            self._adapter = self._export(version)
        return self._adapter

    def _export(self, version: str) -> _ExportedAdapter:
        from vllm.lora.request import LoRARequest

        self._exports += 1
        name = f"{version}#{self._exports}"
        folder = self._lora_root / f"{self._exports:05d}-{re.sub(r'[^A-Za-z0-9._-]', '_', version)}"
        write_peft_adapter(self.policy.transformer, folder)
        if self._adapter is not None:  # vllm-omni keeps its own copy once loaded
            shutil.rmtree(Path(self._adapter.request.lora_path), ignore_errors=True)
        request = LoRARequest(lora_name=name, lora_int_id=self._exports, lora_path=str(folder))
        return _ExportedAdapter(version=version, name=name, request=request)


def write_peft_adapter(transformer: ModelMixin, folder: Path) -> None:
    """The transformer's LoRA adapter as a PEFT folder that vllm-omni's LoRA manager loads.

    Module names follow vllm-omni's Qwen-Image transformer: diffusers' `attn.to_out.0` is its
    `attn.to_out`; `to_q/to_k/to_v` and `add_q/k/v_proj` are found by its packed-module
    mapping onto the fused `to_qkv` and `add_kv_proj`.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = transformer.peft_config["default"]
    state = get_peft_model_state_dict(transformer)
    tensors = {}
    for key, value in state.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2 shards
        name = "base_model.model." + _omni_module_name(key)
        tensors[name] = value.detach().to("cpu", torch.float32).contiguous()
    targets = sorted({_omni_module_name(t) for t in config.target_modules})
    adapter_config = {
        "peft_type": "LORA",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "target_modules": targets,
        "bias": "none",
        "use_rslora": bool(config.use_rslora),
        "use_dora": bool(getattr(config, "use_dora", False)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))


def _omni_module_name(name: str) -> str:
    return re.sub(r"(^|\.)to_out\.0(\.|$)", r"\1to_out\2", name)


def _env_omni_kwargs() -> dict[str, Any]:
    raw = os.environ.get(OMNI_KWARGS_ENV)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise FlowGrpoError(f"${OMNI_KWARGS_ENV} is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise FlowGrpoError(f"${OMNI_KWARGS_ENV} must be a JSON object of Omni(...) arguments")
    return value


def sampler_job(settings: SamplerSettings, sigmas: torch.Tensor) -> dict[str, Any]:
    """The sampler settings and sigmas as the JSON-able job a request carries to the pipeline
    (the size travels in the sampling params); `job_settings` reads it back."""
    return {
        "kind": settings.kind,
        "noise_level": settings.noise_level,
        "guidance_scale": settings.guidance_scale,
        "stochastic": list(settings.schedule.stochastic),
        "trained": list(settings.schedule.trained),
        "sigmas": [float(s) for s in sigmas],
        "post_window_solver": settings.post_window_solver,
        "post_window_compress": settings.post_window_compress,
        "ode_solver": settings.ode_solver,
        # The sigmas above already carry sampler.shift; the pipeline's settings record it.
        "shift": settings.shift,
        "same_noise_per_group": settings.same_noise_per_group,
    }


def job_settings(job: dict[str, Any], *, height: int, width: int) -> SamplerSettings:
    """The SamplerSettings a `sampler_job` carries, in the pipeline vllm-omni runs."""
    return SamplerSettings(
        kind=job["kind"],
        noise_level=job["noise_level"],
        guidance_scale=job["guidance_scale"],
        height=height,
        width=width,
        schedule=StepSchedule(
            num_steps=len(job["stochastic"]),
            stochastic=tuple(job["stochastic"]),
            trained=tuple(job["trained"]),
        ),
        post_window_solver=job["post_window_solver"],
        post_window_compress=job["post_window_compress"],
        ode_solver=job["ode_solver"],
        shift=job["shift"],
        same_noise_per_group=job["same_noise_per_group"],
    )


def _metadata_of(output: Any) -> dict[str, Any]:
    return (getattr(output, "multimodal_output", None) or {}).get("metadata") or {}


def _sampled_batch(outputs: list[Any]) -> SampledBatch:
    """Per-request trajectory outputs -> one SampledBatch (rows in request order)."""
    import numpy as np

    latents = torch.stack([out.trajectory_latents for out in outputs])  # [B, T+1, C, h, w]
    log_probs = torch.stack([out.trajectory_log_probs for out in outputs])  # [B, T]
    sigmas = torch.stack([out.trajectory_timesteps for out in outputs])  # [B, 2, T]
    images = torch.stack(
        [
            torch.from_numpy(np.array(out.trajectory_decoded[0].convert("RGB"))).permute(2, 0, 1)
            for out in outputs
        ]
    )  # [B, 3, H, W] uint8
    return SampledBatch(
        latents=latents.float(),
        log_probs=log_probs.float(),
        timesteps=sigmas[:, 0].float(),
        timesteps_next=sigmas[:, 1].float(),
        images=images.float() / 255.0,
        final_latents=latents[:, -1].float(),  # every step is stochastic: the last state
    )


# -- the pipeline vllm-omni runs ------------------------------------------------------------


class _TransformerView:
    """vllm-omni's Qwen-Image transformer behind the call diffusers' transformer takes.

    QwenImageAdapter.velocity calls ``transformer(hidden_states=..., timestep=...,
    encoder_hidden_states=..., encoder_hidden_states_mask=..., img_shapes=...,
    return_dict=False)`` and reads ``.dtype`` and ``.config.in_channels``; vllm-omni's module
    also wants the text lengths for its RoPE table (the padded width, as diffusers uses).
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.module = module
        self.dtype = dtype
        self.config = SimpleNamespace(in_channels=module.in_channels)

    def __call__(self, *, encoder_hidden_states: torch.Tensor, **kwargs: Any) -> Any:
        from vllm_omni.diffusion.models.qwen_image.rope_utils import txt_seq_lens_from_embeds

        return self.module(
            encoder_hidden_states=encoder_hidden_states,
            txt_seq_lens=txt_seq_lens_from_embeds(encoder_hidden_states),
            **kwargs,
        )


def _adapter_over(pipeline: Any) -> Any:
    """Our QwenImageAdapter over a vllm-omni pipeline's modules (what it reads of a pipeline)."""
    from diffusers.image_processor import VaeImageProcessor

    from flowgrpo_cli.models.qwenimage import QwenImageAdapter

    view = SimpleNamespace(
        transformer=_TransformerView(pipeline.transformer, pipeline.od_config.dtype),
        scheduler=pipeline.scheduler,
        vae=pipeline.vae,
        vae_scale_factor=pipeline.vae_scale_factor,
        device=pipeline.device,
        image_processor=VaeImageProcessor(vae_scale_factor=pipeline.vae_scale_factor * 2),
    )
    # cast: the view holds what QwenImageAdapter reads of a diffusers QwenImagePipeline.
    return QwenImageAdapter(cast("QwenImagePipeline", view))


def _build_pipeline_class() -> type:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline

    from flowgrpo_cli.engines.sampling import sample_batch
    from flowgrpo_cli.models import to_pil

    class FlowGrpoQwenImagePipeline(QwenImagePipeline):
        """vllm-omni's Qwen-Image pipeline whose forward runs flowgrpo's sampler.

        A request of flowgrpo's carries its text conditioning and {sample_id, seed} in the
        prompt and the sampler settings in ``sampling_params.extra_args["flowgrpo"]``; the
        requests vllm-omni batches together are sampled as one batch. Other requests (the
        engine's warm-up) run the stock pipeline.
        """

        def forward(self, req: Any) -> list[Any]:
            params = req.sampling_params_list
            jobs = [sp.extra_args.get(JOB_KEY) for sp in params]
            if all(job is None for job in jobs):
                return super().forward(req)
            if any(job != jobs[0] for job in jobs):
                raise ValueError("flowgrpo requests with different sampler settings were batched")
            job, first = jobs[0], params[0]
            settings = job_settings(job, height=first.height, width=first.width)
            prompts = req.prompts
            cond = Conditioning.cat(
                [Conditioning({k: p[k] for k in _CONDITIONING_KEYS if k in p}) for p in prompts]
            ).to(self.device)
            seeds = [int(p[JOB_KEY]["seed"]) for p in prompts]
            noise_seeds = None
            if settings.same_noise_per_group:  # a missing seed raises: never a silent default
                noise_seeds = [int(p[JOB_KEY]["noise_seed"]) for p in prompts]
            sigmas = torch.tensor(job["sigmas"], dtype=torch.float32)
            sampled = sample_batch(
                _adapter_over(self), cond, seeds, settings, sigmas, noise_seeds=noise_seeds
            )
            adapter = first.lora_request.lora_name if first.lora_request is not None else None
            outputs = []
            for i, prompt in enumerate(prompts):
                image = sampled.images[i : i + 1]  # [1, 3, H, W] in [0, 1]
                outputs.append(
                    DiffusionOutput(
                        # vllm-omni's own post-processing turns [-1, 1] into its PIL images.
                        output={
                            "payload": {"image": image * 2.0 - 1.0},
                            # What the engine checks: which sample, which adapter ran.
                            "metadata": {
                                "adapter": adapter,
                                "batch_size": len(prompts),
                                **prompt[JOB_KEY],
                            },
                        },
                        trajectory_latents=sampled.latents[i].cpu(),  # [T+1, C, h, w]
                        trajectory_log_probs=sampled.log_probs[i].cpu(),  # [T]
                        trajectory_timesteps=torch.stack(
                            [sampled.timesteps[i], sampled.timesteps_next[i]]
                        ),  # [2, T]: sigma of each stochastic step, and the sigma it goes to
                        # The exact image, rounded as the diffusers engine rounds it.
                        trajectory_decoded=to_pil(image),
                    )
                )
            return outputs

    FlowGrpoQwenImagePipeline.__module__ = __name__
    FlowGrpoQwenImagePipeline.__qualname__ = "FlowGrpoQwenImagePipeline"
    return FlowGrpoQwenImagePipeline


_PIPELINE_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # The pipeline class derives from vllm-omni's, so it is built on first access only:
    # importing this module must not need vllm-omni.
    global _PIPELINE_CLASS
    if name == "FlowGrpoQwenImagePipeline":
        if _PIPELINE_CLASS is None:
            _PIPELINE_CLASS = _build_pipeline_class()
        return _PIPELINE_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
