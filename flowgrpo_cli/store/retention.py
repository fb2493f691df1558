"""Retention: the trajectories of finished iterations are deleted, all but the last K.

What makes a rollout large is what only its update reads: the latents around every stochastic
step of every image (SD3.5-M at 512 px: about 1 MB a step an image) and the text conditioning
of every prompt. Once an iteration's update has finished nothing reads them again, so with
`run.keep_trajectories = K` the rollouts of older finished iterations are rewritten without
them. Images, prompts, seeds, per-step sigmas and log-probs stay, as do scores, advantages,
metrics, checkpoints and evaluations; only that iteration's update can no longer be redone.

A rollout is pruned beside itself (`rollout.pruning/`) and swapped in with two renames
(the old folder goes to `rollout.replaced/` in between); `recover` completes or undoes a
swap a kill interrupted, so every state a kill can leave is one the next pass finishes. The
pruned manifest lists the new parts and records the pruning, including the original
manifest's hash, which stays the rollout's identity for the stages that recorded it
(`rundir.manifest_hash`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.evaluations import best_evaluation
from flowgrpo_cli.store.rundir import (
    CHECKPOINT,
    EVAL,
    MANIFEST,
    ROLLOUT,
    RunDir,
    atomic_write_json,
    manifest_hash,
    part_entry,
    read_manifest,
)
from flowgrpo_cli.store.trajectory import ArrowPartWriter, iter_batches, open_part

PRUNED_COLUMNS = ("latents",)  # trajectory columns only the update reads
_STAGING = ".pruning"
_REPLACED = ".replaced"


def apply_retention(
    run: RunDir, keep_trajectories: int, keep_checkpoints: int, checkpoint_every: int = 1
) -> Pruned:
    """The limits, after an update finished: the caller holds the run's lock."""
    prune_checkpoints(run, keep_checkpoints, checkpoint_every)
    return prune_finished(run, keep_trajectories)


@dataclass(frozen=True)
class Pruned:
    iterations: list[int]  # the iterations pruned by this pass
    bytes_freed: int


def prune_finished(run: RunDir, keep: int) -> Pruned:
    """Prune the rollouts of finished iterations older than the last `keep` (keep < 0: none).
    Call it holding the run's lock, on one process."""
    if keep < 0:
        return Pruned([], 0)
    finished = run.current_iteration()  # iterations 0 .. finished - 1 have their checkpoint
    pruned, freed = [], 0
    for iteration in range(max(0, finished - keep)):
        folder = run.stage_dir(iteration, ROLLOUT)
        recover(folder)
        manifest = read_manifest(folder) if folder.is_dir() else None
        if manifest is None or "pruned" in manifest:
            continue
        freed += _prune(folder, manifest)
        pruned.append(iteration)
    return Pruned(pruned, freed)


def kept_checkpoints(finished: int, keep: int, every: int = 1) -> list[int]:
    """The checkpoints (of iterations 0 .. finished - 1) whose weights stay: every `every`-th
    (iter-N with N + 1 a multiple of it) and the latest, which resume needs; of those the
    last `keep` (0: all)."""
    candidates = [n for n in range(finished) if (n + 1) % every == 0 or n == finished - 1]
    return candidates[-keep:] if keep > 0 else candidates


def prune_checkpoints(run: RunDir, keep: int, every: int = 1) -> list[int]:
    """Delete the files of finished checkpoints that `kept_checkpoints` does not keep (the
    latest always stays, and so does the best held-out evaluation's checkpoint, whatever the
    limits), leaving their manifest, marked pruned, so the iteration still counts as finished.
    The manifest is rewritten first: a kill after it leaves files the next pass deletes."""
    finished = run.current_iteration()
    kept = set(kept_checkpoints(finished, keep, every))
    best = best_evaluation(run)  # derived from eval/ on every pass: never a stale record
    if best is not None and best.checkpoint is not None:
        kept.add(best.checkpoint)
    if len(kept) == finished:
        return []
    pruned = []
    for iteration in range(finished):
        if iteration in kept:
            continue
        folder = run.checkpoint_dir(iteration)
        manifest = read_manifest(folder)
        if manifest is None:
            continue
        if "pruned" not in manifest:
            record = {"deleted_parts": [part["name"] for part in manifest["parts"]]}
            atomic_write_json(folder / MANIFEST, {**manifest, "parts": [], "pruned": record})
            pruned.append(iteration)
        for path in sorted(folder.rglob("*"), reverse=True):  # files before their folders
            if path == folder / MANIFEST:
                continue
            path.rmdir() if path.is_dir() else path.unlink()
    return pruned


def drop_iterations(run: RunDir, first: int) -> None:
    """Delete iteration `first` and every later one (their stages, checkpoints, evaluations
    and grids), so the loop redoes them; earlier iterations and the data stay.

    Checkpoint `first`'s manifest goes first: from then on the run counts `first` as its
    current iteration, and a kill midway leaves what a second call deletes.
    """
    finished = run.current_iteration()
    if not 0 <= first <= finished:
        raise FlowGrpoError(
            f"--restart-from {first}: the run has finished iterations 0 to {finished - 1}; "
            f"restart from one of them, or from {finished} (nothing to drop)"
        )
    if first > 0:
        previous = run.checkpoint_dir(first - 1)
        if "pruned" in (read_manifest(previous) or {}):
            raise FlowGrpoError(
                f"--restart-from {first}: iteration {first} starts from {previous}, whose "
                "weights were deleted (run.checkpoint_every / run.keep_checkpoints); restart from "
                "an iteration whose previous checkpoint kept its weights"
            )
    doomed = [
        *(p for p in run.root.glob("iter-*") if _number(p.name) >= first),
        *(p for p in (run.root / CHECKPOINT.folder).glob("iter-*") if _number(p.name) >= first),
        *(p for p in (run.root / EVAL.folder).glob("iter-*") if _number(p.name) >= first),
    ]
    grids = [
        grid
        for grid in (run.root / "samples").glob("*iter-*.png")
        if _number(grid.stem.removeprefix("eval-")) >= first
    ]
    for path in [run.checkpoint_dir(first), *doomed, *grids]:  # all checked before any goes
        _check_inside(run, path, first)
    (run.checkpoint_dir(first) / MANIFEST).unlink(missing_ok=True)
    for path in doomed:
        shutil.rmtree(path)
    for grid in grids:
        grid.unlink()


def _check_inside(run: RunDir, path: Path, first: int) -> None:
    """Refuse to delete `path` when it is a link, lies outside the run through one, or is not
    the kind of entry flowgrpo wrote there: only the run's own files are deleted, never a
    folder elsewhere that a link points to."""
    if not os.path.lexists(path):
        return
    folder = path.suffix != ".png"  # iteration, checkpoint and evaluation folders; grids
    if path.is_symlink():
        problem = f"is a symbolic link (to {os.readlink(path)})"
    elif not path.resolve().is_relative_to(run.root.resolve()):
        problem = f"lies outside the run, at {path.resolve()}, through a link"
    elif path.is_dir() != folder:
        problem = f"is not the {'folder' if folder else 'file'} flowgrpo wrote there"
    else:
        return
    raise FlowGrpoError(
        f"--restart-from {first}: {path} {problem}; flowgrpo deletes only the run's own files, "
        "never through a link: put the folder itself there, or move that out of the run, and "
        "run again"
    )


def _number(name: str) -> int:
    """N of `iter-N` (-1 for any other name: never dropped)."""
    digits = name.removeprefix("iter-")
    return int(digits) if name.startswith("iter-") and digits.isdigit() else -1


def recover(folder: Path) -> None:
    """Finish or undo a swap a kill interrupted (see the module docstring)."""
    staging, replaced = _sibling(folder, _STAGING), _sibling(folder, _REPLACED)
    if replaced.is_dir() and not folder.exists():
        staging.rename(folder)  # killed between the two renames: staging was complete
    if replaced.is_dir():
        shutil.rmtree(replaced)
    if staging.is_dir():  # killed while pruning: the original is untouched
        shutil.rmtree(staging)


def _sibling(folder: Path, suffix: str) -> Path:
    return folder.with_name(folder.name + suffix)


def _prune(folder: Path, manifest: dict[str, Any]) -> int:
    """Rewrite `folder` without its latents and conditioning; the bytes this frees."""
    staging, replaced = _sibling(folder, _STAGING), _sibling(folder, _REPLACED)
    staging.mkdir()
    parts = []
    for name in manifest["trajectory_parts"]:
        source = folder / name
        schema = open_part(source).schema
        keep = [column for column in schema.names if column not in PRUNED_COLUMNS]
        with ArrowPartWriter(staging / name) as writer:
            for batch in iter_batches([source], keep):
                writer.write(batch)
        path = staging / name
        parts.append(part_entry(path, name))
    listed = {part["name"] for part in manifest["parts"]}
    for path in folder.iterdir():  # metrics.json and anything else the stage wrote beside
        if path.is_file() and path.name not in listed and path.name != MANIFEST:
            shutil.copyfile(path, staging / path.name)
    before = sum(part["bytes"] for part in manifest["parts"])
    after = sum(part["bytes"] for part in parts)
    record = {
        "original_manifest": manifest_hash(folder),
        "dropped_columns": list(PRUNED_COLUMNS),
        "dropped_parts": list(manifest["conditioning_parts"]),
        "bytes_before": before,
        "bytes_after": after,
    }
    atomic_write_json(staging / MANIFEST, {**manifest, "parts": parts, "pruned": record})
    folder.rename(replaced)
    staging.rename(folder)
    shutil.rmtree(replaced)
    return before - after
