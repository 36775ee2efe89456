"""A verl 0.9.1 command line maps onto hybridflow's config: verl's own example scripts resolve unchanged
through the dry run with verl's meanings; every key that carries a verl name has verl's default or a listed,
reasoned difference; whatever is unsupported is named in one line, before anything starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from hybridflow.config import ConfigError, config_to_dict, flat_items
from hybridflow.config.schema import ExperimentConfig
from hybridflow.config.verl import split_argv, translate
from hybridflow.config.verl_keys import DIFFERENCES, MUST_AGREE, NO_EFFECT, NO_EFFECT_SECTIONS, RENAMED, _ours
from hybridflow.trainer.main import dry_run, load

EXAMPLES = Path(__file__).parent.parent / "fixtures" / "verl_examples"
VERL_DEFAULTS = Path(__file__).parent.parent / "fixtures" / "verl" / "ppo_megatron_trainer_0.9.1.yaml"
BASE = ["--config", "configs/ppo_megatron.yaml"]


def script_args(script: Path) -> list[str]:
    """The arguments a verl example script passes to ``python3 -m verl.trainer.main_ppo``: the script runs in
    bash as written, with ``python3`` a function that prints them."""
    out = subprocess.run(["bash", "-c", 'python3() { printf "%s\\0" "$@"; }; HOME=/home/user; source "$0"', script],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=script.parent, check=True).stdout
    args = [a for a in out.decode().split("\0") if a]
    assert args[:2] == ["-m", "verl.trainer.main_ppo"], args[:3]
    return args[2:]


def resolve(args: list[str]) -> ExperimentConfig:
    return load([*BASE, "--verl-overrides", *args])


# A handful of mapped values per script: (our key, value).
EXPECTED = {
    "grpo_trainer_run_qwen2-7b.sh": {
        "algorithm.adv_estimator": "grpo", "data.batch_size": 1024, "actor.ppo_mini_batch_size": 256,
        "actor.ppo_micro_batch_size_per_gpu": 40, "rollout.n": 5, "rollout.tensor_model_parallel_size": 2,
        "actor.ref_param_offload": True, "actor.megatron.param_offload": False, "trainer.val_every": 5,
        "trainer.save_every": 20, "trainer.total_epochs": 15, "trainer.total_steps": None,
        "resources.n_workers": 8, "data.filter_overlong_prompts": True, "use_critic": False,
        "actor.megatron.override_transformer_config": {"recompute_granularity": "full", "recompute_method": "uniform",
                                                       "recompute_num_layers": 1}},
    "grpo_trainer_run_qwen2-7b_math.sh": {
        "data.train_files": ["/home/user/data/gsm8k/train.parquet", "/home/user/data/math/train.parquet"],
        "actor.use_kl_loss": True, "actor.kl_loss_type": "low_var_kl", "algorithm.use_kl_in_reward": False},
    "grpo_trainer_run_qwen2-7b_math_megatron.sh": {
        "actor.megatron.tensor_model_parallel_size": 2, "actor.megatron.pipeline_model_parallel_size": 2,
        "actor.ppo_micro_batch_size_per_gpu": 4, "rollout.tensor_model_parallel_size": 2,
        "actor.megatron.sequence_parallel": True, "actor.megatron.use_distributed_optimizer": True,
        "data.max_prompt_length": 1024, "trainer.logger": ["console", "wandb"]},
    "grpo_trainer_run_qwen2-7b_seq_balance_math_megatron.sh": {
        "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 12000,
        "actor.log_prob_use_dynamic_bsz": True, "actor.megatron.param_offload": True, "actor.ref_param_offload": True},
    "grpo_trainer_run_qwen2_5-7b_math_megatron_diff_tp.sh": {  # generation TP 4 above training TP 2
        "rollout.tensor_model_parallel_size": 4, "actor.megatron.tensor_model_parallel_size": 2,
        "model.path": "Qwen/Qwen2.5-7B-Instruct"},
    "grpo_trainer_run_qwen3-8b.sh": {"model.path": "Qwen/Qwen3-8B", "rollout.gpu_memory_utilization": 0.6},
    "grpo_trainer_run_seed_oss_36b.sh": {
        "data.batch_size": 64, "actor.ppo_mini_batch_size": 8, "rollout.n": 2, "actor.use_dynamic_bsz": True,
        "actor.log_prob_use_dynamic_bsz": True, "trainer.val_before_train": False},
    "grpo_trainer_run_mistral13b_skyworkrm_hhrlhf.sh": {
        "reward_model.enable": True, "reward_model.path": "Skywork/Skywork-Reward-Llama-3.1-8B",
        "trainer.val_every": -1, "rollout.tensor_model_parallel_size": 4, "trainer.total_epochs": 5},
    "ppo_trainer_run_gemma.sh": {
        "algorithm.adv_estimator": "gae", "use_critic": True, "critic.optim.lr": 1e-5, "resources.n_workers": 2,
        "critic.ppo_mini_batch_size": 128, "critic.ppo_micro_batch_size_per_gpu": 4},
    "ppo_trainer_run_qwen2-7b_math_gsm8k_megatron.sh": {
        "rollout.tensor_model_parallel_size": 4, "critic.megatron.tensor_model_parallel_size": 1,  # verl's too
        "trainer.total_epochs": 100, "critic.ppo_mini_batch_size": 256},
    "ppo_trainer_run_qwen2-7b_rm.sh": {
        "reward_model.path": "/home/user/models/FsfairX-LLaMA3-RM-v0.1", "critic.ppo_micro_batch_size_per_gpu": 32,
        "model.path": "/home/user/models/Qwen2-7B-Instruct"},
    "ppo_trainer_run_qwen2-7b_rm_seq_balance.sh": {
        "data.batch_size": 4096, "actor.use_dynamic_bsz": True, "actor.ppo_max_token_len_per_gpu": 24000,
        "actor.log_prob_max_token_len_per_gpu": 24000, "critic.use_dynamic_bsz": True,
        "critic.ppo_max_token_len_per_gpu": 98304, "critic.forward_max_token_len_per_gpu": 98304},
    "ppo_trainer_run_qwen2-7b_seq_balance.sh": {
        "critic.use_dynamic_bsz": True,  # the actor's: verl's ${oc.select:...actor.use_dynamic_bsz}
        "critic.megatron.override_transformer_config": {"recompute_granularity": "full", "recompute_method": "uniform",
                                                        "recompute_num_layers": 1}},
    "ppo_trainer_run_qwen2.5-32b.sh": {"resources.n_workers": 32, "resources.critic_n_workers": 32,
                                       "rollout.tensor_model_parallel_size": 4},
    # the last verl examples (issue 28): keys that change nothing here, the prime manager and the code sandbox
    "ppo_trainer_run_deepseek7b_llm.sh": {  # trainer.use_legacy_worker_impl=auto
        "model.path": "deepseek-ai/deepseek-llm-7b-chat", "data.batch_size": 1024, "trainer.val_every": 1},
    "ppo_trainer_run_deepseek7b_llm_sandbox_fusion.sh": {
        "reward.manager": "prime", "reward.sandbox_fusion.max_concurrent": 128,
        "reward.sandbox_fusion.url": "https://xxxxxxxxx.apigateway-cn-beijing.volceapi.com/run_code",
        "reward.sandbox_fusion.memory_limit_mb": 1024},
    "ppo_trainer_run_deepseek_math_gsm8k_megatron_nsys.sh": {  # *.profiler.*, global_profiler.*
        "data.batch_size": 256, "actor.ppo_mini_batch_size": 64, "rollout.tensor_model_parallel_size": 2,
        "trainer.total_epochs": 100},
    "ppo_trainer_run_qwen2-7b_rm_legacy.sh": {  # reward_model.model.use_remove_padding, .fsdp_config.param_offload
        "reward_model.enable": True, "reward_model.path": "/home/user/models/Skywork-Reward-V2-Llama-3.2-3B",
        "actor.ppo_mini_batch_size": 256, "reward.manager": "naive"},
    "ppo_trainer_run_qwen2-7b_rm_reward_loop_colocate.sh": {
        "reward_model.enable": True, "reward_model.path": "/home/user/models/Skywork-Reward-V2-Llama-3.2-3B"},
    "ppo_trainer_run_qwen2-7b_rm_seq_balance_fused_kernels.sh": {  # model.fused_kernel_options.impl_backend
        "data.batch_size": 4096, "actor.use_dynamic_bsz": True, "reward_model.path": "sfairXC/FsfairX-LLaMA3-RM-v0.1"},
    "ppo_trainer_run_qwen2-7b_rm_seq_balance_nsys.sh": {
        "data.batch_size": 4096, "trainer.val_every": -1, "reward_model.enable": True},
    "ppo_trainer_run_qwen2.5-3b_rm_legacy.sh": {
        "reward_model.enable": True, "model.path": "/home/user/models/Qwen2.5-3B-Instruct"},
}


def value(cfg, key):
    if key == "use_critic":
        from hybridflow.plan import resolve

        return resolve(cfg).needs.critic
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_stored_example_is_checked():
    assert sorted(p.name for p in EXAMPLES.glob("*.sh")) == sorted(EXPECTED) and len(EXPECTED) >= 8


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verl_example_script_resolves_unchanged(name):
    args = script_args(EXAMPLES / name)
    cfg = resolve(args)
    got = {key: value(cfg, key) for key in EXPECTED[name]}
    assert got == EXPECTED[name]
    text = dry_run([*BASE, "--dry-run", "--verl-overrides", *args])  # the CLI's dry run prints it all
    assert "actor.ppo_mini_batch_size = " in text and "# verl override 'actor_rollout_ref.actor.ppo_mini_batch_size=" in text


def test_dry_run_command_prints_and_starts_nothing(capsys):
    from hybridflow.trainer.main import main

    args = script_args(EXAMPLES / "grpo_trainer_run_qwen2-7b_math_megatron.sh")
    assert main(["--config", "configs/ppo_megatron.yaml", "--dry-run", "--verl-overrides", *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^data\.batch_size = 1024 +# verl override 'data\.train_batch_size=1024'$", out, re.M), out
    assert "# accepted without effect: --config-name (picks verl's FSDP or megatron defaults file" in out
    assert "# accepted without effect: data.return_raw_chat (" in out


def test_config_show_takes_verl_overrides_too(capsys):
    from hybridflow.tools.config_show import main

    assert main(["show", "--config", "configs/ppo_megatron.yaml", "--verl-overrides", "data.train_batch_size=64"]) == 0
    assert re.search(r"^data\.batch_size = 64 +# verl override", capsys.readouterr().out, re.M)


def _verl_default(tree: dict, key: str):
    """verl 0.9.1's default of a dotted key, following its ``${oc.select:other,fallback}`` defaults."""
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    if isinstance(node, str) and (m := re.fullmatch(r"\$\{oc\.select:([\w.]+),(.*)\}", node)):
        found = _verl_default(tree, m.group(1))
        return yaml.safe_load(m.group(2)) if found is KeyError else found
    if isinstance(node, str) and node.startswith("${"):
        return KeyError  # other interpolations: not a plain default
    return node


def _mapped_keys() -> list[tuple[str, str]]:
    """(verl key, our key) of every verl key that maps onto one of ours by name."""
    tree = yaml.safe_load(VERL_DEFAULTS.read_text())
    verl_keys = [k for k, _ in flat_items(tree)]
    pairs = []
    for verl_key in verl_keys:
        ours = _ours(verl_key)
        for target in (ours,) if isinstance(ours, str) else (ours or ()):
            if not target.endswith(".") and "override_transformer_config." not in target:
                pairs.append((verl_key, target))
    pairs += [(k, v) for k, v in RENAMED.items() if k not in verl_keys and isinstance(v, str)]
    return pairs


def test_defaults_equal_verl_or_are_listed_differences():
    tree = yaml.safe_load(VERL_DEFAULTS.read_text())
    ours = ExperimentConfig()
    ours.resolve_defaults()
    our_values = dict(flat_items(config_to_dict(ours)))
    pairs = _mapped_keys()
    assert len(pairs) > 60, pairs  # the comparison covers the mapped keys, not a few
    unlisted, differing = [], set()
    for verl_key, key in pairs:
        theirs = _verl_default(tree, verl_key)
        if theirs is KeyError or key not in our_values:
            continue
        mine = our_values[key]
        if mine != theirs:  # (1e-5 == 1.0e-05 and 1 == 1.0 compare equal)
            differing.add(key)
            if key not in DIFFERENCES:
                unlisted.append(f"{key}={mine!r} (verl {verl_key}={theirs!r})")
    assert not unlisted, f"defaults that differ from verl 0.9.1 without a reason in DIFFERENCES: {unlisted}"
    stale = [key for key in DIFFERENCES if key not in differing]
    assert not stale, f"listed in DIFFERENCES but equal to verl's default (or not mapped): {stale}"


def test_translation_tables_have_reasons_and_no_overlap():
    assert all(isinstance(why, str) and len(why) > 10 for why in NO_EFFECT.values())
    assert all(len(why) > 10 for _, why in NO_EFFECT_SECTIONS.values())
    assert not set(NO_EFFECT) & set(RENAMED) and not set(NO_EFFECT) & set(MUST_AGREE)


def test_sections_without_effect_name_verl_leaves():
    """Each leaf accepted under a section without effect is one of verl 0.9.1's (the reward model's
    fsdp_config is verl's older dp_reward_model.yaml's, which its example scripts still set; fsdp_config.mixed_precision
    is the FSDP engine's free dict, FSDPEngineConfig.mixed_precision, with the leaves its fsdp workers read)."""
    verl_keys = [k for k, _ in flat_items(yaml.safe_load(VERL_DEFAULTS.read_text()))]
    for section, (leaves, _) in NO_EFFECT_SECTIONS.items():
        free_dicts = ("fsdp_config.mixed_precision.", "engine_kwargs.trtllm.")  # engine_kwargs.trtllm: {} in verl
        if section.startswith("reward_model.model.fsdp_config.") or section.endswith(free_dicts):
            continue
        for leaf in leaves:
            assert any(k == section + leaf or (leaf.endswith(".") and k.startswith(section + leaf)) for k in verl_keys), \
                section + leaf


def test_other_rollout_engines_sample_with_vllm_after_a_notice(capsys):
    """rollout.name=sglang or trtllm: vLLM samples, with the script's sampling settings; one notice line, in the dry
    run and when a run starts (here stopped by a config error, after the notice)."""
    from hybridflow.trainer.main import main

    args = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters=8"]
    cfg = resolve(args)
    assert (cfg.rollout.name, cfg.rollout.temperature, cfg.rollout.top_p) == ("vllm", 0.7, 0.9)
    notice = ("notice: verl override 'actor_rollout_ref.rollout.name=sglang': hybridflow samples with vLLM, with the "
              "same sampling settings (SGLang's server is not built here)")
    assert f"# {notice}" in dry_run([*BASE, "--dry-run", "--verl-overrides", *args]).splitlines()
    assert main([*BASE, "model.path=/nonexistent/model", "--verl-overrides", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == notice and err[-1].startswith("config error: "), err


def test_our_overrides_and_verl_overrides_combine():
    cfg = load([*BASE, "trainer.seed=7", "--verl-overrides", "actor_rollout_ref.actor.clip_ratio=0.25",
                "data.train_batch_size=64"])
    assert cfg.trainer.seed == 7 and (cfg.actor.clip_ratio_low, cfg.actor.clip_ratio_high) == (0.25, 0.25)


def test_verl_semantics_of_shared_names():
    cfg = resolve(["trainer.total_training_steps=7", "trainer.total_epochs=3", "trainer.save_freq=-1",
                   "trainer.test_freq=-1", "trainer.resume_mode=resume_path",
                   "trainer.resume_from_path=outputs/x/checkpoints/step_3", "trainer.max_actor_ckpt_to_keep=3",
                   "trainer.max_critic_ckpt_to_keep=3"])
    t = cfg.trainer
    assert (t.total_steps, t.total_epochs, t.save_every, t.val_every) == (7, 3, -1, -1)
    assert (t.resume_mode, t.resume_from_path, t.max_checkpoints, t.save_hf_at_end) == (
        "resume_path", "outputs/x/checkpoints/step_3", 3, False)  # save_freq -1: no checkpoint, no export
    assert resolve([]).algorithm.use_kl_in_reward is False


def test_fsdp_keys_map_onto_megatron():
    cfg = resolve(["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                   "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                   "actor_rollout_ref.ref.fsdp_config.param_offload=False",
                   "critic.model.fsdp_config.optimizer_offload=True", "critic.strategy=fsdp2"])
    assert (cfg.actor.megatron.param_offload, cfg.actor.megatron.optimizer_offload) == (True, True)
    assert cfg.actor.ref_param_offload is False and cfg.critic.megatron.optimizer_offload is True
    assert cfg.actor.megatron.use_distributed_optimizer  # FSDP's sharded optimizer state


def test_explicit_recompute_settings_win_over_gradient_checkpointing():
    cfg = resolve(["+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=selective",
                   "actor_rollout_ref.model.enable_gradient_checkpointing=True"])
    assert cfg.actor.megatron.override_transformer_config["recompute_granularity"] == "selective"
    assert resolve(["actor_rollout_ref.model.enable_gradient_checkpointing=False"]).actor.megatron.override_transformer_config == {}
    megatron = resolve(["--config-name=ppo_megatron_trainer", "actor_rollout_ref.model.enable_gradient_checkpointing=True"])
    assert megatron.actor.megatron.override_transformer_config == {}  # verl's megatron engine ignores the key


def test_hydra_config_name_with_a_space_and_engine_kwargs():
    ours, verl = split_argv(["--config", "a.yaml", "--verl-overrides", "--config-path", "config", "--config-name",
                             "ppo_megatron_trainer", "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"])
    assert ours == ["--config", "a.yaml"]
    assert verl[:2] == ["--config-path=config", "--config-name=ppo_megatron_trainer"]
    assert translate(verl).overrides == ["rollout.engine_kwargs.swap_space=4"]


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.actor.use_torch_compile=True", "actor_rollout_ref.actor.megatron.bogus=1",
      "actor_rollout_ref.actor.checkpoint.async_save=True", "data.image_key=images"],
     "verl keys not supported by hybridflow: actor_rollout_ref.actor.megatron.bogus, "
     "actor_rollout_ref.actor.checkpoint.async_save, data.image_key"),
    (["critic.model.path=models/other"], "verl override 'critic.model.path=models/other' must equal model.path"),
    (["actor_rollout_ref.rollout.name=hf"], "'actor_rollout_ref.rollout.name=hf' must equal rollout.name ('vllm')"),
    (["actor_rollout_ref.rollout.data_parallel_size=2"], "'actor_rollout_ref.rollout.data_parallel_size=2' must "
                                                         "equal supported here (1)"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"],
     "must equal actor.megatron.tensor_model_parallel_size (1)"),
    (["trainer.critic_warmup=5"], "'trainer.critic_warmup=5' must equal supported here (0)"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bogus"], "actor.policy_loss: unknown policy loss 'bogus'"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=48", "data.train_batch_size=64"],
     "actor.ppo_mini_batch_size (48 prompts) must divide data.batch_size (64)"),
    (["data.train_batch_size"], "bad verl override 'data.train_batch_size': expected key=value"),
    (["data.truncation=sideways"], "data.truncation"),
    (["trainer.resume_mode=resume_path"], "resume_mode 'resume_path' needs resume_from_path"),
    # values of the wrong type name the verl key they were given as
    (["data.train_batch_size=1.5"], "key 'data.batch_size' expects int, got float 1.5 (in verl override "
                                    "'data.train_batch_size=1.5')"),
    (["actor_rollout_ref.actor.clip_ratio=wide"], "key 'actor.clip_ratio_low' expects float, got str 'wide' (in verl "
                                                  "override 'actor_rollout_ref.actor.clip_ratio=wide')"),
    (["trainer.n_gpus_per_node=1.5"], "verl override 'trainer.n_gpus_per_node=1.5': expects a whole number >= 1, got '1.5'"),
    (["trainer.nnodes=0"], "verl override 'trainer.nnodes=0': expects a whole number >= 1, got '0'"),
    (["reward_model.reward_manager=batch"], "reward_model.reward_manager=batch (reward managers here: naive, dapo, prime)"),
    (["--config-name=my_grpo"], "verl --config-name=my_grpo: hybridflow knows verl's own ppo_trainer and "
                                "ppo_megatron_trainer only"),
    (["--config-path=/nonexistent/verl/config", "--config-name=ppo_trainer"],
     "verl --config-path=/nonexistent/verl/config: no such folder"),
    (["--config-path=tests/fixtures", "--config-name=ppo_trainer"],
     "verl --config-path=tests/fixtures: hybridflow reads only verl's own config folder (--config-path=config)"),
    (["global_profiler.tool_typo=nsys", "actor_rollout_ref.actor.profiler.enabled=True"],
     "verl keys not supported by hybridflow: global_profiler.tool_typo, actor_rollout_ref.actor.profiler.enabled"),
    (["reward_model.sandbox_fusion.url=localhost:8080"], "sandbox_fusion.url must be an http(s) URL"),
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"],
     "verl applies overlong shaping only in the dapo reward manager; add reward_model.reward_manager=dapo"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.type=dora"],
     "'actor_rollout_ref.model.lora.type=dora' must equal supported here ('lora')"),
    # the reference's context parallelism (Ulysses on megatron) and virtual stages are the actor's
    (["actor_rollout_ref.ref.megatron.context_parallel_size=2"],
     "'actor_rollout_ref.ref.megatron.context_parallel_size=2' must equal actor.megatron.context_parallel_size (1)"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
      "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"],
     "'actor_rollout_ref.ref.ulysses_sequence_parallel_size=1' must equal actor.megatron.context_parallel_size (2)"),
    # two verl names of one value: the later must not silently win
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
      "actor_rollout_ref.actor.megatron.context_parallel_size=4"],
     "verl overrides actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 and "
     "actor_rollout_ref.actor.megatron.context_parallel_size=4 both set actor.megatron.context_parallel_size: they "
     "must agree"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "virtual_pipeline_model_parallel_size 2 needs pipeline_model_parallel_size > 1"),
    (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
      "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=1", "trainer.n_gpus_per_node=2"],
     "'actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=1' must equal "
     "actor.megatron.virtual_pipeline_model_parallel_size (2)"),
    (["actor_rollout_ref.model.lora.rank=1024", "actor_rollout_ref.model.lora.merge=False"],
     "model.lora.rank 1024 with merge=false: vLLM's LoRA takes ranks up to 512; set model.lora.merge=true"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,lm_head]"],
     "expects all-linear or a list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.exclude_modules=[linear_fc2]"],
     "model.lora.exclude_modules needs target_modules empty"),
])
def test_unsupported_or_conflicting_verl_keys_are_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        resolve(args)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_dapo_reward_manager_with_its_overlong_buffer():
    """verl-recipe DAPO scripts: reward_manager=dapo with reward_kwargs.overlong_buffer_cfg (legacy reward_model.*
    spellings, which verl migrates to reward.*); the overlong shaping here is reward.overlong_buffer."""
    cfg = resolve(["reward_model.reward_manager=dapo", "data.max_response_length=512",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.len=128",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                   "+reward_model.reward_kwargs.max_resp_len=512"])
    ob = cfg.reward.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.log) == (True, 128, 1.0, False)
    assert resolve(["reward.reward_manager.name=dapo"]).reward.overlong_buffer.enable is False  # dapo, no shaping
    assert resolve(["reward_model.reward_manager=naive"]).reward.overlong_buffer.enable is False


def test_gpu_counts_become_workers():
    assert translate(["trainer.n_gpus_per_node=8", "trainer.nnodes=2"]).overrides == [
        "resources.n_workers=16", "resources.critic_n_workers=16", "resources.gpus_per_worker=1"]


def test_readme_verl_command_line_resolves():
    """The README's "Coming from verl" command line (verl's quickstart, unchanged) resolves."""
    readme = (Path(__file__).parent.parent.parent / "README.md").read_text()
    block = readme.split("hybridflow train --config configs/ppo_megatron.yaml --verl-overrides \\\n", 1)[1]
    block = block.split("```", 1)[0].replace("$HOME", "/home/user")
    args = block.replace("\\\n", " ").split()
    cfg = resolve(args)
    assert (cfg.data.batch_size, cfg.actor.ppo_mini_batch_size, cfg.critic.ppo_mini_batch_size) == (256, 64, 64)
    assert (cfg.trainer.save_every, cfg.trainer.val_every, cfg.trainer.total_epochs) == (10, 10, 15)
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.resources.n_workers == 1


def test_verl_config_folder_and_names_are_accepted():
    for args in (["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"],
                 ["--config-path=./config", "--config-name=ppo_trainer"]):
        assert resolve(args).data.batch_size == 1024


def test_validation_sampling_and_profiler_keys():
    """rollout.val_kwargs maps onto validation sampling; the profiler sections are accepted, each listed once
    (with the reason) by the dry run."""
    args = [f"actor_rollout_ref.rollout.val_kwargs.{k}" for k in ("temperature=0.6", "top_p=0.95", "top_k=20", "n=4",
                                                                   "do_sample=True")]
    v = resolve(args).rollout.val_kwargs
    assert (v.temperature, v.top_p, v.top_k, v.n) == (0.6, 0.95, 20, 4)
    profile = ["actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.ranks=[0,1]",
               "+actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=2", "global_profiler.tool=torch",
               "global_profiler.steps=[1,2]", "+global_profiler.global_tool_config.nsys.discrete=True"]
    text = dry_run([*BASE, "--dry-run", "--verl-overrides", *profile])
    assert text.count("# accepted without effect: actor_rollout_ref.actor.profiler.* (verl's profiler hooks") == 1
    assert text.count("# accepted without effect: global_profiler.* (") == 1


def test_prime_manager_with_a_custom_reward_function_is_refused(tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ConfigError, match="reward.manager 'prime' runs the rule and sandbox scorers; "
                                          "custom_reward_function.path is called row by row"):
        resolve(["reward_model.reward_manager=prime", f"custom_reward_function.path={fn}"])


def test_lora_keys_of_both_verl_engines():
    """The megatron section (Megatron-Bridge's names, alpha 32) and the FSDP engine's peft keys (lora_alpha 16,
    peft's module names onto the megatron linear holding them) both land on model.lora."""
    cfg = resolve(["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.target_modules=[linear_qkv]",
                   "actor_rollout_ref.model.lora.lora_A_init_method=kaiming"])
    lora = cfg.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.lora_A_init_method) == (16, 32, ["linear_qkv"], "kaiming")
    cfg = resolve(["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.target_modules=all-linear"])
    assert (cfg.model.lora.rank, cfg.model.lora.alpha) == (32, 16)
    assert cfg.model.lora.target_modules == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    cfg = resolve(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=64",
                   "actor_rollout_ref.model.target_modules=[q_proj,v_proj,down_proj]"])
    assert (cfg.model.lora.alpha, cfg.model.lora.target_modules) == (64, ["linear_qkv", "linear_fc2"])


def test_context_parallel_ulysses_and_virtual_stages_resolve():
    """verl's megatron context_parallel_size, and its FSDP scripts' Ulysses size (context parallelism on megatron),
    set each role's CP; virtual pipeline stages each role's VPP; its megatron scripts often spell out the layouts
    they leave off (no virtual stages)."""
    off = [f"{role}.megatron.context_parallel_size=1" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                                                   "critic")]
    off += ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1", "critic.ulysses_sequence_parallel_size=1"]
    assert resolve(off) == resolve([])
    cp = resolve(["actor_rollout_ref.actor.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2",
                  "actor_rollout_ref.ref.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert (cp.actor.megatron.context_parallel_size, cp.critic.megatron.context_parallel_size) == (2, 2)
    ulysses = resolve(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                       "critic.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"])
    assert ulysses == cp
    vpp = resolve([f"{role}.megatron.{key}=2" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
                   for key in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")]
                  + ["trainer.n_gpus_per_node=2"])
    assert (vpp.actor.megatron.virtual_pipeline_model_parallel_size,
            vpp.critic.megatron.virtual_pipeline_model_parallel_size) == (2, 2)


def test_muon_keys_map_and_the_distributed_optimizer_is_refused_in_one_line():
    """verl 0.9.1's optim.optimizer=muon and muon_* keys become the role's (megatron/optimizer_config.py builds
    megatron-core's Muon from them); megatron-core 0.16.1 builds Muon without the distributed optimizer, so
    leaving it on is one line naming the key, before start."""
    from hybridflow.megatron.optimizer_config import muon_fields
    from hybridflow.trainer.preflight import check_config

    args = [*BASE, "--verl-overrides", "actor_rollout_ref.actor.optim.optimizer=muon",
            "actor_rollout_ref.actor.optim.muon_momentum=0.9", "actor_rollout_ref.actor.optim.muon_tp_mode=duplicated",
            "actor_rollout_ref.actor.optim.muon_match_adamw_update_rms=true",
            "actor_rollout_ref.actor.optim.use_layer_wise_distributed_optimizer=false", "critic.optim.optimizer=adam"]
    cfg = load(args)
    assert (cfg.actor.optim.optimizer, cfg.critic.optim.optimizer) == ("muon", "adam")
    fields = muon_fields(cfg.actor.optim)
    assert fields["muon_momentum"] == 0.9 and fields["muon_tp_mode"] == "duplicated"
    assert fields["muon_extra_scale_factor"] == pytest.approx(((1 - 0.9) / (1 + 0.9)) ** 0.5)  # betas[0] = 0.9
    assert muon_fields(cfg.critic.optim) is None
    cfg.actor.megatron.use_distributed_optimizer = True
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert str(e.value).startswith("actor.optim.optimizer=muon keeps its state") and "\n" not in str(e.value)
    assert "actor.megatron.use_distributed_optimizer=false" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load([*args, "actor_rollout_ref.actor.optim.muon_coefficient_type=cubic"])
    assert "muon_coefficient_type" in str(e.value) and "\n" not in str(e.value)

def test_mtp_off_is_accepted_and_on_is_refused_in_one_line_saying_why():
    """verl 0.9.1's model.mtp.*: multi-token prediction is not built here; off (verl's default) with its settings
    beside it changes nothing, on is refused in one line naming the key and why (config/verl_keys.MTP_WHY)."""
    off = ["actor_rollout_ref.model.mtp.enable=false", "actor_rollout_ref.model.mtp.num_speculative_tokens=1"]
    assert load([*BASE, "--verl-overrides", *off]).actor.optim.lr > 0
    with pytest.raises(ConfigError) as e:
        load([*BASE, "--verl-overrides", "actor_rollout_ref.model.mtp.enable=true"])
    assert "'actor_rollout_ref.model.mtp.enable=true'" in str(e.value) and "\n" not in str(e.value)
    assert "neither trained nor used for speculative decoding" in str(e.value)
