"""config/distillation.py: verl 0.9.1's distillation keys on a verl command line, their checks, and the routing of
teachers by key."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.trainer.main import load

BASE = ["--config", "configs/ppo_megatron.yaml"]
TEACHER = "distillation.teacher_models.teacher_model.model_path=/models/teacher"


def test_verl_keys_map_onto_the_section():
    cfg = load([*BASE, "--verl-overrides", "distillation.enabled=true", TEACHER,
                "distillation.distillation_loss.loss_mode=k1", "distillation.distillation_loss.use_policy_gradient=true",
                "distillation.distillation_loss.clip_ratio=0.3", "distillation.distillation_loss.use_task_rewards=false",
                "distillation.distillation_loss.policy_loss_mode=vanilla", "distillation.n_gpus_per_node=4",
                "distillation.nnodes=1", "distillation.teacher_models.teacher_model.num_replicas=2",
                "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2"])
    d = cfg.distillation
    assert d.enabled and d.teachers() == {None: "/models/teacher"}
    loss = d.distillation_loss
    assert (loss.loss_mode, loss.use_policy_gradient, loss.use_task_rewards) == ("k1", True, False)
    assert (loss.clip_ratio_low, loss.clip_ratio_high) == (0.3, 0.3)


def test_verls_yaml_defaults():
    loss = load([*BASE, "--verl-overrides", "distillation.enabled=true", TEACHER]).distillation.distillation_loss
    assert (loss.loss_mode, loss.topk, loss.use_policy_gradient, loss.loss_max_clamp, loss.log_prob_min_clamp) == (
        "k3", 32, False, None, None)


def test_several_teachers_are_routed_by_their_keys():
    cfg = load([*BASE, "--verl-overrides", "distillation.enabled=true", "distillation.teacher_key=ability",
                "+distillation.teacher_models.m.model_path=/math", "+distillation.teacher_models.m.key=math",
                "+distillation.teacher_models.c.model_path=/code", "+distillation.teacher_models.c.key=code"])
    assert cfg.distillation.teachers() == {"math": "/math", "code": "/code"}
    assert cfg.distillation.teacher_key == "ability"


@pytest.mark.parametrize("args, message", [
    (["distillation.distillation_loss.loss_mode=jsd"], "loss_mode 'jsd' is not one of kl, k1"),
    (["distillation.distillation_loss.policy_loss_mode=gspo"], "policy_loss_mode"),
    (["+distillation.teacher_models.t2.model_path=/b"], "distillation.teacher_models.teacher_model.key is not set"),
    (["distillation.teacher_models.teacher_model.key=a", "+distillation.teacher_models.t2.model_path=/b",
      "+distillation.teacher_models.t2.key=a"], "distillation.teacher_models: duplicate key 'a'"),
    (["distillation.distillation_loss.loss_max_clamp=-1"], "loss_max_clamp must be > 0"),
])
def test_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=None) as e:
        load([*BASE, "--verl-overrides", "distillation.enabled=true", TEACHER, *args])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_forward_kl_topk_is_refused_under_context_parallelism():
    with pytest.raises(ConfigError, match="forward_kl_topk is not supported with context parallelism"):
        load([*BASE, "--verl-overrides", "distillation.enabled=true", TEACHER,
              "distillation.distillation_loss.loss_mode=forward_kl_topk", "trainer.n_gpus_per_node=2",
              "actor_rollout_ref.actor.megatron.context_parallel_size=2"])

