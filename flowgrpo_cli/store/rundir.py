"""The run directory: layout, atomic files, stage manifests, checksums and the writer lock.

A stage's output folder counts only once its manifest.json exists. Every file is written under
a temporary name in the same folder, flushed to disk, then renamed into place, so a crash
never leaves a visible half-written part. The manifest, written last, records each part's size
and sha256, the config hash and the hashes of the input manifests: verification names any part
that was truncated or altered, and a re-run after a crash keeps the finished parts only when
they were written for the same config and inputs (see ``StageWriter``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flowgrpo_cli.errors import FlowGrpoError, storage_error

MANIFEST = "manifest.json"
PENDING = "pending.json"
METRICS = "metrics.json"
SCHEMA_VERSION = 1
_TMP_MARK = ".tmp-"
_TMP_NAME = re.compile(rf"{re.escape(_TMP_MARK)}\d+$")  # what atomic_file names its files


# ---------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class Stage:
    """One kind of stage output: where it goes, and which command writes it."""

    name: str  # the `stage` its manifest records; its key in config.STAGE_SECTIONS
    folder: str  # its folder: under iter-N/ for the iteration stages
    command: str  # the `flowgrpo` command that writes it


PREPARE = Stage("prepare", "data", "prepare")
ROLLOUT = Stage("rollout", "rollout", "rollout")
SCORE = Stage("scores", "scores", "score")
UPDATE = Stage("update", "update", "update")
CHECKPOINT = Stage("checkpoint", "checkpoints", "update")
EVAL = Stage("eval", "eval", "loop")
#: The stages of one iteration, in order: the folders under iter-N/.
ITERATION_STAGES = (ROLLOUT, SCORE, UPDATE)


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory (DESIGN.md "The run directory")."""

    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.toml"

    @property
    def data_dir(self) -> Path:
        return self.root / PREPARE.folder

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def lock_path(self) -> Path:
        return self.root / "run.lock"

    def iteration_dir(self, iteration: int) -> Path:
        return self.root / f"iter-{iteration:06d}"

    def stage_dir(self, iteration: int, stage: Stage) -> Path:
        return self.iteration_dir(iteration) / stage.folder

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.root / CHECKPOINT.folder / f"iter-{iteration:06d}"

    def eval_dir(self, iteration: int) -> Path:
        """The evaluation of the policy iteration `iteration` starts from (0: the base)."""
        return self.root / EVAL.folder / f"iter-{iteration:06d}"

    def samples_path(self, iteration: int) -> Path:
        return self.root / "samples" / f"iter-{iteration:06d}.png"

    def eval_samples_path(self, iteration: int) -> Path:
        """The grid of the evaluation of the policy iteration `iteration` starts from."""
        return self.root / "samples" / f"eval-iter-{iteration:06d}.png"

    def current_iteration(self) -> int:
        """The first iteration whose update has not finished (its checkpoint has no manifest)."""
        iteration = 0
        while (self.checkpoint_dir(iteration) / MANIFEST).is_file():
            iteration += 1
        return iteration

    def holds_results(self) -> bool:
        """Whether anything was computed in this run yet: prepared data (even unfinished),
        an iteration, a checkpoint or an evaluation. Its config.toml and run.lock do not count."""
        folders = [self.data_dir, self.root / CHECKPOINT.folder, self.root / EVAL.folder]
        return any(folder.exists() for folder in folders) or bool(self.iterations())

    def iterations(self) -> list[int]:
        """Iteration numbers that have a folder, in order."""
        found = []
        for path in self.root.glob("iter-*"):
            suffix = path.name.removeprefix("iter-")
            if path.is_dir() and suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)


def part_name(index: int, count: int, suffix: str = "arrow") -> str:
    return f"part-{index:05d}-of-{count:05d}.{suffix}"


def inside(folder: Path, name: str, *, where: str) -> Path:
    """folder / name, refused when a name read from a file (`where`) would leave `folder`:
    an absolute path, `..`, or a link pointing out."""
    path = folder / name
    if Path(name).is_absolute() or not path.resolve().is_relative_to(folder.resolve()):
        raise FlowGrpoError(f"{where} names {name!r}, which is outside {folder}: refused")
    return path


# ---------------------------------------------------------------------------------------------
# Atomic files


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary sibling of `path`; on success flush, fsync and rename it into place.

    On any exception the temporary file is removed and `path` is left as it was.
    """
    tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        # On a read-only or full disk the clean-up can fail too; the first error is the news.
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        storage = storage_error(err, path) if isinstance(err, OSError) else None
        if storage is not None:
            raise storage from None
        raise


def remove_temp_files(folder: Path) -> None:
    """Delete the temporary files of killed writers anywhere under `folder`.

    Call it only while no writer can be alive there: holding the run's lock, or for a stage
    folder whose writer is about to start over.
    """
    for path in folder.rglob(f"*{_TMP_MARK}*") if folder.is_dir() else []:
        if _TMP_NAME.search(path.name) and path.is_file():
            path.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Manifests


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The stage's manifest, or None while the stage is incomplete."""
    path = stage_dir / MANIFEST
    if not path.is_file():
        return None
    manifest = _read_json(path, "manifest")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise FlowGrpoError(
            f"{path}: not a flowgrpo manifest ({problem}); delete {stage_dir} and redo the stage"
        )
    return manifest


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FlowGrpoError(f"{path}: {what} is not valid JSON ({err})") from None


# The keys StageWriter.finish writes into every manifest, with their JSON types.
_MANIFEST_KEYS = {"schema_version": int, "stage": str, "identity": dict, "counts": dict,
                  "parts": list}  # fmt: skip
_PART_KEYS = {"name": str, "bytes": int, "sha256": str}


def _manifest_problem(manifest: Any) -> str | None:
    """What makes `manifest` unlike the ones StageWriter.finish writes, or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    problem = _missing_key(manifest, _MANIFEST_KEYS, "")
    for n, part in enumerate(manifest["parts"] if problem is None else []):
        if not isinstance(part, dict):
            return f"`parts[{n}]` is not an object"
        problem = problem or _missing_key(part, _PART_KEYS, f"parts[{n}].")
    return problem


def _missing_key(entry: dict[str, Any], keys: dict[str, type], where: str) -> str | None:
    for key, kind in keys.items():
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"`{where}{key}` is missing or not a {kind.__name__}"
    return None


def require_manifest(stage_dir: Path, what: str) -> dict[str, Any]:
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise FlowGrpoError(
            f"{stage_dir} has no {MANIFEST}: the {what} is missing or did not "
            f"finish; run `flowgrpo {what}` first"
        )
    return manifest


def read_metrics(stage_dir: Path) -> dict[str, float]:
    """The metrics a finished stage recorded beside its manifest ({} while unfinished)."""
    path = stage_dir / METRICS
    if read_manifest(stage_dir) is None or not path.is_file():
        return {}
    metrics = _read_json(path, "metrics file")
    if not isinstance(metrics, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in metrics.values()
    ):
        raise FlowGrpoError(
            f"{path}: expected a JSON object of numbers; delete {stage_dir} and redo the stage"
        )
    return metrics


def manifest_hash(stage_dir: Path) -> str:
    """Identity of a finished stage output, recorded by the stages that read it. A pruned
    rollout (store.retention) keeps the identity it was finished with."""
    manifest = read_manifest(stage_dir)
    pruned = manifest.get("pruned") if manifest is not None else None
    if isinstance(pruned, dict) and isinstance(pruned.get("original_manifest"), str):
        return pruned["original_manifest"]
    return sha256_file(stage_dir / MANIFEST)[:16]


def verify_stage(stage_dir: Path) -> dict[str, Any]:
    """Check every part listed in the manifest against its recorded size and sha256 (one
    streamed read of each); a mismatch names the file and says how to redo the stage."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise FlowGrpoError(f"{stage_dir}: incomplete (no {MANIFEST})")
    redo = f"delete {stage_dir} and run the stage that wrote it again"
    for part in manifest["parts"]:
        path = inside(stage_dir, part["name"], where=str(stage_dir / MANIFEST))
        if not path.is_file():
            raise FlowGrpoError(f"{path}: listed in the manifest but missing; {redo}")
        size = path.stat().st_size
        if size != part["bytes"]:
            raise FlowGrpoError(
                f"{path}: {size} bytes, the manifest says {part['bytes']} (truncated or "
                f"replaced); {redo}"
            )
        if sha256_file(path) != part["sha256"]:
            raise FlowGrpoError(f"{path}: checksum differs from the manifest (altered); {redo}")
    return manifest


class StageWriter:
    """Writes one stage's output folder: parts first, the manifest last.

    `identity` (config hash, input manifest hashes, anything else that determines the output)
    is stored in pending.json when the stage starts. A re-run with the same identity keeps the
    parts already finished (`has_part`) and writes only the missing ones; a re-run with another
    identity removes them first, so old and new outputs are never mixed.
    """

    def __init__(self, stage_dir: Path, stage: str, identity: dict[str, Any]):
        self.dir = stage_dir
        self.stage = stage
        self.identity = identity

    def begin(self) -> bool:
        """Prepare the folder; return False when the stage is already complete."""
        manifest = read_manifest(self.dir)
        if manifest is not None:
            if manifest.get("identity") == self.identity:
                return False
            raise FlowGrpoError(
                f"{self.dir} was finished with another config or other inputs; delete that "
                "folder to redo the stage"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        pending_path = self.dir / PENDING
        pending = json.loads(pending_path.read_text()) if pending_path.is_file() else None
        if pending != self.identity:
            for stale in self.dir.iterdir():
                if stale.is_file():
                    stale.unlink()
            atomic_write_json(pending_path, self.identity)
        else:
            remove_temp_files(self.dir)
        return True

    def has_part(self, name: str) -> bool:
        return (self.dir / name).is_file()

    def part_path(self, name: str) -> Path:
        return self.dir / name

    def finish(
        self, parts: list[str], counts: dict[str, Any], extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Write the manifest listing `parts` (already in place) and return it."""
        entries = []
        for name in parts:
            path = self.dir / name
            if not path.is_file():
                raise FlowGrpoError(f"{path}: cannot finish {self.stage}, part missing")
            entries.append(
                {"name": name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
            )
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "identity": self.identity,
            "counts": counts,
            "parts": entries,
            **(extra or {}),
        }
        atomic_write_json(self.dir / MANIFEST, manifest)
        (self.dir / PENDING).unlink(missing_ok=True)
        return manifest


# ---------------------------------------------------------------------------------------------
# The single-writer lock


class RunLock:
    """One writer per run: an exclusive OS lock (flock) on `run.lock`, whose text names the
    holder's pid and host for the message a refused command prints.

    The kernel drops the lock when its holder ends, however it ends, so there is no stale lock
    to detect and no read-check-delete race: two processes never hold it at once. The file is
    never deleted (deleting it would let one process lock a new file while another still holds
    the old one); release empties it. Across hosts this needs a file system with locks (NFS
    with lockd, Lustre, CephFS); the run directory is where every node sees it anyway.
    """

    def __init__(self, run_root: Path):
        self.path = RunDir(run_root).lock_path
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise FlowGrpoError(
                f"run {self.path.parent} is locked by {holder}; another flowgrpo command is "
                "writing to it (the lock ends with that process)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd = fd
        # Every earlier writer of this run is dead now (a live one would hold the lock), so
        # any temporary file left (a checkpoint, metrics.jsonl, a grid) is theirs.
        remove_temp_files(self.path.parent)
        return self

    def release(self) -> None:
        """Give up this lock (only ever one's own: the OS lock belongs to its descriptor)."""
        import fcntl

        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_holder(fd: int) -> str:
    """'pid N' (and its host when not this one), from the lock file's text when readable."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host = int(owner["pid"]), str(owner["host"])
    except (ValueError, KeyError, TypeError):  # written this instant, or not by flowgrpo
        return "another process"
    return f"pid {pid}" if host == socket.gethostname() else f"pid {pid} on host {host}"
