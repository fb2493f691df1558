"""The registry, build_rewards, RewardSet.score and the two entry points the CLI calls."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import (
    REWARD_NAMES,
    ImageScore,
    RewardBatch,
    ScoreResult,
    build_rewards,
    build_rewards_from_config,
    score_batches,
    score_image_files,
)
from flowgrpo_cli.rewards.jpeg import jpeg_size_kb
from flowgrpo_cli.store.config import RemoteRewardSection, RewardSection, load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"
REPO = Path(__file__).resolve().parents[1]


def gray(level: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (level, level, level))


@pytest.fixture
def example_plugin(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_importing_the_package_loads_no_ocr_engine():
    code = (
        "import sys, flowgrpo_cli.rewards; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('rapidocr_onnxruntime', 'onnxruntime', 'cv2', 'rapidfuzz', 'torch', 'http')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO)},
    )
    assert out.stdout.strip() == "[]"


def test_build_from_the_config_reward_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        "[reward]\nocr_workers = 1\n"
        "[reward.weights]\njpeg_compressibility = 0.2\nremote = 0.5\n"
        '[reward.remote]\nurl = "http://127.0.0.1:9/score"\ntimeout_s = 7.5\nbatch_size = 4\n'
    )
    with build_rewards_from_config(load_config(path, []).reward) as rewards:
        assert rewards.names == ("jpeg_compressibility", "remote")
        assert rewards.weights == {"jpeg_compressibility": 0.2, "remote": 0.5}
        assert rewards._rewards[1].options == RemoteRewardSection(
            url="http://127.0.0.1:9/score", timeout_s=7.5, max_retries=3, batch_size=4
        )
    # No url: `remote` is named without a server.
    section = load_config(None, ["reward.weights={remote = 1.0}"]).reward
    with pytest.raises(FlowGrpoError, match=r"set \[reward.remote\] url"):
        build_rewards_from_config(section)


def test_unknown_name_lists_the_valid_ones_and_the_nearest():
    with pytest.raises(FlowGrpoError) as caught:
        build_rewards({"ocrr": 1.0})
    message = str(caught.value)
    assert "unknown reward 'ocrr' (did you mean 'ocr'?)" in message
    assert all(name in message for name in REWARD_NAMES)
    assert "`module:function`" in message


def test_every_name_is_checked_before_any_reward_is_built():
    # `remote` alone would fail for its missing url; the typo is reported first.
    with pytest.raises(FlowGrpoError, match="unknown reward 'jpeg'"):
        build_rewards({"remote": 1.0, "jpeg": 1.0})


@pytest.mark.parametrize("weight", ["1.0", math.nan, math.inf, True, None])
def test_weights_must_be_finite_numbers(weight):
    with pytest.raises(FlowGrpoError, match=r"weights: 'ocr' = .*must be a finite number"):
        build_rewards({"ocr": weight})


def test_empty_weights():
    with pytest.raises(FlowGrpoError, match="weights is empty"):
        build_rewards({})


def test_a_missing_input_is_named():
    with (
        build_rewards({"ocr": 1.0}) as rewards,
        pytest.raises(FlowGrpoError, match="reward 'ocr' needs ground_truths"),
    ):
        rewards.score(RewardBatch([gray(0)], prompts=["no targets"]))


@pytest.mark.parametrize(
    ("raw", "value", "error"),
    [
        (0.5, 0.5, None),
        (np.float32(0.25), 0.25, None),
        (torch.tensor(2.0), 2.0, None),
        (3, 3.0, None),
        (math.inf, None, "returned inf"),
        (-math.inf, None, "returned -inf"),
        (False, None, "returned False, not a number"),
        ("0.5", None, "returned '0.5', not a number"),
        (None, None, "returned None, not a number"),
        ([1.0], None, "returned [1.0], not a number"),
    ],
)
def test_checked_values(raw, value, error):
    assert ImageScore.checked(raw) == ImageScore(value=value, error=error)


def test_total_is_the_weighted_sum_and_none_where_any_reward_failed(example_plugin):
    images = [gray(51), gray(255), Image.new("RGB", (0, 0))]
    weights = {"brightness:score": 2.0, "jpeg_compressibility": 0.5}
    with build_rewards(weights) as rewards:
        result = rewards.score(RewardBatch(images, prompts=["a", "b", "c"]))
    assert result.names == rewards.names == ("brightness:score", "jpeg_compressibility")
    for index, level in enumerate([0.2, 1.0]):
        kb = jpeg_size_kb(images[index])
        assert result.reward[index] == pytest.approx(2.0 * level + 0.5 * (-kb / 500))
    # JPEG cannot hold an empty image: no total, though brightness keeps its column value.
    assert result.columns["brightness:score"][2] == 0.0
    assert result.columns["jpeg_compressibility"][2] is None
    assert result.reward[2] is None
    assert result.reward_error[2].startswith("jpeg_compressibility: ValueError")


def test_concat_joins_batches_in_order(example_plugin):
    with build_rewards({"brightness:score": 1.0}) as rewards:
        parts = [rewards.score(RewardBatch([gray(level)], prompts=["p"])) for level in (0, 255)]
    joined = ScoreResult.concat(parts)
    assert joined.columns == {"brightness:score": [0.0, 1.0]}
    assert joined.reward == [0.0, 1.0]
    assert joined.reward_error == [None, None]
    assert len(joined) == 2


def test_score_batches_applies_the_policy_across_chunks(example_plugin):
    def chunk(images, start):
        return RewardBatch(
            images,
            prompts=["p"] * len(images),
            metadata=[
                {"sample_id": f"s{start + i}", "group_id": (start + i) // 2}
                for i in range(len(images))
            ],
        )

    # Group 1 (s2, s3) spans the two chunks; JPEG cannot score s3. Weight 0: computed and
    # checked, not counted.
    batches = [chunk([gray(0), gray(51), gray(102)], 0), chunk([Image.new("RGB", (0, 0))], 3)]
    with build_rewards({"brightness:score": 1.0, "jpeg_compressibility": 0.0}) as rewards:
        scored = score_batches(rewards, batches, "drop_group")
        assert scored.result.reward[:3] == pytest.approx([0.0, 0.2, 0.4])
        assert scored.outcome.keep == [True, True, False, False]
        assert scored.summary.failures == {"brightness:score": 0, "jpeg_compressibility": 1}
        with pytest.raises(FlowGrpoError, match="sample s3 \\(group 1\\)"):
            score_batches(rewards, batches, "stop")


def render(text: str) -> Image.Image:
    image = Image.new("RGB", (512, 512), "white")
    ImageDraw.Draw(image).text((24, 220), text, fill="black", font=ImageFont.load_default(size=48))
    return image


def test_score_image_files_reads_targets_from_prompts(tmp_path):
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    render("Hello World").save(paths[0])
    render("Hello World").save(paths[1])
    prompts = ['A sign that says "Hallo World"', "A sign with no quoted text"]
    result = score_image_files(paths, prompts, RewardSection())
    assert result.columns["ocr"] == [pytest.approx(0.9), None]
    assert result.details["ocr"]["text"] == ["Hello World", "Hello World"]
    assert "no quoted target text" in result.reward_error[1]


def test_score_image_files_input_errors(tmp_path):
    (tmp_path / "not.png").write_text("not an image")
    with pytest.raises(FlowGrpoError, match="1 prompt\\(s\\) for 2 image\\(s\\)"):
        score_image_files([tmp_path / "a.png", tmp_path / "b.png"], ["p"], RewardSection())
    with pytest.raises(FlowGrpoError, match=r"missing\.png: no such image file"):
        score_image_files([tmp_path / "missing.png"], ["p"], RewardSection())
    with pytest.raises(FlowGrpoError, match=r"not\.png: cannot read the image"):
        score_image_files([tmp_path / "not.png"], ["p"], RewardSection())
