"""Exact-match scorer for the arithmetic task: the response must be the number, nothing else."""

from __future__ import annotations

from hybridflow.rewards.registry import register_scorer


@register_scorer("arithmetic")
def arithmetic_score(response: str, answer: str) -> float:
    """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0


@register_scorer("multiplication")
def final_answer_score(response: str, answer: str) -> float:
    """The tools quickstart's scorer: 1.0 when the response's last line (the final assistant turn: a multi-turn
    response's turns are joined by newlines, trainer/experience.py sampled_text) is exactly the answer."""
    lines = [line.strip() for line in response.strip().splitlines()]
    return 1.0 if lines and lines[-1] == answer.strip() else 0.0
