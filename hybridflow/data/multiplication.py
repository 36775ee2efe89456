"""The tools quickstart's task: 3-digit x 2-digit products ("123*45=" -> "5535"), which a tiny model cannot
compute alone but can with the calculator tool.

Prompts are written in verl's parquet format (chat messages, ``reward_model.ground_truth``, ``data_source``),
and ``tool_trace`` builds the warm start's tool-use demonstrations token by token, exactly as the agent loop
assembles a trajectory: the assistant's call, the calculator's real response rendered by the chat template,
then the answer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa

from hybridflow.data.arithmetic import write_splits

DATA_SOURCE = "multiplication"


def make_split(n_train: int, n_val: int, seed: int) -> tuple[list, list]:
    """Disjoint (a, b) pairs, 100 <= a <= 999 and 10 <= b <= 99, for training and held-out validation."""
    pairs = random.Random(seed).sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], n_train + n_val)
    return pairs[n_val:], pairs[:n_val]


def question(a: int, b: int) -> str:
    return f"{a}*{b}="


def _table(pairs: list) -> pa.Table:
    return pa.table({
        "data_source": [DATA_SOURCE] * len(pairs),
        "prompt": [[{"role": "user", "content": question(a, b)}] for a, b in pairs],
        "ability": ["math"] * len(pairs),
        "reward_model": [{"style": "rule", "ground_truth": str(a * b)} for a, b in pairs],
        "extra_info": [{"index": i, "a": a, "b": b} for i, (a, b) in enumerate(pairs)],
    })


def write_multiplication_parquet(out_dir: str | Path, n_train: int = 20000, n_val: int = 256,
                                 seed: int = 0) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet (verl's format); returns their paths."""
    return write_splits(out_dir, *(_table(pairs) for pairs in make_split(n_train, n_val, seed)))


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator, in the Hermes format the agent loop parses."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def tool_trace(tokenizer, chat, calculator, prompt_ids: list[int], a: int, b: int) -> tuple[list[int], list[int]]:
    """(prompt + response ids, loss mask) of a demonstration: call the calculator, read its response, answer.
    The response's tokens are laid out as the agent loop lays out a trajectory (agent/loop.py): the turns the
    model writes end with the chat's end-of-turn token and are trained on (mask 1); the tool message between
    them is rendered by ``chat`` (agent/chat.py ChatFormat) from the calculator's actual response (mask 0)."""
    expression = question(a, b).rstrip("=")
    result = calculator.call({"expression": expression}).text
    call = tokenizer(tool_call_text(expression), add_special_tokens=False).input_ids + [chat.end_of_turn_id]
    tool = chat.tool_message_ids([result])
    answer = tokenizer(result, add_special_tokens=False).input_ids + [chat.end_of_turn_id]
    ids = prompt_ids + call + tool + answer
    mask = [0] * len(prompt_ids) + [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    return ids, mask


def direct_trace(tokenizer, chat, prompt_ids: list[int], a: int, b: int) -> tuple[list[int], list[int]]:
    """(prompt + response ids, loss mask) of a demonstration that answers at once, without the calculator."""
    answer = tokenizer(str(a * b), add_special_tokens=False).input_ids + [chat.end_of_turn_id]
    return prompt_ids + answer, [0] * len(prompt_ids) + [1] * len(answer)
