"""on_error policies and the error summary, on errors laid out by hand."""

import pytest

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards import ScoreResult, apply_error_policy, summarize_errors

#               s0    s1         s2    s3    s4    s5
ERRORS = [None, "ocr: boom", None, None, None, "jpeg: bad"]
GROUPS = [0, 0, 0, 1, 1, 2]
SAMPLES = [f"s{i}" for i in range(6)]


def test_drop_sample_keeps_the_rest_of_each_group():
    outcome = apply_error_policy(ERRORS, GROUPS, "drop_sample", sample_ids=SAMPLES)
    assert outcome.keep == [True, False, True, True, True, False]
    assert outcome.dropped_samples == 2
    assert outcome.dropped_groups == 1  # group 2 had only s5


def test_drop_group_drops_every_group_with_a_failure():
    outcome = apply_error_policy(ERRORS, GROUPS, "drop_group", sample_ids=SAMPLES)
    assert outcome.keep == [False, False, False, True, True, False]
    assert outcome.dropped_samples == 4
    assert outcome.dropped_groups == 2


def test_stop_names_the_first_failed_sample_and_its_message():
    with pytest.raises(FlowGrpoError) as caught:
        apply_error_policy(ERRORS, GROUPS, "stop", sample_ids=SAMPLES)
    message = str(caught.value)
    assert "sample s1 (group 0): ocr: boom" in message
    assert "2 of 6 samples failed" in message
    assert 'on_error = "stop"' in message


def test_stop_without_sample_ids_names_the_index():
    with pytest.raises(FlowGrpoError, match="sample #1 "):
        apply_error_policy(ERRORS, GROUPS, "stop")


@pytest.mark.parametrize("on_error", ["drop_sample", "drop_group", "stop"])
def test_no_errors_keeps_everything(on_error):
    outcome = apply_error_policy([None] * 3, [0, 0, 1], on_error)
    assert outcome.keep == [True] * 3
    assert (outcome.dropped_samples, outcome.dropped_groups) == (0, 0)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(FlowGrpoError, match=r"on_error = 'skip'.*'drop_sample', 'drop_group'"):
        apply_error_policy([None], [0], "skip")


def test_summary_counts_per_reward_and_keeps_first_distinct_messages():
    result = ScoreResult(
        names=("ocr", "remote"),
        columns={"ocr": [None, None, None, None, 1.0], "remote": [0.1, None, 0.3, 0.4, 0.5]},
        errors={"ocr": ["a", "b", "a", "c", None], "remote": [None, "down", None, None, None]},
        reward=[None] * 4 + [1.5],
        reward_error=["ocr: a", "ocr: b; remote: down", "ocr: a", "ocr: c", None],
        details={},
    )
    summary = summarize_errors(result, max_messages=2)
    assert summary.num_samples == 5
    assert summary.num_failed == 4
    assert summary.failures == {"ocr": 4, "remote": 1}
    assert summary.first_messages == {"ocr": ["a", "b"], "remote": ["down"]}
    assert summary.lines() == [
        "ocr: failed on 4 of 5 images, e.g. a | b",
        "remote: failed on 1 of 5 images, e.g. down",
    ]
