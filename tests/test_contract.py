"""The rollout manifest's sampler settings: written and read back generically, field by field,
in the same bytes as before, and an older manifest without a newer key still reads."""

import dataclasses
import json

import pytest

from flowgrpo_cli.algorithm.schedule import build_step_schedule
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.contract import RolloutManifest, SamplerSettings
from flowgrpo_cli.store.rundir import StageWriter

# The "sampler" table as rollout wrote it before the settings were serialised generically:
# the same keys, in the same order, with the same values (the keys added later, shift,
# same_noise_per_group and ode_solver, are written only when set).
WRITTEN = {
    "kind": "sde",
    "noise_level": 0.7,
    "guidance_scale": 4.5,
    "num_steps": 4,
    "stochastic": [False, True, True, False],
    "trained": [False, True, False, False],
    "height": 64,
    "width": 48,
    "post_window_solver": "dpm++2m",
    "post_window_compress": 0.5,
    "dtype": "float32",
    "sigmas": [1.0, 0.75, 0.5, 0.25, 0.0],
}


def _manifest() -> RolloutManifest:
    schedule = build_step_schedule(4, train_fraction=0.5, window_size=2, window_range=(1, 1))
    sampler = SamplerSettings(
        kind="sde", noise_level=0.7, guidance_scale=4.5, height=64, width=48,
        schedule=schedule, post_window_solver="dpm++2m", post_window_compress=0.5,
    )  # fmt: skip
    return RolloutManifest(
        trajectory_parts=("part-00000-of-00001.arrow",),
        conditioning_parts=("conditioning-00000-of-00001.arrow",),
        policy_version="base",
        sampler=sampler,
        sigmas=(1.0, 0.75, 0.5, 0.25, 0.0),
        dtype="float32",
        identity={"config_hash": "abc"},
    )


def _write(folder, extra: dict) -> None:
    """A finished rollout folder whose manifest holds `extra`, written as rollout writes it."""
    writer = StageWriter(folder, "rollout", {"config_hash": "abc"})
    writer.begin()
    for name in (*extra["trajectory_parts"], *extra["conditioning_parts"]):
        (folder / name).write_bytes(b"")
    writer.finish([*extra["trajectory_parts"], *extra["conditioning_parts"]], {}, extra)


def test_the_sampler_is_written_as_before_and_reads_back(tmp_path):
    manifest = _manifest()
    fields = manifest.fields()
    assert list(fields["sampler"].items()) == list(WRITTEN.items())  # same order too
    assert json.dumps(fields["sampler"]) == json.dumps(WRITTEN)
    _write(tmp_path / "rollout", fields)
    assert RolloutManifest.read(tmp_path / "rollout") == manifest


def test_an_older_manifest_takes_the_defaults_of_newer_keys(tmp_path):
    manifest = _manifest()
    fields = manifest.fields()
    newer = ("post_window_solver", "post_window_compress", "ode_solver")
    older = {k: v for k, v in fields["sampler"].items() if k not in newer}
    _write(tmp_path / "rollout", {**fields, "sampler": older})
    read = RolloutManifest.read(tmp_path / "rollout")
    assert read.sampler.post_window_solver == "euler"  # how manifests before them sampled
    assert read.sampler.post_window_compress == 1.0
    assert read.sampler.ode_solver == "euler"
    assert read.sampler.schedule == manifest.sampler.schedule
    assert read.sigmas == manifest.sigmas


def test_a_manifest_without_a_required_key_says_what_to_run(tmp_path):
    fields = _manifest().fields()
    sampler = {k: v for k, v in fields["sampler"].items() if k != "noise_level"}
    _write(tmp_path / "rollout", {**fields, "sampler": sampler})
    with pytest.raises(FlowGrpoError, match=r"lacks 'noise_level'.*flowgrpo rollout"):
        RolloutManifest.read(tmp_path / "rollout")


def test_the_mixgrpo_sampler_keys_are_written_only_when_set(tmp_path):
    """sampler.shift and sampler.same_noise_per_group: absent at their defaults (the bytes
    above), written after the others when set, and read back."""
    manifest = _manifest()
    changed = dataclasses.replace(
        manifest,
        sampler=dataclasses.replace(manifest.sampler, shift=3.0, same_noise_per_group=True),
    )
    fields = changed.fields()
    assert list(fields["sampler"])[-4:] == ["shift", "same_noise_per_group", "dtype", "sigmas"]
    _write(tmp_path / "rollout", fields)
    read = RolloutManifest.read(tmp_path / "rollout")
    assert (read.sampler.shift, read.sampler.same_noise_per_group) == (3.0, True)
    assert read == changed


def test_keys_added_later_are_written_when_set(tmp_path):
    manifest = _manifest()
    changed = dataclasses.replace(
        manifest.sampler, shift=3.0, same_noise_per_group=True, ode_solver="dpm++2m"
    )
    manifest = dataclasses.replace(manifest, sampler=changed)
    written = manifest.fields()["sampler"]
    assert (written["shift"], written["same_noise_per_group"], written["ode_solver"]) == (
        3.0, True, "dpm++2m",
    )  # fmt: skip
    _write(tmp_path / "rollout", manifest.fields())
    assert RolloutManifest.read(tmp_path / "rollout") == manifest
