"""A character-level tokenizer built locally with the `tokenizers` library (no hub downloads).

Saved as a standard Hugging Face fast tokenizer folder, so transformers (AutoTokenizer) and vLLM load
it like any other.
"""

from __future__ import annotations

from pathlib import Path

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
DEFAULT_ALPHABET = "0123456789+-*=:?,. QAabcdefghijklmnopqrstuvwxyz#"


def build_char_tokenizer(out_dir: str | Path, alphabet: str = DEFAULT_ALPHABET):
    """Write a char-level fast tokenizer to ``out_dir`` and return it (PreTrainedTokenizerFast)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, UNK]
    chars = list(dict.fromkeys(alphabet))  # unique, order kept: ids are stable across builds
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without separators
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, bos_token=None,
        padding_side="left", clean_up_tokenization_spaces=False,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast
