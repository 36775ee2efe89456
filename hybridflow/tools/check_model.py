"""``hybridflow check-model MODEL_DIR [--tp N --pp N --ep N --rollout-tp N]``: does this HF model convert?

Builds the megatron model at the given layout from the folder (gloo processes on this machine), runs a few
fixed prompts through it and through transformers, compares every decoder layer's output and the logits,
pushes the weights through the hybrid transition into vLLM at the generation TP, and prints the largest
logit difference, the greedy agreement between vLLM and transformers, and the transition's bytes per rank
against the planner's formula. Exit status: 0 when every layer agrees within the dtype's tolerance, 1 on a
mismatch (naming the first layer that differs, or that is not finite), 2 on an unsupported architecture
or layout (one line). Greedy disagreement is reported, not fatal: near-ties flip greedy tokens legitimately,
and vLLM-CPU's in-place reload of MoE experts is known to differ (tests/distributed/test_vllm_archs.py).
"""

from __future__ import annotations

import argparse
import sys

import torch

PROMPT_LEN, N_PROMPTS, NEW_TOKENS = 12, 3, 8
# fp32: other kernels (fused q/k/v, megatron's attention) than transformers', on logits of O(10): relative
# 1e-4 of the largest logit, the acceptance tolerance of the conversion tests.
REL_TOLERANCE = 1e-4


def _prompts(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, min(vocab_size, 1000), (N_PROMPTS, PROMPT_LEN), generator=g)


def _rank_fn(rank, world, model_dir, tp, pp, ep, rollout_tp, with_vllm):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.resharding.vllm_layout import to_checkpoint_names
    from hybridflow.workers.common import open_hf_folder

    parallel.init_model_parallel(tp, pp, seed=0, ep=ep, etp=1 if ep > 1 else None)
    cfg, weights = open_hf_folder(model_dir)
    role = MegatronRole(cfg, weights)
    ids = _prompts(cfg.vocab_size)
    hidden = {}
    module = role.module

    def keep(index):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            hidden[index] = out.detach().transpose(0, 1).clone()  # [s, b, h] -> [b, s, h]
        return hook

    first = role.shard.layer_range(cfg.num_hidden_layers).start
    for i, layer in enumerate(module.decoder.layers):
        layer.register_forward_hook(keep(first + i))
    mb = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(PROMPT_LEN).expand(N_PROMPTS, -1))
    outs = role.forward([mb], lambda mb, o: {"logits": o})
    logits = None
    if outs and "logits" in outs[0]:
        logits = outs[0]["logits"]
        if tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    every = [None] * world
    dist.all_gather_object(every, {"hidden": hidden, "logits": logits})
    result = {"hidden": {k: v for r in every for k, v in r["hidden"].items()},
              "logits": next(r["logits"] for r in every if r["logits"] is not None)}
    if with_vllm:
        from hybridflow.rollout.vllm_rollout import SamplingSettings, VLLMRollout

        plan = HybridPlan(Layout(pp, tp, ps.get_data_parallel_world_size()), 1, rollout_tp)
        me = plan.ranks[rank]
        rollout = VLLMRollout(model_dir, max_model_len=PROMPT_LEN + NEW_TOKENS, tensor_parallel_size=rollout_tp,
                              generation_groups=plan.replicas)
        stats = TransitionStats("hybrid")
        resharder = Resharder(module, cfg, plan, "hybrid")
        rollout.update_weights(to_checkpoint_names(resharder.stream(stats), cfg, k=me.gen_tp_rank, t_g=rollout_tp,
                                                   stats=stats))
        result["greedy"] = rollout.generate(ids.tolist(), SamplingSettings(temperature=0, max_new_tokens=NEW_TOKENS))
        result["bytes_received"] = stats.bytes_received
        rollout.close()
    return result


def _formula_bytes(state: dict, cfg, tp: int, pp: int, ep: int, rollout_tp: int) -> float:
    from hybridflow.resharding.plan import HybridPlan, Layout

    split = experts = replicated = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if ".mlp.experts." in name and ep > 1:  # exchanged by all-to-all (at EP 1 they are TP-split, in S)
            experts += n
        elif "norm" in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            replicated += n
        else:
            split += n
    plan = HybridPlan(Layout(pp, tp, ep), 1, rollout_tp)
    if experts:
        return float(plan.moe_bytes_received(split, experts, replicated, ep))
    return float(split * plan.hybrid_bytes_received() + replicated * (plan.pp_block - 1) / pp)


def check(model_dir: str, tp: int = 1, pp: int = 1, ep: int = 1, rollout_tp: int = 1, with_vllm: bool = True) -> dict:
    """The comparison as numbers (``report`` prints it); raises ValueError (one line) on an unsupported setup."""
    from transformers import AutoModelForCausalLM

    from hybridflow.megatron.model import check_architecture, check_rope_supported
    from hybridflow.resharding.vllm_layout import check_supported
    from hybridflow.spawn import run_ranks
    from hybridflow.workers.common import load_hf_folder

    cfg, state = load_hf_folder(model_dir)
    check_architecture(cfg)
    check_rope_supported(cfg)
    check_supported(cfg, rollout_tp)
    for name, size, n in (("--tp", tp, cfg.num_attention_heads), ("--pp", pp, cfg.num_hidden_layers),
                          ("--ep", ep, getattr(cfg, "num_experts", None) or ep)):
        if size < 1 or n % size:
            raise ValueError(f"{name} {size} does not divide the model's {n}")
    world = tp * pp * ep
    results = run_ranks(_rank_fn, world, model_dir, tp, pp, ep, rollout_tp, with_vllm)
    mine = results[0]
    ids = _prompts(cfg.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
    layers = []  # (name, max abs diff, scale); the last layer's HF output is only seen after the final norm
    for i in range(cfg.num_hidden_layers - 1):
        ref, got = out.hidden_states[i + 1], mine["hidden"][i]
        layers.append((f"model.layers.{i}", (got - ref).abs().max().item(), ref.abs().max().item(),
                       bool(torch.isfinite(got).all())))
    ref, got = out.logits, mine["logits"].float()
    layers.append(("logits", (got - ref).abs().max().item(), ref.abs().max().item(), bool(torch.isfinite(got).all())))
    first_bad = next((name for name, diff, scale, finite in layers
                      if not finite or not diff <= REL_TOLERANCE * max(scale, 1.0)), None)
    report = {"layers": layers, "first_mismatch": first_bad, "max_logit_diff": layers[-1][1],
              "max_logit": layers[-1][2]}
    if with_vllm:
        with torch.no_grad():
            expected = [hf.generate(ids[i:i + 1], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                    pad_token_id=0)[0, PROMPT_LEN:].tolist() for i in range(N_PROMPTS)]
        pairs = [(a, b) for r in results for got, want in zip(r["greedy"], expected) for a, b in zip(got, want)]
        report["greedy_agreement"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        report["bytes_received"] = max(r["bytes_received"] for r in results)
        report["bytes_formula"] = _formula_bytes(state, cfg, tp, pp, ep, rollout_tp)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow check-model", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--no-vllm", action="store_true", help="compare megatron with transformers only")
    args = parser.parse_args(argv)
    try:
        report = check(args.model_dir, args.tp, args.pp, args.ep, args.rollout_tp, with_vllm=not args.no_vllm)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"check-model: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"layout: tp={args.tp} pp={args.pp} ep={args.ep} -> rollout tp={args.rollout_tp}")
    for name, diff, scale, finite in report["layers"]:
        print(f"  {name:24s} max |megatron - HF| {diff:.3e} (max |HF| {scale:.3e}){'' if finite else '  NOT FINITE'}")
    print(f"max logit difference: {report['max_logit_diff']:.3e} (tolerance {REL_TOLERANCE:g} x max |logit| "
          f"{report['max_logit']:.3e})")
    if "greedy_agreement" in report:
        print(f"vLLM greedy agreement with HF: {100 * report['greedy_agreement']:.1f}% of tokens")
        print(f"transition bytes received per rank: {report['bytes_received']} (formula {report['bytes_formula']:.0f})")
    if report["first_mismatch"]:
        print(f"MISMATCH: first differing layer: {report['first_mismatch']}", file=sys.stderr)
        return 1
    print("OK: the model converts at this layout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
