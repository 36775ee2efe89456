"""The experiment config's reward sections: the rule scorer, the overlong penalty, a custom reward function and a reward model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.config.checks import check_numbers, check_sizes
from hybridflow.config.scoring import SandboxFusion


@dataclass
class OverlongBuffer:
    """DAPO's overlong reward shaping (verl 0.9.1's DAPO reward manager, reward_kwargs.overlong_buffer_cfg): a
    response within the last ``len`` tokens of data.max_response_length loses up to ``penalty_factor``, linearly."""

    enable: bool = False
    len: int = 0  # the buffer's width in tokens (must be in 1 .. data.max_response_length when enabled)
    penalty_factor: float = 1.0
    log: bool = False  # log the penalty per step

    def validate(self):
        if self.enable and self.len < 1:
            raise ValueError("reward.overlong_buffer.len must be >= 1 when enable is true")
        check_numbers(self, penalty_factor=dict(ge=0))


@dataclass
class Reward:
    # The rule scorer for rows without a data.reward_fn_key column (or with the quickstart's "arithmetic"
    # source); rows naming a known source (openai/gsm8k, the MATH sources, math_dapo, ...) are routed to its
    # scorer as verl's default scorer does (rewards/routing.py).
    name: str = "arithmetic"
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)
    # naive: one row after another; prime: verl's PrimeRewardManager, rows scored concurrently and a row whose
    # scorer raises or runs past 300 s scores 0 (rewards/routing.py). (verl's dapo: naive + overlong_buffer)
    manager: Literal["naive", "prime"] = "naive"
    sandbox_fusion: SandboxFusion = field(default_factory=SandboxFusion)  # a remote sandbox scoring code answers



@dataclass
class CustomReward:
    """A user reward function (verl's signature: fn(data_source, solution_str, ground_truth, extra_info))."""

    path: str | None = None  # python file; when set it scores every row (training and validation), as in verl
    name: str = "compute_score"  # function in that file
    # Seconds one call may take; a call that takes longer ends the run naming the function and the row
    # (the function runs on a helper thread, as verl's reward loop runs it in an executor).
    timeout_s: float = 60.0

    def validate(self):
        check_numbers(self, timeout_s=dict(gt=0))


@dataclass
class RewardModel:
    """A learned reward model: a HF AutoModelForSequenceClassification (one logit) scoring prompt+response."""

    enable: bool = False
    path: str | None = None  # HF folder (config, weights, tokenizer)
    micro_batch_size: int = 16
    max_length: int = 512  # tokens of prompt+response as the reward model tokenizes them
    # Its weights' dtype on the worker's device (its GPU share, or the CPU).
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    def validate(self):
        check_sizes(self, "micro_batch_size", "max_length")
        if self.enable and not self.path:
            raise ValueError("path is required when enable is true")
