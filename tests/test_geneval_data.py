"""GenEval metadata records from prompt file to reward: `prepare` checks and keeps them, the
data tables store them, `score` and `evaluate` hand each image's record to the rewards, and a
reward that needs records refuses prompts without one before anything is sampled."""

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.store.datatable import read_split
from flowgrpo_cli.store.prompts import read_prompt_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "geneval" / "test_metadata.jsonl"
RECORDS = [
    {"tag": "single_object", "include": [{"class": "bowl", "count": 1}],
     "prompt": "a photo of a bowl"},
    {"tag": "counting", "include": [{"class": "wine glass", "count": 2}],
     "exclude": [{"class": "wine glass", "count": 3}], "prompt": "a photo of two wine glasses"},
    {"tag": "position", "include": [{"class": "laptop", "count": 1},
     {"class": "cow", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a cow right of a laptop"},
    {"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "pink"},
     {"class": "scissors", "count": 1, "color": "black"}],
     "prompt": "a photo of a pink handbag and a black scissors"},
]  # fmt: skip
# A plugin reward that needs records: the number of `include` entries of each image's record.
PLUGIN = """
def score(images, prompts, metadata):
    return [len(meta["geneval"]["include"]) for meta in metadata]
score.needs = {"images", "geneval"}
"""
runner = CliRunner()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_shipped_test_set_reads_with_a_record_per_prompt():
    parsed = read_prompt_file(EXAMPLE, needs_record="geneval")
    assert parsed.problems == []
    # 320 + 396 + 320 + 376 + 400 + 400 records over the six tags; `wc -l` counts 2211 (no
    # newline ends the last line)
    assert len(parsed.rows) == 2212
    first = json.loads(parsed.rows[0].geneval)
    assert first["tag"] == "counting" and first["prompt"] == parsed.rows[0].prompt


def test_prepare_keeps_each_record_as_json_and_other_rows_as_null(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [*RECORDS, {"prompt": 'a sign "OPEN"'}])
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "run"), "--train",
                                 str(train), "--test", str(train)])  # fmt: skip
    assert result.exit_code == 1  # the default reward, OCR, needs quoted text: GenEval's hinted
    assert "({geneval = 1.0} for GenEval metadata)" in result.output
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "run"), "--train",
                                 str(train), "--test", str(train), "--set",
                                 "reward.weights={jpeg_compressibility = 1.0}"])  # fmt: skip
    assert result.exit_code == 0, result.output
    column = pq.read_table(tmp_path / "run/data/train.parquet").column("geneval").to_pylist()
    assert [json.loads(text) for text in column[:4]] == RECORDS
    assert column[4] is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tag": 3}, "'tag' 3 is not one of single_object"),
        ({"include": []}, "'include' is empty"),
        ({"include": [{"class": "unicorn", "count": 1}]},
         "include[0].class 'unicorn' is not one of COCO's 80 classes"),
        ({"include": [{"class": "bowl", "count": 0}]},
         "include[0].count must be a whole number >= 1, got 0"),
        ({"include": [{"class": "bowl", "count": True}]},
         "include[0].count must be a whole number >= 1, got True"),
        ({"include": [{"class": "bowl", "count": 1, "colour": "red"}]},
         "include[0]: unknown key 'colour'"),
        ({"include": [{"class": "bowl", "count": 1, "color": "grey"}]},
         "include[0].color 'grey' is not one of red, orange"),
        ({"include": [{"class": "bowl", "count": 1}, {"class": "cow", "count": 1,
                       "position": ["right of", 1]}]},
         "include[1].position target 1 must be the index of an earlier include clause"),
        ({"include": [{"class": "bowl", "count": 1}, {"class": "cow", "count": 1,
                       "position": ["beside", 0]}]},
         "include[1].position relation 'beside' is not one of"),
        ({"exclude": {"class": "bowl"}}, "'exclude' must be a list"),
    ],
)  # fmt: skip
def test_a_malformed_record_is_refused_at_its_line_and_key(tmp_path, change, message):
    """The rules' own check of a record (rewards/geneval_rules.py), at prepare, with file:line."""
    train = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], {**RECORDS[2], **change}])
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "run"), "--train",
                                 str(train), "--test", str(train), "--set",
                                 "reward.weights={jpeg_compressibility = 1.0}"])  # fmt: skip
    assert result.exit_code == 1
    where = f"{train}:2: GenEval record 'a photo of a cow right of a laptop': "
    assert where + message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "data").exists()


def test_a_reward_that_needs_records_refuses_prompts_without_one(tmp_path):
    (tmp_path / "counter.py").write_text(PLUGIN)
    train = write_jsonl(tmp_path / "train.jsonl", [RECORDS[0], {"prompt": "a photo of a cat"}])
    result = runner.invoke(app, [
        "prepare", "--run", str(tmp_path / "run"), "--train", str(train), "--test", str(train),
        "--set", f'reward.plugin_dirs=["{tmp_path}"]',
        "--set", "reward.weights={'counter:score' = 1.0}",
    ])  # fmt: skip
    assert result.exit_code == 1
    assert f"{train}:2: no GenEval record for 'a photo of a cat'" in result.output
    assert "the `counter:score` reward needs one" in result.output


def test_a_table_from_before_records_reads_without_them(make_run):
    _, run = make_run()
    path = run.data_dir / "train.parquet"
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["geneval"]), path)
    assert [row["geneval"] for row in read_split(run, "train")] == [None] * table.num_rows


def test_score_and_evaluate_hand_each_image_its_prompts_record(make_run, tmp_path):
    from helpers import do_rollout, do_score

    from flowgrpo_cli.stages import evaluate
    from flowgrpo_cli.store.rundir import ROLLOUT, SCORE
    from flowgrpo_cli.store.trajectory import read_table

    (tmp_path / "counter.py").write_text(PLUGIN)
    prompts = write_jsonl(tmp_path / "geneval.jsonl", RECORDS)
    config, run = make_run(
        f"data.train={prompts}", f"data.test={prompts}", f'reward.plugin_dirs=["{tmp_path}"]',
        "reward.weights={'counter:score' = 1.0}", "algorithm.prompts_per_iteration=4",
    )  # fmt: skip
    do_rollout(config, run)
    do_score(config, run)

    def parts(folder):
        return sorted(folder.glob("part-*.arrow"))

    rollout = read_table(parts(run.stage_dir(0, ROLLOUT)), ["sample_id", "prompt_index"])
    scores = read_table(parts(run.stage_dir(0, SCORE)), ["sample_id", "counter:score"])
    by_sample = dict(zip(*scores.to_pydict().values(), strict=True))
    includes = [len(record["include"]) for record in RECORDS]  # 1, 1, 2, 2
    for sample, index in zip(*rollout.to_pydict().values(), strict=True):
        assert by_sample[sample] == includes[index]

    from helpers import engine_for, policy_for

    engine = engine_for(policy_for(config, run, 0), config)
    evaluate.run(config, run, 0, engine)
    table = read_table(parts(run.eval_dir(0)), ["prompt", "counter:score"]).to_pydict()
    assert table["counter:score"] == includes
    assert table["prompt"] == [record["prompt"] for record in RECORDS]


def test_a_batch_has_records_only_when_every_image_has_one():
    from PIL import Image

    from flowgrpo_cli.rewards.base import RewardBatch

    images = [Image.new("RGB", (8, 8))] * 2
    assert RewardBatch(images, metadata=[{"geneval": RECORDS[0]}] * 2).has("geneval")
    assert not RewardBatch(images, metadata=[{"geneval": RECORDS[0]}, {}]).has("geneval")
    assert not RewardBatch(images).has("geneval")
