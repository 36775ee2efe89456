"""GSM8K scorer: hand-computed cases against verl's semantics."""

import pytest

from hybridflow.rewards import get_scorer
from hybridflow.rewards.gsm8k import _SOLUTION_CLIP_CHARS, compute_score, extract_ground_truth, extract_solution


@pytest.mark.parametrize("text, expected", [
    ("so the answer is\n#### 72", "72"),
    ("#### 1,234", "1234"),                      # commas stripped
    ("#### -7 degrees", "-7"),                    # negative
    ("#### 3.50", "3.50"),                        # kept as written: exact string match later
    ("first #### 10 then #### 12", "12"),         # the LAST marker wins
    ("#### $45", None),                           # "$" is not in the number class: no match
    ("####45", None),                             # the space after #### is required
    ("the answer is 72", None),                   # no marker
    ("", None),
    ("#### .", "."),                              # verl accepts any run of digits/./,
])
def test_strict(text, expected):
    assert extract_solution(text, "strict") == expected


@pytest.mark.parametrize("text, expected", [
    ("I think it is 72.", "72."),                 # the trailing period is part of the run
    ("1,234 apples and then 56", "56"),           # last number
    ("costs 1,234", "1,234"),                     # flexible keeps commas
    ("it drops to -7", "-7"),
    ("#### 5\nDone.", "5"),                       # a lone "." is skipped
    ("no digits here", None),
    ("Hello, world.", ","),                       # verl quirk: "," is not in the invalid list
    ("Done.", "."),                               # verl quirk: all invalid -> first candidate stays
])
def test_flexible(text, expected):
    assert extract_solution(text, "flexible") == expected


def test_clip_to_last_300_chars():
    tail = "x" * (_SOLUTION_CLIP_CHARS - len("#### 9"))
    # the marker sits just before the clipped tail: invisible to both modes
    assert extract_solution("#### 5" + "y" * _SOLUTION_CLIP_CHARS, "strict") is None
    assert extract_solution("answer 5 " + "y" * _SOLUTION_CLIP_CHARS, "flexible") is None
    # exactly 300 chars ending in the marker: still seen
    text = "#### 9" + tail
    assert len(text) == _SOLUTION_CLIP_CHARS and extract_solution(text, "strict") == "9"
    # one more char at the end pushes the first '#' out of the clip: "### 9" no longer matches
    assert extract_solution(text + "z", "strict") is None
    assert extract_solution(text + "z", "flexible") == "9"  # the bare number is still inside
    # an earlier answer outside the clip does not mask a later one inside it
    assert extract_solution("#### 1" + "y" * 400 + " #### 2", "strict") == "2"


def test_compute_score():
    assert compute_score("#### 72", "72") == 1.0
    assert compute_score("#### 71", "72") == 0.0
    assert compute_score("#### 71", "72", format_score=0.1) == 0.1
    assert compute_score("no answer", "72", format_score=0.1) == 0.0     # no answer -> 0, not format_score
    assert compute_score("#### 72", "72", score=2.0) == 2.0
    assert compute_score("#### 1,000", "1000") == 1.0
    assert compute_score("it is 72", "72") == 0.0                        # strict needs the marker
    assert compute_score("it is 72", "72", method="flexible") == 1.0
    assert compute_score("it is 72.", "72", method="flexible") == 0.0   # "72." != "72", as in verl
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        extract_solution("#### 1", "loose")


def test_registered_scorers():
    strict, flexible = get_scorer("gsm8k"), get_scorer("gsm8k_flexible")
    assert strict("so #### 18", "18") == 1.0 and strict("so 18", "18") == 0.0
    assert flexible("so 18", "18") == 1.0 and flexible("so 17", "18") == 0.0


def test_ground_truth_from_answer_field():
    assert extract_ground_truth("3 + 4 = <<3+4=7>>7\n#### 7") == "7"
    assert extract_ground_truth("...\n#### 1,200") == "1200"
    assert extract_ground_truth("...\n#### -3") == "-3"
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        extract_ground_truth("the answer is 7")
