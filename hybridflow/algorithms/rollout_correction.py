"""Rollout correction: the mismatch between the rollout engine's probabilities (vLLM's log-prob of each sampled
token) and the trainer's, measured, and corrected by truncated importance sampling and rejection, as verl
0.9.1's ``trainer/ppo/rollout_corr_helper.py`` and its ``bypass_mode`` loss (``core_algos.py``) do.

With ``log_ratio = log pi_train - log pi_rollout`` per response token:

* IS weights (``rollout_is``): ``token``: ``exp(log_ratio)``; ``sequence``: ``exp(sum of the row's log_ratio)``
  on every token of the row; both exponentiated after clamping to +-20, zero on padding, then truncated at the
  threshold (``min(w, upper)``, TIS) or, for a ``"lower_upper"`` threshold, zeroed outside ``[lower, upper]``
  (IcePop); detached; optionally divided by their batch mean (``rollout_is_batch_normalize``: the token mean,
  or the mean of the per-row weights for ``sequence``).
* Rejection (``rollout_rs``, comma-separated options, all must pass): ``token_k{1,2,3}``, ``seq_sum_k{1,2,3}``,
  ``seq_mean_k{1,2,3}``, ``seq_max_k{2,3}`` with ``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``,
  ``k3 = exp(log_ratio) - 1 - log_ratio``; ``k1`` options keep ``log(lower) <= stat <= log(upper)`` (a single
  threshold t means ``1/t_t``), the others ``stat <= upper``. Rejected tokens (or whole rows) leave the
  response mask the loss is aggregated with.
* Metrics: every one verl 0.9.1 reports, by its names and with its values, under ``rollout_corr/``: the IS
  weights' ``rollout_is_{mean,max,min,std,eff_sample_size,ratio_fraction_high|low}``, their per-row
  ``rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high|low}`` (``_oob_ratio`` for IcePop,
  ``_batch_norm_factor`` when normalizing); per rejection option ``rollout_rs_<option>_{mean,max,min,std,
  fraction_high|low,masked_fraction}`` and ``_seq_{mean,std,max,min,max_deviation,fraction_high[,fraction_low],
  masked_fraction}``, and ``rollout_rs_{,seq_}masked_fraction`` for all together; the off-policy ``kl``,
  ``k3_kl``, ``*_ppl``, ``log_ppl_*``, ``ppl_ratio``, ``chi2_*``; and verl's ``training/rollout_probs_diff_*``
  and ``training/rollout_actor_probs_pearson_corr`` (:func:`debug_metrics`). Plus :data:`HYBRIDFLOW_ONLY_METRICS`:
  the token ratio range and the share of tokens and of rows with a ratio outside ``[1/t, t]`` (t the IS
  threshold's upper bound), which verl reports only with IS on. tests/fixtures/verl/rollout_corr_metrics.json
  holds verl's own outputs the unit tests compare with.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch

from .aggregation import GlobalBatch
from .masked import masked_mean, masked_sum
from .policy_loss import compute_policy_loss_vanilla
from .policy_losses import compute_policy_loss_reinforce
from .registry import register_policy_loss

Tensor = torch.Tensor
SAFETY_BOUND = 20.0  # verl's: exp(+-20) bounds every exponentiated log-ratio
# logged with verl's metrics, verl has no such names (the mismatch's range, with or without IS)
HYBRIDFLOW_ONLY_METRICS = frozenset(f"rollout_corr/{k}" for k in (
    "token_ratio_max", "token_ratio_min", "token_fraction_beyond_threshold", "seq_fraction_beyond_threshold"))
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_is_threshold(spec) -> Tuple[float, Optional[float]]:
    """``(upper, lower)`` of ``rollout_is_threshold``: a number (TIS, lower None) or ``"lower_upper"`` (IcePop)."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be a number or 'lower_upper', "
                         f"got {spec!r}")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold {spec!r} is not a number or "
                         "'lower_upper'") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold {spec!r}: bounds must be positive, "
                         "lower <= upper")
    return upper, lower


def parse_rs(options: str, spec) -> Dict[str, Tuple[Optional[float], float]]:
    """``{option: (lower, upper)}`` of ``rollout_rs`` / ``rollout_rs_threshold`` (one threshold for all options,
    or one per option, comma-separated)."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs {options!r}: options must be among {list(RS_OPTIONS)}")
    if spec is None:
        raise ValueError("algorithm.rollout_correction.rollout_rs_threshold must be set when rollout_rs is")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold {spec!r}: one value, or one per "
                         f"rollout_rs option ({len(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = {}
    for name, s in zip(names, specs):
        try:
            if name.endswith("k1"):
                lower, upper = (float(x) for x in s.split("_", 1)) if "_" in s else (1.0 / float(s), float(s))
            elif "_" in s:
                raise ValueError
            else:
                lower, upper = None, float(s)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold {s!r} for {name}: a positive "
                             "number (k1 options: also 'lower_upper')") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold {s!r} for {name}: bounds must be "
                             "positive, lower <= upper")
        out[name] = (lower, upper)
    return out


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    return x.masked_fill(~mask.bool(), float("-inf")).max()


def _masked_min(x: Tensor, mask: Tensor) -> Tensor:
    return x.masked_fill(~mask.bool(), float("inf")).min()


def _std(values: Tensor, mask: Tensor, low: float, high: float) -> float:
    """verl's spread of a statistic: the masked std of ``values`` clamped to ``[low, high]`` (0 for one token)."""
    if mask.sum() <= 1:
        return 0.0
    clamped = values.clamp(min=low, max=high)
    var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    return torch.sqrt(var.clamp(min=0.0)).item()


def _row_stats(prefix: str, rows: Tensor, center: float) -> Dict[str, float]:
    """``{prefix}_seq_mean|std|max|min|max_deviation`` over per-row values (verl: std unbiased, 0 for one row;
    the deviation from ``center``, the ideal value)."""
    if rows.numel() == 0:
        return {f"{prefix}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation")}
    return {f"{prefix}_seq_mean": rows.mean().item(),
            f"{prefix}_seq_std": rows.std().item() if rows.numel() > 1 else 0.0,
            f"{prefix}_seq_max": rows.max().item(), f"{prefix}_seq_min": rows.min().item(),
            f"{prefix}_seq_max_deviation": (rows - center).abs().max().item()}


def _is_metrics(weights: Tensor, raw: Tensor, log_ratio_for_metrics: Tensor, mask: Tensor, level: str,
                upper: float, lower: Optional[float]) -> Dict[str, float]:
    """verl 0.9.1's ``compute_is_metrics``: the applied (truncated / IcePop-zeroed, unnormalized) weights' mean,
    max, min, std, ESS and per-row statistics; the ratio fractions from the raw weights (``sequence``: from the
    row log-ratios, in log space, max unclamped by the threshold)."""
    low = 1.0 / upper if lower is None else lower
    if level == "sequence":
        m = {"rollout_is_max": math.exp(min(log_ratio_for_metrics.max().item(), SAFETY_BOUND)),
             "rollout_is_min": math.exp(log_ratio_for_metrics.min().item()),
             "rollout_is_mean": masked_mean(weights, mask).item(),
             "rollout_is_ratio_fraction_high": (log_ratio_for_metrics > math.log(upper)).double().mean().item(),
             "rollout_is_ratio_fraction_low": (log_ratio_for_metrics < math.log(low)).double().mean().item()}
    else:
        m = {"rollout_is_mean": masked_mean(weights, mask).item(),
             "rollout_is_ratio_fraction_high": masked_mean((raw > upper).to(mask.dtype), mask).item(),
             "rollout_is_ratio_fraction_low": masked_mean((raw < low).to(mask.dtype), mask).item(),
             "rollout_is_max": _masked_max(weights, mask).item(), "rollout_is_min": _masked_min(weights, mask).item()}
    m["rollout_is_std"] = _std(weights, mask, 0.0, upper)
    clipped = weights.clamp(0.0, upper)  # verl's ESS: of the applied weights, normalized to mean 1
    normalized = clipped / (masked_mean(clipped, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized ** 2, mask).item()
    # per row: every row counts, an empty one with weight 0 (verl's masked mean over its no tokens)
    m.update(_row_stats("rollout_is", masked_mean(weights, mask, dim=-1), 1.0))
    raw_rows = masked_mean(raw, mask, dim=-1)  # raw: a truncated row mean never exceeds the threshold
    m["rollout_is_seq_fraction_high"] = (raw_rows > upper).double().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_rows < low).double().mean().item()
    if lower is not None:
        m["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).to(mask.dtype), mask).item()
    return m


def is_weights(log_ratio: Tensor, mask: Tensor, level: str = "token", threshold=2.0,
               batch_normalize: bool = False) -> Tuple[Tensor, Dict[str, float]]:
    """Truncated (or IcePop-masked) importance weights ``pi_train / pi_rollout`` [B, R] and their metrics
    (verl 0.9.1's ``compute_rollout_correction_weights``; the metrics are of the weights before
    ``batch_normalize``, as verl's)."""
    upper, lower = parse_is_threshold(threshold)
    mask = mask.to(log_ratio.dtype)
    if level == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        for_metrics = masked_sum(log_ratio, mask, dim=-1)
        raw = torch.exp(for_metrics.unsqueeze(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be token or sequence, got {level!r}")
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    weights = weights.detach()
    m = _is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            rows = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, dim=-1) * rows).sum() / rows.sum().clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
        m["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
    return weights, m


def _rs_metrics(prefix: str, stat: Tensor, rows: Tensor, mask: Tensor, valid_rows: Tensor, level: str,
                lower: Optional[float], upper: float) -> Dict[str, float]:
    """verl 0.9.1's ``compute_rs_metrics`` for one option: the statistic ``stat`` (per token, [B, R]; a row's
    value on each of its tokens for sequence options) against its bounds (``k1``: log bounds, both applied;
    others: ``upper`` only); ``rows``: the per-row values, ``valid_rows``: rows with a token."""
    lo = 0.0 if lower is None else lower
    rows = rows[valid_rows]
    m = {f"{prefix}_mean": masked_mean(stat, mask).item()}
    if level == "sequence" and rows.numel() > 0:
        m.update({f"{prefix}_max": rows.max().item(), f"{prefix}_min": rows.min().item(),
                  f"{prefix}_fraction_high": (rows > upper).double().mean().item(),
                  f"{prefix}_fraction_low": (rows < lo).double().mean().item() if lower is not None else 0.0})
    else:
        m.update({f"{prefix}_max": _masked_max(stat, mask).item(), f"{prefix}_min": _masked_min(stat, mask).item(),
                  f"{prefix}_fraction_high": masked_mean((stat > upper).to(mask.dtype), mask).item(),
                  f"{prefix}_fraction_low": masked_mean((stat < lo).to(mask.dtype), mask).item()
                  if lower is not None else 0.0})
    m[f"{prefix}_std"] = _std(stat, mask, lo, upper)
    m.update(_row_stats(prefix, rows, 0.0))
    m[f"{prefix}_seq_fraction_high"] = (rows > upper).double().mean().item() if rows.numel() else 0.0
    if lower is not None or rows.numel() == 0:  # verl: the low fraction only with a lower bound (k1)
        m[f"{prefix}_seq_fraction_low"] = (rows < lo).double().mean().item() if rows.numel() else 0.0
    return m


def rejection_mask(log_ratio: Tensor, mask: Tensor, options: str, threshold) -> Tuple[Tensor, Dict[str, float]]:
    """``mask`` with the tokens (or rows) that fail any ``rollout_rs`` option set to 0, and the metrics
    (verl 0.9.1's ``compute_rollout_rejection_mask``)."""
    specs = parse_rs(options, threshold)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    fmask = mask.to(lr.dtype)
    stats = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    neg_inf = torch.tensor(float("-inf"), dtype=lr.dtype, device=lr.device)
    keep_all = torch.ones_like(fmask)
    valid_rows = mask.sum(-1) > 0
    m: Dict[str, float] = {}
    for name, (lower, upper) in specs.items():
        stat = stats[name[-2:]]
        level = "token" if name.startswith("token") else "sequence"
        if name.startswith("seq_sum"):
            stat = masked_sum(stat, fmask, dim=-1).unsqueeze(-1)
        elif name.startswith("seq_mean"):
            stat = masked_mean(stat, fmask, dim=-1).unsqueeze(-1)
        elif name.startswith("seq_max"):
            top = stat.masked_fill(~mask.bool(), neg_inf).max(-1).values
            stat = torch.where(top == neg_inf, torch.zeros_like(top), top).unsqueeze(-1)
        if lower is not None:  # k1: bounds on the log-ratio
            lower, upper = math.log(lower), math.log(upper)
            keep = (stat >= lower) & (stat <= upper)
        else:
            keep = stat <= upper
        keep = keep.expand_as(fmask).to(fmask.dtype)
        keep_all = keep_all * keep
        prefix = f"rollout_rs_{name}"
        per_token = stat.expand_as(fmask)
        rows = stat.squeeze(-1) if level == "sequence" else masked_mean(stat, fmask, dim=-1)
        m.update(_rs_metrics(prefix, per_token, rows, fmask, valid_rows, level, lower, upper))
        m[f"{prefix}_masked_fraction"] = masked_mean(1 - keep, fmask).item()
        m[f"{prefix}_seq_masked_fraction"] = (((keep < 0.5) & mask.bool()).any(-1) & valid_rows).double().sum().item() \
            / max(int(valid_rows.sum()), 1)
    m["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, fmask).item()
    m["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & mask.bool()).any(-1).double().mean().item()
    return (mask * keep_all).to(mask.dtype), m


def mismatch_metrics(train_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, threshold=2.0) -> Dict[str, float]:
    """How far the trainer's log-probs are from the rollout's (verl's ``compute_offpolicy_metrics`` and
    ``calculate_debug_metrics``, plus the ratio range and the share of tokens and rows beyond the threshold);
    keys without the ``rollout_corr/`` prefix, except verl's ``training/*``."""
    upper, lower = parse_is_threshold(threshold)
    lower = 1.0 / upper if lower is None else lower
    fmask = mask.to(train_log_prob.dtype)
    log_ratio = train_log_prob - rollout_log_prob
    mean_train = masked_mean(train_log_prob, fmask, dim=-1)
    mean_rollout = masked_mean(rollout_log_prob, fmask, dim=-1)
    log_ppl_diff = mean_rollout - mean_train
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = masked_sum(log_ratio, fmask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    beyond = ((log_ratio > math.log(upper)) | (log_ratio < math.log(lower))) & mask.bool()
    m = {"training_ppl": torch.exp(-mean_train).mean().item(), "training_log_ppl": (-mean_train).mean().item(),
         "kl": masked_mean(-log_ratio, fmask).item(),
         "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, fmask).item(),
         "rollout_ppl": torch.exp(-mean_rollout).mean().item(), "rollout_log_ppl": (-mean_rollout).mean().item(),
         "log_ppl_diff": log_ppl_diff.mean().item(), "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
         "log_ppl_diff_max": log_ppl_diff.max().item(), "log_ppl_diff_min": log_ppl_diff.min().item(),
         "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
         "chi2_token": (masked_mean(torch.exp(safe) ** 2, fmask) - 1.0).item(),
         "chi2_seq": (torch.exp(2.0 * seq_sum).mean() - 1.0).item(),
         "token_ratio_max": math.exp(min(_masked_max(log_ratio, fmask).item(), SAFETY_BOUND)),
         "token_ratio_min": math.exp(max(_masked_min(log_ratio, fmask).item(), -SAFETY_BOUND)),
         "token_fraction_beyond_threshold": masked_mean(beyond.to(fmask.dtype), fmask).item(),
         "seq_fraction_beyond_threshold": beyond.any(-1).double().mean().item()}
    return {**{f"rollout_corr/{k}": v for k, v in m.items()}, **debug_metrics(train_log_prob, rollout_log_prob, mask)}


def debug_metrics(train_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor) -> Dict[str, float]:
    """verl 0.9.1's ``calculate_debug_metrics`` (utils/debug/metrics.py), which its trainer logs whenever the
    batch has rollout log-probs: the absolute difference of the token probabilities and their Pearson
    correlation. Where verl's are NaN (one token: an undefined std and correlation) these are 0, so a
    one-token micro-batch does not poison the averaged update metrics."""
    keep = mask.bool()
    train, rollout = torch.exp(train_log_prob)[keep], torch.exp(rollout_log_prob)[keep]
    diff = (train - rollout).abs()
    one = diff.numel() <= 1
    return {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(),
            "training/rollout_probs_diff_std": 0.0 if one else diff.std().item(),
            "training/rollout_actor_probs_pearson_corr": 0.0 if one else
            torch.corrcoef(torch.stack([train, rollout]))[0, 1].item()}


def active(rc: Any) -> bool:
    """Whether ``algorithm.rollout_correction`` changes the update (weights, rejection or bypass), rather than
    only measuring."""
    return rc is not None and (rc.rollout_is is not None or rc.rollout_rs is not None or rc.bypass_mode)


def correct(old_log_prob: Tensor, rollout_log_prob: Tensor, mask: Tensor, rc: Any,
            ) -> Tuple[Optional[Tensor], Tensor, Dict[str, float]]:
    """verl's ``compute_rollout_correction_and_rejection_mask`` with ``algorithm.rollout_correction`` ``rc``:
    (IS weights or None, the response mask after rejection, metrics with their logging names)."""
    log_ratio = old_log_prob - rollout_log_prob
    metrics, weights, kept = {}, None, mask
    if rc.rollout_is is not None:
        weights, m = is_weights(log_ratio, mask, rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize)
        metrics.update(m)
    if rc.rollout_rs is not None:
        kept, m = rejection_mask(log_ratio, mask, rc.rollout_rs, rc.rollout_rs_threshold)
        metrics.update(m)
    metrics = {f"rollout_corr/{k}": v for k, v in metrics.items()}
    # the mismatch over every response token, rejected ones included (verl's off-policy metrics)
    metrics.update(mismatch_metrics(old_log_prob, rollout_log_prob, mask, rc.rollout_is_threshold))
    return weights, kept, metrics


def _tensor_metrics(metrics: Dict[str, float], like: Tensor) -> Dict[str, Tensor]:
    return {k: torch.tensor(v, dtype=like.dtype) for k, v in metrics.items()}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                                    *, loss_agg_mode: str = "token-mean", config: Any = None,
                                    global_batch: GlobalBatch | None = None, rollout_is_weights: Tensor | None = None,
                                    rollout_correction: Any = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """verl 0.9.1's ``bypass_mode`` loss: ``old_log_prob`` are the rollout's log-probs (no old-log-prob forward).
    The IS weights and rejection mask of ``rollout_correction`` are computed here against the current
    (detached) log-probs, per micro-batch; ``loss_type`` ``ppo_clip``: the vanilla PPO loss on the rejected
    mask (its ratio already is pi/pi_rollout: no IS weights, as verl); ``reinforce``:
    ``-A * log_prob * w`` aggregated with ``loss_agg_mode``. ``rollout_is_weights`` is ignored (computed here,
    as verl). Registered as ``bypass_mode`` (verl's name); verl's trainer selects it by setting
    ``policy_loss.loss_mode`` when ``algorithm.rollout_correction.bypass_mode`` is true, and so does
    the run plan's rule (plan/rules.py): ``loss_mode=bypass_mode`` needs ``bypass_mode=true``, whose
    ``rollout_correction`` the actor passes.

    Differences from verl: ``rollout_is_batch_normalize`` divides by the micro-batch's mean weight (verl's by
    an all-reduce over its default process group); metrics are returned as tensors, and the actor logs them
    with verl's ``actor/`` prefix (``actor/rollout_corr/kl``, ...), as verl's trainer renames them."""
    rc = rollout_correction
    if rc is None:
        raise ValueError("the bypass_mode loss needs algorithm.rollout_correction")
    with torch.no_grad():
        weights, mask, metrics = correct(log_prob.detach(), old_log_prob, response_mask, rc)
    if rc.loss_type == "reinforce":
        loss, out = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, mask, loss_agg_mode=loss_agg_mode,
                                                  config=config, global_batch=global_batch, rollout_is_weights=weights)
    elif rc.loss_type == "ppo_clip":
        loss, out = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode=loss_agg_mode,
                                                config=config, global_batch=global_batch)
    else:
        raise ValueError(f"algorithm.rollout_correction.loss_type must be ppo_clip or reinforce, got {rc.loss_type!r}")
    return loss, {**out, **_tensor_metrics(metrics, log_prob)}
