"""The tools quickstart's preparation (configs/quickstart_tools_cpu.yaml): 3-digit x 2-digit products in verl's
parquet format, a tiny Qwen2 whose char-level chat template has tool-call tokens, and a warm start on tool-use
demonstrations that stops once the multi-turn greedy accuracy (the agent loop with the calculator, as RL's
validation runs it) reaches prepare.sft_target_accuracy. Each part is built only when absent."""

from __future__ import annotations

import random
from pathlib import Path

from hybridflow.agent.chat import ChatFormat
from hybridflow.agent.hf_engine import HFEngine
from hybridflow.agent.loop import AgentLoop, AgentSettings
from hybridflow.agent.parsers import get_parser
from hybridflow.agent.tools import load_tools
from hybridflow.data.dataset import PromptDataset
from hybridflow.data.multiplication import direct_trace, tool_trace, write_multiplication_parquet
from hybridflow.models.tiny_qwen2 import build_chat_tokenizer, build_tiny_qwen2
from hybridflow.rewards import get_scorer
from hybridflow.rollout.vllm_rollout import SamplingSettings
from hybridflow.trainer.experience import sampled_text
from hybridflow.trainer.sft import train_sequences


def prepare_tools_quickstart(cfg, before_warm_start=None) -> None:
    """The tools quickstart's data, tiny base model and warm start, each when absent (``before_warm_start``: as
    prepare.prepare_quickstart's)."""
    p = cfg.prepare
    data_dir = Path(p.data_dir)
    if not (data_dir / "train.parquet").exists() or not (data_dir / "val.parquet").exists():
        write_multiplication_parquet(data_dir, n_train=p.n_train, n_val=p.n_val, seed=cfg.trainer.seed)
    base = Path(p.base_model_dir)
    if not (base / "model.safetensors").exists():
        build_tiny_qwen2(base, build_chat_tokenizer(base, tools=True), hidden_size=p.hidden_size,
                         num_layers=p.num_layers, intermediate_size=3 * p.hidden_size, vocab_multiple=p.vocab_multiple,
                         max_position_embeddings=cfg.data.max_prompt_length + cfg.data.max_response_length,
                         seed=cfg.trainer.seed)
    if not (Path(cfg.model.path) / "model.safetensors").exists():
        if before_warm_start is not None:
            before_warm_start(str(base))
        result = warm_start_on_tool_traces(cfg, str(base), str(data_dir / "train.parquet"))
        print(f"warm start: {result['steps']} steps, held-out multi-turn greedy accuracy {result['dev_accuracy']}",
              flush=True)


def warm_start_on_tool_traces(cfg, base_dir: str, train_file: str, dev_size: int = 128) -> dict:
    """SFT on demonstrations of calling the calculator and answering with its result (``tool_trace_sequences``),
    evaluated on ``dev_size`` held-out training prompts by the agent loop itself."""
    from transformers import AutoTokenizer

    p, tokenizer = cfg.prepare, AutoTokenizer.from_pretrained(base_dir)
    tools = calculator_tools(cfg)
    chat = ChatFormat(tokenizer, cfg.data.apply_chat_template_kwargs)
    rng = random.Random(cfg.trainer.seed)
    sequences, dev_prompts, dev_answers = tool_trace_sequences(cfg, tokenizer, chat, tools, train_file, dev_size, rng)

    def evaluate(model) -> float:
        return multi_turn_greedy_accuracy(cfg, model, tokenizer, tools, chat, dev_prompts, dev_answers)

    return train_sequences(base_dir, cfg.model.path, sequences, steps=p.sft_steps, lr=p.sft_lr,
                           batch_size=p.sft_batch_size, seed=cfg.trainer.seed, target_accuracy=p.sft_target_accuracy,
                           evaluate=evaluate, eval_every=p.sft_eval_every, rng=rng)


def calculator_tools(cfg) -> dict:
    tools = load_tools(cfg.rollout.multi_turn.tool_config_path)
    if "calculator" not in tools:
        raise ValueError(f"{cfg.rollout.multi_turn.tool_config_path}: prepare.task multiplication_tools needs the "
                         "calculator tool")
    return tools


def tool_trace_sequences(cfg, tokenizer, chat, tools, train_file: str, dev_size: int, rng: random.Random):
    """(the warm start's (ids, loss mask) demonstrations, the held-out prompts' ids, their answers): a
    prepare.tool_trace_fraction share of the demonstrations call the calculator (data/multiplication.py
    tool_trace), the others answer directly."""
    data = PromptDataset.from_config([train_file], tokenizer, cfg.data, tools=[t.schema for t in tools.values()])
    rows = list(range(len(data)))
    rng.shuffle(rows)
    dev, train = rows[:dev_size], rows[dev_size:]
    extra = data.columns["extra_info"]
    sequences = [tool_trace(tokenizer, chat, tools["calculator"], data.prompt_ids[r], extra[r]["a"], extra[r]["b"])
                 if rng.random() < cfg.prepare.tool_trace_fraction else
                 direct_trace(tokenizer, chat, data.prompt_ids[r], extra[r]["a"], extra[r]["b"]) for r in train]
    return sequences, [data.prompt_ids[r] for r in dev], [str(data.columns["answer"][r]) for r in dev]


def multi_turn_greedy_accuracy(cfg, model, tokenizer, tools, chat, prompts: list[list[int]], answers: list[str]) -> float:
    """Greedy multi-turn accuracy of a transformers model: the agent loop with its tools, scored as RL scores."""
    import torch

    m = cfg.rollout.multi_turn
    parser = get_parser(m.format, tokenizer, [t.schema for t in tools.values()])
    loop = AgentLoop(tokenizer, tools, parser, AgentSettings.from_config(m, cfg.data.max_response_length), chat)
    try:
        trajectories = loop.run(HFEngine(model, tokenizer.pad_token_id), prompts,
                                SamplingSettings(temperature=0.0), log_probs=False)
    finally:
        loop.close()
    scorer = get_scorer(cfg.reward.name)
    texts = [sampled_text(tokenizer, torch.tensor(t.response_ids), torch.tensor(t.response_mask)) for t in trajectories]
    return sum(scorer(text, answer) for text, answer in zip(texts, answers)) / len(answers)
