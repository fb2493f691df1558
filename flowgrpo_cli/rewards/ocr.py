"""`ocr`: how well an image shows its target text, read offline by RapidOCR on the CPU.

reward = 1 - distance / len(target), on both strings lower-cased with all white space removed
(the engine drops spaces between small words, so spacing must not count); distance is 0 when
the target appears inside what was read, else the Levenshtein distance, capped at len(target)
so the reward stays in [0, 1].

Each process builds its engine once (building costs about 0.4 s, reading 512x512 about 0.1 s);
with `workers > 1` images are read in a pool of spawned processes, each engine on one thread.
"""

from __future__ import annotations

import functools
import importlib.util
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.base import (
    ImageScore,
    Need,
    RewardBatch,
    RewardOutput,
    describe_exception,
)
from flowgrpo_cli.store.prompts import NO_TARGET

if TYPE_CHECKING:
    from flowgrpo_cli.store.config import RewardSection

# Settings measured on a 2-core CPU when the reward was written: the defaults (min side
# scaled up to 736, a rotation classifier, all cores per engine) were several times slower on
# 512x512 images and dropped spaces on small text; one thread per engine lets worker
# processes scale.
ENGINE_SETTINGS: dict[str, Any] = {
    "det_limit_type": "max",
    "det_limit_side_len": 960,
    "use_cls": False,
    "intra_op_num_threads": 1,
}


def normalize(text: str) -> str:
    """Lower-case, with every white space character removed."""
    return "".join(text.lower().split())


def ocr_distance(read: str, target: str) -> int:
    """Edits between what was read and the target; 0 if the target is inside the reading."""
    from rapidfuzz.distance import Levenshtein  # the `ocr` extra, checked when it is built

    read, target = normalize(read), normalize(target)
    if target in read:
        return 0
    return min(Levenshtein.distance(read, target), len(target))


def ocr_score(read: str, target: str) -> float:
    length = len(normalize(target))
    if length == 0:
        raise ValueError(f"target {target!r} is empty once white space is removed")
    return 1.0 - ocr_distance(read, target) / length


@dataclass(frozen=True)
class OcrRead:
    """What the engine read in one image (boxes joined in reading order), or why it failed."""

    text: str | None = None
    error: str | None = None


@functools.cache
def _engine() -> Any:
    from rapidocr_onnxruntime import RapidOCR

    return RapidOCR(**ENGINE_SETTINGS)


def read_text(image: Image.Image) -> OcrRead:
    """Run this process's engine on one RGB image; an engine failure is returned, not raised,
    so one bad image does not sink the rest of the batch."""
    try:
        boxes, _ = _engine()(image)
    except Exception as err:
        return OcrRead(error=f"OCR engine failed: {describe_exception(err)}")
    # rapidocr gives None when it finds no text, else [box, text, confidence] rows sorted
    # top to bottom, left to right.
    return OcrRead(text=" ".join(row[1] for row in boxes or []))


def _init_worker() -> None:
    import cv2  # rapidocr's image ops; a worker is meant to use one core, like its engine

    cv2.setNumThreads(1)
    _engine()


class OcrReward:
    name = "ocr"
    needs: frozenset[Need] = frozenset({"images", "ground_truths"})
    parallel_safe = True

    def __init__(self, workers: int = 1) -> None:
        if workers < 1:
            raise FlowGrpoError(f"[reward] ocr_workers = {workers}: must be >= 1")
        missing = [
            name
            for name in ("rapidocr_onnxruntime", "rapidfuzz")
            if importlib.util.find_spec(name) is None
        ]
        if missing:
            raise FlowGrpoError(
                f"the `ocr` reward needs {' and '.join(missing)}; install the extra: "
                "pip install 'flowgrpo[ocr]'"
            )
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        if workers > 1:
            # spawn, not fork: the parent may hold torch's threads, which fork can deadlock.
            self._pool = ProcessPoolExecutor(
                max_workers=workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
            )

    def score(self, batch: RewardBatch) -> RewardOutput:
        assert batch.ground_truths is not None  # the RewardSet checks `needs`
        images = [image.convert("RGB") for image in batch.images]
        if self._pool is None:
            reads = [read_text(image) for image in images]
        else:
            try:
                reads = list(self._pool.map(read_text, images))
            except BrokenProcessPool as err:
                raise FlowGrpoError(
                    f"an OCR worker process died ({err}); out of memory? Lower [reward] "
                    f"ocr_workers (now {self.workers})"
                ) from err
        scores = [
            _score_read(read, target)
            for read, target in zip(reads, batch.ground_truths, strict=True)
        ]
        return RewardOutput(scores=scores, details={"text": [read.text for read in reads]})

    @property
    def info(self) -> dict[str, str]:
        from importlib.metadata import version

        return {"engine": f"rapidocr-onnxruntime {version('rapidocr-onnxruntime')}"}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _score_read(read: OcrRead, target: str | None) -> ImageScore:
    if read.error is not None:
        return ImageScore.failed(read.error)
    assert read.text is not None
    if target is None:
        return ImageScore.failed(f"{NO_TARGET} in the prompt")
    try:
        return ImageScore(value=ocr_score(read.text, target))
    except ValueError as err:
        return ImageScore.failed(str(err))


def build_ocr(section: RewardSection) -> OcrReward:
    return OcrReward(workers=section.ocr_workers)
