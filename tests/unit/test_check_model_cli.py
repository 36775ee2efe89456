"""`hybridflow check-model`'s cheap parts: what fails before any model is built (unreadable weights, a layout
with more ranks than this host's GPUs, a head size vLLM-CPU has no kernel for), the engine woken before the
sync, and third-party start-up warnings kept out of its output."""

from __future__ import annotations

import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from hybridflow.tools import check_model
from hybridflow.tools.check_model import check_ranks_fit, quiet_third_party, sync_and_generate, vllm_cannot_run


def test_third_party_start_up_warnings_are_filtered_here_and_in_spawned_processes():
    code = ("import warnings\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
            "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
            "warnings.warn('a deprecation', FutureWarning)\n"
            "warnings.warn('the model is odd')\n")
    with quiet_third_party():
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "the model is odd" in child.stderr  # anything else still shows
    for hidden in ("Transformer Engine", "Apex is not", "deprecation"):
        assert hidden not in child.stderr, child.stderr
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Transformer Engine" in after.stderr  # the filter ends with the command


def test_in_process_warnings_are_filtered_inside_the_command():
    with quiet_third_party(), warnings.catch_warnings(record=True) as seen:
        warnings.warn("Transformer Engine and Apex are not installed. Falling back")
        warnings.warn("a deprecation", FutureWarning)
        warnings.warn("the model is odd")
    assert [str(w.message) for w in seen] == ["the model is odd"]


def _folder_with_garbage_weights(tmp_path, data: bytes):
    import transformers

    transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(data)
    return str(tmp_path)


@pytest.mark.parametrize("data", [b"\x00" * 7, b"\xff" * 64 + b"{not json" * 50], ids=["truncated", "garbage"])
def test_unreadable_safetensors_is_one_line_naming_the_file(tmp_path, capsys, data):
    folder = _folder_with_garbage_weights(tmp_path, data)
    assert check_model.main([folder, "--no-vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"check-model: {folder}/model.safetensors is not a readable "
                                               "safetensors file"), err


def test_a_layout_needing_more_ranks_than_visible_gpus_is_one_line():
    with pytest.raises(ValueError, match=r"^--tp 2 x --pp 1 x --cp 1 x --ep 8 needs 16 processes, one per GPU, but "
                                         r"this host has 8 visible GPUs"):
        check_ranks_fit(2, 1, 8, visible=8)
    assert check_ranks_fit(2, 1, 4, visible=8) == 8
    assert check_ranks_fit(2, 1, 2, visible=8, cp=2) == 8
    assert check_ranks_fit(2, 1, 8, visible=0) == 16  # CPU processes: any number


def test_vllm_cpu_head_sizes_are_named_before_building_an_engine():
    def cfg(head_dim):
        return SimpleNamespace(head_dim=head_dim, hidden_size=64, num_attention_heads=4)

    why = vllm_cannot_run(cfg(16), on_gpu=False)
    assert why is not None and why.endswith("this model's head_dim is 16") and "32, 64" in why
    assert vllm_cannot_run(cfg(None), on_gpu=False) is not None  # 64 / 4 heads = 16
    assert vllm_cannot_run(cfg(32), on_gpu=False) is None
    assert vllm_cannot_run(cfg(16), on_gpu=True) is None  # vLLM-GPU picks its backend by head size itself


class _SleepingEngine:
    """VLLMRollout's memory phases as vLLM's sleep mode has them on GPU (it starts asleep, VLLMRollout.__init__):
    writing weights into a sleeping engine or generating with anything asleep is an error here. (The real
    sleep mode exists on GPU only.)"""

    def __init__(self):
        self.asleep, self.calls = {"weights", "kv_cache"}, []

    def wake_up(self, tags):
        self.asleep -= set(tags)
        self.calls.append(("wake_up", tuple(tags)))

    def update_weights(self, weights):
        assert "weights" not in self.asleep, "weights written into a sleeping engine"
        self.calls.append(("update_weights", dict(weights)))

    def generate(self, prompts, sampling):
        assert not self.asleep, f"generate with {sorted(self.asleep)} asleep"
        self.calls.append(("generate", prompts))
        return [[1] for _ in prompts]


def test_the_vllm_leg_wakes_the_engine_before_loading_and_generating():
    engine = _SleepingEngine()
    assert sync_and_generate(engine, lambda: {"w": 1}, [[5, 6]], sampling=None) == [[1]]
    assert [c[0] for c in engine.calls] == ["wake_up", "update_weights", "wake_up", "generate"]
    assert engine.calls[0] == ("wake_up", ("weights",)) and "kv_cache" in engine.calls[2][1]
