"""Tiny models and tokenizers built offline, for tests, recipes and benchmarks.

A character-level tokenizer (every character is one token, so token counts are easy to predict) and
a small Qwen2-architecture model with random weights, saved as an ordinary HF directory that every
part of tether loads by path.

The tokenizer is a Qwen2Tokenizer (byte-level BPE with no merges): next to a Qwen2 config,
`AutoTokenizer.from_pretrained` always builds a Qwen2Tokenizer from the saved vocabulary, so any
other kind of tokenizer saved there would come back changed (a word-level one loses its spaces).
Built as what it will be loaded as, the saved tokenizer encodes and decodes exactly like the one in
memory.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]

# Digits, letters, whitespace and the punctuation that math prompts and LaTeX
# answers need (braces and backslash for \boxed{...}).
CHARS = (
    string.digits
    + string.ascii_letters
    + " \n"
    + "+-*/=?.,:;!'\"()[]{}<>\\$%^_|&#@~`"
)

# Byte-level BPE spells the two whitespace characters with printable stand-ins (GPT-2's byte map);
# every other character of CHARS is printable ASCII and stands for itself.
_BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}

# Role-prefixed plain-text template: every character stays in the vocabulary, so
# chat-formatted prompts tokenize without unknown tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_char_tokenizer(
    out_dir: str | Path | None = None, chat_template: bool = True
) -> PreTrainedTokenizerBase:
    """Build a character-level tokenizer (pad "<pad>", eos "<eos>", unk "<unk>").

    Token ids: the three special tokens, then CHARS in order. Characters outside CHARS are
    dropped by the byte-level model (the data round-trip check at start-up reports such rows).

    Args:
        out_dir: if given, the tokenizer is saved there (save_pretrained) so code
            that loads tokenizers by path can be tested.
        chat_template: set a simple role-prefixed jinja chat template.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(_BYTE_LEVEL.get(ch, ch), len(vocab))
    # No merges: BPE leaves every byte its own token, which is one character for all of CHARS.
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=UNK_TOKEN, eos_token=EOS_TOKEN,
                               pad_token=PAD_TOKEN)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_model(out_dir: str | Path, tokenizer: PreTrainedTokenizerBase, *, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                     max_positions: int = 256, seed: int = 0) -> Path:
    """A randomly initialised Qwen2 causal LM plus ``tokenizer``, saved as an HF directory."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
