"""Lazy safetensors reading: a rank reads only its stage's tensors and its TP chunks of them, and builds
exactly what conversion from the whole state dict builds."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.megatron.convert import Shard, hf_to_megatron
from hybridflow.megatron.hf_weights import HFWeights
from hybridflow.workers.common import load_hf_folder, open_hf_folder


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def folder(request, tmp_path):
    """A tiny Qwen2 (qkv bias, 2 query groups, 4 layers) saved as two safetensors files."""
    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=request.param)
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in Qwen2ForCausalLM(cfg).state_dict().items()}
    if request.param:
        state.pop("lm_head.weight", None)
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    cfg.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("tp_rank,pp_rank", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_a_pp2_tp2_rank_reads_only_its_chunks_and_builds_the_same_shard(folder, tp_rank, pp_rank):
    cfg, full = load_hf_folder(str(folder))
    shard = Shard(tp_rank, 2, pp_rank, 2)
    eager = hf_to_megatron(full, cfg, shard)
    weights = HFWeights(str(folder))
    lazy = hf_to_megatron(weights, cfg, shard)
    assert set(lazy) == set(eager)
    for k, v in eager.items():
        assert lazy[k].dtype == v.dtype and torch.equal(lazy[k], v), k
    # Every byte read lands in the rank's shard once: nothing of the other stage, no other TP chunk.
    assert weights.bytes_read == sum(_nbytes(v) for v in lazy.values())
    total = sum(_nbytes(v) for v in full.values())
    assert weights.bytes_read < total / 3  # a quarter of the split tensors, half of the norms


def test_nothing_is_read_until_asked_for(folder):
    cfg, weights = open_hf_folder(str(folder))
    assert weights.bytes_read == 0
    assert "model.norm.weight" in weights and "model.nope" not in weights and weights.bytes_read == 0
    assert set(weights) == set(load_hf_folder(str(folder))[1]) and len(weights) == len(list(weights))
    assert torch.equal(weights.chunk("model.layers.0.self_attn.o_proj.weight", 1, 2, 1),
                       torch.chunk(weights["model.layers.0.self_attn.o_proj.weight"], 2, dim=1)[1])


def test_a_folder_without_weights_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors weights in model folder {tmp_path}"):
        open_hf_folder(str(tmp_path))
