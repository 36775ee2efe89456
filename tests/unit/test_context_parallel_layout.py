"""Context parallelism without processes: megatron's load-balanced split, each rank's part of a laid-out micro-batch
(row_layout.split_for_context_parallel), and the run plan's CP arithmetic and refusals (plan/layout, plan/rules).
The distributed tier checks that CP reproduces CP 1 (tests/distributed/test_layouts.py, test_dynamic_bsz.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.megatron.context_parallel import chunk_positions, gathered_order, positions_held
from hybridflow.plan import load_experiment, resolve
from hybridflow.plan.layout import context_chunks
from hybridflow.protocol import Batch
from hybridflow.workers import row_layout
from tests.unit.test_moe_rules import DENSE, MOE, SEPARATE

QUICKSTART = "configs/quickstart_cpu.yaml"
MICRO = ["actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8"]


def test_megatrons_load_balanced_chunks():
    # 16 tokens over CP 2: 4 chunks of 4, rank 0 the first and last, rank 1 the middle two
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_order([0, 24], 3).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        chunk_positions(10, 2, 0)


def _rows(shared: bool) -> Batch:
    """4 rows, prompts of width 5 left-padded, responses of width 3 right-padded; two pairs share prompts."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, :2] = 0
    mask[3, 6:] = 0
    ids = torch.randint(3, 40, (4, 8), generator=g) * mask
    if shared:
        ids[1, :5], ids[3, :5], mask[3, :5] = ids[0, :5], ids[2, :5], mask[2, :5]
        mask[1, :5] = mask[0, :5]
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "responses": ids[:, 5:],
                                    "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})


@pytest.mark.parametrize("shared", [False, True], ids=["rotated_rows", "shared_prompts"])
def test_each_rank_holds_its_chunks_and_the_ranks_together_every_response_token(shared):
    cp = 2
    (mb,) = row_layout.micro_batches(_rows(shared), 4, seq_multiple=context_chunks(cp),
                                     share_prompts=shared)
    s = mb["input_ids"].shape[1]
    assert s % (2 * cp) == 0
    full_mask = mb.get("packed_mask")
    full_mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None] if full_mask is None else full_mask
    owned = []
    for rank in range(cp):
        part = row_layout.split_for_context_parallel(mb, cp, rank, explicit_mask=True)
        own = chunk_positions(s, cp, rank)
        assert torch.equal(part["input_ids"], mb["input_ids"][:, own])
        # the local queries' rows of the whole mask, over keys in gathered order
        back = torch.empty_like(part["packed_mask"])
        back[..., gathered_order([0, s], cp)] = part["packed_mask"]
        assert torch.equal(back, full_mask[:, :, own].expand_as(back))
        # each response token a rank holds is predicted at the local position of its global one
        held = part["cp_owned"]
        assert torch.equal(own[part["response_index"][held]], mb["response_index"][held])
        owned.append(held)
    assert not (owned[0] & owned[1]).any()
    assert torch.equal(owned[0] | owned[1], mb["response_valid"].bool())
    # Transformer Engine's CP takes the causal rows as they are: no mask
    assert "packed_mask" not in row_layout.split_for_context_parallel(
        row_layout.micro_batches(_rows(False), 4, seq_multiple=4)[0], cp, 0, explicit_mask=False)


def test_the_plan_counts_context_parallel_ranks():
    overrides = [*MICRO, *SEPARATE, "actor.ppo_mini_batch_size=32", "resources.n_workers=4",
                 "actor.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2"]
    plan = resolve(load_experiment([QUICKSTART], overrides), DENSE)
    assert (plan.actor.dp, plan.actor.cp) == (2, 2)
    # the checkpoint engine's planner (separate_async) counts data x context ranks as its d
    assert plan.rollout_spec.train_layout == (1, 1, 4)


@pytest.mark.parametrize("config,overrides,message", [
    (QUICKSTART, ["resources.n_workers=2", "actor.megatron.context_parallel_size=2",
                  "actor.megatron.tensor_model_parallel_size=2"],
     r"resources.n_workers \(2\) is not divisible by actor tensor x context x pipeline parallel size \(4\)"),
    (MOE, ["actor.megatron.context_parallel_size=2"],
     "actor.megatron.context_parallel_size 2: actor.megatron.router_replay is not supported"),
])
def test_context_parallel_refusals_are_one_line(config, overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve(load_experiment([config], overrides))
    assert "\n" not in str(err.value)


def test_packed_sequences_split_per_sequence_as_transformer_engine_does():
    """Token-budget THD rows (the GPU layout): each sequence padded at its end to 2 x CP tokens, and each CP rank
    holding chunks r and 2cp-1-r of every sequence (TE's thd_get_partitioned_indices) with the row's boundaries
    kept for TE; for megatron's local attention the boundaries become a block-causal mask instead."""
    cp = 2
    batch = _rows(False)
    (mb,), _ = row_layout.token_micro_batches(batch, row_layout.TokenBudget(64, "test"), thd=True,
                                              unit_multiple=context_chunks(cp))
    bounds = mb["cu_seqlens"].tolist()
    lengths = batch.tensors["attention_mask"].sum(1).tolist()
    assert [b - a for a, b in zip(bounds, bounds[1:])] == [n + -n % 4 for n in lengths]
    parts = [row_layout.split_for_context_parallel(mb, cp, r, explicit_mask=False) for r in range(cp)]
    for r, part in enumerate(parts):
        assert torch.equal(part["cu_seqlens"], mb["cu_seqlens"])  # TE divides the whole row's boundaries
        assert torch.equal(part["input_ids"], mb["input_ids"][:, positions_held(bounds, cp, r)])
    assert torch.equal(parts[0]["cp_owned"] | parts[1]["cp_owned"], mb["response_valid"].bool())
    masked = row_layout.split_for_context_parallel(mb, cp, 0, explicit_mask=True)
    assert "cu_seqlens" not in masked
    own, keys = positions_held(bounds, cp, 0), gathered_order(bounds, cp)
    seq = torch.bucketize(torch.arange(bounds[-1]), torch.tensor(bounds[1:]), right=True)
    sees = ~masked["packed_mask"][0, 0]
    assert torch.equal(sees, (keys[None] <= own[:, None]) & (seq[keys][None] == seq[own][:, None]))

