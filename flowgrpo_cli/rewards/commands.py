"""The two ways the CLI scores images: a rollout iteration (`flowgrpo score`: build the
rewards from the config once, then `score_batches`) and image files given on the command
line (`flowgrpo reward`: `score_image_files`)."""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image, UnidentifiedImageError

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import GENEVAL_KEY, RewardBatch
from flowgrpo_cli.rewards.imports import add_plugin_dirs
from flowgrpo_cli.rewards.on_error import (
    ErrorPolicyOutcome,
    ErrorSummary,
    apply_error_policy,
    check_on_error,
    summarize_errors,
)
from flowgrpo_cli.rewards.rewardset import RewardSet, ScoreResult, build_rewards
from flowgrpo_cli.store.prompts import extract_target, format_problems, read_prompt_file

if TYPE_CHECKING:
    from flowgrpo_cli.store.config import RewardSection


def build_rewards_from_config(section: RewardSection) -> RewardSet:
    """build_rewards with the config's [reward] table, its plugin folders searched first;
    [reward.remote] counts once its url is set."""
    add_plugin_dirs(section.plugin_dirs)
    return build_rewards(section.weights, section)


@dataclass(frozen=True)
class ScoredIteration:
    result: ScoreResult  # every sample, in the order the batches gave them
    outcome: ErrorPolicyOutcome  # which samples the on_error policy keeps
    summary: ErrorSummary  # failures per reward, for the log and metrics


def score_batches(
    rewards: RewardSet, batches: Iterable[RewardBatch], on_error: str
) -> ScoredIteration:
    """Score an iteration chunk by chunk, then apply [reward] on_error over all of it (groups
    may span chunks). Each batch's metadata must hold `group_id`; `sample_id` names a failed
    sample in the "stop" message."""
    check_on_error(on_error)
    results: list[ScoreResult] = []
    group_ids: list[Hashable] = []
    sample_ids: list[Hashable] = []
    for batch in batches:
        if batch.metadata is None or any("group_id" not in meta for meta in batch.metadata):
            raise ValueError("score_batches: every sample's metadata needs a group_id")
        group_ids += [meta["group_id"] for meta in batch.metadata]
        sample_ids += [
            meta.get("sample_id", f"#{len(sample_ids) + i}")
            for i, meta in enumerate(batch.metadata)
        ]
        results.append(rewards.score(batch))
    result = ScoreResult.concat(results)
    return ScoredIteration(
        result=result,
        outcome=apply_error_policy(result.reward_error, group_ids, on_error, sample_ids=sample_ids),
        summary=summarize_errors(result),
    )


def score_image_files(
    paths: Sequence[Path],
    prompts: Sequence[str],
    section: RewardSection,
    records: Sequence[dict[str, Any]] | None = None,
    sources: Sequence[Path] | None = None,
) -> ScoreResult:
    """Score image files against their prompts (one each) with the rewards of a config's
    [reward] table; the OCR target is the prompt's first quoted span, `records` the images'
    GenEval records (one each), `sources` the files of the images' source images (one each;
    read as `prepare` reads an editing data set's), if given.
    `result.details["ocr"]["text"]` holds what OCR read."""
    if len(prompts) != len(paths):
        raise FlowGrpoError(
            f"{len(prompts)} prompt(s) for {len(paths)} image(s): give one prompt per image"
        )
    if records is not None and len(records) != len(paths):
        raise FlowGrpoError(
            f"{len(records)} GenEval record(s) for {len(paths)} image(s): give one record per "
            "image, or one for all"
        )
    if sources is not None and len(sources) != len(paths):
        raise FlowGrpoError(
            f"{len(sources)} --source image(s) for {len(paths)} image(s): give one source image "
            "per image, or one for all"
        )
    metadata: list[dict[str, Any]] = [{"sample_id": str(path)} for path in paths]
    if records is not None:
        metadata = [
            {**meta, GENEVAL_KEY: record} for meta, record in zip(metadata, records, strict=True)
        ]
    batch = RewardBatch(
        images=[_load(Path(path)) for path in paths],
        prompts=list(prompts),
        ground_truths=[extract_target(prompt) for prompt in prompts],
        metadata=metadata,
        source_images=_load_sources(sources) if sources else None,
    )
    with build_rewards_from_config(section) as rewards:
        return rewards.score(batch)


def read_geneval_records(path: Path) -> list[dict[str, Any]]:
    """The records of a GenEval metadata jsonl, in order; a row that is not one, or that the
    rules refuse, is a FlowGrpoError naming its line."""
    from flowgrpo_cli.rewards.geneval_rules import colour_requests

    parsed = read_prompt_file(path, needs_record="geneval", check_record=colour_requests)
    if parsed.problems:
        raise FlowGrpoError(
            f"{len(parsed.problems)} invalid GenEval record(s) in {path}:\n  "
            f"{format_problems(parsed.problems)}"
        )
    if not parsed.rows:
        raise FlowGrpoError(f"{path}: no GenEval records")
    return [json.loads(row.geneval) for row in parsed.rows if row.geneval is not None]


def _load_sources(paths: Sequence[Path]) -> list[Image.Image]:
    """Source image files as `prepare` keeps an editing data set's (upright, RGB; the default
    data.max_image_pixels), each distinct file read once."""
    from flowgrpo_cli.store.config import MAX_IMAGE_PIXELS
    from flowgrpo_cli.store.source_images import decode_source_image, load_source_image

    loaded: dict[Path, Image.Image] = {}
    for path in paths:
        if path not in loaded:
            try:
                png = load_source_image(Path(path), MAX_IMAGE_PIXELS).png
            except FlowGrpoError as err:
                raise FlowGrpoError(f"--source: {err}") from None
            loaded[path] = decode_source_image(png)
    return [loaded[path] for path in paths]


def _load(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            return image.copy()  # reads the pixels, so closing the file is safe
    except FileNotFoundError:
        raise FlowGrpoError(f"{path}: no such image file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise FlowGrpoError(f"{path}: cannot read the image ({err})") from None
