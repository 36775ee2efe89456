"""`hybridflow check-model` on each new architecture (Qwen3 through vLLM at generation TP 2, Qwen3-MoE with expert
parallelism 2, Qwen2-MoE, Mistral), on a corrupted checkpoint (exit 1 naming the first differing layer) and on an
unsupported architecture (exit 2, one line)."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main

pytestmark = pytest.mark.distributed


def _build(path, arch):
    from hybridflow.models.char_tokenizer import build_char_tokenizer
    from hybridflow.models.tiny_arch import build_tiny

    build_tiny(path, build_char_tokenizer(path), arch, vocab_multiple=128, seed=40)
    return str(path)


# Each new architecture once (every layout: test_model_archs.py): Qwen3 through vLLM, Qwen3-MoE with EP 2,
# the others on one process.
@pytest.mark.parametrize("arch,args", [("qwen3", ["--tp", "2", "--rollout-tp", "2"]),
                                       ("qwen3_moe", ["--ep", "2", "--no-vllm"]),
                                       ("qwen2_moe", ["--no-vllm"]), ("mistral", ["--no-vllm"])])
def test_each_architecture_converts(tmp_path, capsys, arch, args):
    assert main(["check-model", _build(tmp_path, arch), *args]) == 0
    out = capsys.readouterr().out
    assert "OK: the model converts" in out and "max logit difference" in out
    if "--no-vllm" not in args:
        assert "vLLM greedy agreement with HF: 100.0% of tokens" in out
        assert "bytes received per rank: 0 (formula 0)" in out  # TP 2 -> TP 2: nothing moves


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
