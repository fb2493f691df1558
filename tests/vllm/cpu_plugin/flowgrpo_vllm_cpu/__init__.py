"""Test-only CPU platform for vllm-omni, registered through its own plugin entry point.

vllm-omni supports CUDA, ROCm, NPU, XPU and MUSA. It loads third-party platforms from the
entry-point group ``vllm_omni.platform_plugins``: each entry is a function that returns the
qualified name of an ``OmniPlatform`` class when its hardware is present, else None. This one
answers only when FLOWGRPO_VLLM_CPU_PLATFORM=1 (the integration test sets it), so the
package is inert wherever it happens to be installed.
"""

import os

ENV_VAR = "FLOWGRPO_VLLM_CPU_PLATFORM"


def platform_plugin() -> str | None:
    if os.environ.get(ENV_VAR) != "1":
        return None
    return "flowgrpo_vllm_cpu.platform.CpuOmniPlatform"
