"""Row layout: how a rollout batch's rows become megatron micro-batches whose attention is exact.

Rows arrive as left-padded prompts followed by right-padded responses. Fused GPU attention (TE's
flash/cuDNN kernels) applies the causal mask only, so rows are rotated so that no real token ever sees a
pad; on the CPU path, rows of a GRPO group can share one packed prompt instead. With a token budget
(dynamic batch size) the rows of a micro-batch are packed end to end into one row: on CPU with a
block-diagonal mask, on GPU through TE's packed-sequence (THD) attention. Every role (policy, reference,
value) lays its micro-batches out here, and reads its per-response-token outputs back through the
``sample_row`` / ``response_index`` / ``response_valid`` keys this module writes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch

from hybridflow.protocol import Batch

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


@dataclass(frozen=True)
class TokenBudget:
    """Dynamic batch size: micro-batches of at most ``max_tokens`` tokens on a rank instead of a row count
    (verl's ``use_dynamic_bsz`` with ``*_max_token_len_per_gpu``, which counts each row's attention mask; a
    prompt shared by a group's rows counts once here, as it is computed once); ``key`` is that config key,
    named when a row does not fit."""

    max_tokens: int
    key: str


def micro_batches(batch: Batch, size: int, extra_keys=(), seq_multiple: int = 1,
                  share_prompts: bool = False, count: int | None = None) -> list[dict]:
    """Dicts for megatron's schedule, one per ``size`` rows (or, with a ``count`` other than that gives, ``count``
    micro-batches of near-equal rows), laid out so the model's attention is exact.

    Rows arrive as left-padded prompts followed by right-padded responses. By default each row is rotated
    so that its tokens come first and all of its padding follows them: a causal-only attention (TE's
    flash/cuDNN kernels ignore any padding mask) then never lets a real token see a pad. Columns that no
    row of the micro-batch uses are trimmed. With ``share_prompts`` (the CPU path: megatron's local
    attention honours an explicit mask), consecutive rows with the same prompt (a GRPO group) become one
    packed row instead: the prompt once, then each response, with a mask letting every response see the
    prompt and itself only and positions continuing from the prompt (``shared_prompt_rows``).

    The length is padded to ``seq_multiple`` (sequence parallel splits it across TP ranks). Outputs are
    read per response token: ``sample_row`` [N] is the packed row of each of the N input rows,
    ``token_position`` [N, T] the flat place (packed row x length + position) of each token of each input row
    (-1 for padding; a shared prompt's tokens are one place for all of its rows),
    ``response_index`` [N, R] the positions whose outputs predict its response tokens, ``response_labels``
    [N, R] those tokens and ``response_valid`` [N, R] where they exist. Built on the host; the engine moves
    each micro-batch to the device right before its forward.
    """
    P, R = prompt_and_response_width(batch)
    out = []
    selected = batch.select(tensor_keys=[*MODEL_INPUTS, *extra_keys])
    if count is None or count == -(-len(batch) // size):
        parts = selected.split(size)
    else:
        parts = [selected[rows.numpy()] for rows in torch.arange(len(batch)).tensor_split(count)]
    for mb in parts:
        d = shared_prompt_rows(mb, P, seq_multiple) if share_prompts else None
        out.append({**(d or _rotated_rows(mb, P, R, seq_multiple)), **{k: mb.tensors[k] for k in extra_keys}})
    return out


def micro_batch_count(batch: Batch, budget: TokenBudget, share_prompts: bool = False) -> int:
    """How many micro-batches ``token_micro_batches`` forms for ``batch`` on its own (the fewest that fit)."""
    P, _ = prompt_and_response_width(batch)
    units = _units(batch, P, budget.max_tokens, share_prompts)
    return len(token_partitions([cost for _, _, cost in units], budget.max_tokens))


def token_micro_batches(batch: Batch, budget: TokenBudget, extra_keys=(), seq_multiple: int = 1,
                        share_prompts: bool = False, thd: bool = False, count: int | None = None,
                        unit_multiple: int = 1) -> tuple[list[dict], torch.Tensor]:
    """Micro-batches of at most ``budget.max_tokens`` tokens each, every one a single packed row [1, S]: its
    rows' tokens end to end, no padding computed (but the < ``seq_multiple`` tokens sequence parallel needs
    at the end). Returns the micro-batches and ``order`` [b]: the batch row of each output
    row when the micro-batches' per-row outputs are concatenated (``restore`` puts them back).

    Rows are grouped into units, a unit's tokens staying together: a row (prompt + response); with
    ``share_prompts`` a run of consecutive rows with the same prompt (a GRPO group), which costs its prompt
    once plus its responses, cut into pieces where it alone exceeds the budget. The fewest micro-batches
    whose Karmarkar-Karp balanced token sums fit the budget are formed (verl 0.9.1's
    ``rearrange_micro_batches``; it balances an attention-weighted workload and orders micro-batches for
    pipeline bubbles, we balance tokens and keep the rows' order). Micro-batch counts may differ between
    data-parallel ranks: each micro-batch's loss is normalized by the whole mini-batch
    (role_ops._train), and megatron reduces gradients once per step, after all micro-batches. ``count``: the
    number the data-parallel ranks agreed on (role_ops: the largest rank's ``micro_batch_count``; with expert
    parallelism every micro-batch's all-to-all needs all of its ranks), at least this rank's own: its rows are
    spread over that many, a GRPO group's rows apart where they must be. The ranks hold equal numbers of rows
    (dispatch splits evenly), so the count never exceeds a rank's rows.

    Attention stays within a row (a unit's responses see its prompt): with ``thd`` (GPU, TE) through
    ``cu_seqlens`` [units + 1 (+ 1 for the trailing pad)] for megatron's ``PackedSeqParams``, which restarts
    rotary positions per sequence (no prompt sharing there: it needs a non-causal block structure); else
    (CPU: megatron's local attention asserts ``packed_seq_params is None`` and honours an explicit mask)
    through ``packed_mask`` and explicit ``position_ids`` (the role applies them with
    ``rope_at_positions``). The local attention computes the whole [S, S] score matrix, so on CPU the cost
    of attention grows with the square of the budget. With ``thd`` each sequence ends in padding to
    ``unit_multiple`` tokens (CP's 2 x CP chunks: up to 2 x CP - 1 tokens a row beyond the budget), after its
    tokens, which causal attention keeps it out of.
    """
    if thd and share_prompts:
        raise ValueError("packed-sequence (THD) attention is causal per sequence: it cannot share prompts")
    P, _ = prompt_and_response_width(batch)
    units = _budget_units(batch, P, budget, share_prompts, count)
    parts = token_partitions([cost for _, _, cost in units], budget.max_tokens, count or 1)
    selected = batch.select(tensor_keys=[*MODEL_INPUTS, *extra_keys])
    out, order = [], []
    for part in parts:
        rows = [r for u in part for r in range(units[u][0], units[u][1])]
        sizes = [units[u][1] - units[u][0] for u in part]  # each unit's rows, then where they are in ``rows``
        local = [(end - n, end) for n, end in zip(sizes, itertools.accumulate(sizes))]
        mb = selected[rows]
        d = _packed_rows(mb, P, [local], seq_multiple, cu_seqlens=thd, unit_multiple=unit_multiple)
        out.append({**d, **{k: mb.tensors[k] for k in extra_keys}})
        order.extend(rows)
    return out, torch.tensor(order, dtype=torch.long)


def _budget_units(batch: Batch, P: int, budget: TokenBudget, share_prompts: bool, count: int | None) -> list:
    """``token_micro_batches``' units (first row, end row, tokens), each within the budget; one row each where the
    ranks agreed on more micro-batches than there are units."""
    lengths = batch.tensors["attention_mask"].bool().sum(1)
    longest = int(lengths.max())
    if longest > budget.max_tokens:
        row = int(lengths.argmax())
        raise ValueError(f"{budget.key} ({budget.max_tokens}) is less than the longest row ({longest} tokens, "
                         f"row {row}): it must hold at least one prompt + response")
    units = _units(batch, P, budget.max_tokens, share_prompts)
    if count is not None and count > len(units):  # more micro-batches than units: one row each
        if count > len(batch):
            raise ValueError(f"{count} micro-batches agreed for {len(batch)} rows: the data-parallel ranks hold "
                             "different numbers of rows")
        units = [(r, r + 1, int(lengths[r])) for r in range(len(batch))]
    return units


def restore(outputs: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Per-row outputs concatenated in micro-batch order, back in the batch's row order."""
    return outputs[torch.argsort(order)]


def computed_tokens(mbs: list[dict]) -> int:
    """Tokens the model computes for these micro-batches (padding included)."""
    return sum(mb["input_ids"].numel() for mb in mbs)


def _units(batch: Batch, P: int, max_tokens: int, share_prompts: bool) -> list[tuple[int, int, int]]:
    """(first row, end row, tokens) of the batch's indivisible pieces, in row order."""
    ids, mask = batch.tensors["input_ids"], batch.tensors["attention_mask"].bool()
    prompt_len, response_len = mask[:, :P].sum(1).tolist(), mask[:, P:].sum(1).tolist()
    if not share_prompts:
        return [(i, i + 1, prompt_len[i] + response_len[i]) for i in range(len(batch))]
    prompts = torch.where(mask[:, :P], ids[:, :P], -1)
    units, first, cost = [], 0, prompt_len[0] + response_len[0]
    for i in range(1, len(batch)):
        if torch.equal(prompts[i], prompts[first]) and cost + response_len[i] <= max_tokens:
            cost += response_len[i]
            continue
        units.append((first, i, cost))
        first, cost = i, prompt_len[i] + response_len[i]
    return units + [(first, len(batch), cost)]


def token_partitions(costs: list[int], max_tokens: int, min_groups: int = 1) -> list[list[int]]:
    """The fewest groups (at least ``min_groups``, at most one per item) of ``costs``' indices, balanced by
    Karmarkar-Karp, whose sums are each at most ``max_tokens`` (every cost must fit); indices ascending in each
    group, groups ordered by their first."""
    if max(costs) > max_tokens:
        raise ValueError(f"an item of {max(costs)} tokens exceeds the budget of {max_tokens}")
    k = min(len(costs), max(1, min_groups, math.ceil(sum(costs) / max_tokens)))
    while True:  # the ceiling is a lower bound: items are indivisible
        parts = [p for p in balanced_partitions(costs, k) if p]
        if all(sum(costs[i] for i in p) <= max_tokens for p in parts):
            return sorted(parts)
        k += 1  # terminates: at k == len(costs) every group holds one item


def balanced_partitions(weights: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of ``weights`` split into ``k`` groups of near-equal sums by the largest differencing method
    (Karmarkar-Karp, as verl 0.9.1's ``get_seqlen_balanced_partitions``): repeatedly merge the two partial
    k-way partitions with the largest spread, pairing the heaviest group of one with the lightest of the
    other. ``equal_size``: every group gets ``len(weights) / k`` items (must divide). Indices ascending in
    each group."""
    if equal_size and len(weights) % k:
        raise ValueError(f"{len(weights)} items do not split into {k} equal groups")
    if len(weights) < k:
        raise ValueError(f"{len(weights)} items cannot fill {k} groups")
    ranked = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:  # k items of neighbouring weight start as one partition: merges keep sizes equal
        seeds = [ranked[s:s + k] for s in range(0, len(ranked), k)]
    else:
        seeds = [[i] for i in ranked]
    heap = []
    for n, seed in enumerate(seeds):
        groups = sorted(([weights[i], [i]] for i in seed), key=lambda g: -g[0])
        heapq.heappush(heap, _state(groups + [[0, []] for _ in range(k - len(seed))], n))
    n = len(seeds)
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[-1], heapq.heappop(heap)[-1]
        merged = [[ga[0] + gb[0], ga[1] + gb[1]] for ga, gb in zip(a, reversed(b))]
        heapq.heappush(heap, _state(sorted(merged, key=lambda g: -g[0]), n))
        n += 1
    return [sorted(g[1]) for g in heap[0][-1]]


def _state(groups: list, n: int) -> tuple:
    # heap order: the largest spread first, then the heaviest group; n keeps ties deterministic
    return (-(groups[0][0] - groups[-1][0]), -groups[0][0], n, groups)


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
    place = torch.arange(len(mb))[:, None] * length + (torch.arange(s)[None] - lead[:, None]) % s
    d["token_position"] = torch.where(mask.bool(), place, -1)
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
    return _packed_rows(mb, P, [[g] for g in zip(starts, starts[1:] + [len(mb)])], seq_multiple)


def _packed_rows(mb: Batch, P: int, layout: list[list[tuple[int, int]]], seq_multiple: int,
                 cu_seqlens: bool = False, unit_multiple: int = 1) -> dict:
    """Packed rows of ``mb``: ``layout[r]`` lists the units of packed row r, each a range of consecutive
    rows of ``mb`` sharing its first row's prompt, laid out [prompt, response, response, ...]. Tokens see
    earlier tokens of their own unit's prompt and their own response only (``packed_mask`` [rows, 1, S, S],
    True = masked), at the positions of the unpacked row (``position_ids``). With ``cu_seqlens`` (one
    packed row, single-row units) the units' boundaries are returned instead of the mask."""
    ids, mask = mb.tensors["input_ids"], mb.tensors["attention_mask"].bool()
    index, sample_row = torch.zeros(len(mb), mask.shape[1] - P, dtype=torch.long), torch.zeros(len(mb), dtype=torch.long)
    place = torch.full(mask.shape, -1, dtype=torch.long)  # each cell's place in its packed row (until flattened)
    rows, units, segments, positions, bounds = [], [], [], [], [0]
    for r, row_units in enumerate(layout):
        packed = _pack_row(ids, mask, P, row_units, unit_multiple, index, place, bounds)
        sample_row[[i for first, end in row_units for i in range(first, end)]] = r
        for out, t in zip((rows, units, segments, positions), packed):
            out.append(t)
    length = max(len(r) for r in rows)
    length += -length % seq_multiple
    pad = lambda ts, v: torch.stack([torch.nn.functional.pad(t, (0, length - len(t)), value=v)  # noqa: E731
                                     for t in ts])
    d = {"input_ids": pad(rows, 0), "position_ids": pad(positions, 0), "sample_row": sample_row,
         "token_position": torch.where(place >= 0, sample_row[:, None] * length + place, -1),
         "response_index": index, "response_labels": ids[:, P:], "response_valid": mask[:, P:].long()}
    if cu_seqlens:
        assert len(layout) == 1 and all(end - first == 1 for first, end in layout[0])
        if length > bounds[-1]:  # the sequence-parallel padding: a sequence of its own, seen by nothing real
            bounds.append(length)
        d["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        d["max_seqlen"] = max(b - a for a, b in zip(bounds, bounds[1:]))
        return d
    d["packed_mask"] = _unit_mask(pad(units, -1), pad(segments, -1))  # -1: padding
    return d


def _pack_row(ids, mask, P: int, row_units: list[tuple[int, int]], unit_multiple: int, index, place,
              bounds: list) -> tuple:
    """One packed row of ``_packed_rows``: its (tokens, unit, segment, position) per cell. Fills ``index`` (where
    each response token's predictor sits) and ``place`` (each cell's place in the row) for the row's samples, and
    appends each unit's end to ``bounds``."""
    tokens, unit, seg, pos, at = [], [], [], [], 0
    for u, (first, end) in enumerate(row_units):
        prompt = ids[first, :P][mask[first, :P]]
        base = at
        tokens.append(prompt)
        seg.append(torch.zeros(len(prompt), dtype=torch.long))
        pos.append(torch.arange(len(prompt)))
        at += len(prompt)
        for i in range(first, end):
            resp = ids[i, P:][mask[i, P:]]
            tokens.append(resp)
            seg.append(torch.full((len(resp),), i - first + 1))
            pos.append(len(prompt) + torch.arange(len(resp)))
            # the prompt's last token predicts the first response token; each response token the next
            index[i, 0] = base + len(prompt) - 1
            index[i, 1:len(resp)] = at + torch.arange(max(len(resp) - 1, 0))
            place[i, mask[i] & (torch.arange(mask.shape[1]) < P)] = base + torch.arange(len(prompt))
            place[i, P:][mask[i, P:]] = at + torch.arange(len(resp))
            at += len(resp)
        pad = -(at - base) % unit_multiple  # trailing, seen by no real token (THD under CP)
        if pad:
            tokens.append(torch.zeros(pad, dtype=ids.dtype))
            seg.append(torch.full((pad,), -1))
            pos.append(at - base + torch.arange(pad))
            at += pad
        unit.append(torch.full((at - base,), u))
        bounds.append(at)
    return torch.cat(tokens), torch.cat(unit), torch.cat(seg), torch.cat(pos)


def _unit_mask(unit: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """[rows, 1, S, S], True = masked: a token sees earlier tokens of its unit's prompt (segment 0) and of its own
    response (its segment); padding (-1) sees itself only, so no softmax row is empty."""
    length = unit.shape[1]
    same_unit = (unit[:, :, None] == unit[:, None, :]) & (unit[:, :, None] >= 0)
    q, k = seg[:, :, None], seg[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & same_unit & ((k == 0) | (k == q))
    allowed |= torch.eye(length, dtype=torch.bool)
    return ~allowed[:, None]


def prompt_and_response_width(batch: Batch) -> tuple[int, int]:
    r = batch.tensors["responses"].shape[1]
    return batch.tensors["input_ids"].shape[1] - r, r


def split_for_context_parallel(mb: dict, size: int, rank: int, explicit_mask: bool) -> dict:
    """This CP rank's part of a laid-out micro-batch (megatron/context_parallel.py): its two chunks of
    ``input_ids`` and ``position_ids``, and where its response tokens are: ``response_index`` becomes the local
    position predicting each response token this rank holds, ``cp_owned`` [N, R] marks those (the role_ops
    outputs sum the ranks' parts). A row is cut into 2 x ``size`` chunks (its length divides:
    ``plan.layout.context_chunks``); a packed-sequence (THD) row each of its sequences (``cu_seqlens``, each padded
    to 2 x ``size``: ``token_micro_batches``' ``unit_multiple``), as Transformer Engine's
    ``thd_get_partitioned_indices`` and megatron's THD rotary (rope_utils ``_get_thd_freqs_on_this_cp_rank``)
    expect. With ``explicit_mask`` (megatron's local attention: ``GatheredKVAttention``) ``packed_mask`` becomes
    the mask of the local queries against every key in gathered order, from the micro-batch's own mask, its
    sequences' (THD: the boundaries then leave the micro-batch) or the causal one; without it (TE's CP) the rows
    stay causal (or THD with the whole row's ``cu_seqlens``) and megatron's rotary table is sliced per rank."""
    from hybridflow.megatron.context_parallel import gathered_order, positions_held

    s = mb["input_ids"].shape[1]
    bounds = mb["cu_seqlens"].tolist() if "cu_seqlens" in mb else [0, s]
    own = positions_held(bounds, size, rank)
    d = dict(mb, input_ids=mb["input_ids"][:, own], position_ids=mb["position_ids"][:, own])
    if explicit_mask:
        mask = mb.get("packed_mask")
        if mask is None:
            sequence = torch.bucketize(torch.arange(s), torch.tensor(bounds[1:]), right=True)
            mask = (torch.ones(s, s, dtype=torch.bool).triu(1) | (sequence[:, None] != sequence[None, :]))[None, None]
        d["packed_mask"] = mask[:, :, own][..., gathered_order(bounds, size)]
        d.pop("cu_seqlens", None)
        d.pop("max_seqlen", None)
    if "response_index" in mb:  # laid out by this module (not a bare prompt batch: tools/check_model)
        local = torch.full((s,), -1, dtype=torch.long)
        local[own] = torch.arange(len(own))
        at = local[mb["response_index"]]
        d["cp_owned"] = (at >= 0) & mb["response_valid"].bool()
        d["response_index"] = at.clamp(min=0)
    return d
