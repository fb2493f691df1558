"""`module:function` plugins: any importable function as a reward.

The function is called with a batch and returns one finite number per image, in order:

    def score(images: list[PIL.Image.Image], prompts: list[str],
              metadata: list[dict]) -> Sequence[float]: ...

`metadata[i]` holds sample i's metadata (the score stage gives sample_id, group_id,
prompt_index, ...) plus `ground_truth` (the OCR target) when known, and `geneval` (the
prompt's GenEval record) when it has one. Two optional attributes on the function declare
more:

    score.needs = {"images", "prompts", "ground_truths"}   # default {"images", "prompts"};
                                                           # "geneval": every image's record
    score.parallel_safe = True    # may run in a thread beside other rewards; default False

A function whose `needs` holds "source_images" (an editing data set) is called with one more
argument, by keyword: `source_images`, the PIL image each image's prompt edits, in order
(RGB, at the size the data set gave it). Other functions are called as above.

When the call raises, the function is called again one image at a time, so only the images
that fail get an error. A value that is not a finite number is an error for that image; the
wrong number of values, or something that is not a sequence of them, is a FlowGrpoError (a
bug in the plugin, not in an image). A numpy array or tensor of shape (n,) or (n, 1) counts as
n values; any other shape is an error.

The function runs in a worker process of its own (spawned on the first batch, reused for every
later one, stopped by `close`), so that a plugin cannot end or stall the run in silence: one
that calls os._exit() or crashes the interpreter, one that calls sys.exit(), and one that
returns nothing within `plugin_timeout_s` seconds of a call (its worker is then killed) are
each a FlowGrpoError naming it. The module is imported in this process too, to check its name
and read `needs` and `parallel_safe` before anything is built.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
import threading
from collections.abc import Callable
from typing import Any, get_args

from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import (
    ImageScore,
    Need,
    RewardBatch,
    RewardOutput,
    describe_exception,
)
from flowgrpo_cli.rewards.imports import import_object

PluginFunction = Callable[[list[Image.Image], list[str], list[dict[str, Any]]], Any]
DEFAULT_NEEDS: frozenset[Need] = frozenset({"images", "prompts"})
DEFAULT_TIMEOUT_S = 600.0
_STOP_WAIT_S = 5.0  # for a worker to end once its pipe is closed, before it is killed


def score_in_process(
    name: str,
    function: PluginFunction,
    images: list,
    prompts: list,
    metadata: list,
    source_images: list | None = None,
) -> list[ImageScore]:
    """One ImageScore per image from `function` (in this process); FlowGrpoError for a bug
    of the plugin. A call that raises is repeated image by image. `source_images`, when
    given, is passed by keyword."""
    extra = {} if source_images is None else {"source_images": source_images}
    try:
        raw = function(images, prompts, metadata, **extra)
    except SystemExit as err:  # sys.exit() in a plugin would end the run without a word
        raise FlowGrpoError(
            f"reward {name!r} called sys.exit({err.code!r}) while scoring; a reward "
            "returns its scores, or raises to fail the images"
        ) from None
    except Exception as err:
        if len(images) == 1:
            return [ImageScore.failed(describe_exception(err))]
        return [
            score
            for i in range(len(images))
            for score in score_in_process(
                name,
                function,
                images[i : i + 1],
                prompts[i : i + 1],
                metadata[i : i + 1],
                None if source_images is None else source_images[i : i + 1],
            )
        ]
    return [ImageScore.checked(value) for value in _values(name, raw, len(images))]


def _values(name: str, raw: Any, count: int) -> list[Any]:
    expected = f"expected a list of {count} numbers, one per image"
    shape = getattr(raw, "shape", None)
    if shape is not None and hasattr(raw, "reshape"):  # numpy array, torch tensor
        shape = tuple(shape)
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
            raise FlowGrpoError(
                f"reward {name!r} returned an array of shape {shape}; {expected} (shape "
                f"({count},) or ({count}, 1))"
            )
        raw = raw.reshape(-1).tolist()
    if isinstance(raw, str | bytes | dict | set | frozenset) or not hasattr(raw, "__iter__"):
        raise FlowGrpoError(f"reward {name!r} returned a {type(raw).__name__}; {expected}")
    values = list(raw)
    if len(values) != count:
        raise FlowGrpoError(f"reward {name!r} returned {len(values)} values for {count} images")
    return values


def _worker_main(connection: Any, spec: str) -> None:
    """A plugin's worker process: import it, then answer each batch sent through
    `connection` with ("ok", scores) or ("error", message), until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        function: Any = import_object(spec, f"reward {spec!r}")
    except FlowGrpoError as err:
        function = err
    while True:
        try:
            images, prompts, metadata, source_images = connection.recv()
        except (EOFError, OSError):  # the parent closed the pipe, or is gone
            return
        try:
            if isinstance(function, FlowGrpoError):
                raise function
            reply: tuple[str, Any] = (
                "ok",
                score_in_process(spec, function, images, prompts, metadata, source_images),
            )
        except FlowGrpoError as err:
            reply = ("error", str(err))
        try:
            connection.send(reply)
        except Exception as err:  # a value that does not pickle: a bug of the plugin
            connection.send(("error", f"reward {spec!r}: cannot send its scores back ({err})"))


class PluginReward:
    def __init__(
        self,
        spec: str,
        function: PluginFunction,
        needs: frozenset[Need],
        parallel_safe: bool,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.name = spec
        self.needs = needs
        self.parallel_safe = parallel_safe
        self.timeout_s = timeout_s
        self._function = function
        self._worker: Any = None  # multiprocessing's SpawnProcess, started by the first batch
        self._connection: Any = None
        self._lock = threading.Lock()  # one batch at a time through the pipe

    def configured(self, timeout_s: float) -> PluginReward:
        """This plugin with `timeout_s` seconds for each call ([reward] plugin_timeout_s)."""
        if not timeout_s > 0:
            raise FlowGrpoError(f"[reward] plugin_timeout_s = {timeout_s}: must be > 0")
        self.timeout_s = timeout_s
        return self

    def score(self, batch: RewardBatch) -> RewardOutput:
        prompts = batch.prompts if batch.prompts is not None else [""] * len(batch)
        sources = batch.source_images if "source_images" in self.needs else None
        request = (
            list(batch.images), list(prompts), batch.metadata_with_ground_truth(),
            None if sources is None else list(sources),
        )  # fmt: skip
        with self._lock:
            kind, payload = self._call(request)
        if kind == "error":
            raise FlowGrpoError(payload)
        return RewardOutput(scores=payload)

    def _call(self, request: tuple) -> tuple[str, Any]:
        if self._worker is None or not self._worker.is_alive():
            self._start()
        try:
            self._connection.send(request)
            answered = self._connection.poll(self.timeout_s)
        except (BrokenPipeError, ConnectionError, EOFError):
            answered = True  # the worker is gone: recv below says so
        if not answered:
            self._stop(kill=True)
            raise FlowGrpoError(
                f"reward {self.name!r} returned no scores within {self.timeout_s} s "
                "([reward] plugin_timeout_s); its worker process was stopped"
            )
        try:
            return self._connection.recv()
        except (EOFError, OSError):
            self._worker.join(_STOP_WAIT_S)
            code = self._worker.exitcode
            self._stop(kill=True)
            raise FlowGrpoError(
                f"reward {self.name!r}: its worker process ended (exit code {code}) while "
                "scoring, without returning scores (os._exit(), a crash, or out of memory?); "
                "a reward returns its scores, or raises to fail the images"
            ) from None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of torch's threads
        ours, theirs = context.Pipe()
        # Not a daemon: a plugin may start processes of its own. It ends when the pipe
        # closes (close(), or this process exiting: see the atexit hook).
        worker = context.Process(
            target=_worker_main, args=(theirs, self.name), name=f"flowgrpo reward {self.name}"
        )
        worker.start()
        theirs.close()
        self._worker, self._connection = worker, ours
        atexit.register(self.close)

    def _stop(self, kill: bool = False) -> None:
        """End the worker: close its pipe and wait for it to return, or `kill` it at once."""
        worker, connection = self._worker, self._connection
        self._worker = self._connection = None
        atexit.unregister(self.close)
        if connection is not None:
            connection.close()
        if worker is not None:
            if not kill:
                worker.join(_STOP_WAIT_S)
            if worker.is_alive():
                worker.kill()
            worker.join()

    @property
    def info(self) -> dict[str, str]:
        import inspect

        module = inspect.getmodule(self._function)
        return {"file": str(getattr(module, "__file__", None) or "unknown")}

    def close(self) -> None:
        """Stop the worker process (it ends once its pipe closes; killed if it does not)."""
        self._stop()


def load_plugin(spec: str) -> PluginReward:
    what = f"reward {spec!r}"
    function = import_object(spec, what)
    if not callable(function):
        raise FlowGrpoError(f"{what} is a {type(function).__name__}, not a function")
    needs = frozenset(getattr(function, "needs", DEFAULT_NEEDS))
    unknown = needs - set(get_args(Need))
    if unknown:
        raise FlowGrpoError(
            f"{what}: unknown `needs` {sorted(unknown)}; choose from {list(get_args(Need))}"
        )
    return PluginReward(spec, function, needs, bool(getattr(function, "parallel_safe", False)))
