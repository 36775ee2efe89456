"""A verl 0.9.1 command line's overrides (``actor_rollout_ref.*``, ``data.*``, ``algorithm.*``, ``critic.*``,
``trainer.*``, ...) mapped onto this suite's keys, for users who bring their verl scripts along:

    hybridflow train --config configs/ppo_megatron.yaml --verl-overrides data.train_batch_size=256 ...

Every verl key either maps to ours, is checked to agree with what it maps to (a second name for one of
our values), or is named in a one-line error; keys that change nothing here are listed with the reason.
Batch-size keys mean what they mean in verl (``ppo_mini_batch_size`` counts prompts, ``*_per_gpu`` sizes are
per rank), as ours do.
"""

from __future__ import annotations

from hybridflow.config.loader import ConfigError, Override

_ACTOR = "actor_rollout_ref.actor."
_ROLLOUT = "actor_rollout_ref.rollout."
_SAME_NAMES = {  # verl section prefix -> ours, for keys spelled the same below it
    _ACTOR + "megatron.": "actor.megatron.",
    "critic.megatron.": "critic.megatron.",
    "algorithm.kl_ctrl.": "algorithm.kl_ctrl.",
}
_SAME_LEAVES = {
    _ACTOR: ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "clip_ratio_low", "clip_ratio_high",
             "clip_ratio_c", "loss_agg_mode", "loss_scale_factor", "use_kl_loss", "kl_loss_coef", "kl_loss_type"),
    _ACTOR + "optim.": ("lr", "weight_decay", "betas"),
    "critic.": ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "cliprange_value",
                "loss_agg_mode", "loss_scale_factor"),
    "critic.optim.": ("lr", "weight_decay", "betas"),
    _ROLLOUT: ("n", "temperature", "top_p", "top_k", "tensor_model_parallel_size", "gpu_memory_utilization", "dtype",
               "enforce_eager", "free_cache_engine", "max_num_batched_tokens"),
    "algorithm.": ("adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty"),
    "data.": ("train_files", "val_files", "prompt_key", "max_prompt_length", "max_response_length", "shuffle",
              "val_batch_size"),
    "trainer.": ("experiment_name", "total_epochs", "logger", "project_name", "val_before_train"),
    "custom_reward_function.": ("path", "name"),
    "reward_model.": ("enable",),
}
RENAMED = {
    "data.train_batch_size": "data.batch_size",
    "data.seed": "trainer.seed",
    "actor_rollout_ref.model.path": "model.path",
    _ACTOR + "grad_clip": "actor.optim.clip_grad",
    _ACTOR + "clip_ratio": ("actor.clip_ratio_low", "actor.clip_ratio_high"),
    _ROLLOUT + "log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor.ref_log_prob_micro_batch_size_per_gpu",
    "critic.grad_clip": "critic.optim.clip_grad",
    "critic.forward_micro_batch_size_per_gpu": "critic.log_prob_micro_batch_size_per_gpu",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.test_freq": "trainer.val_every",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.save_freq": "trainer.save_every",  # verl's -1 (never) is any value <= 0 here
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints",
    "trainer.resume_from_path": "trainer.resume",
    "trainer.log_val_generations": "trainer.val_samples",
    "reward_model.model.path": "reward_model.path",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size",
}
# Second names for one of our values: accepted when they agree with it (checked after loading).
MUST_AGREE = {
    "critic.model.path": "model.path",  # the critic starts from the policy's weights here
    _ROLLOUT + "name": "rollout.name",
    **{f"actor_rollout_ref.ref.megatron.{k}": f"actor.megatron.{k}"  # the reference shares the actor's layout
       for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel")},
    "trainer.critic_warmup": 0,  # no critic warm-up steps here
}
NO_EFFECT = {  # verl key -> why it changes nothing here
    "data.filter_overlong_prompts": "a prompt longer than max_prompt_length is an error naming its row "
                                    "(the GSM8K preprocessor filters them)",
    "data.truncation": "over-long prompts are an error, as verl's 'error'",
    "actor_rollout_ref.model.use_remove_padding": "rows are always laid out padding-free",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "not used by the megatron engine here",
    "critic.model.enable_gradient_checkpointing": "not used by the megatron engine here",
    "critic.model.use_remove_padding": "rows are always laid out padding-free",
}
_GPU_KEYS = ("trainer.n_gpus_per_node", "trainer.nnodes")
_LISTS = ("data.train_files", "data.val_files", "trainer.logger")


def _ours(key: str):
    if key in RENAMED:
        return RENAMED[key]
    for prefix, leaves in _SAME_LEAVES.items():
        if key.startswith(prefix) and key[len(prefix):] in leaves:
            ours = key[len(prefix):]
            return {_ACTOR: "actor.", _ACTOR + "optim.": "actor.optim.", _ROLLOUT: "rollout."}.get(prefix, prefix) + ours
    for prefix, ours in _SAME_NAMES.items():
        if key.startswith(prefix):
            return ours + key[len(prefix):]
    return None


def _gpu_count(arg: str, value: str) -> int:
    import yaml

    try:
        n = yaml.safe_load(value)
    except yaml.YAMLError:
        n = value
    if type(n) is not int or n < 1:
        raise ConfigError(f"verl override {arg!r}: expects a whole number >= 1, got {value!r}")
    return n


def translate(verl_overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """Our ``key=value`` overrides for a verl command line's (each naming its verl override in errors: a
    ``1.5`` for an integer key names the verl key), and the (our key or constant -> verl value) pairs that
    must agree once the config is loaded (``check_agreement``)."""
    ours, agree, unsupported, gpus = [], {}, [], {}
    for arg in verl_overrides:
        if "=" not in arg:
            raise ConfigError(f"bad verl override {arg!r}: expected key=value")
        key, value = arg.split("=", 1)
        key = key.lstrip("+")  # hydra's "add a key" prefix
        target = _ours(key)
        if key in _GPU_KEYS:
            gpus[key] = _gpu_count(arg, value)
        elif key in MUST_AGREE:
            agree[arg] = MUST_AGREE[key]
        elif key in NO_EFFECT:
            continue
        elif target is None:
            unsupported.append(key)
        else:
            if target in _LISTS and not value.lstrip().startswith("["):
                value = f"[{value}]"  # verl takes one file (or logger) as a plain string
            ours.extend(Override(f"{t}={value}", f"verl override '{arg}'")
                        for t in ((target,) if isinstance(target, str) else target))
    if unsupported:
        raise ConfigError(f"verl keys not supported by hybridflow: {', '.join(unsupported)} "
                          "(see hybridflow/config/verl.py for the supported ones)")
    if gpus:  # one process per GPU, as verl places them
        n = gpus.get("trainer.n_gpus_per_node", 1) * gpus.get("trainer.nnodes", 1)
        ours += [f"resources.n_workers={n}", f"resources.critic_n_workers={n}", "resources.gpus_per_worker=1"]
    return ours, agree


def check_agreement(cfg, agree: dict[str, str]) -> None:
    """Each verl second name must equal the value it names here (one-line error otherwise)."""
    import yaml

    for arg, target in agree.items():
        key, raw = arg.split("=", 1)
        value = yaml.safe_load(raw)
        if isinstance(target, str):
            ours = cfg
            for part in target.split("."):
                ours = getattr(ours, part)
        else:
            ours, target = target, "supported here"
        if value != ours:
            raise ConfigError(f"verl override {arg!r} must equal {target} ({ours!r}) in hybridflow")
