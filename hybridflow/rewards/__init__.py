"""Reward scoring: rule-based scorers registered by name, and turning scores into token rewards."""

from hybridflow.rewards.registry import get_scorer, register_scorer, score_batch  # noqa: F401
from hybridflow.rewards import arithmetic  # noqa: F401  (registers "arithmetic")
