"""`module:function` plugins: the example plugin, per-image failures, and bad specs."""

import textwrap
from pathlib import Path

import pytest
from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "plugins"


def gray(level: int, width: int = 8) -> Image.Image:
    return Image.new("RGB", (width, 8), (level, level, level))


@pytest.fixture
def plugins(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path holding `rw_plugins.py` (test plugins) and the example's folder."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    (tmp_path / "rw_plugins.py").write_text(
        textwrap.dedent("""
        import math
        import threading

        THRESHOLD = 3

        def fails_on_wide(images, prompts, metadata):
            if any(image.width > 8 for image in images):
                raise ValueError(f"too wide: {[image.width for image in images]}")
            return [1.0] * len(images)

        def nan_on_second(images, prompts, metadata):
            return [float("nan") if meta["sample_id"] == "b" else 2.0 for meta in metadata]

        def one_short(images, prompts, metadata):
            return [1.0] * (len(images) - 1)

        def returns_number(images, prompts, metadata):
            return 1.0

        def target_length(images, prompts, metadata):
            return [len(meta["ground_truth"]) for meta in metadata]
        target_length.needs = {"images", "ground_truths"}

        def bad_needs(images, prompts, metadata):
            return [0.0] * len(images)
        bad_needs.needs = {"images", "captions"}

        def _meet(mine, theirs):
            # Each plugin runs in its own worker process: they meet through files.
            import os, pathlib, time
            folder = pathlib.Path(os.environ["RW_MEET_DIR"])
            (folder / mine).touch()
            deadline = time.monotonic() + 10
            while not (folder / theirs).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{theirs} never came")
                time.sleep(0.01)

        def meets_a(images, prompts, metadata):
            _meet("a", "b")
            return [1.0] * len(images)
        meets_a.parallel_safe = True

        def meets_b(images, prompts, metadata):
            _meet("b", "a")
            return [2.0] * len(images)
        meets_b.parallel_safe = True

        def records_thread(images, prompts, metadata):
            return [float(threading.current_thread() is threading.main_thread())] * len(images)

        def source_level(images, prompts, metadata, source_images):
            levels = [source.getpixel((0, 0))[0] for source in source_images]
            if 7 in levels:
                raise ValueError(f"source levels {levels}")
            return levels
        source_level.needs = {"images", "source_images"}
    """)
    )
    (tmp_path / "rw_broken.py").write_text("import rw_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_example_plugin_by_name(plugins):
    batch = RewardBatch([gray(0), gray(51), gray(255)], prompts=["a", "b", "c"])
    with build_rewards({"brightness:score": 2.0}) as rewards:
        result = rewards.score(batch)
    assert rewards.names == ("brightness:score",)
    assert result.columns["brightness:score"] == pytest.approx([0.0, 0.2, 1.0])
    assert result.reward == pytest.approx([0.0, 0.4, 2.0])
    assert rewards._rewards[0].parallel_safe  # declared by the example


def test_a_raising_plugin_fails_only_the_images_that_raise(plugins):
    batch = RewardBatch([gray(0), gray(0, width=9), gray(0)], prompts=["a", "b", "c"])
    with build_rewards({"rw_plugins:fails_on_wide": 1.0}) as rewards:
        result = rewards.score(batch)
    assert result.columns["rw_plugins:fails_on_wide"] == [1.0, None, 1.0]
    assert result.reward == [1.0, None, 1.0]
    assert result.reward_error == [
        None,
        "rw_plugins:fails_on_wide: ValueError: too wide: [9]",
        None,
    ]


def test_nan_is_an_error_for_that_image(plugins):
    batch = RewardBatch(
        [gray(0)] * 3, prompts=["p"] * 3, metadata=[{"sample_id": s} for s in "abc"]
    )
    with build_rewards({"rw_plugins:nan_on_second": 1.0}) as rewards:
        result = rewards.score(batch)
    assert result.columns["rw_plugins:nan_on_second"] == [2.0, None, 2.0]
    assert result.reward_error[1] == "rw_plugins:nan_on_second: returned nan"


def test_plugin_sees_ground_truth_in_metadata_when_it_needs_it(plugins):
    with build_rewards({"rw_plugins:target_length": 1.0}) as rewards:
        result = rewards.score(RewardBatch([gray(0)] * 2, ground_truths=["OPEN", "Hi there"]))
        assert result.columns["rw_plugins:target_length"] == [4.0, 8.0]
        with pytest.raises(FlowGrpoError, match="needs ground_truths"):
            rewards.score(RewardBatch([gray(0)], prompts=["no targets here"]))


def test_plugin_gets_source_images_by_keyword_when_it_needs_them(plugins):
    """A call that raises is retried image by image with each image's own source; a plugin
    without the need is called with three arguments, source images or not."""
    images, sources = [gray(0)] * 3, [gray(3), gray(7), gray(5)]
    weights = {"rw_plugins:source_level": 1.0, "rw_plugins:target_length": 1.0}
    with build_rewards(weights) as rewards:
        batch = RewardBatch(images, ground_truths=["ab", "c", ""], source_images=sources)
        result = rewards.score(batch)
        assert result.columns["rw_plugins:source_level"] == [3.0, None, 5.0]
        assert result.columns["rw_plugins:target_length"] == [2.0, 1.0, 0.0]
        assert result.reward_error[1] == "rw_plugins:source_level: ValueError: source levels [7]"
        with pytest.raises(FlowGrpoError, match="needs source_images"):
            rewards.score(RewardBatch([gray(0)], ground_truths=["a"]))
    with pytest.raises(ValueError, match="2 source_images for 3 images"):
        RewardBatch(images, source_images=sources[:2])


def test_plugins_declared_parallel_safe_run_at_the_same_time(plugins, tmp_path, monkeypatch):
    # Each waits for the other to arrive: run one after the other, the first would time out.
    monkeypatch.setenv("RW_MEET_DIR", str(tmp_path))
    weights = {
        "rw_plugins:meets_a": 1.0,
        "rw_plugins:records_thread": 1.0,
        "rw_plugins:meets_b": 1.0,
    }
    with build_rewards(weights) as rewards:
        result = rewards.score(RewardBatch([gray(0)], prompts=["p"]))
    assert result.reward == [4.0]  # 1 + 2, and 1 from the main thread of its worker
    assert rewards.names == tuple(weights)  # column order is the config's, not finishing order


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rw_plugins:one_short", "returned 1 values for 2 images"),
        ("rw_plugins:returns_number", "returned a float; expected a list of 2 numbers"),
    ],
)
def test_wrong_shaped_returns_are_clear_errors(plugins, spec, message):
    with build_rewards({spec: 1.0}) as rewards, pytest.raises(FlowGrpoError, match=message):
        rewards.score(RewardBatch([gray(0)] * 2, prompts=["p"] * 2))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("rw_no_such_module:score", "no module named 'rw_no_such_module'"),
        ("rw_no_such_pkg.sub:score", "no module named 'rw_no_such_pkg'"),
        ("rw_broken:score", "importing 'rw_broken' failed: No module named 'rw_no_such_dep"),
        ("rw_plugins:missing", "has no attribute 'missing'; its functions: bad_needs, "),
        ("rw_plugins:THRESHOLD", "is a int, not a function"),
        ("rw_plugins:bad_needs", r"unknown `needs` \['captions'\]"),
        ("rw_plugins:", "expected `module:function`"),
        (":score", "expected `module:function`"),
        ("a:b:c", "expected `module:function`"),
        ("my plugin:score", "expected `module:function`"),
    ],
)
def test_bad_specs_are_clear_errors(plugins, spec, message):
    with pytest.raises(FlowGrpoError, match=message) as caught:
        build_rewards({spec: 1.0})
    assert repr(spec) in str(caught.value)  # says which reward
