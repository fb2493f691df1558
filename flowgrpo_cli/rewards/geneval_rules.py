"""GenEval's scoring rules as a pure function of one prompt record and its detections.

GenEval (Ghosh et al., 2023) asks an object detector what an image shows and checks it against
the prompt's metadata record: which COCO classes, how many, what colour, where. This module is
that check with the models left out: the detector's raw per-class detections (and, for colour
prompts, each used detection's colour class) come in, three scores come out:

- `correct`: GenEval's own verdict (its evaluation/evaluate_images.py, `evaluate`): every
  include clause holds with at least `count` objects, no exclude clause is met.
- `strict`: the Flow-GRPO authors' reward server's strict reward (its reward_server/gen_eval.py,
  `evaluate_reward`): 1.0 when every include clause holds with exactly `count` objects.
- `partial`: that function's partial score, which the paper's training optimised. It is a mean
  of per-clause terms and is reproduced with its quirks (docs/rewards.md lists them): it is NOT
  confined to [0, 1], an object count above twice the asked count makes it negative.

Before any check, each class's detections go through GenEval's filter, in its order: keep
scores above the threshold (0.9 for every class of a `counting` record, else 0.3), keep the 16
most confident, then greedy non-maximum suppression, which GenEval's default overlap of 1.0
turns off. Scores and boxes are compared in float32, as GenEval's detector arrays are, so a
score on the float32 threshold itself is not above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowgrpo_cli.errors import FlowGrpoError

# GenEval's colour classes, in the order its CLIP zero-shot classifier lists them.
COLOURS: tuple[str, ...] = (
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
)

# COCO's 80 classes as GenEval names them (its evaluation/object_names.txt, in that order).
COCO_CLASSES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip

TAGS: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)

# The relations a position clause may ask for, in the order GenEval tests them.
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")

_CLASSES = frozenset(COCO_CLASSES)
_INCLUDE_KEYS = frozenset({"class", "count", "color", "position"})
_EXCLUDE_KEYS = frozenset({"class", "count"})


@dataclass(frozen=True)
class Thresholds:
    """GenEval's filter and position settings; the defaults are GenEval's and the server's."""

    detection: float = 0.3  # keep detections scoring above this ...
    counting: float = 0.9  # ... or above this, for every class of a `counting` record
    max_objects: int = 16  # then keep at most this many per class, most confident first
    max_overlap: float = 1.0  # then drop boxes with IoU >= this with a kept one; 1.0: none
    position: float = 0.1  # share of the two boxes' summed size a centre offset must beat


GENEVAL = Thresholds()


@dataclass(frozen=True)
class Detection:
    """One detected object of one class."""

    score: float  # detector confidence
    box: tuple[float, float, float, float]  # x1, y1, x2, y2 in pixels
    mask: np.ndarray | None = field(default=None, compare=False)  # bool [H, W], if given
    colour: str | None = None  # GenEval colour class of the masked crop, set only where asked

    def __post_init__(self) -> None:
        if len(self.box) != 4:
            raise ValueError(f"Detection.box needs 4 values (x1, y1, x2, y2), got {self.box!r}")
        if self.colour is not None and self.colour not in COLOURS:
            raise ValueError(f"Detection.colour {self.colour!r} is not one of {COLOURS}")


@dataclass(frozen=True)
class GenEvalScore:
    correct: bool  # GenEval's own verdict
    strict: float  # the authors' server's strict reward: 1.0 or 0.0
    partial: float  # the authors' server's partial score, quirks included (may be < 0)
    reason: str  # GenEval's reason text for a failure ("" when correct)


@dataclass(frozen=True)
class _Clause:
    cls: str
    count: int
    colour: str | None = None
    position: tuple[str, int] | None = None  # (relation, index of the target include clause)


@dataclass(frozen=True)
class _Record:
    tag: str
    include: tuple[_Clause, ...]
    exclude: tuple[_Clause, ...]


def colour_requests(record: Mapping[str, Any]) -> frozenset[str]:
    """The classes whose detections need a `colour` for `record`: those of its include clauses
    that ask for a colour. GenEval classifies only the `count` most confident detections that
    survive its filter (`kept_detections`); those must carry a colour, others may."""
    return frozenset(c.cls for c in _parse(record).include if c.colour is not None)


def kept_detections(
    record: Mapping[str, Any],
    detections: Mapping[str, Sequence[Detection]],
    thresholds: Thresholds = GENEVAL,
) -> dict[str, list[Detection]]:
    """Each class's detections that survive GenEval's filter, most confident first; classes
    left with none are absent."""
    return _keep(_parse(record), detections, thresholds)


def score_record(
    record: Mapping[str, Any],
    detections: Mapping[str, Sequence[Detection]],
    thresholds: Thresholds = GENEVAL,
) -> GenEvalScore:
    """GenEval's verdict and the authors' server's two rewards for one image.

    `detections` maps a COCO class name (GenEval's spelling) to that class's raw detections,
    before any threshold; a class not in it has none. A detection GenEval colour-classifies
    (see `colour_requests`) without a colour is a ValueError naming its class.
    """
    parsed = _parse(record)
    objects = _keep(parsed, detections, thresholds)
    correct, reason = _geneval(parsed, objects, thresholds.position)
    strict, partial = _server(parsed, objects, thresholds.position)
    return GenEvalScore(correct=correct, strict=strict, partial=partial, reason=reason)


# --- GenEval's filter ---------------------------------------------------------------------


def _keep(
    record: _Record, detections: Mapping[str, Sequence[Detection]], thresholds: Thresholds
) -> dict[str, list[Detection]]:
    threshold = thresholds.counting if record.tag == "counting" else thresholds.detection
    kept: dict[str, list[Detection]] = {}
    for cls, found in detections.items():
        if cls not in _CLASSES:
            raise ValueError(f"detections for {cls!r}, which is not one of COCO's 80 classes")
        if survivors := _filter(list(found), threshold, thresholds):
            kept[cls] = survivors
    return kept


def _filter(found: list[Detection], threshold: float, thresholds: Thresholds) -> list[Detection]:
    """GenEval's per-class filter: threshold, then the top `max_objects`, then greedy NMS."""
    scores = np.array([d.score for d in found], dtype=np.float32)
    order = np.argsort(scores)[::-1]  # GenEval's own ordering, ties included
    order = order[scores[order] > np.float32(threshold)]
    ordering: list[int] = order[: thresholds.max_objects].tolist()
    kept = []
    while ordering:
        best = ordering.pop(0)
        kept.append(found[best])
        if thresholds.max_overlap != 1:
            ordering = [
                i for i in ordering if _iou(found[best].box, found[i].box) < thresholds.max_overlap
            ]
    return kept


def _iou(box_a: Sequence[float], box_b: Sequence[float]) -> float:
    """GenEval's IoU, in float32; a box's width and height count its end pixel (+1)."""
    a = np.asarray(box_a, dtype=np.float32)
    b = np.asarray(box_b, dtype=np.float32)

    def area(box: np.ndarray) -> np.float32:
        one = np.float32(1)
        return np.float32(max(box[2] - box[0] + one, 0) * max(box[3] - box[1] + one, 0))

    inter = area(np.concatenate([np.maximum(a[:2], b[:2]), np.minimum(a[2:], b[2:])]))
    union = area(a) + area(b) - inter
    return float(inter / union) if union else 0.0


# --- the checks ---------------------------------------------------------------------------


def _relations(obj: Detection, target: Detection, margin: float) -> set[str]:
    """Where `obj` is relative to `target` (GenEval's `relative_position`): the centre offset,
    each axis shrunk towards 0 by `margin` times the two boxes' summed size on that axis, then
    divided by the unshrunk offset's length; a component beyond +-0.5 names a relation."""
    boxes = np.array([obj.box, target.box], dtype=np.float32).reshape(2, 2, 2)
    centre_a, centre_b = boxes.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    revised = np.maximum(np.abs(offset) - margin * (size_a + size_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def _colours(found: list[Detection], cls: str) -> list[str]:
    colours = []
    for d in found:
        if d.colour is None:
            raise ValueError(
                f"a {cls!r} detection has no colour, and this record asks for its colour "
                "(colour_requests)"
            )
        colours.append(d.colour)
    return colours


def _position_failure(
    cls: str, expected: str, found: list[Detection], targets: list[Detection], margin: float
) -> str | None:
    """GenEval's position check: every (object, target) pair must show the relation; the
    first pair that does not gives the reason (relations listed in RELATIONS order)."""
    for obj in found:
        for target in targets:
            true_rels = _relations(obj, target, margin)
            if expected not in true_rels:
                shown = " and ".join(r for r in RELATIONS if r in true_rels)
                return f"expected {cls} {expected} target, found {shown} target"
    return None


def _geneval(
    record: _Record, objects: dict[str, list[Detection]], margin: float
) -> tuple[bool, str]:
    """GenEval's `evaluate`: include clauses on the `count` most confident objects (at least
    `count` must exist), then exclude clauses on all kept objects."""
    correct = True
    reason: list[str] = []
    matched_groups: list[list[Detection] | None] = []
    for clause in record.include:
        matched = True
        found = objects.get(clause.cls, [])[: clause.count]
        if len(found) < clause.count:
            correct = matched = False
            reason.append(f"expected {clause.cls}>={clause.count}, found {len(found)}")
        else:
            if clause.colour is not None:
                colours = _colours(found, clause.cls)
                if colours.count(clause.colour) < clause.count:
                    correct = matched = False
                    tally = ", ".join(f"{colours.count(c)} {c}" for c in COLOURS if c in colours)
                    reason.append(
                        f"expected {clause.colour} {clause.cls}>={clause.count}, found "
                        f"{colours.count(clause.colour)} {clause.colour}; and {tally}"
                    )
            if clause.position is not None and matched:
                relation, target_index = clause.position
                targets = matched_groups[target_index]
                if targets is None:
                    correct = matched = False
                    reason.append(f"no target for {clause.cls} to be {relation}")
                elif failure := _position_failure(clause.cls, relation, found, targets, margin):
                    correct = matched = False
                    reason.append(failure)
        matched_groups.append(found if matched else None)
    for clause in record.exclude:
        if len(objects.get(clause.cls, [])) >= clause.count:
            correct = False
            reason.append(f"expected {clause.cls}<{clause.count}, found {len(objects[clause.cls])}")
    return correct, "\n".join(reason)


def _server(
    record: _Record, objects: dict[str, list[Detection]], margin: float
) -> tuple[float, float]:
    """The authors' server's `evaluate_reward`: (strict, partial).

    strict: every include clause holds with exactly `count` kept objects; exclude clauses are
    not read. partial: the mean of these terms, per include clause in order:
      1 - |count - n| / count, n = all kept objects of the class (negative once n > 2 count);
      wrong count and a colour or position asked: one more 0.0;
      right count and a colour asked: 1 - |count - n_colour| / count;
      position with no matched target: 0.0; otherwise 1.0 if every pair shows the relation,
      else 0.0 AND 1.0 (the server appends 1.0 after its pair loop whatever the loop found).
    """
    strict = True
    terms: list[float] = []
    matched_groups: list[list[Detection] | None] = []
    for clause in record.include:
        matched = True
        found = objects.get(clause.cls, [])
        terms.append(1 - abs(clause.count - len(found)) / clause.count)
        if len(found) != clause.count:
            strict = matched = False
            if clause.colour is not None or clause.position is not None:
                terms.append(0.0)
        else:
            if clause.colour is not None:
                n_colour = _colours(found, clause.cls).count(clause.colour)
                terms.append(1 - abs(clause.count - n_colour) / clause.count)
                if n_colour != clause.count:
                    strict = matched = False
            if clause.position is not None and matched:
                relation, target_index = clause.position
                targets = matched_groups[target_index]
                if targets is None:
                    strict = matched = False
                    terms.append(0.0)
                else:
                    if _position_failure(clause.cls, relation, found, targets, margin):
                        strict = matched = False
                        terms.append(0.0)
                    terms.append(1.0)
        matched_groups.append(found if matched else None)
    partial = sum(terms) / len(terms) if terms else 0.0
    return (1.0 if strict else 0.0), partial


# --- the record ---------------------------------------------------------------------------


def _parse(record: Mapping[str, Any]) -> _Record:
    """Check a GenEval metadata record; a user's file, so every fault is a FlowGrpoError."""
    if not isinstance(record, Mapping):
        raise FlowGrpoError(f"GenEval record: expected an object, got {type(record).__name__}")
    prompt = record.get("prompt")
    where = f"GenEval record {prompt!r}" if isinstance(prompt, str) else "GenEval record"
    for key in ("tag", "include", "prompt"):
        if key not in record:
            raise FlowGrpoError(f"{where}: missing key {key!r}")
    if not isinstance(prompt, str):
        raise FlowGrpoError(f"{where}: 'prompt' must be a string, got {prompt!r}")
    tag = record["tag"]
    if tag not in TAGS:
        raise FlowGrpoError(f"{where}: 'tag' {tag!r} is not one of {', '.join(TAGS)}")
    include = _clauses(record["include"], "include", where)
    if not include:
        raise FlowGrpoError(f"{where}: 'include' is empty")
    exclude = _clauses(record.get("exclude", []), "exclude", where)
    return _Record(tag=tag, include=include, exclude=exclude)


def _clauses(value: Any, key: str, where: str) -> tuple[_Clause, ...]:
    if not isinstance(value, list):
        raise FlowGrpoError(f"{where}: {key!r} must be a list, got {value!r}")
    allowed = _INCLUDE_KEYS if key == "include" else _EXCLUDE_KEYS
    clauses = []
    for index, item in enumerate(value):
        at = f"{where}: {key}[{index}]"
        if not isinstance(item, Mapping):
            raise FlowGrpoError(f"{at} must be an object, got {item!r}")
        if unknown := sorted(set(item) - allowed):
            raise FlowGrpoError(f"{at}: unknown key {unknown[0]!r} (known: {sorted(allowed)})")
        for needed in ("class", "count"):
            if needed not in item:
                raise FlowGrpoError(f"{at}: missing key {needed!r}")
        cls, count = item["class"], item["count"]
        if cls not in _CLASSES:
            raise FlowGrpoError(
                f"{at}.class {cls!r} is not one of COCO's 80 classes as GenEval names them "
                "(e.g. 'tv', 'computer mouse', 'hair drier')"
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise FlowGrpoError(f"{at}.count must be a whole number >= 1, got {count!r}")
        colour = item.get("color")
        if colour is not None and colour not in COLOURS:
            raise FlowGrpoError(f"{at}.color {colour!r} is not one of {', '.join(COLOURS)}")
        position = item.get("position")
        if position is not None:
            position = _position(position, index, at)
        clauses.append(_Clause(cls, count, colour, position))
    return tuple(clauses)


def _position(value: Any, index: int, at: str) -> tuple[str, int]:
    if not (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2):
        raise FlowGrpoError(f"{at}.position must be [relation, target index], got {value!r}")
    relation, target = value
    if relation not in RELATIONS:
        raise FlowGrpoError(
            f"{at}.position relation {relation!r} is not one of {', '.join(RELATIONS)}"
        )
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < index:
        raise FlowGrpoError(
            f"{at}.position target {target!r} must be the index of an earlier include clause"
        )
    return relation, target
