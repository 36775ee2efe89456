"""vLLM's TP parameter layout: reference HF->vLLM shards, and staging back into loader-shaped tensors."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.resharding.vllm_layout import (check_supported, hf_to_vllm_shard, kv_heads, slice_shard,
                                               to_checkpoint_names)


@pytest.fixture(scope="module")
def model():
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return cfg, Qwen2ForCausalLM(cfg).state_dict()


def test_fused_shard_layout(model):
    cfg, hf = model
    shard = hf_to_vllm_shard(hf, cfg, k=1, t_g=2)
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(shard["model.layers.0.self_attn.qkv_proj.weight"], torch.cat([q[32:], k[16:], v[16:]]))
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(shard["model.layers.0.mlp.gate_up_proj.weight"], torch.cat([gate[48:], up[48:]]))
    assert torch.equal(shard["model.layers.0.self_attn.o_proj.weight"], hf["model.layers.0.self_attn.o_proj.weight"][:, 32:])
    assert torch.equal(shard["model.embed_tokens.weight"], hf["model.embed_tokens.weight"][64:])


def _vllm_loader_block(cfg, name: str, shape, k: int, t_g: int) -> tuple[int, int, int]:
    """(dim, start, size) of the checkpoint tensor ``name`` that vLLM's rank k of t_g narrows out, by the
    weight loaders' own rules: QKVParallelLinear's k/v take shard ``tp_rank // num_kv_head_replicas`` of
    num_kv_heads = max(1, ng // t_g) heads (replicas = t_g // ng where t_g >= ng); the other parallel
    layers take block k of t_g."""
    ng, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    if "k_proj" in name or "v_proj" in name:
        size = max(1, ng // t_g) * hd
        return 0, (k // max(1, t_g // ng)) * size, size
    dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
    return dim, k * shape[dim] // t_g, shape[dim] // t_g


@pytest.mark.parametrize("t_g", [1, 2, 4])  # 4 > the 2 KV heads: vLLM replicates each on 2 ranks
def test_staged_checkpoint_tensors_hold_exactly_what_vllm_loads(model, t_g):
    cfg, hf = model
    for k in range(t_g):
        out = dict(to_checkpoint_names(hf_to_vllm_shard(hf, cfg, k, t_g).items(), cfg, k, t_g))
        assert set(out) == set(hf)
        for name, tensor in out.items():
            assert tensor.shape == hf[name].shape, name
            if "norm" in name:
                assert torch.equal(tensor, hf[name])
                continue
            dim, start, size = _vllm_loader_block(cfg, name, hf[name].shape, k, t_g)
            assert torch.equal(tensor.narrow(dim, start, size), hf[name].narrow(dim, start, size)), name


def test_kv_heads_follow_vllm_replication(model):
    cfg, hf = model  # 4 heads, 2 KV heads
    assert [kv_heads(cfg, k, 2) for k in range(2)] == [(0, 1), (1, 1)]
    assert [kv_heads(cfg, k, 4) for k in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # each on 2 ranks
    assert kv_heads(cfg, 0, 1) == (0, 2)
    hd = 16
    k_proj = hf["model.layers.0.self_attn.k_proj.weight"]
    for k in range(4):
        qkv = hf_to_vllm_shard(hf, cfg, k, 4)["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape[0] == (1 + 1 + 1) * hd  # one q head, one (replicated) k and v head
        assert torch.equal(qkv[hd:2 * hd], k_proj[(k // 2) * hd:(k // 2 + 1) * hd])


@pytest.mark.parametrize("t,t_g", [(1, 2), (1, 4), (2, 4), (1, 8), (2, 8), (4, 8)])
def test_slice_of_training_shard_is_the_generation_shard(t, t_g):
    """t_g a multiple of t: vLLM shard k cut from vLLM shard k // (t_g/t) of t equals the direct
    conversion, with q/kv head groups, fused gate/up, row-parallel columns and vocab rows each sliced
    on their own (and KV heads replicated where t_g exceeds them)."""
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=4, attention_bias=True)
    torch.manual_seed(1)
    hf = Qwen2ForCausalLM(cfg).state_dict()
    assert "model.layers.0.self_attn.qkv_proj.bias" in hf_to_vllm_shard(hf, cfg, 0, t_g)
    m = t_g // t
    for k in range(t_g):
        got = slice_shard(hf_to_vllm_shard(hf, cfg, k // m, t), cfg, k, t_g, t)
        expected = hf_to_vllm_shard(hf, cfg, k, t_g)
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), f"t={t} t_g={t_g} k={k}: {name}"


def test_unsupported_generation_tp(model):
    cfg, _ = model
    check_supported(cfg, 4)  # 4 heads; 2 KV heads, each replicated on 2 ranks (as vLLM does)
    with pytest.raises(ValueError, match="must divide attention heads"):
        check_supported(cfg, 8)
    with pytest.raises(ValueError, match="divide or be a multiple of KV heads"):
        check_supported(Qwen2Config(vocab_size=128, hidden_size=96, intermediate_size=96, num_attention_heads=12,
                                    num_key_value_heads=4), 6)
    with pytest.raises(ValueError, match="must divide intermediate_size"):
        check_supported(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=90, num_attention_heads=4,
                                    num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match="must be a multiple of 64 and of generation TP"):
        check_supported(Qwen2Config(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 2)


def _vllm_vocab_rows(vocab: int, k: int, t_g: int) -> tuple[int, int]:
    """The checkpoint vocab rows vLLM's rank k of t_g loads, by vLLM's own index math (weight_loader
    narrows the checkpoint tensor to [org_vocab_start_index, org_vocab_end_index))."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    padded = pad_vocab_size(vocab)  # vLLM's default padding, as Qwen2/Llama build their embedding and head
    rows = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, k, t_g)
    return rows.org_vocab_start_index, rows.org_vocab_end_index


@pytest.mark.parametrize("vocab, t_g, supported", [
    (151936, 4, True), (151936, 8, True),  # Qwen2.5 <= 3B, Qwen3: refused by the former 64 x t_g rule
    (128256, 8, True),  # Llama 3.x: also refused before at 8
    (152064, 4, True), (192, 3, True),
    (96, 2, False), (160, 2, False),  # padded by vLLM: its shards are not the even split
])
def test_vocab_rule_accepts_exactly_what_vllm_shards_like_megatron(vocab, t_g, supported):
    """Each vLLM rank loads exactly the rows our conversion hands it (hf_to_vllm_shard, which the
    resharding tests hold bit-identical to the transition's) iff the rule accepts the vocab."""
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=48, intermediate_size=48, num_hidden_layers=0,
                      num_attention_heads=24, num_key_value_heads=24)
    table = torch.arange(vocab, dtype=torch.float64)[:, None]  # row i holds i: exact at any vocab size
    hf = {"model.embed_tokens.weight": table, "lm_head.weight": table}
    matches = True
    for k in range(t_g):
        start, end = _vllm_vocab_rows(vocab, k, t_g)
        for shard in hf_to_vllm_shard(hf, cfg, k, t_g).values():
            matches &= torch.equal(shard, table[start:end])
    assert matches == supported
    if supported:
        check_supported(cfg, t_g)
    else:
        with pytest.raises(ValueError, match="must be a multiple of 64 and of generation TP"):
            check_supported(cfg, t_g)
