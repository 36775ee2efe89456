"""GSM8K rule scorer, behaviour-identical to verl's ``verl/utils/reward_score/gsm8k.py``.

Users migrate reward curves from verl, so quirks are kept on purpose (noted where they occur).
"""

from __future__ import annotations

import re

from hybridflow.rewards.registry import register_scorer

# Only the tail is searched: regexes on long generations are slow and the final answer is at the end.
_SOLUTION_CLIP_CHARS = 300

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_RE = re.compile(r"(\-?[0-9\.\,]+)")
_INVALID_FLEXIBLE = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The model's final answer, or None when there is none.

    strict: the last ``#### <number>``, commas and ``$`` removed (also checks the output format).
    flexible: the last number-like run that is not ``"."`` (commas kept, as in verl).
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if len(solution_str) > _SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-_SOLUTION_CLIP_CHARS:]

    if method == "strict":
        solutions = _STRICT_RE.findall(solution_str)
        if not solutions:
            return None
        return solutions[-1].replace(",", "").replace("$", "")

    candidates = _NUMBER_RE.findall(solution_str)
    if not candidates:
        return None
    for final_answer in reversed(candidates):
        if final_answer not in _INVALID_FLEXIBLE:
            return final_answer
    # verl quirk: when every candidate is invalid its loop variable ends on the first one ("."),
    # which then scores format_score rather than 0.
    return candidates[0]


def compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """0 without an extractable answer, ``score`` on an exact string match, else ``format_score``."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


@register_scorer("gsm8k")
def gsm8k_strict(response: str, ground_truth: str) -> float:
    return compute_score(response, ground_truth, method="strict")


@register_scorer("gsm8k_flexible")
def gsm8k_flexible(response: str, ground_truth: str) -> float:
    return compute_score(response, ground_truth, method="flexible")


def extract_ground_truth(answer_field: str) -> str:
    """The number after ``#### `` in a GSM8K ``answer`` field, commas removed (verl's preprocessing:
    first match, ``$`` kept)."""
    match = _STRICT_RE.search(answer_field)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer_field[-80:]!r}")
    return match.group(1).replace(",", "")
