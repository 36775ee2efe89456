"""What the workers compute with a MegatronRole: log-probs, values, and the PPO policy/value updates.

Plain functions of (role, batch, settings), so equivalence tests drive exactly the code the workers run.
Every rank of the role calls them with its data-parallel shard; outputs exist on the last pipeline stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.algorithms import (GlobalBatch, aggregate_loss, compute_policy_loss_vanilla, kl_penalty, masked_mean,
                                   value_loss)
from hybridflow.megatron.role import MegatronRole, token_log_probs, vocab_parallel_entropy
from hybridflow.protocol import Batch
from hybridflow.util import mean_by_key

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def micro_batches(batch: Batch, size: int, extra_keys=(), seq_multiple: int = 1,
                  share_prompts: bool = False) -> list[dict]:
    """Dicts for megatron's schedule, one per ``size`` rows, laid out so the model's attention is exact.

    Rows arrive as left-padded prompts followed by right-padded responses. By default each row is rotated
    so that its tokens come first and all of its padding follows them: a causal-only attention (TE's
    flash/cuDNN kernels ignore any padding mask) then never lets a real token see a pad. Columns that no
    row of the micro-batch uses are trimmed. With ``share_prompts`` (the CPU path: megatron's local
    attention honours an explicit mask), consecutive rows with the same prompt (a GRPO group) become one
    packed row instead: the prompt once, then each response, with a mask letting every response see the
    prompt and itself only and positions continuing from the prompt (``shared_prompt_rows``).

    The length is padded to ``seq_multiple`` (sequence parallel splits it across TP ranks). Outputs are
    read per response token: ``sample_row`` [N] is the packed row of each of the N input rows,
    ``response_index`` [N, R] the positions whose outputs predict its response tokens, ``response_labels``
    [N, R] those tokens and ``response_valid`` [N, R] where they exist. Built on the host; the engine moves
    each micro-batch to the device right before its forward.
    """
    P, R = _lengths(batch)
    out = []
    for mb in batch.select(tensor_keys=[*MODEL_INPUTS, *extra_keys]).split(size):
        d = shared_prompt_rows(mb, P, seq_multiple) if share_prompts else None
        out.append({**(d or _rotated_rows(mb, P, R, seq_multiple)), **{k: mb.tensors[k] for k in extra_keys}})
    return out


def _rotated_rows(mb: Batch, P: int, R: int, seq_multiple: int) -> dict:
    mask = mb.tensors["attention_mask"]
    s = mask.shape[1]
    lead = (mask.cumsum(1) == 0).sum(1)  # left padding of each row
    rotate = (torch.arange(s)[None] + lead[:, None]) % s
    length = int(mask.sum(1).max())
    length += -length % seq_multiple
    d = {}
    for k in MODEL_INPUTS:
        t = mb.tensors[k].gather(1, rotate)[:, :length]
        d[k] = torch.nn.functional.pad(t, (0, length - t.shape[1])) if length > s else t
    d["sample_row"] = torch.arange(len(mb))
    d["response_index"] = ((P - 1 - lead)[:, None] + torch.arange(R)[None]).clamp(max=length - 1)
    d["response_labels"] = mb.tensors["input_ids"][:, P:]
    d["response_valid"] = mask[:, P:]
    return d


def shared_prompt_rows(mb: Batch, P: int, seq_multiple: int = 1) -> dict | None:
    """One packed row per run of consecutive rows with the same prompt: [prompt, response 1, ...,
    response n], with ``packed_mask`` [G, 1, S, S] (True = masked: megatron's convention) letting each
    token see the prompt's earlier tokens and its own response's, and ``position_ids`` restarting each
    response right after the prompt, so every output equals the unpacked row's. None when no prompt
    repeats (nothing to share)."""
    ids, mask = mb.tensors["input_ids"], mb.tensors["attention_mask"].bool()
    prompts = torch.where(mask[:, :P], ids[:, :P], -1)
    starts = [0] + [i for i in range(1, len(mb)) if not torch.equal(prompts[i], prompts[i - 1])]
    if len(starts) == len(mb):
        return None
    groups = list(zip(starts, starts[1:] + [len(mb)]))
    rows, segments, positions, index = [], [], [], torch.zeros(len(mb), mask.shape[1] - P, dtype=torch.long)
    for first, end in groups:
        prompt = ids[first, :P][mask[first, :P]]
        tokens, seg, pos = [prompt], [torch.zeros(len(prompt), dtype=torch.long)], [torch.arange(len(prompt))]
        at = len(prompt)
        for i in range(first, end):
            resp = ids[i, P:][mask[i, P:]]
            tokens.append(resp)
            seg.append(torch.full((len(resp),), i - first + 1))
            pos.append(len(prompt) + torch.arange(len(resp)))
            # the prompt's last token predicts the first response token; each response token the next
            index[i, 0] = len(prompt) - 1
            index[i, 1:len(resp)] = at + torch.arange(max(len(resp) - 1, 0))
            at += len(resp)
        rows.append(torch.cat(tokens))
        segments.append(torch.cat(seg))
        positions.append(torch.cat(pos))
    length = max(len(r) for r in rows)
    length += -length % seq_multiple
    pad = lambda ts, v: torch.stack([torch.nn.functional.pad(t, (0, length - len(t)), value=v) for t in ts])  # noqa: E731
    seg = pad(segments, -1)  # -1: padding
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & (((k == 0) & (q >= 0)) | (k == q))
    allowed |= torch.eye(length, dtype=torch.bool)  # padding attends to itself: no empty softmax row
    return {
        "input_ids": pad(rows, 0), "position_ids": pad(positions, 0), "packed_mask": ~allowed[:, None],
        "sample_row": torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([e - f for f, e in groups])),
        "response_index": index, "response_labels": ids[:, P:], "response_valid": mask[:, P:].long(),
    }


def _picked(per_position: torch.Tensor, mb: dict) -> torch.Tensor:
    """Outputs [rows, s, ...] at the positions predicting each response token: [N, R, ...]."""
    return per_position[mb["sample_row"][:, None], mb["response_index"]]


def _valid(x: torch.Tensor, mb: dict) -> torch.Tensor:
    """0 where a row's response has ended."""
    return torch.where(mb["response_valid"].bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def response_log_probs(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    """log p(response token) [N, R] from vocab-parallel logits [rows, s, V/t] (differentiable)."""
    return _valid(token_log_probs(_picked(logits, mb), mb["response_labels"]), mb)


def response_entropy(logits: torch.Tensor, mb: dict) -> torch.Tensor:
    return _valid(vocab_parallel_entropy(_picked(logits, mb)), mb)


def response_values(values: torch.Tensor, mb: dict) -> torch.Tensor:
    """Values [N, R] at the positions that predict each response token, from the value head's [rows, s, 1]."""
    return _valid(_picked(values[..., 0].float(), mb), mb)


def _lengths(batch: Batch) -> tuple[int, int]:
    r = batch.tensors["responses"].shape[1]
    return batch.tensors["input_ids"].shape[1] - r, r


def last_stage_batch(**tensors) -> Batch | None:
    """A Batch of the outputs; None on pipeline stages that have none (the controller collects only
    from the last stage)."""
    if any(t is None for t in tensors.values()):
        return None
    return Batch.from_dict(tensors=tensors)


def _concat(outputs: list[dict], key: str):
    return torch.cat([o[key] for o in outputs]) if outputs else None


def _micro_batches(role: MegatronRole, batch: Batch, size: int, extra_keys=()) -> list[dict]:
    return micro_batches(batch, size, extra_keys, role.shard.tp_size if role.tf_config.sequence_parallel else 1,
                         share_prompts=role.shares_prompts)


def log_probs(role: MegatronRole, batch: Batch, micro_batch_size: int, with_entropy: bool = False) -> dict:
    """{'log_probs': [b, R], 'entropy': [b, R]} of the response tokens (None off the last stage)."""
    def output_fn(mb, logits):
        out = {"log_probs": response_log_probs(logits, mb)}
        if with_entropy:
            out["entropy"] = response_entropy(logits, mb)
        return out

    outs = role.forward(_micro_batches(role, batch, micro_batch_size), output_fn)
    return {k: _concat(outs, k) for k in (("log_probs", "entropy") if with_entropy else ("log_probs",))}


def values(role: MegatronRole, batch: Batch, micro_batch_size: int):
    """Critic values [b, R] at the positions that predict each response token."""
    outs = role.forward(_micro_batches(role, batch, micro_batch_size),
                        lambda mb, v: {"values": response_values(v, mb)})
    return _concat(outs, "values")


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


def _train(role, batch, *, mini_batch_size, micro_batch_size, epochs, keys, loss_fn, loss_scale_factor) -> dict:
    """Optimizer steps over mini-batches. ``loss_fn(mb, output, whole)`` returns a micro-batch's share of
    the mini-batch loss (normalized by ``whole``, the mini-batch's global counts) and its metrics.

    megatron's schedule divides every micro-batch loss by the number of micro-batches and its DDP averages
    gradients over data-parallel ranks; both are undone here, so the gradient is exactly that of the
    mini-batch loss however the mini-batch is split into micro-batches and ranks. Losses in the metrics
    are scaled the same way: their mean over micro-batches and ranks is the mini-batch loss."""
    from megatron.core import parallel_state as ps

    all_metrics = []
    for _ in range(epochs):
        for mini in batch.split(mini_batch_size):
            mbs = _micro_batches(role, mini, micro_batch_size, keys)
            whole = global_batch(mini.tensors["response_mask"], loss_scale_factor)
            scale = len(mbs) * ps.get_data_parallel_world_size()

            def scaled(mb, output, whole=whole, scale=scale):
                loss, metrics = loss_fn(mb, output, whole)
                # clone: megatron's schedule divides the returned loss in place
                return loss * scale, {k: (v * scale).detach().clone() if k.endswith("loss") else v
                                      for k, v in metrics.items()}

            all_metrics.append(role.train_mini_batch(mbs, scaled))
    return mean_by_key(all_metrics)  # update_skipped: the fraction of steps megatron's loss scaler skipped


def update_policy(role: MegatronRole, batch: Batch, actor_cfg, dp_size: int, rollout_n: int = 1) -> dict:
    """PPO clipped policy loss (+ optional KL-to-reference loss) over mini-batches of this DP shard; a
    mini-batch is ``ppo_mini_batch_size`` prompts with their ``rollout_n`` responses each (verl's meaning)."""
    a = actor_cfg
    # Without old log-probs the update is on-policy (PPOTrainer.update_is_on_policy): its own log-probs,
    # detached, are the old ones (ratio 1, the same gradient), and it reports the entropy the skipped
    # forward would have.
    on_policy = "old_log_probs" not in batch.tensors
    keys = ["advantages", "response_mask"] + ([] if on_policy else ["old_log_probs"]) + (
        ["ref_log_prob"] if a.use_kl_loss else [])

    def loss_fn(mb, logits, whole):
        log_prob = response_log_probs(logits, mb)
        mask = mb["response_mask"]
        old = log_prob.detach() if on_policy else mb["old_log_probs"]
        loss, m = compute_policy_loss_vanilla(
            old, log_prob, mb["advantages"], mask, loss_agg_mode=a.loss_agg_mode,
            clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
            global_batch=whole)
        metrics = {"actor/pg_loss": loss.detach(), **{f"actor/{k}": v for k, v in m.items()}}
        if on_policy:
            metrics["actor/entropy"] = masked_mean(response_entropy(logits, mb), mask)
        if a.use_kl_loss:
            kl = aggregate_loss(kl_penalty(log_prob, mb["ref_log_prob"], a.kl_loss_type), mask, a.loss_agg_mode,
                                whole)
            loss = loss + a.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        return loss, metrics

    metrics = _train(role, batch, mini_batch_size=a.ppo_mini_batch_size * rollout_n // dp_size,
                     micro_batch_size=a.ppo_micro_batch_size_per_gpu, epochs=a.ppo_epochs, keys=keys, loss_fn=loss_fn,
                     loss_scale_factor=a.loss_scale_factor)
    metrics["actor/grad_norm"] = metrics.pop("grad_norm")
    metrics["actor/update_skipped"] = metrics.pop("update_skipped")
    return metrics


def update_value(role: MegatronRole, batch: Batch, critic_cfg, dp_size: int, rollout_n: int = 1) -> dict:
    """Clipped value loss over mini-batches of this DP shard (``ppo_mini_batch_size`` prompts each)."""
    c = critic_cfg

    def loss_fn(mb, v, whole):
        vpreds = response_values(v, mb)
        loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                    cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                    global_batch=whole)
        return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}

    metrics = _train(role, batch, mini_batch_size=c.ppo_mini_batch_size * rollout_n // dp_size,
                     micro_batch_size=c.ppo_micro_batch_size_per_gpu, epochs=c.ppo_epochs,
                     keys=["values", "returns", "response_mask"], loss_fn=loss_fn,
                     loss_scale_factor=c.loss_scale_factor)
    metrics["critic/grad_norm"] = metrics.pop("grad_norm")
    metrics["critic/update_skipped"] = metrics.pop("update_skipped")
    return metrics
