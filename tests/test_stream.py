"""stream(): pieces concatenate to generate().text and never split a UTF-8 character."""
from __future__ import annotations

import math

import pytest
from ckpt_util import make_hf_checkpoint

from staged_engine import Engine
from staged_engine.config import GenerationConfig
from staged_engine.engine import TextStreamer

TEXT = ["héllo wörld ünïcødé 😀🎉 naïve café", "def f(x):\n    return x * 2  # ✓"]


@pytest.fixture(scope="module")
def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    return tok


def test_streamer_holds_back_a_split_character(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("a😀b").ids
    byte_ids = [tok.token_to_id(c) for c in tok.pre_tokenizer.pre_tokenize_str("😀")[0][0]]
    assert len(byte_ids) == 4 and None not in byte_ids  # four byte tokens for one character
    streamer = TextStreamer(lambda t: tok.decode(t))
    pieces = [streamer.push([i]) for i in [ids[0]] + byte_ids + [tok.token_to_id("b")]]
    assert pieces == ["a", "", "", "", "😀", "b"]
    assert "\ufffd" not in "".join(pieces)


def test_stream_concatenates_to_generate_text(byte_tokenizer, tmp_path):
    path = make_hf_checkpoint(str(tmp_path / "m"), seed=5, vocab_size=byte_tokenizer.get_vocab_size(),
                              n_positions=128, n_embd=64, n_layer=2, n_head=2)
    byte_tokenizer.save(str(tmp_path / "m" / "tokenizer.json"))
    eng = Engine.from_pretrained(path)
    for seed in range(4):
        kw = dict(max_new_tokens=40, strategy="plain", temperature=1.0, seed=seed, stop_at_eos=False)
        text = eng.generate("héllo wörld", **kw).text
        pieces = list(eng.stream("héllo wörld", **kw))
        assert "".join(pieces) == text
        so_far = ""
        for piece in pieces:  # every emitted prefix is final: nothing is taken back or replaced
            so_far += piece
            assert text.startswith(so_far)


@pytest.fixture(scope="module")
def demo():
    return Engine.demo(ngram=False)


@pytest.mark.parametrize("strategy,kwargs", [
    ("beam", dict(num_beams=3, temperature=0.8, seed=5)),
    ("beam", dict(num_beams=2, layout="rows", temperature=1.0, seed=6)),
    ("dsbd", dict(num_beams=3, temperature=0.8, seed=5)),
    ("dsbd", dict(num_beams=4, temperature=1.0, seed=7, layout="rows", gamma=3)),
])
def test_beams_stream_as_their_shared_prefix_is_fixed(demo, strategy, kwargs):
    """Beams stream the tokens every live beam shares, as soon as they are fixed; the pieces
    concatenate to generate()'s text, and the first arrives well before the last token."""
    prompt = 'def read_lines(path):\n    """Return the lines of a text file."""\n'
    ref = demo.generate(prompt, max_new_tokens=64, strategy=strategy, stop_at_eos=False, **kwargs)
    stats: dict = {}
    pieces = list(demo.stream(prompt, max_new_tokens=64, strategy=strategy, stop_at_eos=False, stats=stats,
                              **kwargs))
    assert len(pieces) > 1
    assert "".join(pieces) == ref.text
    assert stats["new_tokens"] == 64 and stats["beam_token_ids"] == ref.stats["beam_token_ids"]


def test_generate_runs_plain_steps_in_one_native_call_a_stream_in_pieces(demo, monkeypatch):
    """Nobody reads generate's tokens before the end: its plain steps run in as long native calls
    as an interrupt allows (each return to Python slows the passes after it), a stream's in calls
    of 8 (its pieces); a planner playing plain steps runs a whole stint of plain blocks a call.
    The tokens are the same."""
    from staged_engine.model.runner import ModelRunner

    calls = []
    real = ModelRunner.lookup_steps

    def counted(self, root, n, *args, **kwargs):
        calls.append(n)
        return real(self, root, n, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "lookup_steps", counted)
    prompt = "def add(a, b):\n"
    kw = dict(max_new_tokens=100, strategy="plain", temperature=0.8, top_p=0.95, seed=3, stop_at_eos=False)
    tokens = demo.generate(prompt, **kw).token_ids
    assert calls == [8, 92]  # the first call's rate says the rest fits in CALL_SECONDS (0.25 s)
    calls.clear()
    stats = {}
    text = "".join(demo.stream(prompt, stats=stats, **kw))
    assert calls == [8] * 12 + [4] and text == demo.decode(tokens)
    # a planned chain whose planner's memory favours plain steps, far ahead of the chains (0.6x)
    calls.clear()
    chain = dict(kw, strategy="chain")
    config = GenerationConfig.make("chain", 100, 0.8, 0, 0.95, 3, 1, False, False)
    st = demo._planner_memory(config, (demo.cost_profile("oracle"), demo.cost_profile("draft"))).stints
    st.favoured, st.plan, st.stint = 0, [0] * 8, 8
    st.score = [0.0] + [math.log(0.6)] * (st.n_arms - 1)
    st.pairs = [4] * st.n_arms
    st.arm, st.rounds_left, st.warming = 0, 16, False
    assert demo.generate(prompt, **chain).token_ids == tokens
    assert calls == [4, 96], calls  # the generation's first call, off the clock, then the run


def test_a_call_of_plain_steps_is_cut_to_about_a_quarter_second_so_an_interrupt_is_seen():
    """On a model whose step takes tens of milliseconds a whole generation in one native call
    would hold off Ctrl-C for seconds: a call runs 8 steps first, then what the last call's rate
    runs in 0.25 s (never fewer than 8)."""
    from staged_engine.spec.decoders import PlainDecoder

    d = PlainDecoder(None, None, whole=True)
    assert d.call_steps(1000) == 8
    d.step_seconds = 0.01  # 10 ms a step: 25 steps in 0.25 s
    assert d.call_steps(1000) == 25 and d.call_steps(20) == 20
    d.step_seconds = 0.1
    assert d.call_steps(1000) == 8
    d.step_seconds = 2.5e-4  # the demo oracle
    assert d.call_steps(5000) == 1000
