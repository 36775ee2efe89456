"""What the workers compute with a MegatronRole: log-probs, values, and the PPO policy/value updates.

Plain functions of (role, batch, settings), so equivalence tests drive exactly the code the workers run.
Every rank of the role calls them with its data-parallel shard; outputs exist on the last pipeline stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.algorithms import (POLICY_LOSSES, GlobalBatch, aggregate_loss, kl_loss, masked_mean,
                                   value_loss)
from hybridflow.algorithms.distillation import distilled_loss, estimator_terms, topk_metrics
from hybridflow.algorithms.rollout_correction import compute_policy_loss_bypass_mode, mismatch_metrics
from hybridflow.megatron import virtual_stages
from hybridflow.megatron.model import te_available
from hybridflow.megatron.role import MegatronRole, token_log_probs, vocab_parallel_entropy
from hybridflow.plan.layout import mini_batch_rows
from hybridflow.protocol import Batch
from hybridflow.workers import row_layout
from hybridflow.workers.row_layout import TokenBudget
from hybridflow.workers.topk_ops import student_topk_kl
from hybridflow.util import mean_by_key

def picked(per_position: torch.Tensor, mb: dict) -> torch.Tensor:
    """Outputs [rows, s, ...] at the positions predicting each response token: [N, R, ...]."""
    return per_position[mb["sample_row"][:, None], mb["response_index"]]


def zero_past_end(x: torch.Tensor, mb: dict) -> torch.Tensor:
    """``x`` [N, R, ...] with 0 where a row's response has ended."""
    valid = mb["response_valid"].bool()
    valid = valid.reshape(*valid.shape, *(1,) * (x.dim() - valid.dim()))
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _at_responses(per_position: torch.Tensor, mb: dict, fn) -> torch.Tensor:
    """``fn(outputs, labels)`` at the positions predicting each response token: [N, R], 0 where there is none.
    Under context parallelism each rank computes the tokens whose positions it holds (``cp_owned``,
    row_layout.split_for_context_parallel) and the parts are summed over the CP group."""
    if "cp_owned" not in mb:
        return zero_past_end(fn(picked(per_position, mb), mb["response_labels"]), mb)
    from hybridflow.megatron.context_parallel import sum_over_ranks

    owned = mb["cp_owned"]
    rows = mb["sample_row"][:, None].expand_as(owned)[owned]
    y = fn(per_position[rows, mb["response_index"][owned]], mb["response_labels"][owned])
    return sum_over_ranks(torch.zeros(owned.shape, dtype=y.dtype, device=y.device).masked_scatter(owned, y))


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def response_log_probs(logits: torch.Tensor, mb: dict, temperature: float = 1.0) -> torch.Tensor:
    """log p(response token) [N, R] from vocab-parallel logits [rows, s, V/t] at ``temperature``
    (differentiable)."""
    return _at_responses(logits, mb, lambda z, labels: token_log_probs(_tempered(z, temperature), labels))


def response_entropy(logits: torch.Tensor, mb: dict, temperature: float = 1.0, chunk: int | None = None) -> torch.Tensor:
    return _at_responses(logits, mb, lambda z, _: vocab_parallel_entropy(_tempered(z, temperature), chunk))


def response_sum_pi_squared(logits: torch.Tensor, mb: dict, temperature: float = 1.0) -> torch.Tensor:
    """sum over the vocabulary of p^2 at each response position [N, R] (verl's actor.calculate_sum_pi_squared,
    the optimal token baselines' input), from vocab-parallel logits without gradient: S2 / S0^2 with
    S0 = sum exp(z - m), S2 = sum exp(2 (z - m)), both summed over the TP ranks (m the global max), as
    ``vocab_parallel_entropy`` sums its statistics."""
    return _at_responses(logits.detach(), mb, lambda z, _: _sum_pi_squared(_tempered(z, temperature)))


def _sum_pi_squared(z: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    z = z.float()
    m = z.max(dim=-1, keepdim=True).values
    tp = ps.get_tensor_model_parallel_world_size() > 1
    if tp:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    e = (z - m).exp()
    stats = torch.stack([e.sum(-1), (e * e).sum(-1)])
    if tp:
        dist.all_reduce(stats, group=ps.get_tensor_model_parallel_group())
    return stats[1] / stats[0] ** 2


def response_values(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """Values [N, R] at the positions that predict each response token, from the value head's [rows, s, 1]."""
    return _at_responses(values[..., 0].float(), mb, lambda v, _: v)


def last_stage_batch(**tensors) -> Batch | None:
    """A Batch of the outputs; None on pipeline stages that have none (the controller collects only
    from the last stage)."""
    if any(t is None for t in tensors.values()):
        return None
    return Batch.from_dict(tensors=tensors)


def _concat(outputs: list[dict], key: str):
    return torch.cat([o[key] for o in outputs]) if outputs else None


def micro_batches_of(role: MegatronRole, batch: Batch, micro: int | TokenBudget,
                     extra_keys=()) -> tuple[list[dict], torch.Tensor | None]:
    """The role's micro-batches of ``micro`` rows, or packed by a token budget; and the batch row of each
    concatenated output row (None: the batch's own order)."""
    mbs, order = _laid_out(role, batch, micro, extra_keys)
    cp = role.shard.cp_size
    if cp > 1:  # each CP rank its part of every micro-batch; TE's attention takes causal rows, the local one a mask
        mbs = [row_layout.split_for_context_parallel(mb, cp, role.shard.cp_rank, explicit_mask=not te_available())
               for mb in mbs]
    return mbs, order


def _laid_out(role: MegatronRole, batch: Batch, micro: int | TokenBudget,
              extra_keys=()) -> tuple[list[dict], torch.Tensor | None]:
    seq_multiple = role.layout.sequence_multiple
    if isinstance(micro, TokenBudget):
        # GPU with TE: packed-sequence attention (causal per row, no shared prompts); else an explicit mask
        thd = role.packs_sequences
        share = role.shares_prompts and not thd
        count = agreed_count(max(row_layout.micro_batch_count(batch, micro, share), least_micro_batches(role, batch)))
        count = _schedule_count(role, count, len(batch))  # the same on every rank: from the agreed count
        return row_layout.token_micro_batches(batch, micro, extra_keys, seq_multiple, share_prompts=share, thd=thd,
                                              count=count,
                                              unit_multiple=role.layout.context_chunks)
    least = least_micro_batches(role, batch)
    if -(-len(batch) // micro) < least:  # fewer, smaller micro-batches
        micro = len(batch) // least
    count = _schedule_count(role, -(-len(batch) // micro), len(batch))
    return row_layout.micro_batches(batch, micro, extra_keys, seq_multiple, share_prompts=role.shares_prompts,
                                    count=count), None


def _schedule_count(role: MegatronRole, count: int, rows: int) -> int:
    """The micro-batch count the role's schedule runs: with virtual pipeline stages rounded up to a multiple of the
    pipeline size where the rows allow (virtual_stages.interleaved_count), else ``count``."""
    if role.shard.vpp_size == 1:
        return count
    return virtual_stages.interleaved_count(count, role.shard.pp_size, rows)


def least_micro_batches(role: MegatronRole, batch: Batch) -> int:
    """The fewest micro-batches the role's schedule runs (``ParallelLayout.least_micro_batches``), a row each at
    least."""
    least = role.layout.least_micro_batches
    if least > 1 and len(batch) < least:
        raise ValueError(f"virtual pipeline stages need more than pipeline_model_parallel_size "
                         f"({role.layout.pp}) micro-batches; this rank got {len(batch)} rows")
    return least


def agreed_count(own: int) -> int:
    """The micro-batch count of every data-parallel rank: the largest rank's (verl 0.9.1's
    ``same_micro_num_in_dp``). Pipeline stages run the same schedule, and under expert parallelism each
    micro-batch's token all-to-all needs every rank of the group: ranks running different counts would wait
    for each other for ever."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1:
        return own
    count = device.to_device(torch.tensor([own], dtype=torch.int64))  # NCCL: a device tensor
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return int(count.item())


def gathered(outs: list[dict], key: str, order: torch.Tensor | None):
    out = _concat(outs, key)
    return out if out is None or order is None else row_layout.restore(out, order)


def log_prob_batching(actor_cfg, ref: bool = False) -> int | TokenBudget:
    """Micro-batching of the actor's (with ``ref`` the reference's) log-prob forwards: a token budget with
    verl's log_prob_use_dynamic_bsz (log_prob_max_token_len_per_gpu), else rows per micro-batch."""
    a = actor_cfg
    if a.log_prob_dynamic:
        return TokenBudget(getattr(a, a.log_prob_token_key), f"actor.{a.log_prob_token_key}")
    if ref and a.ref_log_prob_micro_batch_size_per_gpu:
        return a.ref_log_prob_micro_batch_size_per_gpu
    return a.log_prob_micro_batch_size_per_gpu


def value_batching(critic_cfg) -> int | TokenBudget:
    """Micro-batching of the critic's value forwards (critic.forward_max_token_len_per_gpu with dynamic bsz)."""
    c = critic_cfg
    if c.use_dynamic_bsz:
        return TokenBudget(getattr(c, c.forward_token_key), f"critic.{c.forward_token_key}")
    return c.log_prob_micro_batch_size_per_gpu


def _update_batching(role_cfg, name: str) -> int | TokenBudget:
    if role_cfg.use_dynamic_bsz:
        return TokenBudget(role_cfg.ppo_max_token_len_per_gpu, f"{name}.ppo_max_token_len_per_gpu")
    return role_cfg.ppo_micro_batch_size_per_gpu


def routes_of(role: MegatronRole, batch: Batch) -> tuple[str, ...]:
    """The batch's MoE routes as a micro-batch key, when the role replays routing and the batch has them."""
    return ("routed_experts",) if role.routing is not None and "routed_experts" in batch.tensors else ()


def log_probs(role: MegatronRole, batch: Batch, micro: int | TokenBudget, with_entropy: bool = False,
              with_sum_pi_squared: bool = False, temperature: float = 1.0, record_routes: bool = False,
              entropy_chunk: int | None = None) -> dict:
    """{'log_probs': [b, R], 'entropy': [b, R], 'sum_pi_squared': [b, R]} of the response tokens (the last two
    when asked; None off the last stage) under the policy at ``temperature`` (the run plan's
    ``ActorSpec.logit_temperature``); ``micro``: rows per micro-batch, or a token budget (``log_prob_batching``).
    With routing replay (``MegatronRole.forward``): the batch's ``routed_experts`` are replayed, and
    'routing_differing', 'routing_counted' [b] measure them; with ``record_routes`` (and none to replay) the
    routers' own choices come back as 'routed_experts' [b, T, L, k]. ``entropy_chunk``: ``ActorConfig.entropy_chunk``."""
    def output_fn(mb, logits):
        out = {"log_probs": response_log_probs(logits, mb, temperature)}
        if with_entropy:
            out["entropy"] = response_entropy(logits, mb, temperature, entropy_chunk)
        if with_sum_pi_squared:
            out["sum_pi_squared"] = response_sum_pi_squared(logits, mb, temperature)
        return out

    replay = routes_of(role, batch)
    mbs, order = micro_batches_of(role, batch, micro, replay)
    outs = role.forward(mbs, output_fn, record_routes=record_routes and not replay)
    keys = ("log_probs",) + (("entropy",) if with_entropy else ()) + (("sum_pi_squared",) if with_sum_pi_squared else ())
    keys += ("routing_differing", "routing_counted") if replay else (
        ("routed_experts",) if record_routes and role.routing is not None else ())
    return {k: gathered(outs, k, order) for k in keys}


def values(role: MegatronRole, batch: Batch, micro: int | TokenBudget):
    """Critic values [b, R] at the positions that predict each response token."""
    mbs, order = micro_batches_of(role, batch, micro)
    return gathered(role.forward(mbs, lambda mb, v: {"values": response_values(v, mb)}), "values", order)


def global_batch(mask: torch.Tensor, loss_scale_factor: float | None = None) -> GlobalBatch:
    """The mini-batch's valid tokens and sequences over every data-parallel rank (one all-reduce of two
    numbers), which each micro-batch's loss is normalized by (verl 0.9.1's global batch info)."""
    from megatron.core import parallel_state as ps

    local = GlobalBatch.of(mask)
    counts = torch.tensor([local.num_tokens, local.num_seqs], dtype=torch.float64)
    if ps.get_data_parallel_world_size() > 1:
        counts = device.to_device(counts)
        dist.all_reduce(counts, group=ps.get_data_parallel_group())
    tokens, seqs = counts.tolist()
    return GlobalBatch(tokens, seqs, loss_scale_factor)


def _train(role, batch, *, name, mini_batch_size, micro, epochs, keys, loss_fn, loss_scale_factor) -> dict:
    """Optimizer steps over mini-batches, all in one residency of the role (``MegatronRole.train``).
    ``loss_fn(mb, output, whole)`` returns a micro-batch's share of the mini-batch loss (normalized by
    ``whole``, the mini-batch's global counts) and its metrics.

    megatron's schedule divides every micro-batch loss by the number of micro-batches and its DDP averages
    gradients over data-parallel ranks; both are undone here, so the gradient is exactly that of the
    mini-batch loss however the mini-batch is split into micro-batches and ranks. Losses in the metrics
    are scaled the same way: their mean over micro-batches and ranks is the mini-batch loss. With a token
    budget (``micro``) the number of micro-batches varies between mini-batches, and the data-parallel ranks
    agree on one (``agreed_count``): that count is undone, and megatron's DDP reduces gradients once, after
    all of them.

    ``perf/<name>_update/*``: the tokens of this rank's rows (attention mask) and the tokens its forwards
    computed (padding included, a shared prompt once), over the whole update."""
    from megatron.core import parallel_state as ps

    tokens = {"real_tokens": 0, "computed_tokens": 0}

    def steps():  # built as the role asks for them, inside its residency
        for _ in range(epochs):
            for mini in batch.split(mini_batch_size):
                mbs, _ = micro_batches_of(role, mini, micro, keys)
                tokens["real_tokens"] += int(mini.tensors["attention_mask"].sum())
                tokens["computed_tokens"] += row_layout.computed_tokens(mbs)
                whole = global_batch(mini.tensors["response_mask"], loss_scale_factor)
                scale = len(mbs) * ps.get_data_parallel_world_size()

                def scaled(mb, output, whole=whole, scale=scale):
                    loss, metrics = loss_fn(mb, output, whole)
                    # clone: megatron's schedule divides the returned loss in place (and multiplies it by the
                    # CP size: context_parallel.py)
                    return loss * scale, {k: (v * scale).detach().clone() if k.endswith("loss") else v
                                          for k, v in metrics.items()}

                yield mbs, scaled

    metrics = mean_by_key(role.train(steps()))  # update_skipped: the fraction of steps whose update was skipped
    metrics.update({f"perf/{name}_update/{k}": float(v) for k, v in tokens.items()})
    metrics[f"perf/{name}_update/computed_per_real_token"] = tokens["computed_tokens"] / max(tokens["real_tokens"], 1)
    return metrics


def _role_step_metrics(metrics: dict, prefix: str) -> dict:
    """The optimizer steps' metrics under the role's prefix, as verl's trainer names them (actor/..., critic/...)."""
    for key in ("grad_norm", "lr", "update_skipped"):
        metrics[f"{prefix}/{key}"] = metrics.pop(key)
    return metrics


def _policy_update_keys(batch: Batch, actor_cfg, on_policy: bool, measure: bool) -> list[str]:
    """The batch tensors the policy update reads: the old log-probs unless on-policy, the reference's for the
    KL loss, the rollout's to measure the mismatch, and rollout correction's weights when the batch has them."""
    return ["advantages", "response_mask"] + ([] if on_policy else ["old_log_probs"]) + (
        ["ref_log_prob"] if actor_cfg.use_kl_loss else []) + (["rollout_log_probs"] if measure else []) + (
        ["rollout_is_weights"] if "rollout_is_weights" in batch.tensors else [])


def _teacher_keys(distillation) -> list[str]:
    """The batch tensors a distillation loss reads: the teachers' log-probs of the sampled tokens, or their top-k."""
    if distillation is None:
        return []
    return ["teacher_topk_log_probs", "teacher_topk_ids"] if distillation.uses_topk else [
        "teacher_log_probs"]


def _surrogate_loss(old, log_prob, mb: dict, whole: GlobalBatch, actor_cfg, rollout_correction):
    """The policy-gradient loss of a micro-batch and its metrics: verl's bypass loss in rollout correction's
    ``bypass_mode``, else the loss ``actor.policy_loss.loss_mode`` names."""
    a, rc, mask = actor_cfg, rollout_correction, mb["response_mask"]
    if rc is not None and rc.bypass_mode:  # verl's apply_bypass_mode: loss_mode becomes bypass_mode
        return compute_policy_loss_bypass_mode(old, log_prob, mb["advantages"], mask, loss_agg_mode=a.loss_agg_mode,
                                               config=a, global_batch=whole, rollout_correction=rc)
    # actor.policy_loss.loss_mode picks the loss; each reads its settings from the actor config
    weights = {"rollout_is_weights": mb["rollout_is_weights"]} if "rollout_is_weights" in mb else {}
    return POLICY_LOSSES.get(a.policy_loss.loss_mode)(
        old, log_prob, mb["advantages"], mask, loss_agg_mode=a.loss_agg_mode, config=a, global_batch=whole,
        **weights)


def _with_entropy(loss, metrics: dict, logits, mb: dict, whole: GlobalBatch, actor_cfg, temperature: float,
                  on_policy: bool):
    """``loss`` less the entropy bonus (``entropy_coeff``, reported as actor/entropy_loss); an on-policy update also
    reports the entropy (actor/entropy) that the forward it skipped would have."""
    a, mask = actor_cfg, mb["response_mask"]
    entropy = None
    if a.entropy_coeff:
        entropy = response_entropy(logits, mb, temperature, a.entropy_chunk)
        entropy_loss = aggregate_loss(entropy, mask, a.loss_agg_mode, whole)
        loss = loss - a.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach()
    if on_policy:
        with torch.no_grad():
            if entropy is None:
                entropy = response_entropy(logits, mb, temperature, a.entropy_chunk)
            metrics["actor/entropy"] = masked_mean(entropy, mask)
    return loss


def _with_teachers(loss, metrics: dict, logits, log_prob, old, mb: dict, whole: GlobalBatch, actor_cfg, distillation,
                   temperature: float):
    """``loss`` plus what pulls the policy toward another model: the KL loss to the reference (verl's actor/kl_loss and
    actor/kl_coef) and the distillation term toward each row's teacher (``distillation``: the loss section, or None)."""
    a, mask = actor_cfg, mb["response_mask"]
    if a.use_kl_loss:
        kl, kl_metrics = kl_loss(log_prob, mb["ref_log_prob"], mask, a, whole)
        loss = loss + a.kl_loss_coef * kl
        metrics.update({f"actor/{k}": v for k, v in kl_metrics.items()})
    if distillation is not None:
        losses, d_metrics = _distillation_losses(logits, log_prob, mb, distillation, temperature)
        loss, more = distilled_loss(loss, losses, log_prob, old, mask, distillation, loss_agg_mode=a.loss_agg_mode,
                                    global_batch=whole, rollout_is_weights=mb.get("rollout_is_weights"))
        metrics.update({f"actor/{k}": v for k, v in {**d_metrics, **more}.items()})
    return loss, metrics


def _distillation_losses(logits, log_prob, mb: dict, d, temperature: float):
    """Each response token's distillation loss and its metrics: an estimator of the reverse KL at the sampled token
    from the teacher's log-prob of it, or forward_kl_topk from the student's logits (workers/topk_ops.py)."""
    if not d.uses_topk:
        return estimator_terms(log_prob, mb["teacher_log_probs"], mb["response_mask"], d.loss_mode)
    terms = student_topk_kl(picked(_tempered(logits, temperature), mb), mb, d.log_prob_min_clamp)
    terms = {key: zero_past_end(v, mb) for key, v in terms.items()}
    return terms["losses"], topk_metrics(terms, mb["response_mask"], d.topk)


def update_policy(role: MegatronRole, batch: Batch, actor_cfg, dp_size: int, rollout_n: int = 1,
                  rollout_correction=None, temperature: float = 1.0, distillation=None) -> dict:
    """PPO clipped policy loss (- entropy_coeff x entropy, + optional KL-to-reference loss) over mini-batches of
    this DP shard; a mini-batch is ``ppo_mini_batch_size`` prompts with their ``rollout_n`` responses each
    (verl's meaning), under the policy at ``temperature`` (the run plan's ``ActorSpec.logit_temperature``). The
    entropy bonus is verl 0.9.1's (workers/utils/losses.py ``ppo_loss``): the entropy of the response tokens, with its gradient,
    aggregated with ``loss_agg_mode`` over the mini-batch.

    Rollout correction (``algorithm.rollout_correction``, algorithms/rollout_correction.py): the batch's
    ``rollout_is_weights`` go to the loss, as verl passes them; in ``bypass_mode`` the old log-probs are the
    rollout's and verl's bypass loss replaces ``loss_mode``; an on-policy update measures the mismatch of its
    own (detached) log-probs to the rollout's, per micro-batch (averaged, as verl's bypass metrics are).
    ``distillation`` (the distillation loss section, or None): the batch's ``teacher_log_probs`` give the distillation
    term, combined with the loss above as verl's distillation_ppo_loss does (algorithms/distillation.py)."""
    a, rc = actor_cfg, rollout_correction
    # Without old log-probs the update is on-policy (the run plan's needs.on_policy_reuse): its own log-probs,
    # detached, are the old ones (ratio 1, the same gradient), and it reports the entropy the skipped
    # forward would have.
    on_policy = "old_log_probs" not in batch.tensors
    measure = on_policy and "rollout_log_probs" in batch.tensors
    keys = _policy_update_keys(batch, a, on_policy, measure) + list(routes_of(role, batch)) + _teacher_keys(distillation)

    def loss_fn(mb, logits, whole):
        log_prob = response_log_probs(logits, mb, temperature)
        mask = mb["response_mask"]
        old = log_prob.detach() if on_policy else mb["old_log_probs"]
        loss, m = _surrogate_loss(old, log_prob, mb, whole, a, rc)
        # verl's trainer prefixes every update metric with actor/ (rename_dict): bypass_mode's rollout_corr/...
        # become actor/rollout_corr/...
        metrics = {"actor/pg_loss": loss.detach(), **{f"actor/{k}": v for k, v in m.items()}}
        if measure:
            with torch.no_grad():
                metrics.update(mismatch_metrics(log_prob.detach(), mb["rollout_log_probs"], mask,
                                                2.0 if rc is None else rc.rollout_is_threshold))
        loss = _with_entropy(loss, metrics, logits, mb, whole, a, temperature, on_policy)
        if "routed_experts" in mb:  # routing replay: the share of replayed routes the routers would not choose
            r = role.routing.outputs(mb)
            metrics["actor/routing_replay/update_differing_fraction"] = (r["routing_differing"].sum()
                                                                         / r["routing_counted"].sum().clamp(min=1))
        return _with_teachers(loss, metrics, logits, log_prob, old, mb, whole, a, distillation, temperature)

    metrics = _train(role, batch, name="actor", mini_batch_size=mini_batch_rows(a.ppo_mini_batch_size, rollout_n, dp_size),
                     micro=_update_batching(a, "actor"), epochs=a.ppo_epochs, keys=keys, loss_fn=loss_fn,
                     loss_scale_factor=a.loss_scale_factor)
    return _role_step_metrics(metrics, "actor")


def update_value(role: MegatronRole, batch: Batch, critic_cfg, dp_size: int, rollout_n: int = 1) -> dict:
    """Clipped value loss over mini-batches of this DP shard (``ppo_mini_batch_size`` prompts each)."""
    c = critic_cfg

    def loss_fn(mb, v, whole):
        vpreds = response_values(v, mb)
        loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                    cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                    global_batch=whole)
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}

    metrics = _train(role, batch, name="critic", mini_batch_size=mini_batch_rows(c.ppo_mini_batch_size, rollout_n, dp_size),
                     micro=_update_batching(c, "critic"), epochs=c.ppo_epochs,
                     keys=["values", "returns", "response_mask"], loss_fn=loss_fn,
                     loss_scale_factor=c.loss_scale_factor)
    return _role_step_metrics(metrics, "critic")
