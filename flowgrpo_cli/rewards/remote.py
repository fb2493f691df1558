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
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
import urllib.error
import urllib.request
from typing import Any

from PIL import Image

from flowgrpo_cli import __version__
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.options import RemoteOptions, RewardOptions

RETRIED_HTTP_CODES = frozenset({408, 429, 500, 502, 503, 504})
_EXCERPT = 200


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
    payload = {
        "images": [encode_png(image) for image in batch.images],
        "prompts": batch.prompts,
        "ground_truths": batch.ground_truths or [None] * len(batch),
        "metadata": batch.metadata or [{}] * len(batch),
    }
    return json.dumps(payload, default=_json_value).encode("utf-8")


def decode_reply(raw: bytes, count: int, where: str) -> list[ImageScore]:
    """The scores in a reply, one per image; raises FlowGrpoError unless it is well formed."""
    try:
        reply = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FlowGrpoError(f"{where}: the reply is not JSON ({err}): {_excerpt(raw)}") from None
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

    def __init__(self, options: RemoteOptions) -> None:
        self.options = options

    def score(self, batch: RewardBatch) -> RewardOutput:
        size = self.options.batch_size
        scores: list[ImageScore] = []
        for start in range(0, len(batch), size):
            stop = min(start + size, len(batch))
            chunk = batch.slice(start, stop)
            where = f"remote reward {self.options.url} (images {start}..{stop - 1})"
            raw = self._post(encode_request(chunk), where)
            scores.extend(decode_reply(raw, len(chunk), where))
        return RewardOutput(scores=scores)

    def _post(self, body: bytes, where: str) -> bytes:
        request = urllib.request.Request(
            self.options.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Accept": "application/json",
                "User-Agent": f"flowgrpo/{__version__}",
            },
        )
        attempts = self.options.max_retries + 1
        failure = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.options.backoff_s * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.options.timeout_s) as reply:
                    return reply.read()
            except urllib.error.HTTPError as err:
                failure = f"HTTP {err.code} {err.reason}: {_excerpt(_body(err))}"
                if err.code not in RETRIED_HTTP_CODES:
                    raise FlowGrpoError(f"{where}: {failure}") from None
            except (OSError, http.client.HTTPException) as err:
                # URLError wraps connection failures; a slow reply raises TimeoutError itself.
                reason = err.reason if isinstance(err, urllib.error.URLError) else err
                failure = f"{type(reason).__name__}: {reason}"
        raise FlowGrpoError(
            f"{where}: no reply after {attempts} attempt(s), last: {failure} "
            f"([reward.remote] timeout_s = {self.options.timeout_s}, "
            f"max_retries = {self.options.max_retries}); is the server up?"
        )

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def _body(err: urllib.error.HTTPError) -> bytes:
    try:
        return err.read()
    except (OSError, http.client.HTTPException):
        return b""


def build_remote(options: RewardOptions) -> RemoteReward:
    if options.remote is None:
        raise FlowGrpoError(
            'reward "remote" needs a server: set [reward.remote] url = "http://host:port/score"'
        )
    return RemoteReward(options.remote)
