"""On-policy distillation's losses, as verl 0.9.1 defines them (verl/trainer/distillation/losses.py and
fsdp/losses.py): the student samples, a teacher scores what it sampled, and the student moves toward the teacher.

- ``estimator_losses``: a single-sample estimate of KL(student || teacher) at each sampled token from the two
  models' log-probs of it (loss_mode kl/k1, abs, mse/k2, low_var_kl/k3: the reference KL's estimators, kl.py).
- ``forward_kl_topk``: KL(teacher's top-k || student) at each position over the teacher's k most likely tokens, from
  the student's logits (loss_mode forward_kl_topk; log-probs clamped below at ``log_prob_min_clamp``; a negative
  value, possible as neither top-k mass sums to 1, counts as 0).
- ``distillation_loss``: the per-token losses clamped to +-``loss_max_clamp``, then either a policy-gradient term
  (``use_policy_gradient``: minus the loss is each token's advantage in the vanilla PPO clip loss, the reverse KL as
  a reward of Thinking Machines' write-up) or aggregated as a supervised loss (https://arxiv.org/abs/2306.13649).
- ``combined_loss``: the task's policy loss plus the distillation term times ``distillation_loss_coef`` with task
  rewards (``use_task_rewards``), the distillation term alone without.

Pure torch: the logits are one rank's whole vocabulary here (a vocabulary split over tensor-parallel ranks is the
megatron role's to gather).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from hybridflow.config.distillation import ESTIMATOR_MODES

from .aggregation import GlobalBatch, aggregate_loss
from .kl import kl_penalty
from .masked import masked_mean
from .policy_loss import compute_policy_loss_vanilla

DUAL_CLIP_C = 3.0  # verl's vanilla loss reads clip_ratio_c from the distillation loss config, which has none: 3.0


def estimator_losses(student_log_probs: Tensor, teacher_log_probs: Tensor, loss_mode: str) -> Tensor:
    """[B, T] KL(student || teacher) estimates at the sampled tokens (verl's kl_penalty(logprob=student,
    ref_logprob=teacher))."""
    if loss_mode not in ESTIMATOR_MODES:
        raise ValueError(f"distillation loss_mode {loss_mode!r} is not a single-sample estimator "
                         f"({', '.join(ESTIMATOR_MODES)})")
    return kl_penalty(student_log_probs, teacher_log_probs, loss_mode)


def forward_kl_topk(student_logits: Tensor, teacher_topk_log_probs: Tensor, teacher_topk_ids: Tensor,
                    log_prob_min_clamp: float | None) -> Dict[str, Tensor]:
    """Per position [..., V] logits and the teacher's [..., K] top-k log-probs and token ids: ``losses`` (sum over
    the k tokens of p_t (log p_t - log p_s), at least 0), ``student_mass`` and ``teacher_mass`` (each model's
    probability on the teacher's k tokens), ``overlap_count`` (how many of them are among the student's own k most
    likely) and ``overlap_token_advantage`` (the mean of -p_t (log p_t - log p_s) over those; 0 where none), the
    diagnostics of "Rethinking On-Policy Distillation" (arXiv:2604.13016) that verl logs."""
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # verl: fp32 (kl_divergence's .float())
    student_log_probs = torch.log_softmax(student_logits.to(dtype), dim=-1)
    student_topk_ids = torch.topk(student_log_probs, k=teacher_topk_ids.shape[-1], dim=-1).indices
    student = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    return topk_kl_terms(student, student_topk_ids, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp)


def topk_kl_terms(student: Tensor, student_topk_ids: Tensor, teacher_topk_log_probs: Tensor, teacher_topk_ids: Tensor,
                  log_prob_min_clamp: float | None) -> Dict[str, Tensor]:
    """``forward_kl_topk``'s outputs from the student's log-probs at the teacher's k ids [..., K] (differentiable) and
    the student's own k most likely ids: what a vocabulary split over tensor-parallel ranks gives
    (megatron/vocab_topk.py) without any rank holding the whole of it."""
    teacher = teacher_topk_log_probs.to(student.dtype)
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    token_kl = teacher.exp() * (teacher - student)
    overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap.sum(-1)
    overlap_advantage = (-token_kl * overlap).sum(-1) / overlap_count.clamp_min(1)
    return {"losses": token_kl.sum(-1).clamp_min(0.0), "student_mass": student_mass, "teacher_mass": teacher_mass,
            "overlap_count": overlap_count,
            "overlap_token_advantage": torch.where(overlap_count > 0, overlap_advantage, torch.zeros_like(overlap_advantage))}


def distillation_loss(losses: Tensor, response_mask: Tensor, *, use_policy_gradient: bool,
                      loss_max_clamp: float | None, loss_agg_mode: str = "token-mean",
                      global_batch: GlobalBatch | None = None, log_prob: Tensor | None = None,
                      old_log_prob: Tensor | None = None, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                      rollout_is_weights: Tensor | None = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The distillation term from per-token ``losses`` [B, T] and its metrics (``distillation/loss_min``,
    ``loss_max`` over the response before the clamp; with policy gradient the PPO clip loss's own, prefixed
    ``distillation/``). With ``use_policy_gradient``, ``log_prob`` (differentiable) and ``old_log_prob`` are the
    student's; the clip ratios are the distillation loss's own (verl's distillation_loss.clip_ratio_low/high)."""
    picked = losses.detach()[response_mask.bool()]
    metrics = {"distillation/loss_min": picked.min() if picked.numel() else losses.new_zeros(()),
               "distillation/loss_max": picked.max() if picked.numel() else losses.new_zeros(())}
    if loss_max_clamp is not None:  # both sides: k1 can be negative
        losses = losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    if not use_policy_gradient:
        return aggregate_loss(losses, response_mask, loss_agg_mode, global_batch), metrics
    loss, pg_metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, -losses.detach(), response_mask, loss_agg_mode=loss_agg_mode,
        global_batch=global_batch, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
        clip_ratio_c=DUAL_CLIP_C, rollout_is_weights=rollout_is_weights)
    metrics.update({f"distillation/{k}": v for k, v in pg_metrics.items()})
    return loss, metrics


def combined_loss(policy_loss: Tensor | float, distill_loss: Tensor, *, use_task_rewards: bool,
                  distillation_loss_coef: float) -> Tensor:
    """The actor's loss: the task's policy loss + coef x the distillation term with task rewards; the
    distillation term alone without (verl's distillation_ppo_loss)."""
    if not use_task_rewards:
        return distill_loss
    return policy_loss + distillation_loss_coef * distill_loss


def abs_loss_mean(losses: Tensor, response_mask: Tensor) -> Tensor:
    """verl's ``distillation/abs_loss`` of the estimator losses (k1 can be negative)."""
    return masked_mean(losses.detach().abs(), response_mask)


def distilled_loss(policy_loss: Tensor | float, losses: Tensor, log_prob: Tensor, old_log_prob: Tensor,
                   response_mask: Tensor, cfg, *, loss_agg_mode: str, global_batch: GlobalBatch | None = None,
                   rollout_is_weights: Tensor | None = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The actor's loss with the distillation term of per-token ``losses`` [B, T] (``estimator_terms`` or
    ``topk_kl_terms``; verl's distillation_ppo_loss): ``cfg`` is the distillation loss section
    (config/distillation.py DistillationLoss); ``log_prob`` the student's, differentiable; ``old_log_prob`` the
    student's at sampling (the policy-gradient form's ratio). Metrics as verl names them (``distillation/...``)."""
    term, metrics = distillation_loss(
        losses, response_mask, use_policy_gradient=cfg.use_policy_gradient, loss_max_clamp=cfg.loss_max_clamp,
        loss_agg_mode=loss_agg_mode, global_batch=global_batch, log_prob=log_prob, old_log_prob=old_log_prob,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, rollout_is_weights=rollout_is_weights)
    metrics["distillation/loss"] = term.detach()
    return combined_loss(policy_loss, term, use_task_rewards=cfg.use_task_rewards,
                         distillation_loss_coef=cfg.distillation_loss_coef), metrics


def estimator_terms(log_prob: Tensor, teacher_log_probs: Tensor, response_mask: Tensor,
                    loss_mode: str) -> Tuple[Tensor, Dict[str, Tensor]]:
    """An estimator mode's per-token losses and verl's metric of them (compute_distillation_loss_reverse_kl_estimator)."""
    losses = estimator_losses(log_prob, teacher_log_probs, loss_mode)
    return losses, {"distillation/abs_loss": abs_loss_mean(losses, response_mask)}


def topk_metrics(terms: Dict[str, Tensor], response_mask: Tensor, k: int) -> Dict[str, Tensor]:
    """verl's compute_forward_kl_topk metrics over the response tokens: each model's mass on the teacher's top-k
    (mean, min, max), the overlap ratio with the student's own top-k and the overlapped tokens' mean advantage."""
    valid = response_mask.bool()
    out = {}
    for who in ("student", "teacher"):
        mass = terms[f"{who}_mass"].detach()[valid]
        out.update({f"distillation/{who}_mass": mass.mean(), f"distillation/{who}_mass_min": mass.min(),
                    f"distillation/{who}_mass_max": mass.max()} if mass.numel() else {})
    count = terms["overlap_count"][valid]
    overlapped = valid & (terms["overlap_count"] > 0)
    out["distillation/overlap_ratio"] = count.float().mean() / k if count.numel() else torch.zeros(())
    out["distillation/overlap_token_advantage"] = (terms["overlap_token_advantage"].detach()[overlapped].mean()
                                                   if overlapped.any() else torch.zeros(()))
    return out
