"""verl 0.9.1's keys and what each means here (config/verl.py translates a command line with them): renamed keys,
leaves spelled the same under a section, whole dicts passed on, second names that must agree, keys and sections
without effect, and the deliberate differences from verl's defaults."""

from __future__ import annotations

import re

from hybridflow.config.loader import ConfigError

_A = "actor_rollout_ref.actor."
_R = "actor_rollout_ref.rollout."
_REF = "actor_rollout_ref.ref."
_MODEL = "actor_rollout_ref.model."

_SANDBOX_LEAVES = ("url", "max_concurrent", "memory_limit_mb")
# verl section -> ours, for leaves spelled the same below it (each leaf listed: anything else is unsupported)
_SAME_LEAVES = {
    _A: ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "clip_ratio_low", "clip_ratio_high",
         "clip_ratio_c", "loss_agg_mode", "loss_scale_factor", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
         "entropy_coeff", "use_dynamic_bsz", "ppo_max_token_len_per_gpu", "tau_pos", "tau_neg",
         "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size"),
    "critic.": ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "cliprange_value",
                "loss_agg_mode", "loss_scale_factor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
                "forward_max_token_len_per_gpu"),
    _R: ("n", "temperature", "top_p", "top_k", "tensor_model_parallel_size", "gpu_memory_utilization", "dtype",
         "enforce_eager", "free_cache_engine", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill"),
    "algorithm.": ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
                   "gdpo_reward_keys", "gdpo_reward_weights", "use_pf_ppo"),
    "algorithm.pf_ppo.": ("reweight_method", "weight_pow"),
    "distillation.": ("enabled", "teacher_key"),
    "distillation.distillation_loss.": ("loss_mode", "topk", "use_task_rewards", "distillation_loss_coef",
                                        "loss_max_clamp", "log_prob_min_clamp", "use_policy_gradient",
                                        "clip_ratio_low", "clip_ratio_high"),
    # policy_loss.rollout_correction is not here (unsupported)
    _A + "policy_loss.": ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef",
                          "dro_beta"),
    "algorithm.kl_ctrl.": ("type", "kl_coef", "target_kl", "horizon"),
    "algorithm.filter_groups.": ("enable", "metric", "max_num_gen_batches"),
    _R + "multi_turn.": ("enable", "max_assistant_turns", "max_user_turns", "max_parallel_calls",
                         "max_tool_response_length", "tool_response_truncate_side", "format", "tool_config_path"),
    "algorithm.rollout_correction.": ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                                      "rollout_rs_threshold", "bypass_mode", "loss_type"),
    "data.": ("train_files", "val_files", "prompt_key", "max_prompt_length", "max_response_length", "shuffle",
              "val_batch_size", "reward_fn_key", "filter_overlong_prompts", "truncation"),
    "trainer.": ("experiment_name", "total_epochs", "logger", "project_name", "val_before_train", "balance_batch"),
    "custom_reward_function.": ("path", "name"),
    "reward_model.": ("enable",),
    _MODEL + "lora.": ("rank", "alpha", "dropout", "target_modules", "exclude_modules", "lora_A_init_method",
                       "lora_B_init_method", "merge", "adapter_path"),
    _R + "val_kwargs.": ("temperature", "top_p", "top_k", "n"),
    "reward.sandbox_fusion.": _SANDBOX_LEAVES,
}
_OPTIM = ("lr", "weight_decay", "betas", "clip_grad", "lr_warmup_steps", "lr_warmup_steps_ratio", "lr_warmup_init",
          "lr_decay_style", "lr_decay_steps", "min_lr", "min_lr_ratio", "optimizer", "muon_momentum", "muon_nesterov",
          "muon_split_qkv", "muon_scale_mode", "muon_coefficient_type", "muon_num_ns_steps", "muon_tp_mode",
          "muon_fp32_matmul_prec", "muon_extra_scale_factor", "muon_scalar_optimizer", "muon_match_adamw_update_rms")
_MEGATRON = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
             "virtual_pipeline_model_parallel_size", "sequence_parallel",
             "use_distributed_optimizer", "dtype", "param_offload", "grad_offload", "optimizer_offload",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "use_dist_checkpointing",
             "dist_checkpointing_path", "dist_checkpointing_prefix")
_OURS_PREFIX = {_A: "actor.", _R: "rollout.", "algorithm.kl_ctrl.": "algorithm.kl_ctrl.",
                _R + "val_kwargs.": "rollout.val_kwargs.",
                _R + "multi_turn.": "rollout.multi_turn.",
                _A + "policy_loss.": "actor.policy_loss.", _MODEL + "lora.": "model.lora."}

_OVERLONG_SECTIONS = ("reward.reward_kwargs.overlong_buffer_cfg", "reward_model.reward_kwargs.overlong_buffer_cfg",
                      "reward_model.overlong_buffer")
# verl's reward manager (reward_model.reward_manager is the legacy name verl migrates to reward.reward_manager.name):
# "naive" scores each response, as the reward path here does; "dapo" also applies the overlong shaping of
# overlong_buffer_cfg, which the reward path here applies whenever reward.overlong_buffer.enable. So both are
# accepted, and overlong shaping enabled on a verl command line needs "dapo" (verl's naive manager ignores it).
# "prime" (workers/reward_manager/prime.py) scores rows concurrently, a failed or 300 s row scoring 0: ours
# is reward.manager=prime (rewards/routing.py).
REWARD_MANAGER_KEYS = ("reward_model.reward_manager", "reward.reward_manager.name")
REWARD_MANAGERS = {"naive": "naive", "dapo": "naive", "prime": "prime"}  # verl's -> reward.manager

RENAMED = {
    "data.train_batch_size": "data.batch_size",
    "data.seed": "trainer.seed",
    _MODEL + "path": "model.path",
    _MODEL + "trust_remote_code": "model.trust_remote_code",
    _MODEL + "override_config.model_config.max_position_embeddings": "model.max_position_embeddings",
    # verl's timeout (seconds) of its workers' process groups: one torch.distributed timeout for every group here
    "actor_rollout_ref.nccl_timeout": "trainer.dist_timeout_s",
    _A + "grad_clip": "actor.optim.clip_grad",
    # FSDP's Ulysses sequence parallelism splits each sequence over ranks: on megatron that is context parallelism
    # (a deliberate difference: K/V cross ranks, not heads; the same sizes and results)
    _A + "ulysses_sequence_parallel_size": "actor.megatron.context_parallel_size",
    "critic.ulysses_sequence_parallel_size": "critic.megatron.context_parallel_size",
    _A + "clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    "distillation.distillation_loss.clip_ratio": ("distillation.distillation_loss.clip_ratio_low",
                                                  "distillation.distillation_loss.clip_ratio_high"),
    _R + "log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    _R + "log_prob_use_dynamic_bsz": "actor.log_prob_use_dynamic_bsz",
    _R + "log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    _REF + "log_prob_micro_batch_size_per_gpu": "actor.ref_log_prob_micro_batch_size_per_gpu",
    _REF + "megatron.param_offload": "actor.ref_param_offload",
    _REF + "fsdp_config.param_offload": "actor.ref_param_offload",
    _A + "fsdp_config.param_offload": "actor.megatron.param_offload",
    _A + "fsdp_config.optimizer_offload": "actor.megatron.optimizer_offload",
    "critic.model.fsdp_config.param_offload": "critic.megatron.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.megatron.optimizer_offload",
    "critic.grad_clip": "critic.optim.clip_grad",
    "critic.forward_micro_batch_size_per_gpu": "critic.log_prob_micro_batch_size_per_gpu",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_every",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.save_freq": "trainer.save_every",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints",
    "trainer.resume_mode": "trainer.resume_mode",
    "trainer.resume_from_path": "trainer.resume_from_path",
    "trainer.log_val_generations": "trainer.val_samples",
    "reward_model.model.path": "reward_model.path",
    # the trainer modes (config/schema.py Schedule) and the fully-async recipe's names for the same settings:
    # its staleness_threshold (samples generated ahead, as a fraction of a sync period's) is our look-ahead
    "trainer.v1.trainer_mode": "schedule.mode",
    "trainer.v1.colocate_async.num_warmup_batches": "schedule.num_warmup_batches",
    "trainer.v1.separate_async.num_warmup_batches": "schedule.num_warmup_batches",
    "trainer.v1.separate_async.parameter_sync_step": "schedule.parameter_sync_step",
    "trainer.v1.sampler.max_off_policy_threshold": "schedule.max_off_policy_threshold",
    "trainer.v1.sampler.max_off_policy_strategy": "schedule.max_off_policy_strategy",
    "async_training.staleness_threshold": "schedule.num_warmup_batches",
    "async_training.trigger_parameter_sync_step": "schedule.parameter_sync_step",
    "async_training.partial_rollout": "schedule.partial_rollout",
    _R + "checkpoint_engine.backend": "rollout.checkpoint_engine.backend",
    _R + "checkpoint_engine.update_weights_bucket_megabytes": "rollout.checkpoint_engine.update_weights_bucket_megabytes",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size",
    _A + "megatron.router_replay.mode": "actor.megatron.router_replay.mode",  # MoE routing replay (R2, R3)
    # LoRA: the FSDP engine's names (peft) and the megatron section's (Megatron-Bridge) both onto model.lora
    _MODEL + "lora_rank": "model.lora.rank",
    _MODEL + "lora_alpha": "model.lora.alpha",
    _MODEL + "lora_adapter_path": "model.lora.adapter_path",
    _R + "enable_rollout_routing_replay": "rollout.enable_rollout_routing_replay",
    # DAPO's overlong shaping: verl 0.9.1's DAPO reward manager reads reward.reward_kwargs.overlong_buffer_cfg
    # (reward_model.reward_kwargs is moved there by verl's migrate_legacy_reward_impl); the DAPO recipe's older
    # scripts set reward_model.overlong_buffer
    **{f"{section}.{leaf}": f"reward.overlong_buffer.{leaf}"
       for section in _OVERLONG_SECTIONS for leaf in ("enable", "len", "penalty_factor", "log")},
    # the remote code sandbox: verl 0.9.1 migrates the legacy top-level sandbox_fusion to reward.sandbox_fusion
    # (experimental/reward_loop/reward_loop.py migrate_legacy_reward_impl); older scripts set it under reward_model
    **{f"{section}.{leaf}": f"reward.sandbox_fusion.{leaf}"
       for section in ("sandbox_fusion", "reward_model.sandbox_fusion") for leaf in _SANDBOX_LEAVES},
}
# Whole dicts passed on: verl section -> ours (their entries are checked where they are used, before start).
_DICTS = {
    _A + "megatron.override_transformer_config.": "actor.megatron.override_transformer_config.",
    "critic.megatron.override_transformer_config.": "critic.megatron.override_transformer_config.",
    _A + "optim.override_optimizer_config.": "actor.optim.override_optimizer_config.",
    "critic.optim.override_optimizer_config.": "critic.optim.override_optimizer_config.",
    _R + "engine_kwargs.vllm.": "rollout.engine_kwargs.",
    "data.apply_chat_template_kwargs.": "data.apply_chat_template_kwargs.",
}
# verl's FSDP engine reads enable_gradient_checkpointing (HF gradient checkpointing: every layer recomputed
# in full, which is megatron's full, uniform recompute one layer at a time); verl 0.9.1's megatron engine
# ignores it and recomputes only as override_transformer_config.recompute_* says. So does the translation:
# the key means recompute for an FSDP command line, nothing under --config-name=ppo_megatron_trainer.
_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": "1"}
_CHECKPOINTING = {_MODEL + "enable_gradient_checkpointing": "actor.megatron.override_transformer_config.",
                  "critic.model.enable_gradient_checkpointing": "critic.megatron.override_transformer_config."}
# Second names for one of our values: accepted when they agree with it (checked after loading).
MUST_AGREE = {
    "critic.model.path": "model.path",  # the critic starts from the policy's weights here
    # one tokenizer and config for the policy folder: the data's prompts, the critic and vLLM read the same
    "critic.model.trust_remote_code": "model.trust_remote_code",
    "data.trust_remote_code": "model.trust_remote_code",
    "critic.nccl_timeout": "trainer.dist_timeout_s",
    _R + "name": "rollout.name",
    **{f"{_REF}megatron.{k}": f"actor.megatron.{k}"  # the reference shares the actor's layout
       for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "virtual_pipeline_model_parallel_size", "sequence_parallel",
                 "expert_model_parallel_size", "expert_tensor_parallel_size", "router_replay.mode",
                 "use_dist_checkpointing", "dist_checkpointing_path", "dist_checkpointing_prefix")},  # ref starts as actor
    "trainer.max_critic_ckpt_to_keep": "trainer.max_checkpoints",  # one retention for the whole checkpoint
    _REF + "log_prob_use_dynamic_bsz": "actor.log_prob_use_dynamic_bsz",  # one setting for actor and ref forwards
    _REF + "log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "trainer.critic_warmup": 0,  # no critic warm-up steps here
    "critic.megatron.router_replay.mode": "disabled",  # the critic's routers route by themselves here
    "reward.reward_kwargs.max_resp_len": "data.max_response_length",  # the overlong buffer ends at the longest response
    "reward_model.reward_kwargs.max_resp_len": "data.max_response_length",
    "trainer.device": "cuda",
    "async_training.require_batches": 1,  # a step's mini-batches come from one batch of data.batch_size prompts
    "trainer.v1.separate_async.hybrid_rollout.enable_switch": False,  # the trainer's devices are not lent to rollout
    _MODEL + "lora.type": "lora",  # Megatron-Bridge's fused lora (canonical_lora, dora, vlm_lora are not built here)
    _MODEL + "lora.dropout_position": "pre",
    _MODEL + "lora.a2a_experimental": False,
    _MODEL + "lora.dtype": None,  # the adapters take the model's dtype (fp32 main params in the optimizer)
    # the reference runs in the actor's processes: its Ulysses size (context parallelism here) is the actor's
    _REF + "ulysses_sequence_parallel_size": "actor.megatron.context_parallel_size",
    # one vLLM engine per rollout.tensor_model_parallel_size ranks, each without data or expert parallelism inside
    _R + "data_parallel_size": 1,
    _R + "expert_parallel_size": 1,
    "distillation.distillation_loss.policy_loss_mode": "vanilla",  # verl's only one too
    # Muon's state replicated on each data-parallel rank (megatron-core 0.16.1's get_megatron_muon_optimizer without
    # its LayerWiseDistributedOptimizer, which verl turns on with this key)
    **{f"{role}optim.use_layer_wise_distributed_optimizer": False for role in (_A, "critic.")},
    # multi-token prediction: not trained here, nor used to draft tokens (MTP_WHY)
    _MODEL + "mtp.enable": False,
}
MTP_WHY = ("multi-token prediction is neither trained nor used for speculative decoding here (model.mtp.enable must be "
           "false); a checkpoint's MTP layers are skipped on import with a note (trainer/model_files.py)")
AGREE_WHY = {_MODEL + "mtp.enable": MTP_WHY}  # a MUST_AGREE key -> why it must agree, in its error
# verl's other rollout engines: a script naming one samples with vLLM here (a notice says so), its sampling
# settings (rollout.temperature, top_p, top_k, n, response length) carried over as they are
OTHER_ROLLOUT_ENGINES = {"sglang": "SGLang's server is not built here", "trtllm": "TensorRT-LLM is not built here"}
_STRATEGY = "an FSDP run becomes megatron data parallelism with the distributed optimizer (this module's docstring)"
_FSDP_ONLY = "FSDP's wrapping/sharding detail; megatron's distributed optimizer shards state here"
NO_EFFECT = {  # verl key -> why it changes nothing here
    _A + "strategy": _STRATEGY, _REF + "strategy": _STRATEGY, "critic.strategy": _STRATEGY,
    "--config-name": "picks verl's FSDP or megatron defaults file; hybridflow's engine is megatron-core either way",
    "--config-path": "verl's config folder; hybridflow's configs come from --config",
    _MODEL + "use_remove_padding": "rows are always laid out padding-free",
    "critic.model.use_remove_padding": "rows are always laid out padding-free",
    _MODEL + "use_fused_kernels": "log-probs come from megatron's vocab-parallel cross entropy without full logits",
    _A + "megatron.use_mbridge": "hybridflow converts HF weights itself (megatron/convert.py)",
    _REF + "megatron.use_mbridge": "hybridflow converts HF weights itself (megatron/convert.py)",
    "critic.megatron.use_mbridge": "hybridflow converts HF weights itself (megatron/convert.py)",
    _A + "megatron.seed": "trainer.seed seeds every role",
    _A + "use_torch_compile": "megatron-core's kernels are used as they are",
    _A + "fsdp_config.model_dtype": "FSDP's parameter storage dtype; actor.megatron.dtype sets compute here, with "
                                    "fp32 main params in the optimizer",
    _A + "fsdp_config.fsdp_size": _FSDP_ONLY, _A + "fsdp_config.wrap_policy": _FSDP_ONLY,
    _A + "fsdp_config.reshard_after_forward": _FSDP_ONLY, "critic.model.fsdp_config.fsdp_size": _FSDP_ONLY,
    _REF + "fsdp_config.reshard_after_forward": _FSDP_ONLY,
    "data.return_raw_chat": "prompts are rendered with the chat template at load; the raw chat is not needed",
    "data.filter_overlong_prompts_workers": "filtering runs in the loading process",
    "data.dataloader_num_workers": "prompts are tokenized once at load",
    _R + "mode": "one batched vLLM call per step gives the samples verl's sync and async modes give",
    _R + "multi_turn.use_inference_chat_template": "tool responses are rendered with the tokenizer's chat template",
    _R + "multi_turn.tokenization_sanity_check_mode": "sampled tokens are kept as sampled (token-in, token-out): "
                                                      "no re-tokenization to check",
    _R + "agent.default_agent_loop": "rollout.multi_turn.enable picks the tool agent loop for every row",
    _R + "agent.num_workers": "the agent loop runs in each rollout worker, batched per turn",
    _R + "load_format": "weights reach vLLM through the resharding engine, not a load format",
    _R + "calculate_log_probs": "sampled rollouts always carry vLLM's log-probs (rollout_log_probs)",
    _R + "engine_kwargs.sglang.attention_backend": "sglang is not used (vLLM is the rollout engine)",
    _R + "val_kwargs.do_sample": "verl 0.9.1's vLLM agent loop samples validation with val_kwargs' temperature, "
                                 "top_p and top_k whatever do_sample says (temperature 0: greedy); so does hybridflow",
    "trainer.use_legacy_worker_impl": "picks verl's worker classes (legacy fsdp/megatron workers or its engine "
                                      "workers); hybridflow has one worker implementation",
    "reward_model.model.use_remove_padding": "a padding-free layout is a speed-up: the reward model's scores are "
                                             "the same (padding is masked)",
    "reward_model.use_reward_loop": "the reward model runs in its own worker group here",
    "reward_model.num_workers": "the reward model's worker group has resources.n_workers ranks",
    "reward_model.rollout.name": "the reward model is a HF sequence classifier scored with transformers here",
    "reward_model.rollout.tensor_model_parallel_size": "the reward model is not sharded here",
    "reward_model.rollout.gpu_memory_utilization": "the reward model is not served by vLLM here",
    "reward_model.rollout.prompt_length": "reward_model.max_length bounds prompt + response",
    "reward_model.rollout.response_length": "reward_model.max_length bounds prompt + response",
    "trainer.val_only": "not supported as a mode: run `hybridflow train` with trainer.total_steps=0 instead",
    "trainer.default_hdfs_dir": "checkpoints are written under trainer.output_dir",
    "trainer.del_local_ckpt_after_load": "checkpoints are kept (trainer.max_checkpoints prunes old ones)",
    "trainer.ray_wait_register_center_timeout": "trainer.stage_timeout_s bounds every stage",
    "trainer.use_v1": "one trainer loop here",
    "actor_rollout_ref.hybrid_engine": "the colocated modes always run the hybrid engine; separate_async serves every "
                                       "rollout from the standalone pool (verl's hybrid replicas on the trainer's "
                                       "devices are not built)",
    "algorithm.filter_groups.max_inflight_gen_batches": "dynamic sampling generates one batch at a time here",
    **{f"{role}megatron.vanilla_mbridge": "picks verl's HF<->megatron converter (mbridge or Megatron-Bridge); "
                                          "hybridflow converts HF weights itself (megatron/convert.py)"
       for role in (_A, _REF, "critic.")},
    _R + "layered_summon": "verl's FSDP engine gathers the LoRA weights for vLLM one layer at a time (memory); the "
                           "resharding engine here never gathers the whole model: each rank sends its own shards",
    **{f"{m}use_shm": "verl copies the model folder into /dev/shm before loading it; the folder is read where it is"
       for m in (_MODEL, "critic.model.")},
    _REF + "use_torch_compile": "megatron-core's kernels are used as they are",
    **{f"{_REF}entropy_from_logits_{k}": "the reference computes log-probs only, no entropy"
       for k in ("with_chunking", "chunk_size")},
    **{f"{role}fsdp_config.forward_prefetch": _FSDP_ONLY for role in (_A, _REF, "critic.model.")},
    _R + "multi_stage_wake_up": "sglang's staged wake-up of weights and KV cache; vLLM is the rollout engine here "
                                "(its sleep levels: rollout.free_cache_engine)",
    **{_MODEL + f"lora.{k}": "vision-language models are not supported here"
       for k in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model")},
}
_PROFILE = ("verl's profiler hooks (nsys, npu, torch, torch_memory, precision_debugger) wrap its workers' stages; "
            "hybridflow has none: each stage's seconds are in every step's time/* metrics, and a profiler runs the "
            "whole command (nsys profile hybridflow train ..., py-spy record --subprocesses)")
_PROFILER_LEAVES = ("tool", "enable", "all_ranks", "ranks", "save_path", "relocate_results", "finish_hook_cmd",
                    "finish_hook_all_ranks", "finish_hook_ranks", "tool_config.")
# Whole sections accepted without effect: verl section -> (its leaves; a name ending in "." takes any leaf below
# it, as verl's tool configs do), why.
NO_EFFECT_SECTIONS = {
    **{f"{role}profiler.": (_PROFILER_LEAVES, _PROFILE) for role in (_A, _REF, _R, "critic.")},
    "global_profiler.": (("tool", "steps", "profile_continuous_steps", "save_path", "relocate_results",
                          "finish_hook_cmd", "finish_hook_all_ranks", "finish_hook_ranks", "global_tool_config."),
                         _PROFILE),
    _MODEL + "fused_kernel_options.": (("impl_backend",), "the fused kernels' backend (torch or triton); log-probs "
                                       "come from megatron's vocab-parallel cross entropy (use_fused_kernels)"),
    "critic.model.fused_kernel_options.": (("impl_backend",), "the critic computes values, not log-probs"),
    **{f"{role}fsdp_config.mixed_precision.": (("param_dtype", "reduce_dtype", "buffer_dtype"),
                                               "FSDP's mixed-precision dtypes; megatron-core computes in the role's "
                                               "megatron.dtype, keeps fp32 main params in the optimizer and reduces "
                                               "gradients in fp32") for role in (_A, _REF, "critic.model.")},
    _MODEL + "mtp.": (("enable_train", "enable_rollout", "detach_encoder", "mtp_loss_scaling_factor",
                       "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                       "speculative_num_draft_tokens", "method", "num_speculative_tokens"), MTP_WHY),
    _R + "engine_kwargs.trtllm.": (("batch_wait_timeout_iters", "batch_wait_max_tokens_ratio"),
                                   "TensorRT-LLM's batching; vLLM is the rollout engine here (verl's rollout.name)"),
    "reward_model.model.fsdp_config.": (("param_offload", "wrap_policy.", "reshard_after_forward", "fsdp_size",
                                         "forward_prefetch"),
                                        "the reward model is one unsharded HF classifier per worker here, resident "
                                        "while it scores: FSDP's sharding and offload do not apply"),
}


# distillation.teacher_models.<entry>.{key, model_path}: ours, spelled the same; verl's vLLM pool for the teachers
_TEACHER = re.compile(r"distillation\.teacher_models\.[^.]+\.(key|model_path)")
_TEACHER_POOL = re.compile(r"distillation\.(n_gpus_per_node|nnodes|teacher_models\.[^.]+\.(num_replicas|inference\..+)|"
                           r"distillation_loss\.(use_chunked_topk|chunked_topk_chunk_size))")
_TEACHER_POOL_WHY = ("verl serves each teacher from a vLLM pool of its own; a teacher runs in the actor's processes "
                     "at the actor's layout here (config/distillation.py); verl's chunked top-k saves the memory of "
                     "a whole-vocabulary log-softmax, which forward_kl_topk never builds here (megatron/vocab_topk.py)")


def _no_effect_section(key: str):
    """(section, why) when ``key`` is a leaf of a section accepted without effect, else None."""
    if _TEACHER_POOL.fullmatch(key):
        return "distillation.(teacher pool).", _TEACHER_POOL_WHY
    for section, (leaves, why) in NO_EFFECT_SECTIONS.items():
        rest = key[len(section):] if key.startswith(section) else None
        if rest and any(rest == leaf or (leaf.endswith(".") and rest.startswith(leaf)) for leaf in leaves):
            return section, why
    return None


# verl's own config files main_ppo reads (--config-name), from its config folder (--config-path, relative to
# verl/trainer/); their defaults are what this module maps. Another file would set values hybridflow never sees.
VERL_CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
VERL_CONFIG_PATHS = ("config", "./config", "config/", "./config/")


def _check_hydra(key: str, value: str) -> None:
    import os

    value = value.strip()
    if key == "--config-name" and value.removesuffix(".yaml") not in VERL_CONFIG_NAMES:
        raise ConfigError(f"verl --config-name={value}: hybridflow knows verl's own {' and '.join(VERL_CONFIG_NAMES)} "
                          "only; another config file's settings are not read: give them as overrides")
    if key == "--config-path" and value not in VERL_CONFIG_PATHS:
        if not os.path.isdir(os.path.expanduser(value)):
            raise ConfigError(f"verl --config-path={value}: no such folder")
        raise ConfigError(f"verl --config-path={value}: hybridflow reads only verl's own config folder "
                          "(--config-path=config); the files in another are not read: give their settings as overrides")


_GPU_KEYS = ("trainer.n_gpus_per_node", "trainer.nnodes", _R + "n_gpus_per_node", _R + "nnodes")
_LISTS = ("data.train_files", "data.val_files", "trainer.logger")

# Deliberate differences from verl 0.9.1 (ppo_megatron_trainer.yaml) for keys that carry a verl name:
# ours -> (verl key, reason). tests/unit/test_verl_overrides.py compares every mapped key's default with
# verl's and fails on one not listed here.
DIFFERENCES = {
    "model.lora.alpha": ("actor_rollout_ref.model.lora_alpha", "32, the megatron section's (lora.alpha); the FSDP "
                                                               "name's 16 applies when a command line sets lora_rank"),
    "model.lora.merge": ("actor_rollout_ref.model.lora.merge", "true: merged weights reach vLLM through the resharding "
                                                               "engine, for every model (MoE experts too) and with "
                                                               "generation at the base model's speed; false is built "
                                                               "(adapters into vLLM's LoRA) for dense models"),
    "data.val_batch_size": ("data.val_batch_size", "verl's null sends the whole validation set to one generate "
                                                   "call; 256 prompts per call bounds the driver's memory"),
    "actor.ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",
                                  "16, not 256: fits the default data.batch_size on a few ranks"),
    "actor.ppo_micro_batch_size_per_gpu": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                           "verl requires it (null default); 8 here"),
    "actor.log_prob_micro_batch_size_per_gpu": ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                                                "verl requires it (null default); 16 here"),
    "critic.ppo_micro_batch_size_per_gpu": ("critic.ppo_micro_batch_size_per_gpu",
                                            "verl requires it (null default); 8 here"),
    "rollout.tensor_model_parallel_size": ("actor_rollout_ref.rollout.tensor_model_parallel_size",
                                           "1, not 2: any machine runs it; set it for large models"),
    "rollout.gpu_memory_utilization": ("actor_rollout_ref.rollout.gpu_memory_utilization",
                                       "0.4, not 0.5: the colocated megatron roles keep their memory"),
    "rollout.max_num_batched_tokens": ("actor_rollout_ref.rollout.max_num_batched_tokens",
                                       "null: vLLM's own default for the chunked-prefill budget"),
    "trainer.experiment_name": ("trainer.experiment_name", "a name only"),
    "trainer.project_name": ("trainer.project_name", "a name only"),
    "trainer.logger": ("trainer.logger", "console + jsonl: wandb needs an account and network"),
    "trainer.output_dir": ("trainer.default_local_dir", "outputs/run; verl's is under checkpoints/"),
    "trainer.val_samples": ("trainer.log_val_generations", "4 examples logged per validation, not 0"),
    "trainer.seed": ("data.seed", "1: verl's null seeds its data loader with 1 too"),
    "critic.ppo_mini_batch_size": ("critic.ppo_mini_batch_size", "the actor's, as in verl (whose actor's is 256)"),
    "model.path": ("actor_rollout_ref.model.path", "the CPU quickstart's model, not a 7B download"),
    "data.train_files": ("data.train_files", "none: verl's points at ~/data/rlhf/gsm8k, which few have"),
    "data.val_files": ("data.val_files", "none: verl's points at ~/data/rlhf/gsm8k, which few have"),
    "custom_reward_function.name": ("custom_reward_function.name", "verl's null means compute_score too"),
    "reward_model.enable": ("reward_model.enable", "verl's null means false too"),
    **{f"reward.sandbox_fusion.{leaf}": (f"sandbox_fusion.{leaf}", "verl's legacy null means reward.sandbox_fusion's "
                                         "default, which is ours") for leaf in ("max_concurrent", "memory_limit_mb")},
}


def _ours(key: str):
    if key in RENAMED:
        return RENAMED[key]
    if _TEACHER.fullmatch(key):
        return key
    for section, leaves in _SAME_LEAVES.items():
        if key.startswith(section) and key[len(section):] in leaves:
            return _OURS_PREFIX.get(section, section) + key[len(section):]
    for verl_role, ours in ((_A, "actor."), ("critic.", "critic.")):
        for sub, names in (("optim.", _OPTIM), ("megatron.", _MEGATRON)):
            if key.startswith(verl_role + sub) and key[len(verl_role + sub):] in names:
                return ours + sub + key[len(verl_role + sub):]
    for section, ours in _DICTS.items():
        if key.startswith(section) and len(key) > len(section):
            return ours + key[len(section):]
    return None
