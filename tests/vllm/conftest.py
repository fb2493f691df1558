"""Integration tests of the vllm-omni rollout engine, on CPU (`just test-vllm`).

They run in .venv-vllm (vllm-omni pins its own diffusers and transformers), never in the main
`just test` (pyproject's norecursedirs keeps a bare `pytest` out of this folder). vllm-omni
has no CPU platform, so these tests run it through test-only scaffolding, all of it in this
folder (see README.md here):

- cpu_plugin/: a CPU OmniPlatform registered with vllm-omni's own plugin entry point
  (`vllm_omni.platform_plugins`), active only when FLOWGRPO_VLLM_CPU_PLATFORM=1, with an
  attention backend that routes vllm-omni's TORCH_SDPA to plain torch SDPA on the CPU;
- fix_packages.py: the package fixes CPU torch needs beside vllm's CUDA wheels.
"""

import os

# Before anything imports vllm or huggingface_hub, which read these once.
os.environ["FLOWGRPO_VLLM_CPU_PLATFORM"] = "1"  # activates cpu_plugin's platform
os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # vllm's memory profiler asks for it
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vllm's INFO lines drown the results

import importlib.util

import pytest
import torch

# Tiny models gain nothing from intra-op threads on a shared 2-core machine.
torch.set_num_threads(1)


def pytest_configure(config):
    if importlib.util.find_spec("vllm_omni") is None:
        return  # the test modules skip themselves
    if importlib.util.find_spec("flowgrpo_vllm_cpu") is None:
        pytest.exit(
            "the test CPU platform for vllm-omni is not installed: run `just test-vllm`, or "
            "`.venv-vllm/bin/python tests/vllm/fix_packages.py`",
            returncode=4,
        )
