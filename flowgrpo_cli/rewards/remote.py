"""`remote`: scores from an HTTP server, for preference models or VLM judges served elsewhere.

Wire format (JSON over HTTP POST, Content-Type: application/json), one request per batch of
at most `batch_size` images:

    request  {"images": ["<base64 PNG>", ...],
              "prompts": ["...", ...],
              "ground_truths": ["..." or null, ...],     # null: not known
              "metadata": [{"sample_id": ..., "group_id": ..., ...}, ...],
              "source_images": ["<base64 PNG>", ...]}    # an editing data set's only
    response {"scores": [0.73, ...],                    # one finite number per image
              "errors": [null, "why image 2 failed", ...]}   # optional

Every list has one entry per image, in order. `source_images[i]` is the image that image i's
prompt edits (RGB, at the data set's size), sent only when the batch has them: a
text-to-image request is the same bytes as before the field existed. A server that needs them
says so to the trainer through `[reward.remote] needs`. A per-image failure is reported through
`errors` (its score is then ignored, null is fine); a null score with no message, or a score
that is not a finite number, becomes an error for that image only. A reply that is not this
shape (not JSON, no `scores`, the wrong number of entries) or an HTTP error is a FlowGrpoError
naming the URL and the images: the server is broken, not the image.

The HTTP part (`timeout_s` per attempt, retries with backoff, the `max_reply_mb` cap, the
`deadline_s` of a whole batch of the score stage, no proxy) is transport.py's, shared with the
`vlm` reward. A reply nested deeper than 16 levels or holding a number of more than 4300
digits is refused as malformed.
"""

from __future__ import annotations

import base64
import io
import json
import time
from typing import Any, cast

from PIL import Image

from flowgrpo_cli import untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import ImageScore, Need, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.transport import JsonPoster, excerpt
from flowgrpo_cli.store.config import RemoteRewardSection, RewardSection

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
    if batch.source_images is not None:  # only then: text-to-image requests stay as they were
        payload["source_images"] = _encode_each_once(batch.source_images)
    return json.dumps(payload, default=_json_value).encode("utf-8")


def _encode_each_once(images: list[Image.Image]) -> list[str]:
    """Base64 PNGs of `images`, each distinct image object encoded once (a group's images
    share their prompt's source image)."""
    encoded: dict[int, str] = {}
    for image in images:
        if id(image) not in encoded:
            encoded[id(image)] = encode_png(image)
    return [encoded[id(image)] for image in images]


def decode_reply(raw: bytes, count: int, where: str) -> list[ImageScore]:
    """The scores in a reply, one per image; raises FlowGrpoError unless it is well formed."""
    try:
        reply = untrusted.loads(raw, max_depth=_REPLY_DEPTH)
    except untrusted.BadJSON as err:
        what = "is not JSON" if err.column is not None else "is refused"
        raise FlowGrpoError(f"{where}: the reply {what} ({err}): {excerpt(raw)}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("scores"), list):
        raise FlowGrpoError(
            f'{where}: expected a JSON object {{"scores": [...]}}, got {excerpt(raw)}'
        )
    scores = reply["scores"]
    errors = reply.get("errors")
    if errors is None:
        errors = [None] * len(scores)
    elif not isinstance(errors, list):
        raise FlowGrpoError(f'{where}: "errors" must be a list, got {excerpt(raw)}')
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


class RemoteReward:
    name = "remote"
    needs: frozenset[Need] = frozenset({"images", "prompts"})
    parallel_safe = True  # waits on the network while the other rewards compute

    def __init__(self, options: RemoteRewardSection) -> None:
        self.options = options
        self.needs = _needs(options)
        self._poster = JsonPoster(options.url, options)

    @classmethod
    def configured_needs(cls, section: RewardSection) -> frozenset[Need]:
        """What it reads under [reward] `section`: its own needs and the server's (`needs`)."""
        return _needs(section.remote)

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
            raw = self._poster.post(encode_request(chunk), where, deadline)
            scores.extend(decode_reply(raw, len(chunk), where))
        return RewardOutput(scores=scores)

    @property
    def info(self) -> dict[str, str]:
        return {"url": self.options.url}

    def close(self) -> None:
        """Nothing to release: each request opens and closes its own connection."""


def _needs(options: RemoteRewardSection) -> frozenset[Need]:
    # cast: the config's check allows only names of REMOTE_NEEDS, each a Need.
    return RemoteReward.needs | frozenset(cast("list[Need]", options.needs))


def build_remote(section: RewardSection) -> RemoteReward:
    if not section.remote.url:
        raise FlowGrpoError(
            'reward "remote" needs a server: set [reward.remote] url = "http://host:port/score"'
        )
    return RemoteReward(section.remote)
