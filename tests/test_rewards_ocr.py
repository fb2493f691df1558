"""The `ocr` reward: the distance by hand, then RapidOCR on text rendered here with Pillow."""

import os
import signal
from pathlib import Path

import pytest
from PIL import Image, ImageDraw, ImageFont

from benchmarks.ocr_images import ocr_throughput, render_text_images
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards, ocr
from flowgrpo_cli.rewards.ocr import OcrReward, normalize, ocr_distance, ocr_score
from flowgrpo_cli.store.config import RewardSection

DEJAVU_SERIF_BOLD = Path("/usr/share/fonts/truetype/dejavu/DejaVuSerif-Bold.ttf")


def font(kind: str, size: int) -> ImageFont.FreeTypeFont:
    if kind == "dejavu-serif-bold":
        if not DEJAVU_SERIF_BOLD.is_file():
            pytest.skip(f"no {DEJAVU_SERIF_BOLD} on this system")
        return ImageFont.truetype(str(DEJAVU_SERIF_BOLD), size)
    return ImageFont.load_default(size=size)


def render(
    text: str,
    kind: str = "default",
    size: int = 48,
    stroke: int = 0,
    width: int = 512,
    height: int = 512,
) -> Image.Image:
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text(
        (24, height // 2 - size),
        text,
        fill="black",
        font=font(kind, size),
        stroke_width=stroke,
        stroke_fill="black",
    )
    return image


def score_one(image: Image.Image, target: str, reward: OcrReward) -> float | None:
    output = reward.score(RewardBatch([image], ground_truths=[target]))
    return output.scores[0].value


@pytest.fixture(scope="module")
def in_process() -> OcrReward:
    return OcrReward(workers=1)


# --- the distance, by hand -------------------------------------------------------------


def test_normalize_lowercases_and_removes_every_white_space():
    assert normalize("  Open\t24 HOURS\n\u00a0now ") == "open24hoursnow"


@pytest.mark.parametrize(
    ("read", "target", "distance"),
    [
        ("OPEN", "open", 0),  # case
        ("O P E N", "open", 0),  # spaces dropped or added by the engine
        ("we are open today", "OPEN", 0),  # target inside what was read
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("opem", "open", 1),
        ("", "open", 4),  # nothing read: the full length
        ("a completely different and long reading", "open", 4),  # capped at len(target)
    ],
)
def test_distance(read, target, distance):
    assert ocr_distance(read, target) == distance


def test_score_is_one_minus_distance_over_target_length():
    assert ocr_score("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert ocr_score("Hallo World", "hello world") == pytest.approx(1 - 1 / 10)
    assert ocr_score("", "open") == 0.0
    assert ocr_score("xxxxxxxxxxxxxxxxxxxxxxxx", "ab") == 0.0  # never below 0


def test_empty_target_is_an_error_not_a_free_point():
    with pytest.raises(ValueError, match="empty once white space is removed"):
        ocr_score("anything", " \t ")


# --- the engine on rendered text ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "size", "stroke"),
    [("default", 32, 0), ("default", 64, 0), ("default", 40, 2), ("dejavu-serif-bold", 48, 0)],
)
def test_exact_text_scores_one(in_process, kind, size, stroke):
    assert score_one(render("Hello World", kind, size, stroke), "Hello World", in_process) == 1.0


@pytest.mark.parametrize("kind", ["default", "dejavu-serif-bold"])
def test_one_wrong_character_costs_one_over_n(in_process, kind):
    # "Hallo World" against "Hello World": 1 edit, n = 10 once the space is removed.
    image = render("Hallo World", kind, 48)
    assert score_one(image, "Hello World", in_process) == pytest.approx(1 - 1 / 10)


def test_target_inside_longer_text_scores_one(in_process):
    image = render("Big Sale Today Only", size=40)
    assert score_one(image, "sale today", in_process) == 1.0


def test_case_and_white_space_are_ignored(in_process):
    image = render("COFFEE   SHOP", size=48)
    assert score_one(image, "  Coffee\tshop ", in_process) == 1.0


def test_blank_image_scores_zero_and_reads_nothing(in_process):
    output = in_process.score(
        RewardBatch([Image.new("RGB", (512, 512), "white")], ground_truths=["Hello World"])
    )
    assert output.scores[0].value == 0.0
    assert output.details == {"text": [""]}


def test_failures_are_per_image_errors_not_zeros(in_process):
    images = [render("Hello World"), Image.new("RGB", (0, 0)), render("Hello World")]
    output = in_process.score(RewardBatch(images, ground_truths=["hello world", "x", None]))
    first, empty, no_target = output.scores
    assert first.value == 1.0 and first.error is None
    assert empty.value is None and "OCR engine failed" in empty.error
    assert no_target.value is None and "no quoted target text in the prompt" in no_target.error
    assert output.details["text"][0] == "Hello World"
    assert output.details["text"][1] is None


def test_engine_is_built_once_per_process(in_process):
    in_process.score(RewardBatch([render("one"), render("two")], ground_truths=["a", "b"]))
    assert ocr._engine.cache_info().misses == 1


def engine_builds() -> int:
    """Run in a worker: how many engines that process has built."""
    return ocr._engine.cache_info().misses


def test_worker_pool_matches_in_process_one_engine_per_worker_and_a_dead_worker_is_named():
    texts = ["Hello World", "Hallo World", "OPEN 24 HOURS", "coffee shop"]
    batch = RewardBatch(
        [render(text, size=44) for text in texts],
        ground_truths=["hello world"] * 2 + ["open 24 hours", "coffee shop"],
    )
    with build_rewards({"ocr": 1.0}, RewardSection(ocr_workers=2)) as rewards:
        result = rewards.score(batch)
        pool = rewards._rewards[0]._pool
        engines_built = {pool.submit(engine_builds).result() for _ in range(6)}
        os.kill(next(iter(pool._processes)), signal.SIGKILL)  # as the OOM killer would
        with pytest.raises(FlowGrpoError, match=r"an OCR worker process died.*ocr_workers"):
            rewards.score(batch)
    assert result.columns["ocr"] == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert [normalize(text) for text in result.details["ocr"]["text"]] == [
        normalize(text) for text in texts
    ]
    assert engines_built == {1}


def test_benchmark_images_are_readable_and_repeatable(in_process):
    batch = render_text_images(3)
    assert [image.tobytes() for image in render_text_images(3).images] == [
        image.tobytes() for image in batch.images
    ]
    assert [score.value for score in in_process.score(batch).scores] == [1.0, 1.0, 1.0]
    assert ocr_throughput(num_images=2, workers=1) > 0
