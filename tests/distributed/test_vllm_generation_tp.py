"""vLLM with generation TP 2 over 4 training ranks: the planner's strided generation groups become vLLM's
TP groups, the hybrid transition fills them, and greedy output equals HF greedy on the same weights."""

from __future__ import annotations

import pytest
import torch

from hybridflow.spawn import run_ranks

pytestmark = pytest.mark.distributed
PROMPTS = [[22, 17, 21, 6], [22, 17, 30, 8, 13, 6]]


def _rank_fn(rank, world, hf_dir, p, t):
    from megatron.core import parallel_state as ps

    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.vllm_layout import to_checkpoint_names
    from hybridflow.rollout.vllm_rollout import SamplingSettings, VLLMRollout
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(t, p, seed=1)
    cfg, state = load_hf_folder(hf_dir)
    role = MegatronRole(cfg, state)
    with torch.no_grad():  # move the weights away from the checkpoint vLLM starts from
        # One seed on every rank: TP ranks of a stage hold equally shaped shards, so the norms that
        # megatron replicates across TP get identical noise, as training would keep them.
        g = torch.Generator().manual_seed(100)
        for param in role.module.parameters():
            param.mul_(1 + 0.3 * torch.rand(param.shape, generator=g))
        if hasattr(role.module, "output_layer"):  # last stage: peaked logits, so greedy has no near-ties
            role.module.output_layer.weight.mul_(30)
    train = Layout(p, t, ps.get_data_parallel_world_size())
    plan = HybridPlan(train, 1, 2)
    me = plan.ranks[rank]
    rollout = VLLMRollout(hf_dir, max_model_len=32, tensor_parallel_size=2, seed=0, generation_groups=plan.replicas)
    resharder = Resharder(role.module, cfg, plan, "hybrid")
    stats = TransitionStats("hybrid")
    rollout.update_weights(to_checkpoint_names(resharder.stream(stats), cfg, k=me.gen_tp_rank, t_g=2, stats=stats))
    out = rollout.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
    hf = {k: v.clone() for k, v in role.hf_state_dict().items()}
    shard = {name: tuple(t.shape) for name, t in resharder.stream(TransitionStats("hybrid"))}
    prefix = rollout._shm_prefix
    params = _vllm_parameter_shapes(rollout)
    rollout.close()
    return {"tokens": out, "hf": hf if rank == 0 else None, "group": me.gen_group, "shm": prefix,
            "shard": shard, "vllm_params": params, "staging_bytes": stats.staging_bytes}


def _vllm_parameter_shapes(rollout) -> dict:
    """{name: shape} of the engine's parameters in vLLM's model format, as its loader built them: vLLM
    records them for in-place reloads before any backend repacking (reload/layerwise.py), all but the
    biases (reload/meta.py, SKIP_TENSORS), which no backend repacks."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    model = rollout._worker().model_runner.get_model()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters() if name.endswith(".bias")}
    for prefix, module in model.named_modules():
        params, _ = get_layerwise_info(module).restore_metadata
        shapes.update({f"{prefix}.{name}" if prefix else name: tuple(t.shape) for name, t in params.items()})
    return shapes


@pytest.mark.parametrize("p,t", [(1, 4), (2, 2)], ids=["p1t4_to_tg2", "p2t2_to_tg2"])
def test_strided_generation_tp_matches_hf(tmp_path, p, t):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, num_kv_heads=4, vocab_multiple=128, seed=3)
    results = run_ranks(_rank_fn, 4, str(tmp_path), p, t)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model.load_state_dict(results[0]["hf"])
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            g = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            expected.append(g[0, len(prompt):].tolist())
    assert len({r["group"] for r in results}) == 2
    for r in results:
        assert r["tokens"] == expected, f"generation group {r['group']}"
    for r in results:
        # The shard the GPU path hands vLLM as is (VLLMRollout.takes_shards) has exactly the names and
        # shapes of vLLM's own parameters on that rank.
        assert r["shard"] == r["vllm_params"], sorted(set(r["shard"].items()) ^ set(r["vllm_params"].items()))[:4]
        # The CPU path stages checkpoint-shaped tensors, one at a time: counted at the largest, a whole
        # checkpoint tensor.
        assert r["staging_bytes"] == max(v.numel() * v.element_size() for v in results[0]["hf"].values())
    # vLLM's TP communicator segments carry this engine's own prefix and are gone after close()
    assert len({r["shm"] for r in results}) == 1
    import os

    assert not [f for f in os.listdir("/dev/shm") if f.startswith(results[0]["shm"])]
