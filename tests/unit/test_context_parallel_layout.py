"""Context parallelism without processes: megatron's load-balanced split, each rank's part of a laid-out micro-batch
(row_layout.split_for_context_parallel), and the run plan's CP arithmetic and refusals (plan/layout, plan/rules).
The distributed tier checks that CP reproduces CP 1 (tests/distributed/test_layouts.py, test_dynamic_bsz.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.megatron.context_parallel import chunk_positions, gathered_order
from hybridflow.plan import load_experiment, resolve
from hybridflow.protocol import Batch
from hybridflow.workers import row_layout
from tests.unit.test_moe_rules import DENSE, MOE, SEPARATE

QUICKSTART = "configs/quickstart_cpu.yaml"
MICRO = ["actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8"]


def test_megatrons_load_balanced_chunks():
    # 16 tokens over CP 2: 4 chunks of 4, rank 0 the first and last, rank 1 the middle two
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(gathered_order(24, 3).tolist()) == list(range(24))
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
    (mb,) = row_layout.micro_batches(_rows(shared), 4, seq_multiple=row_layout.context_parallel_multiple(cp),
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
        back[..., gathered_order(s, cp)] = part["packed_mask"]
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
    plan = resolve(load_experiment([QUICKSTART], [*MICRO, *SEPARATE, "actor.ppo_mini_batch_size=32", "resources.n_workers=4", "actor.megatron.context_parallel_size=2",
                                                  "critic.megatron.context_parallel_size=2"]), DENSE)
    assert (plan.actor.dp, plan.actor.cp) == (2, 2)
    # the checkpoint engine's planner (separate_async) counts data x context ranks as its d
    assert plan.rollout_spec.train_layout == (1, 1, 4)


@pytest.mark.parametrize("config,overrides,on_gpu,message", [
    (QUICKSTART, ["resources.n_workers=2", "actor.megatron.context_parallel_size=2",
                  "actor.megatron.tensor_model_parallel_size=2"], False,
     r"resources.n_workers \(2\) is not divisible by actor tensor x context x pipeline parallel size \(4\)"),
    (MOE, ["actor.megatron.context_parallel_size=2"], False,
     "actor.megatron.context_parallel_size 2: actor.megatron.router_replay is not supported"),
    (QUICKSTART, [*MICRO, "resources.n_workers=2", "critic.megatron.context_parallel_size=2", "critic.use_dynamic_bsz=true"],
     True, "critic.megatron.context_parallel_size 2 with critic.use_dynamic_bsz on GPU"),
])
def test_context_parallel_refusals_are_one_line(config, overrides, on_gpu, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve(load_experiment([config], overrides), None, on_gpu=on_gpu)
    assert "\n" not in str(err.value)
