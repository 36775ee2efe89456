"""Build a tiny Qwen2-architecture causal LM from scratch (random init), saved as a HF folder."""

from __future__ import annotations

from pathlib import Path

from hybridflow.models.char_tokenizer import build_char_tokenizer


def build_tiny_qwen2(out_dir: str | Path, tokenizer, *, hidden_size: int = 128, num_layers: int = 4,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                     max_position_embeddings: int = 64, vocab_multiple: int = 16, seed: int = 0,
                     tie_word_embeddings: bool = False):
    """Write config + safetensors weights of a random-init Qwen2ForCausalLM; returns the model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=padded_vocab(tokenizer, vocab_multiple), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, torch_dtype="float32", use_sliding_window=False,
        **special_tokens(tokenizer))
    return save_random_model(Qwen2ForCausalLM, config, out_dir, tokenizer, seed)


def padded_vocab(tokenizer, multiple: int) -> int:
    """The tokenizer's size rounded up so that it divides any tensor-parallel size we use (megatron needs
    divisibility)."""
    return -(-len(tokenizer) // multiple) * multiple


def special_tokens(tokenizer) -> dict:
    return dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def save_random_model(model_cls, config, out_dir: str | Path, tokenizer, seed: int):
    """A random-init ``model_cls(config)`` (seeded, fp32) saved with ``tokenizer`` into ``out_dir``."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).float()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return model


# Qwen's ChatML turns, without Qwen2.5's default system prompt (it would not fit a tiny context).
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_ALPHABET = "0123456789+-*=:?,.!'()/$# \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# With tools: Qwen2.5's tool turns (Hermes tool calls; tool responses in a user turn), without its system prompt
# listing the tools' schemas (it would not fit a tiny context either).
CHATML_TOOLS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def build_chat_tokenizer(out_dir: str | Path, alphabet: str = CHAT_ALPHABET, tools: bool = False):
    """A char-level tokenizer with Qwen's ChatML chat template: ``<|im_start|>``/``<|im_end|>`` are special
    tokens of their own and ``<|im_end|>`` ends a turn (the eos token, as in Qwen's instruct models). The
    alphabet holds the newline the template puts after each role and turn. Loaded back by AutoTokenizer from
    a Qwen2 model folder, transformers 5 builds a Qwen2Tokenizer whose byte-level pre-tokenizer drops this
    char-level vocabulary's whitespace (the newlines too), as it does for the quickstart's tokenizer; the
    special tokens and every other character stay. With ``tools``, Hermes tool calls and tool responses have
    special tokens of their own too, and the alphabet gains JSON's characters."""
    tokenizer = build_char_tokenizer(out_dir, alphabet + ('{}"_[]' if tools else ""))
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHATML_TOKENS) + (list(TOOL_TOKENS) if tools else [])})
    tokenizer.eos_token = CHATML_TOKENS[1]
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE if tools else CHATML_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_qwen2_chat(out_dir: str | Path, **model_kw):
    """A random-init tiny Qwen2 folder whose tokenizer renders chats (``build_chat_tokenizer``); returns
    (model, tokenizer). ``model_kw``: ``build_tiny_qwen2``'s sizes."""
    tokenizer = build_chat_tokenizer(out_dir)
    return build_tiny_qwen2(out_dir, tokenizer, **model_kw), tokenizer
