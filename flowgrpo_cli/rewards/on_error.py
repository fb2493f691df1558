"""What the score stage does with samples a reward failed on ([reward] on_error).

- drop_sample: train on the rest of the group (its advantages use the samples left);
- drop_group: drop the whole group, so no group's statistics come from fewer samples;
- stop: raise, naming the first failed sample and the message.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.rewardset import ScoreResult

ON_ERROR = ("drop_sample", "drop_group", "stop")


def check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise FlowGrpoError(f"[reward] on_error = {on_error!r}: choose one of {list(ON_ERROR)}")


@dataclass(frozen=True)
class ErrorPolicyOutcome:
    keep: list[bool]  # one per sample: True if it stays in the iteration
    dropped_samples: int
    dropped_groups: int  # groups with no sample left


def apply_error_policy(
    reward_error: Sequence[str | None],
    group_ids: Sequence[Hashable],
    on_error: str,
    *,
    sample_ids: Sequence[Hashable] | None = None,
) -> ErrorPolicyOutcome:
    """Which samples to keep, given each sample's `reward_error` (None = scored) and group."""
    check_on_error(on_error)
    if len(group_ids) != len(reward_error):
        raise ValueError(f"{len(group_ids)} group ids for {len(reward_error)} samples")
    failed = [error is not None for error in reward_error]
    if on_error == "stop" and any(failed):
        index = failed.index(True)
        sample = sample_ids[index] if sample_ids is not None else f"#{index}"
        raise FlowGrpoError(
            f"reward failed on sample {sample} (group {group_ids[index]}): "
            f"{reward_error[index]}. {sum(failed)} of {len(failed)} samples failed; "
            '[reward] on_error = "stop" (set "drop_sample" or "drop_group" to go on without them)'
        )
    if on_error == "drop_group":
        bad_groups = {group for group, bad in zip(group_ids, failed, strict=True) if bad}
        keep = [group not in bad_groups for group in group_ids]
    else:
        keep = [not bad for bad in failed]
    kept_groups = {group for group, kept in zip(group_ids, keep, strict=True) if kept}
    return ErrorPolicyOutcome(
        keep=keep,
        dropped_samples=keep.count(False),
        dropped_groups=len(set(group_ids) - kept_groups),
    )


@dataclass(frozen=True)
class ErrorSummary:
    num_samples: int
    num_failed: int  # samples with at least one failed reward
    failures: dict[str, int]  # reward name -> images it failed on (every reward listed)
    first_messages: dict[str, list[str]]  # reward name -> its first distinct messages

    def lines(self) -> list[str]:
        """One line per failing reward, for the log."""
        return [
            f"{name}: failed on {count} of {self.num_samples} images, e.g. "
            + " | ".join(self.first_messages[name])
            for name, count in self.failures.items()
            if count
        ]


def summarize_errors(result: ScoreResult, *, max_messages: int = 3) -> ErrorSummary:
    first: dict[str, list[str]] = {}
    for name in result.names:
        distinct = list(dict.fromkeys(error for error in result.errors[name] if error is not None))
        first[name] = distinct[:max_messages]
    return ErrorSummary(
        num_samples=len(result),
        num_failed=sum(error is not None for error in result.reward_error),
        failures={name: sum(e is not None for e in result.errors[name]) for name in result.names},
        first_messages=first,
    )
