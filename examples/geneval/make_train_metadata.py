"""GenEval training prompts, drawn by GenEval's own rules, none of them asking what a test
prompt asks.

GenEval (Ghosh et al., 2023) made its 553 evaluation prompts with prompts/create_prompts.py
(https://github.com/djghosh13/geneval): one template per task over COCO's 80 classes as it
names them, its 10 colours and 4 relations, drawn with numpy's `default_rng`. This script holds
the same rules and draws them the same way, call for call: `geneval_suite(43, 100)` gives
GenEval's own 553 records (its prompts/evaluation_metadata.jsonl, the prompts of
test_metadata.jsonl), which tests/test_geneval_prompts.py checks.

| tag             | prompt                                   | include                      |
|-----------------|------------------------------------------|------------------------------|
| `single_object` | a photo of a bench                       | bench 1                      |
| `two_object`    | a photo of an apple and a bowl           | apple 1, bowl 1              |
| `counting`      | a photo of three buses (2 to 4)          | bus 3; exclude bus 4         |
| `colors`        | a photo of an orange cat (no person)     | cat 1 orange                 |
| `position`      | a photo of a cow right of a laptop       | laptop 1, cow 1 [right of, 0]|
| `color_attr`    | a photo of a red bus and a blue cup      | bus 1 red, cup 1 blue        |

An article is "an" before a vowel letter, else "a"; a plural adds "es" after an "s", else "s"
("two skises", "two benchs": GenEval's rule, kept). `colors` and `color_attr` never colour a
person; `color_attr` gives its two objects two different colours.

Per tag, records are drawn until the tag has its count, each drawn from its own stream
(`default_rng([seed, tag's index])`, so one tag's count leaves the others' prompts alone):

- a draw asking what a test prompt asks is dropped: the same prompt, or for `two_object` and
  `color_attr` the same two objects in the other order (as flow_grpo filtered its training
  set: its issue #4), or for `position` the converse ("a laptop left of a cow" for "a cow
  right of a laptop");
- a repeat of a prompt already drawn is dropped while the tag has unseen prompts left. A tag
  with fewer left than asked (80 x 3 counting prompts exist, 790 colour prompts, 80 single
  objects, all 80 of which GenEval tests) then repeats them, drawn as before, so the tag mix
  stays as asked; `--no-repeat` stops at the last unseen prompt instead.

Every record is checked by flowgrpo's own GenEval parser (`colour_requests`), then all are
shuffled and written as JSONL, one record per line in GenEval's key order.

    python examples/geneval/make_train_metadata.py            # `just geneval-train`
    python examples/geneval/make_train_metadata.py --seed 1 --per-tag 2000 --no-repeat
    python examples/geneval/make_train_metadata.py --tags position=7000,counting=5000
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flowgrpo_cli.rewards.geneval_rules import (
    COCO_CLASSES,
    COLOURS,
    RELATIONS,
    TAGS,
    colour_requests,
)

HERE = Path(__file__).resolve().parent
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
MAX_COUNT = 4  # create_prompts.py's generate_suite asks counting for 2 to 4 objects
CONVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
# No colour ever goes on a person: GenEval draws from the other 79, counted on from "person".
_PERSON = COCO_CLASSES.index("person")
# Every tag but single_object, whose 80 prompts are all GenEval test prompts (flow_grpo's
# dataset/merge_genevaltask.py, written for another of its GenEval sets, mixes these five).
DEFAULT_TAGS = ("two_object", "counting", "colors", "position", "color_attr")
DEFAULT_PER_TAG = 5000

Record = dict[str, Any]
Clause = dict[str, Any]


def with_article(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def plural(name: str) -> str:
    return f"{name}es" if name.endswith("s") else f"{name}s"


def _describe(clause: Clause) -> str:
    """One object of a prompt: "a bowl", "a red bowl", "three bowls"."""
    name = clause["class"]
    if clause["count"] > 1:
        return f"{NUMBERS[clause['count']]} {plural(name)}"
    return with_article(f"{clause['color']} {name}" if "color" in clause else name)


def make_record(tag: str, include: list[Clause]) -> Record:
    """A GenEval record for `include`, with its prompt and (counting) exclude clause."""
    if tag == "position":
        target, obj = include
        relation = obj["position"][0]
        text = f"{_describe(obj)} {relation} {_describe(target)}"
    else:
        text = " and ".join(_describe(clause) for clause in include)
    record: Record = {"tag": tag, "include": include}
    if tag == "counting":
        (clause,) = include
        record["exclude"] = [{"class": clause["class"], "count": clause["count"] + 1}]
    record["prompt"] = f"a photo of {text}"
    return record


# --- GenEval's draws, each making create_prompts.py's rng calls in its order ----------------


def _coloured_classes(idxs: Any) -> Any:
    """create_prompts.py's trick for "no person": indices drawn from 0..78 (one or an
    array), moved past it."""
    return (idxs + 1 + _PERSON) % len(COCO_CLASSES)


def _single_objects(rng: np.random.Generator, size: int) -> list[Record]:
    idxs = rng.choice(len(COCO_CLASSES), size=size, replace=False)
    return [make_record("single_object", [{"class": COCO_CLASSES[i], "count": 1}]) for i in idxs]


def _two_object(rng: np.random.Generator) -> Record:
    a, b = rng.choice(len(COCO_CLASSES), size=2, replace=False)
    include = [{"class": COCO_CLASSES[a], "count": 1}, {"class": COCO_CLASSES[b], "count": 1}]
    return make_record("two_object", include)


def _counting(rng: np.random.Generator) -> Record:
    idx = rng.choice(len(COCO_CLASSES))
    count = int(rng.integers(2, MAX_COUNT, endpoint=True))
    return make_record("counting", [{"class": COCO_CLASSES[idx], "count": count}])


def _colors(rng: np.random.Generator) -> Record:
    idx = _coloured_classes(rng.choice(len(COCO_CLASSES) - 1))
    colour = COLOURS[rng.choice(len(COLOURS))]
    return make_record("colors", [{"class": COCO_CLASSES[idx], "count": 1, "color": colour}])


def _position(rng: np.random.Generator) -> Record:
    a, b = rng.choice(len(COCO_CLASSES), size=2, replace=False)
    relation = RELATIONS[rng.choice(len(RELATIONS))]
    include = [
        {"class": COCO_CLASSES[b], "count": 1},
        {"class": COCO_CLASSES[a], "count": 1, "position": [relation, 0]},
    ]
    return make_record("position", include)


def _color_attr(rng: np.random.Generator) -> Record:
    a, b = _coloured_classes(rng.choice(len(COCO_CLASSES) - 1, size=2, replace=False))
    colour_a, colour_b = rng.choice(len(COLOURS), size=2, replace=False)
    include = [
        {"class": COCO_CLASSES[a], "count": 1, "color": COLOURS[colour_a]},
        {"class": COCO_CLASSES[b], "count": 1, "color": COLOURS[colour_b]},
    ]
    return make_record("color_attr", include)


DRAWS: dict[str, Callable[[np.random.Generator], Record]] = {
    "single_object": lambda rng: _single_objects(rng, 1)[0],
    "two_object": _two_object,
    "counting": _counting,
    "colors": _colors,
    "position": _position,
    "color_attr": _color_attr,
}


def geneval_suite(seed: int = 43, n: int = 100) -> list[Record]:
    """create_prompts.py's `generate_suite`: all 80 single objects, then `n` draws of each
    other task in TAGS order, duplicates dropped. Its defaults give GenEval's 553 records."""
    rng = np.random.default_rng(seed)
    records = _single_objects(rng, len(COCO_CLASSES))
    for tag in TAGS[1:]:
        records += [DRAWS[tag](rng) for _ in range(n)]
    return list(_unique(records))


def _unique(records: Iterable[Record]) -> Iterator[Record]:
    seen: set[str] = set()
    for record in records:
        if record["prompt"] not in seen:
            seen.add(record["prompt"])
            yield record


# --- every prompt a tag can make, and which ones a test prompt asks ----------------------------


def space(tag: str) -> Iterator[Record]:
    """Every record GenEval's draw for `tag` can make, each once."""
    coloured = [c for c in COCO_CLASSES if c != "person"]
    if tag == "single_object":
        for name in COCO_CLASSES:
            yield make_record(tag, [{"class": name, "count": 1}])
    elif tag in ("two_object", "position"):
        relations = RELATIONS if tag == "position" else (None,)
        for (a, b), relation in itertools.product(
            itertools.permutations(COCO_CLASSES, 2), relations
        ):
            if relation is None:
                yield make_record(tag, [{"class": a, "count": 1}, {"class": b, "count": 1}])
            else:
                obj = {"class": a, "count": 1, "position": [relation, 0]}
                yield make_record(tag, [{"class": b, "count": 1}, obj])
    elif tag == "counting":
        for name, count in itertools.product(COCO_CLASSES, range(2, MAX_COUNT + 1)):
            yield make_record(tag, [{"class": name, "count": count}])
    elif tag == "colors":
        for name, colour in itertools.product(coloured, COLOURS):
            yield make_record(tag, [{"class": name, "count": 1, "color": colour}])
    elif tag == "color_attr":
        for (a, b), (ca, cb) in itertools.product(
            itertools.permutations(coloured, 2), itertools.permutations(COLOURS, 2)
        ):
            include = [
                {"class": a, "count": 1, "color": ca},
                {"class": b, "count": 1, "color": cb},
            ]
            yield make_record(tag, include)
    else:
        raise ValueError(f"unknown GenEval tag {tag!r} (one of {', '.join(TAGS)})")


SPACE_SIZE = {
    "single_object": 80,
    "two_object": 80 * 79,
    "counting": 80 * (MAX_COUNT - 1),
    "colors": 79 * 10,
    "position": 80 * 79 * 4,
    "color_attr": 79 * 78 * 10 * 9,
}


def same_request(record: Record) -> set[str]:
    """The prompts that ask what `record` asks: its own, and for two objects joined by "and"
    the other order, for a position the converse."""
    prompts = {record["prompt"]}
    tag, include = record["tag"], record["include"]
    if tag in ("two_object", "color_attr") and len(include) == 2:
        prompts.add(make_record(tag, include[::-1])["prompt"])
    elif tag == "position" and len(include) == 2:
        target, obj = include
        relation = CONVERSE.get(obj.get("position", [None])[0])
        if relation is not None:
            converse = {"class": target["class"], "count": 1, "position": [relation, 0]}
            prompts.add(make_record(tag, [{"class": obj["class"], "count": 1}, converse])["prompt"])
    return prompts


def read_excluded(path: Path) -> set[str]:
    """Every prompt asking what a record of the JSONL file `path` asks."""
    excluded: set[str] = set()
    for line in path.read_text().splitlines():
        if line.strip():
            excluded |= same_request(json.loads(line))
    return excluded


def unseen(tag: str, excluded: set[str]) -> int:
    """How many of the prompts `tag` can make are not excluded."""
    return sum(record["prompt"] not in excluded for record in space(tag))


# --- the training set ------------------------------------------------------------------------


def draw_tag(
    tag: str, count: int, rng: np.random.Generator, excluded: set[str], repeat: bool = True
) -> list[Record]:
    """`count` draws of `tag` none of them excluded, distinct while unseen prompts are left;
    then repeats (`repeat`) or a shorter list. A tag with no unseen prompt is an error."""
    # Counting the unseen prompts walks the tag's whole space: only when they may run short.
    left = unseen(tag, excluded) if count > SPACE_SIZE[tag] - len(excluded) else math.inf
    if left == 0 and count:
        raise SystemExit(
            f"no {tag} prompt left: all {SPACE_SIZE[tag]} GenEval can make ask what a test "
            "prompt asks; leave the tag out"
        )
    records: list[Record] = []
    drawn: set[str] = set()
    while len(records) < count and (repeat or len(drawn) < left):
        record = DRAWS[tag](rng)
        prompt = record["prompt"]
        if prompt in excluded or (prompt in drawn and len(drawn) < left):
            continue
        drawn.add(prompt)
        records.append(record)
    return records


def make_train_metadata(
    counts: dict[str, int], seed: int, excluded: set[str], repeat: bool = True
) -> list[Record]:
    """Each tag's records (`counts`: tag -> how many), checked by flowgrpo's GenEval parser,
    shuffled; the same arguments give the same list."""
    records: list[Record] = []
    for tag, count in counts.items():
        rng = np.random.default_rng([seed, TAGS.index(tag)])
        records += draw_tag(tag, count, rng, excluded, repeat)
    for record in records:
        colour_requests(record)  # raises FlowGrpoError on a record the reward would refuse
    order = np.random.default_rng([seed, len(TAGS)]).permutation(len(records))
    return [records[i] for i in order]


def parse_tags(text: str, per_tag: int) -> dict[str, int]:
    """ "position=7000,counting" -> {"position": 7000, "counting": per_tag}."""
    if per_tag < 1:
        raise SystemExit(f"--per-tag must be a whole number above 0, got {per_tag}")
    counts: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tag, _, number = item.partition("=")
        if tag not in TAGS:
            raise SystemExit(f"--tags: unknown tag {tag!r} (one of {', '.join(TAGS)})")
        if number and not (number.isdigit() and int(number) > 0):
            raise SystemExit(f"--tags: {item!r} needs a whole number above 0 after '='")
        counts[tag] = int(number) if number else per_tag
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "train_metadata.jsonl")
    parser.add_argument(
        "--test",
        type=Path,
        default=HERE / "test_metadata.jsonl",
        help="GenEval records (JSONL) whose prompts the training set leaves out",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-tag", type=int, default=DEFAULT_PER_TAG, help="records per tag")
    parser.add_argument(
        "--tags",
        default=",".join(DEFAULT_TAGS),
        help="comma-separated tags, each optionally TAG=COUNT (default: the five flow_grpo "
        "trains on, --per-tag each)",
    )
    parser.add_argument(
        "--no-repeat",
        dest="repeat",
        action="store_false",
        help="stop a tag at its last unseen prompt instead of repeating its prompts",
    )
    args = parser.parse_args(argv)
    counts = parse_tags(args.tags, args.per_tag)
    records = make_train_metadata(counts, args.seed, read_excluded(args.test), args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    tags = Counter(record["tag"] for record in records)
    distinct = Counter(tag for tag, _ in {(r["tag"], r["prompt"]) for r in records})
    for tag in counts:
        print(f"{tag:>13}: {tags[tag]:6,} records, {distinct[tag]:6,} distinct prompts")
    print(f"wrote {len(records):,} records to {args.out}")


if __name__ == "__main__":
    main()
