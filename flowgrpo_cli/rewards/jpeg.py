"""`jpeg_compressibility` / `jpeg_incompressibility` (DDPO): the JPEG file size as a reward.

value = -/+ (size in kB of the image saved as JPEG at quality 95) / 500. DDPO divides only
the compressibility reward by 500; both are divided here so that the two differ only in
sign and one weight means the same for either.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from PIL import Image

from flowgrpo_cli.rewards.base import (
    ImageScore,
    Need,
    RewardBatch,
    RewardOutput,
    describe_exception,
)

if TYPE_CHECKING:
    from flowgrpo_cli.store.config import RewardSection

QUALITY = 95
KB_PER_UNIT = 500.0


def jpeg_size_kb(image: Image.Image) -> float:
    """Size of the image as a quality-95 JPEG, in kB (1000 bytes, as DDPO counts)."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="JPEG", quality=QUALITY)
    return buffer.tell() / 1000.0


class JpegReward:
    needs: frozenset[Need] = frozenset({"images"})
    parallel_safe = True  # Pillow's encoder releases the GIL

    def __init__(self, name: str, sign: float) -> None:
        self.name = name
        self._sign = sign

    def score(self, batch: RewardBatch) -> RewardOutput:
        return RewardOutput(scores=[self._score_one(image) for image in batch.images])

    def _score_one(self, image: Image.Image) -> ImageScore:
        try:
            return ImageScore(value=self._sign * jpeg_size_kb(image) / KB_PER_UNIT)
        except Exception as err:
            return ImageScore.failed(describe_exception(err))

    @property
    def info(self) -> dict[str, str]:
        return {"jpeg_quality": str(QUALITY)}

    def close(self) -> None:
        """Nothing to release."""


def build_compressibility(section: RewardSection) -> JpegReward:
    return JpegReward("jpeg_compressibility", sign=-1.0)


def build_incompressibility(section: RewardSection) -> JpegReward:
    return JpegReward("jpeg_incompressibility", sign=1.0)
