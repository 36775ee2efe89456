"""Before any worker starts: each distillation teacher (config/distillation.py) is a model folder the actor's layout
splits, with the student's vocabulary (it scores the student's token ids), a context that holds a whole row, and
with several teachers every prompt's routing column names one of them."""

from __future__ import annotations

import os
from pathlib import Path

from hybridflow import device
from hybridflow.config.distillation import routing_keys
from hybridflow.config.loader import ConfigError


def check_teachers(cfg, tokenizer, plan, datasets) -> None:
    """``datasets``: the training and validation prompts (PromptDataset; None skipped)."""
    d = cfg.distillation
    if not d.enabled:
        return
    for name, teacher in d.teacher_models.items():
        _check_teacher(cfg, f"distillation.teacher_models.{name}.model_path", teacher.model_path, tokenizer, plan)
    if len(d.teacher_models) > 1:
        keys = {t.key for t in d.teacher_models.values()}
        for data in (x for x in datasets if x is not None):
            _check_routing(data, d.teacher_key, keys)


def _check_teacher(cfg, key: str, path: str, tokenizer, plan) -> None:
    from transformers import AutoConfig, AutoTokenizer

    if not os.path.isdir(path):
        raise ConfigError(f"{key}: not a model folder: {path}")
    try:
        model = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        own = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"{key}: cannot read the config and tokenizer in {path} ({' '.join(str(e).split())[:200]})") from None
    if not list(Path(path).glob("*.safetensors")):
        raise ConfigError(f"{key}: no *.safetensors weights in {path}")
    if own.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{key}: the tokenizer in {path} differs from model.path's ({cfg.model.path}): a teacher "
                          "scores the student's token ids, so it needs the student's vocabulary")
    try:
        plan.actor.check_model(model, path, device.has_gpu())  # the teacher runs at the actor's layout
    except ValueError as e:
        raise ConfigError(f"{key}: {e} (a teacher runs at the actor's layout)") from None
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if longest > model.max_position_embeddings:
        raise ConfigError(f"{key}: data.max_prompt_length + data.max_response_length ({longest}) exceeds the "
                          f"teacher's max_position_embeddings ({model.max_position_embeddings}) in {path}")


def _check_routing(data, column: str, keys: set) -> None:
    values = data.columns.get(column)
    if values is None:
        raise ConfigError(f"distillation.teacher_key: {data.files[0]} has no column {column!r} to route its rows to "
                          f"the teachers {sorted(keys)}")
    for row, value in enumerate(routing_keys(values)):
        if value not in keys:
            raise ConfigError(f"distillation.teacher_key: {column}={value!r} at {data.where(row)} names no teacher "
                              f"(keys: {sorted(keys)})")
