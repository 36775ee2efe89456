"""Priority-filtered PPO (verl 0.9.1 ``algorithm.use_pf_ppo``, core_algos.compute_pf_ppo_reweight_data): after the
GAE advantages, the batch is resampled with replacement, each row drawn with a weight from its sequence score, so
the update sees high-|score| (``pow``), extreme (``max_min``) or best (``max_random``) rows more often."""

from __future__ import annotations

import torch

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str, weight_pow: float) -> torch.Tensor:
    """Each row's sampling weight from its sequence score [b]: |score|^weight_pow (``pow``), 1 at the batch's
    highest and lowest score else 0 (``max_min``), 0.4 at the highest else 0.1 (``max_random``); every weight at
    least 1e-8 after adding it, as verl's."""
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.full_like(scores, 0.1).masked_fill(scores == scores.max(), 0.4)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method must be one of {', '.join(PF_PPO_METHODS)}, got {method!r}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_rows(token_level_scores: torch.Tensor, method: str, weight_pow: float,
                generator: torch.Generator) -> torch.Tensor:
    """The rows [b] of the resampled batch: as many draws with replacement as the batch has rows, weighted by
    ``pf_ppo_weights`` of each row's summed token-level scores. ``generator``: the draw's own stream (verl draws
    from torch's global one; here a step's draw is the same on a resumed run)."""
    weights = pf_ppo_weights(token_level_scores.sum(dim=-1), method, weight_pow)
    return torch.multinomial(weights, len(weights), replacement=True, generator=generator)
