"""The demo corpus (dedup, split, held-out packages) and the newline-safe tokenizer."""
from __future__ import annotations

import hashlib

import pytest

from staged_engine.training import corpus
from staged_engine.training.tokenizer import EOS_TOKEN, train_tokenizer
from staged_engine.training.train import token_byte_lengths

CODE = '''import os


class Stack:
    """A stack."""

    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)
        return len(self.items)


def main(argv=None):
    """Entry point."""
    for i in range(10):
        print(i, os.sep)
'''


@pytest.fixture(scope="module")
def built():
    return corpus.build(log=lambda m: None)


def test_corpus_covers_stdlib_and_requirements_and_holds_packages_out(built):
    names = {p["name"]: p for p in built.manifest["packages"]}
    assert {"stdlib", "torch", "transformers", "tokenizers"} <= set(names)
    assert all(p["version"] for p in names.values())
    for h in corpus.HELD_OUT:
        assert names[h]["role"] == "held_out" and names[h]["files"] > 0
    held = tuple(h + "/" for h in corpus.HELD_OUT)
    assert built.held_out and all(rel.startswith(held) for rel, _ in built.held_out)
    assert not any(rel.startswith(held) for rel, _ in built.train + built.val)
    assert built.manifest["files_train"] == len(built.train) > 5000


def test_corpus_is_deduplicated_and_split_by_content(built):
    seen = set()
    for docs, side in ((built.train, "train"), (built.val, "val"), (built.held_out, None)):
        for _, text in docs:
            h = hashlib.sha256(text.encode("utf-8")).hexdigest()
            assert h not in seen
            seen.add(h)
            if side is not None:
                assert corpus.split_of_hash(h, built.manifest["val_fraction"]) == side
    assert 0.005 < len(built.val) / (len(built.train) + len(built.val)) < 0.05


def test_missing_held_out_package_is_refused():
    with pytest.raises(ValueError, match="held-out packages not installed: \\['no-such-package'\\]"):
        corpus.build(held_out=("no-such-package",), roots=("tokenizers",), include_stdlib=False,
                      log=lambda m: None)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([CODE] * 20 + [CODE.replace("    ", "\t")] * 5, vocab_size=600)


def test_line_breaks_never_merge_with_indentation(tok):
    assert tok.token_to_id(EOS_TOKEN) == 0
    lengths = token_byte_lengths(tok)
    for piece, i in tok.get_vocab().items():
        if piece == EOS_TOKEN:
            continue
        raw = piece.replace("Ċ", "\n").replace("Ġ", " ").replace("ĉ", "\t")
        assert "\n " not in raw and "\n\t" not in raw, piece
        assert lengths[i] == len(piece)
    # A prompt that ends in a newline ends in a token the training text also ended a line with.
    ids = tok.encode('def main(argv=None):\n    """Entry point."""\n').ids
    last = tok.id_to_token(ids[-1])
    assert last.endswith("Ċ")
    assert last in {tok.id_to_token(i) for i in tok.encode(CODE).ids}


def test_round_trip_and_bytes_per_token(tok):
    text = CODE + "x = 'naïve ü'\r\n\t\tpass\n" + EOS_TOKEN
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    lengths = token_byte_lengths(tok)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8")) - len(EOS_TOKEN)
