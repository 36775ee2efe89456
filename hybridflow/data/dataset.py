"""Parquet prompt datasets -> left-padded prompt batches.

Two prompt formats, per file:
- plain text: ``prompt`` a string, tokenized as it is (the quickstart's);
- verl's (``examples/data_preprocess/*.py``, read by verl's ``RLHFDataset``): ``prompt`` a list of chat
  messages ``{role, content}``, rendered with the tokenizer's chat template and a generation prompt, beside
  ``data_source``, ``ability``, ``reward_model: {style, ground_truth}`` and ``extra_info``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hybridflow.protocol import Batch

log = logging.getLogger(__name__)

GROUND_TRUTH = "reward_model.ground_truth"  # verl's place for it
TRUNCATIONS = ("error", "left", "right", "middle")


class PromptDataset:
    """Prompts (tokenized once) and their non-tensor columns, from one or more parquet files; the column
    ``answer`` holds each row's ground truth (``answer_key``, a column or ``column.field``; None: verl's
    ``reward_model.ground_truth`` when the file has it, else the column ``answer``).

    Prompts over ``max_prompt_length`` tokens are dropped when ``filter_overlong_prompts`` (``filtered``:
    {file: number dropped}), else cut as ``truncation`` says, with verl's meanings
    (``verl/utils/torch_functional.py`` ``postprocess_data``): left keeps the last tokens, right the first,
    middle half from each end, error refuses naming the row.
    ``unrepresentable``: {file: rows} whose prompts the tokenizer cannot represent (kept; the caller warns).
    """

    def __init__(self, files: list[str], tokenizer, *, prompt_key: str, answer_key: str | None = None,
                 max_prompt_length: int, filter_overlong_prompts: bool = False, truncation: str = "error",
                 chat_template_kwargs: dict | None = None):
        if not files:
            raise ValueError("no parquet files given")
        if truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        self.tokenizer, self.max_prompt_length, self.files = tokenizer, max_prompt_length, list(files)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # verl's data.apply_chat_template_kwargs
        self.prompt_ids: list[list[int]] = []
        self.unrepresentable: dict[str, list[int]] = {}
        self.filtered: dict[str, int] = {}
        self.origin: list[tuple[int, int]] = []  # per row: (index in files, row in that file)
        tables: list[dict[str, list]] = []
        for file_index, f in enumerate(self.files):
            table = self._read(f, prompt_key)
            truths = _ground_truths(table, f, answer_key)
            texts, ids, chat = self._tokenize(table, f, prompt_key)
            if lossy := _unrepresentable(tokenizer, texts, ids, skip_special_tokens=not chat):
                self.unrepresentable[f] = lossy
            keep = self._fit(f, ids, filter_overlong_prompts, truncation)
            self.filtered[f] = len(ids) - len(keep)
            if self.filtered[f]:
                log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                            "(data.filter_overlong_prompts)", f, self.filtered[f], len(ids), max_prompt_length)
            self.prompt_ids.extend(ids[row] for row in keep)
            self.origin.extend((file_index, row) for row in keep)
            columns = {name: table[name].to_pylist() for name in table.column_names}
            columns["answer"] = truths
            tables.append({name: [values[row] for row in keep] for name, values in columns.items()})
        if not self.prompt_ids:
            raise ValueError(f"{', '.join(self.files)}: no prompts left: all {sum(self.filtered.values())} are longer "
                             f"than data.max_prompt_length={max_prompt_length} tokens (data.filter_overlong_prompts)")
        names = list(dict.fromkeys(name for t in tables for name in t))
        # a column some files lack is None in their rows (such rows score by reward.name, see rewards.routing)
        self.columns = {name: _object_array([v for t in tables for v in t.get(name, [None] * len(t["answer"]))])
                        for name in names}

    @classmethod
    def from_config(cls, files: list[str], tokenizer, data, tools: list[dict] | None = None) -> PromptDataset:
        """The dataset the ``data`` config section describes; chat prompts are rendered showing ``tools`` (OpenAI
        function schemas: the multi-turn rollout's tools) when given."""
        kwargs = {**data.apply_chat_template_kwargs, **({"tools": tools} if tools else {})}
        return cls(files, tokenizer, prompt_key=data.prompt_key, answer_key=data.answer_key,
                   max_prompt_length=data.max_prompt_length, filter_overlong_prompts=data.filter_overlong_prompts,
                   truncation=data.truncation, chat_template_kwargs=kwargs)

    def where(self, row: int) -> str:
        """Dataset row ``row`` as a user finds it: its file and row there."""
        file_index, file_row = self.origin[row]
        return f"{self.files[file_index]} row {file_row}"

    @staticmethod
    def _read(path: str, prompt_key: str):
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
        if prompt_key not in table.column_names:
            raise ValueError(f"{path}: column {prompt_key!r} missing (columns: {table.column_names})")
        _check_no_nulls(table[prompt_key].to_pylist(), path, prompt_key)
        return table

    def _tokenize(self, table, path: str, key: str) -> tuple[list[str], list[list[int]], bool]:
        """(texts as tokenized, their ids, whether they are rendered chats)."""
        column = table[key]
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            texts = column.to_pylist()
            blank = next((row for row, text in enumerate(texts) if not text.strip()), None)
            if blank is not None:
                raise ValueError(f"{path} row {blank}: {key!r} is empty (blank text)")
            return texts, self.tokenizer(texts).input_ids, False
        if not ((pa.types.is_list(column.type) or pa.types.is_large_list(column.type))
                and pa.types.is_struct(column.type.value_type)):
            raise ValueError(f"{path}: column {key!r} holds {column.type}, not text (nor a list of chat messages)")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{path}: column {key!r} holds chat messages but the tokenizer "
                             f"{getattr(self.tokenizer, 'name_or_path', '')!r} has no chat template to render them")
        texts = [self._render(messages, path, row, key) for row, messages in enumerate(column.to_pylist())]
        # What apply_chat_template(tokenize=True) does after rendering (transformers'
        # tokenization_utils_base.py: self(rendered_chat, add_special_tokens=False)), batched.
        return texts, self.tokenizer(texts, add_special_tokens=False).input_ids, True

    def _render(self, messages: list[dict], path: str, row: int, key: str) -> str:
        if not messages:
            raise ValueError(f"{path} row {row}: {key!r} is empty (no messages)")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **self.chat_template_kwargs)
        except Exception as e:  # jinja errors of a template that expects other fields
            raise ValueError(f"{path} row {row}: the chat template cannot render {key!r} "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None

    def _fit(self, path: str, ids: list[list[int]], filter_overlong: bool, truncation: str) -> list[int]:
        """Rows kept; over-long prompts cut in place (truncation) unless dropped (filter)."""
        limit, keep = self.max_prompt_length, []
        for row, row_ids in enumerate(ids):
            if len(row_ids) > limit:
                if filter_overlong:
                    continue
                if truncation == "error":
                    raise ValueError(f"{path} row {row}: prompt has {len(row_ids)} tokens, more than "
                                     f"data.max_prompt_length={limit} (set data.filter_overlong_prompts or "
                                     "data.truncation: left | right | middle)")
                ids[row] = truncate(row_ids, limit, truncation)
            keep.append(row)
        return keep

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


def truncate(ids: list[int], limit: int, side: str) -> list[int]:
    """``ids`` cut to ``limit`` tokens as verl's ``postprocess_data`` cuts: left keeps the last, right the
    first, middle ``limit // 2`` from the start and the rest from the end."""
    if len(ids) <= limit:
        return ids
    if side == "left":
        return ids[-limit:]
    if side == "right":
        return ids[:limit]
    if side == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head):]
    raise ValueError(f"no truncation {side!r}")


def _ground_truths(table, path: str, answer_key: str | None) -> list:
    """Each row's ground truth from ``answer_key`` (a column, or ``column.field`` of a struct column)."""
    names = table.column_names
    if answer_key is None:
        reward_model = table.schema.field("reward_model").type if "reward_model" in names else None
        if (reward_model is not None and pa.types.is_struct(reward_model)
                and reward_model.get_field_index("ground_truth") >= 0):
            answer_key = GROUND_TRUTH
        elif "answer" in names:
            answer_key = "answer"
        else:
            raise ValueError(f"{path}: no ground truth: neither {GROUND_TRUTH} nor a column 'answer' (set "
                             f"data.answer_key; columns: {names})")
    column, _, field = answer_key.partition(".") if answer_key not in names else (answer_key, "", "")
    if column not in names:
        raise ValueError(f"{path}: column {answer_key!r} missing (columns: {names})")
    values = table[column].to_pylist()
    if field:
        kind = table.schema.field(column).type
        if not pa.types.is_struct(kind) or kind.get_field_index(field) < 0:
            fields = [kind.field(i).name for i in range(kind.num_fields)] if pa.types.is_struct(kind) else []
            raise ValueError(f"{path}: column {column!r} has no field {field!r} (it holds {kind}"
                             f"{f'; fields: {fields}' if fields else ''})")
        values = [None if v is None else v[field] for v in values]
    _check_no_nulls(values, path, answer_key)
    return values


def _check_no_nulls(values: list, path: str, key: str) -> None:
    null = next((row for row, v in enumerate(values) if v is None), None)
    if null is not None:
        raise ValueError(f"{path} row {null}: {key!r} is empty (null)")


def _object_array(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise: np.array would build a 2-D array from chat prompts
        out[i] = v
    return out


def _unrepresentable(tokenizer, texts: list[str], ids: list[list[int]], skip_special_tokens: bool = True) -> list[int]:
    """Rows whose text the tokenizer cannot represent: an unknown token, or characters lost on the way back
    (whitespace aside: tokenizers normalize it, SentencePiece's and the quickstart's among them). Rendered
    chats are compared with their special tokens (the template's markers are part of the text)."""
    def visible(text: str) -> str:
        return "".join(text.split())

    unk = tokenizer.unk_token_id
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)
    return [row for row, (text, row_ids, back) in enumerate(zip(texts, ids, decoded))
            if (unk is not None and unk in row_ids) or visible(back) != visible(text)]
