"""Score stage: reward columns, the weighted total, per-image errors and the on_error policy."""

import pytest
from helpers import do_rollout, do_score

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import SCORE, read_manifest
from flowgrpo_cli.store.trajectory import read_table

# Fails on the second image of group 1: a NaN score is an error for that image alone.
PLUGIN = """
import math

def score(images, prompts, metadata):
    return [math.nan if m["sample_id"].endswith("g0001-k001") else 1.0 for m in metadata]
"""


def scores_of(run, iteration=0):
    folder = run.stage_dir(iteration, SCORE)
    manifest = read_manifest(folder)
    return read_table([folder / p["name"] for p in manifest["parts"]]).to_pydict(), manifest


def test_scores_have_a_column_per_reward_and_the_weighted_total(make_run):
    config, run = make_run(
        "reward.weights={jpeg_compressibility = 1.0, jpeg_incompressibility = 0.5}"
    )
    do_rollout(config, run)
    do_score(config, run)
    table, manifest = scores_of(run)
    assert list(table) == [
        "sample_id", "jpeg_compressibility", "jpeg_incompressibility", "reward", "reward_error",
    ]  # fmt: skip
    for c, i, total in zip(table["jpeg_compressibility"], table["jpeg_incompressibility"],
                           table["reward"], strict=True):  # fmt: skip
        assert c == -i  # minus and plus the same JPEG size
        assert total == pytest.approx(1.0 * c + 0.5 * i)
    assert table["reward_error"] == [None] * 4
    assert manifest["rewards"] == ["jpeg_compressibility", "jpeg_incompressibility"]
    assert manifest["stats"]["reward"]["count"] == 4


@pytest.fixture
def plugin_run(make_run, tmp_path, monkeypatch):
    (tmp_path / "flaky_reward.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(on_error):
        config, run = make_run(
            'reward.weights={"flaky_reward:score" = 1.0}', f"reward.on_error={on_error}",
            name=f"run-{on_error}",
        )  # fmt: skip
        do_rollout(config, run)
        return config, run

    return make


def test_drop_sample_drops_only_the_failed_image(plugin_run):
    config, run = plugin_run("drop_sample")
    do_score(config, run)
    table, manifest = scores_of(run)
    assert table["reward"] == [1.0, 1.0, 1.0, None]
    assert "flaky_reward:score" in table["reward_error"][3]
    assert table["flaky_reward:score"][3] is None
    assert manifest["counts"] == {"images": 4, "failed": 1, "dropped": 1}


def test_drop_group_drops_the_whole_group(plugin_run):
    config, run = plugin_run("drop_group")
    do_score(config, run)
    table, manifest = scores_of(run)
    assert table["reward"] == [1.0, 1.0, None, None]
    assert manifest["counts"]["dropped"] == 2


def test_stop_names_the_sample_and_writes_no_manifest(plugin_run):
    config, run = plugin_run("stop")
    with pytest.raises(FlowGrpoError, match="i000000-g0001-k001"):
        do_score(config, run)
    assert read_manifest(run.stage_dir(0, SCORE)) is None


def test_score_needs_a_finished_rollout(make_run):
    config, run = make_run()
    with pytest.raises(FlowGrpoError, match="run `flowgrpo rollout` first"):
        do_score(config, run)
