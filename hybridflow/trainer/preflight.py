"""Everything a run reads, writes or asks for, checked before Ray or any worker starts: one-line
``ConfigError``s that name the key, file or row."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hybridflow import device, families
from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.parsers import get_parser
from hybridflow.agent.tools import check_tool_config, tool_schemas
from hybridflow.config import ConfigError
from hybridflow.config.schema import ExperimentConfig
from hybridflow.device import DTYPES
from hybridflow.megatron import lr_schedule
from hybridflow.megatron.checkpoint_files import resolve_dist_checkpoint
from hybridflow.megatron.optimizer_config import check_optimizer_overrides
from hybridflow.megatron.model import (check_grouped_gemm_dtype, check_rope_supported, check_transformer_config,
                                       check_transformer_overrides)
from hybridflow.plan import RunPlan, model_shape, resolve
from hybridflow.resharding.vllm_layout import check_supported
from hybridflow.rewards.routing import SourceRouter
from hybridflow.rollout.vllm_rollout import check_engine_kwargs
from hybridflow.trainer import checkpoint
from hybridflow.trainer.lora_checks import check_adapter, check_lora_targets, header_shapes
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
    plan = check_model(cfg, model, len(train_data))
    check_lr_schedules(cfg, plan)
    warn_no_bound(cfg, plan)
    check_resources(cfg, plan)
    check_ray(cfg)
    checked = Checked(model, tokenizer, train_data, val_data, plan, resume_checkpoint(cfg, model, plan))
    check_trackers(cfg)
    return checked


def check_model(cfg: ExperimentConfig, model, n_train: int | None = None) -> RunPlan:
    """The rules that need the model's HF config: the run plan's layouts against its heads, layers and experts, then
    ``MODEL_RULES``. Run before the warm start where the model exists (trainer/session.py: on the quickstart's base
    model), so a rule of the model and the config does not wait for minutes of preparation. A rule that needs only the
    config belongs in ``check_config``, which the dry run runs (tests/unit/test_dry_run_rules.py walks these)."""
    plan = run_plan(cfg, model, n_train)
    for rule in MODEL_RULES:
        rule(cfg, model, plan)
    return plan


def run_plan(cfg: ExperimentConfig, model=None, n_train: int | None = None) -> RunPlan:
    """The run plan (``ConfigError`` naming the keys of a rule broken); with the model's HF config, its
    layouts are checked against the model's heads, layers and experts."""
    try:
        plan = resolve(cfg, model, n_train, on_gpu=device.has_gpu())
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
        check_engine_kwargs(cfg.rollout.engine_kwargs)
        check_multi_turn(cfg.rollout.multi_turn)
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

    get_parser(m.format)
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


def check_model_folder(cfg: ExperimentConfig):
    """model.path holds a readable config whose RoPE megatron reproduces, safetensors weights and a
    tokenizer, and the model's context fits the longest prompt plus response; returns (HF config, tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer

    path = cfg.model.path
    if not os.path.isdir(path):
        raise ConfigError(f"model.path: not a model folder: {path}")
    try:
        model = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {path}/config.json ({str(e).splitlines()[0][:120]})") from None
    try:
        check_rope_supported(model)
    except ValueError as e:
        raise ConfigError(f"model.path: {e} in {path}/config.json") from None
    if not list(Path(path).glob("*.safetensors")):
        raise ConfigError(f"model.path: no *.safetensors weights in {path}")
    check_weight_shapes(path, model)
    # Without its files AutoTokenizer quietly builds an empty tokenizer from config.json alone.
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ConfigError(f"model.path: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) in {path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"model.path: no usable tokenizer in {path} ({str(e).splitlines()[0][:120]})") from None
    if len(tokenizer) < 2 or tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {path} is empty or lacks pad/eos tokens (tokenizer files missing?)")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError(f"data.max_prompt_length + data.max_response_length ({longest}) exceeds the model's "
                          f"max_position_embeddings ({model.max_position_embeddings}) in {path}")
    return model, tokenizer


def check_weight_shapes(path: str, model) -> None:
    """The safetensors headers parse and cover their files, and hold the embedding and attention shapes
    config.json implies: a vocab, hidden size or head count that disagrees with the weights (or a truncated
    or garbage file) fails here in one line, not in a worker loading them. Reads the headers only
    (``safe_open`` memory-maps; no tensor is loaded)."""
    try:
        shapes, file_of = header_shapes(path)
    except ConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    hidden, heads, kv_heads = model.hidden_size, model.num_attention_heads, model.num_key_value_heads
    head_dim = getattr(model, "head_dim", None) or hidden // heads  # as hybridflow.megatron.convert derives it
    head = f"head_dim {head_dim}" + ("" if getattr(model, "head_dim", None) else f" (hidden_size / {heads} heads)")
    vocab = f"[vocab_size {model.vocab_size}, hidden_size {hidden}]"
    expected = {"model.embed_tokens.weight": ([model.vocab_size, hidden], vocab)}
    if not getattr(model, "tie_word_embeddings", False):
        expected["lm_head.weight"] = ([model.vocab_size, hidden], vocab)
    for i in range(model.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn."
        expected[attn + "q_proj.weight"] = ([heads * head_dim, hidden],
                                            f"[num_attention_heads {heads} x {head}, hidden_size {hidden}]")
        expected[attn + "k_proj.weight"] = ([kv_heads * head_dim, hidden],
                                            f"[num_key_value_heads {kv_heads} x {head}, hidden_size {hidden}]")
    for name, (shape, meaning) in expected.items():
        if name not in shapes:
            raise ConfigError(f"model.path: the safetensors in {path} lack {name}, which its config.json "
                              f"({model.num_hidden_layers} layers) needs")
        if shapes[name] != shape:
            raise ConfigError(f"model.path: {name} in {path}/{file_of[name]} has shape {shapes[name]}, but "
                              f"config.json says {meaning}")
    check_declared_weights(path, model, file_of)


# Tensors a checkpoint may hold that no conversion reads: old rotary caches, a tied model's saved output layer.
_UNREAD = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^lm_head\.weight$")


def check_declared_weights(path: str, model, file_of: dict) -> None:
    """The checkpoint holds exactly the tensors its family declares (hybridflow/families): one that no
    conversion reads (a variant such as Llama's attention_bias, whose o_proj bias megatron's layers here do
    not have) would be dropped silently, one missing would fail in every worker."""
    family = families.FAMILIES.get(getattr(model, "model_type", None))
    if family is None:  # refused by name with the supported list (megatron.model.check_architecture)
        return
    declared = family.hf_names(model)
    unread = sorted(n for n in file_of if n not in declared and not _UNREAD.search(n))
    if unread:
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise ConfigError(f"model.path: {path}/{file_of[unread[0]]} holds {unread[0]}{more}, which hybridflow's "
                          f"{family.architecture} does not have: a variant of it (e.g. attention_bias, mlp_bias) "
                          "that conversion would drop")
    missing = sorted(declared - set(file_of))
    if missing:
        raise ConfigError(f"model.path: the safetensors in {path} lack {missing[0]}, which its config.json "
                          f"({model.num_hidden_layers} layers) needs")


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


def resume_checkpoint(cfg: ExperimentConfig, model, plan: RunPlan) -> Path | None:
    """The checkpoint this run continues from (``trainer.resume_mode``, verl's: auto | disable | resume_path
    with ``resume_from_path``), or None for a fresh run; a fresh run never overwrites another run's metrics
    in the same output_dir (verl would append to them: a deliberate difference)."""
    t = cfg.trainer
    metrics = Path(t.output_dir) / "metrics.jsonl"
    ran_before = metrics.is_file() and metrics.stat().st_size > 0
    if t.resume_mode == "disable":
        if ran_before or checkpoint.complete_checkpoints(t.output_dir):
            raise ConfigError(f"trainer.output_dir: {t.output_dir} already holds a run; continue it with "
                              "trainer.resume_mode=auto, choose another output_dir, or delete its metrics.jsonl and "
                              "checkpoints/ to start over there")
        return None
    if t.resume_mode == "auto":
        path = checkpoint.newest_whole(t.output_dir)  # a damaged newest one is passed over with a warning
        if path is None and ran_before:
            raise ConfigError(f"trainer.output_dir: {t.output_dir} holds a run with no complete checkpoint to "
                              "resume; choose another output_dir, or delete its metrics.jsonl to start over there")
    else:
        path = Path(t.resume_from_path)
        if not checkpoint.is_complete(path):
            raise ConfigError(f"trainer.resume_from_path: {t.resume_from_path} is not a complete checkpoint "
                              f"(no {checkpoint.STATE_FILE}; expected .../checkpoints/step_<k>)")
        if (damage := checkpoint.find_damage(path)) is not None:
            raise ConfigError(f"trainer.resume_from_path: checkpoint {t.resume_from_path} is damaged: {damage}")
    if path is not None:
        check_checkpoint_fits(cfg, model, plan, path)
        for role in ("actor", "critic"):  # megatron-core 0.16's HybridDeviceOptimizer cannot load its state back
            if getattr(cfg, role).optim.override_optimizer_config.get("optimizer_cpu_offload"):
                raise ConfigError(f"{role}.optim.override_optimizer_config.optimizer_cpu_offload: resuming from {path} "
                                  "is not supported with it (megatron-core 0.16's HybridDeviceOptimizer cannot load "
                                  "its Adam state); resume without it")
    return path


def check_checkpoint_fits(cfg: ExperimentConfig, model, plan: RunPlan, path: Path) -> None:
    """The checkpoint holds this model's architecture and every role the config trains."""
    from transformers import AutoConfig

    saved = AutoConfig.from_pretrained(str(path / "hf"))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size"):
        if getattr(saved, key) != getattr(model, key):
            raise ConfigError(f"trainer.resume_from_path: {path} holds a model with {key}={getattr(saved, key)}, "
                              f"model.path ({cfg.model.path}) has {getattr(model, key)}")
    if plan.critic is not None and not (path / "critic").is_dir():
        raise ConfigError(f"resume: {path} has no critic, but this config trains one")
    import yaml

    saved_cfg = yaml.safe_load((path / checkpoint.CONFIG_FILE).read_text()) or {}  # the run config it was saved by
    check_same_adapters(cfg, saved_cfg, path)
    if families.is_moe(model):
        check_same_expert_layout(plan, saved_cfg, path)


def check_same_expert_layout(plan: RunPlan, saved: dict, path: Path) -> None:
    """A MoE checkpoint's optimizer state resumes only at the expert-parallel size it was saved at: megatron-core
    0.16.1 chains a second optimizer for the experts' parameters where EP > 1 (their ``allreduce`` is False;
    optimizer/__init__.py ``get_megatron_optimizer``), and its load cannot map one chain onto the other (measured
    here EP 2 -> 1: ``KeyError 'pre_wd_mult'``; EP 1 -> 2: ``Expected 2 entries in state dict``). Between two EP
    sizes > 1 it is not verified either, so any change is refused. ``saved``: the checkpoint's run config."""
    for layout in (plan.actor, plan.critic):
        if layout is None:
            continue
        was = int(((saved.get(layout.role) or {}).get("megatron") or {}).get("expert_model_parallel_size") or 1)
        if was != layout.ep:
            raise ConfigError(f"resume: {path} was saved at {layout.role}.megatron.expert_model_parallel_size {was}, "
                              f"this run has {layout.ep}: the experts' optimizer state resumes only at the EP size it "
                              f"was saved at; resume with {layout.role}.megatron.expert_model_parallel_size={was}, or "
                              "start a new output_dir from an export of it (model.path)")


def check_same_adapters(cfg: ExperimentConfig, saved_cfg: dict, path: Path) -> None:
    """A checkpoint resumes only into the parameters it holds: LoRA adapters of its rank, or the full model (the
    load otherwise fails deep in megatron's dist_checkpointing, as if the checkpoint were damaged)."""
    saved = saved_cfg.get("model", {}).get("lora", {}) or {}
    was, now = int(saved.get("rank", 0) or 0), cfg.model.lora.rank
    if was == now:
        return
    kind = {True: "LoRA adapters of rank {}", False: "the full model"}
    raise ConfigError(f"resume: {path} trained {kind[bool(was)].format(was)} (model.lora.rank {was}), this run "
                      f"trains {kind[bool(now)].format(now)} (model.lora.rank {now}): resume with model.lora.rank={was}, "
                      "or start a new output_dir")


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


_RAY_CONNECT_TIMEOUT_S = 5


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


def check_ray(cfg: ExperimentConfig) -> None:
    """A joined cluster answers at ray.address; an embedded cluster's temp_dir can hold Ray's sockets."""
    if cfg.ray.address is not None:
        check_ray_address(cfg.ray.address)
    elif cfg.ray.temp_dir is not None:
        check_ray_temp_dir(cfg.ray.temp_dir)


def check_ray_address(address: str) -> None:
    """A TCP connection to the cluster's GCS (or Ray client server) within a few seconds; ray.init would
    otherwise retry for a minute and end in a traceback."""
    import socket

    if address == "local":  # ray.init starts a cluster of its own
        return
    if address == "auto":
        # ray.init's own lookup: RAY_ADDRESS, the cluster `ray start` recorded, a local GCS process
        # (ray/_private/services.py canonicalize_bootstrap_address_or_die)
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            address = canonicalize_bootstrap_address_or_die("auto")
        except ConnectionError:
            raise ConfigError("ray.address: 'auto' finds no running Ray cluster on this node (no RAY_ADDRESS, no "
                              "`ray start`); start one or give its host:port") from None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address: expected host:port, ray://host:port or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise ConfigError(f"ray.address: no Ray cluster answers at {host}:{port} within "
                          f"{_RAY_CONNECT_TIMEOUT_S} s ({reason})") from None
    check_speaks_ray(address, f"{host}:{port}")


def check_speaks_ray(address: str, host_port: str) -> None:
    """What answers TCP at ``host_port`` is Ray: one gRPC call a Ray GCS serves (``ray://``: any gRPC
    answer, the client server's methods differ) within a few seconds. A proxy, a web server or another
    program would make ray.init retry for ~25 s and end in a ConnectionError traceback. Any gRPC status but
    "unavailable", "timed out" and (for a GCS) "unimplemented" is Ray's: e.g. UNAUTHENTICATED, whose cause
    ray.init names itself."""
    import grpc

    client = address.startswith("ray://")
    method = "/ray.rpc.NodeInfoGcsService/GetClusterId"  # what ray.init asks a GCS first (empty request)
    with grpc.insecure_channel(host_port) as channel:
        call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
        try:
            call(b"", timeout=_RAY_CONNECT_TIMEOUT_S)
            return
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
    bad = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
           *(() if client else (grpc.StatusCode.UNIMPLEMENTED,)))
    if code in bad:
        what = "a Ray client server" if client else "a Ray cluster (its GCS)"
        details = " ".join(details.split())
        details = details if len(details) <= 160 else details[:157] + "..."
        raise ConfigError(f"ray.address: {host_port} answers, but not as {what}: {code.name} ({details}); check "
                          "the address and port")


def check_ray_temp_dir(temp_dir: str) -> None:
    path = Path(os.path.abspath(temp_dir))
    if path.exists() and not path.is_dir():
        raise ConfigError(f"ray.temp_dir: {temp_dir} is a file; Ray needs a folder there")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"ray.temp_dir: cannot create or write {temp_dir} ({existing} is not a writable folder)")
    from hybridflow.controller.cluster import AF_UNIX_PATH_MAX, MAX_TEMP_DIR_BYTES, RAY_SOCKET_TAIL  # lazy: Ray

    longest = len(str(path).encode()) + len(RAY_SOCKET_TAIL)
    if longest > AF_UNIX_PATH_MAX:
        raise ConfigError(f"ray.temp_dir: {temp_dir} is too long: Ray's socket paths in it reach {longest} bytes "
                          f"(<temp_dir>{RAY_SOCKET_TAIL}), over the {AF_UNIX_PATH_MAX}-byte limit of Unix sockets; "
                          f"keep the absolute path within {MAX_TEMP_DIR_BYTES} bytes")


def check_trackers(cfg: ExperimentConfig) -> None:
    """wandb without credentials logs offline (one warning) instead of failing when the tracker starts."""
    if "wandb" in cfg.trainer.logger and wandb_falls_back_offline():
        log.warning("trainer.logger: wandb finds no credentials (WANDB_API_KEY, or an entry in ~/.netrc) and "
                    "WANDB_MODE is not offline: logging offline to %s/wandb (upload later with `wandb sync`)",
                    cfg.trainer.output_dir)


# The rules that need the model (``check_model`` runs them in this order), each ``(cfg, model, plan)``: the walk in
# tests/unit/test_dry_run_rules.py fails for one that refuses a config without reading the model.
MODEL_RULES = (check_roles, check_lora, check_step_fits)
