"""FP8 block-quantized and MXFP4 checkpoints (megatron/quantized.py) read as their training dtype: the dequantization
is transformers' own, a folder made from a tiny model reads within the quantization error of the original, preflight
accepts its scale (and block) tensors, an export of it says nothing of quantization, and a quantization not read
here is one line. Megatron and vLLM on such a folder: tests/distributed/test_check_model.py."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.megatron.quantized import dequantize_fp8, quantization_of
from hybridflow.models.fp8_checkpoint import quantize_fp8, write_fp8_checkpoint


def test_dequantization_is_transformers():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8(w, (32, 32))
    ours = dequantize_fp8(q, s, (32, 32))
    assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32))
    # a grid rounded up (100 x 70 in 32 x 32 blocks), which transformers' refuses: still within e4m3's rounding
    w = torch.randn(100, 70, generator=torch.Generator().manual_seed(1))
    q, s = quantize_fp8(w, (32, 32))
    assert s.shape == (4, 3) and (dequantize_fp8(q, s, (32, 32)) - w).abs().max() <= w.abs().max() / 16
    with pytest.raises(ValueError, match=r"x_scale_inv has shape \[4, 3\], but x \[100, 70\] in blocks of \[64, 64\]"):
        dequantize_fp8(q, s, (64, 64), "x")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    root = tmp_path_factory.mktemp("fp8")
    build_tiny(root / "base", build_char_tokenizer(root / "base"), "qwen3", seed=3)
    write_fp8_checkpoint(root / "base", root / "fp8", block=(32, 32))
    return root / "base", root / "fp8"


def test_an_fp8_folder_reads_within_the_quantization_error(folders):
    from hybridflow.workers.common import load_hf_folder

    (_, original), (cfg, read) = load_hf_folder(str(folders[0])), load_hf_folder(str(folders[1]))
    assert quantization_of(cfg)["weight_block_size"] == [32, 32]
    assert set(read) == set(original)  # the scales are not names of their own
    quantized = [n for n in read if not torch.equal(read[n], original[n])]
    assert len(quantized) == 7 * cfg.num_hidden_layers  # q, k, v, o, gate, up, down of each layer
    for name in quantized:  # e4m3 keeps 3 mantissa bits: within 1/16 of the largest in each block
        assert read[name].dtype == torch.float32
        assert (read[name] - original[name]).abs().max() <= original[name].abs().max() / 16, name


def test_preflight_reads_the_scales_and_an_export_is_unquantized(folders, tmp_path):
    from transformers import AutoConfig

    from hybridflow.trainer.model_files import check_weight_shapes
    from hybridflow.workers.common import load_hf_folder
    from hybridflow.workers.export import save_hf_folder

    cfg = AutoConfig.from_pretrained(str(folders[1]))
    check_weight_shapes(str(folders[1]), cfg)  # each *_scale_inv beside a declared weight is read with it
    _, read = load_hf_folder(str(folders[1]))
    save_hf_folder(str(tmp_path / "export"), cfg, read)
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())
    assert getattr(cfg, "quantization_config", None) is not None  # the run's own config is left as it was


def test_a_quantization_not_read_here_is_one_line(folders, tmp_path):
    from transformers import AutoConfig

    config = json.loads((folders[1] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config: quant_method 'awq' with weight_block_size None is not"):
        quantization_of(AutoConfig.from_pretrained(str(tmp_path)))


@pytest.fixture(scope="module")
def mxfp4_folders(tmp_path_factory):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.mxfp4_checkpoint import write_mxfp4_checkpoint
    from hybridflow.models.tiny_arch import build_tiny

    root = tmp_path_factory.mktemp("mxfp4")
    build_tiny(root / "base", build_char_tokenizer(root / "base"), "gpt_oss", seed=3)
    write_mxfp4_checkpoint(root / "base", root / "mxfp4")
    return root / "base", root / "mxfp4"


def test_an_mxfp4_folder_reads_within_the_quantization_error(mxfp4_folders):
    """gpt-oss's fused experts, each expert's slice read from transformers' dequantization of its blocks: within
    half of E2M1's widest step (2, between 4 and 6) at each group's power-of-two scale of the original, every other
    tensor as written. Preflight reads the blocks and scales as the expert tensors' storage; an export is the
    dequantized bf16 layout, unquantized."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from hybridflow.trainer.model_files import check_weight_shapes
    from hybridflow.workers.common import load_hf_folder

    (_, original), (cfg, read) = load_hf_folder(str(mxfp4_folders[0])), load_hf_folder(str(mxfp4_folders[1]))
    assert quantization_of(cfg)["quant_method"] == "mxfp4" and set(read) == set(original)
    with safe_open(str(mxfp4_folders[1] / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in f.keys()
    quantized = [n for n in read if not torch.equal(read[n], original[n])]
    assert {n.rsplit(".", 1)[1] for n in quantized} == {"gate_up_proj", "down_proj"}
    assert len(quantized) == 2 * 8 * cfg.num_hidden_layers  # both of each of the 8 experts of every layer
    for name in quantized:
        w = original[name]  # [in, out]: a group is 32 consecutive inputs of one output
        scale = torch.exp2(torch.ceil(torch.log2(w.abs().reshape(-1, 32, w.shape[1]).amax(1) / 6)))
        err = (read[name] - w).abs().reshape(-1, 32, w.shape[1]).amax(1)
        assert (err <= scale).all(), name
    check_weight_shapes(str(mxfp4_folders[1]), AutoConfig.from_pretrained(str(mxfp4_folders[1])))


def test_mxfp4_blocks_without_scales_are_one_line(mxfp4_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    from hybridflow.workers.common import open_hf_folder

    tensors = load_file(str(mxfp4_folders[1] / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((mxfp4_folders[1] / "config.json").read_text())
    with pytest.raises(ValueError, match="the checkpoint holds model.layers.1.mlp.experts.down_proj_blocks without "
                                         "model.layers.1.mlp.experts.down_proj_scales"):
        open_hf_folder(str(tmp_path))
