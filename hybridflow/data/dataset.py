"""Parquet prompt datasets -> left-padded prompt batches."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridflow.protocol import Batch


class PromptDataset:
    """Prompts (tokenized once) and their non-tensor columns, from one or more parquet files.
    ``unrepresentable``: {file: rows} whose prompts the tokenizer cannot represent (kept; the caller warns)."""

    def __init__(self, files: list[str], tokenizer, *, prompt_key: str, answer_key: str, max_prompt_length: int):
        if not files:
            raise ValueError("no parquet files given")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_ids: list[list[int]] = []
        self.unrepresentable: dict[str, list[int]] = {}
        columns: dict[str, list] = {}
        for f in files:
            table = self._read(f, prompt_key, answer_key)
            for key in (prompt_key, answer_key):
                nulls = table[key].is_null().to_pylist()
                if any(nulls):
                    raise ValueError(f"{f} row {nulls.index(True)}: {key!r} is empty (null)")
            prompts = table[prompt_key]
            if not (pa.types.is_string(prompts.type) or pa.types.is_large_string(prompts.type)):
                raise ValueError(f"{f}: column {prompt_key!r} holds {prompts.type}, not text")
            prompts = prompts.to_pylist()
            blank = next((row for row, text in enumerate(prompts) if not text.strip()), None)
            if blank is not None:
                raise ValueError(f"{f} row {blank}: {prompt_key!r} is empty (blank text)")
            ids = tokenizer(prompts).input_ids
            for row, row_ids in enumerate(ids):
                if len(row_ids) > max_prompt_length:
                    raise ValueError(f"{f} row {row}: prompt has {len(row_ids)} tokens, more than "
                                     f"data.max_prompt_length={max_prompt_length}")
            self.prompt_ids.extend(ids)
            if lossy := _unrepresentable(tokenizer, prompts, ids):
                self.unrepresentable[f] = lossy
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
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as e:
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


def _unrepresentable(tokenizer, texts: list[str], ids: list[list[int]]) -> list[int]:
    """Rows whose text the tokenizer cannot represent: an unknown token, or characters lost on the way back
    (whitespace aside: tokenizers normalize it, SentencePiece's and the quickstart's among them)."""
    def visible(text: str) -> str:
        return "".join(text.split())

    unk = tokenizer.unk_token_id
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return [row for row, (text, row_ids, back) in enumerate(zip(texts, ids, decoded))
            if (unk is not None and unk in row_ids) or visible(back) != visible(text)]
