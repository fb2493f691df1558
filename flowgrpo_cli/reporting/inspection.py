"""`flowgrpo inspect`: what a run, an iteration, a stage folder or one part holds."""

from __future__ import annotations

import csv
import hashlib
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.reporting.render import describe_best, updates
from flowgrpo_cli.store.evaluations import best_evaluation
from flowgrpo_cli.store.rundir import (
    CHECKPOINT,
    EVAL,
    ITERATION_STAGES,
    MANIFEST,
    RunDir,
    numbered_folders,
    read_manifest,
    verify_part,
    verify_stage,
)
from flowgrpo_cli.store.trajectory import iter_batches, open_part


def describe(console: Console, path: Path, *, images_dir: Path | None = None) -> None:
    """Describe `path` and verify what it holds against the manifests: a run, an iteration
    and a stage folder every finished stage in it, a part file its entry in its stage's
    manifest. Damage is printed where it is found and ends in a FlowGrpoError (exit 1)."""
    if not path.exists():
        raise FlowGrpoError(f"{path} does not exist")
    if path.is_file():
        _verify_part(console, path)
        _describe_parts(console, [path], images_dir)
    elif (path / "config.toml").is_file():
        _describe_run(console, RunDir(path))
    elif (path / MANIFEST).is_file() or any(path.glob("*.arrow")):
        _describe_stage(console, path, images_dir)  # checkpoints/iter-N/ included
    elif path.name.startswith("iter-"):
        _describe_iteration(console, path)
    else:
        raise FlowGrpoError(f"{path} is not a run, an iteration, a stage folder or an Arrow part")


def _raise_damage(problems: list[str]) -> None:
    """The first problem as the error (exit 1); the others were printed above it."""
    if problems:
        more = len(problems) - 1
        raise FlowGrpoError(problems[0] + (f" (and {more} more, listed above)" if more else ""))


def _status(stage_dir: Path) -> str:
    manifest = read_manifest(stage_dir)
    if manifest is not None:
        counts = ", ".join(f"{k} {v}" for k, v in manifest.get("counts", {}).items())
        pruned = "; latents pruned (run.keep_trajectories)" if "pruned" in manifest else ""
        return f"[green]done[/] ({counts}{pruned})"
    return "[yellow]incomplete[/]" if stage_dir.exists() else "-"


class _Verifier:
    """Verifies finished stage folders (every part against its recorded size and checksum) and
    keeps what was wrong, so a whole run is looked at before the command fails."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.parts = 0

    def status(self, stage_dir: Path) -> str:
        """_status of a stage folder, marked damaged (in red) when a finished one fails."""
        try:
            status = _status(stage_dir)
            if read_manifest(stage_dir) is not None:
                self.parts += len(verify_stage(stage_dir)["parts"])
        except FlowGrpoError as err:
            self.problems.append(str(err))
            return "[red]damaged[/]"
        return status

    def summary(self, console: Console) -> None:
        for problem in self.problems[1:]:  # the first one is the command's error
            console.print(f"[red]damaged:[/] {escape(problem)}", highlight=False)
        if not self.problems:
            console.print(
                f"[green]{self.parts} part(s) match their recorded size and checksum[/]",
                highlight=False,
            )
        _raise_damage(self.problems)


def _describe_run(console: Console, run: RunDir) -> None:
    check = _Verifier()
    table = Table(title=f"run {run.root}", show_edge=False)
    table.add_column("iteration")
    for stage in ITERATION_STAGES:
        table.add_column(stage.folder)
    table.add_column("checkpoint")
    for number in run.iterations():
        cells = [check.status(run.stage_dir(number, stage)) for stage in ITERATION_STAGES]
        table.add_row(str(number), *cells, check.status(run.checkpoint_dir(number)))
    console.print(f"data: {check.status(run.data_dir)}")
    console.print(table)
    evaluations = sorted(p for p in (run.root / EVAL.folder).glob("iter-*") if p.is_dir())
    for folder in evaluations:  # the loop's and `flowgrpo evaluate`'s
        suffix = folder.name.removeprefix("iter-")
        what = ""
        if suffix.isdigit():
            policy = f"the policy after {updates(int(suffix))}" if int(suffix) else "the base model"
            what = f" ({policy})"
        console.print(f"eval/{folder.name}{what}: {check.status(folder)}", highlight=False)
    _describe_best(console, run, check)
    for number in numbered_folders(run.root / CHECKPOINT.folder):
        if number not in run.iterations():
            check.status(run.checkpoint_dir(number))
    console.print(f"current iteration: {run.current_iteration()}")
    check.summary(console)


def _describe_best(console: Console, run: RunDir, check: _Verifier) -> None:
    """One line: the best held-out evaluation (what best.json records), when there is one."""
    try:
        best = best_evaluation(run)
    except FlowGrpoError as err:  # an evaluation's metrics.json that is not flowgrpo's
        check.problems.append(str(err))
        return
    if best is not None:
        console.print(f"best held-out evaluation: {escape(describe_best(best))}", highlight=False)


def _describe_iteration(console: Console, folder: Path) -> None:
    check = _Verifier()
    for stage in ITERATION_STAGES:
        console.print(f"[bold]{stage.folder}[/]: {check.status(folder / stage.folder)}")
    check.summary(console)


def _verify_part(console: Console, path: Path) -> None:
    """One file against its entry in its folder's manifest (the checks of verify_stage)."""
    stage_dir = path.parent
    manifest = read_manifest(stage_dir)
    entry = next((p for p in (manifest or {}).get("parts", []) if p["name"] == path.name), None)
    if manifest is None or entry is None:
        why = "has no manifest (an unfinished stage)" if manifest is None else "does not list it"
        console.print(f"[yellow]not verified:[/] {stage_dir} {why}", highlight=False)
        return
    redo = f"delete {stage_dir} and run the stage that wrote it again"
    verify_part(path, entry, redo)
    console.print("[green]matches its recorded size and checksum[/]", highlight=False)


def _describe_stage(console: Console, folder: Path, images_dir: Path | None) -> None:
    console.print(f"[bold]{folder}[/]: {_status(folder)}")
    manifest = read_manifest(folder)
    if manifest is not None:
        verified = verify_stage(folder)  # damage: the command's error, exit 1
        console.print(
            f"[green]{len(verified['parts'])} part(s) match their recorded size and checksum[/]",
            highlight=False,
        )
    if manifest is not None and "sampler" in manifest:
        sampler = manifest["sampler"]
        console.print(
            f"policy {manifest.get('policy_version')}; {sampler['kind']} a={sampler['noise_level']}"
            f", {sampler['num_steps']} steps, CFG {sampler['guidance_scale']}, "
            f"{sampler['height']}x{sampler['width']}",
            highlight=False,
        )
    parts = sorted(p for p in folder.glob("*.arrow") if not p.name.startswith("conditioning-"))
    if parts:
        _describe_parts(console, parts, images_dir)


def _describe_parts(console: Console, parts: list[Path], images_dir: Path | None) -> None:
    schema = open_part(parts[0]).schema
    console.print(f"schema of {parts[0].name}:")
    for field in schema:
        console.print(f"  {field.name}: {field.type}", highlight=False)
    names = set(schema.names)
    small = [c for c in ("sample_id", "group_id", "prompt", "ground_truth") if c in names]
    rows = 0
    groups: dict[int, int] = {}
    log_probs = []
    writer = _ImageDump(images_dir) if images_dir is not None and "image" in names else None
    wanted = small + [c for c in ("log_probs", "image") if c in names]
    for batch in iter_batches(parts, wanted):
        rows += batch.num_rows
        if "group_id" in names:
            for gid in batch.column("group_id").to_pylist():
                groups[gid] = groups.get(gid, 0) + 1
        if "log_probs" in names:
            column = batch.column("log_probs")
            width = column.type.list_size
            log_probs.append(column.flatten().to_numpy().reshape(-1, width))
        if writer is not None:
            writer.add(batch)
    console.print(f"rows: {rows} in {len(parts)} part(s)")
    if groups:
        sizes = sorted(set(groups.values()))
        console.print(f"groups: {len(groups)} (sizes {sizes})")
    if log_probs and log_probs[0].shape[1]:
        _log_prob_table(console, np.concatenate(log_probs))
    if writer is not None:
        writer.close()
        console.print(f"{writer.count} images -> {images_dir}", highlight=False)
        if writer.renamed:
            console.print(
                f"{writer.renamed} of them under another name than their sample id (missing, "
                "repeated or too long): prompts.tsv gives each file's sample id",
                highlight=False,
            )


def _log_prob_table(console: Console, values: np.ndarray) -> None:
    table = Table(title="log-prob per stored step", show_edge=False)
    for column in ("step", "mean", "std", "min", "max"):
        table.add_column(column, justify="right")
    for step in range(values.shape[1]):
        v = values[:, step]
        table.add_row(str(step), *(f"{x:.4f}" for x in (v.mean(), v.std(), v.min(), v.max())))
    console.print(table)


_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
_MAX_STEM = 100  # characters of a sample id kept in its file name (file systems allow 255 bytes)


class _ImageDump:
    """Writes each row's PNG as SAMPLE_ID.png and one prompts.tsv line per image.

    Every image gets a file of its own: a sample id too long for a file name is shortened
    (its start and a hash of the whole), and a missing or repeated one gets a numbered name;
    prompts.tsv maps each file to its sample id. `count` is the number of files written."""

    def __init__(self, folder: Path):
        if folder.exists() and not folder.is_dir():
            raise FlowGrpoError(f"--images {folder}: exists and is not a folder; name a folder")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise FlowGrpoError(f"--images {folder}: cannot create it ({err.strerror})") from None
        self.folder = folder
        self.count = 0
        self.renamed = 0
        self._used: set[str] = set()  # lower-cased: distinct on case-insensitive disks too
        self._tsv = open(folder / "prompts.tsv", "w", newline="", encoding="utf-8")  # noqa: SIM115
        self._csv = csv.writer(self._tsv, delimiter="\t")
        self._csv.writerow(["file", "prompt", "ground_truth", "sample_id"])

    def _name(self, sample_id: object) -> str:
        if sample_id is None:
            stem = "no-sample-id"
        else:
            stem = str(sample_id)
            if not _FILE_NAME.fullmatch(f"{stem}.png"):  # a sample id read from a file
                raise FlowGrpoError(
                    f"sample_id {stem!r} is not a plain file name (letters, digits, '.', "
                    f"'_', '-'): no image written for it outside {self.folder}"
                )
            if len(stem) > _MAX_STEM:
                digest = hashlib.sha256(stem.encode()).hexdigest()[:12]
                stem = f"{stem[: _MAX_STEM - 13]}-{digest}"
        name, number = f"{stem}.png", 2
        while name.lower() in self._used:
            name, number = f"{stem}-{number}.png", number + 1
        self._used.add(name.lower())
        self.renamed += name != f"{sample_id}.png"
        return name

    def add(self, batch) -> None:
        for row in batch.select(["sample_id", "prompt", "ground_truth", "image"]).to_pylist():
            if not isinstance(row["image"], bytes):
                raise FlowGrpoError(
                    f"sample_id {row['sample_id']!r} has no image bytes (a damaged part): "
                    f"{self.count} image(s) were written to {self.folder} before it"
                )
            name = self._name(row["sample_id"])
            (self.folder / name).write_bytes(row["image"])
            self._csv.writerow([name, row["prompt"], row["ground_truth"], row["sample_id"]])
            self.count += 1

    def close(self) -> None:
        self._tsv.close()
