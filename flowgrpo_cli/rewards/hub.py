"""Reward model files from a local folder or the Hugging Face Hub, pinned to one commit.

A hub revision (a branch such as `main`, a tag or a commit) is resolved to its commit once,
through a small file of the repository, and everything else is then read at that commit: the
run records which weights scored it, and a push to the branch mid-run cannot mix two versions.
Resolving goes through huggingface_hub's cache, so it also works offline once the files are
there (HF_HUB_OFFLINE=1). A source is a config key's value and its revision's: `model` (a
folder, a file or a hub id) and `revision` (ignored for a folder or a file).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.hub_errors import hub_error_message


@dataclass(frozen=True)
class ResolvedSource:
    """What to pass to `from_pretrained`: a folder, or a hub id with the commit to read."""

    location: str
    commit: str | None  # None for a local folder

    @property
    def record(self) -> str:
        """`hub-id@commit`, or the folder: what the score manifest stores."""
        return f"{self.location}@{self.commit}" if self.commit else self.location


def resolve_folder(model: str, revision: str, probe: str, key: str) -> ResolvedSource:
    """A model folder (`probe`, e.g. config.json, must be in it) or a hub repository.

    `key` names the config key the source came from, for error messages.
    """
    folder = Path(model).expanduser()
    if folder.is_dir():
        if not (folder / probe).is_file():
            raise FlowGrpoError(f"{key} = {model!r}: the folder has no {probe}")
        return ResolvedSource(str(folder.resolve()), None)
    _, commit = _download(model, revision, probe, key)
    return ResolvedSource(model, commit)


def resolve_file(model: str, revision: str, filename: str, key: str) -> tuple[Path, str]:
    """A weights file: `model` is the file itself, a folder holding `filename`, or a hub
    repository holding it. Returns the local path and what the manifest records."""
    given = Path(model).expanduser()
    if given.is_file():
        return given.resolve(), str(given.resolve())
    if given.is_dir():
        path = given / filename
        if not path.is_file():
            raise FlowGrpoError(f"{key} = {model!r}: the folder has no {filename}")
        return path.resolve(), str(path.resolve())
    path, commit = _download(model, revision, filename, key)
    return path, f"{model}@{commit}/{filename}"


def _download(model: str, revision: str, filename: str, key: str) -> tuple[Path, str]:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{key} = {model!r}"
    try:
        path = Path(hf_hub_download(model, filename, revision=revision))
    except HFValidationError:
        raise FlowGrpoError(f"{where}: no such folder, and not a valid hub id") from None
    except RevisionNotFoundError:
        raise FlowGrpoError(f"{where}: the repository has no revision {revision!r}") from None
    except (RepositoryNotFoundError, LocalEntryNotFoundError) as err:
        # LocalEntryNotFoundError subclasses EntryNotFoundError: caught before it
        raise FlowGrpoError(f"{where}: {hub_error_message(err, model)}") from None
    except EntryNotFoundError:
        raise FlowGrpoError(f"{where}: the repository has no {filename}") from None
    # The cache keeps every file under snapshots/<commit>/<filename>.
    commit = path.parents[len(Path(filename).parts) - 1].name
    return path, commit


def load_pretrained(cls: Any, source: ResolvedSource, **kwargs: Any) -> Any:
    """`cls.from_pretrained` of a resolved source, at its commit; a folder or repository
    without the files `cls` reads is a FlowGrpoError naming it."""
    from flowgrpo_cli.loading import quiet_loading

    quiet_loading()  # transformers' torchvision fallback warning, its progress bars
    try:
        return cls.from_pretrained(source.location, revision=source.commit or "main", **kwargs)
    except OSError as err:
        raise FlowGrpoError(f"{source.record}: cannot load {cls.__name__}: {err}") from None


def check_model_type(source: ResolvedSource, model_type: str, key: str) -> None:
    """FlowGrpoError naming `key` unless the config.json of `source` is of `model_type`
    ("clip", "dinov2"): from_pretrained of another model's folder would load with random
    weights wherever the names differ, and score noise without a word."""
    from transformers import AutoConfig

    try:
        found = load_pretrained(AutoConfig, source).model_type
    except (FlowGrpoError, ValueError) as err:  # ValueError: a model_type transformers lacks
        raise FlowGrpoError(
            f"{key} = {source.record!r}: cannot read its config.json as a {model_type!r} "
            f"model's: {' '.join(str(err).split())[:300]}"
        ) from None
    if found != model_type:
        raise FlowGrpoError(
            f"{key} = {source.record!r}: its config.json is a {found!r} model, not {model_type!r}"
        )
