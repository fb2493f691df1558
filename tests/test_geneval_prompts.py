"""examples/geneval/make_train_metadata.py: GenEval's prompt rules, call for call, and a
training set drawn by them that is seeded, leaves the test prompts out and passes the reward's
own record checker."""

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from flowgrpo_cli.rewards.geneval_rules import COCO_CLASSES, colour_requests
from flowgrpo_cli.store.prompts import read_prompt_file

GENEVAL = Path(__file__).resolve().parents[1] / "examples" / "geneval"
TEST_FILE = GENEVAL / "test_metadata.jsonl"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location(
        "make_train_metadata", GENEVAL / "make_train_metadata.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def default_file(gen, tmp_path_factory):
    """The file `just geneval-train` writes: seed 0, 5,000 of each of five tags."""
    out = tmp_path_factory.mktemp("geneval") / "train_metadata.jsonl"
    gen.main(["--out", str(out)])
    return out


def records_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


class Scripted:
    """A stand-in for numpy's Generator that returns the given values in turn and records each
    call, to check a draw's rng calls against create_prompts.py's and its record by hand."""

    def __init__(self, *values):
        self.values = list(values)
        self.calls = []

    def choice(self, a, size=None, replace=True):
        self.calls.append(("choice", a, size, replace))
        value = self.values.pop(0)
        return np.asarray(value) if size is not None else value

    def integers(self, low, high, endpoint=False):
        self.calls.append(("integers", low, high, endpoint))
        return self.values.pop(0)


def test_its_suite_is_genevals_553_test_prompts_byte_for_byte(gen):
    # create_prompts.py's defaults (seed 43, 100 per task) give GenEval's evaluation records;
    # flow_grpo's test file holds them four times, shuffled, in the same JSON spelling.
    suite = [json.dumps(record) for record in gen.geneval_suite(43, 100)]
    assert len(suite) == len(set(suite)) == 553
    assert set(suite) == set(TEST_FILE.read_text().splitlines())
    assert Counter(json.loads(line)["tag"] for line in suite) == {
        "single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
        "color_attr": 100,
    }  # fmt: skip


# Each draw with the values create_prompts.py's rng would return, worked out by hand from
# COCO's class order (person 0, bicycle 1, bus 5, cow 19, umbrella 25, handbag 26, skis 30,
# wine glass 40, bowl 45, apple 47, orange 49, laptop 63, scissors 76, toothbrush 79) and
# the colours' (red 0, orange 1, pink 6, black 8).
DRAWS = [
    ("two_object", [[47, 45]], [("choice", 80, 2, False)],
     {"tag": "two_object", "include": [{"class": "apple", "count": 1},
      {"class": "bowl", "count": 1}], "prompt": "a photo of an apple and a bowl"}),
    ("counting", [5, 2], [("choice", 80, None, True), ("integers", 2, 4, True)],
     {"tag": "counting", "include": [{"class": "bus", "count": 2}],
      "exclude": [{"class": "bus", "count": 3}], "prompt": "a photo of two buses"}),
    ("counting", [30, 4], [("choice", 80, None, True), ("integers", 2, 4, True)],
     {"tag": "counting", "include": [{"class": "skis", "count": 4}],
      "exclude": [{"class": "skis", "count": 5}], "prompt": "a photo of four skises"}),
    ("counting", [40, 3], [("choice", 80, None, True), ("integers", 2, 4, True)],
     {"tag": "counting", "include": [{"class": "wine glass", "count": 3}],
      "exclude": [{"class": "wine glass", "count": 4}],
      "prompt": "a photo of three wine glasses"}),
    # colours skip the person: 79 choices, moved on by one (0 -> bicycle, 78 -> toothbrush)
    ("colors", [0, 1], [("choice", 79, None, True), ("choice", 10, None, True)],
     {"tag": "colors", "include": [{"class": "bicycle", "count": 1, "color": "orange"}],
      "prompt": "a photo of an orange bicycle"}),
    ("colors", [78, 0], [("choice", 79, None, True), ("choice", 10, None, True)],
     {"tag": "colors", "include": [{"class": "toothbrush", "count": 1, "color": "red"}],
      "prompt": "a photo of a red toothbrush"}),
    # the first drawn class is the one placed, relative to the second (include[0])
    ("position", [[19, 63], 1], [("choice", 80, 2, False), ("choice", 4, None, True)],
     {"tag": "position", "include": [{"class": "laptop", "count": 1},
      {"class": "cow", "count": 1, "position": ["right of", 0]}],
      "prompt": "a photo of a cow right of a laptop"}),
    ("color_attr", [[25, 75], [6, 8]], [("choice", 79, 2, False), ("choice", 10, 2, False)],
     {"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "pink"},
      {"class": "scissors", "count": 1, "color": "black"}],
      "prompt": "a photo of a pink handbag and a black scissors"}),
    ("color_attr", [[24, 48], [1, 0]], [("choice", 79, 2, False), ("choice", 10, 2, False)],
     {"tag": "color_attr", "include": [{"class": "umbrella", "count": 1, "color": "orange"},
      {"class": "orange", "count": 1, "color": "red"}],
      "prompt": "a photo of an orange umbrella and a red orange"}),
    ("single_object", [[47]], [("choice", 80, 1, False)],
     {"tag": "single_object", "include": [{"class": "apple", "count": 1}],
      "prompt": "a photo of an apple"}),
]  # fmt: skip


@pytest.mark.parametrize(("tag", "values", "calls", "expected"), DRAWS)
def test_each_draw_makes_genevals_calls_and_record(gen, tag, values, calls, expected):
    rng = Scripted(*values)
    record = gen.DRAWS[tag](rng)
    assert record == expected
    assert json.dumps(record) == json.dumps(expected)  # GenEval's key order too
    assert rng.calls == calls and not rng.values
    colour_requests(record)


def test_articles_and_plurals_follow_genevals_letter_rules(gen):
    assert [gen.with_article(w) for w in ("apple", "orange", "umbrella", "hair drier", "tv")] == [
        "an apple", "an orange", "an umbrella", "a hair drier", "a tv"
    ]  # fmt: skip
    # GenEval's test prompts say "four benchs" and "two sheeps": its rule, not English
    assert [gen.plural(w) for w in ("bus", "skis", "bench", "sheep", "computer mouse")] == [
        "buses", "skises", "benchs", "sheeps", "computer mouses"
    ]  # fmt: skip
    prompts = {json.loads(line)["prompt"] for line in TEST_FILE.read_text().splitlines()}
    assert {"a photo of four benchs", "a photo of two sheeps"} <= prompts


def test_a_request_is_its_prompt_its_swap_or_its_converse(gen):
    two = gen.make_record("two_object", [{"class": "apple", "count": 1},
                                         {"class": "bowl", "count": 1}])  # fmt: skip
    assert gen.same_request(two) == {"a photo of an apple and a bowl",
                                     "a photo of a bowl and an apple"}  # fmt: skip
    position = DRAWS[6][3]
    assert gen.same_request(position) == {"a photo of a cow right of a laptop",
                                          "a photo of a laptop left of a cow"}  # fmt: skip
    attr = DRAWS[7][3]
    assert gen.same_request(attr) == {"a photo of a pink handbag and a black scissors",
                                      "a photo of a black scissors and a pink handbag"}  # fmt: skip
    assert gen.same_request(DRAWS[1][3]) == {"a photo of two buses"}


def test_the_same_seed_writes_the_same_bytes(gen, tmp_path, default_file):
    args = ["--per-tag", "300", "--tags", "counting,position,color_attr"]
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        gen.main([*args, "--seed", seed, "--out", str(tmp_path / name)])
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert (tmp_path / "a").read_bytes() != (tmp_path / "c").read_bytes()
    # each tag draws from its own stream: another count for one tag leaves the others' prompts
    gen.main([*args, "--seed", "7", "--tags", "counting=50,position,color_attr",
              "--out", str(tmp_path / "d")])  # fmt: skip

    def prompts(name, tag):
        return sorted(r["prompt"] for r in records_of(tmp_path / name) if r["tag"] == tag)

    assert prompts("a", "position") == prompts("d", "position")
    assert prompts("a", "color_attr") == prompts("d", "color_attr")
    assert prompts("a", "counting") != prompts("d", "counting")
    # and the default run, once more, gives the recipe's file byte for byte
    gen.main(["--out", str(tmp_path / "again")])
    assert (tmp_path / "again").read_bytes() == default_file.read_bytes()


def request(record: dict) -> tuple:
    """What a record asks, whatever the wording: two objects in either order, a position or
    its converse, worked out from the clauses alone."""
    tag, include = record["tag"], record["include"]
    if tag in ("two_object", "color_attr"):
        return tag, frozenset((c["class"], c.get("color")) for c in include)
    if tag == "position":
        target, obj = include[0]["class"], include[1]["class"]
        relation = include[1]["position"][0]
        flip = {"right of": "left of", "below": "above"}
        if relation in flip:
            return tag, target, flip[relation], obj
        return tag, obj, relation, target
    return tag, record["prompt"]


def test_no_training_prompt_asks_what_a_test_prompt_asks(gen, default_file):
    test = [json.loads(line) for line in TEST_FILE.read_text().splitlines()]
    train = records_of(default_file)
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # nor the same two objects the other way round, nor a position's converse
    assert not {request(r) for r in test} & {request(r) for r in train}
    # the generator's own list of what to leave out agrees, on a test prompt of each kind
    excluded = gen.read_excluded(TEST_FILE)
    assert {"a photo of a skis and a bowl", "a photo of a laptop left of a cow",
            "a photo of a black scissors and a pink handbag"} <= excluded  # fmt: skip
    # two prompts per two-object, colour-pair or position request, one per single-object,
    # counting or colour request (80, 80 and 94 of those)
    assert len(excluded) == len({request(r) for r in test}) * 2 - 80 - 80 - 94


OBJECTS = {"single_object": 1, "two_object": 2, "counting": 1, "colors": 1, "position": 2,
           "color_attr": 2}  # fmt: skip


def test_every_record_passes_the_rewards_checker_and_has_its_tags_shape(gen, default_file):
    parsed = read_prompt_file(default_file, needs_record="geneval", check_record=colour_requests)
    assert parsed.problems == []
    assert len(parsed.rows) == 25_000
    for record in records_of(default_file):
        tag, include = record["tag"], record["include"]
        # the prompt and exclude clause are the template's for these clauses
        assert record == gen.make_record(tag, include)
        assert list(record) == ["tag", "include", *(["exclude"] if tag == "counting" else []),
                                "prompt"]  # fmt: skip
        classes = [clause["class"] for clause in include]
        assert len(set(classes)) == len(classes) == OBJECTS[tag]
        if tag == "counting":
            assert 2 <= include[0]["count"] <= 4
            assert record["exclude"] == [{"class": classes[0], "count": include[0]["count"] + 1}]
        else:
            assert all(clause["count"] == 1 for clause in include)
        if tag in ("colors", "color_attr"):
            assert "person" not in classes
            colours = [clause["color"] for clause in include]
            assert len(set(colours)) == len(colours)
        if tag == "position":
            assert "position" not in include[0] and include[1]["position"][1] == 0


def test_the_tag_mix_is_as_asked(gen, default_file, tmp_path, capsys):
    records = records_of(default_file)
    assert Counter(r["tag"] for r in records) == {tag: 5000 for tag in gen.DEFAULT_TAGS}
    distinct = Counter(tag for tag, _ in {(r["tag"], r["prompt"]) for r in records})
    # 80 x 3 counting prompts exist and 80 are tested; 79 x 10 colour prompts, 94 tested: those
    # tags repeat theirs; the others have thousands left and never repeat
    assert distinct == {"two_object": 5000, "counting": 160, "colors": 696, "position": 5000,
                        "color_attr": 5000}  # fmt: skip

    gen.main(["--no-repeat", "--out", str(tmp_path / "once")])
    assert "counting:    160 records,    160 distinct prompts" in capsys.readouterr().out
    assert Counter(r["tag"] for r in records_of(tmp_path / "once")) == {
        "two_object": 5000, "counting": 160, "colors": 696, "position": 5000, "color_attr": 5000
    }  # fmt: skip
    # flow_grpo's dataset/merge_genevaltask.py weights (0.7, 0.5, 0.3, 0.1, 0.1), x 1,000
    mix = "position=700,counting=500,color_attr=300,colors=100,two_object=100"
    gen.main(["--tags", mix, "--out", str(tmp_path / "mix")])
    assert Counter(r["tag"] for r in records_of(tmp_path / "mix")) == {
        "position": 700, "counting": 500, "color_attr": 300, "colors": 100, "two_object": 100
    }  # fmt: skip


def test_single_objects_are_all_test_prompts(gen, tmp_path):
    with pytest.raises(SystemExit, match="no single_object prompt left: all 80"):
        gen.main(["--tags", "single_object", "--out", str(tmp_path / "x")])
    # against an empty test file the 80 are there, and --no-repeat stops at them
    (tmp_path / "empty.jsonl").write_text("")
    gen.main(["--tags", "single_object=100", "--no-repeat", "--test", str(tmp_path / "empty.jsonl"),
              "--out", str(tmp_path / "single")])  # fmt: skip
    classes = [r["include"][0]["class"] for r in records_of(tmp_path / "single")]
    assert sorted(classes) == sorted(COCO_CLASSES)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tags", "counting,shapes"], "unknown tag 'shapes'"),
        (["--tags", "counting=0"], "'counting=0' needs a whole number above 0"),
        (["--per-tag", "0"], "--per-tag must be a whole number above 0"),
    ],
)
def test_bad_options_say_what_is_wrong(gen, tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        gen.main([*args, "--out", str(tmp_path / "x")])
