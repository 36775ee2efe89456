"""Supervised warm start on prompt/answer parquet: teaches the task format so RL has signal to amplify
(from a random init PPO reward stays ~0.03 on the arithmetic task)."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import torch


def _sft_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Left-padded prompt+answer+EOS sequences; loss only on the answer tokens."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = [(tokenizer(p).input_ids, tokenizer(a).input_ids + [eos]) for p, a in pairs]
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(seqs):
        off = width - len(p) - len(a)
        ids[i, off:] = torch.tensor(p + a)
        mask[i, off:] = 1
        labels[i, off + len(p):] = torch.tensor(a)
    return ids, mask, labels


def warm_start(model_dir: str, out_dir: str, train_file: str, *, steps: int, lr: float, batch_size: int,
               seed: int, prompt_key: str = "prompt", answer_key: str = "answer", log_every: int = 100) -> None:
    """Fine-tune the HF model in ``model_dir`` on (prompt -> answer) for ``steps`` steps; save to ``out_dir``."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.workers.export import save_hf_folder

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    table = pq.read_table(train_file, columns=[prompt_key, answer_key])
    pairs = list(zip(table[prompt_key].to_pylist(), table[answer_key].to_pylist()))
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    bar = tqdm(range(1, steps + 1), desc="sft warm start", dynamic_ncols=True)
    for step in bar:
        ids, mask, labels = _sft_batch(tokenizer, rng.sample(pairs, batch_size))
        loss = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                     labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % log_every == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    save_hf_folder(out_dir, model.config, {k: v.detach() for k, v in model.state_dict().items()}, tokenizer)


def main(argv=None) -> int:
    """`hybridflow sft --model DIR --out DIR --train-file F [--steps N --lr X --batch-size B]`."""
    import argparse

    ap = argparse.ArgumentParser(prog="hybridflow sft", description="supervised warm start on prompt/answer parquet")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train-file", required=True)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    warm_start(a.model, a.out, a.train_file, steps=a.steps, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    return 0
