"""`flowgrpo inspect`: what a run, an iteration, a stage folder or one part holds."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.rundir import (
    ITERATION_STAGES,
    MANIFEST,
    RunDir,
    read_manifest,
    verify_stage,
)
from flowgrpo_cli.store.trajectory import iter_batches, open_part


def describe(console: Console, path: Path, *, images_dir: Path | None = None) -> None:
    if not path.exists():
        raise FlowGrpoError(f"{path} does not exist")
    if path.is_file():
        _describe_parts(console, [path], images_dir)
    elif (path / "config.toml").is_file():
        _describe_run(console, RunDir(path))
    elif (path / MANIFEST).is_file() or any(path.glob("*.arrow")):
        _describe_stage(console, path, images_dir)  # checkpoints/iter-N/ included
    elif path.name.startswith("iter-"):
        _describe_iteration(console, path)
    else:
        raise FlowGrpoError(f"{path} is not a run, an iteration, a stage folder or an Arrow part")


def _status(stage_dir: Path) -> str:
    manifest = read_manifest(stage_dir)
    if manifest is not None:
        counts = ", ".join(f"{k} {v}" for k, v in manifest.get("counts", {}).items())
        pruned = "; latents pruned (run.keep_trajectories)" if "pruned" in manifest else ""
        return f"[green]done[/] ({counts}{pruned})"
    return "[yellow]incomplete[/]" if stage_dir.exists() else "-"


def _verified(stage_dir: Path) -> str:
    """Every part the manifest lists, checked against its recorded size and sha256."""
    try:
        manifest = verify_stage(stage_dir)
    except FlowGrpoError as err:
        return f"[red]{err}[/]"
    return f"[green]{len(manifest['parts'])} part(s) match their recorded size and sha256[/]"


def _describe_run(console: Console, run: RunDir) -> None:
    table = Table(title=f"run {run.root}", show_edge=False)
    table.add_column("iteration")
    for stage in ITERATION_STAGES:
        table.add_column(stage.folder)
    table.add_column("checkpoint")
    for number in run.iterations():
        cells = [_status(run.stage_dir(number, stage)) for stage in ITERATION_STAGES]
        table.add_row(str(number), *cells, _status(run.checkpoint_dir(number)))
    console.print(f"data: {_status(run.data_dir)}")
    console.print(table)
    console.print(f"current iteration: {run.current_iteration()}")


def _describe_iteration(console: Console, folder: Path) -> None:
    for stage in ITERATION_STAGES:
        console.print(f"[bold]{stage.folder}[/]: {_status(folder / stage.folder)}")


def _describe_stage(console: Console, folder: Path, images_dir: Path | None) -> None:
    console.print(f"[bold]{folder}[/]: {_status(folder)}")
    manifest = read_manifest(folder)
    if manifest is not None:
        console.print(_verified(folder), highlight=False)
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
        console.print(f"{writer.count} images -> {images_dir}")


def _log_prob_table(console: Console, values: np.ndarray) -> None:
    table = Table(title="log-prob per stored step", show_edge=False)
    for column in ("step", "mean", "std", "min", "max"):
        table.add_column(column, justify="right")
    for step in range(values.shape[1]):
        v = values[:, step]
        table.add_row(str(step), *(f"{x:.4f}" for x in (v.mean(), v.std(), v.min(), v.max())))
    console.print(table)


_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


class _ImageDump:
    """Writes each row's PNG as SAMPLE_ID.png and one prompts.tsv line per image."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.count = 0
        self._tsv = open(folder / "prompts.tsv", "w", newline="", encoding="utf-8")  # noqa: SIM115
        self._csv = csv.writer(self._tsv, delimiter="\t")
        self._csv.writerow(["file", "prompt", "ground_truth"])

    def add(self, batch) -> None:
        for row in batch.select(["sample_id", "prompt", "ground_truth", "image"]).to_pylist():
            name = f"{row['sample_id']}.png"
            if not _FILE_NAME.fullmatch(name):  # a sample id read from a file names the PNG
                raise FlowGrpoError(
                    f"sample_id {row['sample_id']!r} is not a plain file name (letters, digits, "
                    f"'.', '_', '-'): no image written for it outside {self.folder}"
                )
            (self.folder / name).write_bytes(row["image"])
            self._csv.writerow([name, row["prompt"], row["ground_truth"]])
            self.count += 1

    def close(self) -> None:
        self._tsv.close()
