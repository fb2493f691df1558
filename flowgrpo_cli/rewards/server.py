"""`flowgrpo serve-reward`: any reward behind the `remote` reward's wire format.

POST /score takes one batch in the wire format of rewards/remote.py and answers with the
weighted total of the served rewards, `{"scores": [...], "errors": [...]}`, one entry per
image; GET /health answers `{"status": "ok", "rewards": {name: weight}}`. With it, reward
models run on other machines or GPUs and the trainer's `remote` reward talks to them.

- The rewards are built once, before the server listens (one model load per process), and
  closed when it stops (SIGINT or SIGTERM: uvicorn finishes the requests in flight first).
- Each request is scored as one batch (the `remote` reward sends up to batch_size images per
  request), one request at a time, in a worker thread: the event loop keeps answering /health
  while a batch is scored, and a GPU reward never sees two batches at once.
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
import math
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

from PIL import Image, UnidentifiedImageError

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import RewardBatch
from flowgrpo_cli.rewards.rewardset import RewardSet


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


def build_app(rewards: RewardSet):  # -> starlette.applications.Starlette
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    one_at_a_time = asyncio.Lock()

    async def score(request: Request) -> JSONResponse:
        try:
            batch = parse_batch(await request.json())
        except ValueError:  # json.JSONDecodeError included
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        except BadRequest as problem:
            return JSONResponse({"error": str(problem)}, status_code=400)
        async with one_at_a_time:
            try:
                result = await asyncio.to_thread(rewards.score, batch)
            except FlowGrpoError as err:
                return JSONResponse({"error": str(err)}, status_code=500)
        scores = [None if v is None or not math.isfinite(v) else v for v in result.reward]
        return JSONResponse({"scores": scores, "errors": result.reward_error})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "rewards": rewards.weights})

    return Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/health", health)])


def serve(rewards: RewardSet, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Serve `rewards` until SIGINT / SIGTERM; `on_ready(url)` once the port is bound (port 0
    picks a free one)."""
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as err:
        raise FlowGrpoError(f"serve-reward: cannot listen on {host}:{port}: {err}") from None
    listener.listen(128)  # from here connections wait in the backlog until uvicorn accepts
    bound = listener.getsockname()[1]
    config = uvicorn.Config(build_app(rewards), log_level="warning", timeout_graceful_shutdown=30)
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
