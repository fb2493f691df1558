"""`remote`: scores from an HTTP server, for preference models or VLM judges served elsewhere.

Wire format (JSON over HTTP POST, Content-Type: application/json), one request per batch of
at most `batch_size` images:

    request  {"images": ["<base64 PNG>", ...],
              "prompts": ["...", ...],
              "ground_truths": ["..." or null, ...],     # null: not known
              "metadata": [{"sample_id": ..., "group_id": ..., ...}, ...]}
    response {"scores": [0.73, ...],                    # one finite number per image
              "errors": [null, "why image 2 failed", ...]}   # optional

Every list has one entry per image, in order. A per-image failure is reported through
`errors` (its score is then ignored, null is fine); a null score with no message, or a score
that is not a finite number, becomes an error for that image only. A reply that is not this
shape (not JSON, no `scores`, the wrong number of entries) or an HTTP error is a FlowGrpoError
naming the URL and the images: the server is broken, not the image. Timeouts, connection
errors, HTTP 408/429 and 5xx are retried `max_retries` times, waiting backoff_s, 2*backoff_s,
4*backoff_s, ... between attempts; other HTTP errors are not retried.

`timeout_s` bounds a whole attempt (connect, send, and the reply to its last byte), not each
socket read: a server that trickles a byte at a time cannot stall scoring. A reply larger than
`max_reply_mb` is refused without reading the rest, and so is a reply nested deeper than 16
levels or holding a number of more than 4300 digits. `deadline_s` bounds the whole batch of
the score stage (every request, retry and backoff for it), so a server that keeps failing
slowly stops scoring within it rather than after max_retries x timeout_s per request. The
connection is made directly (no HTTP proxy), as reward servers sit next to the trainer.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import math
import socket
import threading
import time
import urllib.parse
from typing import Any

from PIL import Image

from flowgrpo_cli import __version__, untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.store.config import RemoteRewardSection, RewardSection

RETRIED_HTTP_CODES = frozenset({408, 429, 500, 502, 503, 504})
_EXCERPT = 200
_REPLY_DEPTH = 16  # {"scores": [...], "errors": [...]} nests 2 deep


def encode_png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    # Level 1: several times faster than the default and lossless all the same.
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _json_value(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars read from an Arrow table
        return value.item()
    return str(value)


def encode_request(batch: RewardBatch) -> bytes:
    payload: dict[str, object] = {
        "images": [encode_png(image) for image in batch.images],
        "prompts": batch.prompts,
        "ground_truths": batch.ground_truths or [None] * len(batch),
        "metadata": batch.metadata or [{}] * len(batch),
    }
    return json.dumps(payload, default=_json_value).encode("utf-8")


def decode_reply(raw: bytes, count: int, where: str) -> list[ImageScore]:
    """The scores in a reply, one per image; raises FlowGrpoError unless it is well formed."""
    try:
        reply = untrusted.loads(raw, max_depth=_REPLY_DEPTH)
    except untrusted.BadJSON as err:
        what = "is not JSON" if err.column is not None else "is refused"
        raise FlowGrpoError(f"{where}: the reply {what} ({err}): {_excerpt(raw)}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
        raise FlowGrpoError(
            f'{where}: expected a JSON object {{"scores": [...]}}, got {_excerpt(raw)}'
        )
    scores = reply["scores"]
    errors = reply.get("errors")
    if errors is None:
        errors = [None] * len(scores)
    elif not isinstance(errors, list):
        raise FlowGrpoError(f'{where}: "errors" must be a list, got {_excerpt(raw)}')
    for key, column in (("scores", scores), ("errors", errors)):
        if len(column) != count:
            raise FlowGrpoError(f'{where}: {len(column)} "{key}" for {count} images')
    return [_image_score(score, error) for score, error in zip(scores, errors, strict=True)]


def _image_score(score: object, error: object) -> ImageScore:
    if error is not None:
        return ImageScore.failed(f"server: {error}")
    if score is None:
        return ImageScore.failed("server sent a null score and no error")
    return ImageScore.checked(score)


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "...")


class RemoteReward:
    name = "remote"
    needs: frozenset[Need] = frozenset({"images", "prompts"})
    parallel_safe = True  # waits on the network while the other rewards compute

    def __init__(self, options: RemoteRewardSection) -> None:
        self.options = options

    def score(self, batch: RewardBatch) -> RewardOutput:
        """Scores of `batch`, in requests of batch_size images; all of them together, retries
        and backoff included, end by `deadline_s` from now."""
        size = self.options.batch_size
        deadline = time.monotonic() + self.options.deadline_s
        scores: list[ImageScore] = []
        for start in range(0, len(batch), size):
            stop = min(start + size, len(batch))
            chunk = batch.slice(start, stop)
            where = f"remote reward {self.options.url} (images {start}..{stop - 1})"
            raw = self._post(encode_request(chunk), where, deadline)
            scores.extend(decode_reply(raw, len(chunk), where))
        return RewardOutput(scores=scores)

    def _post(self, body: bytes, where: str, deadline: float = math.inf) -> bytes:
        attempts = self.options.max_retries + 1
        failure = ""
        for attempt in range(attempts):
            wait = self.options.backoff_s * 2 ** (attempt - 1) if attempt else 0.0
            left = deadline - time.monotonic()
            if left <= wait:
                raise FlowGrpoError(
                    f"{where}: no reply within the batch's deadline ([reward.remote] "
                    f"deadline_s = {self.options.deadline_s}) after {attempt} attempt(s), "
                    f"last: {failure or 'none'}; is the server up, or too slow?"
                )
            time.sleep(wait)
            try:
                status, reason, raw = self._attempt(body, where, deadline - time.monotonic())
            except (OSError, http.client.HTTPException) as err:
                failure = f"{type(err).__name__}: {err}"
                continue
            if status < 400:
                return raw
            failure = f"HTTP {status} {reason}: {_excerpt(raw)}"
            if status not in RETRIED_HTTP_CODES:
                raise FlowGrpoError(f"{where}: {failure}")
        raise FlowGrpoError(
            f"{where}: no reply after {attempts} attempt(s), last: {failure} "
            f"([reward.remote] timeout_s = {self.options.timeout_s}, "
            f"max_retries = {self.options.max_retries}); is the server up?"
        )

    def _attempt(self, body: bytes, where: str, left: float = math.inf) -> tuple[int, str, bytes]:
        """One request: (status, reason, body of the reply). A watchdog shuts the socket at
        the deadline (timeout_s, or the `left` seconds of the batch's deadline if fewer),
        which ends any read blocked on it, so the whole attempt is bounded."""
        url = urllib.parse.urlsplit(self.options.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        timeout = min(self.options.timeout_s, max(left, 0.001))
        if not url.hostname:  # refused when the section is built (url_problem); "" if unset
            raise FlowGrpoError(f"{where}: {self.options.url!r} names no host")
        connection = kind(url.hostname, url.port, timeout=timeout)
        expired = threading.Event()
        # the socket, kept here: the connection drops it once a reply is read
        sockets: list[socket.socket] = []

        def expire() -> None:
            expired.set()
            for sock in sockets:
                with contextlib.suppress(OSError):  # closed meanwhile: nothing to do
                    sock.shutdown(socket.SHUT_RDWR)  # a blocked read returns at once

        watchdog = threading.Timer(timeout, expire)
        watchdog.start()
        try:
            connection.connect()
            sockets.append(connection.sock)
            target = (url.path or "/") + (f"?{url.query}" if url.query else "")
            connection.request("POST", target, body=body, headers={
                "Content-Type": "application/json",
                "Accept": "application/json",
                "User-Agent": f"flowgrpo/{__version__}",
            })  # fmt: skip
            reply = connection.getresponse()
            raw = self._read_capped(reply, where)
        except (OSError, http.client.HTTPException):
            if not expired.is_set():
                raise
        finally:
            watchdog.cancel()
            connection.close()
        if expired.is_set():  # a shut socket can also read as the end of a short reply
            raise TimeoutError(f"timed out: no complete reply within {timeout} s")
        return reply.status, reply.reason, raw

    def _read_capped(self, reply: http.client.HTTPResponse, where: str) -> bytes:
        cap = int(self.options.max_reply_mb * 2**20)
        declared = reply.getheader("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise FlowGrpoError(self._too_large(where, f"{int(declared)} bytes declared"))
        chunks, size = [], 0
        while chunk := reply.read(2**16):
            size += len(chunk)
            if size > cap:
                raise FlowGrpoError(self._too_large(where, f"over {cap} bytes"))
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, where: str, size: str) -> str:
        return (
            f"{where}: the reply is too large ({size}; [reward.remote] max_reply_mb = "
            f"{self.options.max_reply_mb}); a reply holds one score per image"
        )

    @property
    def info(self) -> dict[str, str]:
        return {"url": self.options.url}

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def build_remote(section: RewardSection) -> RemoteReward:
    if not section.remote.url:
        raise FlowGrpoError(
            'reward "remote" needs a server: set [reward.remote] url = "http://host:port/score"'
        )
    return RemoteReward(section.remote)
