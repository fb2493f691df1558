"""Settings rewards read when they are built (kept apart so that naming them loads nothing)."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from flowgrpo_cli.errors import FlowGrpoError


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach the scoring server; the fields mirror the config's [reward.remote]."""

    url: str
    timeout_s: float = 60.0  # per attempt: connect, send, and the whole reply
    max_retries: int = 3  # attempts after the first one
    batch_size: int = 16  # images per request
    backoff_s: float = 1.0  # wait before the first retry; doubles for each further one
    max_reply_mb: float = 16.0  # a larger reply is refused, not read

    def __post_init__(self) -> None:
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in ("http", "https"):
            raise FlowGrpoError(
                f"[reward.remote] url = {self.url!r}: expected an http:// or https:// URL"
            )
        if not self.timeout_s > 0:
            raise FlowGrpoError(f"[reward.remote] timeout_s = {self.timeout_s}: must be > 0")
        if not self.backoff_s >= 0:
            raise FlowGrpoError(f"[reward.remote] backoff_s = {self.backoff_s}: must be >= 0")
        if self.max_retries < 0:
            raise FlowGrpoError(f"[reward.remote] max_retries = {self.max_retries}: must be >= 0")
        if self.batch_size < 1:
            raise FlowGrpoError(f"[reward.remote] batch_size = {self.batch_size}: must be >= 1")
        if not self.max_reply_mb > 0:
            raise FlowGrpoError(f"[reward.remote] max_reply_mb = {self.max_reply_mb}: must be > 0")


@dataclass(frozen=True)
class RewardOptions:
    """What build_rewards passes to every reward's builder; each reads what it needs."""

    ocr_workers: int = 1
    remote: RemoteOptions | None = None
