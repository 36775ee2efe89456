"""Build a tiny Llama-architecture causal LM from scratch (random init), saved as a HF folder."""

from __future__ import annotations

from pathlib import Path

from hybridflow.models.tiny_qwen2 import padded_vocab, save_random_model, special_tokens


def build_tiny_llama(out_dir: str | Path, tokenizer, *, rope_parameters: dict | None = None,
                     hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 192, max_position_embeddings: int = 64, vocab_multiple: int = 16,
                     seed: int = 0, tie_word_embeddings: bool = False):
    """Write config + safetensors weights of a random-init LlamaForCausalLM (no attention or MLP biases,
    as Llama 3) with the given ``rope_parameters`` (e.g. Llama 3.1's ``rope_type: llama3``); returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=padded_vocab(tokenizer, vocab_multiple), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        rope_parameters=rope_parameters, tie_word_embeddings=tie_word_embeddings, torch_dtype="float32",
        **special_tokens(tokenizer))
    return save_random_model(LlamaForCausalLM, config, out_dir, tokenizer, seed)
