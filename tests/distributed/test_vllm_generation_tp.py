"""vLLM with generation TP 2 over 4 training ranks: the planner's strided generation groups become vLLM's
TP groups, the hybrid transition fills them, and greedy output equals HF greedy on the same weights. And
generation TP 2 from training TP 1 x DP 2: one engine over both DP ranks, each cutting its half locally
(no bytes move), greedy equal to HF's after a sync of the initial weights and after one of an update."""

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
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
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
    rollout = VLLMRollout(hf_dir, EngineSettings(tensor_parallel_size=2), max_model_len=32, seed=0,
                          generation_groups=plan.replicas)
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


# p1 t4 -> tg2 gives the same strided vLLM groups without the stage gather; its shards are checked bit for bit
# in test_resharding.py (one vLLM case keeps the suite's time budget)
@pytest.mark.parametrize("p,t", [(2, 2)], ids=["p2t2_to_tg2"])
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


def _hf_greedy(hf_dir: str, state: dict, eos: int, pad: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if state is not None:  # None: the folder's own weights
        model.load_state_dict(state)
    with torch.no_grad():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=eos,
                               pad_token_id=pad)[0, len(prompt):].tolist() for prompt in PROMPTS]


def _dp_rank_fn(rank, world, hf_dir):
    from hybridflow.megatron import parallel
    from hybridflow.megatron.role import MegatronRole, OptimSettings, token_log_probs
    from hybridflow.resharding.plan import HybridPlan, Layout
    from hybridflow.resharding.transition import Resharder, TransitionStats
    from hybridflow.resharding.vllm_layout import to_checkpoint_names
    from hybridflow.rollout.vllm_rollout import EngineSettings, SamplingSettings, VLLMRollout
    from hybridflow.workers.common import load_hf_folder

    parallel.init_model_parallel(1, 1, seed=1)  # TP 1 x DP 2
    cfg, state = load_hf_folder(hf_dir)
    role = MegatronRole(cfg, state, optim=OptimSettings(lr=1e-3))
    with torch.no_grad():  # identical on both DP ranks, as data parallelism keeps them
        g = torch.Generator().manual_seed(100)
        for param in role.module.parameters():
            param.mul_(1 + 0.3 * torch.rand(param.shape, generator=g))
        role.module.output_layer.weight.mul_(30)  # peaked logits: greedy has no near-ties
    plan = HybridPlan(Layout(1, 1, 2), 1, 2)
    me = plan.ranks[rank]
    settings = EngineSettings(tensor_parallel_size=2, max_num_seqs=4, enable_chunked_prefill=True,
                            engine_kwargs={"max_logprobs": 3, "swap_space": None})
    rollout = VLLMRollout(hf_dir, settings, max_model_len=32, seed=plan.ranks[rank].replica,
                          generation_groups=plan.replicas)
    engine = rollout.llm.llm_engine.vllm_config
    options = (engine.scheduler_config.max_num_seqs, engine.scheduler_config.enable_chunked_prefill,
               engine.model_config.max_logprobs)
    resharder = Resharder(role.module, cfg, plan, "hybrid")
    out = {"group": me.gen_group, "k": me.gen_tp_rank, "options": options, "syncs": []}

    def sync_and_generate():
        stats = TransitionStats("hybrid")
        rollout.update_weights(to_checkpoint_names(resharder.stream(stats), cfg, k=me.gen_tp_rank, t_g=2,
                                                   stats=stats))
        tokens = rollout.generate(PROMPTS, SamplingSettings(temperature=0, max_new_tokens=6))
        hf = {k: v.clone() for k, v in role.hf_state_dict().items()}  # on rank 0 only
        local = {k: v.clone() for k, v in role.module.state_dict().items() if not k.endswith("_extra_state")}
        out["syncs"].append(dict(tokens=tokens, bytes=(stats.bytes_received, stats.bytes_sent), hf=hf, local=local))

    sync_and_generate()
    # One update on different data per DP rank: the gradient all-reduce keeps the replicas equal.
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(rank))
    mb = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.arange(10).expand(2, 10),
              labels=torch.roll(ids, -1, 1))

    def loss_fn(mb, o):
        loss = -token_log_probs(o, mb["labels"]).mean()
        return loss, {"loss": loss.detach()}

    role.train([([mb], loss_fn)])
    sync_and_generate()
    # The GPU path hands vLLM the shard as is (VLLMRollout.takes_shards): it has vLLM's own parameters'
    # names and shapes, the replicated KV head included.
    out["shard"] = {name: tuple(t.shape) for name, t in resharder.stream(TransitionStats("hybrid"))}
    out["vllm_params"] = _vllm_parameter_shapes(rollout)
    rollout.close()
    return out


def test_generation_tp_above_training_tp_matches_hf_after_each_sync(tmp_path):
    """Training TP 1 x DP 2 -> generation TP 2, with one KV head (vLLM replicates it on both ranks)."""
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(tmp_path)
    build_tiny_qwen2(tmp_path, tok, hidden_size=128, num_layers=2, num_kv_heads=1, vocab_multiple=128, seed=3)
    results = run_ranks(_dp_rank_fn, 2, str(tmp_path))
    assert [r["group"] for r in results] == [(0, 1), (0, 1)] and [r["k"] for r in results] == [0, 1]
    assert all(r["options"] == (4, True, 3) for r in results), [r["options"] for r in results]
    first, second = results[0]["syncs"]
    assert not all(torch.equal(first["hf"][k], second["hf"][k]) for k in first["hf"]), "the update changed nothing"
    for i, sync in enumerate(results[0]["syncs"]):
        other = results[1]["syncs"][i]
        assert all(torch.equal(v, other["local"][k]) for k, v in sync["local"].items()), "DP replicas diverged"
        expected = _hf_greedy(str(tmp_path), sync["hf"], tok.eos_token_id, tok.pad_token_id)
        for r in results:
            assert r["syncs"][i]["tokens"] == expected, f"sync {i}: vLLM greedy != HF greedy"
            assert r["syncs"][i]["bytes"] == (0, 0), f"sync {i}: the transition moved bytes"
    for r in results:
        assert r["shard"] == r["vllm_params"], sorted(set(r["shard"].items()) ^ set(r["vllm_params"].items()))[:4]


def test_engine_kwargs_refusals():
    from hybridflow.rollout.vllm_rollout import check_engine_kwargs

    assert check_engine_kwargs({"max_logprobs": 3, "swap_space": None}) == {"max_logprobs": 3}
    assert check_engine_kwargs(None) == {}
    assert check_engine_kwargs({"enable_expert_parallel": False}) == {"enable_expert_parallel": False}
    for key, message in [("tensor_parallel_size", "from rollout.tensor_model_parallel_size"),
                         ("max_num_seqs", "from rollout.max_num_seqs"), ("load_format", "set by hybridflow itself"),
                         ("not_an_arg", "not a vllm.LLM argument"), ("vllm", "directly under rollout.engine_kwargs"),
                         ("enable_expert_parallel", "not supported: .*split a MoE model's experts"),
                         ("quantization", "not supported: .*quantized engine")]:
        with pytest.raises(ValueError, match=f"^rollout.engine_kwargs.{key}: .*{message}"):
            check_engine_kwargs({key: 1})
