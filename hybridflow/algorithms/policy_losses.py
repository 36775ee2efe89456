"""verl 0.9.1's policy losses beyond ``vanilla`` (``trainer/ppo/core_algos.py``), by verl's names, settings
and numbers: ``gspo``, ``sapo``, ``gpg``, ``geo_mean``, ``dro``, ``cispo``, ``dppo_tv``, ``dppo_kl``
(``clip_cov``/``kl_cov``: :mod:`.policy_losses_cov`), and ``reinforce`` (``compute_policy_loss_reinforce``, which
verl calls from its ``bypass_mode`` loss).

The signature, the settings they read and what they return: :mod:`.policy_loss`. Each normalizes over the
whole mini-batch through ``global_batch`` (:func:`aggregate_loss`), so its gradient does not depend on how
the mini-batch is split into micro-batches and data-parallel ranks; sequence-level quantities (GSPO's and
GMPO's ratios) are per row, and a row is a whole sequence in every micro-batch. Rollout correction's IS
weights (``rollout_is_weights``) multiply the per-token losses before aggregation, as verl (``geo_mean``: their
per-sequence geometric mean multiplies the sequence's loss).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from .aggregation import GlobalBatch, aggregate_loss
from .masked import _as_mask, masked_mean, masked_sum
from .policy_loss import (actor_settings, clamped_log_ratio, clip_range, policy_loss_setting, setting, weighted,
                          zero_metric)
from .registry import register_policy_loss

Tensor = torch.Tensor
Result = Tuple[Tensor, Dict[str, Tensor]]


def _metrics(pg_clipfrac: Tensor, ppo_kl: Tensor, pg_clipfrac_lower: Tensor) -> Dict[str, Tensor]:
    return {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach(),
            "pg_clipfrac_lower": pg_clipfrac_lower.detach()}


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                             loss_agg_mode: str = "token-mean", config: Any = None,
                             global_batch: GlobalBatch | None = None,
                             rollout_is_weights: Tensor | None = None) -> Result:
    """GSPO (https://arxiv.org/abs/2507.18071): PPO clipping of the sequence-level ratio
    ``s_i = exp(mean over the row's valid tokens of log(pi/pi_old))``, with verl's token-level form
    ``s_i,t = sg[s_i] * pi_t / sg[pi_t]`` (value ``s_i``, gradient ``s_i * grad log pi_t``).

    As verl 0.9.1: the log-ratio is clamped at ``max=10`` only after forming ``s_i,t`` (no +-20 clamp), and
    the loss is aggregated with ``loss_agg_mode`` (the paper aggregates per sequence,
    ``seq-mean-token-mean``; verl's function default is that, but its actor always passes
    ``actor.loss_agg_mode``, default ``token-mean``). ``pg_clipfrac_lower`` is always 0.
    """
    config = actor_settings(config)
    low, high = clip_range(config)
    mask = _as_mask(response_mask, log_prob)
    negative_approx_kl = log_prob - old_log_prob
    seq_log_ratio = masked_sum(negative_approx_kl, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, response_mask), zero_metric(log_prob))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                             loss_agg_mode: str = "token-mean", config: Any = None,
                             global_batch: GlobalBatch | None = None,
                             rollout_is_weights: Tensor | None = None) -> Result:
    """SAPO (https://arxiv.org/abs/2511.20347): a smooth gate instead of a hard clip,
    ``loss_t = -A_t * sigmoid(tau * (r_t - 1)) * 4 / tau``, with ``tau = tau_pos`` where ``A_t > 0``, else
    ``tau_neg`` (the gate's slope at r = 1 is 1 for any tau: the on-policy gradient is the plain one).

    As verl 0.9.1: always aggregated as ``seq-mean-token-mean`` whatever ``loss_agg_mode`` says (verl
    hard-codes it); the log-ratio is clamped to +-20; ``pg_clipfrac`` and ``pg_clipfrac_lower`` are 0.
    ``config.tau_pos``/``tau_neg`` (verl's ``actor.tau_pos``/``tau_neg``): verl's defaults 1.0 and 1.05 when
    the config has none.
    """
    config = actor_settings(config)
    tau_pos = torch.as_tensor(setting(config, "tau_pos", 1.0), dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(setting(config, "tau_neg", 1.05), dtype=advantages.dtype, device=advantages.device)
    negative_approx_kl = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = weighted(-gates * advantages, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, "seq-mean-token-mean", global_batch)
    zero = zero_metric(log_prob)
    return loss, _metrics(zero, masked_mean(-negative_approx_kl, response_mask), zero)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            global_batch: GlobalBatch | None = None,
                            rollout_is_weights: Tensor | None = None) -> Result:
    """GPG (AMAP-ML/GPG, as verl adapts it): plain policy gradient ``-A_t * log pi_t``, no ratio, no
    clip; ``old_log_prob`` is unused. No metrics (verl returns none)."""
    pg_losses = weighted(-log_prob * advantages, rollout_is_weights)
    return aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch), {}


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                  *, loss_agg_mode: str = "seq-mean-token-sum", config: Any = None,
                                  global_batch: GlobalBatch | None = None,
                                  rollout_is_weights: Tensor | None = None) -> Result:
    """verl 0.9.1's ``compute_policy_loss_reinforce``: REINFORCE, ``-A_t * log pi_t``, times the caller's
    (detached) IS weights ``w_t`` when given, ``-A_t * log pi_t * w_t``; no ratio, no clip; aggregated with
    ``loss_agg_mode`` (verl's default for this function: ``seq-mean-token-sum``). ``old_log_prob`` is the
    rollout's (verl's ``rollout_log_prob``), used only for ``ppo_kl = mean(log pi_old - log pi)``.

    verl registers no name for it (its ``bypass_mode`` loss calls it for ``loss_type=reinforce``, and so does
    :func:`~.rollout_correction.compute_policy_loss_bypass_mode`); here it is also ``loss_mode=reinforce``, so
    the decoupled mode's weights (``algorithm.rollout_correction.rollout_is``) can drive a REINFORCE update."""
    pg_losses = weighted(-advantages * log_prob, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    return loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                                 response_mask: Tensor, *, loss_agg_mode: str = "token-mean", config: Any = None,
                                 global_batch: GlobalBatch | None = None,
                                 rollout_is_weights: Tensor | None = None) -> Result:
    """GMPO (https://arxiv.org/abs/2507.20673): the geometric mean of the token ratios of a sequence, each
    token's log-ratio clipped to ``[-clip_ratio_low, clip_ratio_high]`` on the side its advantage sign
    makes pessimistic, times the sequence's mean advantage: ``loss_i = -mean_t(A) * exp(mean_t(clipped
    log-ratio))``, both means over the valid tokens.

    As verl 0.9.1: ``loss_agg_mode`` is ignored (one value per sequence) and the log-ratio is not clamped.
    Deliberate difference: verl takes ``torch.mean`` over the rows of the micro-batch it is given, which
    depends on the micro-batch size (its sum over micro-batches is not the mini-batch's mean); here the
    per-sequence losses are summed and divided by the mini-batch's sequences with a valid token
    (``global_batch.num_seqs``), the same number as verl's for a whole mini-batch with no empty row.
    ``pg_clipfrac``/``pg_clipfrac_lower``: share of tokens whose log-ratio was clipped, with A > 0 / A < 0.
    """
    config = actor_settings(config)
    low, high = clip_range(config)
    mask = _as_mask(response_mask, log_prob)
    negative_approx_kl = log_prob - old_log_prob
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    sign = torch.sign(advantages)
    clamped = torch.clamp(negative_approx_kl, -low, high)
    clipped_log_ratio = sign * torch.minimum(sign * negative_approx_kl, sign * clamped)
    lengths = mask.sum(dim=-1)
    # verl divides by lengths + 1e-8 with its bool mask's integer lengths, a float32 sum in which the 1e-8
    # vanishes: exactly the length; clamp keeps an empty row at 0 / 1 as verl's 0 / 1e-8 is 0
    seq_ratio = torch.exp((clipped_log_ratio * mask).sum(dim=-1) / lengths.clamp(min=1))
    seq_advantage = (advantages * mask).sum(dim=-1) / lengths.clamp(min=1)
    seq_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:  # verl: the weights' geometric mean over the row's tokens, in log space
        seq_losses = seq_losses * torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / lengths.clamp(min=1))
    # one "token" per row: seq-mean-token-sum is then the sum over rows with a valid token / num_seqs
    row_valid = (lengths > 0).unsqueeze(-1)
    loss = aggregate_loss(seq_losses.unsqueeze(-1), row_valid, "seq-mean-token-sum", global_batch)
    clipped = torch.ne(negative_approx_kl, clamped)
    pg_clipfrac = masked_mean((clipped & (advantages > 0)).to(log_prob.dtype), response_mask)
    pg_clipfrac_lower = masked_mean((clipped & (advantages < 0)).to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dro")
def compute_policy_loss_dro(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            global_batch: GlobalBatch | None = None,
                            rollout_is_weights: Tensor | None = None) -> Result:
    """Direct Reward Optimization with a quadratic log-ratio penalty, as verl 0.9.1 writes it:
    ``loss_t = -(A_t * log pi_t - dro_beta / 2 * (log pi_t - log pi_old_t)^2)``, no clamp. Metrics:
    ``ppo_kl`` only.

    Raises:
        ValueError: without ``config.policy_loss.dro_beta > 0`` (verl's message).
    """
    beta = policy_loss_setting(actor_settings(config), "dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    log_ratio = log_prob - old_log_prob
    pg_losses = weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    return loss, {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
                              loss_agg_mode: str = "token-mean", config: Any = None,
                              global_batch: GlobalBatch | None = None,
                              rollout_is_weights: Tensor | None = None) -> Result:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): ``loss_t = -sg(clip(r_t, 1 - low, 1 + high)) *
    A_t * log pi_t``: the importance weight is clipped and detached, so every token keeps a gradient (none
    is dropped as in PPO's clip). Log-ratio clamped to +-20 as verl; ``pg_clipfrac``: share of tokens whose
    ratio was clipped; ``pg_clipfrac_lower`` is 0."""
    config = actor_settings(config)
    low, high = clip_range(config)
    negative_approx_kl = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio = torch.clamp(ratio, 1 - low, 1 + high)
    pg_losses = weighted(-clipped_ratio.detach() * advantages * log_prob, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    pg_clipfrac = masked_mean((ratio != clipped_ratio).to(log_prob.dtype), response_mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, response_mask), zero_metric(log_prob))


def _dppo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, loss_agg_mode: str,
          config: Any, global_batch: GlobalBatch | None, divergence: str,
          rollout_is_weights: Tensor | None) -> Result:
    config = actor_settings(config)
    low, high = clip_range(config)  # here thresholds on the divergence, not on the ratio
    # verl reads config.get("clip_ratio_c", 20.0): its ActorConfig always has clip_ratio_c (3.0), so 3.0 it is
    clip_ratio_c = setting(config, "clip_ratio_c", 20.0)
    negative_approx_kl = clamped_log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive = (prob - old_prob) <= high
        valid_negative = (prob - old_prob) >= -low
    else:  # KL between the Bernoulli distributions (sampled token vs the rest) of old and new policy
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        valid_positive = (binary_kl <= high) | (prob <= old_prob)
        valid_negative = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().to(log_prob.dtype)
    pg_losses = weighted(-advantages * truncated_ratio * log_prob * valid, rollout_is_weights)
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_batch)
    pg_clipfrac = masked_mean(1.0 - valid, response_mask)
    pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(log_prob.dtype) * valid, response_mask)
    return loss, _metrics(pg_clipfrac, masked_mean(-negative_approx_kl, response_mask), pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                *, loss_agg_mode: str = "token-mean", config: Any = None,
                                global_batch: GlobalBatch | None = None,
                                rollout_is_weights: Tensor | None = None) -> Result:
    """DPPO-Binary-TV (https://arxiv.org/abs/2602.04879): ``loss_t = -A_t * sg(min(r_t, clip_ratio_c)) *
    log pi_t * valid_t``, where a token is dropped (valid 0) when its probability moved more than the
    threshold in the direction its advantage pushes: ``pi - pi_old > clip_ratio_high`` for A > 0,
    ``pi - pi_old < -clip_ratio_low`` otherwise.

    As verl 0.9.1: ``clip_ratio_low/high`` are the divergence thresholds (0.2 by default, the PPO clip
    keys reused), and the truncation is ``actor.clip_ratio_c``: verl's code default 20.0 (the paper's
    advice: a large threshold) applies only to a config without the key, and verl's ActorConfig always has
    it (3.0) — so 3.0 by default, as here; set ``actor.clip_ratio_c=20`` for the paper's value.
    ``pg_clipfrac``: share of dropped tokens; ``pg_clipfrac_lower``: kept tokens whose ratio was truncated.
    """
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch, "tv",
                 rollout_is_weights)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                *, loss_agg_mode: str = "token-mean", config: Any = None,
                                global_batch: GlobalBatch | None = None,
                                rollout_is_weights: Tensor | None = None) -> Result:
    """DPPO-Binary-KL (https://arxiv.org/abs/2602.04879): as ``dppo_tv`` with the binary KL
    ``pi_old log(pi_old/pi) + (1 - pi_old) log((1 - pi_old + 1e-8)/(1 - pi + 1e-8))`` as the divergence:
    a token is dropped when it exceeds ``clip_ratio_high`` (A > 0, probability rising) or
    ``clip_ratio_low`` (A <= 0, probability falling). ``clip_ratio_c``: see ``dppo_tv``."""
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, global_batch, "kl",
                 rollout_is_weights)
