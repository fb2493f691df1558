"""`flowgrpo prepare`: every input format, every error, determinism, the paper's prompt file."""

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowgrpo_cli.cli import app
from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.store.prompts import extract_target, read_prompt_file

PAPER_PROMPTS = Path(__file__).resolve().parents[2] / "shared/data/flow_grpo_ocr_test.txt"
runner = CliRunner()

LINES = [
    'A shop sign that reads "OPEN" in red neon.',
    "A mug printed with “Best Dad” on its side.",
    'A poster saying "Hello World" and "ignored second".',
]


def prepare(tmp_path, *args):
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "run"), *map(str, args)])
    return result


def table(tmp_path, split):
    return pq.read_table(tmp_path / "run" / "data" / f"{split}.parquet").to_pandas()


@pytest.mark.parametrize(
    ("prompt", "target"),
    [
        ('A sign that says "OPEN"', "OPEN"),
        ("A sign with “curly text” on it", "curly text"),
        ('first "one" then "two"', "one"),
        ('mixed “curly” then "straight"', "curly"),
        ("no quotes at all", None),
        ('empty "" quotes', None),
    ],
)
def test_target_is_first_quoted_span(prompt, target):
    assert extract_target(prompt) == target


def test_txt_train_and_test_files(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("\n".join(LINES) + "\n")
    test = tmp_path / "test.txt"
    test.write_text('A cake with "42" in icing.\n')
    result = prepare(tmp_path, "--train", train, "--test", test)
    assert result.exit_code == 0, result.output
    frame = table(tmp_path, "train")
    assert list(frame.ground_truth) == ["OPEN", "Best Dad", "Hello World"]
    assert list(frame.prompt_index) == [0, 1, 2]
    assert list(frame.source) == [f"{train}:1", f"{train}:2", f"{train}:3"]
    assert list(table(tmp_path, "test").ground_truth) == ["42"]
    manifest = json.loads((tmp_path / "run/data/manifest.json").read_text())
    assert manifest["counts"] == {"train": 3, "test": 1}


def test_train_prompts_keeps_the_first_n_after_the_split(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("".join(f'Sign "{i:03d}"\n' for i in range(20)))
    result = prepare(tmp_path, "--train", train, "--set", "data.train_prompts=3")
    assert result.exit_code == 0, result.output
    kept = list(table(tmp_path, "train").ground_truth)
    held_out = list(table(tmp_path, "test").ground_truth)
    assert len(kept) == 3 and len(held_out) == 2  # test_fraction 0.1 of all 20, as without
    assert not set(kept) & set(held_out)
    result = prepare(tmp_path / "all", "--train", train)
    assert list(table(tmp_path / "all", "train").ground_truth)[:3] == kept
    assert list(table(tmp_path / "all", "test").ground_truth) == held_out


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_table_formats_with_optional_columns(tmp_path, suffix):
    rows = [
        {"prompt": 'A sign "A1"', "ground_truth": "", "negative_prompt": "blurry"},
        {"prompt": "A label with no quotes", "ground_truth": "given", "negative_prompt": ""},
    ]
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    result = prepare(tmp_path, "--train", path, "--test", path, "--negative-prompt", "ugly")
    assert result.exit_code == 0, result.output
    frame = table(tmp_path, "train")
    assert list(frame.ground_truth) == ["A1", "given"]
    assert list(frame.negative_prompt) == ["blurry", "ugly"]


def test_missing_prompt_column_names_file_and_columns(tmp_path):
    path = tmp_path / "p.csv"
    pd.DataFrame({"text": ['say "x"']}).to_csv(path, index=False)
    result = prepare(tmp_path, "--train", path)
    assert result.exit_code == 1
    assert f"{path}: no `prompt` column (columns: text)" in result.output


def test_line_without_target_and_empty_prompt_are_errors_with_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('good "A"\nno target here\n\n   \ngood "B"\n')
    result = prepare(tmp_path, "--train", path, "--test", path)  # the default reward: ocr
    assert result.exit_code == 1
    assert "3 invalid prompt row(s)" in result.output
    assert f"{path}:2: no quoted target text in 'no target here'; the `ocr` reward" in (
        result.output
    )
    assert f"{path}:3: empty prompt" in result.output
    assert f"{path}:4: empty prompt" in result.output
    assert "Traceback" not in result.output


def test_skip_invalid_skips_and_reports(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('good "A"\nno target here\ngood "B"\n')
    result = prepare(tmp_path, "--train", path, "--test", path, "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert "skipped 2 invalid row(s)" in result.output  # one per file
    assert list(table(tmp_path, "train").ground_truth) == ["A", "B"]


def test_non_utf8_file_names_line_and_column(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b'ok "A"\nbad "caf' + b"\xe9" + b'"\n')
    result = prepare(tmp_path, "--train", path)
    assert result.exit_code == 1
    assert f"{path}:2:9: not UTF-8 (byte 0xe9)" in result.output


def test_lines_split_on_newline_only(tmp_path):
    """Form feed, vertical tab and U+2028 stay inside their line; \\r\\n ends one."""
    path = tmp_path / "p.txt"
    path.write_text('a "A"\fstill line 1\r\nb "B"\vand\u2028more\r\nno target\n', newline="")
    parsed = read_prompt_file(path, needs_target="ocr")
    assert [r.prompt for r in parsed.rows] == ['a "A"\fstill line 1', 'b "B"\vand\u2028more']
    assert [p.source for p in parsed.problems] == [f"{path}:3"]


def test_skip_invalid_skips_lines_that_are_not_utf8(tmp_path):
    txt, csv = tmp_path / "p.txt", tmp_path / "p.csv"
    txt.write_bytes(b'ok "A"\nbad "caf\xe9"\nok "B"\n')
    csv.write_bytes(b'prompt,ground_truth\nok,A\nbad "caf\xe9",x\nok,B\n')
    result = prepare(tmp_path, "--train", txt, "--test", csv, "--skip-invalid")
    assert result.exit_code == 0, result.output
    assert list(table(tmp_path, "train").ground_truth) == ["A", "B"]
    assert list(table(tmp_path, "test").ground_truth) == ["A", "B"]
    assert list(table(tmp_path, "test").source) == [f"{csv}:2", f"{csv}:4"]


def test_csv_with_an_unbalanced_quote_is_an_error_at_its_lines(tmp_path):
    merged = tmp_path / "merged.csv"  # the quote opened on line 2 closes on line 3
    merged.write_text('prompt,ground_truth\n"A sign ""OPEN"", OPEN\nA mug "Best", Best\n')
    result = prepare(tmp_path, "--train", merged)
    assert result.exit_code == 1
    assert f"{merged}:2: malformed CSV in lines 2-3" in result.output
    assert "unbalanced quote" in result.output
    spanning = tmp_path / "spanning.csv"  # closes cleanly, but two lines became one field
    spanning.write_text('prompt,ground_truth\n"A sign ""OPEN,OPEN\nA mug ""Best""",Best\n')
    parsed = read_prompt_file(spanning)
    assert [(p.source, p.message) for p in parsed.problems] == [
        (f"{spanning}:2", "a quoted field runs over lines 2-3; is a quote unbalanced?")
    ]


def test_csv_rows_with_the_wrong_number_of_fields(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt,ground_truth\nok,A\none,two,three\n\nok,B\n")
    problems = read_prompt_file(path).problems
    assert [(p.source, p.message) for p in problems] == [
        (f"{path}:3", "3 fields, the header has 2"),
        (f"{path}:4", "empty line"),
    ]


def test_suffix_is_matched_without_case(tmp_path):
    path = tmp_path / "PROMPTS.CSV"
    path.write_text('prompt\nA sign "OPEN"\n')
    assert [r.ground_truth for r in read_prompt_file(path).rows] == ["OPEN"]


def test_values_that_are_not_strings_say_so(tmp_path):
    jsonl, parquet = tmp_path / "p.jsonl", tmp_path / "p.parquet"
    jsonl.write_text('{"prompt": 5}\n{"prompt": "a", "ground_truth": ["x"]}\n')
    pd.DataFrame({"prompt": [7]}).to_parquet(parquet)
    messages = [p.message for p in read_prompt_file(jsonl).problems]
    assert messages == ["prompt is not a string: 5", "ground_truth is not a string: ['x']"]
    assert [p.message for p in read_prompt_file(parquet).problems] == ["prompt is not a string: 7"]


def test_jsonl_errors_name_line_and_column(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a \\"B\\""}\n{"prompt": oops}\n{"text": "x"}\n')
    result = prepare(tmp_path, "--train", path, "--test", path)
    assert result.exit_code == 1
    assert f"{path}:2:12: invalid JSON" in result.output
    assert f"{path}:3: expected a JSON object with a `prompt` key" in result.output


def test_unknown_suffix_and_missing_file(tmp_path):
    with pytest.raises(FlowGrpoError, match=r"unsupported prompt file type '\.xml'"):
        (tmp_path / "p.xml").write_text("x")
        read_prompt_file(tmp_path / "p.xml")
    with pytest.raises(FlowGrpoError, match="does not exist"):
        read_prompt_file(tmp_path / "none.txt")


def test_no_train_file_configured(tmp_path):
    result = prepare(tmp_path)
    assert result.exit_code == 1 and "data.train" in result.output


def test_duplicates_reported(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('same "A"\nother "B"\nsame "A"\n')
    result = prepare(tmp_path, "--train", path, "--test", path)
    assert result.exit_code == 0
    manifest = json.loads((tmp_path / "run/data/manifest.json").read_text())
    assert manifest["summary"]["duplicates"]["train"] == [
        {"prompt": 'same "A"', "sources": [f"{path}:1", f"{path}:3"]}
    ]
    assert "duplicate in train" in result.output


def test_seeded_split_is_deterministic_and_byte_identical(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("".join(f'sign "{i}"\n' for i in range(50)))
    for name in ("a", "b"):
        result = runner.invoke(
            app,
            [
                "prepare",
                "--run",
                str(tmp_path / name),
                "--train",
                str(path),
                "--test-fraction",
                "0.2",
            ],
        )
        assert result.exit_code == 0, result.output
    for split in ("train", "test"):
        a = (tmp_path / "a/data" / f"{split}.parquet").read_bytes()
        assert a == (tmp_path / "b/data" / f"{split}.parquet").read_bytes()
    test_rows = pq.read_table(tmp_path / "a/data/test.parquet").to_pandas()
    assert len(test_rows) == 10
    assert list(test_rows.source) == sorted(test_rows.source, key=lambda s: int(s.split(":")[1]))
    other_seed = runner.invoke(
        app,
        [
            "prepare",
            "--run",
            str(tmp_path / "c"),
            "--train",
            str(path),
            "--test-fraction",
            "0.2",
            "--set",
            "run.seed=1",
        ],
    )
    assert other_seed.exit_code == 0
    assert (tmp_path / "c/data/test.parquet").read_bytes() != (
        tmp_path / "a/data/test.parquet"
    ).read_bytes()


def test_rerun_is_a_no_op_and_changed_input_is_refused(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('a "A"\nb "B"\n')
    assert prepare(tmp_path, "--train", path, "--test", path).exit_code == 0
    assert prepare(tmp_path).exit_code == 0  # same stored config, same inputs
    path.write_text('a "A"\nc "C"\n')
    result = prepare(tmp_path)
    assert result.exit_code == 1 and "another config or other inputs" in result.output


@pytest.mark.skipif(not PAPER_PROMPTS.is_file(), reason="shared/data not present")
def test_paper_ocr_prompts(tmp_path):
    result = prepare(tmp_path, "--train", PAPER_PROMPTS, "--test", PAPER_PROMPTS)
    assert result.exit_code == 0, result.output
    frame = table(tmp_path, "train")
    assert len(frame) == 1018
    lines = PAPER_PROMPTS.read_text(encoding="utf-8").splitlines()
    for line, target in zip(lines, frame.ground_truth, strict=True):
        assert f'"{target}"' in line
        assert line.index(f'"{target}"') == line.index('"')


def test_prompts_without_targets_serve_rewards_that_need_none(tmp_path, monkeypatch):
    """A plain prompt list is valid input unless a configured reward reads the target."""
    plain = tmp_path / "plain.csv"
    pd.DataFrame({"prompt": ["a cat on a sofa", "a red bicycle", 'a sign "OPEN"']}).to_csv(
        plain, index=False
    )
    jpeg = ["--set", "reward.weights={jpeg_compressibility = 1.0}"]
    result = prepare(tmp_path, "--train", plain, "--test", plain, *jpeg)
    assert result.exit_code == 0, result.output
    targets = pq.read_table(tmp_path / "run/data/train.parquet").column("ground_truth")
    assert targets.to_pylist() == [None, None, "OPEN"]

    # A plugin that reads ground truths is named as the one that needs them.
    (tmp_path / "rw_reads_targets.py").write_text(
        "def score(images, prompts, metadata):\n    return [0.0] * len(images)\n"
        "score.needs = {'images', 'ground_truths'}\n"
    )
    plugin = [
        "--set",
        f'reward.plugin_dirs=["{tmp_path}"]',
        "--set",
        'reward.weights={jpeg_compressibility = 1.0, "rw_reads_targets:score" = 1}',
    ]
    result = runner.invoke(app, ["prepare", "--run", str(tmp_path / "other"), "--train",
                                 str(plain), "--test", str(plain), *plugin])  # fmt: skip
    assert result.exit_code == 1
    assert "2 invalid prompt row(s)" in result.output
    assert f"{plain}:2: no quoted target text in 'a cat on a sofa'" in result.output
    assert "the `rw_reads_targets:score` reward needs one" in result.output

    # Switching the run to OCR redoes prepare, which then refuses the rows OCR cannot score.
    result = prepare(tmp_path, "--set", "reward.weights={ocr = 1.0}", "--allow-config-change")
    assert result.exit_code == 1 and "the `ocr` reward needs one" in result.output
