"""LoRA on megatron-core (megatron/lora.py) against peft on the Hugging Face model, at TP 1, TP 2 with sequence
parallel, PP 2, and TP 1 with full activation recompute: the same adapters (peft's, with the fused projections' A
shared: Megatron-Bridge's lora) give the same response log-probs and, after one on-policy PPO update, the same adapter
gradients (the fused A's gradient is the sum of its projections'); the frozen base gets no gradient and no optimizer
state; with the adapters disabled the model is the base model (the reference for free); the merged weights (what vLLM
and export read) are transformers' model with peft's adapters merged; the updated adapters written in peft's format
load with peft and give the trainer's log-probs. A LoRA checkpoint holds the adapters only and resumes at any layout."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.batched import batched_worlds, one_case
from tests.distributed.test_layouts import P, R, rollout_batch
from tests.numerics import assert_close

pytestmark = pytest.mark.distributed

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)]  # (t, p, recompute)
IDS = ["tp1", "tp2_sp", "pp2", "tp1_recompute"]
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
RANK, ALPHA = 4, 8.0
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARED_A = (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj"))  # (takes, from)


def on_policy_batch():
    """``rollout_batch`` without old log-probs: the update is on-policy (ratio 1, gradient -A grad log p / N)."""
    t = rollout_batch().tensors
    return type(rollout_batch()).from_dict(tensors={k: t[k] for k in (
        "input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages")})


def _settings():
    from hybridflow.config.model import LORA_TARGETS
    from hybridflow.config.schema import Actor, Optim
    from hybridflow.megatron.lora import LoRASettings

    actor = Actor(optim=Optim(lr=1e-3), ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2)
    lora = LoRASettings(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=LORA_TARGETS, exclude_modules=(),
                        a_init="xavier", b_init="zero", seed=0)
    return actor, lora


def _gathered(actor, tp, grads: bool):
    """{local adapter parameter name: TP-gathered gradient (or value)} of this stage, on TP rank 0 (None elsewhere)."""
    from megatron.core import parallel_state as ps

    out = {}
    for name, p in actor.module.named_parameters():
        if ".adapter.lora_" not in name:
            continue
        g = (p.main_grad if grads else p).detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            torch.distributed.all_gather(parts, g, group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, p.partition_dim)
        out[name] = g
    return out if ps.get_tensor_model_parallel_rank() == 0 else None


def _rank_fn(rank, world, root, tp, pp, recompute):
    from hybridflow.megatron import lora, lora_peft, parallel
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(tp, pp, seed=1)
    cfg, state = load_hf_folder(f"{root}/base")
    actor_cfg, settings = _settings()
    build = ModelBuild(sequence_parallel=tp > 1, lora_settings=settings,
                       transformer_overrides=RECOMPUTE if recompute else None)
    actor = MegatronRole(cfg, state, build, optim=OptimSettings(lr=1e-3, clip_grad=0.0))
    found = lora.adapters(actor.module)
    lora_peft.load(actor.module, lora_peft.from_peft(torch.load(f"{root}/adapter.pt"), cfg, actor.shard, set(found)))
    batch = on_policy_batch()
    out = {"collect": parallel.dispatch_info()["collect"], "rank": rank}
    out["log_probs"] = role_ops.log_probs(actor, batch, 2)["log_probs"]
    with lora.disabled(actor.module):
        out["base_log_probs"] = role_ops.log_probs(actor, batch, 2)["log_probs"]
    merged = {k: v.clone() for k, v in actor.hf_state_dict().items()}  # before the update: peft's adapters merged
    role_ops.update_policy(actor, batch, actor_cfg, 1)
    grads = _gathered(actor, tp, grads=True)
    out["peft_grads"] = None if grads is None else lora_peft.to_peft(grads, cfg, actor.shard)
    # the updated adapters in peft's format, whole on every rank (as vLLM's LoRA takes them), and the trainer's
    # log-probs under them
    out["peft_adapters"] = lora_peft.gathered(actor.module, cfg, actor.shard)
    out["updated_log_probs"] = role_ops.log_probs(actor, batch, 2)["log_probs"]
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    out["optimizer_params"] = len(optimized)
    out["adapter_params"] = 2 * len(found)
    out["frozen_with_grad"] = [n for n, p in actor.module.named_parameters() if ".adapter." not in n and (
        p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None)]
    if rank == 0:
        out["merged"] = merged
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny Qwen2 and peft adapters on it (random A and B, the fused projections' A shared), saved as peft's
    state dict; peft's response log-probs and adapter gradients under the on-policy loss."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2

    root = tmp_path_factory.mktemp("lora")
    tok = build_char_tokenizer(root / "base")
    build_tiny_qwen2(root / "base", tok, hidden_size=64, num_layers=2, seed=5)
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS,
                                                  lora_dropout=0.0, init_lora_weights=False))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        params = dict(peft_model.named_parameters())
        for name, p in params.items():
            for takes, source in SHARED_A:
                if f".{takes}.lora_A." in name:
                    p.copy_(params[name.replace(takes, source)])
    torch.save(get_peft_model_state_dict(peft_model), root / "adapter.pt")

    t = on_policy_batch().tensors
    valid = t["response_mask"].bool()

    def log_probs():
        logits = peft_model(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                            position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
        return torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, P:, None])[..., 0]

    lp = log_probs()
    with peft_model.disable_adapter(), torch.no_grad():
        base = log_probs()
    loss = -(t["advantages"] * torch.exp(lp - lp.detach()))[valid].sum() / valid.sum()  # token-mean, ratio 1
    loss.backward()
    from hybridflow.megatron.lora_peft import peft_names

    grads = peft_names({n: p.grad for n, p in peft_model.named_parameters() if ".lora_" in n})
    merged_model = peft_model.merge_and_unload()
    torch.save(dict(log_probs=lp.detach(), base=base, grads=grads,
                    merged={k: v.clone() for k, v in merged_model.state_dict().items()}), root / "peft.pt")
    return str(root)


@pytest.fixture(scope="module")
def results(root):
    return batched_worlds(one_case, {i: (t * p, (_rank_fn, root, t, p, r)) for i, (t, p, r) in zip(IDS, LAYOUTS)})


def _fused_a_grads(peft_grads: dict) -> dict:
    """peft's gradients with each fused linear's shared A holding the sum of its projections' (megatron's)."""
    out = dict(peft_grads)
    for takes, source in SHARED_A:
        for name in list(out):
            if f".{source}.lora_A." in name:
                out[name] = out[name] + peft_grads[name.replace(source, takes)]
    for takes, source in SHARED_A:
        for name in list(out):
            if f".{takes}.lora_A." in name:
                out[name] = out[name.replace(takes, source)]
    return out


@pytest.mark.parametrize("case", IDS)
def test_lora_equals_peft_forward_gradients_and_merge(root, results, case):
    ref = torch.load(f"{root}/peft.pt")
    res = results(case)
    valid = on_policy_batch().tensors["response_mask"].bool()
    last = next(r for r in res if r["collect"])
    # megatron's fused q/k/v and its attention vs transformers': 10x the same-kernel tolerance (test_layouts)
    assert_close(last["log_probs"][valid], ref["log_probs"][valid], slack=10, what=f"{case} LoRA log-probs vs peft")
    assert_close(last["base_log_probs"][valid], ref["base"][valid], slack=10, what=f"{case} adapters off vs base")
    assert (last["log_probs"] - last["base_log_probs"])[valid].abs().max() > 1e-3, "the adapters change nothing"
    grads = {}
    for r in res:
        grads.update(r["peft_grads"] or {})
    want = _fused_a_grads(ref["grads"])
    assert set(grads) == set(want), sorted(set(grads) ^ set(want))[:4]
    # a backward through both models and a reduction over ranks
    assert_close(grads, want, slack=20, what=f"{case} adapter gradients vs peft")
    merged = res[0]["merged"]
    assert_close({k: merged[k] for k in ref["merged"]}, ref["merged"], what=f"{case} merged weights vs peft's merge")
    # the updated adapters written as peft's adapter folder (hybridflow export) load with peft and give the
    # trainer's log-probs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.megatron.lora_peft import adapter_config
    from hybridflow.workers.export import save_peft_folder

    tensors = res[0]["peft_adapters"]  # every stage's, gathered over TP and PP
    for r in res[1:]:
        assert r["peft_adapters"].keys() == tensors.keys()
        assert all(torch.equal(r["peft_adapters"][k], v) for k, v in tensors.items()), f"{case}: ranks differ"
    folder = f"{root}/exported_{case}"
    save_peft_folder(folder, tensors, adapter_config(tensors, RANK, ALPHA, 0.0, f"{root}/base"))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(f"{root}/base", dtype=torch.float32),
                                       folder).eval()
    t = on_policy_batch().tensors
    with torch.no_grad():
        logits = loaded(input_ids=t["input_ids"], attention_mask=t["attention_mask"],
                        position_ids=t["position_ids"]).logits[:, P - 1:P - 1 + R]
    exported = torch.log_softmax(logits, -1).gather(-1, t["input_ids"][:, P:, None])[..., 0]
    assert_close(last["updated_log_probs"][valid], exported[valid], slack=10, what=f"{case} exported adapter vs trainer")
    assert (last["updated_log_probs"] - last["log_probs"])[valid].abs().max() > 1e-4, "the update moved nothing"
    for r in res:
        assert r["frozen_with_grad"] == [], f"{case}: base parameters with gradients {r['frozen_with_grad'][:3]}"
        assert r["optimizer_params"] == r["adapter_params"], f"{case}: the optimizer holds more than the adapters"


def _checkpoint_rank_fn(rank, world, root, ckpt, save):
    """save: two LoRA updates, a checkpoint after the first; else: load it (any layout), then the second update."""
    from hybridflow.megatron import parallel
    from hybridflow.megatron.checkpoint import load_role, save_role
    from hybridflow.megatron.role import MegatronRole, ModelBuild, OptimSettings
    from hybridflow.workers import role_ops
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(world, 1, seed=1)
    cfg, state = load_hf_folder(f"{root}/base")
    actor_cfg, settings = _settings()
    actor = MegatronRole(cfg, state, ModelBuild(sequence_parallel=world > 1, lora_settings=settings),
                         optim=OptimSettings(lr=1e-2))
    batch = on_policy_batch()
    if save:
        role_ops.update_policy(actor, batch, actor_cfg, 1)
        save_role(actor, ckpt)
    else:
        load_role(actor, ckpt)
    metrics = role_ops.update_policy(actor, batch, actor_cfg, 1)
    return {"metrics": metrics, "merged": actor.hf_state_dict()}


def test_lora_checkpoint_holds_the_adapters_and_resumes_at_any_layout(root, tmp_path):
    """The checkpoint holds the adapters (and their optimizer state) only; resuming at the saved layout (TP 2
    with sequence parallel: the split factors sharded, the whole ones replicated) is bit-exact, at TP 1 exact up to
    fp32 rounding."""
    from megatron.core import dist_checkpointing

    from hybridflow.spawn import run_ranks

    ckpt = str(tmp_path / "actor")
    straight = run_ranks(_checkpoint_rank_fn, 2, root, ckpt, True)[0]
    saved = [k for k in dist_checkpointing.load_tensors_metadata(ckpt) if not k.startswith("optimizer.")]
    assert saved and all(".adapter.lora_" in k for k in saved), saved[:5]
    same = run_ranks(_checkpoint_rank_fn, 2, root, ckpt, False)[0]
    for k, v in straight["merged"].items():
        assert torch.equal(v, same["merged"][k]), f"TP2 -> TP2: {k} differs after the resumed update"
    assert straight["metrics"] == same["metrics"]
    other = run_ranks(_checkpoint_rank_fn, 1, root, ckpt, False)[0]
    assert_close(other["merged"], straight["merged"], what="TP2 -> TP1: merged weights after the resumed update")
    from hybridflow.workers.common import load_hf_folder

    _, base = load_hf_folder(f"{root}/base")
    assert max((straight["merged"][k] - base[k]).abs().max() for k in base) > 1e-4, "the adapters did not move"
