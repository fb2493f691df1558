"""`flowgrpo plan`: memory, disk and passes of a run, before anything is loaded.

Parameter counts are checked against the published totals; the LoRA and optimizer sizes
against hand-worked numbers; weights against a loaded tiny pipeline; disk per iteration
against what a real two-iteration tiny run wrote.
"""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.planning import plan_run
from flowgrpo_cli.planning.architectures import resolve_architecture
from flowgrpo_cli.store.config import load_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted([*REPO.glob("examples/*.toml"), *REPO.glob("examples/toy_ocr/*.toml")])


@pytest.fixture(scope="module")
def weightless_tiny(tmp_path_factory):
    """A tiny SD3 pipeline folder with every weight file deleted: configs only."""
    from flowgrpo_cli.models.tiny import build_tiny_pipeline

    folder = build_tiny_pipeline("sd3", tmp_path_factory.mktemp("weightless") / "tiny-sd3")
    for weights in folder.rglob("*.safetensors"):
        weights.unlink()
    return folder


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_plan_every_example_offline_without_weights(example, weightless_tiny):
    args = ["plan", "--config", str(example), "--json"]
    if example.name == "tiny.toml":  # its model is built by `flowgrpo tiny-model` first
        args += ["--set", f"model.path={weightless_tiny}"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["disk_per_iteration_bytes"] > 0 and plan["disk_total_bytes"] > 0
    assert {"rollout", "update", "evaluate"} <= plan["memory"].keys()
    config = load_config(example)
    assert ("score" in plan["memory"]) == ("pickscore" in config.reward.weights)
    for stage in plan["memory"].values():
        assert stage["total_bytes"] == sum(size for _, size in stage["items"])


def test_plan_renders_tables(weightless_tiny):
    result = CliRunner().invoke(
        app, ["plan", "--config", str(REPO / "examples" / "sd35m_ocr.toml"), "-n", "10"]
    )
    assert result.exit_code == 0, result.output
    for text in (
        "rollout: memory per device",
        "update: memory per device",
        "disk",
        "transformer passes",
        "for 10 iterations",
    ):
        assert text in result.output


# Published totals (the checkpoints' safetensors headers): SD3.5-Medium's transformer stores
# its 226,492,416-element position embedding too, 2.47B in all ("2.5B").
PUBLISHED = {
    "sd3.5-medium": {
        "transformer": 2_243_171_520,
        "text_encoder": 123_650_304,  # CLIP ViT-L/14 text, with projection
        "text_encoder_2": 694_659_840,  # OpenCLIP bigG text, with projection
        "text_encoder_3": 4_762_310_656,  # T5-XXL encoder
        "vae": 83_819_683,
    },
    "flux.1-dev": {
        "transformer": 11_901_408_320,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
        "vae": 83_819_683,
    },
    "flux.1-schnell": {"transformer": 11_891_178_560},  # no guidance embedding
    "flux.1-kontext-dev": {"transformer": 11_901_408_320},  # FLUX.1-dev's, fine-tuned
    "qwen-image": {
        "transformer": 20_430_401_088,
        "text_encoder": 8_292_166_656,  # Qwen2.5-VL-7B-Instruct, vision tower included
        "vae": 126_892_531,
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_architectures_have_published_parameter_counts(name):
    arch = resolve_architecture("", name)
    for component, count in PUBLISHED[name].items():
        assert arch.components[component].parameters == count, component
    if name == "sd3.5-medium":
        transformer = arch.components["transformer"]
        assert transformer.parameters + transformer.buffers == 2_469_663_936
        assert arch.blocks == {"sd35_dual": 13, "sd3": 11}


@pytest.mark.parametrize("family", ["qwenimage_edit", "flux_kontext"])
def test_edit_families_plan_their_source_image(family, make_run, tiny_model_dir):
    """The source's tokens lengthen every forward; its latents are stored once per prompt."""
    config, _ = make_run(family=family)
    arch = resolve_architecture(str(tiny_model_dir(family)))
    # About 1 MP (the pipelines' resize) in 2x2 patches of 8 x 8 pixel latents.
    assert arch.source_tokens == 1024 * 1024 // 16**2
    assert arch.source_elements == 16 * 1024 * 1024 // 8**2
    plan = plan_run(config, iterations=2)
    rollout = dict(plan.memory["rollout"].items)
    forward = next(name for name in rollout if name.startswith("transformer forward"))
    assert "16 image (+ 4096 of the source)" in forward  # 64 x 64: 4 x 4 patches
    assert rollout["text and source-image conditioning of the rank's 2 prompts"] >= (
        2 * arch.source_elements * 4  # float32 tiny model
    )


def test_lora_and_optimizer_bytes_worked_by_hand(make_run):
    config, _ = make_run()  # tiny SD3: 2 blocks of width 64, LoRA r 4 on the joint attention
    plan = plan_run(config, iterations=2)
    # Block 0: 8 target projections 64 -> 64; block 1 (context_pre_only): 7, no to_add_out.
    # Each LoRA pair is r (64 + 64) = 512 weights: 15 x 512 = 7,680, float32.
    assert plan.parameters["trained"] == 7_680
    items = dict(plan.memory["update"].items)
    assert items["LoRA weights, r 4, 0.0M x float32"] == 7_680 * 4
    assert items["AdamW moments (2 x LoRA weights (float32))"] == 2 * 7_680 * 4
    assert items["gradients of the trained weights"] == 7_680 * 4
    # ... and the policy the update trains has exactly that many.
    from flowgrpo_cli.training.policy import load_policy

    policy = load_policy(config, torch.device("cpu"))
    assert sum(p.numel() for p in policy.trainable_parameters()) == 7_680


@pytest.mark.parametrize("family", ["sd35", "flux", "qwenimage", "flux_kontext"])
def test_weights_match_the_loaded_pipeline(family, tiny_model_dir):
    from flowgrpo_cli.models import load_adapter

    arch = resolve_architecture(str(tiny_model_dir(family)))
    adapter = load_adapter(tiny_model_dir(family), dtype=torch.bfloat16, device="cpu")
    for name, component in arch.components.items():
        module = getattr(adapter.pipeline, name)
        loaded = sum(t.numel() * t.element_size() for t in module.parameters())
        loaded += sum(
            b.numel() * b.element_size() for b in module.buffers() if b.is_floating_point()
        )
        assert component.weight_bytes("bfloat16") == loaded, name


def test_disk_per_iteration_matches_a_tiny_run(make_run):
    """The plan's bytes per iteration against the files iteration 1 of a real run wrote:
    exact for the latents, within 2% for the conditioning and 10% for the checkpoint; the
    whole iteration between 1x and 2x what was written (images and grids are counted at the
    3 bytes a pixel no PNG exceeds; the tiny model's images compress to about half)."""
    from flowgrpo_cli.store.rundir import ROLLOUT
    from flowgrpo_cli.store.trajectory import open_part

    config, run = make_run("eval.every=0")
    result = CliRunner().invoke(app, ["loop", "--run", str(run.root), "-n", "2"])
    assert result.exit_code == 0, result.output
    plan = plan_run(config, iterations=2)
    items = dict(plan.disk_per_iteration)

    def item(prefix: str) -> int:
        return next(size for label, size in items.items() if label.startswith(prefix))

    def size(path: Path) -> int:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        return sum(p.stat().st_size for p in files)

    rollout = run.stage_dir(1, ROLLOUT)
    part = open_part(next(rollout.glob("part-*.arrow"))).read_all()
    assert item("trajectory latents") == part.column("latents").nbytes
    conditioning = size(next(rollout.glob("conditioning-*.arrow")))
    assert item("text conditioning") == pytest.approx(conditioning, rel=0.02)
    assert item("checkpoint") == pytest.approx(size(run.checkpoint_dir(1)), rel=0.1)
    events = sum(size(p) for p in run.root.rglob("events.out.tfevents*")) / 2
    written = (
        size(rollout.parent)
        + size(run.checkpoint_dir(1))
        + size(run.samples_path(1))
        + size(run.root / "metrics.jsonl") / 2
        + events
    )
    assert written <= plan.disk_per_iteration_bytes <= 2 * written


def test_unknown_hub_id_asks_for_arch():
    result = CliRunner().invoke(app, ["plan", "--set", "model.path=someone/private-model"])
    assert result.exit_code == 1
    assert "--arch" in result.output
    result = CliRunner().invoke(
        app, ["plan", "--set", "model.path=someone/private-model", "--arch", "flux.1-schnell"]
    )
    assert result.exit_code == 0, result.output


def test_a_plan_that_cannot_be_made_never_stops_a_run():
    from flowgrpo_cli.loop import plan_note

    config = load_config(None, ["model.path=someone/private-model"])
    (line,) = plan_note(config, 10)
    assert line.startswith("plan: not available")
