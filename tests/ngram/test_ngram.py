"""Tests of the n-gram draft model (staged_engine.ngram, csrc/ngram.h).

Every behavioural test runs on both backends ("cpp" and "python") against the same
expectations: a brute-force reference written here from the contract (ALGORITHMS.md sec. 6),
with plain dict counts, that never calls the code under test.
"""
from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import textwrap
import zlib
from array import array

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from staged_engine import ngram as ngram_mod
from staged_engine.cli import build as build_cli
from staged_engine.ngram import MAX_VOCAB, NGramModel

HAVE_CPP = ngram_mod.cpp_available()
BACKENDS = [
    pytest.param("cpp", marks=pytest.mark.skipif(not HAVE_CPP, reason="_ngram not built")),
    "python",
]
PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COUNT_MAX = 2**32 - 1


# ----------------------------------------------------------------------------------------------
# Brute-force reference (independent of the code under test)


class Ref:
    """Naive model: counts[L][ctx][tok] after pruning; queries by full sorts."""

    def __init__(self, docs, order, top_m=None, min_count=1):
        self.order, self.top_m = order, top_m
        raw = [dict() for _ in range(order)]
        for doc in docs:
            for i in range(len(doc)):
                for L in range(order):
                    if i - L < 0:
                        continue
                    ctx = tuple(doc[i - L:i])
                    raw[L].setdefault(ctx, {})
                    raw[L][ctx][doc[i]] = raw[L][ctx].get(doc[i], 0) + 1
        self.counts = [dict() for _ in range(order)]
        for L in range(order):
            for ctx, c in raw[L].items():
                kept = {t: n for t, n in c.items() if n >= min_count}
                if kept:
                    self.counts[L][ctx] = self._cut(kept)

    def _cut(self, c):
        ranked = sorted(c.items(), key=lambda e: (-e[1], e[0]))
        if self.top_m is not None:
            ranked = ranked[: self.top_m]
        return dict(ranked)

    def ranked(self, ctx):
        c = self.counts[len(ctx)].get(tuple(ctx), {})
        return sorted(c.items(), key=lambda e: (-e[1], e[0]))

    def topk(self, context, k):
        ctx = tuple(context[len(context) - min(len(context), self.order - 1):])
        out = []
        for L in range(len(ctx), -1, -1):
            cands = [t for t, _ in self.ranked(ctx[len(ctx) - L:]) if t not in out]
            out += cands[: k - len(out)]
        return out

    def propose(self, context, widths):
        ctx = list(context)
        tokens, parents, parent = [], [], -1
        for w in widths:
            level = self.topk(ctx, w)
            if not level:
                break
            parents += [parent] * len(level)
            parent = len(tokens)
            tokens += level
            ctx.append(level[0])
        return tokens, parents

    def update(self, tokens, context=()):
        hist = list(context)[max(0, len(context) - (self.order - 1)):]
        full = hist + list(tokens)
        new = [dict() for _ in range(self.order)]
        for i in range(len(hist), len(full)):
            for L in range(min(i, self.order - 1) + 1):
                ctx = tuple(full[i - L:i])
                new[L].setdefault(ctx, {})
                new[L][ctx][full[i]] = new[L][ctx].get(full[i], 0) + 1
        for L in range(self.order):
            for ctx, c in new[L].items():
                merged = dict(self.counts[L].get(ctx, {}))
                for t, n in c.items():
                    merged[t] = min(merged.get(t, 0) + n, COUNT_MAX)
                self.counts[L][ctx] = self._cut(merged)

    def all_contexts(self):
        return [ctx for L in range(self.order) for ctx in self.counts[L]]


# ----------------------------------------------------------------------------------------------
# Strategies: random and structured token streams, split into documents


@st.composite
def corpora(draw):
    vocab = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["random", "structured"]))
    if kind == "random":
        stream = draw(st.lists(st.integers(0, vocab - 1), max_size=150))
    else:  # a repeated motif with substitutions: long seen contexts, ties and back-off
        motif = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        reps = draw(st.integers(0, 25))
        stream = motif * reps
        for _ in range(draw(st.integers(0, 10))):
            if stream:
                stream[draw(st.integers(0, len(stream) - 1))] = draw(st.integers(0, vocab - 1))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    bounds = [0] + cuts + [len(stream)]
    docs = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    return vocab, docs


def queries(draw, vocab, docs, order, n):
    """Contexts: windows of the corpus (seen) and random ids (mostly unseen), lengths 0..order+1."""
    out = []
    flat = [t for d in docs for t in d]
    for _ in range(n):
        length = draw(st.integers(0, order + 1))
        if flat and draw(st.booleans()):
            end = draw(st.integers(0, len(flat)))
            out.append(flat[max(0, end - length):end])
        else:
            out.append(draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length)))
    return out


def build(docs, backend, **kw):
    return NGramModel.build(docs, backend=backend, **kw)


# ----------------------------------------------------------------------------------------------
# Ranking, pruning, proposal, update: property tests against the reference


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(data=st.data(), corpus=corpora(), order=st.sampled_from([1, 2, 3, 4]))
def test_topk_matches_bruteforce(backend, data, corpus, order):
    vocab, docs = corpus
    model = build(docs, backend, order=order, vocab_size=vocab)
    ref = Ref(docs, order)
    for ctx in queries(data.draw, vocab, docs, order, 12):
        for k in (1, 4, 12, 40):
            assert model.topk(ctx, k) == ref.topk(ctx, k), (ctx, k)


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(data=st.data(), corpus=corpora(), order=st.sampled_from([2, 3, 4]),
       top_m=st.sampled_from([None, 1, 2, 3]), min_count=st.sampled_from([1, 2, 3]))
def test_pruned_model_matches_bruteforce(backend, data, corpus, order, top_m, min_count):
    vocab, docs = corpus
    model = build(docs, backend, order=order, vocab_size=vocab, top_m=top_m, min_count=min_count)
    ref = Ref(docs, order, top_m=top_m, min_count=min_count)
    for ctx in ref.all_contexts():
        assert model.continuations(list(ctx)) == ref.ranked(ctx)
    assert model.num_contexts == len(ref.all_contexts())
    for ctx in queries(data.draw, vocab, docs, order, 8):
        for k in (1, 4, 12):
            assert model.topk(ctx, k) == ref.topk(ctx, k), (ctx, k)


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(data=st.data(), corpus=corpora(), order=st.sampled_from([1, 2, 3, 4]),
       widths=st.lists(st.integers(1, 13), max_size=7))
def test_propose_matches_bruteforce(backend, data, corpus, order, widths):
    vocab, docs = corpus
    model = build(docs, backend, order=order, vocab_size=vocab)
    ref = Ref(docs, order)
    for ctx in queries(data.draw, vocab, docs, order, 6):
        for ws in (widths, [12, 7, 4, 1, 1, 1]):
            tokens, parents = model.propose(ctx, ws)
            assert (tokens, parents) == ref.propose(ctx, ws)
            assert all(-1 <= p < i for i, p in enumerate(parents))  # topological order


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(data=st.data(), corpus=corpora(), order=st.sampled_from([1, 2, 3, 4]),
       top_m=st.sampled_from([None, 1, 2, 4]), min_count=st.sampled_from([1, 2]))
def test_update_matches_bruteforce(backend, data, corpus, order, top_m, min_count):
    vocab, docs = corpus
    model = build(docs, backend, order=order, vocab_size=vocab, top_m=top_m, min_count=min_count)
    ref = Ref(docs, order, top_m=top_m, min_count=min_count)
    text = []
    for _ in range(data.draw(st.integers(1, 3))):
        new = data.draw(st.lists(st.integers(0, vocab - 1), max_size=20))
        model.update(new, context=text)
        ref.update(new, context=text)
        text += new
    for ctx in ref.all_contexts():
        assert model.continuations(list(ctx)) == ref.ranked(ctx)
    assert model.num_contexts == len(ref.all_contexts())
    for ctx in queries(data.draw, vocab, docs + [text], order, 8):
        assert model.topk(ctx, 5) == ref.topk(ctx, 5)
    again = NGramModel.from_bytes(model.to_bytes(), backend=backend)  # overlay folded on save
    for ctx in ref.all_contexts():
        assert again.continuations(list(ctx)) == ref.ranked(ctx)


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY
@given(corpus=corpora(), order=st.sampled_from([1, 2, 3]), top_m=st.sampled_from([None, 2, 5]),
       chunks=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=4), min_size=5,
                       max_size=25))
def test_many_small_updates_match_bruteforce(backend, corpus, order, top_m, chunks):
    """A drafter's pattern: the generated text arrives a few tokens at a time."""
    vocab, docs = corpus
    model = build(docs, backend, order=order, vocab_size=12, top_m=top_m)
    ref = Ref(docs, order, top_m=top_m)
    text: list[int] = []
    for chunk in chunks:
        model.update(chunk, context=text)
        ref.update(chunk, context=text)
        text += chunk
        for L in range(order):
            ctx = text[len(text) - L:] if L else []
            assert model.continuations(ctx) == ref.ranked(ctx)
    for ctx in ref.all_contexts():
        assert model.continuations(list(ctx)) == ref.ranked(ctx)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_example(backend):
    # counts: (1,2)->3 x2, (1,2)->4 x1; (2)->3 x2, (2)->4 x1; unigrams 1:3 2:3 3:2 4:1 5:2
    model = build([[1, 2, 3, 1, 2, 4, 1, 2, 3], [5, 5]], backend, order=3)
    assert model.topk([0, 1, 2], 2) == [3, 4]  # only the last order-1 = 2 ids count
    assert model.topk([1, 2], 10) == [3, 4, 1, 2, 5]
    assert model.topk([5], 3) == [5, 1, 2]  # (5)->5 once, then unigrams 1, 2 (tie: smaller id)
    assert model.topk([0, 0], 2) == [1, 2]  # unseen context: unigrams only
    assert model.topk([], 1) == [1]
    assert model.continuations([2, 3]) == [(1, 1)]  # documents do not join: no (3)->5 etc.
    assert model.continuations([3]) == [(1, 1)]
    # widths [2, 1, 1]: level 1 = topk([1,2],2) = [3,4]; level 2 below 3: topk([2,3],1) = [1];
    # level 3 below 1: topk([3,1],1) = [2]
    assert model.propose([1, 2], [2, 1, 1]) == ([3, 4, 1, 2], [-1, -1, 0, 2])
    model.update([4, 1, 2, 4], context=[1, 2])  # adds (1,2)->4, (2,4)->1, (4,1)->2, (1,2)->4
    assert model.continuations([1, 2]) == [(4, 3), (3, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_forms_agree(backend):
    docs = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]]
    ref = build(docs, backend, order=3).to_bytes()
    assert build((d for d in docs), backend, order=3).to_bytes() == ref
    assert build([np.array(d, dtype=np.int32) for d in docs], backend, order=3).to_bytes() == ref
    assert build([array("q", d) for d in docs], backend, order=3).to_bytes() == ref
    assert build([array("i", d) for d in docs], backend, order=3).to_bytes() == ref
    assert build([tuple(d) for d in docs], backend, order=3).to_bytes() == ref
    one = build(docs[0], backend, order=3, vocab_size=10)
    assert one.to_bytes() == build(np.array(docs[0]), backend, order=3, vocab_size=10).to_bytes()
    rows = np.array([[1, 2, 3], [3, 2, 1]])
    assert build(rows, backend, order=2).to_bytes() == build(rows.tolist(), backend, order=2).to_bytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend, tmp_path):
    for empty in ([], [[], []], np.zeros(0, dtype=np.int64)):
        model = build(empty, backend, order=3, vocab_size=5)
        assert model.num_contexts == 0 and model.num_entries == 0
        assert model.topk([], 3) == [] and model.topk([1, 2, 3], 3) == []
        assert model.propose([1], [12, 7, 4]) == ([], [])
        model.update([])
        model.save(tmp_path / "e.ngram")
        assert NGramModel.load(tmp_path / "e.ngram", backend=backend).to_bytes() == model.to_bytes()
    model = build([[1], [2]], backend, order=4)  # documents shorter than the order
    assert model.topk([1, 1, 1], 5) == [1, 2]
    assert model.propose([], []) == ([], [])
    model.update([2], context=[])
    assert model.topk([], 5) == [2, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_vocab_and_packing(backend):
    big = MAX_VOCAB - 1  # ids at the top of the 21-bit range, keys over 64 bits while building
    docs = [[big, 0, big, 1, big, 0, 7]]
    model = build(docs, backend, order=4, vocab_size=MAX_VOCAB)
    ref = Ref(docs, 4)
    for ctx in ([big, 0, big], [0, big], [big], [1, big, 0], [5]):
        assert model.topk(ctx, 4) == ref.topk(ctx, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_counts_saturate(backend):
    lists = [{(): [(0, COUNT_MAX - 1), (1, 5)]}, {(1,): [(0, COUNT_MAX)]}]
    data = ngram_mod.ReferenceNGram(2, 3, 0, 1, lists).to_bytes()
    model = NGramModel.from_bytes(data, backend=backend)
    model.update([1, 0, 0, 0])
    assert model.continuations([]) == [(0, COUNT_MAX), (1, 6)]
    assert model.continuations([1]) == [(0, COUNT_MAX)]
    assert model.continuations([0]) == [(0, 2)]


# ----------------------------------------------------------------------------------------------
# The two backends agree


@pytest.mark.skipif(not HAVE_CPP, reason="_ngram not built")
@pytest.mark.parametrize("order", [2, 3, 4])
def test_backends_agree_on_10000_queries(order):
    rng = random.Random(order)
    vocab = 60
    motifs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 8))] for _ in range(12)]
    docs = []
    for _ in range(40):
        doc = []
        while len(doc) < 300:
            doc += rng.choice(motifs) if rng.random() < 0.8 else [rng.randrange(vocab)]
        docs.append(doc)
    kw = dict(order=order, vocab_size=vocab, top_m=8 if order == 3 else None)
    cpp, py = build(docs, "cpp", **kw), build(docs, "python", **kw)
    assert cpp.to_bytes() == py.to_bytes()
    flat = [t for d in docs for t in d]
    for i in range(10_000):
        if i % 2:
            end = rng.randrange(len(flat) + 1)
            ctx = flat[max(0, end - rng.randint(0, 5)):end]
        else:
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 5))]
        k = rng.choice([1, 2, 4, 12, 50])
        assert cpp.topk(ctx, k) == py.topk(ctx, k), (ctx, k)
        if i % 10 == 0:
            assert cpp.propose(ctx, [12, 7, 4, 1, 1, 1]) == py.propose(ctx, [12, 7, 4, 1, 1, 1])
        if i % 1000 == 999:  # online updates keep them in step
            new = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            cpp.update(new, context=ctx)
            py.update(new, context=ctx)
    assert cpp.to_bytes() == py.to_bytes()


@pytest.mark.skipif(not HAVE_CPP, reason="_ngram not built")
def test_extension_checks_raw_inputs():
    """The C++ entry points check what the wrapper normally guarantees, and take empty input."""
    from staged_engine import _ngram  # the C++ unit itself, beneath NGramModel

    raw = _ngram.Model
    for toks, offs in [([1, 2, 3], [0, 2]), ([1, 2, 3], [1, 3]), ([1, 2, 3], [0, 3, 2, 3]),
                       ([1, 2, 3], []), ([], [])]:
        with pytest.raises(ValueError, match="doc_offsets"):
            raw.build(array("q", toks), array("q", offs), 3, 5, 0, 1)
    with pytest.raises(ValueError, match="int64"):
        raw.build(array("i", [1, 2]), array("q", [0, 2]), 3, 5, 0, 1)
    with pytest.raises(ValueError, match="vocab_size"):
        raw.build(array("q"), array("q", [0]), 3, 0, 0, 1)  # 0 = infer, impossible when empty
    for offs in ([0], [0, 0, 0]):
        m = raw.build(array("q"), array("q", offs), 4, 5, 0, 1)
        assert m.topk([1, 2, 3], 4) == [] and m.propose([], [3, 2]) == ([], [])
        m.update(array("q"), 0)
        m.update(array("q", [1, 2]), 5)  # skip beyond the end: nothing counted
        assert m.topk([], 4) == []
        assert raw.from_bytes(m.to_bytes()).to_bytes() == m.to_bytes()
    for data in (b"", bytearray(b"x"), memoryview(b"SENGRAM")):
        with pytest.raises(ValueError):
            raw.from_bytes(data)


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("STAGED_ENGINE_NGRAM_BACKEND", "python")
    assert NGramModel.build([1, 2, 3]).backend == "python"
    monkeypatch.setenv("STAGED_ENGINE_NGRAM_BACKEND", "auto")
    assert NGramModel.build([1, 2, 3]).backend == ("cpp" if HAVE_CPP else "python")
    with pytest.raises(ValueError, match="backend"):
        NGramModel.build([1, 2, 3], backend="fortran")


# ----------------------------------------------------------------------------------------------
# Save / load


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip(backend, tmp_path):
    rng = random.Random(0)
    docs = [[rng.randrange(300) for _ in range(rng.randint(0, 400))] for _ in range(20)]
    for order, top_m, min_count in [(1, None, 1), (2, 5, 1), (3, None, 2), (4, 3, 1)]:
        model = build(docs, backend, order=order, top_m=top_m, min_count=min_count)
        model.update(docs[0][:50], context=docs[1][-3:])
        path = tmp_path / f"m{order}.ngram"
        model.save(path)
        for other in ("cpp", "python") if HAVE_CPP else ("python",):
            loaded = NGramModel.load(str(path), backend=other)
            assert (loaded.order, loaded.vocab_size, loaded.top_m, loaded.min_count) == (
                order, model.vocab_size, top_m, min_count)
            assert loaded.num_contexts == model.num_contexts
            assert loaded.num_entries == model.num_entries
            assert loaded.to_bytes() == path.read_bytes()
            for ctx in ([], docs[2][:3], docs[3][5:9], [1, 2, 3]):
                assert loaded.topk(ctx, 12) == model.topk(ctx, 12)


def _valid_file(order=3, seed=0):
    rng = random.Random(seed)
    docs = [[rng.randrange(40) for _ in range(rng.randint(20, 200))] for _ in range(6)]
    return NGramModel.build(docs, order=order, top_m=6, backend="python").to_bytes()


def _fix_crcs(data: bytes) -> bytes:
    """Recompute both checksums, so that the structural checks behind them are reached."""
    b = bytearray(data)
    if len(b) >= 128:
        b[104:108] = zlib.crc32(bytes(b[128:])).to_bytes(4, "little")
        b[108:112] = zlib.crc32(bytes(b[:108])).to_bytes(4, "little")
    return bytes(b)


def _corrupt_variants():
    good = _valid_file()
    out = {}
    for n in (0, 1, 7, 64, 127, 128, 129, len(good) // 2, len(good) - 1):
        out[f"truncated_{n}"] = good[:n]
    rng = random.Random(1)
    for i in range(40):
        b = bytearray(good)
        pos = rng.randrange(len(b))
        b[pos] ^= 1 << rng.randrange(8)
        out[f"flip_{i}_{pos}"] = bytes(b)
    for i, n in enumerate((1, 100, 128, 5000)):
        out[f"garbage_{i}"] = bytes(rng.randrange(256) for _ in range(n))
    out["garbage_with_magic"] = b"SENGRAM\0" + bytes(rng.randrange(256) for _ in range(300))
    out["extra_bytes"] = good + b"\0" * 8
    # Hostile files: consistent checksums, absurd or inconsistent fields.
    def field(off, fmt_len, value):
        b = bytearray(good)
        b[off:off + fmt_len] = value.to_bytes(fmt_len, "little")
        return _fix_crcs(bytes(b))
    for name, off, n, v in [
        ("version", 8, 4, 2), ("header_size", 12, 4, 64), ("order0", 16, 4, 0),
        ("order5", 16, 4, 5), ("vocab0", 20, 4, 0), ("vocab_huge", 20, 4, 2**32 - 1),
        ("vocab_small", 20, 4, 3), ("min_count0", 32, 8, 0), ("top_m_small", 24, 8, 1),
        ("nctx1_huge", 40, 8, 2**62), ("nctx2_huge", 48, 8, 2**61 + 7), ("nctx3_set", 56, 8, 1),
        ("nent0_huge", 64, 8, 2**63), ("nent1_plus", 72, 8, 1), ("body_huge", 96, 8, 2**64 - 1),
        ("reserved", 112, 8, 1),
    ]:
        out[f"hostile_{name}"] = field(off, n, v)
    # Body edits with fixed checksums: swap two keys, zero a length, huge token, zero count.
    hdr = struct.unpack_from("<8sIIIIQQ3Q4QQII", good)
    n_ent0, n_ctx1 = hdr[10], hdr[7]
    keys1 = 128 + 8 * n_ent0
    lens1 = keys1 + 8 * n_ctx1
    ents1 = lens1 + 4 * n_ctx1
    b = bytearray(good); b[keys1:keys1 + 16] = b[keys1 + 8:keys1 + 16] + b[keys1:keys1 + 8]
    out["hostile_keys_unsorted"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[lens1:lens1 + 4] = (0).to_bytes(4, "little")
    out["hostile_len_zero"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[lens1:lens1 + 4] = (2**31).to_bytes(4, "little")
    out["hostile_len_huge"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[ents1:ents1 + 4] = (2**32 - 1).to_bytes(4, "little")
    out["hostile_token_huge"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[ents1 + 4:ents1 + 8] = bytes(4)
    out["hostile_count_zero"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[keys1:keys1 + 8] = (2**63 - 1).to_bytes(8, "little")
    out["hostile_key_range"] = _fix_crcs(bytes(b))
    b = bytearray(good); b[128:136] = b[136:144]  # unigram list: a repeated entry
    out["hostile_unigram_repeat"] = _fix_crcs(bytes(b))
    # A token twice at different counts is still "ranked" by count (found by the fuzzer).
    out["hostile_repeat_other_count"] = ngram_mod.ReferenceNGram(
        2, 5, 0, 1, [{(): [(1, 4)]}, {(1,): [(0, 5), (0, 3)]}]).to_bytes()
    return out


LOADER_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from staged_engine.ngram import NGramModel, cpp_available
    backends = ["python"] + (["cpp"] if cpp_available() else [])
    results = {}
    for name in sorted(os.listdir(sys.argv[1])):
        path = os.path.join(sys.argv[1], name)
        for backend in backends:
            try:
                m = NGramModel.load(path, backend=backend)
                m.topk([1, 2, 3], 5)
                results[f"{name}/{backend}"] = "loaded"
            except ValueError as exc:
                results[f"{name}/{backend}"] = "ValueError" if path in str(exc) else "bare"
            except Exception as exc:
                results[f"{name}/{backend}"] = type(exc).__name__
    print(json.dumps(results))
""")


def test_corrupt_files_raise_valueerror_in_subprocess(tmp_path):
    variants = _corrupt_variants()
    for name, data in variants.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "good").write_bytes(_valid_file())
    proc = subprocess.run([sys.executable, "-c", LOADER_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"loader crashed (rc {proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    backends = sorted({key.split("/")[1] for key in results})  # what the child process has
    assert "python" in backends and ("cpp" in backends or not HAVE_CPP)
    for backend in backends:
        assert results.pop(f"good/{backend}") == "loaded"
    assert len(results) == len(variants) * len(backends)
    bad = {k: v for k, v in results.items() if v != "ValueError"}
    assert not bad, bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file(backend, tmp_path):
    with pytest.raises(FileNotFoundError):
        NGramModel.load(tmp_path / "nope.ngram", backend=backend)
    with pytest.raises(FileNotFoundError):
        NGramModel.load(tmp_path, backend=backend)  # a directory is not a file


# ----------------------------------------------------------------------------------------------
# Bad arguments


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs, match", [
    (dict(order=0), "order"), (dict(order=5), "order"), (dict(order=2.5), "order"),
    (dict(vocab_size=0), "vocab_size"), (dict(vocab_size=MAX_VOCAB + 1), "vocab_size"),
    (dict(vocab_size=3), "token_ids"), (dict(top_m=0), "top_m"), (dict(min_count=0), "min_count"),
    (dict(token_ids=[1, -1, 2]), "token_ids"), (dict(token_ids=[[1, 2], [3, MAX_VOCAB]]), "token_ids"),
    (dict(token_ids=[1.5, 2.0]), "token_ids"), (dict(token_ids="abc"), "token_ids"),
    (dict(token_ids=[]), "vocab_size"), (dict(token_ids=np.array([1, 2], dtype=np.uint64) + 2**63),
                                         "token_ids"),
    (dict(token_ids=np.zeros((2, 2, 2), dtype=np.int64)), "token_ids"),
])
def test_build_rejects_bad_arguments(backend, kwargs, match):
    kw = dict(token_ids=[1, 2, 3, 4], order=3)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=match):
        NGramModel.build(kw.pop("token_ids"), backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_queries_reject_bad_arguments(backend):
    model = build([[1, 2, 3, 4, 1, 2]], backend, order=3, vocab_size=5)
    cases = [
        (lambda: model.topk([1, 2], 0), "k"),
        (lambda: model.topk([1, 2], -3), "k"),
        (lambda: model.topk([1, 5], 3), "context"),
        (lambda: model.topk([-1, 2], 3), "context"),
        (lambda: model.topk([1, "a"], 3), "context"),
        (lambda: model.topk(7, 3), "context"),
        (lambda: model.topk("ab", 3), "context"),
        (lambda: model.propose([1], [3, 0]), "widths"),
        (lambda: model.propose([1], [3, "x"]), "widths"),
        (lambda: model.propose([1], 3), "widths"),
        (lambda: model.propose([9], [3]), "context"),
        (lambda: model.update([1, 7]), "tokens"),
        (lambda: model.update([1, -2]), "tokens"),
        (lambda: model.update(["x"]), "tokens"),
        (lambda: model.update([1], context=[99]), "context|tokens"),
        (lambda: model.continuations([1, 2, 3]), "context"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert model.topk([0, 1, 2], 2) == model.topk(np.array([1, 2]), 2)
    assert model.topk([99, 1, 2], 2) == [3, 1]  # ids before the last order-1 are not read


# ----------------------------------------------------------------------------------------------
# CLI


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="staged-engine")
    sub = parser.add_subparsers(dest="command")
    build_cli.register_cli(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_from_token_id_file(tmp_path, capsys):
    (tmp_path / "c.ids").write_text("1 2 3 1 2 4\n\n5 5 1 2 3\n")
    out = tmp_path / "c.ngram"
    assert _cli(["ngram-build", str(tmp_path / "c.ids"), "--order", "3", "-o", str(out)]) == 0
    model = NGramModel.load(out)
    ref = NGramModel.build([[1, 2, 3, 1, 2, 4], [5, 5, 1, 2, 3]], order=3)
    assert model.to_bytes() == ref.to_bytes()
    assert "wrote" in capsys.readouterr().err


def test_cli_with_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", "def", "f", "(", ")", ":", "return", "x", "1"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text("def f(x):\n    return x\n")
    (src / "pkg" / "b.py").write_text("def f():\n    return 1\n")
    (src / "notes.md").write_text("ignored")
    out = tmp_path / "code.ngram"
    _cli(["ngram-build", str(src), "--tokenizer", str(tmp_path / "tokenizer.json"),
          "--order", "2", "--top-m", "4", "-q", "-o", str(out)])
    model = NGramModel.load(out)
    assert model.vocab_size == 9 and model.order == 2 and model.top_m == 4
    # files in sorted order: a.py, pkg/b.py; one document each. The Whitespace pre-tokenizer
    # splits \w+ | [^\w\s]+, so "):" and "():" are single pieces, unknown (0).
    docs = [[1, 2, 3, 7, 0, 6, 7], [1, 2, 0, 6, 8]]
    assert model.to_bytes() == NGramModel.build(docs, order=2, vocab_size=9, top_m=4).to_bytes()


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _cli(["ngram-build", "--help"])
    help_text = capsys.readouterr().out
    for word in ("--tokenizer", "--order", "--top-m", "--min-count", "--output", "*.ids"):
        assert word in help_text
    (tmp_path / "t.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="--tokenizer"):
        _cli(["ngram-build", str(tmp_path / "t.py"), "-o", str(tmp_path / "o.ngram")])
    with pytest.raises(FileNotFoundError):
        _cli(["ngram-build", str(tmp_path / "missing"), "-o", str(tmp_path / "o.ngram")])
