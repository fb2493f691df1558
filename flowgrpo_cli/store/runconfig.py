"""Resolve the config a command runs with, and keep it consistent across a run's commands.

The first command on a run writes the resolved config to `RUN/config.toml`, once it holds the
run's lock (`ResolvedRun.writing`): a command the lock refuses changes nothing, and one that
fails before computing anything takes its config (and the folder it created) away again;
data it prepared itself counts as nothing computed when nothing was computed from it (`loop`
prepares before it loads the model, which may fail on a wrong path or LoRA rank). Later
commands read it back; if the user passes a config (or `--set` overrides) that differs in
anything that changes results, the command is refused with a diff, unless `allow_change` is
set, in which case the new config replaces the stored one: stage manifests record the config
hash, so an unfinished stage of the old config is redone, not mixed, while finished iterations
stay as they were computed (`flowgrpo loop --restart-from N` redoes them). A run that holds
results but lost its config.toml is an error, never silently given the defaults.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import Config, config_diff, dumps_config, load_config
from flowgrpo_cli.store.rundir import RunDir, RunLock, atomic_write_bytes


@dataclass(frozen=True)
class ResolvedRun:
    config: Config
    run: RunDir
    config_text: bytes | None = None  # what RUN/config.toml must hold; None: it already does

    def store_config(self) -> None:
        """Write the run's config, if it is new or was changed. Call it holding the run lock."""
        if self.config_text is not None:
            self.run.root.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.run.config_path, self.config_text)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the run's lock and store its config around a command's work.

        A command that fails before computing anything leaves the run as it found it: no
        config.toml, lock file or folder that it created, so the next command starts clean,
        and the config.toml it replaced (a changed config) is put back.
        """
        root = self.run.root
        had_folder, had_config = root.exists(), self.run.config_path.exists()
        had_lock = os.path.lexists(self.run.lock_path)
        had_data = os.path.lexists(self.run.data_dir)
        undo = False
        with RunLock(root):
            # A command that replaces the config and then fails before computing anything
            # puts the old one back: what it computed is what the new config is kept for.
            old_config = before = None
            if had_config and self.config_text is not None:
                old_config = self.run.config_path.read_bytes()
                before = _computed(self.run)
            try:
                self.store_config()
                yield
            except BaseException:
                if not had_data and _only_data(self.run):
                    # `loop` prepares the data before it loads the model: data this command
                    # made, and nothing computed from it, goes with the failed command.
                    shutil.rmtree(self.run.data_dir, ignore_errors=True)
                if old_config is not None and _computed(self.run) == before:
                    atomic_write_bytes(self.run.config_path, old_config)
                undo = not self.run.holds_results()
                if undo:  # under the lock: no other command can be writing its config now
                    if not had_config:
                        self.run.config_path.unlink(missing_ok=True)
                    if not had_lock:  # harmless: the lock is the run folder's (RunLock)
                        self.run.lock_path.unlink(missing_ok=True)
                raise
            finally:
                if undo and not had_folder:
                    with contextlib.suppress(OSError):  # not empty: another command's now
                        root.rmdir()


def _only_data(run: RunDir) -> bool:
    """Whether the run's only result is its prepared data (a real folder, not a link):
    no iteration, checkpoint or evaluation was computed from it."""
    data = run.data_dir
    if data.is_symlink() or not data.is_dir() or run.iterations():
        return False
    return not any(
        os.path.lexists(p) for p in (run.checkpoint_dir(0).parent, run.eval_dir(0).parent)
    )


def _computed(run: RunDir) -> list[tuple[str, int, int]]:
    """Every entry of the run but its config and lock, with size and modification time: the
    same before and after a command that computed nothing."""
    found = []
    for top, folders, files in os.walk(run.root):
        for name in [*folders, *files]:
            path = os.path.join(top, name)
            if top == str(run.root) and name.startswith(("config.toml", "run.lock")):
                continue
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                found.append((path, info.st_size, info.st_mtime_ns))
    return sorted(found)


def resolve_run(
    config_file: Path | None,
    overrides: list[str],
    run_dir: Path | None = None,
    *,
    allow_change: bool = False,
    write: bool = True,
) -> ResolvedRun:
    """Config from the run's stored copy, else `config_file`, else defaults; plus overrides.
    Nothing is written here: `write` says whether the result should be stored (store_config)."""
    requested = load_config(config_file, overrides)
    root = Path(run_dir) if run_dir is not None else Path(requested.run.dir)
    run = RunDir(root.expanduser().absolute())
    if os.path.lexists(run.config_path) and not run.config_path.is_file():
        raise FlowGrpoError(
            f"{run.config_path} is not a file: a run's config.toml is the TOML file flowgrpo "
            "wrote there; move that away and restore the file"
        )
    if not run.config_path.exists() and config_file is None and run.holds_results():
        raise FlowGrpoError(
            f"{run.config_path} is missing, but {run.root} holds results: restore that file, "
            "or pass --config with the config the run was made with (and the --set options "
            "it had); flowgrpo does not guess it from the defaults"
        )
    if run.config_path.is_file():
        stored = load_config(run.config_path)
        if config_file is None:  # `--set` alone adjusts the stored config
            requested = load_config(run.config_path, overrides)
        changes = config_diff(stored, requested)
        # A run where nothing was computed yet (a first command that failed, say) takes the
        # new config: no output can be mixed with another config's.
        if changes and not allow_change and run.holds_results():
            raise FlowGrpoError(
                f"{run.config_path} holds a different config; changed keys:\n  "
                + "\n  ".join(changes)
                + "\nPass --allow-config-change to replace it (finished iterations stay as "
                "they are; `flowgrpo loop --restart-from N` redoes them)."
            )
        if not changes and requested == stored:
            write = False
    config = replace(requested, run=replace(requested.run, dir=str(run.root)))
    text = dumps_config(config).encode() if write else None
    return ResolvedRun(config=config, run=run, config_text=text)
