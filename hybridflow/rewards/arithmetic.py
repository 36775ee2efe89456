"""Exact-match scorer for the arithmetic task: the response must be the number, nothing else."""

from __future__ import annotations

from hybridflow.rewards.registry import register_scorer


@register_scorer("arithmetic")
def arithmetic_score(response: str, answer: str) -> float:
    """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer.strip() else 0.0
