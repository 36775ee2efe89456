"""Recorded agent episodes (agent/sessions.py) as training rows in verl's layout, one row per episode.

A row is the episode's last segment: its first request's rendered prompt (left-padded to
``data.max_prompt_length``), then every token after it, sampled (``response_mask`` 1, with vLLM's log-prob and
the policy version that sampled it) or added by the conversation (tool and user messages: 0), cut at
``data.max_response_length``. The reward is the one the program returned or posted (``episode_reward``; NaN: the
run's reward function scores the text). Earlier segments (the harness rewrote its history) are counted, not
trained: a group's rows must be the episodes, one each. An episode that failed, timed out, sampled nothing or
whose prompt is longer than the limit keeps its row, with no response and a group of its own (``uid`` suffixed),
so it moves no gradient and no group's statistics.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hybridflow.agent.episodes import Outcome
from hybridflow.agent.sessions import Segment, Session
from hybridflow.protocol import Batch


def drop_reason(session: Session | None, outcome: Outcome, max_prompt_length: int) -> str | None:
    """Why an episode trains nothing (None: it trains)."""
    if not outcome.ok:
        return "timeout" if outcome.error == "timeout" else "failed"
    if session is None or not session.segments or not any(session.segments[-1].sampled):
        return "no_requests"
    if session.segments[-1].prompt_length > max_prompt_length:
        return "prompt_too_long"
    return None


def episode_reward(session: Session | None, outcome: Outcome) -> float:
    """The reward the program returned, else the one it posted, else NaN."""
    if outcome.reward is not None:
        return outcome.reward
    return session.reward if session is not None and session.reward is not None else math.nan


def _left_padded(prompts: list[list[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids, mask


def _responses(segments: list[Segment | None], width: int, pad_id: int) -> dict:
    n = len(segments)
    resp = torch.full((n, width), pad_id, dtype=torch.long)
    sampled, real = torch.zeros((n, width), dtype=torch.long), torch.zeros((n, width), dtype=torch.long)
    log_probs, versions = torch.zeros((n, width)), torch.full((n, width), -1, dtype=torch.long)
    for i, seg in enumerate(segments):
        if seg is None:
            continue
        start, k = seg.prompt_length, min(len(seg.ids) - seg.prompt_length, width)
        resp[i, :k] = torch.tensor(seg.ids[start:start + k], dtype=torch.long)
        sampled[i, :k] = torch.tensor(seg.sampled[start:start + k], dtype=torch.long)
        real[i, :k] = 1
        log_probs[i, :k] = torch.tensor(seg.log_probs[start:start + k])
        versions[i, :k] = torch.tensor(seg.versions[start:start + k], dtype=torch.long)
    return {"responses": resp, "response_mask": sampled, "real": real, "rollout_log_probs": log_probs,
            "token_policy_versions": versions}


def episode_batch(rows: Batch, sessions: list[Session | None], outcomes: list[Outcome], max_prompt_length: int,
                  max_response_length: int, pad_id: int) -> tuple[Batch, dict]:
    """The training rows of ``rows``' episodes (``rows``: the prompt rows they ran for, with their ``uid``s) and
    the episodes' counts."""
    reasons = [drop_reason(s, o, max_prompt_length) for s, o in zip(sessions, outcomes)]
    segments = [None if r else s.segments[-1] for s, r in zip(sessions, reasons)]
    ids, mask = _left_padded([seg.ids[:seg.prompt_length] if seg else [] for seg in segments], max_prompt_length,
                             pad_id)
    dropped = torch.tensor([r is not None for r in reasons], dtype=torch.bool)
    ids[dropped], mask[dropped] = rows.tensors["input_ids"][dropped], rows.tensors["attention_mask"][dropped]
    out = _responses(segments, max_response_length, pad_id)
    attention = torch.cat([mask, out.pop("real")], dim=1)
    rewards = torch.tensor([episode_reward(s, o) if r is None else math.nan
                            for s, o, r in zip(sessions, outcomes, reasons)], dtype=torch.float32)
    tensors = {"prompts": ids, "input_ids": torch.cat([ids, out["responses"]], dim=1), "attention_mask": attention,
               "position_ids": (attention.cumsum(-1) - 1).clamp(min=0), "episode_reward": rewards, **out}
    non_tensors = {}
    if "uid" in rows.non_tensors:
        uids = np.array(rows.non_tensors["uid"], dtype=object)
        for i in np.flatnonzero(dropped.numpy()):
            uids[i] = f"{uids[i]}/dropped{i}"
        non_tensors["uid"] = uids
    counts = {f"agent/episodes_{r}": float(reasons.count(r)) for r in ("failed", "timeout", "no_requests",
                                                                        "prompt_too_long")}
    counts["agent/rewrites"] = float(sum(s.rewrites for s in sessions if s is not None))
    counts["agent/reward_from_program"] = float(sum(not math.isnan(r) for r in rewards.tolist()))
    return rows.replace(tensors=tensors, non_tensors=non_tensors), counts
