"""`just gpu-check --smoke`: the GPU check's code path on the CPU, so it cannot rot unseen.

The check builds an SD3.5-architecture pipeline (here at toy widths), runs two iterations of
`flowgrpo loop` on it with examples/sd35m_ocr.toml, and writes one JSON; these tests hold
that JSON to its fields and to values a working run gives.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gpu_check


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("gpu-check")
    out = folder / "out.json"
    assert gpu_check.main(["--smoke", "--out", str(out), "--workdir", str(folder / "work")]) == 0
    return json.loads(out.read_text())


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_smoke_reports_device_and_versions(smoke):
    device = smoke["device"]
    assert device["type"] == "cpu"
    assert device["torch"] == torch.__version__
    assert "cuda" in device  # null on a CPU build of torch, the CUDA version otherwise
    assert device["name"]
    assert smoke["versions"]["diffusers"]


def test_smoke_runs_the_example_config_at_the_stated_sizes(smoke):
    sizes = smoke["sizes"]
    expected = gpu_check.SMOKE_SIZES
    assert sizes["images_per_iteration"] == expected.prompts_per_iteration * expected.group_size
    assert sizes["config"] == "examples/sd35m_ocr.toml"
    # What the example sets, as a user's run takes it.
    assert (sizes["lora_rank"], sizes["lora_alpha"], sizes["guidance_scale"]) == (32, 64, 4.5)
    assert sizes["beta"] == 0.04 and sizes["gradient_checkpointing"] is True
    model = smoke["model"]
    assert model["transformer_config"]["num_layers"] == gpu_check.SMOKE_TRANSFORMER["num_layers"]
    assert model["transformer_parameters"] > 0


def test_smoke_throughputs_are_finite_and_positive(smoke):
    images = gpu_check.SMOKE_SIZES.prompts_per_iteration * gpu_check.SMOKE_SIZES.group_size
    rollout, update = smoke["rollout"], smoke["update"]
    assert _positive(rollout["images_per_s"]) and _positive(rollout["warmup_images_per_s"])
    assert rollout["images"] == images
    assert _positive(update["images_per_s"]) and _positive(update["warmup_images_per_s"])
    # jpeg_compressibility differs between images, so no sample has advantage 0: all train.
    assert update["samples_trained"] == images
    assert update["optimizer_steps"] >= 1
    # Images per second agree with the stage's own seconds.
    assert rollout["images_per_s"] == pytest.approx(images / rollout["stage_seconds"], rel=1e-6)


def test_smoke_logprob_gap_vanishes_in_float32(smoke):
    gap = smoke["logprob_gap"]
    assert gap["dtype"] == "float32"
    assert set(gap["per_iteration"]) == {"0", "1"}
    for values in gap["per_iteration"].values():
        assert 0.0 <= values["mean"] <= values["max"]
    # The on-policy check: below 1e-6 in float32, though rollout batched 2x the rows.
    assert gap["max"] < gap["float32_bound"] == 1e-6
    assert gap["rollout_rows_per_forward"] != gap["update_rows_per_forward"]


def test_smoke_memory_is_null_on_cpu(smoke):
    memory = smoke["memory"]
    assert memory["device"] == "cpu"
    for phase in ("rollout", "update"):
        entry = memory[phase]
        assert entry["peak_allocated_bytes"] is None
        assert entry["peak_reserved_bytes"] is None
        assert entry["ratio_allocated_to_predicted"] is None
    # The plan's prediction: per-phase bytes once `flowgrpo plan` exists, else a reason.
    plan = memory["plan"]
    assert plan == "flowgrpo plan (plan_run)" or isinstance(plan, str)
    if plan == "flowgrpo plan (plan_run)":
        assert _positive(memory["rollout"]["predicted_bytes"])


def test_smoke_wall_times_cover_every_phase(smoke):
    wall = smoke["wall_seconds"]
    for key in ("build_model_s", "loop_s", "load_policy_s", "rollout_0_s", "rollout_1_s",
                "score_1_s", "update_0_s", "update_1_s", "total_s"):  # fmt: skip
        assert _positive(wall[key]), key
    assert wall["total_s"] >= wall["loop_s"] >= wall["rollout_1_s"] + wall["update_1_s"]


def test_smoke_says_whether_vllm_omni_ran(smoke):
    status = smoke["vllm_omni"]["status"]
    assert status in ("not installed", "skipped in --smoke (vllm-omni needs a GPU)")


def test_without_cuda_it_exits_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == gpu_check.NO_CUDA
    assert captured.out == ""
