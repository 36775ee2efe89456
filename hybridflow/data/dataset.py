"""Parquet prompt datasets -> left-padded prompt batches."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from hybridflow.protocol import Batch


class PromptDataset:
    """Prompts (tokenized once) and their non-tensor columns, from one or more parquet files."""

    def __init__(self, files: list[str], tokenizer, *, prompt_key: str, answer_key: str, max_prompt_length: int):
        if not files:
            raise ValueError("no parquet files given")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_ids: list[list[int]] = []
        columns: dict[str, list] = {}
        for f in files:
            table = self._read(f, prompt_key, answer_key)
            for key in (prompt_key, answer_key):
                nulls = table[key].is_null().to_pylist()
                if any(nulls):
                    raise ValueError(f"{f} row {nulls.index(True)}: {key!r} is empty (null)")
            for row, ids in enumerate(tokenizer(table[prompt_key].to_pylist()).input_ids):
                if len(ids) > max_prompt_length:
                    raise ValueError(f"{f} row {row}: prompt has {len(ids)} tokens, more than "
                                     f"data.max_prompt_length={max_prompt_length}")
                self.prompt_ids.append(ids)
            for name in table.column_names:
                columns.setdefault(name, []).extend(table[name].to_pylist())
        self.columns = {k: np.array(v, dtype=object) for k, v in columns.items()}
        self.columns["answer"] = self.columns[answer_key]

    @staticmethod
    def _read(path: str, prompt_key: str, answer_key: str):
        if not Path(path).exists():
            raise FileNotFoundError(f"data file not found: {path}")
        if not Path(path).is_file():  # pyarrow would read a folder as a dataset of every file in it
            raise ValueError(f"{path} is not a file (a parquet file is expected)")
        import pyarrow

        try:
            table = pq.read_table(path)
        except (pyarrow.ArrowInvalid, OSError) as e:
            raise ValueError(f"{path} is not a readable parquet file ({' '.join(str(e).split())[:120]})") from None
        if table.num_rows == 0:
            raise ValueError(f"{path} has no rows")
        for key in (prompt_key, answer_key):
            if key not in table.column_names:
                raise ValueError(f"{path}: column {key!r} missing (columns: {table.column_names})")
        return table

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, rows) -> Batch:
        """Left-padded prompts of the given rows (left padding keeps every prompt ending at one column)."""
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(rows), self.max_prompt_length), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            p = self.prompt_ids[r]
            ids[i, self.max_prompt_length - len(p):] = torch.tensor(p)
            mask[i, self.max_prompt_length - len(p):] = 1
        return Batch.from_dict(
            tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
            non_tensors={k: v[list(rows)] for k, v in self.columns.items()})

    def iterate(self, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True,
                skip: int = 0) -> Iterator[Batch]:
        """Endless batches over epochs, reshuffled each epoch with a seeded generator; ``skip``: the number
        of batches already consumed (a resumed run continues where its checkpoint left off)."""
        if drop_last and len(self) < batch_size:  # no full batch would ever come: fail instead of looping
            raise ValueError(f"{len(self)} prompts cannot fill one batch of {batch_size}")
        rng = np.random.default_rng(seed)
        while True:
            order = rng.permutation(len(self)) if shuffle else np.arange(len(self))
            stop = len(order) - (len(order) % batch_size if drop_last else 0)
            for start in range(0, stop, batch_size):
                if skip:
                    skip -= 1
                    continue
                yield self.batch(order[start:start + batch_size].tolist())
