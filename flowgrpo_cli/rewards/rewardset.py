"""The configured rewards, scored together into one weighted total per image.

    settings = RewardSection(ocr_workers=2)  # the config's [reward] table
    with build_rewards({"ocr": 1.0, "jpeg_compressibility": 0.2}, settings) as rewards:
        result = rewards.score(RewardBatch(images, prompts, ground_truths, metadata))

Columns come out in the order of the weights table. The total `reward` of an image is
sum(weight * value) over all rewards, and None (with `reward_error` saying why) as soon as
one reward failed on it: a partial sum would silently change what is optimised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from numbers import Real
from types import TracebackType
from typing import Any

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import Reward, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.registry import resolve
from flowgrpo_cli.store.config import RewardSection


@dataclass(frozen=True)
class ScoreResult:
    """Per-image results of a batch; every list has one entry per image."""

    names: tuple[str, ...]  # reward names, in column order
    columns: dict[str, list[float | None]]  # name -> value, None where that reward failed
    errors: dict[str, list[str | None]]  # name -> that reward's error message, or None
    reward: list[float | None]  # weighted total; None if any reward failed on the image
    reward_error: list[str | None]  # "name: message; name: message" of every failure
    details: dict[str, dict[str, list[Any]]]  # name -> detail -> values, e.g. ocr -> text

    def __len__(self) -> int:
        return len(self.reward)

    @classmethod
    def concat(cls, results: Sequence[ScoreResult]) -> ScoreResult:
        """Batches joined in order (the score stage scores an iteration in chunks)."""
        if not results:
            raise ValueError("ScoreResult.concat needs at least one result")
        names = results[0].names

        def joined(parts: list[list[Any]]) -> list[Any]:
            return [item for part in parts for item in part]

        return cls(
            names=names,
            columns={name: joined([r.columns[name] for r in results]) for name in names},
            errors={name: joined([r.errors[name] for r in results]) for name in names},
            reward=joined([r.reward for r in results]),
            reward_error=joined([r.reward_error for r in results]),
            details={
                name: {key: joined([r.details[name][key] for r in results]) for key in keys}
                for name, keys in results[0].details.items()
            },
        )

    def slice(self, start: int, stop: int) -> ScoreResult:
        """Images start to stop of this result (a merged batch handed back per request)."""
        return ScoreResult(
            names=self.names,
            columns={name: values[start:stop] for name, values in self.columns.items()},
            errors={name: values[start:stop] for name, values in self.errors.items()},
            reward=self.reward[start:stop],
            reward_error=self.reward_error[start:stop],
            details={
                name: {key: values[start:stop] for key, values in details.items()}
                for name, details in self.details.items()
            },
        )


class RewardSet:
    """Built rewards with their weights; close it (or use `with`) to stop worker processes."""

    def __init__(self, rewards: Sequence[Reward], weights: Mapping[str, float]) -> None:
        self._rewards = list(rewards)
        self.weights = {reward.name: float(weights[reward.name]) for reward in self._rewards}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(reward.name for reward in self._rewards)

    @property
    def needs(self) -> dict[str, frozenset[str]]:
        """Per reward, the batch fields it reads (a server checks requests against them)."""
        return {reward.name: frozenset(reward.needs) for reward in self._rewards}

    @property
    def info(self) -> dict[str, dict[str, object]]:
        """Per reward: its weight and what it scores with (model and commit, engine, URL),
        which the score stage records so that a run says what scored it."""
        return {
            reward.name: {"weight": self.weights[reward.name], **reward.info}
            for reward in self._rewards
        }

    def score(self, batch: RewardBatch) -> ScoreResult:
        self._check_needs(batch)
        outputs = self._run(batch)
        count = len(batch)
        errors = {
            name: [score.error for score in output.scores] for name, output in outputs.items()
        }
        columns = {
            name: [score.value for score in output.scores] for name, output in outputs.items()
        }
        reward: list[float | None] = []
        reward_error: list[str | None] = []
        for index in range(count):
            failures = [
                f"{name}: {errors[name][index]}"
                for name in self.names
                if errors[name][index] is not None
            ]
            total: float | None = None
            if not failures:
                total = 0.0
                for name in self.names:
                    value = columns[name][index]
                    if value is None:  # an ImageScore without an error has a value
                        raise RuntimeError(f"reward {name!r} gave neither a score nor an error")
                    total += self.weights[name] * value
                if not math.isfinite(total):  # finite scores, e.g. +-1e308, can still overflow
                    failures.append(f"the weighted total overflows to {total}")
                    total = None
            reward_error.append("; ".join(failures) if failures else None)
            reward.append(total)
        return ScoreResult(
            names=self.names,
            columns=columns,
            errors=errors,
            reward=reward,
            reward_error=reward_error,
            details={name: output.details for name, output in outputs.items()},
        )

    def _check_needs(self, batch: RewardBatch) -> None:
        for reward in self._rewards:
            missing = sorted(need for need in reward.needs if not batch.has(need))
            if missing:
                raise FlowGrpoError(
                    f"reward {reward.name!r} needs {', '.join(missing)}, "
                    "which this batch does not have"
                )

    def _run(self, batch: RewardBatch) -> dict[str, RewardOutput]:
        # Parallel-safe rewards (OCR in its pool, HTTP waits, JPEG encoding) overlap with each
        # other in threads; the rest run one after another here.
        outputs: dict[str, RewardOutput] = {}
        parallel = [reward for reward in self._rewards if reward.parallel_safe]
        with ThreadPoolExecutor(max_workers=max(1, len(parallel))) as threads:
            futures: dict[str, Future[RewardOutput]] = {
                reward.name: threads.submit(reward.score, batch) for reward in parallel
            }
            for reward in self._rewards:
                if not reward.parallel_safe:
                    outputs[reward.name] = reward.score(batch)
            for name, future in futures.items():
                outputs[name] = future.result()
        for name, output in outputs.items():
            if len(output.scores) != len(batch):  # built-ins and plugins check this themselves
                raise RuntimeError(
                    f"reward {name!r} gave {len(output.scores)} scores for {len(batch)} images"
                )
        return {name: outputs[name] for name in self.names}

    def close(self) -> None:
        for reward in self._rewards:
            reward.close()

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def build_rewards(weights: Mapping[str, float], settings: RewardSection | None = None) -> RewardSet:
    """The rewards named in `weights` ([reward] weights of the config), built and ready.
    Each builder reads its settings from `settings`, the config's [reward] table (its
    defaults when None): OCR workers, [reward.remote], the model rewards' tables.

    Every name and weight is checked (and every plugin imported) before any reward is built,
    so a typo fails at once instead of after the OCR pool has started.
    """
    if not weights:
        raise FlowGrpoError(
            "[reward] weights is empty: name at least one reward, e.g. { ocr = 1.0 }"
        )
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, Real) or not math.isfinite(weight):
            raise FlowGrpoError(f"[reward] weights: {name!r} = {weight!r}: must be a finite number")
    builders = {name: resolve(name) for name in weights}
    section = settings if settings is not None else RewardSection()
    built: list[Reward] = []
    try:
        for builder in builders.values():
            built.append(builder(section))
    except BaseException:
        for reward in built:
            reward.close()
        raise
    return RewardSet(built, weights)
