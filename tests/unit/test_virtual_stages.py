"""Virtual pipeline stages without processes: which layers each stage's chunks hold (with uneven stages too, as
megatron's own functions place them), the interleaved schedule's
micro-batch needs, the memory plan's activations in flight, and the run plan's refusals. The distributed tier
checks that PP 2 x VPP 2 reproduces one rank (tests/distributed/test_layouts.py), resumes at another layout
(test_checkpoint.py) and reshards into vLLM (test_resharding.py, test_check_model.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridflow.megatron.convert import Shard
from hybridflow.megatron.virtual_stages import microbatch_group_size
from hybridflow.plan import ParallelLayout, load_experiment, resolve
from hybridflow.plan.stages import StageSplit
from hybridflow.protocol import Batch
from hybridflow.tools.memory_plan import stages_in_flight
from hybridflow.workers.role_ops import least_micro_batches
from tests.unit.test_moe_rules import DENSE, MOE

QUICKSTART = "configs/quickstart_cpu.yaml"
VPP = ["resources.n_workers=2", "actor.megatron.pipeline_model_parallel_size=2",
       "actor.megatron.virtual_pipeline_model_parallel_size=2", "actor.ppo_micro_batch_size_per_gpu=8",
       "critic.ppo_micro_batch_size_per_gpu=8"]


def test_chunks_take_every_pp_th_block_of_layers():
    # megatron's interleaved assignment: virtual stage c * pp + r is chunk c of stage r
    assert StageSplit(2, 2).layers(8, 0) == [0, 1, 4, 5] and StageSplit(2, 2).layers(8, 1) == [2, 3, 6, 7]
    assert StageSplit(2).layers(8, 1) == [4, 5, 6, 7]  # no virtual stages: one block
    assert sorted(i for r in range(4) for i in StageSplit(4, 2).layers(16, r)) == list(range(16))
    assert Shard(pp_rank=1, pp_size=2, vpp_size=2).layers(4) == [1, 3]
    # Moonlight's 27 layers as verl's script splits them (num_layers_in_last_pipeline_stage=13)
    assert Shard(pp_rank=1, pp_size=2, last_stage_layers=13).layers(27) == list(range(14, 27))


# (layers, pp, vpp, first, last): verl's Moonlight and DeepSeek-V3 (61 layers) splits, first and/or last set, with
# virtual stages, and the even split
SPLITS = [(27, 2, 1, None, 13), (61, 12, 1, None, 6), (10, 3, 1, 2, None), (11, 3, 1, 3, 2), (12, 3, 2, 2, 4),
          (14, 4, 2, 4, 2), (16, 4, 2, None, None), (8, 2, 1, None, None)]


@pytest.mark.parametrize("n,pp,vpp,first,last", SPLITS)
def test_stage_split_places_layers_as_megatron_does(n, pp, vpp, first, last):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    split = StageSplit(pp, vpp, first, last)
    split.check(n, "actor.megatron", "config.json")
    cfg = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, pipeline_dtype=torch.float32,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    for stage in range(pp):
        theirs = []
        for chunk in ([None] if vpp == 1 else range(vpp)):
            start = get_transformer_layer_offset(cfg, vp_stage=chunk, pp_rank=stage)
            theirs += range(start, start + get_num_layers_to_build(cfg, vp_stage=chunk, pp_rank=stage))
        assert split.layers(n, stage) == theirs, stage


@pytest.mark.parametrize("split,n,match", [
    (StageSplit(3, 1, None, 13), 28, "leave 15 for the other 2 pipeline stages"),
    (StageSplit(3, 1, None, 3), 10, "leave 7 for the other 2"),
    (StageSplit(1, 1, 2, None), 4, "num_layers_in_first_pipeline_stage: uneven pipeline stages need"),
    (StageSplit(2, 2, None, 3), 9, r"every stage's layers \[6, 3\] must divide into the 2 virtual stages"),
    (StageSplit(2), 27, r"pipeline_model_parallel_size \(2\) does not divide the model's 27 layers in config.json"),
])
def test_stage_split_refuses_what_megatron_would(split, n, match):
    with pytest.raises(ValueError, match=match):
        split.check(n, "actor.megatron", "config.json")


def test_the_interleaved_schedule_takes_its_micro_batches_in_groups_it_accepts():
    assert microbatch_group_size(4, 2) == 2 and microbatch_group_size(6, 2) == 2
    assert microbatch_group_size(3, 2) == 3  # not a multiple of pp: one group of all
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        microbatch_group_size(1, 2)


def test_more_micro_batches_than_stages():
    role = SimpleNamespace(shard=Shard(pp_size=2, vpp_size=2), layout=ParallelLayout("actor", 2, "", pp=2, vpp=2))

    def rows(n: int) -> Batch:
        return Batch.from_dict(tensors={"x": torch.zeros(n, 1)})

    assert least_micro_batches(role, rows(4)) == 3
    assert least_micro_batches(SimpleNamespace(shard=Shard(pp_size=2), layout=ParallelLayout("actor", 2, "", pp=2)),
                               rows(1)) == 1
    with pytest.raises(ValueError, match=r"more than pipeline_model_parallel_size \(2\) micro-batches"):
        least_micro_batches(role, rows(2))


def test_interleaving_holds_more_activations_in_flight():
    one_f_one_b = SimpleNamespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=None)
    interleaved = SimpleNamespace(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    assert stages_in_flight(one_f_one_b, 16) == 4 and stages_in_flight(one_f_one_b, 2) == 2
    assert stages_in_flight(interleaved, 16) == (2 * 3 + 4 + 1) / 2  # 11 chunk forwards of half a stage each
    assert stages_in_flight(interleaved, 2) == 2  # every chunk of both micro-batches


def test_the_plan_builds_virtual_stages():
    plan = resolve(load_experiment([QUICKSTART], VPP), SimpleNamespace(**{**vars(DENSE), "num_hidden_layers": 4}))
    assert (plan.actor.pp, plan.actor.vpp) == (2, 2)


@pytest.mark.parametrize("config,overrides,message", [
    (QUICKSTART, ["actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "virtual_pipeline_model_parallel_size 2 needs pipeline_model_parallel_size > 1"),
    (QUICKSTART, VPP, r"virtual_pipeline_model_parallel_size \(2\) x pipeline_model_parallel_size \(2\) does not "
                      "divide the model's 2 layers"),
    (MOE, [*VPP, "resources.n_workers=4"],
     "actor.megatron.virtual_pipeline_model_parallel_size 2: actor.megatron.router_replay is not supported"),
    (QUICKSTART, [*VPP, "model.lora.rank=8"], "model.lora is not supported with virtual pipeline stages"),
    # two rows per rank for two stages: found at step 1 before, in the config now
    (QUICKSTART, [*VPP, "resources.n_workers=2", "actor.ppo_mini_batch_size=2", "data.batch_size=2",
                  "actor.ppo_micro_batch_size_per_gpu=1"],
     r"actor.ppo_mini_batch_size x rollout.n \(2 sequences\) gives each of the actor's 1 data-parallel ranks 2 "
     r"rows: virtual pipeline stages need more than pipeline_model_parallel_size \(2\) micro-batches"),
])
def test_virtual_stage_refusals_are_one_line(config, overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve(load_experiment([config], overrides), DENSE)
    assert "\n" not in str(err.value)


def test_the_micro_batch_count_is_rounded_up_to_a_multiple_of_pp_where_the_rows_allow():
    """megatron's interleaved schedule holds about v x every micro-batch's activations where pp does not divide their
    count (one group of all); a multiple of pp keeps the plan's 2 (pp - 1) + (v - 1) pp + 1 chunk forwards."""
    from hybridflow.megatron.virtual_stages import interleaved_count
    from hybridflow.workers.role_ops import _laid_out

    assert interleaved_count(3, 2, rows=8) == 4 and interleaved_count(5, 4, rows=8) == 8
    assert interleaved_count(4, 2, rows=8) == 4
    assert interleaved_count(3, 2, rows=3) == 3  # four micro-batches need four rows: megatron's one group stays
    role = SimpleNamespace(shard=Shard(pp_size=2, vpp_size=2), tf_config=SimpleNamespace(sequence_parallel=False),
                           shares_prompts=False, layout=ParallelLayout("actor", 2, "", pp=2, vpp=2))
    p, r = 3, 2
    ids = torch.arange(10 * (p + r)).reshape(10, p + r)
    batch = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                     "position_ids": torch.arange(p + r).expand(10, -1), "responses": ids[:, p:]})
    mbs, _ = _laid_out(role, batch, 4)  # ceil(10 / 4) = 3 micro-batches of 4 rows: 4 of 3, 3, 2 and 2 rows instead
    assert [len(mb["sample_row"]) for mb in mbs] == [3, 3, 2, 2]
    plain = {"shard": Shard(pp_size=2), "layout": ParallelLayout("actor", 2, "", pp=2)}  # no virtual stages
    mbs, _ = _laid_out(SimpleNamespace(**{**vars(role), **plain}), batch, 4)
    assert [len(mb["sample_row"]) for mb in mbs] == [4, 4, 2]
