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
os.environ["FLOWGRPO_OFFLINE_SOURCE"] = "the test suite"
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


PROMPTS = [
    'A shop sign that reads "OPEN" in red neon.',
    'A mug printed with "Best Dad" on its side.',
    'A poster saying "Hello World" on a brick wall.',
    'A birthday cake with "42" in blue icing.',
    'A road sign showing "STOP" at dusk.',
    'A book cover titled "Deep Sea" in gold letters.',
]


@pytest.fixture
def make_run(tmp_path, tiny_model_dir):
    """(family="sd3", overrides...) -> (Config, RunDir) of a prepared tiny run in tmp_path.

    Small on purpose: 2 prompts x 2 images, 3 steps at 64x64, so a stage takes about a second.
    """
    from flowgrpo_cli.stages import prepare
    from flowgrpo_cli.store.config import dumps_config, load_config
    from flowgrpo_cli.store.rundir import RunDir

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")

    def make(*overrides: str, family: str = "sd3", name: str = "run"):
        config = load_config(
            None,
            [
                f"run.dir={tmp_path / name}",
                f"data.train={prompts}",
                f"data.test={prompts}",
                f"model.path={tiny_model_dir(family)}",
                "model.dtype=float32",
                "model.device=cpu",
                "model.height=64",
                "model.width=64",
                "sampler.num_steps=3",
                "sampler.batch_size=4",
                "algorithm.group_size=2",
                "algorithm.prompts_per_iteration=2",
                "train.lora_rank=4",
                "train.lora_alpha=8",
                "train.micro_batch_size=2",
                "reward.weights={jpeg_compressibility = 1.0}",
                "eval.every=0",
                *overrides,
            ],
        )
        run = RunDir(tmp_path / name)
        run.root.mkdir(parents=True, exist_ok=True)
        run.config_path.write_text(dumps_config(config))  # what the CLI's first command writes
        prepare.run(config, run)
        return config, run

    return make
