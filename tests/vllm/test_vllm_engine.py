"""The vllm-omni engine against the diffusers engine, on a tiny Qwen-Image pipeline, on CPU.

One `flowgrpo loop` of two iterations runs with sampler.engine = "vllm-omni" (evaluation
before each iteration and at the end, rollout, score, update), all sampling through one
vllm-omni instance. The diffusers engine then re-samples the same requests with the same
weights, and the tests compare:

- noise level 0 (the evaluations, taken with eval.ode_solver = "dpm++2m", so vllm-omni's
  pipeline is seen to take the solver the settings name): images equal to within
  ODE_PIXEL_TOL levels of 255, and unlike the Euler steps' images;
- SDE (the rollouts): latents within LATENT_TOL, and the stored log-probs reproduced by the
  update stage's own recompute (its `update/logprob_gap_max` metric) within LOGPROB_GAP_TOL;
- after the first update: the manifest's policy version is the checkpoint's, the images at
  the same seeds differ from the base model's, and the second update's gap stays within
  tolerance, which it could not if the rollout had used the base weights.

Tolerances: the two engines share flowgrpo's sampler (sampling.sample_batch), step functions,
CFG, noise and decode; only the transformer implementation differs (vllm-omni's fused QKV,
its LoRA layers, its SDPA route), which moves float32 results by about 1e-6.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip(
    "vllm_omni", reason="vllm-omni is not installed here: run `just test-vllm` (uses .venv-vllm)"
)

from flowgrpo_cli.engines import ENGINES
from flowgrpo_cli.engines.diffusers_engine import DiffusersEngine
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import ROLLOUT, UPDATE, RunDir, read_manifest, sha256_file

ODE_PIXEL_TOL = 1  # max |difference| of 8-bit image values, noise level 0
LATENT_TOL = 1e-4  # max |difference| of stored float32 latents, SDE
LOGPROB_TOL = 1e-4  # max |difference| of stored log-probs between the engines, SDE
LOGPROB_GAP_TOL = 1e-4  # update/logprob_gap_max: stored vs recomputed by the update
ITERATIONS = 2

TRAIN_PROMPTS = [
    'A neon sign that says "OPEN LATE" above a diner door.',
    'A chalkboard menu reading "SOUP 4" in white chalk.',
    'A wooden plank carved with "CABIN 7" by a lake.',
    'A paper kite printed with "FLY" against a blue sky.',
]
TEST_PROMPTS = [
    'A mug printed with "MONDAY" on a desk.',
    'A license plate showing "ABC 123" on a red car.',
    'A movie poster titled "NIGHTFALL" in gold letters.',
    'A street sign reading "ELM ST" at dusk.',
]


def _config_text(root: Path, model: Path) -> str:
    return f"""
[run]
dir = "{root / "run"}"
seed = 0
checkpoint_every = 1   # the tests load iteration 0's checkpoint: keep its weights

[data]
train = "{root / "train.txt"}"
test = "{root / "test.txt"}"

[model]
path = "{model}"
dtype = "float32"
device = "cpu"
height = 64
width = 64

[sampler]
engine = "vllm-omni"
num_steps = 4
noise_level = 0.7
guidance_scale = 4.0
batch_size = 4

[reward.weights]
jpeg_compressibility = 1.0

[algorithm]
group_size = 2
prompts_per_iteration = 2
beta = 0.04

[train]
lr = 1e-2              # large, so one update visibly changes a random tiny model's images
micro_batch_size = 4
lora_rank = 4
lora_alpha = 8

[eval]
every = 1
num_steps = 4
guidance_scale = 4.0
ode_solver = "dpm++2m"  # the engine must pass the solver on to its pipeline
"""


@pytest.fixture(scope="module")
def looped(tmp_path_factory):
    """A two-iteration loop sampled by vllm-omni (one instance for all of it)."""
    from flowgrpo_cli.loop import run_loop
    from flowgrpo_cli.models.tiny import build_tiny_pipeline
    from flowgrpo_cli.store.runconfig import resolve_run

    root = tmp_path_factory.mktemp("vllm-loop")
    model = build_tiny_pipeline("qwenimage", root / "tiny-qwenimage", seed=0)
    (root / "train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    (root / "test.txt").write_text("\n".join(TEST_PROMPTS) + "\n")
    config_file = root / "config.toml"
    config_file.write_text(_config_text(root, model))
    resolved = resolve_run(config_file, [])
    resolved.store_config()
    started = time.perf_counter()
    with pytest.MonkeyPatch.context() as patch:
        # The shared registry may not list the engine yet; this is the entry it needs.
        if "vllm-omni" not in ENGINES:
            patch.setitem(ENGINES, "vllm-omni", "flowgrpo_cli.engines.vllm_omni:VllmOmniEngine")
        summaries = run_loop(resolved.config, resolved.run, ITERATIONS)
    seconds = time.perf_counter() - started
    print(f"\nloop of {ITERATIONS} iterations with vllm-omni (start-up included): {seconds:.1f} s")
    for summary in summaries:
        m = summary.metrics
        print(
            f"iteration {summary.iteration}: rollout {m.get('rollout/seconds', 0):.2f} s, "
            f"update/logprob_gap_max {m.get('update/logprob_gap_max')}"
        )
    return SimpleNamespace(config=resolved.config, run=resolved.run, summaries=summaries)


def _policy_at(config, run: RunDir, iteration: int):
    """The policy iteration `iteration` starts from, in float32 on the CPU."""
    from flowgrpo_cli.training.policy import load_policy, load_weights

    policy = load_policy(config, torch.device("cpu"))
    if iteration > 0:
        load_weights(policy, run.checkpoint_dir(iteration - 1))
    return policy


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _eval_images(run: RunDir, iteration: int) -> dict[str, bytes]:
    from flowgrpo_cli.store.trajectory import read_table

    folder = run.eval_dir(iteration)
    parts = [folder / part["name"] for part in read_manifest(folder)["parts"]]
    table = read_table(parts, ["sample_id", "image"]).to_pydict()
    return dict(zip(table["sample_id"], table["image"], strict=True))


def _diffusers_eval_images(
    config, run: RunDir, iteration: int, ode_solver: str | None = None
) -> dict[str, bytes]:
    """What the diffusers engine draws for the evaluation of `iteration`: noise level 0, with
    the evaluation's solver or `ode_solver`."""
    import dataclasses

    from flowgrpo_cli.models import to_png
    from flowgrpo_cli.stages.evaluate import evaluation_requests, evaluation_settings

    policy = _policy_at(config, run, iteration)
    engine = DiffusersEngine(
        policy,
        max_sequence_length=config.model.max_sequence_length,
    )
    requests = evaluation_requests(config, run)
    settings = evaluation_settings(config)
    if ode_solver is not None:
        settings = dataclasses.replace(settings, ode_solver=ode_solver)
    sampled = engine.sample(requests, engine.encode(requests, settings.guidance_scale), settings)
    return dict(zip([r.sample_id for r in requests], to_png(sampled.images), strict=True))


def test_ode_images_match_the_diffusers_engine(looped):
    """Noise level 0: the same prompts and seeds give the same images in both engines."""
    for iteration in range(ITERATIONS + 1):
        ours = _eval_images(looped.run, iteration)
        theirs = _diffusers_eval_images(looped.config, looped.run, iteration)
        assert ours.keys() == theirs.keys()
        diffs = [np.abs(_pixels(ours[k]) - _pixels(theirs[k])) for k in ours]
        worst = max(int(d.max()) for d in diffs)
        print(f"eval iteration {iteration}: max pixel difference {worst} of 255")
        assert worst <= ODE_PIXEL_TOL
    # Had vllm-omni's pipeline taken Euler's steps, its images would be these.
    ours = _eval_images(looped.run, 0)
    euler = _diffusers_eval_images(looped.config, looped.run, 0, ode_solver="euler")
    gap = max(int(np.abs(_pixels(ours[k]) - _pixels(euler[k])).max()) for k in euler)
    print(f"eval iteration 0: max pixel difference to the Euler steps' images {gap} of 255")
    assert gap > ODE_PIXEL_TOL


def test_sde_log_probs_are_reproduced_by_the_update(looped):
    """The update recomputes the stored log-probs with the diffusers adapter: the gap metric."""
    for iteration in range(ITERATIONS):
        metrics = (looped.run.stage_dir(iteration, UPDATE) / "metrics.json").read_text()
        gap = json.loads(metrics)["update/logprob_gap_max"]
        print(f"iteration {iteration}: update/logprob_gap_max {gap:.3g}")
        assert gap <= LOGPROB_GAP_TOL


def _resampled_by_diffusers(looped, iteration: int, weights_of: int):
    """(stored rows, the diffusers engine's re-sampling of the same requests) per record batch,
    with the weights iteration `weights_of` starts from."""
    from flowgrpo_cli.stages.rollout import build_requests, sampler_settings
    from flowgrpo_cli.store.trajectory import from_record_batch, iter_batches

    config, run = looped.config, looped.run
    folder = run.stage_dir(iteration, ROLLOUT)
    parts = [folder / name for name in read_manifest(folder)["trajectory_parts"]]
    engine = DiffusersEngine(
        _policy_at(config, run, weights_of),
        max_sequence_length=config.model.max_sequence_length,
    )
    requests = build_requests(
        config, run, iteration, list(range(config.algorithm.prompts_per_iteration))
    )
    by_id = {r.sample_id: r for r in requests}
    settings = sampler_settings(config, iteration)
    conditioning = engine.encode(requests, settings.guidance_scale)
    for batch in iter_batches(parts):
        rows = from_record_batch(batch)
        chunk = [by_id[sid] for sid in rows.sample_ids]
        yield rows, engine.sample(chunk, conditioning, settings)


def test_sde_trajectories_match_the_diffusers_engine(looped):
    """The rollout after one update, re-sampled by the diffusers engine with the same weights."""
    from flowgrpo_cli.models import to_png

    iteration = ITERATIONS - 1
    for rows, sampled in _resampled_by_diffusers(looped, iteration, weights_of=iteration):
        latent_gap = float((sampled.latents - rows.latents).abs().max())
        logprob_gap = float((sampled.log_probs - rows.log_probs).abs().max())
        pixel_gap = max(
            int(np.abs(_pixels(a) - _pixels(b)).max())
            for a, b in zip(to_png(sampled.images), rows.images, strict=True)
        )
        print(f"rollout {iteration}: max differences: latents {latent_gap:.3g}, "
              f"log-probs {logprob_gap:.3g}, pixels {pixel_gap}")  # fmt: skip
        assert torch.equal(sampled.timesteps, rows.timesteps)
        assert torch.equal(sampled.timesteps_next, rows.timesteps_next)
        assert latent_gap <= LATENT_TOL
        assert logprob_gap <= LOGPROB_TOL
        assert pixel_gap <= ODE_PIXEL_TOL


def test_rollout_after_an_update_uses_the_new_lora_weights(looped):
    run = looped.run
    versions = [
        read_manifest(run.stage_dir(i, ROLLOUT))["policy_version"] for i in range(ITERATIONS)
    ]
    weights = run.checkpoint_dir(0) / "pytorch_lora_weights.safetensors"
    assert versions[0] == "base"
    assert versions[1] == f"iter-000000:{sha256_file(weights)[:16]}"
    # The rollout after the update is far from what the base weights draw from the same noise
    # (and matches the updated weights: test_sde_trajectories_match_the_diffusers_engine).
    for rows, base in _resampled_by_diffusers(looped, 1, weights_of=0):
        change = float((base.latents - rows.latents).abs().max())
        print(f"rollout 1 vs the base weights at the same seeds: latents differ by {change:.3g}")
        assert change > 100 * LATENT_TOL
    # The evaluation images, same prompts and seeds, before and after the first update.
    before, after = _eval_images(run, 0), _eval_images(run, 1)
    changed = sum(before[k] != after[k] for k in before)
    print(f"evaluation images changed by the first update: {changed} of {len(before)}")
    assert changed > 0


def test_peft_export_uses_vllm_omni_module_names(tmp_path):
    from flowgrpo_cli.engines.vllm_omni import write_peft_adapter
    from flowgrpo_cli.models import load_adapter
    from flowgrpo_cli.models.tiny import build_tiny_pipeline
    from flowgrpo_cli.training.policy import attach_lora

    model = build_tiny_pipeline("qwenimage", tmp_path / "tiny")
    adapter = load_adapter(model, dtype=torch.float32, device="cpu")
    attach_lora(adapter.transformer, rank=4, alpha=8, targets=adapter.default_lora_targets, seed=0)
    write_peft_adapter(adapter.transformer, tmp_path / "lora")
    from safetensors.torch import load_file

    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    keys = load_file(str(tmp_path / "lora" / "adapter_model.safetensors"))
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    # vllm-omni's Qwen-Image block names its image output projection `attn.to_out` (one
    # RowParallelLinear, where diffusers has `attn.to_out.0`); the fused `attn.to_qkv` and
    # `attn.add_kv_proj` are matched through their sub-projections (to_q ..., add_q_proj ...),
    # and `attn.to_add_out`, `img_mlp.net.0.proj`, `img_mlp.net.2` (and txt_mlp's) keep
    # diffusers' names. The targets are named from the block (attn.to_q, ..., img_mlp.net.2).
    targets = config["target_modules"]
    assert "attn.to_out" in targets
    assert not any(target.endswith("to_out.0") for target in targets)
    assert {"img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj"} <= set(targets)
    assert len(targets) == len(adapter.default_lora_targets)
    assert "base_model.model.transformer_blocks.0.attn.to_out.lora_A.weight" in keys
    assert "base_model.model.transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight" in keys
    assert not any(".to_out.0." in key for key in keys)
    # 2 blocks, every target (8 attention projections, 4 MLP layers), A and B
    assert len(keys) == 2 * len(adapter.default_lora_targets) * 2


def test_engine_says_how_to_install_vllm_omni(monkeypatch):
    import sys

    from flowgrpo_cli.engines.vllm_omni import VllmOmniEngine

    monkeypatch.setitem(sys.modules, "vllm_omni", None)  # import vllm_omni now fails
    with pytest.raises(FlowGrpoError, match="just setup-vllm"):
        VllmOmniEngine(None, max_sequence_length=0)
