"""vLLM's TP parameter layout: reference HF->vLLM shards, and staging back into loader-shaped tensors."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.resharding.vllm_layout import check_supported, hf_to_vllm_shard, to_checkpoint_names


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


@pytest.mark.parametrize("t_g", [1, 2])
def test_staged_checkpoint_tensors_hold_exactly_block_k(model, t_g):
    cfg, hf = model
    for k in range(t_g):
        out = dict(to_checkpoint_names(hf_to_vllm_shard(hf, cfg, k, t_g).items(), cfg, k, t_g))
        assert set(out) == set(hf)
        for name, tensor in out.items():
            assert tensor.shape == hf[name].shape, name
            if "norm" in name:
                assert torch.equal(tensor, hf[name])
                continue
            dim = 1 if ("o_proj" in name or "down_proj" in name) else 0
            size = hf[name].shape[dim] // t_g
            assert torch.equal(tensor.narrow(dim, k * size, size), hf[name].narrow(dim, k * size, size)), name


def test_unsupported_generation_tp(model):
    cfg, _ = model
    with pytest.raises(ValueError, match="must divide attention heads"):
        check_supported(cfg, 4)
    with pytest.raises(ValueError, match="multiple of 64 x generation TP"):
        check_supported(Qwen2Config(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2), 2)
