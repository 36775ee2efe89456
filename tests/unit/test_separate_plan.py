"""The separate-placement planner (resharding/separate.py), separate_async's look-ahead and lag accounting
(trainer/pool_lookahead.py), the run plan's rules for the trainer modes, their verl keys, and per-request seeds."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from hybridflow.config import ConfigError
from hybridflow.config.verl import translate
from hybridflow.plan import load_experiment, resolve
from hybridflow.resharding.plan import Layout
from hybridflow.resharding.separate import SeparatePlan
from hybridflow.trainer.pool_lookahead import check_lag, look_ahead, version_lags
from hybridflow.trainer.experience import group_prompts, sample_seeds


def _feeds(plan):
    return [(f.source, f.part, f.receivers) for f in plan.feeds]


def test_equal_tp_feeds_each_rollout_rank_from_the_training_rank_holding_its_shard():
    plan = SeparatePlan(Layout(1, 2, 2), rollout_world=6, t_g=2)  # 2 training replicas, 3 rollout replicas
    assert plan.t_s == 2 and plan.m == 1
    # rollout replicas 0 and 2 from training replica 0 (ranks 0, 1), replica 1 from training replica 1 (ranks 2, 3)
    assert _feeds(plan) == [(0, 0, (0, 4)), (1, 0, (1, 5)), (2, 0, (2,)), (3, 0, (3,))]
    assert plan.trainer_bytes_received() == 0  # t_s = t, one stage: nothing moves inside the training pool


def test_rollout_tp_above_the_actors_sends_each_rank_its_slice():
    plan = SeparatePlan(Layout(1, 1, 1), rollout_world=2, t_g=2)
    assert (plan.t_s, plan.m) == (1, 2)
    assert _feeds(plan) == [(0, 0, (0,)), (0, 1, (1,))]


def test_rollout_tp_below_the_actors_gathers_inside_the_training_pool_first():
    plan = SeparatePlan(Layout(2, 2, 1), rollout_world=1, t_g=1)
    assert plan.t_s == 1 and plan.trainer.d_g == 4  # the whole model gathered on the source replica's rank
    assert plan.trainer_bytes_received() == Fraction(3, 4)
    (feed,) = plan.feeds
    assert feed.receivers == (0,) and feed.source in plan.trainer.replicas[0]


def test_every_rollout_rank_is_fed_exactly_once_and_gets_its_shard_bytes():
    for train, world, t_g in [(Layout(1, 4, 1), 4, 2), (Layout(2, 2, 2), 8, 4), (Layout(1, 2, 1), 6, 3)]:
        plan = SeparatePlan(train, world, t_g)
        fed = sorted(r for f in plan.feeds for r in f.receivers)
        assert fed == list(range(world)), (train, world, t_g)
        assert plan.dispatch_info(t_g) == dict(dp_rank=1, dp_size=world // t_g, collect=True)
    plan = SeparatePlan(Layout(1, 2, 1), 4, 4)
    assert plan.rollout_bytes_received(split=800, experts=400, replicated=10) == 310


def test_a_rollout_pool_that_does_not_split_into_replicas_is_refused():
    with pytest.raises(ValueError, match="rollout pool \\(3 ranks\\) does not split into vLLM replicas of tensor-parallel size 2"):
        SeparatePlan(Layout(1, 1, 1), 3, 2)


def test_look_ahead_never_generates_a_sample_the_bound_would_drop():
    assert look_ahead(1, 8) == 1 and look_ahead(2.5, 8) == 2 and look_ahead(0.5, 8) == 0
    assert look_ahead(3, 2) == 1 and look_ahead(3, 1) == 0 and look_ahead(3, None) == 3


def test_version_lag_is_the_oldest_sampled_token_behind_the_trainer():
    versions = torch.tensor([[2, 3, -1], [3, 3, 3], [-1, -1, -1]])
    assert version_lags(versions, 3).tolist() == [1, 0, 0]
    check_lag(version_lags(versions, 3), 2, step=4)
    with pytest.raises(RuntimeError, match="step 4: a sample lags 1 policy versions .*max_off_policy_threshold \\(1\\)"):
        check_lag(version_lags(versions, 3), 1, step=4)


def test_a_generated_batch_gives_its_own_prompts_to_the_greedy_baseline():
    """ReMax's greedy responses answer the prompts of the batch generated (ahead, or carried: interleaved groups),
    not the step's prompts; each row gets its group's."""
    from hybridflow.protocol import Batch

    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 0, 4], [7, 8, 9], [0, 0, 4]])
    attention = torch.cat([(prompts > 0).long(), torch.ones(6, 2, dtype=torch.long)], dim=1)
    batch = Batch.from_dict(tensors={"prompts": prompts, "attention_mask": attention,
                                     "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)},
                            non_tensors={"uid": np.array(["2-0", "1-3", "2-0", "2-1", "1-3", "2-1"], dtype=object),
                                         "answer": np.array(["56", "789", "56", "4", "789", "4"], dtype=object)})
    heads, groups = group_prompts(batch)
    assert heads.tensors["input_ids"].tolist() == [[0, 5, 6], [7, 8, 9], [0, 0, 4]]
    assert heads.tensors["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert heads.tensors["position_ids"].tolist() == [[0, 0, 1], [0, 1, 2], [0, 0, 0]]
    assert list(heads.non_tensors["answer"]) == ["56", "789", "4"] and groups.tolist() == [0, 1, 0, 2, 1, 2]


def test_sample_seeds_depend_on_the_group_and_index_only():
    a = sample_seeds(1, ["3-0", "3-1"], 2)
    assert a.tolist() == sample_seeds(1, ["3-0", "3-1"], 2).tolist()
    assert len(set(a.tolist())) == 4 and (a >= 0).all()
    assert sample_seeds(1, ["3-1"], 2).tolist() == a[2:].tolist()  # a row's seed does not depend on its batch
    assert sample_seeds(2, ["3-0"], 2).tolist() != a[:2].tolist()


ASYNC = ["schedule.mode=separate_async", "resources.rollout_n_workers=1", "schedule.parameter_sync_step=1"]


@pytest.mark.parametrize("overrides,message", [
    (["schedule.mode=separate_async"],
     "needs a rollout pool: resources.rollout_n_workers >= 1"),
    (["resources.rollout_n_workers=2"], "resources.rollout_n_workers \\(2\\) sizes the rollout pool"),
    (["schedule.mode=colocate_async", "resources.rollout_n_workers=1"], "colocate_async rolls out on the actor's workers"),
    (ASYNC[:-1] + ["schedule.parameter_sync_step=4"],
     "data.batch_size \\(128\\) must equal schedule.parameter_sync_step \\(4\\) x actor.ppo_mini_batch_size \\(128\\)"),
    (ASYNC + ["rollout.checkpoint_engine.backend=nccl"], "backend 'nccl' needs GPU workers"),
    (ASYNC + ["rollout.tensor_model_parallel_size=2"], "resources.rollout_n_workers \\(1\\) is not divisible by"),
    (["schedule.mode=colocate_async", "schedule.partial_rollout=false"],
     "schedule.partial_rollout=false: colocate_async always carries unfinished responses"),
])
def test_trainer_mode_rules_are_one_line(overrides, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        resolve(load_experiment(["configs/quickstart_cpu.yaml"], overrides))


def test_colocate_async_carries_on_the_hybrid_engine():
    plan = resolve(load_experiment(["configs/quickstart_cpu.yaml"], ["schedule.mode=colocate_async"]))
    assert [p.name for p in plan.pools] == ["actor_rollout_ref"] and plan.rollout_spec is None
    assert plan.actor_spec.carry_unfinished and plan.actor_spec.max_off_policy_threshold == 8


def test_separate_async_plan_has_a_rollout_pool_and_spec():
    plan = resolve(load_experiment(["configs/quickstart_async_cpu.yaml"], []))
    assert [(p.name, p.size) for p in plan.pools] == [("actor_rollout_ref", 1), ("rollout", 1)]
    assert plan.actor_spec.rollout_pool == 1 and plan.rollout_spec.train_layout == (1, 1, 1)
    assert not plan.generation.colocated and plan.generation.replicas == 1


def test_the_rollout_pool_restarts_samples_at_the_staleness_bound():
    plan = resolve(load_experiment(["configs/quickstart_async_cpu.yaml"], ["schedule.max_off_policy_threshold=3"]))
    assert plan.rollout_spec.partial_rollout and plan.rollout_spec.staleness_threshold == 3


def test_verl_trainer_mode_keys():
    t = translate(["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
                   "trainer.v1.sampler.max_off_policy_threshold=3", "actor_rollout_ref.rollout.nnodes=1",
                   "actor_rollout_ref.rollout.n_gpus_per_node=4", "async_training.staleness_threshold=1",
                   "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=512"])
    ours = [str(o) for o in t.overrides]
    for expected in ("schedule.mode=separate_async", "schedule.parameter_sync_step=2",
                     "schedule.max_off_policy_threshold=3", "resources.rollout_n_workers=4",
                     "schedule.num_warmup_batches=1", "rollout.checkpoint_engine.update_weights_bucket_megabytes=512"):
        assert any(expected in o for o in ours), (expected, ours)
    assert not any(o.startswith("resources.n_workers") for o in ours)  # the trainer's GPU count was not given


def test_a_staleness_bound_beyond_the_run_is_named_as_none(caplog):
    from hybridflow.trainer.preflight import warn_no_bound

    for bound, steps, warned in ((100000000000000000000, 100, True), (100, 100, True), (8, 100, False)):
        cfg = load_experiment(["configs/quickstart_async_cpu.yaml"],
                              [f"schedule.max_off_policy_threshold={bound}", f"trainer.total_steps={steps}"])
        assert warn_no_bound(cfg, resolve(cfg)) is warned
    assert "is at least the run's 100 steps: in effect no staleness bound" in caplog.text
