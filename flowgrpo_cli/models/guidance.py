"""Classifier-free guidance, one function used by rollout and training alike.

Keeping a single implementation is what makes the rollout's stored log-probs reproducible by
the update: any difference in how the two combine conditional and unconditional velocities
would show up as a policy ratio that is not 1 before the first optimizer step.
"""

import torch


def apply_cfg(
    v_uncond: torch.Tensor,
    v_cond: torch.Tensor,
    scale: float,
    *,
    rescale_to_cond_norm: bool = False,
    norm_dim: int = -1,
) -> torch.Tensor:
    """Combine velocities: v = v_uncond + scale * (v_cond - v_uncond), in float32.

    The combination runs in float32 whatever the model dtype, like the step that consumes it:
    in bf16 the difference v_cond - v_uncond times a scale of 4.5 would lose most of its bits.

    rescale_to_cond_norm: Qwen-Image's "true CFG" then rescales the combined velocity, token by
    token (the norm over ``norm_dim``, the channel dim of packed latents), to the norm of v_cond.
    """
    uncond, cond = v_uncond.float(), v_cond.float()
    combined = uncond + scale * (cond - uncond)
    if rescale_to_cond_norm:
        cond_norm = torch.linalg.vector_norm(cond, dim=norm_dim, keepdim=True)
        combined_norm = torch.linalg.vector_norm(combined, dim=norm_dim, keepdim=True)
        # A token whose combined velocity is exactly 0 stays 0 instead of becoming 0 * inf = NaN.
        safe_norm = torch.where(combined_norm > 0, combined_norm, torch.ones_like(combined_norm))
        combined = combined * (cond_norm / safe_norm)
    return combined
