"""What used to end in a traceback ends in one line naming the file or key: malformed
manifests, a config that is not UTF-8, a seed or noise level out of range, a full or read-only
disk, a reward plugin that calls sys.exit(), rewards too large to add up."""

import errno
import json
import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import do_rollout, do_score
from PIL import Image
from typer.testing import CliRunner

from flowgrpo_cli.algorithm.advantages import compute_advantages
from flowgrpo_cli.algorithm.sde import check_noise_level, sde_step
from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import RewardBatch, build_rewards
from flowgrpo_cli.store import rundir
from flowgrpo_cli.store.config import load_config
from flowgrpo_cli.store.rundir import ROLLOUT, SCORE, atomic_file, read_manifest

runner = CliRunner()


@pytest.mark.parametrize(
    ("manifest", "problem"),
    [
        ([1, 2], "a JSON list, not an object"),
        ({"stage": "rollout"}, "`schema_version` is missing or not a int"),
        ({"schema_version": 1, "stage": "x", "identity": {}, "counts": {}, "parts": 5},
         "`parts` is missing or not a list"),
        ({"schema_version": 1, "stage": "x", "identity": {}, "counts": {}, "parts": ["a"]},
         "`parts[0]` is not an object"),
        ({"schema_version": 1, "stage": "x", "identity": {}, "counts": {},
          "parts": [{"name": "a", "bytes": "12", "sha256": "f"}]},
         "`parts[0].bytes` is missing or not a int"),
    ],
)  # fmt: skip
def test_a_manifest_of_the_wrong_shape_names_the_file_and_the_key(tmp_path, manifest, problem):
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FlowGrpoError) as caught:
        read_manifest(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'manifest.json'}: not a flowgrpo manifest")
    assert problem in str(caught.value)


def test_inspect_of_a_stage_with_a_wrong_shaped_manifest(make_run):
    config, run = make_run()
    do_rollout(config, run)
    path = run.stage_dir(0, ROLLOUT) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["parts"] = {"not": "a list"}
    path.write_text(json.dumps(manifest))
    result = runner.invoke(app, ["inspect", str(path.parent)])
    assert result.exit_code == 1
    assert f"{path}: not a flowgrpo manifest (`parts` is missing or not a list)" in result.output
    assert "Traceback" not in result.output


def test_a_metrics_file_that_is_not_numbers(make_run):
    config, run = make_run()
    do_rollout(config, run)
    metrics = run.stage_dir(0, ROLLOUT) / "metrics.json"
    metrics.write_text('{"rollout/seconds": "fast"}')
    with pytest.raises(FlowGrpoError, match=f"{metrics}: expected a JSON object of numbers"):
        rundir.read_metrics(metrics.parent)


def test_a_config_that_is_not_utf8_names_line_and_column(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_bytes(b'[run]\nname = "caf\xe9"\n')
    result = runner.invoke(app, ["config", "--config", str(path)])
    assert result.exit_code == 1
    assert f"{path}:2:12: not UTF-8 (byte 0xe9)" in result.output


@pytest.mark.parametrize("seed", [-1, 2**63, 10**23])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(FlowGrpoError, match=r"`run.seed` = .* must be in \[0, 2\*\*63\)"):
        load_config(None, [f"run.seed={seed}"])


def test_the_sde_noise_limit_is_where_the_step_stops_scaling_the_latent_by_a_positive_factor():
    # sigmas 1 -> 0.9 -> 0.5 -> 0, s = 0.9 at sigma 1. The factor 1 + a^2 dt / (2 (1 - s)):
    # step 0: 1 - a^2 0.1 / 0.2; step 1: 1 - a^2 0.4 / 0.2 (the smallest, a < 1/sqrt 2);
    # step 2: 1 - a^2 0.5 / 1.0.
    sigmas = [1.0, 0.9, 0.5, 0.0]
    check_noise_level("sde", 0.7, sigmas)
    with pytest.raises(FlowGrpoError) as caught:
        check_noise_level("sde", 1.0, sigmas)
    message = str(caught.value)
    assert "sampler.noise_level = 1.0: too large" in message
    assert "from sigma 0.9 to 0.5 would scale the latent by -1 " in message
    assert f"a < {1 / math.sqrt(2):.3f}" in message
    # the step itself agrees: with v = 0 the mean is x times that factor
    x = torch.ones(1, 4)
    out = sde_step(x, torch.zeros_like(x), 0.9, 0.5, noise_level=1.0, sigma_max_substitute=0.9,
                   next_latents=x)  # fmt: skip
    assert out.mean == pytest.approx(-x)


def test_the_cps_noise_level_is_at_most_one():
    check_noise_level("cps", 1.0, [1.0, 0.5, 0.0])
    with pytest.raises(FlowGrpoError, match=r"must be in \[0, 1\] for cps"):
        check_noise_level("cps", 1.5, [1.0, 0.5, 0.0])


def test_rollout_refuses_a_noise_level_too_large_before_sampling(make_run):
    config, run = make_run("sampler.noise_level=5")
    with pytest.raises(FlowGrpoError, match=r"sampler\.noise_level = 5\.0: too large"):
        do_rollout(config, run)
    assert not list(run.stage_dir(0, ROLLOUT).glob("*.arrow"))


def test_a_full_disk_names_the_file_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "part.arrow"
    with pytest.raises(FlowGrpoError) as caught, atomic_file(path) as handle:
        handle.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(caught.value) == (
        f"{path}: No space left on device; free some space, or move the run to a larger disk"
    )
    assert list(tmp_path.iterdir()) == []


def test_on_a_read_only_disk_the_real_error_is_reported_not_the_clean_up(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(rundir, "open", read_only, raising=False)
    monkeypatch.setattr(Path, "unlink", read_only)  # the clean-up fails too on a RO disk
    with pytest.raises(FlowGrpoError, match=f"{tmp_path / 'x.json'}: Read-only file system"):
        rundir.atomic_write_json(tmp_path / "x.json", {})


def test_the_cli_reports_an_os_error_the_user_fixes_in_one_line(tmp_path, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "r"), "--train", "x.txt"])
    assert result.exit_code == 1
    assert f"error: {tmp_path / 'r'}: Permission denied; check the owner" in result.output
    assert "Traceback" not in result.output


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "exiting.py").write_text(textwrap.dedent("""
        import sys

        def score(images, prompts, metadata):
            sys.exit(3)
    """))  # fmt: skip
    (tmp_path / "exits_on_import.py").write_text("raise SystemExit('no GPU')\n")
    (tmp_path / "huge.py").write_text(textwrap.dedent("""
        def score(images, prompts, metadata):
            return [1e308] * len(images)
    """))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("exiting", "exits_on_import", "huge"):
        sys.modules.pop(name, None)


def one_image() -> RewardBatch:
    return RewardBatch(images=[Image.new("RGB", (8, 8))], prompts=["p"])


def test_a_plugin_calling_sys_exit_is_an_error_not_a_silent_exit(plugin_dir):
    with (
        build_rewards({"exiting:score": 1.0}) as rewards,
        pytest.raises(
            FlowGrpoError, match=r"reward 'exiting:score' called sys.exit\(3\) while scoring"
        ),
    ):
        rewards.score(one_image())
    with pytest.raises(FlowGrpoError, match=r"importing 'exits_on_import' called sys.exit"):
        build_rewards({"exits_on_import:score": 1.0})


def test_a_weighted_total_that_overflows_fails_the_image(plugin_dir):
    with build_rewards({"huge:score": 2.0}) as rewards:  # 2 x 1e308
        result = rewards.score(one_image())
    assert result.reward == [None]
    assert "the weighted total overflows to inf" in result.reward_error[0]


@pytest.mark.parametrize("rewards", [[1e300, -1e300], [1e308, 1e308]])  # square, sum overflow
def test_rewards_too_large_for_the_group_statistics_are_an_error(rewards):
    with pytest.raises(FlowGrpoError, match="overflow the group statistics; scale the reward"):
        compute_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor([0, 0]))


def test_score_records_overflowing_totals_as_failures(make_run, plugin_dir):
    config, run = make_run('reward.weights={"huge:score" = 2.0}')
    do_rollout(config, run)
    do_score(config, run)
    manifest = read_manifest(run.stage_dir(0, SCORE))
    assert manifest["counts"]["failed"] == manifest["counts"]["images"] == 4
    assert manifest["stats"]["huge:score"]["mean"] == pytest.approx(1e308)
