"""The anchor's decay: how far behind the trained weights the anchor of nft and awm trails.

anchor <- d anchor + (1 - d) weights after each iteration's update, with d from a schedule
[start, slope, max] of the optimizer steps taken so far (DiffusionNFT's `decay_type`, AWM's
`kl_ema_decay_type = "linear"`).
"""

from __future__ import annotations


def anchor_decay(schedule: tuple[float, float, float], optimizer_steps: int) -> float:
    """d after n optimizer steps: 0 before `start`, then min(slope (n - start), max).

    d = 0 makes the anchor the weights themselves (on-policy), d near 1 makes it trail them
    far behind.
    """
    start, slope, most = schedule
    if optimizer_steps < start:
        return 0.0
    return min(slope * (optimizer_steps - start), most)
