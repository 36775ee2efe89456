"""DAPO's overlong reward shaping (https://arxiv.org/abs/2503.14476, "soft overlong punishment"), as verl 0.9.1's
DAPO reward manager computes it (``workers/reward_manager/dapo.py`` and
``experimental/reward_loop/reward_manager/dapo.py``): a response whose length L enters the last ``buffer_len``
tokens before ``max_resp_len`` loses reward linearly,

    penalty = min(-(L - (max_resp_len - buffer_len)) / buffer_len * penalty_factor, 0)

so a response of exactly ``max_resp_len - buffer_len`` tokens loses nothing and one of ``max_resp_len`` tokens
loses ``penalty_factor``. L counts the response's tokens, EOS included (verl's attention-mask sum over the
response). As verl, the penalty is added to rule/custom scores only: a reward model's score is used unchanged.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """The penalty (<= 0) of responses of ``lengths`` tokens, float32 [b]."""
    if not 0 < buffer_len <= max_resp_len:  # verl asserts both
        raise ValueError(f"reward.overlong_buffer.len ({buffer_len}) must be in 1 .. data.max_response_length "
                         f"({max_resp_len})")
    expected_len = max_resp_len - buffer_len
    exceed = lengths.to(torch.float32) - expected_len
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
