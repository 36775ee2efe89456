"""Rewards of agent episodes (agent.entrypoint): the reward the agent program returned or posted to ``/rl/reward``
(a row's ``episode_reward``), else -- the program left it to the run (NaN) -- the run's scorer's of the episode's
sampled text, as for any row."""

from __future__ import annotations

import torch

from hybridflow.protocol import Batch
from hybridflow.rewards.registry import on_last_token


class EpisodeRewards:
    """``inner``: the run's scorer (a SourceRouter or custom reward function), for rows without a program's reward
    and for rows not from episodes."""

    def __init__(self, inner):
        self.inner = inner

    @staticmethod
    def apply(scored: Batch) -> Batch:
        """``scored`` (scored by ``inner``) with each episode's own reward where it has one."""
        reward = scored.tensors.get("episode_reward")
        if reward is None:
            return scored
        scores = torch.where(torch.isnan(reward), scored.tensors["scores"], reward)
        return scored.replace(tensors={"scores": scores,
                                       "token_level_scores": on_last_token(scores, scored.tensors["response_mask"])})
