"""Choosing a rollout engine by name (sampler.engine)."""

import importlib.util

import pytest

from flowgrpo_cli.engines import engine_class
from flowgrpo_cli.engines.diffusers_engine import DiffusersEngine
from flowgrpo_cli.errors import FlowGrpoError


def test_diffusers_is_the_default_engine():
    assert engine_class("diffusers") is DiffusersEngine


def test_unknown_engine_lists_the_known_ones():
    with pytest.raises(FlowGrpoError, match="diffusers, vllm-omni"):
        engine_class("tensorrt")


@pytest.mark.skipif(
    importlib.util.find_spec("vllm_omni") is not None, reason="vllm-omni is installed here"
)
def test_vllm_omni_without_its_environment_says_how_to_install_it():
    # Raised when the engine is chosen, before any policy is loaded.
    with pytest.raises(FlowGrpoError, match="just setup-vllm"):
        engine_class("vllm-omni")
