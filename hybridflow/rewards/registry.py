"""Scorers map (response text, ground truth) -> float; the batch helper places each score on the
last response token, which is where outcome rewards live in PPO."""

from __future__ import annotations

from typing import Callable

import torch

from hybridflow.registry import Registry

SCORERS = Registry("reward scorer")  # name -> fn(response text, ground truth) -> float
register_scorer = SCORERS.register


def get_scorer(name: str) -> Callable[[str, str], float]:
    return SCORERS.get(name)


def score_batch(scorer, texts: list[str], answers, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sequence scores [b], token-level scores [b, R] with each score on the last valid token)."""
    scores = torch.tensor([float(scorer(t, str(a))) for t, a in zip(texts, answers)], dtype=torch.float32)
    return scores, on_last_token(scores, response_mask)


def on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level [b, R] tensor holding each sequence score on its last valid response token (empty responses
    get none). With gaps in the mask (a multi-turn response's tool tokens) that is the last sampled token: verl
    0.9.1 puts it on the last token of the response, which is the same one unless tool messages end the
    trajectory (then verl rewards a token the loss never sees)."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    valid = response_mask.bool()
    width = response_mask.shape[-1]
    last = width - 1 - valid.flip(-1).long().argmax(-1)  # the last 1 in each row
    rows = torch.nonzero(valid.any(-1)).flatten()
    token_scores[rows, last[rows]] = scores[rows].float()
    return token_scores
