"""Seeds derived from names, so that randomness depends only on what it is for.

A sample's noise, an iteration's prompts, an epoch's shuffle: each gets its own seed from
(run seed, iteration, ...), never from a shared random stream, so results do not depend on
batch size, rank count or the order in which things happen to run.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any values, stable across processes and Python versions."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
