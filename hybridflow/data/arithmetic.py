"""The synthetic arithmetic task used by the CPU quickstart: "Q: 37+48= A:" -> "85".

Train and validation prompts are disjoint operand pairs, written to parquet in the suite's prompt
format (columns: prompt, answer, data_source, index).
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.util import atomic_path

DATA_SOURCE = "arithmetic"


def format_prompt(a: int, b: int) -> str:
    return f"Q: {a}+{b}= A:"


def make_split_pairs(max_operand: int, n_val: int, seed: int) -> tuple[list, list]:
    """All pairs (a, b) with 0 <= a, b <= max_operand, shuffled and split into train / held-out val."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    if n_val >= len(pairs):
        raise ValueError(f"n_val ({n_val}) must be smaller than the {len(pairs)} operand pairs")
    return pairs[n_val:], pairs[:n_val]


def _table(pairs: list) -> pa.Table:
    return pa.table({
        "prompt": [format_prompt(a, b) for a, b in pairs],
        "answer": [str(a + b) for a, b in pairs],
        "data_source": [DATA_SOURCE] * len(pairs),
        "index": list(range(len(pairs))),
    })


def write_arithmetic_parquet(out_dir: str | Path, max_operand: int = 99, n_val: int = 256,
                             seed: int = 0) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet; returns their paths."""
    return write_splits(out_dir, *(_table(pairs) for pairs in make_split_pairs(max_operand, n_val, seed)))


def write_splits(out_dir: str | Path, train: pa.Table, val: pa.Table) -> tuple[Path, Path]:
    """``out_dir``/train.parquet and val.parquet, each written atomically; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "val.parquet"
    for table, path in zip((train, val), paths):
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp)
    return paths
