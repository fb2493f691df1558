"""JSON over HTTP POST, bounded, for the rewards that ask a server (`remote`, `vlm`).

One `JsonPoster` per server URL. `post(body, where, deadline)` returns the reply's bytes, or
raises FlowGrpoError naming `where` and the config keys that bound it:

- `timeout_s` bounds a whole attempt (connect, send, and the reply to its last byte), not each
  socket read: a server that trickles a byte at a time cannot stall scoring;
- timeouts, connection errors, HTTP 408/429 and 5xx are retried `max_retries` times, waiting
  backoff_s, 2*backoff_s, 4*backoff_s, ... between attempts; other HTTP errors are not retried;
- a reply larger than `max_reply_mb` is refused without reading the rest;
- `deadline` (a time.monotonic() value; the callers set it `deadline_s` ahead) bounds every
  attempt and backoff for it, so a server that keeps failing slowly stops scoring within it.

The connection is made directly (no HTTP proxy), as reward servers sit next to the trainer.
"""

from __future__ import annotations

import contextlib
import http.client
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping

from flowgrpo_cli import __version__
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.config import HttpRewardSection

RETRIED_HTTP_CODES = frozenset({408, 429, 500, 502, 503, 504})
_EXCERPT = 200


def excerpt(raw: bytes) -> str:
    """The start of a reply, quoted, for an error message."""
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= _EXCERPT else text[:_EXCERPT] + "...")


class JsonPoster:
    """POSTs JSON bodies to `url` under the limits of `options` (a [reward.*] table), with
    `headers` added to every request (an Authorization header, say)."""

    def __init__(
        self, url: str, options: HttpRewardSection, headers: Mapping[str, str] | None = None
    ) -> None:
        self.url = url
        self.options = options
        self.headers = dict(headers or {})

    def post(self, body: bytes, where: str, deadline: float = math.inf) -> bytes:
        """The body of the first successful reply (HTTP status below 400)."""
        options, table = self.options, self.options.TABLE
        attempts = options.max_retries + 1
        failure = ""
        for attempt in range(attempts):
            wait = options.backoff_s * 2 ** (attempt - 1) if attempt else 0.0
            left = deadline - time.monotonic()
            if left <= wait:
                raise FlowGrpoError(
                    f"{where}: no reply within the batch's deadline ([{table}] "
                    f"deadline_s = {options.deadline_s}) after {attempt} attempt(s), "
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
            failure = f"HTTP {status} {reason}: {excerpt(raw)}"
            if status not in RETRIED_HTTP_CODES:
                raise FlowGrpoError(f"{where}: {failure}")
        raise FlowGrpoError(
            f"{where}: no reply after {attempts} attempt(s), last: {failure} "
            f"([{table}] timeout_s = {options.timeout_s}, "
            f"max_retries = {options.max_retries}); is the server up?"
        )

    def _attempt(self, body: bytes, where: str, left: float = math.inf) -> tuple[int, str, bytes]:
        """One request: (status, reason, body of the reply). A watchdog shuts the socket at
        the deadline (timeout_s, or the `left` seconds of the batch's deadline if fewer),
        which ends any read blocked on it, so the whole attempt is bounded."""
        url = urllib.parse.urlsplit(self.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        timeout = min(self.options.timeout_s, max(left, 0.001))
        if not url.hostname:  # refused when the section is built (url_problem); "" if unset
            raise FlowGrpoError(f"{where}: {self.url!r} names no host")
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
                **self.headers,
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
            f"{where}: the reply is too large ({size}; [{self.options.TABLE}] max_reply_mb = "
            f"{self.options.max_reply_mb}); is this the scoring server?"
        )
