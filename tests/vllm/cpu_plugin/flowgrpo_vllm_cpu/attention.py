"""vllm-omni's TORCH_SDPA diffusion attention, routed for the CPU.

`AttentionImpl.forward` dispatches on the platform (CUDA, ROCm, NPU, XPU, MUSA) and raises
for any other. For the SDPA backend every one of those routes is the same plain
torch.nn.functional.scaled_dot_product_attention call (the CUDA route broadcasts the key
mask); this backend takes that route directly on any platform.
"""

from __future__ import annotations

import torch
from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl


class CpuSDPAImpl(SDPAImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata=None,
    ) -> torch.Tensor:
        return self.forward_cuda(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    @staticmethod
    def get_impl_cls() -> type[CpuSDPAImpl]:
        return CpuSDPAImpl
