"""GenEval's rules and the Flow-GRPO server's two rewards, on hand-built detections.

Every expected value is worked out by hand from the two reference functions:
- GenEval (evaluation/evaluate_images.py, `evaluate`): `correct` and `reason`; an include
  clause reads the `count` most confident kept objects and needs at least `count` of them;
  an exclude clause fails once `count` objects of its class are kept.
- The server (reward_server/gen_eval.py, `evaluate_reward`): `strict` needs exactly `count`
  kept objects per include clause and reads no exclude clause; `partial` is the mean of terms
  t = 1 - |count - n| / count per clause (n = all kept objects of the class), plus one 0 for a
  wrong count where a colour or position is asked, a colour term 1 - |count - n_colour| / count,
  a position term 1 (holds), 0 (no target) or 0 then 1 (fails).
Kept objects: score > 0.3 (> 0.9 in a counting record) in float32, at most 16, NMS off.
No model anywhere: detections are written out by hand.
"""

from __future__ import annotations

import warnings

import pytest

from flowgrpo_cli.errors import FlowGrpoError
from flowgrpo_cli.rewards.geneval_rules import (
    COLOURS,
    GENEVAL,
    Detection,
    Thresholds,
    colour_requests,
    kept_detections,
    score_record,
)

BOX = (0.0, 0.0, 10.0, 10.0)


def det(score: float, box: tuple[float, float, float, float] = BOX, colour: str | None = None):
    return Detection(score=score, box=box, colour=colour)


def check(score, correct: bool, strict: float, partial: float, reason: str | None = None):
    assert score.correct is correct
    assert score.strict == strict
    assert score.partial == pytest.approx(partial, abs=1e-12)
    if reason is not None:
        assert score.reason == reason
    if correct:
        assert score.reason == ""


# The records, one per tag, as GenEval's evaluation_metadata.jsonl writes them.
SINGLE = {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a bench"}
TWO = {
    "tag": "two_object",
    "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
    "prompt": "a photo of a bench and a sports ball",
}
COUNTING = {
    "tag": "counting",
    "include": [{"class": "clock", "count": 2}],
    "exclude": [{"class": "clock", "count": 3}],
    "prompt": "a photo of two clocks",
}
COLORS = {
    "tag": "colors",
    "include": [{"class": "fire hydrant", "count": 1, "color": "blue"}],
    "prompt": "a photo of a blue fire hydrant",
}
POSITION = {
    "tag": "position",
    "include": [
        {"class": "teddy bear", "count": 1},
        {"class": "dog", "count": 1, "position": ["right of", 0]},
    ],
    "prompt": "a photo of a dog right of a teddy bear",
}
COLOR_ATTR = {
    "tag": "color_attr",
    "include": [
        {"class": "wine glass", "count": 1, "color": "purple"},
        {"class": "apple", "count": 1, "color": "black"},
    ],
    "prompt": "a photo of a purple wine glass and a black apple",
}


def test_colours_are_genevals_ten_in_its_order():
    assert COLOURS == (
        "red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white",
    )  # fmt: skip
    assert (
        Thresholds(detection=0.3, counting=0.9, max_objects=16, max_overlap=1.0, position=0.1)
        == GENEVAL
    )


# --- single_object -------------------------------------------------------------------------


def test_single_object_found():
    # 1 bench kept; GenEval 1 >= 1; server n = 1 == 1, terms [1 - 0/1] = [1] -> 1
    check(score_record(SINGLE, {"bench": [det(0.95)]}), True, 1.0, 1.0)


def test_single_object_score_on_the_threshold_is_not_kept():
    # 0.3 > 0.3 is false: nothing kept. GenEval: 0 < 1. Server terms [1 - |1 - 0|/1] = [0].
    score = score_record(SINGLE, {"bench": [det(0.3)]})
    check(score, False, 0.0, 0.0, "expected bench>=1, found 0")


def test_single_object_threshold_is_compared_in_float32():
    # 0.30000001 > 0.3 in float64, but both round to the same float32 (0.3000000119...),
    # which GenEval's float32 detector arrays compare: not kept, as in test above.
    assert 0.30000001 > 0.3
    check(score_record(SINGLE, {"bench": [det(0.30000001)]}), False, 0.0, 0.0)
    # 0.3001 rounds to a float32 above float32(0.3): kept.
    check(score_record(SINGLE, {"bench": [det(0.3001)]}), True, 1.0, 1.0)


def test_single_object_two_found_passes_geneval_but_not_the_server():
    # GenEval reads the top 1 of 2: 1 >= 1, correct. Server: n = 2 != 1, strict 0;
    # terms [1 - |1 - 2|/1] = [0] -> 0.
    check(score_record(SINGLE, {"bench": [det(0.9), det(0.8)]}), True, 0.0, 0.0)


def test_partial_goes_negative_with_too_many_objects():
    # n = 3: term 1 - |1 - 3|/1 = -1; GenEval still correct (top 1 of 3).
    check(score_record(SINGLE, {"bench": [det(0.9)] * 3}), True, 0.0, -1.0)


def test_max_objects_caps_the_count_at_16():
    # 20 kept by score, 16 by MAX_OBJECTS: term 1 - |1 - 16|/1 = -14.
    check(score_record(SINGLE, {"bench": [det(0.9)] * 20}), True, 0.0, -14.0)


def test_other_classes_do_not_count():
    # A dog is not asked for and not excluded: bench alone decides, as in the first test.
    check(score_record(SINGLE, {"bench": [det(0.9)], "dog": [det(0.99)]}), True, 1.0, 1.0)


def test_detections_below_the_threshold_do_not_count_against_the_exact_count():
    # 0.29 is not kept, so n = 1: server terms [1] -> 1, strict 1.
    check(score_record(SINGLE, {"bench": [det(0.9), det(0.29)]}), True, 1.0, 1.0)


# --- two_object ---------------------------------------------------------------------------


def test_two_object_both_found_at_the_low_threshold():
    # 0.5 and 0.31 both > 0.3 (the 0.9 counting threshold is for counting records only).
    # Terms [1, 1] -> 1.
    found = {"bench": [det(0.5)], "sports ball": [det(0.31)]}
    check(score_record(TWO, found), True, 1.0, 1.0)


def test_two_object_one_missing():
    # Ball: 0 < 1. Terms [bench 1, ball 1 - |1 - 0|/1 = 0] -> 1/2.
    score = score_record(TWO, {"bench": [det(0.9)], "sports ball": [det(0.2)]})
    check(score, False, 0.0, 0.5, "expected sports ball>=1, found 0")


def test_two_object_one_doubled():
    # GenEval: top 1 bench, 1 ball: correct. Server: bench n = 2, term 0; ball term 1 -> 1/2.
    score = score_record(TWO, {"bench": [det(0.9), det(0.8)], "sports ball": [det(0.9)]})
    check(score, True, 0.0, 0.5)


# --- counting -----------------------------------------------------------------------------


def test_counting_exact():
    # Both > 0.9; GenEval: 2 >= 2 and not 2 >= 3; server: n = 2, terms [1] -> 1.
    check(score_record(COUNTING, {"clock": [det(0.95), det(0.91)]}), True, 1.0, 1.0)


def test_counting_uses_the_counting_threshold():
    # 0.85 > 0.3 but not > 0.9: one clock kept. GenEval: 1 < 2. Server: 1 - |2 - 1|/2 = 0.5.
    score = score_record(COUNTING, {"clock": [det(0.95), det(0.85)]})
    check(score, False, 0.0, 0.5, "expected clock>=2, found 1")


def test_counting_score_on_the_counting_threshold_is_not_kept():
    # float32(0.9) > float32(0.9) is false: one clock kept, as above.
    check(score_record(COUNTING, {"clock": [det(0.95), det(0.9)]}), False, 0.0, 0.5)


def test_counting_too_many_fails_the_exclude_clause():
    # 3 kept: include 3 >= 2 holds, exclude 3 >= 3 fails. Server ignores the exclude, but
    # n = 3 != 2: strict 0, terms [1 - |2 - 3|/2] = [0.5].
    score = score_record(COUNTING, {"clock": [det(0.99)] * 3})
    check(score, False, 0.0, 0.5, "expected clock<3, found 3")


def test_counting_far_too_many_goes_negative():
    # 5 kept: term 1 - |2 - 5|/2 = -0.5; GenEval's reason counts all 5.
    score = score_record(COUNTING, {"clock": [det(0.99)] * 5})
    check(score, False, 0.0, -0.5, "expected clock<3, found 5")


def test_counting_exclude_reason_counts_at_most_16():
    # 20 above 0.9, 16 kept: term 1 - |2 - 16|/2 = -6.
    score = score_record(COUNTING, {"clock": [det(0.99)] * 20})
    check(score, False, 0.0, -6.0, "expected clock<3, found 16")


def test_counting_three_asked_one_found():
    # Term 1 - |3 - 1|/3 = 1/3.
    record = {
        "tag": "counting",
        "include": [{"class": "cup", "count": 3}],
        "exclude": [{"class": "cup", "count": 4}],
        "prompt": "a photo of three cups",
    }
    check(score_record(record, {"cup": [det(0.99)]}), False, 0.0, 1 / 3, "expected cup>=3, found 1")


def test_counting_threshold_applies_to_every_class_of_a_counting_record():
    found = {"clock": [det(0.95)], "dog": [det(0.5)]}
    assert [*kept_detections(COUNTING, found)] == ["clock"]  # 0.5 is not > 0.9
    assert sorted(kept_detections(SINGLE, found)) == ["clock", "dog"]  # 0.5 > 0.3


def test_overlapping_boxes_all_count_with_genevals_default_overlap():
    # max_overlap 1.0 turns NMS off: two identical boxes are two clocks, as in the exact test.
    check(score_record(COUNTING, {"clock": [det(0.95, BOX), det(0.94, BOX)]}), True, 1.0, 1.0)


# --- NMS (GenEval's max_overlap option) and the order of the filter ------------------------


def test_nms_drops_a_box_overlapping_a_kept_one():
    # Identical boxes: IoU 1 >= 0.5, the second is dropped: 1 clock. Term 1 - |2 - 1|/2.
    rules = Thresholds(max_overlap=0.5)
    score = score_record(COUNTING, {"clock": [det(0.95), det(0.94)]}, rules)
    check(score, False, 0.0, 0.5, "expected clock>=2, found 1")


def test_nms_iou_counts_the_end_pixel():
    # (0,0,9,9) and (5,0,14,9): with GenEval's +1 each is 10 x 10 = 100, the overlap is
    # (9 - 5 + 1) x 10 = 50, IoU 50 / (100 + 100 - 50) = 1/3 >= 0.3: dropped. Without the +1
    # it would be 4*9 / (81 + 81 - 36) = 0.2857 < 0.3: kept.
    found = {"clock": [det(0.95, (0, 0, 9, 9)), det(0.94, (5, 0, 14, 9))]}
    assert len(kept_detections(COUNTING, found, Thresholds(max_overlap=0.3))["clock"]) == 1
    assert len(kept_detections(COUNTING, found, Thresholds(max_overlap=0.34))["clock"]) == 2


def test_max_objects_applies_before_nms():
    # 16 identical boxes, then a 17th elsewhere at a lower score. The cap keeps the first 16,
    # NMS then keeps one of them: 1. (NMS first would have kept 2.)
    found = {"clock": [det(0.99)] * 16 + [det(0.95, (100, 100, 110, 110))]}
    assert len(kept_detections(COUNTING, found, Thresholds(max_overlap=0.5))["clock"]) == 1


def test_detections_are_ordered_by_score_whatever_order_they_come_in():
    # The red one is given first but scores lower: GenEval reads the blue one (top 1).
    # Server: n = 2 != 1, terms [1 - 1/1 = 0, and 0 for the colour asked] -> 0.
    found = {"fire hydrant": [det(0.5, colour="red"), det(0.9, colour="blue")]}
    assert kept_detections(COLORS, found)["fire hydrant"][0].colour == "blue"
    check(score_record(COLORS, found), True, 0.0, 0.0)


def test_exclude_clauses_are_read_by_geneval_only():
    # A dog is excluded: GenEval fails (1 >= 1); the server never reads exclude: bench term 1.
    record = {**SINGLE, "exclude": [{"class": "dog", "count": 1}]}
    score = score_record(record, {"bench": [det(0.9)], "dog": [det(0.5)]})
    check(score, False, 1.0, 1.0, "expected dog<1, found 1")


# --- colors and color_attr ----------------------------------------------------------------


def test_colors_right_colour():
    # Terms [count 1, colour 1 - |1 - 1|/1 = 1] -> 1.
    check(score_record(COLORS, {"fire hydrant": [det(0.9, colour="blue")]}), True, 1.0, 1.0)


def test_colors_wrong_colour():
    # Terms [1, 1 - |1 - 0|/1 = 0] -> 0.5.
    score = score_record(COLORS, {"fire hydrant": [det(0.9, colour="red")]})
    check(score, False, 0.0, 0.5, "expected blue fire hydrant>=1, found 0 blue; and 1 red")


def test_colors_object_missing():
    # Terms [1 - |1 - 0|/1 = 0, and 0 for the colour asked of a wrong count] -> 0.
    score = score_record(COLORS, {})
    check(score, False, 0.0, 0.0, "expected fire hydrant>=1, found 0")


def test_colors_only_the_most_confident_is_read_by_geneval():
    # Top is red: GenEval fails on it though a blue one follows. Server: n = 2, [0, 0] -> 0.
    found = {"fire hydrant": [det(0.9, colour="red"), det(0.8, colour="blue")]}
    score = score_record(COLORS, found)
    check(score, False, 0.0, 0.0, "expected blue fire hydrant>=1, found 0 blue; and 1 red")


def test_colour_tally_follows_genevals_colour_order():
    # 2 red cars asked, blue and red found: 1 red < 2. The tally lists red before blue
    # (COLOURS order), not in detection order. Server: n = 2, colour 1 - |2 - 1|/2 = 0.5;
    # terms [1, 0.5] -> 0.75.
    record = {
        "tag": "colors",
        "include": [{"class": "car", "count": 2, "color": "red"}],
        "prompt": "two red cars",
    }
    score = score_record(record, {"car": [det(0.9, colour="blue"), det(0.8, colour="red")]})
    check(score, False, 0.0, 0.75, "expected red car>=2, found 1 red; and 1 red, 1 blue")


def test_color_attr_both_right():
    found = {"wine glass": [det(0.9, colour="purple")], "apple": [det(0.9, colour="black")]}
    # Terms [1, 1, 1, 1] -> 1.
    check(score_record(COLOR_ATTR, found), True, 1.0, 1.0)


def test_color_attr_one_colour_wrong():
    found = {"wine glass": [det(0.9, colour="purple")], "apple": [det(0.9, colour="red")]}
    # Terms [1, 1, 1, 0] -> 0.75.
    score = score_record(COLOR_ATTR, found)
    check(score, False, 0.0, 0.75, "expected black apple>=1, found 0 black; and 1 red")


def test_color_attr_one_object_missing():
    # Terms [1, 1, apple 0, and 0 for its colour] -> 0.5.
    score = score_record(COLOR_ATTR, {"wine glass": [det(0.9, colour="purple")]})
    check(score, False, 0.0, 0.5, "expected apple>=1, found 0")


def test_colour_requests_name_the_coloured_classes():
    assert colour_requests(COLORS) == {"fire hydrant"}
    assert colour_requests(COLOR_ATTR) == {"wine glass", "apple"}
    assert colour_requests(POSITION) == frozenset()
    assert colour_requests(COUNTING) == frozenset()


def test_a_read_detection_without_a_colour_is_an_error_naming_its_class():
    with pytest.raises(ValueError, match="'fire hydrant'"):
        score_record(COLORS, {"fire hydrant": [det(0.9)]})


def test_an_unread_detection_may_lack_a_colour():
    # The 0.2 one is not kept, so its colour is never read: terms [1, 1] -> 1.
    found = {"fire hydrant": [det(0.9, colour="blue"), det(0.2)]}
    check(score_record(COLORS, found), True, 1.0, 1.0)


# --- position -----------------------------------------------------------------------------
# The bear is (0,0,10,10): centre (5,5), size 10 x 10. A 10 x 10 dog: the margin on each axis
# is 0.1 * (10 + 10) = 2. revised = sign(o) * max(|o| - 2, 0) per axis of the centre offset o;
# a relation holds where revised / |o| passes +-0.5 (x: left/right, y: above/below, y down).

BEAR = [det(0.9, (0, 0, 10, 10))]


def relation_record(relation: str) -> dict:
    include = [
        dict(POSITION["include"][0]),
        {"class": "dog", "count": 1, "position": [relation, 0]},
    ]
    return {**POSITION, "include": include}


@pytest.mark.parametrize(
    ("relation", "dog_box"),
    [
        # o = (30, 0): revised (28, 0) / 30 -> x 0.93 > 0.5
        ("right of", (30, 0, 40, 10)),
        # o = (-30, 0): x -0.93 < -0.5
        ("left of", (-30, 0, -20, 10)),
        # o = (0, -30): y -0.93 < -0.5
        ("above", (0, -30, 10, -20)),
        # o = (0, 30): y 0.93 > 0.5
        ("below", (0, 30, 10, 40)),
    ],
)
def test_each_relation_holds(relation, dog_box):
    # Terms [bear 1, dog 1, position 1] -> 1.
    check(
        score_record(relation_record(relation), {"teddy bear": BEAR, "dog": [det(0.9, dog_box)]}),
        True,
        1.0,
        1.0,
    )


@pytest.mark.parametrize(
    ("relation", "dog_box", "shown"),
    [
        ("right of", (-30, 0, -20, 10), "left of"),
        ("left of", (30, 0, 40, 10), "right of"),
        ("above", (0, 30, 10, 40), "below"),
        ("below", (0, -30, 10, -20), "above"),
    ],
)
def test_each_relation_fails_the_other_way(relation, dog_box, shown):
    # The failed position adds 0 and then 1: terms [1, 1, 0, 1] -> 0.75.
    score = score_record(
        relation_record(relation), {"teddy bear": BEAR, "dog": [det(0.9, dog_box)]}
    )
    check(score, False, 0.0, 0.75, f"expected dog {relation} target, found {shown} target")


def test_position_margin_edge():
    # o = (4, 0): revised 4 - 2 = 2, x = 2/4 = 0.5, not > 0.5: no relation at all, and the
    # reason joins an empty set ("found  target", two spaces). Terms [1, 1, 0, 1] -> 0.75.
    near = {"teddy bear": BEAR, "dog": [det(0.9, (4, 0, 14, 10))]}
    check(
        score_record(POSITION, near),
        False,
        0.0,
        0.75,
        "expected dog right of target, found  target",
    )
    # o = (5, 0): revised 3, x = 3/5 = 0.6 > 0.5: right of.
    check(
        score_record(POSITION, {"teddy bear": BEAR, "dog": [det(0.9, (5, 0, 15, 10))]}),
        True,
        1.0,
        1.0,
    )
    # Without the margin, o = (4, 0) gives x = 4/4 = 1: right of.
    check(score_record(POSITION, near, Thresholds(position=0.0)), True, 1.0, 1.0)


def test_position_inside_the_margin_has_no_relation():
    # o = (2, 0): revised max(2 - 2, 0) = 0 on both axes (< 1e-3): no relation.
    score = score_record(POSITION, {"teddy bear": BEAR, "dog": [det(0.9, (2, 0, 12, 10))]})
    check(score, False, 0.0, 0.75, "expected dog right of target, found  target")


def test_position_diagonal_edge():
    # o = (12, 15): revised (10, 13), |o| = sqrt(144 + 225) = 19.209; x = 0.5206 > 0.5 and
    # y = 0.677: right of and below. Terms [1, 1, 1] -> 1.
    holds = {"teddy bear": BEAR, "dog": [det(0.9, (12, 15, 22, 25))]}
    check(score_record(POSITION, holds), True, 1.0, 1.0)
    # o = (12, 17): revised (10, 15), |o| = sqrt(144 + 289) = 20.809; x = 0.4806, y = 0.721:
    # below only. Terms [1, 1, 0, 1] -> 0.75.
    fails = {"teddy bear": BEAR, "dog": [det(0.9, (12, 17, 22, 27))]}
    check(
        score_record(POSITION, fails),
        False,
        0.0,
        0.75,
        "expected dog right of target, found below target",
    )
    # Asked "left of" at o = (12, 15): the reason lists both relations in GenEval's order.
    score = score_record(relation_record("left of"), holds)
    assert score.reason == "expected dog left of target, found right of and below target"


def test_position_of_coincident_boxes_is_no_relation_and_no_division_by_zero():
    # o = (0, 0): revised (0, 0), caught before dividing by |o| = 0. Terms [1, 1, 0, 1] -> 0.75.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score = score_record(POSITION, {"teddy bear": BEAR, "dog": [det(0.9, (0, 0, 10, 10))]})
    check(score, False, 0.0, 0.75, "expected dog right of target, found  target")


def test_a_held_position_adds_a_term_of_1():
    # A third clause, a cat, is missing. Held position: terms [bear 1, dog 1, position 1,
    # cat 0] -> 3/4 (without the position term it would be 2/3). Failed position: terms
    # [1, 1, 0, 1, 0] -> 3/5.
    record = {**POSITION, "include": [*POSITION["include"], {"class": "cat", "count": 1}]}
    right = {"teddy bear": BEAR, "dog": [det(0.9, (30, 0, 40, 10))]}
    check(score_record(record, right), False, 0.0, 3 / 4, "expected cat>=1, found 0")
    left = {"teddy bear": BEAR, "dog": [det(0.9, (-30, 0, -20, 10))]}
    check(score_record(record, left), False, 0.0, 3 / 5)


def test_position_without_a_target():
    # No bear: clause 0 fails, so clause 1 has no target. Server terms
    # [bear 1 - |1 - 0|/1 = 0, dog 1, no target 0] -> 1/3.
    score = score_record(POSITION, {"dog": [det(0.9, (30, 0, 40, 10))]})
    reason = "expected teddy bear>=1, found 0\nno target for dog to be right of"
    check(score, False, 0.0, 1 / 3, reason)


def test_position_reads_only_the_most_confident_dog_in_geneval():
    # Top dog is right of the bear, the second left of it. GenEval reads the top one: correct.
    # Server: dog n = 2: terms [bear 1, dog 1 - |1 - 2|/1 = 0, 0 for the position of a wrong
    # count] -> 1/3.
    dogs = [det(0.9, (30, 0, 40, 10)), det(0.8, (-30, 0, -20, 10))]
    check(score_record(POSITION, {"teddy bear": BEAR, "dog": dogs}), True, 0.0, 1 / 3)


def test_position_reads_only_the_most_confident_target_in_geneval():
    # Two bears, the second right of the dog. GenEval's target group is the top bear: correct.
    # Server: bear n = 2, term 0, clause unmatched; dog term 1; no target 0 -> [0, 1, 0] = 1/3.
    bears = [det(0.9, (0, 0, 10, 10)), det(0.8, (50, 0, 60, 10))]
    found = {"teddy bear": bears, "dog": [det(0.9, (30, 0, 40, 10))]}
    check(score_record(POSITION, found), True, 0.0, 1 / 3)


# --- records from user files --------------------------------------------------------------


@pytest.mark.parametrize(
    ("record", "named"),
    [
        ({**SINGLE, "tag": "counts"}, "'tag' 'counts'"),
        ({"tag": "single_object", "prompt": "x"}, "missing key 'include'"),
        ({"include": SINGLE["include"], "prompt": "x"}, "missing key 'tag'"),
        ({**SINGLE, "include": []}, "'include' is empty"),
        ({**SINGLE, "include": [{"class": "sofa", "count": 1}]}, "include[0].class 'sofa'"),
        ({**SINGLE, "include": [{"class": "bench"}]}, "include[0]: missing key 'count'"),
        ({**SINGLE, "include": [{"class": "bench", "count": 0}]}, "include[0].count"),
        ({**SINGLE, "include": [{"class": "bench", "count": "2"}]}, "include[0].count"),
        ({**COLORS, "include": [{"class": "car", "count": 1, "colour": "red"}]}, "'colour'"),
        ({**COLORS, "include": [{"class": "car", "count": 1, "color": "violet"}]}, "'violet'"),
        ({**SINGLE, "exclude": [{"class": "dog"}]}, "exclude[0]: missing key 'count'"),
        (
            {**POSITION, "include": [POSITION["include"][1], POSITION["include"][0]]},
            "include[0].position target 0",
        ),
        (
            {
                **POSITION,
                "include": [
                    POSITION["include"][0],
                    {"class": "dog", "count": 1, "position": ["beside", 0]},
                ],
            },
            "include[1].position relation 'beside'",
        ),
    ],
)
def test_a_bad_record_is_an_error_naming_the_key(record, named):
    with pytest.raises(FlowGrpoError) as caught:
        score_record(record, {})
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)
    with pytest.raises(FlowGrpoError):
        colour_requests(record)


def test_detections_of_an_unknown_class_or_colour_are_errors():
    with pytest.raises(ValueError, match="'sofa'"):
        score_record(SINGLE, {"sofa": [det(0.9)]})
    with pytest.raises(ValueError, match="'violet'"):
        det(0.9, colour="violet")
