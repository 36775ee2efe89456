"""Qwen3 (QK-norm) and the MoE models (Qwen3-MoE, Qwen2-MoE, GLM-4.5) in vLLM: trained with expert parallelism 2 (TP 1
x DP 2), generated with vLLM TP 2 over the same two ranks (every rank holds every expert, sliced), greedy output
equal to HF's after the first sync and after an update's in-place reload of the experts (the transition's shards themselves are checked
bit for bit in test_moe_resharding.py)."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_vllm_generation_tp import PROMPTS, _hf_greedy

pytestmark = pytest.mark.distributed


def _rank_fn(rank, world, hf_dir, t_g=2):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, OptimSettings, token_log_probs
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.resharding.vllm_layout import to_checkpoint_names
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from hybridflow.workers.common import open_hf_folder

    parallel.init_model_parallel(1, 1, seed=1, ep=2)  # TP 1 x DP 2, experts split over the two ranks
    plan = HybridPlan(Layout(1, 1, 2), 1, t_g)
    me = plan.ranks[rank]
    # one engine per process: closing one destroys the torch.distributed world it shares
    for _ in (0,):
        cfg, weights = open_hf_folder(hf_dir)
        role = MegatronRole(cfg, weights, optim=OptimSettings(lr=1e-2))
        with torch.no_grad():  # away from the checkpoint; one seed: dense params stay equal across DP
            g = torch.Generator().manual_seed(100)
            for name, param in sorted(role.module.named_parameters()):
                param.mul_(1 + 0.3 * torch.rand(param.shape, generator=g))
            role.module.output_layer.weight.mul_(30)  # peaked logits: greedy has no near-ties
            for name, param in role.module.named_parameters():
                if name.endswith("router.weight"):  # decisive routing: no near-tie between two experts
                    param.mul_(20)
        rollout = VLLMRollout(hf_dir, EngineSettings(tensor_parallel_size=t_g), max_model_len=32, seed=0,
                              generation_groups=plan.replicas)
        resharder = Resharder(role.module, cfg, plan, "hybrid")
        syncs = []
        for step in range(2):
            stats = TransitionStats("hybrid")
            rollout.update_weights(to_checkpoint_names(resharder.stream(stats), cfg, k=me.gen_tp_rank, t_g=t_g,
                                                       stats=stats))
            tokens = rollout.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
            syncs.append(dict(tokens=tokens, hf={k: v.clone() for k, v in role.hf_state_dict().items()}))
            if step == 0:  # one update on different data per DP rank
                ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(rank))
                mb = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                          position_ids=torch.arange(10).expand(2, 10), labels=torch.roll(ids, -1, 1))

                def loss_fn(mb, o):
                    loss = -token_log_probs(o, mb["labels"]).mean()
                    return loss, {"loss": loss.detach()}

                role.train([([mb], loss_fn)])
        rollout.close()
    return syncs


# On CPU this needs the experts' prepack after every reload (patches/vllm_engine.py CPU_EXPERTS_REPACK): without
# it every MoE case here fails from the first sync.
# Qwen3 dense through vLLM: test_check_model.py (TP 2, 100% greedy agreement); Qwen2-MoE's experts take
# Qwen3-MoE's reload path (its shards: test_moe_resharding.py). One engine start costs ~20 s here.
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "gpt_oss", "deepseek_v3"])  # GLM-4.5: vLLM's float32 gate and expert bias; DeepSeek-V3: MLA
def test_vllm_greedy_equals_hf_after_each_sync(tmp_path, arch):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    tok = build_char_tokenizer(tmp_path)
    # vLLM-CPU attention needs head_dim >= 32 (Qwen3 sets its own head_dim)
    build_tiny(tmp_path, tok, arch, hidden_size=64, num_heads=2, vocab_multiple=128, seed=30)
    results = run_ranks(_rank_fn, 2, str(tmp_path))
    first, second = results[0]
    experts = [k for k in first["hf"] if ".mlp.experts." in k]
    assert not experts or not all(torch.equal(first["hf"][k], second["hf"][k]) for k in experts), (
        "the update changed no expert")
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    cfg, _ = load_hf_folder(str(tmp_path))
    for i, sync in enumerate(results[0]):
        # through a folder: transformers fuses the per-expert checkpoint tensors as it loads them
        folder = tmp_path / f"sync{i}"
        save_hf_folder(str(folder), cfg, sync["hf"])
        tok.save_pretrained(str(folder))
        expected = _hf_greedy(str(folder), None, tok.eos_token_id, tok.pad_token_id)
        for r in results:
            assert r[i]["tokens"] == expected, f"sync {i}: vLLM greedy != HF greedy {[q[i]['tokens'] for q in results]} {expected}"


def _vllm_last_log_probs(rank, world, hf_dir, seqs):
    import os

    from vllm import LLM, SamplingParams

    # in this process, as VLLMRollout runs it: an engine-core subprocess would outlive the rank (nothing shuts it
    # down), holding its KV cache for the rest of the run
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    llm = LLM(hf_dir, dtype="float32", enforce_eager=True, max_model_len=64, gpu_memory_utilization=0.1, seed=0,
              enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    return [{k: v.logprob for k, v in o.outputs[0].logprobs[0].items()} for o in outs]


def test_vllm_cpu_windowed_attention_with_sinks_on_varied_and_repeated_tokens(tmp_path):
    """gpt-oss's windowed layers with sinks in vLLM-CPU match transformers (and megatron, which matches transformers
    to 1e-7 there) on varied tokens. A known vLLM-CPU fault, measured on an AVX-512 host, is reported as an expected
    failure where it shows, so that its fix shows (then test_check_model's gpt-oss case can require HF's greedy
    tokens again): where the window holds one token repeated, the next token's log-probs are off by ~0.1 (0.11 on
    this model at lengths 15 to 33; 5e-4 with the sinks off or the window wider than the row). Its attention kernel
    is chosen by the CPU's instruction set (cpu_attn.py _get_attn_isa), so another CPU may not show it. The GPU
    kernels are other code (vLLM's FlashAttention/Triton sinks)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    build_tiny(tmp_path, build_char_tokenizer(tmp_path), "gpt_oss", vocab_multiple=128, seed=40)
    g = torch.Generator().manual_seed(1)
    varied = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (10, 17, 24)]
    seqs = varied + [s[:-4] + [28] * 4 for s in varied]
    got = run_ranks(_vllm_last_log_probs, 1, str(tmp_path), seqs)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = [torch.log_softmax(hf(torch.tensor([s])).logits[0, -1], -1) for s in seqs]
    errors = [max(abs(lp - w[k].item()) for k, lp in g_.items()) for g_, w in zip(got, want)]
    assert max(errors[:3]) < 3e-3, errors  # fp32 kernels of different order
    if max(errors[3:]) > 3e-3:
        pytest.xfail(f"vLLM-CPU's windowed attention with sinks errs on repeated tokens: {errors[3:]}")
