"""Rewards for generated images: named in the config with weights, scored per image.

Built in: `ocr`, `jpeg_compressibility`, `jpeg_incompressibility`, `remote`, the `vlm`
judge, the CLIP models `pickscore`, `clipscore`, `aesthetic`, `hpsv2`, `geneval`, and, for
editing data sets, `source_similarity`; any other name of the form `module:function` is a
plugin. Importing this package loads no OCR engine and no torch: each
reward's module is imported when it is built (see registry.py).
"""

from flowgrpo_cli.rewards.base import ImageScore, Need, Reward, RewardBatch, RewardOutput
from flowgrpo_cli.rewards.commands import (
    ScoredIteration,
    build_rewards_from_config,
    score_batches,
    score_image_files,
)
from flowgrpo_cli.rewards.on_error import (
    ON_ERROR,
    ErrorPolicyOutcome,
    ErrorSummary,
    apply_error_policy,
    summarize_errors,
)
from flowgrpo_cli.rewards.registry import REWARD_NAMES
from flowgrpo_cli.rewards.rewardset import RewardSet, ScoreResult, build_rewards

__all__ = [
    "ON_ERROR",
    "REWARD_NAMES",
    "ErrorPolicyOutcome",
    "ErrorSummary",
    "ImageScore",
    "Need",
    "Reward",
    "RewardBatch",
    "RewardOutput",
    "RewardSet",
    "ScoreResult",
    "ScoredIteration",
    "apply_error_policy",
    "build_rewards",
    "build_rewards_from_config",
    "score_batches",
    "score_image_files",
    "summarize_errors",
]
