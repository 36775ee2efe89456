"""HF export: streamed into safetensors shards with an index that transformers loads, written atomically."""

from __future__ import annotations

import json

import pytest
import torch


def test_streamed_shards_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    tok = build_char_tokenizer(tmp_path / "src")
    build_tiny_qwen2(tmp_path / "src", tok, hidden_size=64, num_layers=2, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "src"))
    consumed = []

    def stream():  # a generator, consumed as produced: the exporter never sees the whole dict
        for item in state.items():
            consumed.append(item[0])
            yield item

    save_hf_folder(str(tmp_path / "out"), cfg, stream(), tok, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(state) == set(consumed)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    loaded = model.state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temp dir left


def test_failed_export_keeps_the_previous_folder(tmp_path):
    from hybridflow.models.tiny_qwen2 import build_tiny_qwen2
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    build_tiny_qwen2(tmp_path / "m", build_char_tokenizer(tmp_path / "m"), hidden_size=64, num_layers=1, seed=1)
    cfg, state = load_hf_folder(str(tmp_path / "m"))
    save_hf_folder(str(tmp_path / "out"), cfg, state)

    def broken():
        yield next(iter(state.items()))
        raise RuntimeError("rank died mid-export")

    with pytest.raises(RuntimeError, match="mid-export"):
        save_hf_folder(str(tmp_path / "out"), cfg, broken())
    _, again = load_hf_folder(str(tmp_path / "out"))
    assert set(again) == set(state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]
