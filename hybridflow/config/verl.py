"""A verl 0.9.1 command line (``python3 -m verl.trainer.main_ppo <overrides>``) mapped onto this suite's keys,
for users who bring their verl scripts along: replace ``python3 -m verl.trainer.main_ppo`` with

    hybridflow train --config configs/ppo_megatron.yaml --verl-overrides <the same arguments>

Every verl key either maps to ours with verl's meaning and default (``DIFFERENCES`` lists each deliberate
exception with its reason; tests/unit/test_verl_overrides.py fails on an unlisted one), is checked to agree
with what it names here (a second name for one of our values), changes nothing here (``NO_EFFECT``, and whole
sections such as the profilers' in ``NO_EFFECT_SECTIONS``, with the reason), or is reported: all unsupported keys in one line, before anything starts. Batch sizes mean what they
mean in verl (``ppo_mini_batch_size`` counts prompts, ``*_per_gpu`` sizes are per rank).

FSDP runs (``strategy=fsdp``/``fsdp2``, verl's default ``ppo_trainer.yaml``) become megatron data
parallelism (TP = PP = 1) with the distributed optimizer, which shards optimizer state across ranks as
FSDP does; ``fsdp_config.param_offload``/``optimizer_offload`` map onto the megatron offloads.
"""

from __future__ import annotations

import dataclasses

from hybridflow.config.loader import ConfigError, Override
from hybridflow.config.verl_keys import (AGREE_WHY, MUST_AGREE, NO_EFFECT, OTHER_ROLLOUT_ENGINES,
                                         REWARD_MANAGER_KEYS, REWARD_MANAGERS, _CHECKPOINTING,
                                         _GPU_KEYS, _LISTS, _MODEL, _OVERLONG_SECTIONS, _R, _RECOMPUTE, _check_hydra,
                                         _no_effect_section, _ours)


@dataclasses.dataclass
class Translation:
    overrides: list  # ours, as Override records naming the verl argument
    agree: dict  # verl argument -> our key (or constant) it must equal once loaded
    no_effect: dict  # verl key -> why it changes nothing here (printed by the dry run)
    notices: list  # one line each, printed when the run starts (and by the dry run): what runs otherwise here


# peft's module names (verl's FSDP target_modules) -> the megatron linear holding each
_HF_LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
               "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}


def _lora_targets(arg: str, value: str) -> str:
    """verl's FSDP ``target_modules`` (``all-linear`` or peft's names) as megatron's linears, in a YAML list.
    A fused linear's adapter covers all its projections (q_proj alone adapts linear_qkv)."""
    import yaml

    try:
        names = yaml.safe_load(value)
    except yaml.YAMLError:
        names = value
    if names == "all-linear":
        names = list(_HF_LINEARS)
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or any(n not in _HF_LINEARS for n in names):
        raise ConfigError(f"verl override {arg!r}: expects all-linear or a list of {', '.join(_HF_LINEARS)}")
    return "[" + ",".join(dict.fromkeys(_HF_LINEARS[n] for n in names)) + "]"


_FSDP_LORA = (_MODEL + "lora_rank", _MODEL + "target_modules", _MODEL + "exclude_modules")


def _fsdp_lora(key: str, arg: str, value: str, implied: list, ours: list, unsupported: list) -> None:
    """verl's FSDP LoRA keys (peft's): lora_rank (whose lora_alpha defaults to 16, the megatron section's to 32),
    target_modules in peft's names, exclude_modules (a peft regex: only null is taken)."""
    why = f"verl override '{arg}'"
    if key.endswith("lora_rank"):
        implied.append(Override("model.lora.alpha=16", f"{why} (verl's FSDP default lora_alpha)"))
        ours.append(Override(f"model.lora.rank={value}", why))
    elif key.endswith("target_modules"):
        ours.append(Override(f"model.lora.target_modules={_lora_targets(arg, value)}", why))
    elif value.strip() not in ("null", "None", ""):
        unsupported.append(f"{key} (peft's exclude regex; model.lora.exclude_modules takes megatron's names)")


def _gpu_count(arg: str, value: str, minimum: int = 1) -> int:
    import yaml

    try:
        n = yaml.safe_load(value)
    except yaml.YAMLError:
        n = value
    if type(n) is not int or n < minimum:
        raise ConfigError(f"verl override {arg!r}: expects a whole number >= {minimum}, got {value!r}")
    return n


def _is_true(value: str) -> bool:
    import yaml

    try:
        return yaml.safe_load(value) is True
    except yaml.YAMLError:
        return False


def translate(verl_args: list[str]) -> Translation:
    """Our overrides for a verl command line's arguments (each naming its verl argument in errors: a ``1.5``
    for an integer key names the verl key), the second names to check once loaded (``check_agreement``),
    and the accepted keys that change nothing. All unsupported keys are named in one ``ConfigError``."""
    ours, implied, agree, no_effect, unsupported, gpus, notices = [], [], {}, {}, [], {}, []
    set_by: dict[str, tuple[str, str]] = {}  # our key -> (the verl key, its value) that set it
    manager, overlong_on = "naive", None  # verl's default manager; the argument enabling overlong shaping
    megatron = any(a.startswith("--config-name=") and "megatron" in a for a in verl_args)
    for arg in verl_args:
        if "=" not in arg:
            raise ConfigError(f"bad verl override {arg!r}: expected key=value")
        key, value = arg.split("=", 1)
        key = key.lstrip("+")  # hydra's "add a key" prefixes (+ and ++)
        if key in _GPU_KEYS:
            gpus[key] = _gpu_count(arg, value, minimum=0 if key == _R + "nnodes" else 1)
        elif key in REWARD_MANAGER_KEYS:
            manager = _reward_manager(arg, ours, unsupported)
        elif key in ("--config-name", "--config-path"):
            _check_hydra(key, value)
            no_effect[key] = NO_EFFECT[key]
        elif key == _R + "name" and value in OTHER_ROLLOUT_ENGINES:
            notices.append(f"verl override {arg!r}: hybridflow samples with vLLM, with the same sampling settings "
                           f"({OTHER_ROLLOUT_ENGINES[value]})")
        elif key in MUST_AGREE:
            agree[arg] = MUST_AGREE[key]
        elif key in NO_EFFECT:
            no_effect[key] = NO_EFFECT[key]
        elif (section := _no_effect_section(key)) is not None:
            no_effect[section[0] + "*"] = section[1]
        elif key in _CHECKPOINTING and megatron:
            no_effect[key] = "verl's megatron engine ignores it (override_transformer_config.recompute_* decide)"
        elif key in _CHECKPOINTING:
            if _is_true(value):  # first, so explicit override_transformer_config entries win
                implied.extend(Override(f"{_CHECKPOINTING[key]}{k}={v}", f"verl override '{arg}'")
                            for k, v in _RECOMPUTE.items())
        elif key in _FSDP_LORA:
            _fsdp_lora(key, arg, value, implied, ours, unsupported)
        elif (target := _ours(key)) is None:
            unsupported.append(key)
        else:
            ours.extend(_overrides_of(target, arg, set_by))
        if key in (f"{section}.enable" for section in _OVERLONG_SECTIONS) and _is_true(value):
            overlong_on = arg
    if unsupported:
        raise ConfigError(f"verl keys not supported by hybridflow: {', '.join(unsupported)} "
                          "(the supported ones: hybridflow/config/verl_keys.py)")
    if overlong_on is not None and manager != "dapo":
        raise ConfigError(f"verl override {overlong_on!r}: verl applies overlong shaping only in the dapo reward "
                          "manager; add reward_model.reward_manager=dapo (its naive manager ignores overlong_buffer_cfg)")
    return Translation(implied + ours + _worker_counts(gpus), agree, no_effect, notices)


def _reward_manager(arg: str, ours: list, unsupported: list) -> str:
    """verl's reward manager named by ``arg`` (its reward_manager key) as ours, or reported unsupported."""
    key, value = arg.split("=", 1)
    manager = value.strip()
    if manager not in REWARD_MANAGERS:
        unsupported.append(f"{key.lstrip('+')}={value} (reward managers here: {', '.join(REWARD_MANAGERS)})")
    else:
        ours.append(Override(f"reward.manager={REWARD_MANAGERS[manager]}", f"verl override '{arg}'"))
    return manager


def _worker_counts(gpus: dict) -> list[str]:
    """Our worker counts from verl's GPU counts: one process per GPU, as verl places them."""
    per_node, out = gpus.get("trainer.n_gpus_per_node", 8), []
    if any(k.startswith("trainer.") for k in gpus):
        n = per_node * gpus.get("trainer.nnodes", 1)
        out += [f"resources.n_workers={n}", f"resources.critic_n_workers={n}", "resources.gpus_per_worker=1"]
    if _R + "nnodes" in gpus:  # the standalone rollout pool (verl: rollout.n_gpus_per_node defaults to the trainer's)
        out.append(f"resources.rollout_n_workers={gpus[_R + 'nnodes'] * gpus.get(_R + 'n_gpus_per_node', per_node)}")
    return out


def _overrides_of(target, arg: str, set_by: dict) -> list[Override]:
    """Our overrides for verl's ``arg`` (key=value) naming our ``target`` (one key or several), each value set once
    (``_check_one_value``)."""
    key, value = arg.split("=", 1)
    key = key.lstrip("+")
    if target in _LISTS and not value.lstrip().startswith("["):
        value = f"[{value}]"  # verl takes one file (or logger) as a plain string
    out = []
    for t in ((target,) if isinstance(target, str) else target):
        _check_one_value(set_by, t, key, value)
        out.append(Override(f"{t}={value}", f"verl override '{arg}'"))
    return out


def _check_one_value(set_by: dict, target: str, key: str, value: str) -> None:
    """Two verl keys naming one of our values (ulysses_sequence_parallel_size and megatron.context_parallel_size) must
    give it the same value: otherwise the later one would silently win."""
    import yaml

    if target in set_by and set_by[target][0] != key:
        other, before = set_by[target]
        try:
            same = yaml.safe_load(before) == yaml.safe_load(value)
        except yaml.YAMLError:
            same = before == value
        if not same:
            raise ConfigError(f"verl overrides {other}={before} and {key}={value} both set {target}: they must agree")
    set_by[target] = (key, value)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our arguments, the verl arguments after ``--verl-overrides``): everything after it is verl's, hydra's
    ``--config-path=...``/``--config-name=...`` included, so a verl script's arguments pass unchanged."""
    if "--verl-overrides" not in argv:
        return list(argv), []
    i = argv.index("--verl-overrides")
    verl_args = []
    for a in argv[i + 1:]:
        if verl_args and verl_args[-1] in ("--config-path=", "--config-name="):  # hydra's "--config-name X"
            verl_args[-1] += a
        else:
            verl_args.append(a + "=" if a in ("--config-path", "--config-name") else a)
    return list(argv[:i]), verl_args


def check_agreement(cfg, agree: dict) -> None:
    """Each verl second name must equal the value it names here (one-line error otherwise)."""
    import yaml

    for arg, target in agree.items():
        key, raw = arg.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        if isinstance(target, str) and "." in target:
            ours = cfg
            for part in target.split("."):
                ours = getattr(ours, part)
        else:
            ours, target = target, "supported here"
        if value != ours:
            why = f": {AGREE_WHY[key]}" if key in AGREE_WHY else ""
            raise ConfigError(f"verl override {arg!r} must equal {target} ({ours!r}) in hybridflow{why}")
