"""Sliding windows: HF's (``sliding_window``, per layer by ``layer_types``) becomes megatron's ``window_size`` on
configs whose layers all slide, is refused in one line where only some do (or with context parallelism), and the
window of the local attention is measured in positions (the packed-row equivalence is
tests/distributed/test_shared_prompt_rows.py; HF logits, tests/distributed/test_model_archs.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from hybridflow.megatron.attention_config import windowed_layers
from hybridflow.megatron.model import transformer_config_from_hf

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def _mistral(window):
    config = transformers.MistralConfig(sliding_window=window, **COMMON)
    config.architectures = ["MistralForCausalLM"]
    return config


def _qwen2(max_window_layers):
    config = transformers.Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=max_window_layers,
                                      **COMMON)
    config.architectures = ["Qwen2ForCausalLM"]
    return config


@pytest.mark.parametrize("config, window", [
    (_mistral(4), (3, 0)),  # HF: a key at most sliding_window - 1 positions back
    (_mistral(None), None),
    (_mistral(64), None),  # no shorter than the context: it changes nothing
    (_qwen2(0), (7, 0)),  # Qwen2: layers from max_window_layers on slide
    (_qwen2(2), None),
])
def test_hf_windows_become_megatrons(config, window):
    tf = transformer_config_from_hf(config)
    assert tf.window_size == window and tf.window_attn_skip_freq is None


def test_some_layers_windowed_or_context_parallel_is_one_line():
    assert windowed_layers(_qwen2(1)) == [False, True]
    with pytest.raises(ValueError, match="sliding_window 8 on some layers only"):
        transformer_config_from_hf(_qwen2(1))
    with pytest.raises(ValueError, match="megatron.context_parallel_size=2: a model with a sliding window"):
        transformer_config_from_hf(_mistral(4), cp=2)


def test_the_window_is_measured_in_positions():
    from hybridflow.patches import megatron_layers

    q, k = torch.arange(6)[:, None], torch.arange(6)[None]
    by_index = megatron_layers._outside_window(6, 6, (2, 0), "cpu")[0, 0]
    assert torch.equal(by_index, (k > q) | (q - k > 2))  # causal, and at most 2 keys back
    # two packed rows, the second's positions restarting: distances are theirs (the row mask keeps rows apart)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with megatron_layers.attention_positions(positions):
        packed = megatron_layers._outside_window(6, 6, (1, 0), "cpu")[0, 0]
    assert not packed[5, 1] and packed[5, 0] and packed[2, 0] and not packed[4, 3]
