"""What every reward takes and gives: a batch in, one value or one error per image out.

A reward never turns a failure into a number. An image it cannot score gets an `ImageScore`
with an error message and no value, and the score stage decides what to do with that sample
(see `on_error.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal, Protocol, SupportsFloat, cast

from PIL import Image

# What a reward may need from a batch besides metadata, which is always there (maybe empty);
# "geneval": every image's metadata holds its GenEval record under GENEVAL_KEY;
# "source_images": the image each was edited from (an editing data set).
Need = Literal["images", "prompts", "ground_truths", "geneval", "source_images"]
GENEVAL_KEY = "geneval"


def sample_metadata(sample_id: str, group_id: int, record: dict[str, Any] | None) -> dict[str, Any]:
    """One image's `metadata` as the score and evaluate stages give it: its ids, and its
    prompt's GenEval record under GENEVAL_KEY when the prompt has one."""
    meta: dict[str, Any] = {"sample_id": sample_id, "group_id": group_id}
    if record is not None:
        meta[GENEVAL_KEY] = record
    return meta


@dataclass(frozen=True)
class RewardBatch:
    """Images to score and what they were made from; every list has one entry per image.

    `metadata` holds a dict per image (the score stage puts sample_id and group_id there, and
    the prompt's GenEval record, a dict, under GENEVAL_KEY when it has one);
    `ground_truths[i]` is the OCR target of image i, or None when its prompt has none;
    `source_images[i]` the image its prompt edits (RGB, the size the data set gave it), for
    an editing data set (None for a text-to-image one).
    """

    images: list[Image.Image]
    prompts: list[str] | None = None
    ground_truths: list[str | None] | None = None
    metadata: list[dict[str, Any]] | None = None
    source_images: list[Image.Image] | None = None

    def __post_init__(self) -> None:
        for name in ("prompts", "ground_truths", "metadata", "source_images"):
            column = getattr(self, name)
            if column is not None and len(column) != len(self.images):
                raise ValueError(f"RewardBatch: {len(column)} {name} for {len(self.images)} images")
        for name in ("images", "source_images"):
            for index, image in enumerate(getattr(self, name) or []):
                if not isinstance(image, Image.Image):
                    raise TypeError(
                        f"RewardBatch: {name}[{index}] is a {type(image).__name__}, not a PIL image"
                    )

    def __len__(self) -> int:
        return len(self.images)

    def slice(self, start: int, stop: int) -> RewardBatch:
        def part(column: list[Any] | None) -> list[Any] | None:
            return column[start:stop] if column is not None else None

        return RewardBatch(
            self.images[start:stop],
            part(self.prompts),
            part(self.ground_truths),
            part(self.metadata),
            part(self.source_images),
        )

    def has(self, need: Need) -> bool:
        if need == "geneval":
            return self.metadata is not None and all(
                meta.get(GENEVAL_KEY) is not None for meta in self.metadata
            )
        return getattr(self, need) is not None

    def metadata_with_ground_truth(self) -> list[dict[str, Any]]:
        """Copies of the metadata dicts with `ground_truth` added, for plugins and servers."""
        metadata = self.metadata if self.metadata is not None else [{}] * len(self)
        if self.ground_truths is None:
            return [dict(meta) for meta in metadata]
        return [
            {**meta, "ground_truth": truth}
            for meta, truth in zip(metadata, self.ground_truths, strict=True)
        ]


@dataclass(frozen=True)
class ImageScore:
    """One image's outcome: a finite value, or an error message and no value."""

    value: float | None = None
    error: str | None = None

    @classmethod
    def failed(cls, message: str) -> ImageScore:
        return cls(error=message)

    @classmethod
    def checked(cls, raw: object) -> ImageScore:
        """A value a scorer returned, refused unless it is a finite real number."""
        # bool is an int subclass, and a True/False score is almost surely a bug in the scorer;
        # `__float__` lets 0-d tensors through.
        if isinstance(raw, bool) or not (isinstance(raw, Real) or hasattr(type(raw), "__float__")):
            return cls.failed(f"returned {_clip(repr(raw))}, not a number")
        # cast: the check above found `__float__` on raw's type, which hasattr cannot narrow.
        value = float(cast(SupportsFloat, raw))
        if not math.isfinite(value):
            return cls.failed(f"returned {value}")
        return cls(value=value)


def describe_exception(err: BaseException) -> str:
    """`Type: message` on one line (OpenCV's messages span several), for tables and logs."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _clip(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass(frozen=True)
class RewardOutput:
    """A reward's answer for a batch: one ImageScore per image, plus per-image details
    (e.g. `{"text": [...]}`, what OCR read) that the CLI prints and the score stage may store."""

    scores: list[ImageScore]
    details: dict[str, list[Any]] = field(default_factory=dict)


class Reward(Protocol):
    """The shape of a reward. `needs` names the batch fields it reads; `parallel_safe` says
    the RewardSet may run it in a thread alongside the other rewards (it shares no state
    with them and releases the GIL or waits on I/O, so overlapping pays)."""

    name: str
    needs: frozenset[Need]
    parallel_safe: bool

    @property
    def info(self) -> dict[str, str]:
        """What it scores with (model id and commit, engine version, URL), for manifests."""
        ...

    def score(self, batch: RewardBatch) -> RewardOutput: ...

    def close(self) -> None: ...
