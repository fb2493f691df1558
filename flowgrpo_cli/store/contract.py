"""The contract between stages: the typed manifests they hand on.

A stage's output folder counts once its manifest.json exists, and the stages' names and folders
are constants of the run directory (flowgrpo_cli.store.rundir: ROLLOUT, SCORE, ...). The
manifests that later stages read are typed here, written and read back as the same dataclass,
so a field is named in one place: rollout -> score and update (RolloutManifest: parts and the
exact sampler settings, sigma schedule included), score -> update (ScoreManifest).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.algorithm.schedule import StepSchedule
from flowgrpo_cli.engines.sampling import SamplerSettings
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import MANIFEST, ROLLOUT, SCORE, require_manifest

# The names rollout gives its parts (store.rundir.part_name): a manifest naming anything else,
# another folder's file say, is refused rather than read.
_PART = re.compile(r"(part|conditioning)-\d{5}-of-\d{5}\.arrow")


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
        sampler, schedule = self.sampler, self.sampler.schedule
        return {
            "trajectory_parts": list(self.trajectory_parts),
            "conditioning_parts": list(self.conditioning_parts),
            "policy_version": self.policy_version,
            "sampler": {
                "kind": sampler.kind,
                "noise_level": sampler.noise_level,
                "guidance_scale": sampler.guidance_scale,
                "num_steps": schedule.num_steps,
                "stochastic": list(schedule.stochastic),
                "trained": list(schedule.trained),
                "height": sampler.height,
                "width": sampler.width,
                "post_window_solver": sampler.post_window_solver,
                "post_window_compress": sampler.post_window_compress,
                "dtype": self.dtype,
                "sigmas": list(self.sigmas),
            },
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
                sampler=SamplerSettings(
                    kind=sampler["kind"],
                    noise_level=sampler["noise_level"],
                    guidance_scale=sampler["guidance_scale"],
                    height=sampler["height"],
                    width=sampler["width"],
                    schedule=StepSchedule(
                        num_steps=sampler["num_steps"],
                        stochastic=tuple(sampler["stochastic"]),
                        trained=tuple(sampler["trained"]),
                    ),
                    # Absent from manifests written before MixGRPO-Flash: those sampled so.
                    post_window_solver=sampler.get("post_window_solver", "euler"),
                    post_window_compress=sampler.get("post_window_compress", 1.0),
                ),
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
