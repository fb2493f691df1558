"""GenEval metadata records: what an image must show, checked where the prompt file is read.

A record is one line of GenEval's metadata JSONL (Ghosh et al., 2023; flow_grpo trains on the
same format):

    {"tag": "position", "prompt": "a photo of a cow right of a laptop",
     "include": [{"class": "laptop", "count": 1},
                 {"class": "cow", "count": 1, "position": ["right of", 0]}]}

`include` lists the objects that must be there (`count` of them, optionally of a `color`, or
placed relative to an earlier entry: `position` = [relation, index of that entry]); `exclude`
lists counts that must not be reached. Classes are COCO's 80, as GenEval names them. Which
colours exist and how an image is judged is the reward's business (rewards/geneval_rules.py);
this module only makes sure a record is well formed, so a typo fails at `flowgrpo prepare`
with its line and key, not as a silent zero reward.
"""

from __future__ import annotations

import json
from typing import Any

# COCO's 80 instance classes in their category order (the order of a COCO detector's labels),
# named as GenEval's object_names.txt names them ("computer mouse", not COCO's "mouse").
OBJECT_NAMES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat",
    "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack",
    "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball",
    "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket",
    "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair",
    "couch", "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier",
    "toothbrush",
)  # fmt: skip
RELATIONS = ("left of", "right of", "above", "below")
_INCLUDE_KEYS = {"class", "count", "color", "position"}
_EXCLUDE_KEYS = {"class", "count"}


class RecordProblem(ValueError):
    """What is wrong with a record, naming the key (`include[1].count`)."""


def is_geneval_record(obj: dict[str, Any]) -> bool:
    """A JSONL object is a GenEval record when it has GenEval's `include` key."""
    return "include" in obj


def check_record(obj: dict[str, Any]) -> dict[str, Any]:
    """The record with only GenEval's keys (tag, prompt, include, exclude), or RecordProblem."""
    tag = obj.get("tag")
    if not isinstance(tag, str) or not tag:
        raise RecordProblem(f"tag: expected a non-empty string, got {_show(tag)}")
    include = obj["include"]
    if not isinstance(include, list) or not include:
        raise RecordProblem(f"include: expected a non-empty list, got {_show(include)}")
    for index, item in enumerate(include):
        _check_object(item, f"include[{index}]", _INCLUDE_KEYS, earlier=index)
    exclude = obj.get("exclude", [])
    if not isinstance(exclude, list):
        raise RecordProblem(f"exclude: expected a list, got {_show(exclude)}")
    for index, item in enumerate(exclude):
        _check_object(item, f"exclude[{index}]", _EXCLUDE_KEYS, earlier=0)
    record = {"tag": tag, "prompt": obj.get("prompt"), "include": include}
    if "exclude" in obj:
        record["exclude"] = exclude
    return record


def _check_object(item: object, key: str, allowed: set[str], earlier: int) -> None:
    if not isinstance(item, dict):
        raise RecordProblem(f"{key}: expected an object, got {_show(item)}")
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise RecordProblem(
            f"{key}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
        )
    name = item.get("class")
    if name not in OBJECT_NAMES:
        raise RecordProblem(f"{key}.class: {_show(name)} is not one of GenEval's 80 COCO classes")
    count = item.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise RecordProblem(f"{key}.count: expected an integer >= 1, got {_show(count)}")
    if "color" in item and (not isinstance(item["color"], str) or not item["color"]):
        raise RecordProblem(f"{key}.color: expected a colour name, got {_show(item['color'])}")
    if "position" in item:
        position = item["position"]
        valid = (
            isinstance(position, list)
            and len(position) == 2
            and position[0] in RELATIONS
            and isinstance(position[1], int)
            and not isinstance(position[1], bool)
            and 0 <= position[1] < earlier
        )
        if not valid:
            raise RecordProblem(
                f"{key}.position: expected [relation, index] with relation one of "
                f"{', '.join(RELATIONS)} and index an earlier include entry (0..{earlier - 1}), "
                f"got {_show(position)}"
            )


def dumps(record: dict[str, Any]) -> str:
    """The record as the data tables store it: compact JSON with sorted keys (deterministic)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False) if value is not None else "nothing"
    return text if len(text) <= 60 else text[:57] + "..."
