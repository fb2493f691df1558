"""Rollout: trajectories on disk, equal to the pipeline at noise 0, reproducible log-probs."""

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import do_rollout, engine_for, policy_for, recompute_log_probs, rewrite_part
from PIL import Image

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.engines.sampling import sample_batch
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.launch.distributed import DistInfo
from flowgrpo_cli.stages import rollout
from flowgrpo_cli.store.rundir import ROLLOUT, StageWriter, read_manifest
from flowgrpo_cli.store.trajectory import from_record_batch, iter_batches, read_conditioning

FAMILIES = ["sd3", "flux", "qwenimage"]


def rows_of(run, iteration=0):
    folder = run.stage_dir(iteration, ROLLOUT)
    manifest = read_manifest(folder)
    batches = iter_batches([folder / p for p in manifest["trajectory_parts"]])
    return [from_record_batch(b) for b in batches], manifest


def test_rollout_writes_trajectories_and_manifest(make_run):
    config, run = make_run()
    result = do_rollout(config, run)
    batches, manifest = rows_of(run)
    rows = batches[0]
    assert manifest["counts"] == {"images": 4, "groups": 2, "group_size": 2}
    assert manifest["policy_version"] == "base"
    assert rows.sample_ids == [f"i000000-g{g:04d}-k{k:03d}" for g in (0, 1) for k in (0, 1)]
    assert rows.latents.shape == (4, 4, 16, 8, 8)  # T + 1 = 4 states of [16, 8, 8]
    assert rows.trained.tolist() == [[True, True, False]] * 4  # the last step is not trained
    assert torch.isfinite(rows.log_probs).all()
    assert (rows.timesteps[:, 1:] == rows.timesteps_next[:, :-1]).all()
    assert rows.timesteps_next[0, -1] == 0.0
    assert len(set(rows.seeds)) == 4
    assert Image.open(io.BytesIO(rows.images[0])).size == (64, 64)
    assert result.metrics["rollout/images"] == 4.0
    conditioning = read_conditioning(
        [run.stage_dir(0, ROLLOUT) / "conditioning-00000-of-00001.arrow"]
    )
    assert sorted(conditioning) == [0, 1]


def test_same_command_twice_gives_the_same_files(make_run):
    config, run = make_run(name="a")
    config_b, run_b = make_run(name="b")
    do_rollout(config, run)
    do_rollout(config_b, run_b)
    for name in ("part-00000-of-00001.arrow", "conditioning-00000-of-00001.arrow"):
        assert (run.stage_dir(0, ROLLOUT) / name).read_bytes() == (
            run_b.stage_dir(0, ROLLOUT) / name
        ).read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_logprobs_are_reproduced_by_a_recompute(make_run, family):
    config, run = make_run(family=family)
    policy = policy_for(config, run)
    do_rollout(config, run, policy=policy)
    recomputed, rows = recompute_log_probs(policy, config, run)
    assert (recomputed - rows.log_probs).abs().max().item() < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_noise_level_zero_equals_the_pipeline_call(tiny_adapter, family):
    adapter = tiny_adapter(family)
    prompts = ['A sign that says "OPEN"', 'A mug with "42"']
    cond = adapter.encode_prompts(prompts, None, guidance_scale=4.0)
    settings = rollout.SamplerSettings(
        kind="sde", noise_level=0.0, guidance_scale=4.0, height=64, width=64,
        schedule=build_step_schedule(3),
    )  # fmt: skip
    ours = sample_batch(adapter, cond, [11, 12], settings, adapter.sigmas(3, 64, 64)).images
    kwargs = {"true_cfg_scale": 4.0, "negative_prompt": [""] * 2} if family == "qwenimage" else {}
    pipe = adapter.pipeline(
        prompt=prompts, num_inference_steps=3, guidance_scale=4.0, height=64, width=64,
        generator=[torch.Generator().manual_seed(s) for s in (11, 12)], output_type="np",
        **kwargs,
    ).images  # fmt: skip
    theirs = torch.from_numpy(np.asarray(pipe)).permute(0, 3, 1, 2)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_interrupted_rollout_finishes_only_the_missing_part(make_run, monkeypatch):
    config, run = make_run()
    policy = policy_for(config, run)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed before the manifest")

    monkeypatch.setattr(StageWriter, "finish", crash)
    with pytest.raises(KeyboardInterrupt):
        do_rollout(config, run, policy=policy)
    monkeypatch.undo()
    part = run.stage_dir(0, ROLLOUT) / "part-00000-of-00001.arrow"
    inode = os.stat(part).st_ino
    assert read_manifest(run.stage_dir(0, ROLLOUT)) is None
    do_rollout(config, run, policy=policy)
    assert os.stat(part).st_ino == inode  # kept, not rewritten
    assert read_manifest(run.stage_dir(0, ROLLOUT)) is not None


@pytest.mark.parametrize("thread", ["writer", "sampler"])
def test_an_error_on_either_thread_leaves_no_part(make_run, monkeypatch, thread):
    """PNG encoding and writing run on a second thread, one batch behind the sampling: an
    error on either ends the stage with that error, and no partial part is left behind."""
    config, run = make_run("sampler.batch_size=1")
    policy = policy_for(config, run)
    engine = engine_for(policy, config)
    calls = {"sample": 0}
    real_sample = engine.sample

    def sample(*args, **kwargs):
        calls["sample"] += 1
        if thread == "sampler" and calls["sample"] == 3:  # batches 1-2 written or in flight
            raise RuntimeError("sampling failed")
        return real_sample(*args, **kwargs)

    def write(*args, **kwargs):
        raise RuntimeError("encoding failed")

    monkeypatch.setattr(engine, "sample", sample)
    if thread == "writer":
        monkeypatch.setattr(rollout, "to_record_batch", write)
    with pytest.raises(RuntimeError, match="encoding" if thread == "writer" else "sampling"):
        rollout.run(config, run, 0, engine)
    folder = run.stage_dir(0, ROLLOUT)
    assert not list(folder.glob("part-*")) and read_manifest(folder) is None
    monkeypatch.undo()
    do_rollout(config, run, policy=policy)
    assert rows_of(run)[1]["counts"]["images"] == 4


def test_groups_split_evenly_over_ranks_or_refused():
    assert rollout.rank_groups(4, DistInfo(1, 2, 1)) == [1, 3]
    with pytest.raises(FlowGrpoError, match="cannot be split evenly over 2 ranks"):
        rollout.rank_groups(3, DistInfo(0, 2, 0))


def test_prompt_choice_depends_on_seed_and_iteration_only():
    a = rollout.select_prompts(100, 10, seed=0, iteration=3)
    assert a == rollout.select_prompts(100, 10, seed=0, iteration=3)
    assert a != rollout.select_prompts(100, 10, seed=0, iteration=4)
    assert len(set(a)) == 10
    with pytest.raises(FlowGrpoError, match="has only 5 prompts"):
        rollout.select_prompts(5, 10, seed=0, iteration=0)


def test_prompts_missing_a_column_is_a_clear_error(make_run):
    config, run = make_run()
    table = pq.read_table(run.data_dir / "train.parquet").drop_columns(["negative_prompt"])
    rewrite_part(run.data_dir, "train.parquet", lambda path: pq.write_table(table, path))
    policy = policy_for(config, run)
    with pytest.raises(FlowGrpoError, match=r"lacks column\(s\) \['negative_prompt'\]"):
        rollout.run(config, run, 0, engine_for(policy, config))


def cli(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "flowgrpo_cli", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip


def test_unknown_model_folder_is_a_clear_cli_error(make_run, tmp_path):
    _, run = make_run()
    nowhere = tmp_path / "nowhere"
    result = cli(
        "rollout", "--run", run.root, "--set", f"model.path={nowhere}", "--allow-config-change"
    )
    assert result.returncode == 1
    assert "nowhere" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_one_and_two_processes_write_the_same_samples(make_run):
    _, run = make_run(name="one")
    shutil.copytree(run.root, run.root.parent / "two")
    for name, nproc in (("one", 1), ("two", 2)):
        result = cli("rollout", "--run", run.root.parent / name, "--nproc", nproc)
        assert result.returncode == 0, result.stderr
    by_id = {}
    for name in ("one", "two"):
        folder = run.root.parent / name / "iter-000000" / "rollout"
        manifest = read_manifest(folder)
        assert len(manifest["trajectory_parts"]) == (1 if name == "one" else 2)
        for batch in iter_batches([folder / p for p in manifest["trajectory_parts"]]):
            rows = from_record_batch(batch)
            for i, sid in enumerate(rows.sample_ids):
                by_id.setdefault(sid, []).append(
                    (rows.latents[i], rows.log_probs[i], rows.images[i])
                )
    assert len(by_id) == 4
    for (lat_a, lp_a, img_a), (lat_b, lp_b, img_b) in by_id.values():
        assert (lat_a - lat_b).abs().max() < 1e-6
        assert (lp_a - lp_b).abs().max() < 1e-6
        assert img_a == img_b


def _random_lora(policy, scale: float = 0.05) -> None:
    """Give every LoRA weight a nonzero value, as after some updates (B starts at zero)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in policy.trainable_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def test_merged_lora_rollout_matches_the_unmerged_policy(make_run):
    config, run = make_run("sampler.merge_lora=true")
    policy = policy_for(config, run)
    _random_lora(policy)
    bases = [layer.get_base_layer() for layer in policy.lora_layers]
    before = [base.weight for base in bases]
    copies = [w.detach().clone() for w in before]
    do_rollout(config, run, policy=policy)
    # The base weights are the very tensors they were, bit for bit: no merge/unmerge drift.
    assert all(base.weight is w for base, w in zip(bases, before, strict=True))
    assert all(torch.equal(w, c) for w, c in zip(before, copies, strict=True))
    assert all(not layer.disable_adapters for layer in policy.lora_layers)
    # The unmerged policy (what the update runs) gives the stored log-probs up to rounding,
    # and the LoRA mattered: the base model alone gives clearly different ones.
    recomputed, rows = recompute_log_probs(policy, config, run)
    gap = (recomputed - rows.log_probs).abs().max().item()
    assert 0 < gap < 1e-5
    with policy.adapters_disabled():
        base_only, _ = recompute_log_probs(policy, config, run)
    assert (base_only - rows.log_probs).abs().max().item() > 100 * gap


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.dtype=bfloat16",), "needs model.dtype"),
        (("train.mode=full",), "has none"),
    ],
)
def test_merge_lora_refuses_what_it_cannot_merge(make_run, overrides, message):
    config, run = make_run("sampler.merge_lora=true", *overrides)
    policy = policy_for(config, run)
    with pytest.raises(FlowGrpoError, match=message):
        engine_for(policy, config)


def test_parts_open_in_hugging_face_datasets(make_run):
    """The docs' one line (stages.md): a rollout part as a `datasets.Dataset`, latents included."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    from flowgrpo_cli.store.trajectory import plain_columns

    config, run = make_run()
    do_rollout(config, run)
    part = run.stage_dir(0, ROLLOUT) / "part-00000-of-00001.arrow"
    table = pa.ipc.open_file(part).read_all()
    with pytest.raises(ValueError, match="does not have a datasets dtype"):
        datasets.Dataset(table)  # why the helper exists
    dataset = datasets.Dataset(plain_columns(table))
    assert dataset.num_rows == 4 and dataset[0]["sample_id"] == table["sample_id"][0].as_py()
    latents = np.asarray(dataset.with_format("numpy")["latents"])
    shape = json.loads(plain_columns(table).schema.field("latents").metadata[b"shape"])
    expected = table["latents"].combine_chunks().to_numpy_ndarray()
    np.testing.assert_array_equal(latents.reshape(-1, *shape), expected)
