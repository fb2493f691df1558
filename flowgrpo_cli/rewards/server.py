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
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import itertools
import math
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import RewardBatch
from flowgrpo_cli.rewards.rewardset import RewardSet, ScoreResult


class BadRequest(Exception):
    """What is wrong with a request, for its HTTP 400 reply."""


def parse_batch(body: Any) -> RewardBatch:
    """A wire-format request as a RewardBatch; BadRequest names the first problem."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with `images`")
    images = body.get("images")
    if not isinstance(images, list) or not images:
        raise BadRequest("`images` must be a non-empty list of base64 PNG strings")
    count = len(images)
    lists = {}
    for key in ("prompts", "ground_truths", "metadata"):
        value = body.get(key)
        if value is not None and (not isinstance(value, list) or len(value) != count):
            raise BadRequest(f"`{key}` must be a list with one entry per image ({count})")
        lists[key] = value
    decoded = []
    for index, text in enumerate(images):
        try:
            data = base64.b64decode(text, validate=True)
            with Image.open(io.BytesIO(data)) as image:
                decoded.append(image.convert("RGB"))
        except (TypeError, ValueError, binascii.Error, UnidentifiedImageError, OSError):
            raise BadRequest(f"images[{index}] is not a base64-encoded image") from None
    return RewardBatch(decoded, lists["prompts"], lists["ground_truths"], lists["metadata"])


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


def _same_columns(a: RewardBatch, b: RewardBatch) -> bool:
    """Whether two batches carry the same optional columns, so they can be joined."""
    return all(
        (getattr(a, name) is None) == (getattr(b, name) is None)
        for name in ("prompts", "ground_truths", "metadata")
    )


def _merged(batches: list[RewardBatch]) -> RewardBatch:
    def joined(name: str) -> list | None:
        if getattr(batches[0], name) is None:
            return None
        return [item for batch in batches for item in getattr(batch, name)]

    images = [image for batch in batches for image in batch.images]
    return RewardBatch(images, joined("prompts"), joined("ground_truths"), joined("metadata"))


def build_app(scorer: BatchingScorer):  # -> starlette.applications.Starlette
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def score(request: Request) -> JSONResponse:
        try:
            batch = parse_batch(await request.json())
        except ValueError:  # json.JSONDecodeError included
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
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


def serve(
    rewards: RewardSet,
    host: str,
    port: int,
    on_ready: Callable[[str], None],
    max_images: int = 64,
) -> None:
    """Serve `rewards` until SIGINT / SIGTERM, at most `max_images` images a scored batch;
    `on_ready(url)` once the port is bound (port 0 picks a free one)."""
    scorer = BatchingScorer(rewards, max_images)
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as err:
        raise FlowGrpoError(f"serve-reward: cannot listen on {host}:{port}: {err}") from None
    listener.listen(128)  # from here connections wait in the backlog until uvicorn accepts
    bound = listener.getsockname()[1]
    config = uvicorn.Config(build_app(scorer), log_level="warning", timeout_graceful_shutdown=30)
    on_ready(f"http://{host}:{bound}/score")
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
