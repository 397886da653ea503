"""Tiny models and tokenizers built offline, for tests, recipes and benchmarks.

A character-level tokenizer (built with the `tokenizers` library: every character is one token,
so token counts are easy to predict) and a small Qwen2-architecture model with random weights,
saved as an ordinary HF directory that every part of tether loads by path.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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
) -> PreTrainedTokenizerFast:
    """Build a character-level fast tokenizer (pad "<pad>", eos "<eos>").

    Args:
        out_dir: if given, the tokenizer is saved there (save_pretrained) so code
            that loads tokenizers by path can be tested.
        chat_template: set a simple role-prefixed jinja chat template.

    Returns:
        A PreTrainedTokenizerFast where each character in CHARS is one token.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Isolate every single character (including newline) as its own pre-token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins tokens without the separator spaces WordLevel would insert.
    backend.decoder = decoders.Fuse()

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_tiny_model(out_dir: str | Path, tokenizer: PreTrainedTokenizerFast, *, hidden_size: int = 64,
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
