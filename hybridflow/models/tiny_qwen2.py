"""Build a tiny Qwen2-architecture causal LM from scratch (random init), saved as a HF folder."""

from __future__ import annotations

from pathlib import Path


def build_tiny_qwen2(out_dir: str | Path, tokenizer, *, hidden_size: int = 128, num_layers: int = 4,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                     max_position_embeddings: int = 64, vocab_multiple: int = 16, seed: int = 0,
                     tie_word_embeddings: bool = False):
    """Write config + safetensors weights of a random-init Qwen2ForCausalLM; returns the model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    # Pad the vocabulary so it divides any tensor-parallel size we use (megatron needs divisibility).
    vocab = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, torch_dtype="float32",
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model
