"""Pipeline stages, installed as ``flowgrpo_cli.stages``: one module per stage (prepare,
rollout, score, update, evaluate). A stage never imports another stage.

Every stage module has the same shape: a function

    run(config: Config, run: RunDir, ...) -> StageResult

that its `flowgrpo` command and the loop both call, so both write the same files. The first
two arguments are always the resolved config and the run directory; the stages of an
iteration (rollout, score, update, evaluate) take the iteration number next, then what the
caller keeps loaded between calls (the rollout engine, the reward set, the trainer) and an
optional ``Progress``. The arguments differ from stage to stage, so ``StageRun`` below pins
only those two and the return. A stage never prints: the caller renders the result.

The ``StageResult`` (flowgrpo_cli.launch.stage) holds the manifest written (rank 0; ``{}`` on
other ranks), the metrics recorded beside it, and ``fresh``: False when the output was already
finished with the same identity (config and inputs) and came back without being recomputed.
A finished output with another identity is an error naming the folder to delete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flowgrpo_cli.launch.stage import StageResult
    from flowgrpo_cli.store.config import Config
    from flowgrpo_cli.store.rundir import RunDir


class StageRun(Protocol):
    """The `run` of every stage module: config and run directory first, a StageResult back."""

    def __call__(
        self, config: Config, run: RunDir, /, *args: Any, **kwargs: Any
    ) -> StageResult: ...
