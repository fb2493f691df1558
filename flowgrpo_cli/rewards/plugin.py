"""`module:function` plugins: any importable function as a reward.

The function is called with a batch and returns one finite number per image, in order:

    def score(images: list[PIL.Image.Image], prompts: list[str],
              metadata: list[dict]) -> Sequence[float]: ...

`metadata[i]` holds sample i's metadata (the score stage gives sample_id, group_id,
prompt_index, ...) plus `ground_truth` (the OCR target) when known. Two optional attributes
on the function declare more:

    score.needs = {"images", "prompts", "ground_truths"}   # default {"images", "prompts"}
    score.parallel_safe = True    # may run in a thread beside other rewards; default False

When the call raises, the function is called again one image at a time, so only the images
that fail get an error. A value that is not a finite number is an error for that image; the
wrong number of values is a FlowGrpoError (a bug in the plugin, not in an image).
"""

from __future__ import annotations

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


class PluginReward:
    def __init__(
        self, spec: str, function: PluginFunction, needs: frozenset[Need], parallel_safe: bool
    ) -> None:
        self.name = spec
        self.needs = needs
        self.parallel_safe = parallel_safe
        self._function = function

    def score(self, batch: RewardBatch) -> RewardOutput:
        prompts = batch.prompts if batch.prompts is not None else [""] * len(batch)
        try:
            raw = self._function(batch.images, prompts, batch.metadata_with_ground_truth())
        except SystemExit as err:  # sys.exit() in a plugin would end the run without a word
            raise FlowGrpoError(
                f"reward {self.name!r} called sys.exit({err.code!r}) while scoring; a reward "
                "returns its scores, or raises to fail the images"
            ) from None
        except Exception as err:
            if len(batch) == 1:
                return RewardOutput(scores=[ImageScore.failed(describe_exception(err))])
            return RewardOutput(
                scores=[
                    score
                    for index in range(len(batch))
                    for score in self.score(batch.slice(index, index + 1)).scores
                ]
            )
        return RewardOutput(
            scores=[ImageScore.checked(value) for value in self._values(raw, len(batch))]
        )

    def _values(self, raw: Any, count: int) -> list[Any]:
        try:
            values = list(raw)
        except TypeError:
            raise FlowGrpoError(
                f"reward {self.name!r} returned a {type(raw).__name__}; expected a list of "
                f"{count} numbers, one per image"
            ) from None
        if len(values) != count:
            raise FlowGrpoError(
                f"reward {self.name!r} returned {len(values)} values for {count} images"
            )
        return values

    @property
    def info(self) -> dict[str, str]:
        import inspect

        module = inspect.getmodule(self._function)
        return {"file": str(getattr(module, "__file__", None) or "unknown")}

    def close(self) -> None:
        """Nothing to release: the plugin owns its resources."""


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
