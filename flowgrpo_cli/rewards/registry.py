"""Reward names -> builders, imported only when a reward is built.

Importing this module (or the package) loads no OCR engine, no onnxruntime and no HTTP
client, so `--help` and config checks stay fast. A name with a ':' is a `module:function`
plugin (see plugin.py).
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable
from typing import cast

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import Need, Reward
from flowgrpo_cli.rewards.imports import import_object
from flowgrpo_cli.store.config import RewardSection

_BUILDERS: dict[str, str] = {
    "ocr": "flowgrpo_cli.rewards.ocr:build_ocr",
    "jpeg_compressibility": "flowgrpo_cli.rewards.jpeg:build_compressibility",
    "jpeg_incompressibility": "flowgrpo_cli.rewards.jpeg:build_incompressibility",
    "remote": "flowgrpo_cli.rewards.remote:build_remote",
    "pickscore": "flowgrpo_cli.rewards.clip:build_pickscore",
    "clipscore": "flowgrpo_cli.rewards.clip:build_clipscore",
    "aesthetic": "flowgrpo_cli.rewards.clip:build_aesthetic",
    "vlm": "flowgrpo_cli.rewards.vlm:build_vlm",
    "hpsv2": "flowgrpo_cli.rewards.hps:build_hpsv2",
    "geneval": "flowgrpo_cli.rewards.geneval:build_geneval",
    "source_similarity": "flowgrpo_cli.rewards.source_similarity:build_source_similarity",
}
REWARD_NAMES = tuple(_BUILDERS)


Builder = Callable[[RewardSection], Reward]  # reads what it needs of [reward]


def resolve(name: str) -> Builder:
    """The builder for `name`; importing a plugin happens here, so a bad name fails before
    any reward is built."""
    if ":" in name:
        from flowgrpo_cli.rewards.plugin import load_plugin

        plugin = load_plugin(name)
        return lambda section: plugin.configured(section.plugin_timeout_s)
    if name not in _BUILDERS:
        close = difflib.get_close_matches(name, REWARD_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FlowGrpoError(
            f"[reward] weights: unknown reward {name!r}{hint}. Valid names: "
            f"{', '.join(REWARD_NAMES)}, or `module:function` for a plugin"
        )
    return cast(Builder, import_object(_BUILDERS[name], f"built-in reward {name!r}"))


def reward_needs(name: str, section: RewardSection | None = None) -> frozenset[Need]:
    """What reward `name` reads from a batch under the [reward] table `section` (its defaults
    when None), known without building it (no OCR engine, model or server is started): a
    plugin's `needs`; for a built-in, what the `configured_needs(section)` classmethod of the
    class its builder returns says (a reward whose needs are settings: `remote`, `vlm`), else
    that class's `needs`."""
    section = section if section is not None else RewardSection()
    builder = resolve(name)
    if ":" in name:
        return builder(section).needs
    returned = builder.__annotations__["return"]  # a name: `from __future__ import annotations`
    module = sys.modules[builder.__module__]
    # cast: the annotation names the Reward class the builder returns, found in its module.
    reward_class = cast("type[Reward]", getattr(module, returned, returned))
    configured = getattr(reward_class, "configured_needs", None)
    return configured(section) if configured is not None else reward_class.needs


def reward_needing(
    names: Iterable[str], need: Need, section: RewardSection | None = None
) -> str | None:
    """The first of the rewards `names` that reads `need` (e.g. ground truths, the OCR
    targets) under the [reward] table `section`, or None."""
    return next((name for name in names if need in reward_needs(name, section)), None)
