"""`hybridflow check-model` on each new architecture (Qwen3 from TP 2 through vLLM at generation TP 2, virtual pipeline
stages, Qwen3-MoE with expert parallelism 2, with grouped-GEMM experts too, Qwen2-MoE, GLM-4.5 at PP 2 through vLLM
at TP 2, gpt-oss from MXFP4 at EP 2, Mistral), each in a world of two ranks at most (the layouts of each architecture,
worlds of four included: test_model_archs.py; context parallelism: test_layouts.py), on a corrupted checkpoint (exit 1 naming the
first differing layer), on an unsupported architecture (exit 2, one line) and on a model vLLM-CPU cannot run (the
megatron verdict, then exit 2 naming why in one line). Unreadable weights and other cheap refusals:
tests/unit/test_check_model_cli.py."""

from __future__ import annotations

import json
import re

import pytest

from hybridflow.cli import main

pytestmark = pytest.mark.distributed


def _build(path, arch):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    build_tiny(path, build_char_tokenizer(path), arch, vocab_multiple=128, seed=40)
    return str(path)


# Each new architecture once (every layout: test_model_archs.py): Qwen3 at TP 2 through vLLM at TP 2, Qwen3-MoE with
# EP 2, the others on one process.
@pytest.mark.parametrize("arch,args", [("qwen3", ["--tp", "2", "--rollout-tp", "2"]),
                                       ("qwen3_moe", ["--ep", "2", "--no-vllm"]),
                                       ("qwen2_moe", ["--no-vllm"]),
                                       # MLA without a q latent (its q projection split by heads), default RoPE
                                       ("moonlight", ["--tp", "2", "--no-vllm"]),
                                       # dense first stage, MoE second: the stages' bytes differ
                                       ("glm4_moe", ["--pp", "2", "--rollout-tp", "2"]),
                                       # grouped-GEMM experts (bf16 here) through the transition into vLLM
                                       ("qwen3_moe", ["--ep", "2", "--grouped-gemm", "--rollout-tp", "2"])])
def test_each_architecture_converts(tmp_path, capsys, arch, args):
    assert main(["check-model", _build(tmp_path, arch), *args]) == 0
    out = capsys.readouterr().out
    assert "OK: the model converts" in out and "max logit difference" in out
    if "--grouped-gemm" in args:  # bf16 experts: greedy may flip on near-ties; the shards still arrive whole
        assert "vLLM greedy agreement with HF" in out
        assert "bytes received per rank: 98304 (formula 98304)" in out  # bf16: the experts' all-to-all
    elif "--no-vllm" not in args:
        assert "vLLM greedy agreement with HF: 100.0% of tokens" in out
        moved, formula = re.search(r"bytes received per rank: (\d+) \(formula (\d+)\)", out).groups()
        assert moved == formula and (moved == "0") == (arch == "qwen3")  # TP 2 -> TP 2: nothing moves


def test_virtual_pipeline_stages_convert_and_reach_vllm(tmp_path, capsys):
    """Two stages of two virtual stages (4 layers: stage s holds layers s and 2 + s) through the interleaved
    schedule, then the pipeline gather into vLLM: its bytes are the formula's, the final norm whole to stage 0."""
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    build_tiny(tmp_path, build_char_tokenizer(tmp_path), "qwen3", num_layers=4, vocab_multiple=128, seed=41)
    assert main(["check-model", str(tmp_path), "--pp", "2", "--vpp", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: the model converts" in out and "layout: tp=1 pp=2 vpp=2" in out
    assert "vLLM greedy agreement with HF: 100.0% of tokens" in out
    bytes_line = next(line for line in out.splitlines() if "bytes received per rank" in line)
    got, formula = bytes_line.split(": ")[1].split(" (formula ")
    assert int(got) == int(formula.rstrip(")")) > 0, bytes_line


def test_an_fp8_checkpoint_converts_and_reaches_vllm_unquantized(tmp_path, capsys):
    """An FP8 block-quantized Qwen3 made here from the tiny one (megatron/quantized.py): megatron equals transformers
    on the dequantized tensors, and vLLM, built without the folder's quantization_config, generates HF's greedy
    tokens after the sync."""
    from hybridflow.models.fp8_checkpoint import write_fp8_checkpoint

    write_fp8_checkpoint(_build(tmp_path / "base", "qwen3"), tmp_path / "fp8", block=(32, 32))
    assert main(["check-model", str(tmp_path / "fp8")]) == 0
    out = capsys.readouterr().out
    assert "OK: the model converts" in out and "vLLM greedy agreement with HF: 100.0% of tokens" in out


def test_gpt_oss_from_mxfp4_converts_and_reaches_vllm_unquantized(tmp_path, capsys):
    """gpt-oss (sinks, windows, YaRN, biased experts fused in the checkpoint) as an MXFP4 checkpoint made here from the
    tiny one (its fused experts as blocks and scales, as openai's checkpoints) at EP 2: megatron equals
    transformers on the dequantized experts, and vLLM at TP 2, built without the quantization, gets the trainer's
    weights, the bytes the formula's. Its greedy agreement is reported only: vLLM-CPU's windowed attention with sinks
    errs on repeated tokens (test_vllm_archs.py), which the tiny model's generations are."""
    from hybridflow.models.mxfp4_checkpoint import write_mxfp4_checkpoint

    write_mxfp4_checkpoint(_build(tmp_path / "base", "gpt_oss"), tmp_path / "mxfp4")
    assert main(["check-model", str(tmp_path / "mxfp4"), "--ep", "2", "--rollout-tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "OK: the model converts" in out and "vLLM greedy agreement with HF" in out
    moved, formula = re.search(r"bytes received per rank: (\d+) \(formula (\d+)\)", out).groups()
    assert moved == formula != "0"


def test_a_corrupted_checkpoint_names_the_first_differing_layer(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    folder = _build(tmp_path, "qwen3")
    weights = load_file(f"{folder}/model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, f"{folder}/model.safetensors", metadata={"format": "pt"})
    assert main(["check-model", folder, "--no-vllm"]) == 1
    captured = capsys.readouterr()
    assert "first differing layer: model.layers.0" in captured.err
    assert "NOT FINITE" in captured.out


def test_an_unsupported_architecture_is_one_line(tmp_path, capsys):
    folder = _build(tmp_path, "qwen3")
    capsys.readouterr()  # the build's progress bars
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["check-model", folder]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and "GPTNeoXForCausalLM is not supported" in err[0], err


def test_a_model_vllm_cpu_cannot_run_keeps_the_megatron_verdict(tmp_path, capfd):
    """Mistral's tiny head_dim (64 / 4 heads = 16) has no vLLM-CPU attention kernel: megatron == HF is still
    checked and printed, then one line names what vLLM cannot run (exit 2), with no traceback and none of
    megatron's "Transformer Engine and Apex are not installed" warnings (capfd: the rank processes' stderr too)."""
    folder = _build(tmp_path, "mistral")
    capfd.readouterr()  # the build's progress bars
    assert main(["check-model", folder]) == 2
    captured = capfd.readouterr()
    assert "OK: the model converts" in captured.out and "max logit difference" in captured.out
    err = captured.err.strip().splitlines()
    assert err == [err[0]] and "head_dim is 16" in err[0] and err[0].startswith("check-model: the vLLM leg"), err
