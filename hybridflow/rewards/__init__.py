"""Reward scoring: rule-based scorers registered by name, routed per row by data source, and turning scores
into token rewards."""

from hybridflow.rewards.registry import get_scorer, on_last_token, register_scorer, score_batch  # noqa: F401
from hybridflow.rewards import arithmetic  # noqa: F401  (registers "arithmetic")
from hybridflow.rewards import gsm8k  # noqa: F401,E402  (registers "gsm8k", "gsm8k_flexible")
from hybridflow.rewards import math_dapo, math_equiv  # noqa: F401,E402  (registers "math_dapo", "math_verify")
from hybridflow.rewards.routing import SourceRouter  # noqa: F401,E402
