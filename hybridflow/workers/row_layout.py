"""Row layout: how a rollout batch's rows become megatron micro-batches whose attention is exact.

Rows arrive as left-padded prompts followed by right-padded responses. Fused GPU attention (TE's
flash/cuDNN kernels) applies the causal mask only, so rows are rotated so that no real token ever sees a
pad; on the CPU path, rows of a GRPO group can share one packed prompt instead. Every role (policy,
reference, value) lays its micro-batches out here, and reads its per-response-token outputs back through
the ``sample_row`` / ``response_index`` / ``response_valid`` keys this module writes.
"""

from __future__ import annotations

import torch

from hybridflow.protocol import Batch

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
    P, R = prompt_and_response_width(batch)
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


def prompt_and_response_width(batch: Batch) -> tuple[int, int]:
    r = batch.tensors["responses"].shape[1]
    return batch.tensors["input_ids"].shape[1] - r, r
