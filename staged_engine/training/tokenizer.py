"""The demo tokenizer: byte-level BPE whose pre-tokenizer keeps line breaks to themselves.

GPT-2's pre-tokenizer lets a run of whitespace take the next line's indentation with the line
break ("\\n" + "    " is one pre-token), so a prompt that ends in "\\n" ends in a token that
training text almost never ends a line with, and the model answers with more blank lines. The
split pattern below is the one of newer byte-level BPEs (cl100k-style): a line break run is a
pre-token of its own, indentation is another, and the space before a word stays with the word.
"""
from __future__ import annotations

from typing import Iterable

EOS_TOKEN = "<|endoftext|>"

# Contractions; words with an optional leading non-letter; 1-3 digit numbers; punctuation runs
# with an optional leading space; line-break runs (with trailing spaces of the line before them);
# whitespace not followed by a word; other whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2):
    """Byte-level BPE with the newline-safe split, ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes + eos + one merge), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
