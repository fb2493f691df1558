"""The run directory: layout, atomic files, stage manifests, checksums and the writer lock.

A stage's output folder counts only once its manifest.json exists. Every file is written under
a temporary name in the same folder, flushed to disk, then renamed into place, so a crash
never leaves a visible half-written part. The manifest, written last, records each part's size
and XXH3 digest, the config hash and the hashes of the input manifests: verification names any part
that was truncated or altered, and a re-run after a crash keeps the finished parts only when
they were written for the same config and inputs (see ``StageWriter``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import xxhash

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
    """Paths inside one run directory (docs/run-directory.md)."""

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
    def best_path(self) -> Path:
        """The best held-out evaluation so far (store.evaluations.write_best)."""
        return self.root / "best.json"

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
        return list(numbered_folders(self.root))


def numbered_folders(parent: Path) -> dict[int, Path]:
    """N -> parent/iter-N for every such folder (iterations, checkpoints, evaluations), in
    order of N."""
    found = {}
    for path in parent.glob("iter-*"):
        suffix = path.name.removeprefix("iter-")
        if path.is_dir() and suffix.isdigit():
            found[int(suffix)] = path
    return dict(sorted(found.items()))


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


def remove_temp_files(folder: Path, *, ended_only: bool = False) -> None:
    """Delete the temporary files of killed writers under `folder`, by the names atomic_file
    gives them; never through a link, nor inside a nested run (a folder holding its own
    config.toml or run.lock), whose writer may be alive.

    Call it only while no writer can be alive there: holding the run's lock, or for a stage
    folder whose writer is about to start over. `ended_only`: for a folder written without the
    lock (`flowgrpo report`), delete only the files of processes that have ended.
    """
    if folder.is_symlink() or not folder.is_dir():
        return
    for top, folders, files in os.walk(folder):
        here = Path(top)
        folders[:] = [name for name in folders if not _holds_a_run(here / name)]
        for name in files:
            found = _TMP_NAME.search(name)
            path = here / name
            if found is None or path.is_symlink() or not path.is_file():
                continue
            if ended_only and not process_ended(int(found.group()[len(_TMP_MARK) :])):
                continue
            path.unlink(missing_ok=True)


#: The folders a run's writers write into (and iter-NNNNNN); anything else in it is the user's.
_RUN_FOLDERS = ("data", "checkpoints", "eval", "samples")
_REPORT_FOLDER = "report"  # written by `flowgrpo report`, which takes no lock
_ROOT_FILES = ("config.toml", "metrics.jsonl", "best.json")  # what the run writes into its root
_ITERATION_FOLDER = re.compile(r"iter-\d+")


def remove_run_temp_files(root: Path) -> None:
    """Delete the temporary files that killed writers of the run at `root` left: in the run's
    own folders (data, iter-N, checkpoints, eval, samples, report) and beside its own root files
    (config.toml, metrics.jsonl, best.json). Nothing else: not a folder the run does not own, not a
    nested run (`flowgrpo rollout --run r/parent` must not touch a live run r/parent/child),
    not through a link. In report/, written without the lock, only an ended process's files.

    Call it holding the run's lock: every earlier writer of the run is dead then.
    """
    for path in root.iterdir() if root.is_dir() else []:
        if path.is_symlink():
            continue
        name = path.name
        if name in _RUN_FOLDERS or _ITERATION_FOLDER.fullmatch(name):
            remove_temp_files(path)
        elif name == _REPORT_FOLDER:
            remove_temp_files(path, ended_only=True)
        elif _is_root_temp_file(path):
            path.unlink(missing_ok=True)


def _is_root_temp_file(path: Path) -> bool:
    """Whether `path` is what atomic_file leaves of one of the root files a run writes."""
    name = path.name
    if not _TMP_NAME.search(name) or name[: name.rindex(_TMP_MARK)] not in _ROOT_FILES:
        return False
    return path.is_file()


def _holds_a_run(folder: Path) -> bool:
    """Whether `folder` is (or may be) another run: it holds a config.toml or run.lock."""
    return any(os.path.lexists(folder / name) for name in ("config.toml", "run.lock"))


def process_ended(pid: int) -> bool:
    """Whether no process `pid` runs on this host (a temporary file's writer has ended)."""
    if pid == os.getpid():  # ours are made after the sweep: a leftover of a reused pid
        return True
    if not 0 < pid < 1 << 22:  # beyond any pid_max
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_file(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def sha256_file(path: Path) -> str:
    """The sha256 of a file: identities (manifest hashes, input files, weight versions)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def xxh3_file(path: Path) -> str:
    """The 128-bit XXH3 digest of a file, hashed in place through a memory map.

    Parts are checked against it every time a process first reads them, so its speed sets what
    verification costs: XXH3 hashes at memory speed (about 24 GB/s here against sha256's
    1.3 GB/s, benchmark 5c). It detects truncation, bad disks and stray writes; it is not a
    defence against someone who can write the run folder, who could rewrite the manifest too.
    """
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:  # mmap refuses an empty file
            return digest.hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            digest.update(mapped)
    return digest.hexdigest()


# How a manifest's part entry names its digest: the key and the function that computes it.
# Runs written before XXH3 recorded sha256; they still verify.
PART_DIGESTS = {"xxh3_128": xxh3_file, "sha256": sha256_file}
PART_DIGEST = "xxh3_128"  # what new manifests record

# Files this process has hashed and found to match, by their stat identity: a part is hashed
# once per process, not once per stage that reads it (the loop's update reads the parts its
# score already checked). Any write, truncation, chmod or replacement changes the inode, size,
# mtime or ctime (ctime cannot be set from user space), so a changed file is hashed again.
# Timestamps are coarse (a kernel tick; seconds on some filesystems), so as git does for its
# index, a hash taken less than _RACY_NS after the file's last change is not trusted: a write
# in that same tick could leave every stat field as it was.
_verified: dict[Path, tuple[tuple[int, ...], str, str]] = {}
_RACY_NS = 2_000_000_000


def _stat_identity(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _remember(path: Path, identity: tuple[int, ...], stat_time_ns: int, kind: str,
              digest: str) -> None:  # fmt: skip
    if stat_time_ns - max(identity[3], identity[4]) > _RACY_NS:
        _verified[path.absolute()] = (identity, kind, digest)


def part_entry(path: Path, name: str) -> dict[str, Any]:
    """A manifest's entry for the part at `path`: its name, size and digest. The digest is
    remembered (see _verified), so the stages of this process that read the part later need not
    hash it again."""
    now, identity = time.time_ns(), _stat_identity(path)
    digest = xxh3_file(path)
    _remember(path, identity, now, PART_DIGEST, digest)
    return {"name": name, "bytes": identity[2], PART_DIGEST: digest}


# ---------------------------------------------------------------------------------------------
# Manifests
#
# A manifest is a JSON object read back from disk, hence dict[str, Any]: read_manifest checks
# the keys every manifest has (_manifest_problem), and each stage the ones it reads
# (store.contract types the manifests later stages read).


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
_PART_KEYS = {"name": str, "bytes": int}


def _manifest_problem(manifest: object) -> str | None:
    """What makes `manifest` unlike the ones StageWriter.finish writes, or None."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    problem = _missing_key(manifest, _MANIFEST_KEYS, "")
    for n, part in enumerate(manifest["parts"] if problem is None else []):
        if not isinstance(part, dict):
            return f"`parts[{n}]` is not an object"
        problem = problem or _missing_key(part, _PART_KEYS, f"parts[{n}].")
        if problem is None and not any(isinstance(part.get(k), str) for k in PART_DIGESTS):
            problem = f"`parts[{n}]` records no digest ({' or '.join(PART_DIGESTS)})"
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
    """Check every part listed in the manifest against its recorded size and digest (one read
    of each per process, see verify_part); a mismatch names the file and how to redo it."""
    manifest = read_manifest(stage_dir)
    if manifest is None:
        raise FlowGrpoError(f"{stage_dir}: incomplete (no {MANIFEST})")
    redo = f"delete {stage_dir} and run the stage that wrote it again"
    for part in manifest["parts"]:
        path = inside(stage_dir, part["name"], where=str(stage_dir / MANIFEST))
        if not path.is_file():
            raise FlowGrpoError(f"{path}: listed in the manifest but missing; {redo}")
        verify_part(path, part, redo)
    return manifest


def verify_part(path: Path, entry: dict[str, Any], redo: str) -> None:
    """`path` against its manifest entry (`bytes` and a digest, see PART_DIGESTS); `redo` says
    what to do if not. A file this process already hashed, unchanged since, is not hashed
    again."""
    now, identity = time.time_ns(), _stat_identity(path)
    if identity[2] != entry["bytes"]:
        raise FlowGrpoError(
            f"{path}: {identity[2]} bytes, the manifest says {entry['bytes']} (truncated or "
            f"replaced); {redo}"
        )
    kind = next(key for key in PART_DIGESTS if isinstance(entry.get(key), str))
    if _verified.get(path.absolute()) == (identity, kind, entry[kind]):
        return
    digest = PART_DIGESTS[kind](path)
    if digest != entry[kind]:
        raise FlowGrpoError(f"{path}: checksum differs from the manifest (altered); {redo}")
    _remember(path, identity, now, kind, digest)


#: Identity keys that say only how a stage's output is split into parts (one per rank), not
#: what it holds ("1 and N processes write the same samples"): a finished stage that differs
#: in them alone is kept, so a run resumes with another --nproc. An unfinished one is redone
#: (its part names depend on them).
LAYOUT_KEYS = frozenset({"world_size"})


def _same_output(finished: dict[str, Any], identity: dict[str, Any]) -> bool:
    def content(ident: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in ident.items() if key not in LAYOUT_KEYS}

    return content(finished) == content(identity)


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
            if _same_output(manifest["identity"], self.identity):
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
            entries.append(part_entry(path, name))
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
    """One writer per run: an exclusive OS lock (flock) on the run folder itself, and one on
    `run.lock` inside it, whose text names the holder's pid and host for the message a refused
    command prints.

    Why the folder: a lock on a file alone is undone by deleting the file. After
    `rm RUN/run.lock` beside a live holder, the next command creates a new run.lock and locks
    that inode, and two writers run. The run folder cannot be deleted while it holds anything,
    and a folder made in its place is another inode (another run, with none of this one's
    files), so while the holder lives every command on this run meets its lock, whatever
    happens to run.lock. Why run.lock too: on NFS a folder's flock is seen only by its own
    client, while a file's is forwarded to the server's lock manager (as an fcntl lock):
    run.lock's lock is what keeps a second host out (there, deleting run.lock beside a live
    holder does let another host in; no lock file can stop that). The kernel drops both locks
    when their holder ends, however it ends: no stale lock, no read-check-delete race.

    run.lock is opened without following a link (O_NOFOLLOW), without blocking (O_NONBLOCK: a
    FIFO does not hang the open) and without truncating; a run.lock that is not a regular file
    of the run's own (a link, a folder, a FIFO, a hard link to a file elsewhere) is refused
    before anything is written: the lock never writes through a name to another file. Once both
    locks are held, the folder's path and run.lock must still name the two inodes locked (a
    command that failed before computing anything removes them, holding the lock, as we took
    it); otherwise the lock is taken again. Release empties run.lock and keeps it.
    Across hosts this needs a file system with locks (NFS with lockd, Lustre, CephFS); the run
    directory is where every node sees it anyway.
    """

    _TRIES = 20  # a path that changes under the lock this often is something else's doing

    def __init__(self, run_root: Path):
        self.path = RunDir(run_root).lock_path
        self._fd: int | None = None  # run.lock
        self._folder_fd: int | None = None  # the run folder

    def acquire(self) -> RunLock:
        root = self.path.parent
        for _ in range(self._TRIES):
            root.mkdir(parents=True, exist_ok=True)
            try:
                folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed by a command undoing its start: again
                continue
            fd = None
            try:
                if not _flock(folder, root, folder=True):
                    raise FlowGrpoError(self._refusal(_lock_holder_at(self.path)))
                fd = _open_lock_file(self.path)
                if not _flock(fd, self.path, folder=False):
                    raise FlowGrpoError(self._refusal(_lock_holder(fd)))
                if _names(root, folder, follow=True) and _names(self.path, fd, follow=False):
                    break
            except BaseException:
                for descriptor in (fd, folder):
                    if descriptor is not None:
                        os.close(descriptor)
                raise
            os.close(fd)
            os.close(folder)
        else:
            raise FlowGrpoError(
                f"run {root}: its folder or run.lock was replaced each time the lock was taken; "
                "is another program moving it? Run the command again"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._fd, self._folder_fd = fd, folder
        # Every earlier writer of this run is dead now (a live one would hold the lock), so
        # any temporary file left in the run's own folders (a checkpoint, metrics.jsonl, a
        # grid) is theirs.
        remove_run_temp_files(root)
        return self

    def _refusal(self, holder: str) -> str:
        return (
            f"run {self.path.parent} is locked by {holder}; another flowgrpo command is "
            "writing to it (the lock ends with that process)"
        )

    def release(self) -> None:
        """Give up this lock (only ever one's own: the OS lock belongs to its descriptor)."""
        import fcntl

        if self._fd is None or self._folder_fd is None:
            return
        os.ftruncate(self._fd, 0)
        for descriptor in (self._fd, self._folder_fd):
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)
        self._fd = self._folder_fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# A folder's flock fails with these where its file system cannot lock folders; run.lock's lock
# (taken next) still keeps other writers out there.
_NO_FOLDER_LOCKS = (errno.ENOLCK, errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP)


def _flock(fd: int, path: Path, *, folder: bool) -> bool:
    """Take the exclusive lock on `fd` without waiting; False when another holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if folder and err.errno in _NO_FOLDER_LOCKS:
            return True
        raise FlowGrpoError(
            f"{path}: cannot be locked ({os.strerror(err.errno or 0)}); keep the run on a file "
            "system with locks (local, NFS with lockd, Lustre, CephFS)"
        ) from None
    return True


def _open_lock_file(path: Path) -> int:
    """run.lock, created if missing, opened read-write only if it is a regular file of its own:
    never through a link, never blocking on a FIFO, never truncated here."""
    try:
        problem = _not_a_lock_file(os.lstat(path))
    except FileNotFoundError:
        problem = None
    fd = None
    if problem is None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
                storage = storage_error(err, path)
                if storage is not None:
                    raise storage from None
                raise
            problem = "not a regular file"
    if fd is not None:
        problem = _not_a_lock_file(os.fstat(fd))  # what was opened, not what a name said
        if problem is None:
            return fd
        os.close(fd)
    raise FlowGrpoError(
        f"{path} is {problem}, not the run's own lock file: flowgrpo never writes through it. "
        "Move it out of the run folder (flowgrpo writes its own run.lock, which holds only the "
        "pid of the command writing to the run) and run the command again"
    )


def _not_a_lock_file(info: os.stat_result) -> str | None:
    """What makes a file unfit to be run.lock, or None."""
    kinds = {stat.S_ISLNK: "a symbolic link", stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO"}
    for test, kind in kinds.items():
        if test(info.st_mode):
            return kind
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_nlink != 1:
        return f"a hard link to a file with {info.st_nlink} names (one may be outside the run)"
    return None


def _names(path: Path, fd: int, *, follow: bool) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        now = os.stat(path, follow_symlinks=follow)
    except OSError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _lock_holder_at(path: Path) -> str:
    """The holder named by run.lock, read without following a link or blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "another process (its run.lock was removed)"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "another process"
        return _lock_holder(fd)
    finally:
        os.close(fd)


def _lock_holder(fd: int) -> str:
    """'pid N' (and its host when not this one), from the lock file's text when readable."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host = int(owner["pid"]), str(owner["host"])
    except (ValueError, KeyError, TypeError):  # written this instant, or not by flowgrpo
        return "another process"
    return f"pid {pid}" if host == socket.gethostname() else f"pid {pid} on host {host}"
