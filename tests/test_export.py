"""The exported checkpoint is the trained policy: diffusers' load_lora_weights() reproduces it.

A user takes away checkpoints/iter-N and loads it with `pipe.load_lora_weights(folder)` (the
EMA weights from `folder / "ema"`). These tests train a LoRA with alpha != r for a few optimizer
steps on each family's tiny pipeline, load the checkpoint the way a user does, and compare the
transformer's output and the noise-0 image with the policy that was trained. An editing run's
export is loaded into QwenImageEditPipeline and makes the policy's edit of a source image.
"""

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import do_iteration, policy_for, small_edit_sources

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.stages import rollout
from flowgrpo_cli.store.rundir import RunLock
from flowgrpo_cli.training.policy import EMA_FOLDER, load_weights

# SD3.5's block kinds (dual attention, whose attn2 the default targets leave frozen), FLUX, Qwen.
FAMILIES = ["sd35", "flux", "qwenimage"]
PROMPTS = ['A sign that says "OPEN"', 'A mug with "42"']
GUIDANCE = 4.0


def velocities(adapter, cond) -> torch.Tensor:
    """The transformer's (CFG-combined) velocity at a high and a mid-range sigma, [2, 2, ...]."""
    x = torch.randn(2, *adapter.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    return torch.stack([
        adapter.velocity(x, torch.full((2,), sigma), cond, guidance_scale=GUIDANCE)
        for sigma in (1.0, 0.5)
    ])  # fmt: skip


def noise_zero_images(adapter, cond) -> torch.Tensor:
    """Our sampler at noise level 0 (the ODE), as evaluation draws images: [2, 3, 64, 64]."""
    settings = rollout.SamplerSettings(
        kind="sde", noise_level=0.0, guidance_scale=GUIDANCE, height=64, width=64,
        schedule=build_step_schedule(3),
    )  # fmt: skip
    return sample_batch(adapter, cond, [11, 12], settings, adapter.sigmas(3, 64, 64)).images


def pipeline_images(pipe, family) -> torch.Tensor:
    """The diffusers pipeline's own __call__, same seeds and steps: [2, 3, 64, 64]."""
    kwargs = (
        {"true_cfg_scale": GUIDANCE, "negative_prompt": [""] * 2} if family == "qwenimage" else {}
    )
    images = pipe(
        prompt=PROMPTS, num_inference_steps=3, guidance_scale=GUIDANCE, height=64, width=64,
        generator=[torch.Generator().manual_seed(s) for s in (11, 12)], output_type="np",
        **kwargs,
    ).images  # fmt: skip
    return torch.from_numpy(np.asarray(images)).permute(0, 3, 1, 2)


def load_pipeline(folder, lora=None):
    """The base pipeline as a user loads it, with a LoRA folder loaded the way they would."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_loaded_by_diffusers_is_the_trained_policy(make_run, tiny_model_dir, family):
    # alpha / r = 3: a loader that took alpha = r would run the LoRA at a third of its strength.
    config, run = make_run(
        "train.lora_rank=4", "train.lora_alpha=12", "train.lr=0.05", "train.ema_decay=0.5",
        family=family,
    )  # fmt: skip
    _, trainer = do_iteration(config, run)
    assert trainer.state.optimizer_steps == 2
    policy = trainer.policy
    wrap = type(policy.adapter)  # our adapter around the user's pipeline: the same forward call
    cond = policy.adapter.encode_prompts(PROMPTS, None, guidance_scale=GUIDANCE)
    base = velocities(wrap(load_pipeline(tiny_model_dir(family))), cond)
    trained, images = velocities(policy.adapter, cond), noise_zero_images(policy.adapter, cond)
    with trainer.ema_weights():
        ema, ema_images = velocities(policy.adapter, cond), noise_zero_images(policy.adapter, cond)
    # The comparison means something: the LoRA moves the output, and the EMA is another model.
    assert (trained - base).abs().max().item() > 1e-2
    assert (ema - trained).abs().max().item() > 1e-3

    checkpoint = run.checkpoint_dir(0)
    for folder, ours, our_images in [
        (checkpoint, trained, images),
        (checkpoint / EMA_FOLDER, ema, ema_images),
    ]:
        pipe = load_pipeline(tiny_model_dir(family), folder)
        assert (velocities(wrap(pipe), cond) - ours).abs().max().item() < 1e-6
        assert (pipeline_images(pipe, family) - our_images).abs().max().item() < 1e-5


def test_a_checkpoint_of_another_lora_alpha_is_refused(make_run):
    config, run = make_run("train.lora_alpha=12")
    do_iteration(config, run)
    other, _ = make_run("train.lora_alpha=4", name="other")
    with pytest.raises(FlowGrpoError, match="lora_alpha = 12, the policy's adapter has"):
        load_weights(policy_for(other, run), run.checkpoint_dir(0))


# ---------------------------------------------------------------------------------------------
# `flowgrpo export`: what a user takes away, loaded the way they load it.


def export(run, out, *options):
    from typer.testing import CliRunner

    from flowgrpo_cli.cli import app

    return CliRunner().invoke(app, ["export", str(run.root), str(out), *options])


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_exported_folders_reproduce_the_policy(make_run, tiny_model_dir, tmp_path, mode):
    lr = 0.05 if mode == "lora" else 1e-3
    config, run = make_run(
        f"train.mode={mode}", "train.lora_rank=4", "train.lora_alpha=12", f"train.lr={lr}",
        "train.ema_decay=0.5",
    )  # fmt: skip
    _, trainer = do_iteration(config, run)
    policy = trainer.policy
    cond = policy.adapter.encode_prompts(PROMPTS, None, guidance_scale=GUIDANCE)
    images = noise_zero_images(policy.adapter, cond)
    with trainer.ema_weights():
        ema_images = noise_zero_images(policy.adapter, cond)
    base_images = pipeline_images(load_pipeline(tiny_model_dir("sd3")), "sd3")
    assert (images - base_images).abs().max().item() > 1e-2  # training moved the images

    # A LoRA run exports its adapter unless asked to merge; a full run always merges.
    exports = [("merged", ["--merged"], images), ("ema", ["--ema", "--merged"], ema_images)]
    if mode == "lora":
        exports += [("lora", [], images), ("lora-ema", ["--ema"], ema_images)]
    for name, options, expected in exports:
        out = tmp_path / "exports" / name
        result = export(run, out, *options, "--dtype", "float32")
        assert result.exit_code == 0, result.output
        assert {"README.md", "flowgrpo_config.toml"} <= {p.name for p in out.iterdir()}
        if name.startswith("lora"):
            assert not (out / "model_index.json").exists()
            pipe = load_pipeline(tiny_model_dir("sd3"), out)
        else:  # a whole pipeline, loaded with no LoRA step
            pipe = load_pipeline(out)
        assert (pipeline_images(pipe, "sd3") - expected).abs().max().item() < 1e-4, name
    assert not list((tmp_path / "exports").glob(".*.tmp"))  # no staging folder left


def test_export_picks_the_iteration_and_writes_a_model_card(make_run, tmp_path):
    config, run = make_run("train.lora_alpha=12")
    do_iteration(config, run)
    do_iteration(config, run, 1)
    (run.eval_dir(0)).mkdir(parents=True)
    (run.eval_dir(0) / "metrics.json").write_text('{"eval/reward_mean": 0.25}')
    (run.eval_dir(1)).mkdir(parents=True)
    (run.eval_dir(1) / "metrics.json").write_text('{"eval/reward_mean": 0.5}')

    with RunLock(run.root):  # a loop training this run: exporting needs no lock
        latest = export(run, tmp_path / "latest")
    assert latest.exit_code == 0, latest.output
    assert "checkpoint iter-000001" in (tmp_path / "latest" / "README.md").read_text()
    first = export(run, tmp_path / "first", "--iteration", "0")
    assert first.exit_code == 0, first.output
    card = (tmp_path / "first" / "README.md").read_text()
    assert (
        "| base model | 0.2500 |" in card
        and "| after 1 update (checkpoint iter-000000) | 0.5000 |" in card
    )
    assert "algorithm `flow_grpo`" in card and "`jpeg_compressibility` x 1" in card
    assert "load_lora_weights" in card and f"flowgrpo export {run.root.name} first" in card
    assert str(tmp_path) not in card  # paths shown by their last part only
    weights = "pytorch_lora_weights.safetensors"
    assert (tmp_path / "first" / weights).read_bytes() == (
        run.checkpoint_dir(0) / weights
    ).read_bytes()


def test_export_errors_name_the_problem_and_leave_nothing(make_run, tmp_path):
    config, run = make_run()
    result = export(run, tmp_path / "out")
    assert result.exit_code == 1 and "no finished update yet" in result.output
    do_iteration(config, run)
    result = export(run, tmp_path / "out", "--iteration", "3")
    assert result.exit_code == 1
    assert "--iteration 3" in result.output and "iterations 0 to 0" in result.output
    result = export(run, tmp_path / "out", "--ema")
    assert result.exit_code == 1 and "train.ema_decay = 0" in result.output
    assert not (tmp_path / "out").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    result = export(run, tmp_path / "taken")
    assert result.exit_code == 1 and "already exists" in result.output
    result = export(Path(tmp_path / "no-run"), tmp_path / "out2")
    assert result.exit_code == 1 and "is not a run directory" in result.output


def test_push_to_hub_uploads_the_exported_folder(make_run, tmp_path, monkeypatch):
    import huggingface_hub

    hub = tmp_path / "hub"  # a local stand-in for the Hub: a folder per repo

    class StandInHub:
        def create_repo(self, repo_id, *, repo_type, private, exist_ok):
            (hub / repo_id).mkdir(parents=True, exist_ok=exist_ok)
            return f"https://hub.invalid/{repo_id}"

        def upload_folder(self, *, repo_id, folder_path, commit_message):
            shutil.copytree(folder_path, hub / repo_id, dirs_exist_ok=True)

    monkeypatch.setattr(huggingface_hub, "HfApi", StandInHub)
    config, run = make_run()
    do_iteration(config, run)
    result = export(run, tmp_path / "out", "--push-to-hub", "me/tiny-lora")
    assert result.exit_code == 0, result.output
    assert "https://hub.invalid/me/tiny-lora" in result.output
    assert sorted(p.name for p in (hub / "me/tiny-lora").iterdir()) == sorted(
        p.name for p in (tmp_path / "out").iterdir()
    )


def test_a_run_starts_from_an_existing_lora(make_run, tmp_path):
    config, run = make_run("train.lora_alpha=12", "train.lr=0.05")
    _, trainer = do_iteration(config, run)
    cond = trainer.policy.adapter.encode_prompts(PROMPTS, None, guidance_scale=GUIDANCE)
    trained = velocities(trainer.policy.adapter, cond)
    assert export(run, tmp_path / "lora").exit_code == 0
    for source in (tmp_path / "lora", run.checkpoint_dir(0) / "pytorch_lora_weights.safetensors"):
        other, other_run = make_run(
            "train.lora_alpha=12", f"model.init_lora={source}", name=f"from-{source.name}"
        )
        policy = policy_for(other, other_run)
        assert policy.version.startswith("init:")
        assert (velocities(policy.adapter, cond) - trained).abs().max().item() < 1e-6
        with policy.adapters_disabled():  # the KL reference is still the base model
            base = velocities(policy.adapter, cond)
        assert (base - trained).abs().max().item() > 1e-2
    for overrides, message in [
        (("train.lora_alpha=8",), "lora_alpha = 12, the policy's adapter has lora_alpha = 8"),
        (("train.lora_alpha=12", "train.mode=full"), 'needs train.mode = "lora"'),
        (("train.lora_alpha=12",), "does not exist"),
    ]:
        missing = tmp_path / "nothing" if message == "does not exist" else tmp_path / "lora"
        bad, bad_run = make_run(*overrides, f"model.init_lora={missing}", name="bad")
        with pytest.raises(FlowGrpoError, match=re.escape(message)):
            policy_for(bad, bad_run)


# ---------------------------------------------------------------------------------------------
# An editing run's export: QwenImageEditPipeline with it loaded makes the policy's edit.


def load_edit_pipeline(folder, lora=None):
    """The edit pipeline as DiffusionPipeline.from_pretrained loads `folder`; Qwen-Image-Edit's
    processor handed in image-only (what load_adapter does: this machine's CPU torch has no
    torchvision, without which transformers will not build the processor's video half)."""
    from diffusers import DiffusionPipeline

    from flowgrpo_cli.models.qwenimage_edit import load_processor

    processor = Path(folder) / "processor"
    components = {"processor": load_processor(processor)} if processor.is_dir() else {}
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32, **components)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe


def card_edit(card: str, pipe, loads: list[str], folder: Path) -> torch.Tensor:
    """The card's code that redraws test prompt 0's edit, run with `pipe` in place of its
    loading lines (which must read `loads`) and asked for floats, not 8 bits: [1, 3, H, W]."""
    code = next(b for b in re.findall(r"^```python\n(.*?)^```$", card, re.S | re.M)
                if "image = pipe(\n" in b)  # fmt: skip
    assert [line for line in code.splitlines() if line.startswith("pipe")] == [
        *loads,
        'pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
    ], code
    kept = [line for line in code.splitlines() if not line.startswith(("pipe", "image.save("))]
    call = "\n".join(kept).replace(").images[0]", '    output_type="np",\n).images')
    names = {"pipe": pipe}
    cwd = Path.cwd()
    os.chdir(folder)  # the source image is a file of the exported folder
    try:
        exec(call, names)
    finally:
        os.chdir(cwd)
    return torch.from_numpy(np.asarray(names["image"])).permute(0, 3, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwenimage_edit", "flux_kontext"])
def test_exported_edit_folders_reproduce_the_policys_edit(
    make_run, tiny_model_dir, tmp_path, family
):
    """A LoRA trained on the tiny edit model, exported as a LoRA folder and merged: the card's
    code, with QwenImageEditPipeline loaded from either, redraws the policy's noise-free
    evaluation edit of test prompt 0 (its source image, its seed, true CFG); the merged folder
    names transformers' processor and loads through load_adapter too."""
    from test_edit_data import edit_jsonl

    from flowgrpo_cli.models import load_adapter
    from flowgrpo_cli.stages.evaluate import evaluation_requests, evaluation_settings
    from flowgrpo_cli.store.source_images import decode_source_image

    train = edit_jsonl(tmp_path)
    guidance = 2.0
    config, run = make_run(
        f"data.train={train}", f"data.test={train}", "train.lora_rank=4", "train.lora_alpha=12",
        "train.lr=0.05", "sampler.guidance_scale=1.0", "eval.num_steps=3",
        f"eval.guidance_scale={guidance}",
        # Kontext takes sources of at least 16 x 16 pixels; the sample's are 12 x 9.
        *(["data.source_size=[32, 24]"] if family == "flux_kontext" else []),
        family=family,
    )  # fmt: skip
    with small_edit_sources():  # the weights trained do not depend on the source's size
        _, trainer = do_iteration(config, run)
    policy = trainer.policy
    request = evaluation_requests(config, run)[0]
    cond = policy.adapter.encode_prompts(
        [request.prompt], [request.negative_prompt], guidance_scale=guidance,
        source_images=[decode_source_image(request.source_image)],
    )  # fmt: skip
    settings = evaluation_settings(config)
    sigmas = policy.adapter.sigmas(3, 64, 64)
    edit = sample_batch(policy.adapter, cond, [request.seed], settings, sigmas).images
    with policy.adapters_disabled():
        base_edit = sample_batch(policy.adapter, cond, [request.seed], settings, sigmas).images
    assert (edit - base_edit).abs().max().item() > 1e-2  # training moved the edit

    base = tiny_model_dir(family)
    load = 'pipe = DiffusionPipeline.from_pretrained("{}", dtype=torch.float32)'
    lora_lines = [
        load.format(base.name) + "  # the base model: a local folder, give your copy's path",
        'pipe.load_lora_weights("THIS_FOLDER_OR_REPO")  # rank and alpha come from the file',
    ]
    exports = [
        ("lora", [], lora_lines),
        ("merged", ["--merged"], [load.format("THIS_FOLDER_OR_REPO")]),
    ]
    for name, options, loads in exports:
        out = tmp_path / "exports" / name
        result = export(run, out, *options, "--dtype", "float32")
        assert result.exit_code == 0, result.output
        card = (out / "README.md").read_text()
        assert "- image-to-image" in card and "pipe(image=source, prompt=" in card
        if family == "qwenimage_edit":  # true CFG
            assert f"    true_cfg_scale={guidance!r},\n    negative_prompt=''," in card
        else:  # Kontext's embedded guidance, at the size the run generated at
            assert f"    guidance_scale={guidance!r}," in card and "max_area=4096," in card
        # The source image the card's code edits: the one the run stored, shipped beside it.
        assert (out / f"{request.sample_id}-source.png").read_bytes() == request.source_image
        pipe = load_edit_pipeline(base, out) if name == "lora" else load_edit_pipeline(out)
        difference = (card_edit(card, pipe, loads, out) - edit).abs().max().item()
        assert difference < 1e-4, (name, difference)

    merged = tmp_path / "exports" / "merged"
    index = (merged / "model_index.json").read_text()
    assert "flowgrpo" not in index
    if family == "qwenimage_edit":
        assert '"Qwen2VLProcessor"' in index
        assert "flowgrpo" not in (merged / "processor" / "processor_config.json").read_text()
    ours = load_adapter(merged, dtype=torch.float32, device="cpu")
    x = torch.randn(1, *ours.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((1,), 0.5)
    trained = policy.adapter.velocity(x, sigma, cond, guidance_scale=guidance)
    assert (ours.velocity(x, sigma, cond, guidance_scale=guidance) - trained).abs().max() < 1e-5
