"""Shared fixtures: tiny random pipelines of each family, built once per test session.

Tests never download: the hub is switched off before anything imports huggingface_hub, and
every model is built from configs into a temporary folder, then loaded back through
from_pretrained like a real checkpoint.
"""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Before any test module imports huggingface_hub, which reads it once.
os.environ["HF_HUB_OFFLINE"] = "1"
# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
# threads that spin-wait for a busy core made a 16 ms forward take 600 ms. The variable is
# for subprocesses (CLI runs), set_num_threads for this one, whose torch is already loaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """family -> folder of a tiny pipeline of that family (see TINY_FAMILIES), built on
    first use and shared by the whole session. Treat the folders as read-only."""
    from flowgrpo_cli.models.tiny import build_tiny_pipeline

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            built[family] = build_tiny_pipeline(family, out, seed=0)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model_dir):
    """family -> float32 CPU adapter of the tiny pipeline, loaded once per session.

    Shared: do not add LoRA to it or change its weights; load your own with load_adapter.
    """
    from flowgrpo_cli.models import load_adapter

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = load_adapter(tiny_model_dir(family), dtype=torch.float32, device="cpu")
        return loaded[family]

    return get
