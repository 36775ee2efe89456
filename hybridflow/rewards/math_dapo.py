# Adapted from verl 0.9.1 verl/utils/reward_score/math_dapo.py (Copyright 2024 Bytedance Ltd. and/or its
# affiliates; Copyright 2022 EleutherAI and the HuggingFace Inc. team), itself adapted from
# lm-evaluation-harness lm_eval/tasks/hendrycks_math/utils.py. Licensed under the Apache License 2.0.
"""DAPO's math scorer, behaviour-identical to verl's ``math_dapo``: the last ``Answer: ...`` line
(Minerva normalization), else the last ``\\boxed{}`` in the final 100 characters, against the ground truth;
+1.0 when correct, -1.0 otherwise (no 0: a wrong or missing answer is penalised alike)."""

from __future__ import annotations

import re

from hybridflow.rewards.registry import register_scorer


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` (balanced braces) in ``string``, or None."""
    idx = string.rfind("\\boxed{")
    if idx < 0:
        return None
    depth = 0
    for i in range(idx, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[idx:i + 1]
    return None


def remove_boxed(s: str) -> str:
    left = "\\boxed{"
    if not (s.startswith(left) and s.endswith("}")):
        raise ValueError(f"box error: {s}")
    return s[len(left):-1]


SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]

REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalization of a final answer (verl's, unchanged)."""
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(solution_str: str, gt: str, answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)"):
    """(correct, normalized prediction); the prediction is "[INVALID]" without an ``Answer:`` line."""
    match = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(match[-1] if match else "[INVALID]")
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(pred: str, gt: str):
    """(1 or -1, the last boxed answer in the final 100 characters or None)."""
    boxed = last_boxed_only_string(pred[-100:])
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False):
    """(correct, prediction): Minerva ``Answer:`` first, the ``\\boxed{}`` fallback unless strict."""
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer)
        return correct == 1, pred
    correct, pred = is_correct_minerva(solution_str, answer)
    if pred != "[INVALID]":
        return correct, pred
    box_correct, box_pred = is_correct_strict_box(solution_str, answer)
    if box_pred is not None:
        return box_correct == 1, box_pred
    return correct, pred


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> dict:
    """verl's result: {"score": +1.0 | -1.0, "acc": bool, "pred": the extracted answer}."""
    solution_str = solution_str[-300:]  # the longest answer in MATH-500 has 159 characters (verl's note)
    correct, pred = verify(solution_str, ground_truth, strict_box_verify)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@register_scorer("math_dapo")
def math_dapo_score(response: str, ground_truth: str) -> float:
    return compute_score(response, ground_truth)["score"]
