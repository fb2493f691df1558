"""`flowgrpo serve-reward`: any reward behind the `remote` reward's wire format.

POST /score takes one batch in the wire format of rewards/remote.py and answers with the
weighted total of the served rewards, `{"scores": [...], "errors": [...]}`, one entry per
image; GET /health answers `{"status": "ok", "rewards": {name: weight}}`. With it, reward
models run on other machines or GPUs and the trainer's `remote` reward talks to them.

- The rewards are built once, before the server listens (one model load per process), and
  closed when it stops (SIGINT or SIGTERM: uvicorn finishes the requests in flight first).
- Requests are batched (`BatchingScorer`): one worker scores one batch at a time, in a thread,
  so the event loop keeps answering /health and a GPU reward never sees two batches at once.
  Requests that arrive while a batch is being scored wait, and the next batch takes as many of
  them as fit in `max_images`: an idle server answers a lone request at once, a busy one
  scores many trainers' requests in one forward. Requests are merged only with those that
  carry the same optional columns; each gets its own images' scores back (a reward scores
  every image on its own). If a merged batch fails as a whole, its requests are scored one
  by one, so one request's failure is its own.
- A malformed request is HTTP 400 with what is wrong; a reward that fails as a whole (a bug,
  a wrong number of scores) is HTTP 500 with its message, which the `remote` reward retries
  and then reports; a failure on single images travels in `errors`, as the format says.
- Requests are untrusted and bounded (`Limits`, each a `serve-reward` option): the body is
  read as it streams in and refused with 413 once past `max_request_mb` (a declared
  Content-Length over it is refused before reading anything); more than `max_images` images,
  an image (or source image) whose header declares more than `max_image_pixels` pixels
  (checked before it is decoded: a decompression bomb never is), and JSON nested deeper than
  `max_json_depth` are 400, each naming the option. A client that hangs up mid-body is one
  log line.
- `source_images` (an editing data set's, one per image) is optional; a served reward that
  needs them (a plugin whose `needs` holds "source_images") gets a 400 naming the field when a
  request lacks them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import itertools
import logging
import math
import signal
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from flowgrpo_cli import untrusted
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import RewardBatch
from flowgrpo_cli.rewards.rewardset import RewardSet, ScoreResult


class BadRequest(Exception):
    """What is wrong with a request, for its HTTP 400 reply."""


class TooLarge(Exception):
    """A request body over the size limit, for its HTTP 413 reply."""


@dataclass(frozen=True)
class Limits:
    """What one request may hold; each is a `serve-reward` option of the same name."""

    max_request_mb: float = 128.0  # body size, read as it streams in
    max_image_pixels: int = 2048 * 2048  # width x height of one image, from its header
    max_images: int = 64  # images in one request
    max_json_depth: int = 32  # nesting of arrays and objects; the wire format needs 3

    def __post_init__(self) -> None:
        for name in ("max_request_mb", "max_image_pixels", "max_images", "max_json_depth"):
            value = getattr(self, name)
            if not value > 0:
                option = "--" + name.replace("_", "-")
                raise FlowGrpoError(f"{option} {value}: must be > 0")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 2**20)


_PNG = b"\x89PNG\r\n\x1a\n"
_TEXT_COLUMNS = {"prompts": False, "ground_truths": True}  # key -> whether null is allowed


def parse_batch(body: Any, limits: Limits | None = None) -> RewardBatch:
    """A wire-format request as a RewardBatch; BadRequest names the first problem."""
    limits = limits or Limits()
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with `images`")
    images = body.get("images")
    if not isinstance(images, list) or not images:
        raise BadRequest("`images` must be a non-empty list of base64 PNG strings")
    count = len(images)
    if count > limits.max_images:
        raise BadRequest(
            f"`images`: {count} images in one request; at most {limits.max_images} "
            "(--max-images): send smaller batches ([reward.remote] batch_size)"
        )
    lists = {}
    for key in ("prompts", "ground_truths", "metadata"):
        value = body.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != count):
            raise BadRequest(f"`{key}` must be a list with one entry per image ({count})")
        if value is not None:
            _check_entries(key, value)
        lists[key] = value
    decoded = [_decode_image(f"images[{i}]", text, limits) for i, text in enumerate(images)]
    sources = body.get("source_images")
    if sources is not None and (not isinstance(sources, list) or len(sources) != count):
        raise BadRequest(
            f"`source_images` must be a list with one base64 image per image ({count})"
        )
    return RewardBatch(
        decoded,
        lists["prompts"],
        lists["ground_truths"],
        lists["metadata"],
        _decode_sources(sources, limits) if sources is not None else None,
    )


def _decode_sources(sources: list, limits: Limits) -> list[Image.Image]:
    """The `source_images` of a request, each distinct one decoded once (a group's images
    share their prompt's source), under the limits of `images`."""
    decoded: dict[str, Image.Image] = {}
    out = []
    for index, text in enumerate(sources):
        if not isinstance(text, str):
            raise BadRequest(f"source_images[{index}] is not a base64-encoded image")
        if text not in decoded:
            decoded[text] = _decode_image(f"source_images[{index}]", text, limits)
        out.append(decoded[text])
    return out


def _check_entries(key: str, values: list) -> None:
    for index, value in enumerate(values):
        if key == "metadata":
            ok, what = isinstance(value, dict), "an object"
        else:
            ok = isinstance(value, str) or (value is None and _TEXT_COLUMNS[key])
            what = "a string or null" if _TEXT_COLUMNS[key] else "a string"
        if not ok:
            raise BadRequest(f"`{key}[{index}]` must be {what}, got {type(value).__name__}")


def _decode_image(where: str, text: object, limits: Limits) -> Image.Image:
    """The image at `where` in a request (`images[3]`), refused before decoding when its
    header declares more than the pixel limit (a decompression bomb is a few hundred bytes
    of PNG)."""
    try:
        data = base64.b64decode(text, validate=True)  # type: ignore[arg-type]
    except (TypeError, ValueError, binascii.Error):
        raise BadRequest(f"{where} is not a base64-encoded image") from None
    if data.startswith(_PNG) and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        _check_pixels(where, width, height, limits)
    try:
        with Image.open(io.BytesIO(data)) as image:
            _check_pixels(where, *image.size, limits)
            return image.convert("RGB")
    except Image.DecompressionBombError as err:  # a format whose header was not read above
        raise BadRequest(f"{where}: {err} (--max-image-pixels {limits.max_image_pixels})") from None
    except (TypeError, ValueError, UnidentifiedImageError, OSError):
        raise BadRequest(f"{where} is not a base64-encoded image") from None


def _check_pixels(where: str, width: int, height: int, limits: Limits) -> None:
    if width * height > limits.max_image_pixels:
        raise BadRequest(
            f"{where} is {width}x{height} = {width * height} pixels; at most "
            f"{limits.max_image_pixels} (--max-image-pixels)"
        )


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, read as it arrives; TooLarge as soon as it passes `limit` bytes
    (at once when its Content-Length says it will), without reading the rest."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"{int(declared)} bytes declared")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def url_of(host: str, port: int) -> str:
    """The URL of the score endpoint; an IPv6 address goes in brackets."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}/score"


@dataclass(eq=False)  # a job is itself: `in` compares identity, never two batches' images
class _Job:
    batch: RewardBatch
    done: asyncio.Future


class BatchingScorer:
    """Scores requests' batches with `rewards`, merging those that wait (see the module
    docstring). Used from one event loop; `score` is awaited by each request."""

    def __init__(self, rewards: RewardSet, max_images: int) -> None:
        self.rewards, self.max_images = rewards, max_images
        self._waiting: list[_Job] = []
        self._worker: asyncio.Task | None = None

    async def score(self, batch: RewardBatch) -> ScoreResult:
        job = _Job(batch, asyncio.get_running_loop().create_future())
        self._waiting.append(job)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work())
        return await job.done

    async def _work(self) -> None:
        while self._waiting:
            jobs = self._take()
            for job, outcome in zip(jobs, await self._outcomes(jobs), strict=True):
                if job.done.done():  # its request went away (the client hung up)
                    continue
                if isinstance(outcome, Exception):
                    job.done.set_exception(outcome)
                else:
                    job.done.set_result(outcome)

    def _take(self) -> list[_Job]:
        """The first waiting job (whatever its size) and every later one that fits beside it."""
        first, *rest = self._waiting
        taken, count = [first], len(first.batch)
        for job in rest:
            if _same_columns(job.batch, first.batch) and count + len(job.batch) <= self.max_images:
                taken.append(job)
                count += len(job.batch)
        self._waiting = [job for job in self._waiting if job not in taken]
        return taken

    async def _outcomes(self, jobs: list[_Job]) -> list[ScoreResult | Exception]:
        """Each job's scores, or the error scoring its batch raised. A merged batch that fails
        as a whole is scored again job by job, so the error reaches only the job behind it."""
        if len(jobs) > 1:
            try:
                merged = await self._score(_merged([job.batch for job in jobs]))
            except Exception:  # whose batch failed is found below, job by job
                pass
            else:
                bounds = list(itertools.accumulate((len(job.batch) for job in jobs), initial=0))
                return [merged.slice(a, b) for a, b in itertools.pairwise(bounds)]
        outcomes: list[ScoreResult | Exception] = []
        for job in jobs:
            try:
                outcomes.append(await self._score(job.batch))
            except Exception as err:
                outcomes.append(err)
        return outcomes

    async def _score(self, batch: RewardBatch) -> ScoreResult:
        return await asyncio.to_thread(self.rewards.score, batch)


_OPTIONAL_COLUMNS = ("prompts", "ground_truths", "metadata", "source_images")


def _same_columns(a: RewardBatch, b: RewardBatch) -> bool:
    """Whether two batches carry the same optional columns, so they can be joined."""
    return all(
        (getattr(a, name) is None) == (getattr(b, name) is None) for name in _OPTIONAL_COLUMNS
    )


def _merged(batches: list[RewardBatch]) -> RewardBatch:
    def joined(name: str) -> list | None:
        if getattr(batches[0], name) is None:
            return None
        return [item for batch in batches for item in getattr(batch, name)]

    images = [image for batch in batches for image in batch.images]
    return RewardBatch(images, **{name: joined(name) for name in _OPTIONAL_COLUMNS})


def build_app(scorer: BatchingScorer, limits: Limits | None = None):  # -> Starlette
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = limits or Limits()

    async def score(request: Request) -> JSONResponse:
        try:
            raw = await read_body(request, limits.max_request_bytes)
        except TooLarge as err:
            return JSONResponse(
                {"error": f"the body is too large ({err}); at most {limits.max_request_mb} MB "
                          "(--max-request-mb): send smaller batches ([reward.remote] batch_size)"},
                status_code=413, headers={"Connection": "close"},
            )  # fmt: skip
        except ClientDisconnect:
            client = f"{request.client.host}:{request.client.port}" if request.client else "?"
            logging.getLogger("uvicorn.error").warning(
                "client %s disconnected before sending its whole request", client
            )
            return JSONResponse({"error": "disconnected"}, status_code=400)
        try:
            body = untrusted.loads(raw, max_depth=limits.max_json_depth)
        except untrusted.BadJSON as err:
            if err.column is not None:
                return JSONResponse({"error": f"the body is not JSON ({err})"}, status_code=400)
            depth = " (--max-json-depth)" if "nested" in str(err) else ""
            return JSONResponse({"error": f"the body is refused: {err}{depth}"}, status_code=400)
        try:
            batch = await asyncio.to_thread(parse_batch, body, limits)
            _check_needs(scorer.rewards, batch)
        except BadRequest as problem:
            return JSONResponse({"error": str(problem)}, status_code=400)
        try:
            result = await scorer.score(batch)
        except FlowGrpoError as err:
            return JSONResponse({"error": str(err)}, status_code=500)
        scores = [None if v is None or not math.isfinite(v) else v for v in result.reward]
        return JSONResponse({"scores": scores, "errors": result.reward_error})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "rewards": scorer.rewards.weights})

    return Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/health", health)])


def _check_needs(rewards: Any, batch: RewardBatch) -> None:
    """BadRequest naming the field a served reward needs and the request lacks."""
    for name, needs in getattr(rewards, "needs", {}).items():
        for need in sorted(needs):
            if not batch.has(need):
                raise BadRequest(f"`{need}` is missing: the served reward {name!r} needs it")


def serve(
    rewards: RewardSet,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    max_images: int = 64,
    limits: Limits | None = None,
) -> None:
    """Serve `rewards` until SIGINT / SIGTERM, at most `max_images` images a scored batch,
    requests within `limits`; `on_ready(url)` once the port is bound (port 0 picks a free
    one)."""
    if not 0 <= port <= 65535:
        raise FlowGrpoError(f"--port {port}: must be in 0..65535 (0 picks a free one)")
    scorer = BatchingScorer(rewards, max_images)
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host.strip("[]"), port))
    except (OSError, OverflowError) as err:
        listener.close()
        raise FlowGrpoError(f"serve-reward: cannot listen on {host}:{port}: {err}") from None
    listener.listen(128)  # from here connections wait in the backlog until uvicorn accepts
    bound = listener.getsockname()[1]
    app = build_app(scorer, limits)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    on_ready(url_of(host.strip("[]"), bound))
    _server_class()(config).run(sockets=[listener])


def _server_class():  # uvicorn is imported only when serving
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            """Stop on SIGINT / SIGTERM and return. uvicorn's own re-raises the signal once
            the server stops, which ends the process before the rewards are closed (an OCR
            pool's workers would be left behind)."""
            stops = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in stops}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
