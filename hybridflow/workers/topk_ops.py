"""forward_kl_topk's student side on megatron's vocab-parallel logits (megatron/vocab_topk.py): the forward KL from
the teacher's k most likely tokens at each response position (workers/teachers.py gives them) to the student,
differentiable, each tensor-parallel rank working on its own vocabulary shard. Not under context parallelism
(refused before start, plan/rules.py: a rank would hold part of each row's positions)."""

from __future__ import annotations

import torch

from hybridflow.algorithms.distillation import topk_kl_terms
from hybridflow.megatron import vocab_topk


def student_topk_kl(z: torch.Tensor, mb: dict, log_prob_min_clamp: float | None) -> dict:
    """algorithms/distillation.topk_kl_terms ([N, R] each; the caller zeroes them past a response's end) of the
    student's logits ``z`` [N, R, V/t] at the response positions (at the policy's temperature) against the
    micro-batch's ``teacher_topk_log_probs`` and ``teacher_topk_ids`` [N, R, k]."""
    z = z.float()  # once: the three readers below would otherwise each copy bf16 logits to fp32
    ids = mb["teacher_topk_ids"]
    student = vocab_topk.at_ids(z, ids) - vocab_topk.log_softmax_lse(z)[..., None]
    _, own = vocab_topk.top_logits(z.detach(), ids.shape[-1])
    return topk_kl_terms(student, own, mb["teacher_topk_log_probs"], ids, log_prob_min_clamp)
