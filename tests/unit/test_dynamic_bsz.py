"""Dynamic batch size and DP balancing, without megatron: the Karmarkar-Karp partitions, token-budget
micro-batches (budgets respected, outputs back in row order, exact packed layouts for the CPU mask and the
GPU cu_seqlens), the budget error naming its key, and the driver's balancing across data-parallel ranks."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.trainer.balance import balance_batch, balanced_order
from hybridflow.workers import row_layout
from hybridflow.workers.row_layout import TokenBudget, balanced_partitions, token_partitions

P, R = 7, 5


def rollout(prompt_lens, response_lens, group=1, seed=0):
    """Left-padded prompts (one per ``group`` consecutive rows) and right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    rows = len(response_lens)
    ids = torch.randint(3, 90, (rows, P + R), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        ids[i, :P] = ids[i // group * group, :P]
        mask[i, P - prompt_lens[i // group]:P] = 1
        mask[i, P:P + response_lens[i]] = 1
    ids = ids * mask
    uid = np.array([f"u{i // group}" for i in range(rows)], dtype=object)
    return Batch.from_dict(tensors=dict(input_ids=ids, attention_mask=mask, responses=ids[:, P:],
                                        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                        response_mask=mask[:, P:], row=torch.arange(rows)),
                           non_tensors={"uid": uid})


PROMPTS = [3, 7, 1, 5, 2, 6]
RESPONSES = [5, 0, 2, 4, 1, 5, 3, 3, 0, 5, 2, 1]  # two rows per prompt


# --- partitions ------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_balanced_partitions_cover_every_index_once_and_balance(k):
    weights = [int(w) for w in torch.randint(1, 100, (24,), generator=torch.Generator().manual_seed(k))]
    for equal in (False, True):
        parts = balanced_partitions(weights, k, equal_size=equal)
        assert sorted(i for p in parts for i in p) == list(range(len(weights)))
        assert all(p == sorted(p) and p for p in parts)
        if equal:
            assert {len(p) for p in parts} == {len(weights) // k}
        sums = [sum(weights[i] for i in p) for p in parts]
        # differencing leaves a spread below the largest item (far below in practice)
        assert max(sums) - min(sums) <= max(weights)


def test_balanced_partitions_is_the_largest_differencing_method():
    # the textbook case (Karmarkar & Karp): differencing 8-7, 6-5, then 4, 1, 1 gives {8, 6} / {7, 5, 4},
    # a difference of 2 where {8, 7} / {6, 5, 4} would be 0
    weights = [8, 7, 6, 5, 4]
    assert sorted(balanced_partitions(weights, 2)) == [[0, 2], [1, 3, 4]]
    assert sorted(balanced_partitions([10, 9, 3, 2, 1, 1], 3)) == [[0], [1], [2, 3, 4, 5]]  # as verl 0.9.1


def test_token_partitions_respect_the_budget_with_few_groups():
    costs = [int(c) for c in torch.randint(1, 40, (30,), generator=torch.Generator().manual_seed(1))]
    for budget in (40, 64, 100, 1000):
        parts = token_partitions(costs, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(costs)))
        assert all(sum(costs[i] for i in p) <= budget for p in parts)
        assert len(parts) >= math.ceil(sum(costs) / budget)
        assert len(parts) <= math.ceil(sum(costs) / budget) + 2  # balanced, not one row per group
        assert parts == sorted(parts)  # ordered by their first row


# --- token-budget micro-batches ----------------------------------------------------------------------

def _check_layout(batch, mbs, order, budget, shared):
    t = batch.tensors
    lengths = t["attention_mask"].sum(1)
    assert sorted(order.tolist()) == list(range(len(batch)))
    # per-row outputs come back in the batch's order
    rows = torch.cat([mb["row"] for mb in mbs])
    assert torch.equal(row_layout.restore(rows, order), t["row"])
    for mb in mbs:
        assert mb["input_ids"].shape[0] == 1  # one packed row
        members = mb["row"]
        if not shared:  # nothing is shared: the row holds exactly its rows' tokens
            assert int(lengths[members].sum()) <= budget
        assert mb["input_ids"].shape[1] <= budget + 1
        pos, ids = mb["position_ids"][0], mb["input_ids"][0]
        for j, i in enumerate(members.tolist()):
            n_prompt, n_resp = int(t["attention_mask"][i, :P].sum()), int(t["response_mask"][i].sum())
            idx = mb["response_index"][j, :n_resp]
            # the predicting tokens sit at the unpacked row's positions: prompt end - 1, then the response
            assert pos[idx].tolist() == list(range(n_prompt - 1, n_prompt - 1 + n_resp))
            if n_resp:
                assert torch.equal(ids[idx[1:]], t["responses"][i, :n_resp - 1])
                assert torch.equal(mb["response_labels"][j, :n_resp], t["responses"][i, :n_resp])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("budget", [12, 20, 45, 500])
def test_token_micro_batches_keep_budgets_and_restore_order(shared, budget):
    batch = rollout(PROMPTS, RESPONSES, group=2)
    mbs, order = row_layout.token_micro_batches(batch, TokenBudget(budget, "actor.ppo_max_token_len_per_gpu"),
                                                extra_keys=["row"], seq_multiple=2, share_prompts=shared)
    assert all(mb["input_ids"].shape[1] % 2 == 0 for mb in mbs)
    _check_layout(batch, mbs, order, budget, shared)
    if budget == 500:
        assert len(mbs) == 1
        real = int(batch.tensors["attention_mask"].sum())
        # shared: each of the 6 prompts once instead of twice
        assert row_layout.computed_tokens(mbs) - (real - sum(PROMPTS) if shared else real) in (0, 1)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("count", [1, 3, 7, 12])
def test_an_agreed_count_of_micro_batches_is_met_exactly(shared, count):
    """The data-parallel ranks' agreed count (the largest rank's own, role_ops.agreed_count): a rank that alone
    needs fewer spreads its rows over that many, cutting GRPO groups into rows where it must; the budgets and
    the rows' order hold; more micro-batches than rows is a one-line error."""
    batch = rollout(PROMPTS, RESPONSES, group=2)
    budget = TokenBudget(500, "actor.ppo_max_token_len_per_gpu")
    assert row_layout.micro_batch_count(batch, budget, shared) == 1
    mbs, order = row_layout.token_micro_batches(batch, budget, extra_keys=["row"], share_prompts=shared, count=count)
    assert len(mbs) == count
    _check_layout(batch, mbs, order, 500, shared)
    with pytest.raises(ValueError, match="13 micro-batches agreed for 12 rows"):
        row_layout.token_micro_batches(batch, budget, share_prompts=shared, count=13)


def test_packed_mask_is_block_diagonal_causal_with_shared_prompts():
    batch = rollout([2, 3], [2, 1, 0, 2], group=2)
    (mb,), _ = row_layout.token_micro_batches(batch, TokenBudget(100, "k"), share_prompts=True)
    # [p0 p0 a a b | q q q d d]: unit 0 then unit 1 (its second row has no response)
    allowed = ~mb["packed_mask"][0, 0]
    unit = torch.tensor([0] * 5 + [1] * 5)
    seg = torch.tensor([0, 0, 1, 1, 2, 0, 0, 0, 2, 2])
    want = torch.ones(10, 10, dtype=torch.bool).tril() & (unit[:, None] == unit[None]) & (
        (seg[None] == 0) | (seg[:, None] == seg[None]))
    assert torch.equal(allowed, want)
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3, 4]


def test_cu_seqlens_for_packed_sequence_attention():
    """The GPU branch (TE's THD attention): rows end to end, their boundaries in cu_seqlens, the sequence-
    parallel padding a sequence of its own, no mask."""
    batch = rollout(PROMPTS, RESPONSES, group=2)
    mbs, order = row_layout.token_micro_batches(batch, TokenBudget(40, "k"), extra_keys=["row"], seq_multiple=4,
                                                thd=True)
    _check_layout(batch, mbs, order, 40, shared=False)
    lengths = batch.tensors["attention_mask"].sum(1)
    for mb in mbs:
        assert "packed_mask" not in mb
        real = lengths[mb["row"]].tolist()
        bounds = [0] + list(itertools.accumulate(real))
        width = mb["input_ids"].shape[1]
        assert width % 4 == 0 and width - bounds[-1] < 4
        assert mb["cu_seqlens"].dtype == torch.int32
        assert mb["cu_seqlens"].tolist() == bounds + ([width] if width > bounds[-1] else [])
        cu = mb["cu_seqlens"].tolist()
        assert mb["max_seqlen"] == max(b - a for a, b in zip(cu, cu[1:]))
        # positions restart at every sequence, as megatron's THD rotary embedding applies them
        pos = mb["position_ids"][0]
        for a, b in zip(bounds, bounds[1:]):
            assert pos[a:b].tolist() == list(range(b - a))
    with pytest.raises(ValueError, match="cannot share prompts"):
        row_layout.token_micro_batches(batch, TokenBudget(40, "k"), thd=True, share_prompts=True)


def test_a_budget_below_the_longest_row_names_its_key():
    batch = rollout(PROMPTS, RESPONSES, group=2)
    longest = int(batch.tensors["attention_mask"].sum(1).max())
    with pytest.raises(ValueError, match=rf"^critic.forward_max_token_len_per_gpu \({longest - 1}\) is less than"):
        row_layout.token_micro_batches(batch, TokenBudget(longest - 1, "critic.forward_max_token_len_per_gpu"))
    mbs, _ = row_layout.token_micro_batches(batch, TokenBudget(longest, "k"), share_prompts=True)
    assert len(mbs) >= 2


def test_batching_settings_follow_verl_keys():
    from hybridflow.config.schema import Actor, Critic
    from hybridflow.workers import role_ops

    a = Actor(log_prob_micro_batch_size_per_gpu=3, ref_log_prob_micro_batch_size_per_gpu=5)
    assert (role_ops.log_prob_batching(a), role_ops.log_prob_batching(a, ref=True)) == (3, 5)
    a = Actor(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=100)
    assert role_ops.log_prob_batching(a) == TokenBudget(100, "actor.ppo_max_token_len_per_gpu")
    a = Actor(use_dynamic_bsz=True, log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=70)
    assert role_ops.log_prob_batching(a, ref=True) == TokenBudget(70, "actor.log_prob_max_token_len_per_gpu")
    assert role_ops._update_batching(a, "actor") == TokenBudget(16384, "actor.ppo_max_token_len_per_gpu")
    c = Critic(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=90)
    assert role_ops.value_batching(c) == TokenBudget(90, "critic.ppo_max_token_len_per_gpu")
    assert role_ops.value_batching(Critic(log_prob_micro_batch_size_per_gpu=4)) == 4


# --- balancing across data-parallel ranks ------------------------------------------------------------

def _shard_sums(lengths, order, k):
    return [sum(c) for c in np.array_split([lengths[i] for i in order], k)]


def test_balanced_order_keeps_groups_whole_and_balances_ranks():
    g = torch.Generator().manual_seed(4)
    n, groups = 4, 16
    lengths = [int(x) for x in torch.randint(5, 200, (n * groups,), generator=g)]
    uids = [f"g{i // n}" for i in range(n * groups)]
    for k in (2, 4):
        order = balanced_order(lengths, k, uids)
        assert sorted(order) == list(range(len(lengths)))
        for s in range(0, len(order), n):  # every run of n rows is one whole group, in its order
            assert order[s:s + n] == list(range(order[s], order[s] + n)) and order[s] % n == 0
        before, after = _shard_sums(lengths, range(len(lengths)), k), _shard_sums(lengths, order, k)
        assert max(after) - min(after) <= max(before) - min(before)
        assert max(after) - min(after) <= max(sum(lengths[s:s + n]) for s in range(0, len(lengths), n))


def test_balanced_order_falls_back_to_rows():
    lengths = [50, 1, 1, 1, 50, 1, 1, 1]
    uids = ["a", "a", "a", "b", "b", "b", "c", "c"]  # unequal groups: rows one by one
    order = balanced_order(lengths, 2, uids)
    assert _shard_sums(lengths, order, 2) == [53, 53]


def test_balance_batch_reorders_rows_and_reports_shard_tokens():
    batch = rollout(PROMPTS, RESPONSES, group=2)
    cfg = SimpleNamespace(trainer=SimpleNamespace(balance_batch=True))
    metrics = {}
    out = balance_batch(batch, cfg, 3, metrics)
    lengths = batch.tensors["attention_mask"].sum(1)
    assert sorted(out.tensors["row"].tolist()) == list(range(len(batch)))
    assert torch.equal(out.tensors["input_ids"], batch.tensors["input_ids"][out.tensors["row"]])
    assert list(out.non_tensors["uid"]) == [f"u{r // 2}" for r in out.tensors["row"].tolist()]
    shards = [int(lengths[c].sum()) for c in out.tensors["row"].chunk(3)]
    assert (metrics["global_seqlen/balanced_min"], metrics["global_seqlen/balanced_max"]) == (min(shards), max(shards))
    assert metrics["global_seqlen/balanced_max"] - metrics["global_seqlen/balanced_min"] <= metrics["global_seqlen/minmax_diff"]
    assert metrics["global_seqlen/mean"] == pytest.approx(float(lengths.sum()) / 3)
    assert all(type(v) in (int, float) for v in metrics.values())  # plain numbers for the trackers
    for off in (SimpleNamespace(trainer=SimpleNamespace(balance_batch=False)), cfg):
        same = balance_batch(batch, off, 1 if off is cfg else 3, {})
        assert same is batch


# --- token positions (MoE routing replay follows every token into its micro-batch layout) ---------

def _layouts(batch):
    for name, share in (("rotated", False), ("shared prompts", True)):
        yield name, [(batch[mb["row"].tolist()], mb)
                     for mb in row_layout.micro_batches(batch, 4, extra_keys=("row",), share_prompts=share)]
    for thd, share in ((False, True), (True, False), (False, False)):
        mbs, _ = row_layout.token_micro_batches(batch, TokenBudget(14, "k"), extra_keys=("row",), seq_multiple=2,
                                                share_prompts=share, thd=thd)
        yield f"token budget (thd={thd}, shared={share})", [(batch[mb["row"].tolist()], mb) for mb in mbs]


@pytest.mark.parametrize("which", range(5))
def test_token_position_places_every_real_token_of_every_row_in_its_layout(which):
    from hybridflow.megatron.routing import from_layout, to_layout

    batch = rollout(PROMPTS, RESPONSES, group=2)
    name, pairs = list(_layouts(batch))[which]
    for rows, mb in pairs:
        pos, mask = mb["token_position"], rows.tensors["attention_mask"].bool()
        assert ((pos >= 0) == mask).all(), name
        flat = mb["input_ids"].reshape(-1)
        assert torch.equal(flat[pos[mask]], rows.tensors["input_ids"][mask]), name
        # routes [n, T, L, k] cell by cell through the layout and back: the real cells unchanged
        routes = torch.randint(0, 8, (*mask.shape, 3, 2), generator=torch.Generator().manual_seed(which),
                               dtype=torch.int16)
        shared = {}  # a shared prompt's place holds one of its rows' routes: make them agree, as vLLM's do
        for cell in zip(*torch.nonzero(mask, as_tuple=True)):
            routes[cell] = shared.setdefault(int(pos[cell]), routes[cell])
        back = from_layout(to_layout(routes, pos, *mb["input_ids"].shape), pos, -1)
        assert torch.equal(back[mask], routes[mask]) and (back[~mask] == -1).all(), name
