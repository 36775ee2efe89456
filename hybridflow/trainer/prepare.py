"""Quickstart preparation: tokenizer, tiny Qwen2 model, arithmetic parquet and the SFT warm start,
each built only when absent (so `make run` can be re-run cheaply)."""

from __future__ import annotations

from pathlib import Path

from hybridflow.data.arithmetic import write_arithmetic_parquet
from hybridflow.models.char_tokenizer import build_char_tokenizer
from hybridflow.models.tiny_arch import build_tiny
from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
from hybridflow.rewards import get_scorer
from hybridflow.trainer.prepare_tools import prepare_tools_quickstart
from hybridflow.trainer.sft import warm_start


def prepare_quickstart(cfg, before_warm_start=None) -> None:
    """``before_warm_start(base_dir)``: called with the tiny base model (the warm start's shapes) before the warm start
    trains, so that the rules of the model and the config fail before its minutes (preflight.check_model)."""
    p = cfg.prepare
    if p.task == "multiplication_tools":
        return prepare_tools_quickstart(cfg, before_warm_start)
    data_dir = Path(p.data_dir)
    if not (data_dir / "train.parquet").exists() or not (data_dir / "val.parquet").exists():
        write_arithmetic_parquet(data_dir, max_operand=p.max_operand, n_val=p.n_val, seed=cfg.trainer.seed)
    base = Path(p.base_model_dir)
    if not (base / "model.safetensors").exists():
        tokenizer = build_char_tokenizer(base)
        sizes = dict(hidden_size=p.hidden_size, num_layers=p.num_layers,
                     intermediate_size=3 * p.hidden_size,  # the quickstart's 128 -> 384, at any width
                     vocab_multiple=p.vocab_multiple,
                     max_position_embeddings=cfg.data.max_prompt_length + cfg.data.max_response_length,
                     seed=cfg.trainer.seed)
        if p.arch == "qwen2":
            build_tiny_qwen2(base, tokenizer, **sizes)
        else:  # e.g. qwen3_moe: the MoE quickstart's 8 experts, top-2, as wide as the dense MLP per token
            build_tiny(base, tokenizer, p.arch, head_dim=p.hidden_size // 4, num_experts=p.num_experts,
                       top_k=p.moe_top_k, moe_intermediate_size=3 * p.hidden_size // (2 * p.moe_top_k),
                       norm_noise=0.0, **sizes)
    if not (Path(cfg.model.path) / "model.safetensors").exists():
        if before_warm_start is not None:
            before_warm_start(str(base))
        _warm_start(cfg, base, cfg.model.path, p.sft_steps, p.sft_target_accuracy, "warm start")
    teacher = Path(p.teacher_warm_start_dir)
    named = any(Path(t).resolve() == teacher.resolve() for t in cfg.distillation.teachers().values())
    if named and not (teacher / "model.safetensors").exists():
        _warm_start(cfg, base, str(teacher), p.teacher_sft_steps, p.teacher_target_accuracy, "distillation teacher")


def _warm_start(cfg, base: Path, out: str, steps: int, target_accuracy: float | None, what: str) -> None:
    p = cfg.prepare
    result = warm_start(str(base), out, str(Path(p.data_dir) / "train.parquet"), steps=steps, lr=p.sft_lr,
                        batch_size=p.sft_batch_size, seed=cfg.trainer.seed, target_accuracy=target_accuracy,
                        scorer=get_scorer(cfg.reward.name), eval_every=p.sft_eval_every,
                        max_new_tokens=cfg.data.max_response_length)
    print(f"{what}: {result['steps']} steps, held-out greedy accuracy {result['dev_accuracy']}", flush=True)
