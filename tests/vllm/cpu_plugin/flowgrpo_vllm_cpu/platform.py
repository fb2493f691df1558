"""An OmniPlatform for the CPU: vllm's own CpuPlatform plus the diffusion hooks vllm-omni asks for.

Only what vllm-omni's diffusion worker calls is filled in: the device is "cpu", collectives
use gloo (CpuPlatform's dist backend), memory figures come from psutil, device set/sync and
cache calls are no-ops, and attention goes to a plain torch SDPA backend (see attention.py).
"""

from __future__ import annotations

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

_ATTENTION_BACKEND = "flowgrpo_vllm_cpu.attention.CpuSDPABackend"


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device: torch.device | None = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: torch.device | None = None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return psutil.virtual_memory().total

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        if selected_backend not in (None, "TORCH_SDPA"):
            raise ValueError(
                f"the test CPU platform runs attention with torch SDPA only, not {selected_backend}"
            )
        return _ATTENTION_BACKEND
