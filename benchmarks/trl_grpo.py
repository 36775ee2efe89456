"""One GRPO workload with TRL's GRPOTrainer: the TRL side of the hybridflow-vs-TRL speed benchmark.

    py=$(python benchmarks/trl_env.py)      # TRL's own pinned venv (benchmarks/trl-requirements.txt)
    $py benchmarks/trl_grpo.py --model outputs/quickstart/sft_model \\
        --train outputs/quickstart/data/train.parquet --val outputs/quickstart/data/val.parquet \\
        --steps 20 --prompts 16 --n 4 --threads 2 --out benchmarks/results/trl_grpo.json

Runs in the TRL venv, never in hybridflow's: the only hybridflow code it imports is the reward scorer
(hybridflow.rewards, which needs nothing beyond torch; checked at import time below).

The GRPO settings mirror hybridflow's GRPO (configs/quickstart_grpo_cpu.yaml: GRPO advantages, KL to the
reference as a low_var_kl loss term, one optimizer step per rollout) wherever TRL lets them; each choice is
commented where the GRPOConfig is built.

Measured, written as JSON to --out:
  startup_s          process start (top of this file, before torch/trl imports) to step 0's on_step_begin,
                     minus the time of the "before" validation pass (which runs in between; it is val_s[0]);
  step_s             per optimizer step: on_step_begin -> on_step_end wall seconds (generation, reference and
                     policy log-probs, loss, backward, optimizer step);
  generated_tokens   per step: completion tokens generated over all prompts*n completions, the EOS token
                     counted when produced, padding (and anything after the first EOS) excluded. Read from the
                     completion_ids TRL hands to the reward function (TRL cuts each completion after its first
                     EOS, EOS kept);
  reward_mean        per step: mean arithmetic score over the step's completions;
  val_accuracy_*     greedy (do_sample=False) decoding, max_new_tokens=max_response, all val prompts in one
                     left-padded batch, scored with the same scorer; timed in val_s, outside the steps;
  peak_rss_gib       ru_maxrss of this process.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # process start, as near as a script gets: before any heavy import

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("megatron", "vllm", "ray", "transformer_engine")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model folder (with tokenizer)")
    ap.add_argument("--train", required=True, help="parquet with columns prompt, answer")
    ap.add_argument("--val", required=True, help="parquet with columns prompt, answer")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="completions per prompt (GRPO group size)")
    ap.add_argument("--max-response", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--kl", type=float, default=1e-3, help="KL loss coefficient (TRL's beta)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision (TRL's default; off: fp32)")
    ap.add_argument("--out", default=None, help="JSON results file")
    return ap.parse_args(argv)


def load_scorer():
    """hybridflow's registered "arithmetic" scorer, so both sides score identically. Importing the
    hybridflow.rewards package pulls in torch only (registry.py); checked here so the TRL side never pays for
    (or depends on) hybridflow's megatron/vLLM/Ray stack."""
    before = set(sys.modules)
    sys.path.insert(0, str(REPO))
    try:
        from hybridflow.rewards import get_scorer
    finally:
        sys.path.pop(0)
    pulled = sorted({m.split(".")[0] for m in set(sys.modules) - before} & set(HEAVY))
    if pulled:
        raise RuntimeError(f"importing hybridflow.rewards pulled {pulled}: load the scorer file directly instead")
    return get_scorer("arithmetic")


def read_parquet(path):
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["prompt", "answer"])
    return {"prompt": [str(p) for p in t.column("prompt").to_pylist()],
            "answer": [str(a) for a in t.column("answer").to_pylist()]}


def val_accuracy(model, tokenizer, val, max_response, scorer) -> tuple[float, float]:
    """Greedy accuracy over all val prompts (one left-padded batch); returns (accuracy, seconds)."""
    import torch

    t = time.perf_counter()
    was_training = model.training
    model.eval()
    enc = tokenizer(val["prompt"], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_response,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             temperature=None, top_p=None, top_k=None)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    acc = sum(scorer(x, a) for x, a in zip(texts, val["answer"])) / len(texts)
    if was_training:
        model.train()
    return acc, time.perf_counter() - t


def main(argv=None) -> int:
    a = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    torch.set_num_threads(a.threads)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    transformers.set_seed(a.seed)
    scorer = load_scorer()

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    train = Dataset.from_dict(read_parquet(a.train))
    val = read_parquet(a.val)

    val_before, val_s_before = val_accuracy(model, tokenizer, val, a.max_response, scorer)
    model.train()

    rollout_stats: list[dict] = []

    def arithmetic_reward(prompts, completions, completion_ids, answer, **kwargs):
        """TRL reward function: hybridflow's arithmetic scorer on the decoded completion (TRL decodes with
        skip_special_tokens=True, as hybridflow does). Also records the step's generated-token count."""
        scores = [float(scorer(c, ans)) for c, ans in zip(completions, answer)]
        rollout_stats.append({"tokens": int(sum(len(ids) for ids in completion_ids)),
                              "reward_mean": sum(scores) / len(scores), "completions": len(scores)})
        return scores

    completions_per_step = a.prompts * a.n
    args = GRPOConfig(
        output_dir=str(REPO / "benchmarks" / ".cache" / "trl_grpo_run"),  # nothing is saved there
        # --- devices and precision: TRL's defaults assume a GPU; hybridflow's CPU quickstart is fp32 ---
        use_cpu=True,
        bf16=a.bf16,  # --bf16: TRL's (and HF Trainer's) default mixed precision, fp32 weights
        fp16=False,
        gradient_checkpointing=False,  # hybridflow does not recompute activations
        use_vllm=False,  # TRL's vLLM path needs a GPU; generation is HF generate() on the policy itself
        # --- batch shape: one rollout of prompts*n completions feeds exactly one optimizer step (on-policy) ---
        per_device_train_batch_size=completions_per_step,  # completions, not prompts
        num_generations=a.n,  # GRPO group size (rollout.n)
        gradient_accumulation_steps=1,  # ppo_mini_batch_size = whole batch, one micro-batch
        steps_per_generation=1,  # regenerate every optimizer step
        num_iterations=1,  # ppo_epochs = 1: old log-probs == current ones, ratio is 1 at the step
        max_steps=a.steps,
        # --- sampling: rollout.temperature 1.0, top_p 1.0, top_k -1 (off) ---
        temperature=1.0,
        top_p=1.0,
        top_k=0,  # TRL's "off"
        max_completion_length=a.max_response,  # data.max_response_length
        mask_truncated_completions=False,  # hybridflow keeps truncated responses in the loss
        # --- loss: PPO-clip with KL-to-reference as a loss term ---
        beta=a.kl,  # actor.kl_loss_coef; TRL's per-token KL is the k3 estimator == low_var_kl (unclamped)
        epsilon=0.2,  # clip_ratio_low = clip_ratio_high = 0.2
        importance_sampling_level="token",
        loss_type="dapo",  # token-mean over all response tokens of the whole (single micro-)batch
        scale_rewards="group",  # (r - group mean) / (group std + eps), N-1 std, as norm_adv_by_std_in_grpo
        # --- optimizer: actor.optim = AdamW lr 1e-4, wd 0, betas (0.9, 0.999), eps 1e-8, clip_grad 1.0 ---
        learning_rate=a.lr,
        optim="adamw_torch",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        # --- data: shuffled with --seed ---
        seed=a.seed,
        data_seed=a.seed,
        shuffle_dataset=True,
        dataloader_num_workers=0,
        # --- no evaluation, checkpointing or reporting inside the timed loop ---
        eval_strategy="no",
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )

    step_s: list[float] = []
    trl_logs: list[dict] = []
    marks: dict[str, float] = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if "step0" not in marks:
                marks["step0"] = time.perf_counter()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s.append(time.perf_counter() - marks["begin"])

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "train_runtime" not in logs:
                logs_copy = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                logs_copy["step"] = state.global_step
                trl_logs.append(logs_copy)

    trainer = GRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.remove_callback(PrinterCallback)  # one summary line instead of a dict per step
    gen_cfg = trainer.generation_config.to_dict() if getattr(trainer, "generation_config", None) else {}
    trainer.train()

    val_after, val_s_after = val_accuracy(trainer.model, tokenizer, val, a.max_response, scorer)
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux

    startup_raw = marks["step0"] - T0
    train_stats = rollout_stats[: len(step_s)]
    result = {
        "framework": "trl",
        "startup_s": startup_raw - val_s_before,
        "startup_incl_val_before_s": startup_raw,
        "step_s": step_s,
        "generated_tokens": [s["tokens"] for s in train_stats],
        "reward_mean": [s["reward_mean"] for s in train_stats],
        "completions_per_step": [s["completions"] for s in train_stats],
        "peak_rss_gib": peak_rss_gib,
        "val_accuracy_before": val_before,
        "val_accuracy_after": val_after,
        "val_s": [val_s_before, val_s_after],
        "n_val": len(val["prompt"]),
        "loadavg_1m_at_end": os.getloadavg()[0],  # the machine may be shared: a high load inflates the timings
        "trl_logs": trl_logs,
        "generated_tokens_definition": "completion tokens per step over all prompts*n completions, EOS included "
                                       "when produced, padding and tokens after the first EOS excluded",
        "config": {
            "args": vars(a),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__, "python": sys.version.split()[0]},
            "torch_threads": torch.get_num_threads(),
            "grpo_config": {k: getattr(args, k) for k in (
                "per_device_train_batch_size", "num_generations", "gradient_accumulation_steps",
                "steps_per_generation", "generation_batch_size", "num_iterations", "beta", "epsilon",
                "epsilon_high", "loss_type", "scale_rewards", "importance_sampling_level", "temperature", "top_p",
                "top_k", "max_completion_length", "mask_truncated_completions", "learning_rate", "weight_decay",
                "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "lr_scheduler_type", "warmup_steps",
                "bf16", "fp16", "gradient_checkpointing", "use_vllm", "use_cpu", "seed", "optim")},
            "generation_config": {k: v for k, v in gen_cfg.items() if k in (
                "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "eos_token_id", "pad_token_id")},
        },
    }
    for k, v in result["config"]["grpo_config"].items():
        if not isinstance(v, (int, float, str, bool, type(None))):
            result["config"]["grpo_config"][k] = str(v)

    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=2))
    tail = step_s[4:] if len(step_s) > 4 else step_s
    print(f"trl {trl.__version__}: {len(step_s)} steps, startup {result['startup_s']:.1f}s, "
          f"{sum(tail) / len(tail):.3f} s/step (steps {len(step_s) - len(tail) + 1}..{len(step_s)}), "
          f"{sum(result['generated_tokens']) / max(1, len(train_stats)):.1f} gen tokens/step, "
          f"reward {sum(result['reward_mean']) / max(1, len(train_stats)):.3f}, "
          f"val acc {val_before:.3f} -> {val_after:.3f}, peak RSS {peak_rss_gib:.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
