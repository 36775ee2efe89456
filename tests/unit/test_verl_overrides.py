"""A verl 0.9.1 command line maps onto hybridflow's config: the GSM8K PPO quickstart of verl's docs loads;
keys that mean something else here are named in one line."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.config.verl import translate
from hybridflow.trainer.main import load

# verl's docs (docs/start/quickstart.rst): PPO on GSM8K with Qwen2.5-0.5B-Instruct, as users run it.
VERL_GSM8K_PPO = """
data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet data.train_batch_size=256
data.max_prompt_length=512 data.max_response_length=512 actor_rollout_ref.model.path=models/Qwen2.5-0.5B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
critic.optim.lr=1e-5 critic.model.path=models/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False trainer.n_gpus_per_node=1
trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15
""".split()


def test_verl_gsm8k_ppo_command_line_loads():
    cfg = load(["--config", "configs/ppo_megatron.yaml", "--verl-overrides", *VERL_GSM8K_PPO])
    assert cfg.data.train_files == ["data/gsm8k/train.parquet"] and cfg.data.batch_size == 256
    assert cfg.model.path == "models/Qwen2.5-0.5B-Instruct"
    assert (cfg.actor.optim.lr, cfg.critic.optim.lr) == (1e-6, 1e-5)
    # verl's meanings: mini-batch in prompts, micro-batches per GPU
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu) == (64, 4)
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 8 and cfg.actor.ref_log_prob_micro_batch_size_per_gpu == 4
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4 and cfg.algorithm.kl_ctrl.kl_coef == 0.001
    assert (cfg.resources.n_workers, cfg.resources.gpus_per_worker) == (1, 1)
    assert (cfg.trainer.val_every, cfg.trainer.total_epochs) == (10, 15)
    assert (cfg.trainer.logger, cfg.trainer.val_before_train, cfg.trainer.save_every) == (["console"], False, 10)


def test_our_overrides_and_verl_overrides_combine():
    cfg = load(["--config", "configs/ppo_megatron.yaml", "trainer.seed=7", "--verl-overrides",
                "actor_rollout_ref.actor.clip_ratio=0.25", "data.train_batch_size=64"])
    assert cfg.trainer.seed == 7 and (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.25, 0.25)


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.use_dynamic_bsz=True"],
     "verl keys not supported by hybridflow: actor_rollout_ref.actor.strategy, actor_rollout_ref.actor.use_dynamic_bsz"),
    (["critic.model.path=models/other"], "verl override 'critic.model.path=models/other' must equal model.path"),
    (["actor_rollout_ref.rollout.name=sglang"], "'actor_rollout_ref.rollout.name=sglang' must equal rollout.name ('vllm')"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"],
     "must equal actor.megatron.tensor_model_parallel_size (1)"),
    (["trainer.critic_warmup=5"], "'trainer.critic_warmup=5' must equal supported here (0)"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=48"], "actor.ppo_mini_batch_size (48 prompts) must divide data.batch_size (32)"),
    (["data.train_batch_size"], "bad verl override 'data.train_batch_size': expected key=value"),
    # values of the wrong type name the verl key they were given as
    (["data.train_batch_size=1.5"], "key 'data.batch_size' expects int, got float 1.5 (in verl override "
                                    "'data.train_batch_size=1.5')"),
    (["actor_rollout_ref.actor.ppo_epochs=abc"], "key 'actor.ppo_epochs' expects int, got str 'abc' (in verl override "
                                                 "'actor_rollout_ref.actor.ppo_epochs=abc')"),
    (["actor_rollout_ref.actor.clip_ratio=wide"], "key 'actor.clip_ratio_low' expects float, got str 'wide' (in verl "
                                                  "override 'actor_rollout_ref.actor.clip_ratio=wide')"),
    (["trainer.n_gpus_per_node=1.5"], "verl override 'trainer.n_gpus_per_node=1.5': expects a whole number >= 1, got '1.5'"),
    (["trainer.nnodes=two"], "verl override 'trainer.nnodes=two': expects a whole number >= 1, got 'two'"),
    (["trainer.nnodes=0"], "verl override 'trainer.nnodes=0': expects a whole number >= 1, got '0'"),
])
def test_unsupported_or_conflicting_verl_keys_are_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        load(["--config", "configs/ppo_megatron.yaml", "--verl-overrides", *args])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_no_effect_keys_are_accepted_and_gpu_counts_become_workers():
    ours, _ = translate(["trainer.n_gpus_per_node=8", "trainer.nnodes=2"])
    assert ours == ["resources.n_workers=16", "resources.critic_n_workers=16", "resources.gpus_per_worker=1"]
