"""The `geneval` reward: a tiny random Mask2Former (COCO's 80 classes) and a tiny CLIP built
from configs and loaded through the released models' path; boxes, crops and the colour
classifier checked by hand; the score choice; `flowgrpo reward`, `serve-reward` and a
two-iteration `flowgrpo loop` on the tiny SD3 with GenEval prompts."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import serving_reward
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.models.tiny import build_tiny_clip, build_tiny_mask2former
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.rewards.geneval import COLOUR_TEMPLATES, _box
from flowgrpo_cli.rewards.geneval_rules import COLOURS, Detection
from flowgrpo_cli.rewards.registry import reward_needs
from flowgrpo_cli.store.config import GenEvalSection, RewardSection

BOWL = {"tag": "single_object", "include": [{"class": "bowl", "count": 1}],
        "prompt": "a photo of a bowl"}  # fmt: skip
RED_CUP = {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}],
           "prompt": "a photo of a red cup"}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval")
    build_tiny_mask2former(root / "detector")
    build_tiny_clip(root / "clip")
    return root


def options(models, **changes) -> RewardSection:
    paths = {"detector": str(models / "detector"), "clip": str(models / "clip")}
    table = GenEvalSection(**{**paths, **changes})
    return RewardSection(device="cpu", batch_size=2, geneval=table)


def images(count: int = 3) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(0)
    return [
        Image.fromarray(torch.randint(0, 256, (64, 64, 3), generator=generator).byte().numpy())
        for _ in range(count)
    ]


def batch(records: list) -> RewardBatch:
    meta = [{"sample_id": f"s{i}", "group_id": i, "geneval": r} for i, r in enumerate(records)]
    prompts = [r.get("prompt", "") for r in records]
    return RewardBatch(images(len(records)), prompts, metadata=meta)


def test_needs_are_known_without_loading_a_model():
    assert reward_needs("geneval") == frozenset({"images", "geneval"})


def test_a_box_is_the_masks_bounding_box_with_the_end_pixel_counted():
    mask = np.zeros((6, 8), dtype=bool)
    mask[1:4, 2:5] = True  # rows 1-3, columns 2-4
    mask[2, 6] = True  # a stray pixel widens it to column 6
    # x1 = 2, y1 = 1, x2 = 6 + 1 = 7, y2 = 3 + 1 = 4 (mmdet's mask2bbox)
    assert _box(mask) == (2.0, 1.0, 7.0, 4.0)


def test_the_colour_is_clips_pick_among_the_mean_of_its_prompts(models, monkeypatch):
    """Text embeddings chosen by hand: colour c's three prompts embed to unit vectors whose
    mean points at axis c, except red's, which average to axis 1 (orange's) too; the crop
    embeds to axis 1. Both red and orange score cos = 1: the first, red, wins the argmax. With
    red's prompts moved to axis 0, orange alone matches."""
    with build_rewards({"geneval": 1.0}, options(models)) as rewards:
        reward = rewards._rewards[0]
        dims = len(COLOURS)

        def text_embeddings(texts):
            assert len(texts) == dims * len(COLOUR_TEMPLATES)
            assert texts[:3] == ["a photo of a red cup", "a photo of a red-colored cup",
                                 "a photo of a red object"]  # fmt: skip
            rows = torch.zeros(len(texts), dims)
            for index in range(len(texts)):  # colour c's prompts: rows 3c to 3c + 2
                rows[index, index // len(COLOUR_TEMPLATES)] = 1.0
            rows[:3] = 0.0
            rows[:3, red_axis] = 1.0  # red's prompts
            return rows

        crops = []

        def image_embeddings(images):
            crops.extend(images)
            out = torch.zeros(len(images), dims)
            out[:, 1] = 1.0
            return out

        monkeypatch.setattr(reward.clip, "text_embeddings", text_embeddings)
        monkeypatch.setattr(reward.clip, "image_embeddings", image_embeddings)
        image = Image.new("RGB", (8, 8), (200, 10, 10))
        mask = np.zeros((8, 8), dtype=bool)
        mask[1:4, 2:5] = True
        mask[1, 2] = False  # a pixel of the box outside the object: grey
        detection = Detection(0.9, _box(mask), mask)
        red_axis = 1
        reward._classifiers.clear()
        assert reward._coloured(image, "cup", [detection])[0].colour == "red"
        red_axis = 0
        reward._classifiers.clear()
        assert reward._coloured(image, "cup", [detection])[0].colour == "orange"
        crop = crops[0]
        assert crop.size == (3, 3)  # the box (2, 1, 5, 4)
        assert crop.getpixel((0, 0)) == (153, 153, 153)  # GenEval's #999 behind the object
        assert crop.getpixel((1, 1)) == (200, 10, 10)


def test_the_detections_go_to_the_rules_and_the_configured_score_is_the_reward(models, monkeypatch):
    """Three bowls found for "a photo of a bowl" (1 asked), scores 0.95, 0.8, 0.5, all kept
    above GenEval's 0.3. By hand: correct (at least 1) = 1; strict (exactly 1) = 0; partial =
    1 - |1 - 3| / 1 = -1."""
    found = {"bowl": [Detection(s, (0.0, 0.0, 4.0, 4.0)) for s in (0.95, 0.8, 0.5)]}
    for score, expected in (("correct", 1.0), ("strict", 0.0), ("partial", -1.0)):
        with build_rewards({"geneval": 1.0}, options(models, score=score)) as rewards:
            reward = rewards._rewards[0]
            monkeypatch.setattr(reward, "detect", lambda images, records: [found] * len(images))
            result = rewards.score(batch([BOWL]))
        assert result.columns["geneval"] == [expected]
        details = result.details["geneval"]
        assert (details["correct"], details["strict"], details["partial"]) == (
            [True],
            [0.0],
            [-1.0],
        )


def test_only_kept_detections_of_colour_classes_are_coloured(models, monkeypatch):
    """A fake segmentation: cup 0.9 and cup 0.1 (below GenEval's 0.3), bowl 0.8; label ids
    in COCO order (cup 41, bowl 45). Only the kept cup gets a mask and a colour."""
    with build_rewards({"geneval": 1.0}, options(models)) as rewards:
        reward = rewards._rewards[0]
        masks = torch.zeros(3, 64, 64)
        masks[0, 10:20, 10:30] = 1
        masks[1, 0:5, 0:5] = 1
        masks[2, 40:50, 40:60] = 1
        segments = [{"id": 0, "label_id": 41, "score": 0.9},
                    {"id": 1, "label_id": 41, "score": 0.1},
                    {"id": 2, "label_id": 45, "score": 0.8}]  # fmt: skip
        result = {"segmentation": masks, "segments_info": segments}
        monkeypatch.setattr(reward, "_segment", lambda chunk: [result] * len(chunk))
        monkeypatch.setattr(
            reward, "_coloured",
            lambda image, name, found: [Detection(d.score, d.box, d.mask, "blue") for d in found],
        )  # fmt: skip
        [found] = reward.detect(images(1), [RED_CUP])
    assert [d.score for d in found["cup"]] == [0.9, 0.1]
    assert [d.colour for d in found["cup"]] == ["blue", None]
    assert found["cup"][0].box == (10.0, 10.0, 30.0, 20.0)
    assert found["cup"][0].mask is not None and found["bowl"][0].mask is None


def test_the_tiny_models_score_every_image_and_a_bad_record_fails_only_its_own(models):
    bad = {**BOWL, "include": [{"class": "unicorn", "count": 1}]}
    with build_rewards({"geneval": 1.0}, options(models)) as rewards:
        result = rewards.score(batch([BOWL, bad, RED_CUP]))
        info = rewards.info["geneval"]
    assert result.columns["geneval"][0] is not None and result.columns["geneval"][2] is not None
    assert result.columns["geneval"][1] is None
    assert "include[0].class 'unicorn' is not one of COCO's 80" in result.reward_error[1]
    assert info["detector"] == str(models / "detector") and info["score"] == "partial"
    assert (info["detector_dtype"], info["clip_dtype"]) == ("float32", "float32")


def test_the_detector_stays_float32_under_auto_and_follows_an_explicit_dtype(models):
    """auto: float16 for CLIP on a GPU, float32 on the CPU, and the detector float32 always;
    an explicit dtype sets both."""
    with build_rewards({"geneval": 1.0}, options(models)) as rewards:
        assert rewards._rewards[0].detector.dtype == torch.float32
    settings = options(models)
    settings = RewardSection(device="cpu", dtype="bfloat16", geneval=settings.geneval)
    with build_rewards({"geneval": 1.0}, settings) as rewards:
        assert rewards.info["geneval"]["detector_dtype"] == "bfloat16"
        assert rewards._rewards[0].detector.dtype == torch.bfloat16
        result = rewards.score(batch([BOWL, RED_CUP]))
    assert all(value is not None for value in result.reward), result.reward_error


def test_bad_model_sources_are_clear_errors(models, tmp_path):
    with pytest.raises(FlowGrpoError, match=r"\[reward.geneval\] detector = .*no preprocessor"):
        build_rewards({"geneval": 1.0}, options(models, detector=str(tmp_path)))
    clip = tmp_path / "clip"  # a CLIP folder with an image processor, as on the Hub
    shutil.copytree(models / "clip", clip)
    shutil.copy(models / "detector" / "preprocessor_config.json", clip)
    with pytest.raises(FlowGrpoError, match=r"detector = .*a clip model, not a Mask2Former"):
        build_rewards({"geneval": 1.0}, options(models, detector=str(clip)))
    ade = tmp_path / "ade"  # a Mask2Former of another label set
    build_tiny_mask2former(ade)
    config = json.loads((ade / "config.json").read_text())
    config["id2label"] = {str(i): f"class {i}" for i in range(150)}
    config["label2id"] = {f"class {i}": i for i in range(150)}
    (ade / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlowGrpoError, match="150 classes, not COCO's 80"):
        build_rewards({"geneval": 1.0}, options(models, detector=str(ade)))
    with pytest.raises(FlowGrpoError, match="detector = 'facebook/mask2former-swin-small-coco"):
        # the default, not in this offline cache: named, not a traceback
        build_rewards({"geneval": 1.0}, options(models, detector=GenEvalSection().detector))
    with pytest.raises(FlowGrpoError, match=r"\[reward.geneval\] clip = "):
        build_rewards({"geneval": 1.0}, options(models, clip=str(tmp_path)))
    with pytest.raises(FlowGrpoError, match=r"`reward\.geneval\.score` = 'best'"):
        GenEvalSection(score="best")  # type: ignore[arg-type]


def test_flowgrpo_reward_reads_the_records_of_a_geneval_file(models, tmp_path):
    paths = []
    for index, image in enumerate(images(2)):
        paths.append(tmp_path / f"{index}.png")
        image.save(paths[-1])
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps(BOWL) + "\n" + json.dumps(RED_CUP) + "\n")
    config = tmp_path / "rewards.toml"
    config.write_text(
        f'[reward]\ndevice = "cpu"\nweights = {{ geneval = 1.0 }}\n'
        f'[reward.geneval]\ndetector = "{models}/detector"\nclip = "{models}/clip"\n'
    )
    runner = CliRunner()
    args = ["reward", "-c", str(config), "--geneval", str(records), *map(str, paths)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    with build_rewards({"geneval": 1.0}, options(models)) as rewards:
        expected = rewards.score(
            RewardBatch([Image.open(p) for p in paths], metadata=[{"geneval": BOWL},
                                                                  {"geneval": RED_CUP}])
        ).reward  # fmt: skip
    for value in expected:
        assert f"{value:.4f}" in result.output
    result = runner.invoke(app, ["reward", "-c", str(config), str(paths[0])])
    assert result.exit_code == 1 and "--prompt TEXT (or --geneval" in result.output
    records.write_text(json.dumps({**BOWL, "tag": "shapes"}) + "\n")
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and f"{records}:1: GenEval record" in result.output


def test_serve_reward_scores_geneval_as_in_process(models, tmp_path):
    pytest.importorskip("uvicorn")
    from flowgrpo_cli.store.config import RemoteRewardSection

    config = tmp_path / "rewards.toml"
    config.write_text(
        f'[reward]\ndevice = "cpu"\nweights = {{ geneval = 1.0 }}\n'
        f'[reward.geneval]\ndetector = "{models}/detector"\nclip = "{models}/clip"\n'
    )
    with serving_reward("-c", str(config), announces="serving geneval") as url:
        with build_rewards({"geneval": 1.0}, options(models)) as local:
            expected = local.score(batch([BOWL, RED_CUP]))
        remote = RewardSection(remote=RemoteRewardSection(url=url))
        with build_rewards({"remote": 1.0}, remote) as rewards:
            served = rewards.score(batch([BOWL, RED_CUP]))
            assert served.reward == pytest.approx(expected.reward, abs=1e-6)
            no_record = RewardBatch(images(1), ["p"], metadata=[{"sample_id": "x", "group_id": 0}])
            with pytest.raises(FlowGrpoError, match="`geneval` is missing"):
                rewards.score(no_record)


def test_two_iterations_of_loop_on_geneval_prompts(models, tmp_path, tiny_model_dir):
    prompts = tmp_path / "geneval.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in (BOWL, RED_CUP)))
    overrides = [
        f"run.dir={tmp_path / 'run'}", f"data.train={prompts}", f"data.test={prompts}",
        f"model.path={tiny_model_dir('sd3')}", "model.dtype=float32", "model.device=cpu",
        "model.height=64", "model.width=64", "sampler.num_steps=3", "sampler.batch_size=4",
        "algorithm.group_size=2", "algorithm.prompts_per_iteration=2", "train.lora_rank=4",
        "train.lora_alpha=8", "train.micro_batch_size=2", "eval.every=0",
        "reward.weights={geneval = 1.0}", 'reward.device="cpu"',
        f'reward.geneval.detector="{models}/detector"', f'reward.geneval.clip="{models}/clip"',
    ]  # fmt: skip
    args = ["loop", "--iterations", "2"]
    for override in overrides:
        args += ["--set", override]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert len(metrics) == 2
    assert all(m["score/failed_images"] == 0 for m in metrics)
    # every image scored, by the geneval reward's own column (a number, maybe negative)
    assert all(isinstance(m["reward/geneval_mean"], float) for m in metrics), metrics[0]
