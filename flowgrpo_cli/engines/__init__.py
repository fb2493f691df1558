"""Rollout engines: what turns sample requests into trajectories (the diffusers pipeline in this
process, or vllm-omni), the denoising loop they share, and the registry below, which imports an
engine only when `sampler.engine` chooses it (vllm-omni needs an environment of its own).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowgrpo_cli.errors import FlowGrpoError

if TYPE_CHECKING:
    from flowgrpo_cli.engines.base import RolloutEngine
    from flowgrpo_cli.store.config import Config
    from flowgrpo_cli.training.policy import Policy

#: sampler.engine -> "module:Class" of the engine.
ENGINES: dict[str, str] = {
    "diffusers": "flowgrpo_cli.engines.diffusers_engine:DiffusersEngine",
    "vllm-omni": "flowgrpo_cli.engines.vllm_omni:VllmOmniEngine",
}


def engine_class(name: str) -> Any:
    """The engine class `sampler.engine = name` selects. An engine that needs more than this
    environment has (vllm-omni) says how to install it here, before any policy is loaded."""
    if name not in ENGINES:
        raise FlowGrpoError(
            f"sampler.engine = {name!r} is not available (engines: {', '.join(ENGINES)})"
        )
    module_name, class_name = ENGINES[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    check = getattr(cls, "check_available", None)
    if check is not None:
        check()
    return cls


def build_engine(config: Config, policy: Policy) -> RolloutEngine:
    """The rollout engine `sampler.engine` names, set up from the config."""
    return engine_class(config.sampler.engine)(
        policy,
        max_sequence_length=config.model.max_sequence_length,
        merge_lora=config.sampler.merge_lora,
    )
