"""The contract between stages: the typed manifests they hand on.

A stage's output folder counts once its manifest.json exists, and the stages' names and folders
are constants of the run directory (flowgrpo_cli.store.rundir: ROLLOUT, SCORE, ...). The
manifests that later stages read are typed here, written and read back as the same dataclass,
so a field is named in one place: rollout -> score and update (RolloutManifest: parts and the
exact sampler settings, sigma schedule included), score -> update (ScoreManifest).

SamplerSettings, what every rollout engine samples with, is defined here rather than beside the
denoising loop (engines.sampling), because the manifest records it and the store sits below
the engines: it is written field by field, generically, so a new setting needs no code here.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.algorithm.schedule import StepSchedule
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import MANIFEST, ROLLOUT, SCORE, require_manifest

# The names rollout gives its parts (store.rundir.part_name): a manifest naming anything else,
# another folder's file say, is refused rather than read.
_PART = re.compile(r"(part|conditioning)-\d{5}-of-\d{5}\.arrow")


# A field with this metadata is left out of the manifest while it holds its default.
_WRITTEN_WHEN_SET = {"written_when_set": True}


@dataclass(frozen=True)
class SamplerSettings:
    """How a rollout samples: what every engine's denoising loop reads, and what the rollout
    manifest records (the field order is the manifest's key order; see `_flat`)."""

    kind: str  # a key of algorithm.sde.STEP_FUNCTIONS
    noise_level: float  # 0: every step is the Euler ODE step
    guidance_scale: float
    schedule: StepSchedule
    height: int
    width: int
    # The ODE steps after the SDE window (MixGRPO-Flash; sampler.post_window_solver and
    # post_window_compress): their solver ("euler" or "dpm++2m") and the share of them taken.
    # A field added later needs a default: a manifest written before it lacks its key, and
    # reads back as sampled with the default.
    post_window_solver: str = "euler"
    post_window_compress: float = 1.0
    # sampler.shift (0: the model's own sigma schedule, else that static time shift) and
    # sampler.same_noise_per_group (a group's images start from one initial noise). Written
    # only when set, so a rollout that does not use them writes the manifest it wrote before.
    shift: float = dataclasses.field(default=0.0, metadata=_WRITTEN_WHEN_SET)
    same_noise_per_group: bool = dataclasses.field(default=False, metadata=_WRITTEN_WHEN_SET)
    # The solver of every deterministic step (sampler.ode_solver, eval.ode_solver): "euler" or
    # "dpm++2m". Stochastic steps are never its. Written only when set, as the two above.
    ode_solver: str = dataclasses.field(default="euler", metadata=_WRITTEN_WHEN_SET)


def _flat(settings: Any) -> dict[str, Any]:
    """A dataclass as one JSON table, field by field in order: a field that is a dataclass
    itself (the schedule) is written inline, its fields in its place; tuples become lists; a
    field marked written-when-set is left out at its default (and reads back as it)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.metadata.get("written_when_set") and value == f.default:
            continue
        if dataclasses.is_dataclass(value):
            out.update(_flat(value))
        else:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _unflat(cls: Any, table: dict[str, Any]) -> Any:
    """`_flat` read back. A key the table lacks takes its field's default (a manifest written
    before that field existed); one without a default raises KeyError naming it."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _unflat(tp, table)
        elif f.name in table:
            value = table[f.name]
            values[f.name] = tuple(value) if typing.get_origin(tp) is tuple else value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise KeyError(f.name)
    return cls(**values)


@dataclass(frozen=True)
class RolloutManifest:
    """What rollout hands on: its parts, the policy it sampled with and how it sampled."""

    trajectory_parts: tuple[str, ...]  # one per rank, in rank order
    conditioning_parts: tuple[str, ...]
    policy_version: str
    sampler: SamplerSettings
    sigmas: tuple[float, ...]  # [num_steps + 1]: the schedule the samples were drawn along
    dtype: str  # model.dtype the transformer ran in
    identity: dict[str, Any]

    @property
    def sigma_max_substitute(self) -> float:
        """The second sigma, which the SDE step uses for s where sigma = 1."""
        return self.sigmas[1]

    def fields(self) -> dict[str, Any]:
        """The manifest's own keys (StageWriter.finish adds counts, parts and identity)."""
        return {
            "trajectory_parts": list(self.trajectory_parts),
            "conditioning_parts": list(self.conditioning_parts),
            "policy_version": self.policy_version,
            "sampler": {**_flat(self.sampler), "dtype": self.dtype, "sigmas": list(self.sigmas)},
        }

    @classmethod
    def read(cls, folder: Path) -> RolloutManifest:
        """The finished rollout in `folder`, or a FlowGrpoError that says what to run."""
        manifest = require_manifest(folder, ROLLOUT.command)
        try:
            sampler = manifest["sampler"]
            read = cls(
                trajectory_parts=tuple(manifest["trajectory_parts"]),
                conditioning_parts=tuple(manifest["conditioning_parts"]),
                policy_version=manifest["policy_version"],
                sampler=_unflat(SamplerSettings, sampler),
                sigmas=tuple(float(s) for s in sampler["sigmas"]),
                dtype=sampler["dtype"],
                identity=manifest["identity"],
            )
        except (KeyError, TypeError) as err:
            raise FlowGrpoError(
                f"{folder}/manifest.json lacks {err} (written by an older flowgrpo, or "
                "edited): delete that folder and run `flowgrpo rollout` again"
            ) from None
        _check_part_names(folder, [*read.trajectory_parts, *read.conditioning_parts])
        return read


@dataclass(frozen=True)
class ScoreManifest:
    """What score hands on: one score part per rollout part, and the rewards it holds."""

    parts: tuple[str, ...]
    rewards: tuple[str, ...]  # the per-reward columns beside `reward` (the weighted total)

    @classmethod
    def read(cls, folder: Path) -> ScoreManifest:
        manifest = require_manifest(folder, SCORE.command)
        try:
            read = cls(
                parts=tuple(part["name"] for part in manifest["parts"]),
                rewards=tuple(manifest["rewards"]),
            )
        except (KeyError, TypeError) as err:
            raise FlowGrpoError(
                f"{folder}/manifest.json lacks {err}: delete that folder and run "
                "`flowgrpo score` again"
            ) from None
        _check_part_names(folder, read.parts)
        return read


def _check_part_names(folder: Path, names: list[str] | tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(name, str) or not _PART.fullmatch(name):
            raise FlowGrpoError(
                f"{folder / MANIFEST} lists the part {name!r}, not a name flowgrpo writes "
                "(part-NNNNN-of-NNNNN.arrow): refused; delete that folder and redo the stage"
            )
