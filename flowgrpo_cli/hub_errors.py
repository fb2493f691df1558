"""What to tell a user when a model or reward cannot be had from the Hugging Face Hub.

One place turns huggingface_hub's errors into a sentence with the fix: whether offline mode
is on and who turned it on, the `hf download` that fetches the files once, and what a gated
repository needs (its licence accepted on its page, then `hf auth login` or HF_TOKEN).
"""

from __future__ import annotations

import os

# Set beside HF_HUB_OFFLINE by whatever turns offline mode on for its own commands (the
# Justfile's test and demo recipes, the test suite), so an error can say who did it.
OFFLINE_SOURCE_ENV = "FLOWGRPO_OFFLINE_SOURCE"


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1, true, yes, on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def offline_note() -> str:
    """Whether offline mode is on, who set it and how to turn it off; "" when it is off."""
    if not offline_mode():
        return ""
    source = os.environ.get(OFFLINE_SOURCE_ENV)
    who = f"set by {source}" if source else "set in your environment"
    return (
        f"HF_HUB_OFFLINE=1 is in effect ({who}), so nothing is downloaded: unset it "
        "(`env -u HF_HUB_OFFLINE flowgrpo ...`), or download the files first"
    )


def download_hint(repo_id: str) -> str:
    return f"download it once with `hf download {repo_id}`, or name a local folder"


def hub_error_message(err: BaseException, repo_id: str) -> str | None:
    """A one-line explanation of a Hub failure for `repo_id`, or None when `err` is not one."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return (
            f"{repo_id} is a gated repository: accept its licence at "
            f"https://huggingface.co/{repo_id}, then log in with `hf auth login` (or set "
            "HF_TOKEN) and run again"
        )
    if isinstance(err, RepositoryNotFoundError):
        return (
            f"no local folder and no Hub repository {repo_id!r} (a private or gated one needs "
            "`hf auth login` or HF_TOKEN)"
        )
    if isinstance(err, LocalEntryNotFoundError | OfflineModeIsEnabled) or _names_offline(err):
        note = offline_note() or "the Hub cannot be reached (no network?)"
        return f"{repo_id} is not downloaded yet and {note}; {download_hint(repo_id)}"
    return None


def _names_offline(err: BaseException) -> bool:
    """diffusers and transformers re-raise a missing cached file as a plain OSError."""
    text = str(err).lower()
    return isinstance(err, OSError) and ("offline" in text or "cannot reach" in text)
