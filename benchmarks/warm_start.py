"""The quickstart overlays' warm start: seconds per SFT step with one padded batch (before) and with length groups
(``trainer/sft.py`` ``sft_loss``), side by side on the same batches, and the time to the first RL step it
implies for each overlay on this machine.

    python benchmarks/warm_start.py [--steps 8]

For each overlay its own preparation builds the data and the tiny base model (cached under
benchmarks/.cache/warm_start/), then ``--steps`` optimizer steps of each kind alternate on batches drawn as the
warm start draws them, from one copy of the model each. The time to the first RL step is bounded by
``prepare.sft_steps`` x the step, plus its held-out evaluations (one measured), plus the quickstart's start-up
(results/startup.json). Writes benchmarks/results/warm_start.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import CACHE, REPO, write_json  # noqa: E402

OVERLAYS = ("quickstart_cpu", "quickstart_moe_cpu", "quickstart_tools_cpu")


def _config(name: str):
    from hybridflow.plan import load_experiment

    root = CACHE / "warm_start" / name
    # model.path at the base model: the preparation builds data and base model and no warm start
    return load_experiment([str(REPO / "configs" / f"{name}.yaml")], [
        f"prepare.data_dir={root}/data", f"prepare.base_model_dir={root}/base", f"model.path={root}/base"])


def _sequences_and_evaluation(cfg):
    """The warm start's (ids, loss mask) sequences, and a function timing one held-out evaluation."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from hybridflow.trainer import prepare_tools, sft

    base, train = cfg.prepare.base_model_dir, str(Path(cfg.prepare.data_dir) / "train.parquet")
    tokenizer, rng = AutoTokenizer.from_pretrained(base), random.Random(cfg.trainer.seed)
    if cfg.prepare.task == "multiplication_tools":
        from hybridflow.agent.chat import ChatFormat

        tools = prepare_tools.calculator_tools(cfg)
        chat = ChatFormat(tokenizer, cfg.data.apply_chat_template_kwargs)
        sequences, prompts, answers = prepare_tools.tool_trace_sequences(cfg, tokenizer, chat, tools, train, 128, rng)
        return sequences, lambda model: prepare_tools.multi_turn_greedy_accuracy(cfg, model, tokenizer, tools, chat,
                                                                                  prompts, answers)
    from hybridflow.rewards import get_scorer

    table = pq.read_table(train, columns=["prompt", "answer"])
    pairs = list(zip(table["prompt"].to_pylist(), table["answer"].to_pylist()))
    sequences = [sft.answer_sequence(tokenizer, p, a) for p, a in pairs]
    dev = rng.sample(pairs, 256)
    return sequences, lambda model: sft.greedy_accuracy(model, tokenizer, dev, get_scorer(cfg.reward.name),
                                                        cfg.data.max_response_length)


def _padded_step(model, pad_id: int, batch) -> None:
    from hybridflow.trainer.sft import _sft_batch

    ids, mask, labels = _sft_batch(pad_id, batch)
    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
          labels=labels).loss.backward()


def measure(name: str, steps: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.trainer.prepare import prepare_quickstart
    from hybridflow.trainer.sft import sft_loss

    cfg = _config(name)
    prepare_quickstart(cfg)
    p = cfg.prepare
    sequences, evaluate = _sequences_and_evaluation(cfg)
    pad_id = AutoTokenizer.from_pretrained(p.base_model_dir).pad_token_id
    base = AutoModelForCausalLM.from_pretrained(p.base_model_dir, dtype=torch.float32)
    kinds = {"padded": (copy.deepcopy(base), lambda m, b: _padded_step(m, pad_id, b)),
             "length_groups": (copy.deepcopy(base), lambda m, b: sft_loss(m, pad_id, b))}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=p.sft_lr, weight_decay=0.0) for k, (m, _) in kinds.items()}
    rng, times = random.Random(0), {k: [] for k in kinds}
    for i in range(steps + 1):  # the first step of each kind warms up
        batch = rng.sample(sequences, p.sft_batch_size)
        for k, (model, step) in kinds.items():
            t = time.perf_counter()
            opts[k].zero_grad()
            step(model, batch)
            opts[k].step()
            if i:
                times[k].append(time.perf_counter() - t)
    t = time.perf_counter()
    evaluate(base)
    eval_s = time.perf_counter() - t
    evals = 1 if p.sft_target_accuracy is None else p.sft_steps // p.sft_eval_every
    step_s = {k: statistics.median(v) for k, v in times.items()}
    startup = json.loads((REPO / "benchmarks" / "results" / "startup.json").read_text())["to_first_step_s"]
    bound = {k: p.sft_steps * s + evals * eval_s + startup for k, s in step_s.items()}
    return {"sft_steps_at_most": p.sft_steps, "sft_batch_size": p.sft_batch_size, "step_s": step_s,
            "step_times_s": times, "speedup": step_s["padded"] / step_s["length_groups"], "evaluation_s": eval_s,
            "evaluations_at_most": evals, "startup_s": startup, "to_first_rl_step_at_most_s": bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    results = {}
    for name in OVERLAYS:
        results[name] = r = measure(name, a.steps)
        print(f"{name}: {r['step_s']['padded']:.3f} -> {r['step_s']['length_groups']:.3f} s/step "
              f"({r['speedup']:.2f}x); first RL step within {r['to_first_rl_step_at_most_s']['length_groups']:.0f} s "
              f"(was {r['to_first_rl_step_at_most_s']['padded']:.0f} s)", flush=True)
    write_json(REPO / "benchmarks" / "results" / "warm_start.json",
               {"threads": torch.get_num_threads(), "overlays": results})


if __name__ == "__main__":
    main()
