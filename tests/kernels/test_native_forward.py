"""The native decode path (``_cpu.NativeGPT2``: a whole forward pass in one call) against stock
torch and HF transformers, row-count independence bit for bit, weights changed in place, and
bad arguments refused with ValueError (in a subprocess, so a crash fails one test)."""
from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time

import pytest
import torch

from staged_engine.model.backend import TorchBackend as _Backend  # noqa: F401
from staged_engine.model.backend import TorchBackend, _cpu
from staged_engine.model.checkpoint import load_model
from staged_engine.model.runner import ModelRunner

from ckpt_util import bfloat16_copy, round_weights

pytestmark = pytest.mark.skipif(_cpu is None or not hasattr(_cpu, "NativeGPT2"),
                                reason="the _cpu extension is not built")

NAMES = ["odd96", "eps64", "relu80"]


def _decode(model, backend, batch: int, steps) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Run a fixed sequence of forward calls (chains, trees, pending entries, commits); return
    every call's logits and the final cache."""
    cache = model.new_cache(batch=batch)
    g = torch.Generator().manual_seed(0)
    outs = []
    vocab = model.config.vocab_size
    for n, tree, commit in steps:
        tokens = torch.randint(0, vocab, (batch, n), generator=g)
        base = cache.lengths[0] + cache.pending
        positions = torch.arange(base, base + n).expand(batch, n).contiguous()
        mask = None
        if tree:  # every node sees the pending entries and itself, not its siblings
            m = cache.pending + n
            mask = torch.zeros(n, m, dtype=torch.bool)
            mask[:, :cache.pending] = True
            mask[:, cache.pending:] = torch.eye(n, dtype=torch.bool)
        with torch.inference_mode():
            outs.append(model.forward(tokens, positions, cache, mask, backend=backend))
        if commit:
            cache.advance()
    return outs, cache.k.clone(), cache.v.clone()


STEPS = [(7, False, True), (1, False, True), (1, False, False), (4, True, False), (3, False, True), (1, False, True),
         (5, False, True), (1, False, True)]


def _checkpoint(checkpoints: dict, request, name: str) -> str:
    """The directory of a shared test checkpoint, or of this module's fixture of that name."""
    return checkpoints[name] if name in checkpoints else request.getfixturevalue(name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 3])
def test_native_matches_stock_torch(checkpoints, name, batch, monkeypatch):
    model = load_model(checkpoints[name])
    calls = []
    native = TorchBackend(native=True)
    real = native.forward_model
    monkeypatch.setattr(native, "forward_model", lambda *a: calls.append(1) or real(*a))
    a, ka, va = _decode(model, native, batch, STEPS)
    assert len(calls) == len(STEPS)
    b, kb, vb = _decode(model, TorchBackend(native=False), batch, STEPS)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert ((x - y).abs().max() / y.abs().max()).item() < 1e-5
    n = sum(s[0] for s in STEPS if s[2])
    assert torch.allclose(ka[:, :, :, :n], kb[:, :, :, :n], rtol=1e-5, atol=1e-5)
    assert torch.allclose(va[:, :, :, :n], vb[:, :, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES + ["head64", "wide80"])
def test_rows_do_not_change_a_rows_bits(checkpoints, name, request):
    """A chain of N nodes in one pass gives the very logits and K/V of N one-token passes, and a
    tree node gives the bits of the same token decoded alone after its ancestors: what exact
    speculation relies on. Heads of 64 and 40 dimensions take the value pass in several chunks
    of columns, cut one way for a lone query and another for a pair."""
    model = load_model(_checkpoint(checkpoints, request, name))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=g).tolist()
    new = torch.randint(0, model.config.vocab_size, (6,), generator=g).tolist()
    one, many = (ModelRunner(model, TorchBackend(native=True)) for _ in range(2))
    with torch.inference_mode():
        for r in (one, many):
            r.prefill(prompt)
        seq = torch.stack([one.step(t) for t in new])  # (6, V)
        chain = many.forward_nodes(new, list(range(20, 26)), None)
        assert torch.equal(seq, chain)
        many.commit(list(range(6)))
        assert torch.equal(one.cache.k[:, :, :, :26], many.cache.k[:, :, :, :26])
        assert torch.equal(one.cache.v[:, :, :, :26], many.cache.v[:, :, :, :26])
        # a tree: root r with children a, b; b's child c. Node c must equal decoding r, b, c.
        r_, a_, b_, c_ = new[:4]
        tree = many.forward_nodes([r_, a_, b_, c_], [26, 27, 27, 28],
                                  torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool))
        alone = ModelRunner(model, TorchBackend(native=True))
        alone.prefill(prompt + new)
        path = torch.stack([alone.step(t) for t in (r_, b_, c_)])
        assert torch.equal(tree[[0, 2, 3]], path)


@pytest.mark.parametrize("name", NAMES + ["head64", "wide80", "bf16"])
def test_native_matches_transformers(checkpoints, name, request):
    """40 rows and one row at a time against HF in float32 (``bf16``: a checkpoint stored in
    bfloat16, widened to float32 at load by both, and packed as bfloat16 by the native path)."""
    from transformers import GPT2LMHeadModel

    path = _checkpoint(checkpoints, request, name)
    model = load_model(path)
    backend = TorchBackend(native=True, wide_weights=False)
    assert backend.native_model(model).weight_format == ("bfloat16" if name == "bf16" else "float32")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = ModelRunner(model, backend).forward_nodes(ids[0].tolist(), list(range(40)), None)
        one = ModelRunner(model, backend)
        one.prefill(ids[0, :30].tolist())
        steps = torch.stack([one.step(t) for t in ids[0, 30:].tolist()])
        ref = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()(ids).logits[0]
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    assert ((steps - ref[30:]).abs().max() / ref.abs().max()).item() <= 1e-4


@pytest.fixture(scope="module")
def head64(tmp_path_factory) -> str:
    """Heads of 64 dimensions (the demo pair's and GPT-2's): each head's q, k and v columns are
    whole panel groups, so a thread computes its own heads' q/k/v and attends without a barrier
    in between; with a thread count that does not divide the heads, the shared path runs."""
    from ckpt_util import make_hf_checkpoint

    return make_hf_checkpoint(str(tmp_path_factory.mktemp("head64") / "m"), seed=5, vocab_size=301,
                              n_positions=96, n_embd=128, n_layer=2, n_head=2)


@pytest.fixture(scope="module")
def bf16(checkpoints, tmp_path_factory) -> str:
    """odd96 stored in bfloat16 (``bfloat16_copy``)."""
    return bfloat16_copy(checkpoints["odd96"], str(tmp_path_factory.mktemp("bf16") / "m"))


@pytest.fixture(scope="module")
def wide80(tmp_path_factory) -> str:
    """The demo draft's widths (80 features, heads of 40): a product 80 wide is 5 panels, cut for
    2 threads into groups of 2 and 3 panels (for 1 thread: 4 and 1), the MLP's 320 into 10 and
    10; the heads' columns are not whole groups, so the shared attention path runs."""
    from ckpt_util import make_hf_checkpoint

    return make_hf_checkpoint(str(tmp_path_factory.mktemp("wide80") / "m"), seed=6, vocab_size=301,
                              n_positions=96, n_embd=80, n_layer=2, n_head=2)


def _close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return ((x - y).abs().max() / y.abs().max()).item() < 1e-5


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("shape", ["head64", "wide80"])
def test_each_thread_split_gives_the_single_threads_bits(head64, wide80, shape, threads):
    """The native pass with 2 and 3 threads (3 does not divide the 2 heads, so the shared path
    runs; each product's panel groups are cut within the threads' even shares, so 3 threads and
    the 80-wide shape give groups of 1-3 panels): the very logits and committed K/V of one
    thread, on chains, trees and several cache rows, also when the weights were packed and laid
    out for the other thread count; those within 1e-5 of stock torch; and a chain's rows the
    bits of one-token passes."""
    model = load_model(head64 if shape == "head64" else wide80)
    saved = torch.get_num_threads()
    try:
        for batch in (1, 3):
            torch.set_num_threads(1)
            ref, kr, vr = _decode(model, TorchBackend(native=True), batch, STEPS)
            stock, ks, vs = _decode(model, TorchBackend(native=False), batch, STEPS)
            torch.set_num_threads(threads)
            backend = TorchBackend(native=True)  # packs, and lays the weights out, for `threads`
            out, ko, vo = _decode(model, backend, batch, STEPS)
            torch.set_num_threads(5 - threads)  # 2 <-> 3: read in another order
            other, _, _ = _decode(model, backend, batch, STEPS)
            torch.set_num_threads(threads)
            n = sum(s[0] for s in STEPS if s[2])
            assert all(torch.equal(x, y) for x, y in zip(out, ref))
            assert all(torch.equal(x, y) for x, y in zip(other, ref))
            assert torch.equal(ko[:, :, :, :n], kr[:, :, :, :n]) and torch.equal(vo[:, :, :, :n], vr[:, :, :, :n])
            assert all(_close(x, y) for x, y in zip(out, stock))
            assert _close(ko[:, :, :, :n], ks[:, :, :, :n]) and _close(vo[:, :, :, :n], vs[:, :, :, :n])
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, 301, (30,), generator=g).tolist()
        new = torch.randint(0, 301, (5,), generator=g).tolist()
        one, many = (ModelRunner(model, TorchBackend(native=True)) for _ in range(2))
        with torch.inference_mode():
            for r in (one, many):
                r.prefill(prompt)
            seq = torch.stack([one.step(t) for t in new])
            assert torch.equal(seq, many.forward_nodes(new, list(range(30, 35)), None))
            many.commit(list(range(5)))
        assert torch.equal(one.cache.k[:, :, :, :35], many.cache.k[:, :, :, :35])
        assert torch.equal(one.cache.v[:, :, :, :35], many.cache.v[:, :, :, :35])
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(params=[0, 1, 2, 3, "one_group"], ids=lambda n: f"narrow{n}" if isinstance(n, int) else n)
def narrow(request):
    """Pins how many rows a float16 register block computes in 256-bit halves (``block_narrow``,
    AVX-512 builds; the probe's choice otherwise), and restores the probe's choice afterwards.
    ``one_group``: blocks of one to three rows over one panel group each instead of several at
    once (``group_runs`` pinned off, AVX2 builds), with the probe's choice of halves. The others
    pin several groups at once, so that each case runs one form whatever a model's chooser saw."""
    try:
        if request.param == "one_group":
            _cpu.set_group_runs("off")
            yield _cpu.set_narrow_rows(-1)
        else:
            _cpu.set_group_runs("on")
            yield _cpu.set_narrow_rows(request.param)
    finally:
        _cpu.set_narrow_rows(-1)
        _cpu.set_group_runs("auto")


@pytest.mark.parametrize("weights", ["fp16-exact", "bf16-exact", "fp32"])
@pytest.mark.parametrize("name", ["odd96", "head64"])
def test_every_register_block_shape_gives_one_token_bits(checkpoints, head64, name, weights, narrow):
    """Chains of 2-40 rows cover every row-block split (one block of up to 6 rows, uneven blocks
    such as 3 + 4, many blocks) over fp16 and bf16 weights widened in registers and over fp32
    weights: each row's logits and K/V are the bits of one-token decoding on 2 threads, and within 1e-5
    of stock torch. (bf16 groups hold their panels in interleaved pairs: odd96's groups of 3
    panels on 2 AVX-512 threads end in one alone, head64's of 4 do not.) With one to three rows in 256-bit halves (``narrow``), the one-token pass and
    the chains of two and three rows (and the 3 of 3 + 4) take the narrow blocks and the rest the
    512-bit ones, so their bits must agree across the two forms; so must blocks of one to three
    rows over several panel groups at once (AVX2 builds) and over one (``one_group``)."""
    model = load_model(head64 if name == "head64" else checkpoints[name])
    fmt = {"fp16-exact": "float16", "bf16-exact": "bfloat16", "fp32": "float32"}[weights]
    if fmt != "float32":
        round_weights(model, fmt)

    def TorchBackend(native):  # 16-bit values streamed as such (not the faster packing, if timed so)
        return _Backend(native=native, wide_weights=False)

    assert TorchBackend(native=True).native_model(model).weight_format == fmt
    g = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
    new = torch.randint(0, vocab, (40,), generator=g).tolist()
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            one = ModelRunner(model, TorchBackend(native=True))
            one.prefill(prompt)
            seq = torch.stack([one.step(t) for t in new])  # (40, V), one row a pass
            for rows in (2, 3, 5, 6, 7, 8, 13, 40):
                many = ModelRunner(model, TorchBackend(native=True))
                many.prefill(prompt)
                got = many.forward_nodes(new[:rows], list(range(9, 9 + rows)), None)
                assert torch.equal(got, seq[:rows]), rows
                many.commit(list(range(rows)))
                end = 9 + rows
                assert torch.equal(many.cache.k[:, :, :, :end], one.cache.k[:, :, :, :end]), rows
                assert torch.equal(many.cache.v[:, :, :, :end], one.cache.v[:, :, :, :end]), rows
            stock = ModelRunner(model, TorchBackend(native=False))
            stock.prefill(prompt)
            assert _close(seq, stock.forward_nodes(new, list(range(9, 49)), None))
    finally:
        torch.set_num_threads(saved)


def test_weights_changed_in_place_are_picked_up_at_the_next_generation(checkpoints):
    model = load_model(checkpoints["odd96"])
    backend = TorchBackend(native=True)
    runner = ModelRunner(model, backend)
    with torch.inference_mode():
        runner.reset()
        before = runner.forward_nodes([1, 2, 3], [0, 1, 2], None)
        model.ln_f.bias.add_(1.0)  # a uniform shift of every logit by the LM head's row sums
        runner.reset()
        after = runner.forward_nodes([1, 2, 3], [0, 1, 2], None)
        ref = ModelRunner(model, TorchBackend(native=False))
        expected = ref.forward_nodes([1, 2, 3], [0, 1, 2], None)
    assert not torch.allclose(before, after)
    assert ((after - expected).abs().max() / expected.abs().max()).item() < 1e-5


def test_stock_backend_runs_no_native_pass(checkpoints, monkeypatch):
    model = load_model(checkpoints["odd96"])
    backend = TorchBackend(native=False)
    monkeypatch.setattr(backend, "native_model", lambda m: pytest.fail("the stock backend packed the model"))
    with torch.inference_mode():
        ModelRunner(model, backend).forward_nodes([1, 2, 3], [0, 1, 2], None)


@pytest.mark.parametrize("name", NAMES)
def test_the_list_path_of_a_runner_is_the_tensor_path_bit_for_bit(checkpoints, name, monkeypatch):
    """ModelRunner passes of one row go to ``forward_ids`` (lists, no module call): the same
    logits and cache bits as ``model.forward`` over tensors, chains and trees alike."""
    model = load_model(checkpoints[name])
    backend = TorchBackend(native=True)
    ref, k_ref, v_ref = _decode(model, backend, 1, STEPS)
    runner = ModelRunner(model, backend)
    runner.reset()
    tensor_calls = []
    real = backend.forward_model
    monkeypatch.setattr(backend, "forward_model", lambda *a: tensor_calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    with torch.inference_mode():
        for (n, tree, commit), want in zip(STEPS, ref):
            tokens = torch.randint(0, vocab, (1, n), generator=g)[0].tolist()  # _decode's draws
            base = runner.length + runner.pending
            mask = None
            if tree:
                m = runner.pending + n
                mask = torch.zeros(n, m, dtype=torch.bool)
                mask[:, :runner.pending] = True
                mask[:, runner.pending:] = torch.eye(n, dtype=torch.bool)
            got = runner.forward_nodes(tokens, list(range(base, base + n)), mask)
            assert torch.equal(got, want[0])
            if commit:
                runner.cache.advance()
        assert not tensor_calls
        n = runner.length  # committed slots (the others were never written)
        assert torch.equal(runner.cache.k[:, :, :, :n], k_ref[:, :, :, :n])
        assert torch.equal(runner.cache.v[:, :, :, :n], v_ref[:, :, :, :n])
        runner.reset()
        runner.prefill([3, 1, 4, 1, 5])
        step = runner.step(9)
        assert not tensor_calls
        full = model.forward(torch.tensor([[3, 1, 4, 1, 5, 9]]), torch.arange(6)[None], model.new_cache(),
                             backend=backend)[0, -1]
    assert torch.equal(step, full)


def test_fp16_exact_weights_are_streamed_as_fp16(checkpoints):
    """A checkpoint whose values fp16 holds exactly (stored in fp16) is packed as fp16, half the
    bytes, and still matches stock torch; one inexact value keeps the model in fp32."""
    model = load_model(checkpoints["odd96"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    backend = TorchBackend(native=True, wide_weights=False)
    native = backend.native_model(model)
    assert native.half
    assert native.checkpoint_bytes == native.weight_bytes
    ids, pos = [5, 9, 2, 7], [0, 1, 2, 3]
    with torch.inference_mode():
        got = ModelRunner(model, backend).forward_nodes(ids, pos, None)
        ref = ModelRunner(model, TorchBackend(native=False)).forward_nodes(ids, pos, None)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with torch.no_grad():
        model.wte.weight[0, 0] += 1e-6  # below the fp16 spacing there: not representable
    assert not TorchBackend(native=True, wide_weights=False).native_model(model).half


def test_bf16_exact_weights_are_streamed_as_bf16(checkpoints):
    """A checkpoint whose values bfloat16 holds, some of which float16 cannot (stored in bf16),
    is packed as bfloat16, half the bytes, and matches stock torch. float16 comes first where it
    holds a product's every value, so a model whose products differ is "mixed"; a value neither
    holds keeps its product in fp32."""
    model = load_model(checkpoints["odd96"])
    round_weights(model, "bfloat16")
    native = TorchBackend(native=True, wide_weights=False).native_model(model)
    assert native.half and native.weight_format == "bfloat16"
    assert native.checkpoint_bytes == native.weight_bytes
    ids, pos = [5, 9, 2, 7], [0, 1, 2, 3]
    with torch.inference_mode():
        got = ModelRunner(model, TorchBackend(native=True, wide_weights=False)).forward_nodes(ids, pos, None)
        ref = ModelRunner(model, TorchBackend(native=False)).forward_nodes(ids, pos, None)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    fc = model._layer_tensors()[0][8]
    with torch.no_grad():
        fc.copy_(fc.half().float())  # float16 values (and so bfloat16's too, most of them: not all)
    assert TorchBackend(native=True, wide_weights=False).native_model(model).weight_format == "mixed"
    with torch.no_grad():
        model.wte.weight[0, 1] += 1e-6  # neither's value: the LM head in fp32, the layers still 16-bit
    native = TorchBackend(native=True, wide_weights=False).native_model(model)
    assert not native.half and native.weight_format == "mixed"
    assert native.checkpoint_bytes == native.weight_bytes  # that value makes the head 4 bytes a weight in both


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["odd96", "head64", "wide80"])
def test_16_bit_weights_packed_as_fp32_give_the_same_bits(checkpoints, head64, wide80, name, fmt):
    """The float32 packing of float16- or bfloat16-valued weights (``wide_weights``, or where it
    timed faster) reads the same values: one-token decoding and a 7-row chain give the bits of the
    16-bit packing, logits and K/V; it streams twice the bytes, and the checkpoint's bytes stay
    those of 16 bits. Left to the backend, either packing is chosen and the choice is recorded.
    (wide80's products of 5 panels are cut into groups of 2 and 3 on 2 threads, 4 and 1 on one:
    bf16 pairs with a panel alone at the end of a group.)"""
    model = load_model({"head64": head64, "wide80": wide80}.get(name) or checkpoints[name])
    round_weights(model, fmt)
    g = torch.Generator().manual_seed(6)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (9,), generator=g).tolist()
    new = torch.randint(0, vocab, (12,), generator=g).tolist()
    out = {}
    for wide in (False, True):
        backend = TorchBackend(native=True, wide_weights=wide)
        native = backend.native_model(model)
        assert native.half != wide and native.weight_format == ("float32" if wide else fmt)
        assert native.weight_bytes == (2 if wide else 1) * native.checkpoint_bytes
        with torch.inference_mode():
            runner = ModelRunner(model, backend)
            runner.prefill(prompt)
            seq = torch.stack([runner.step(t) for t in new])
            chain = ModelRunner(model, backend)
            chain.prefill(prompt)
            rows = chain.forward_nodes(new[:7], list(range(9, 16)), None)
        n = len(prompt) + len(new)
        out[wide] = (seq, rows, runner.cache.k[:, :, :, :n].clone(), runner.cache.v[:, :, :, :n].clone())
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)
    auto = TorchBackend(native=True)
    native = auto.native_model(model)
    how = auto.packing[id(model)]
    assert how["packed"] == native.weight_format == (fmt if native.half else "float32")
    assert how["why"] == "timed" or "outgrows" in how["why"] or "unknown" in how["why"]


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> str:
    """A model whose float16 weights (7.3 MB) outgrow the L2 cache of the one thread the tests
    run on (any L2 up to 4 MB), in products of K >= 256: each prefetches ahead in its streams."""
    from ckpt_util import make_hf_checkpoint

    return make_hf_checkpoint(str(tmp_path_factory.mktemp("streams") / "m"), seed=8, vocab_size=8192,
                              n_positions=64, n_embd=256, n_layer=2, n_head=4)


def test_streaming_weights_give_the_same_bits(streams):
    """Non-temporal prefetch of the weight streams (``set_streaming``) changes where lines are
    cached, never a value: one-token decoding, a 7-row pass and a 3-node tree give the same
    logits and K/V bits either way, and those are HF transformers' within 1e-4."""
    from transformers import GPT2LMHeadModel

    model = load_model(streams)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    backend = TorchBackend(native=True, wide_weights=False)
    native = backend.native_model(model)
    assert native.half and native.weight_bytes > (4 << 20) * torch.get_num_threads()
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 8192, (9,), generator=g).tolist()
    new = torch.randint(0, 8192, (12,), generator=g).tolist()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out = {}
    forms = ["off", "on"] if _cpu.group_runs() != "off" else ["off"]  # blocks of several groups or one
    runs = [(form, on) for form in forms for on in (False, True, False)]
    try:
        for form, on in runs:
            _cpu.set_group_runs(form)
            native.set_streaming(on)
            assert native.streaming is on
            out = _stream_outputs(model, backend, prompt, new, tree, out, on)
    finally:
        _cpu.set_group_runs("auto")
    for a, b in zip(out[False], out[True]):
        assert torch.equal(a, b)
    ref = GPT2LMHeadModel.from_pretrained(streams).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
        want = ref(torch.tensor([prompt + new[:7]])).logits[0, 9:]
    assert ((out[True][1] - want).abs().max() / want.abs().max()).item() <= 1e-4


def _stream_outputs(model, backend, prompt, new, tree, out, on):
    """Logits of one-token decoding, a 7-row pass and a 3-node tree, and the K/V, checked against
    the bits of every earlier run in ``out`` (either setting, either form), which they extend."""
    with torch.inference_mode():
        runner = ModelRunner(model, backend)
        runner.prefill(prompt)
        seq = torch.stack([runner.step(t) for t in new])
        chain = ModelRunner(model, backend)
        chain.prefill(prompt)
        rows = chain.forward_nodes(new[:7], list(range(9, 16)), None)
        chain.discard()
        nodes = chain.forward_nodes(new[:3], [9, 10, 10], tree)
    n = len(prompt) + len(new)
    got = (seq, rows, nodes, runner.cache.k[:, :, :, :n].clone(), runner.cache.v[:, :, :, :n].clone())
    for seen in out.values():
        assert all(torch.equal(a, b) for a, b in zip(seen, got))
    out[on] = got
    return out


@pytest.mark.parametrize("llc,expect", [(1 << 10, True), (1 << 40, False), (0, False)])
def test_weights_that_outgrow_the_last_level_cache_stream(checkpoints, monkeypatch, llc, expect):
    """The backend streams a model's weights non-temporally exactly when they outgrow the
    last-level cache the OS reports (not when it reports none), and records it."""
    import staged_engine.model.backend as backend_mod

    monkeypatch.setattr(backend_mod, "last_level_cache_bytes", lambda: llc)
    model = load_model(checkpoints["odd96"])
    for wide in (None, False):
        backend = TorchBackend(native=True, wide_weights=wide)
        native = backend.native_model(model)
        assert native.streaming is expect
        assert backend.packing[id(model)]["streaming"] is expect


def test_packing_comparison_reads_the_clock_both_ways(checkpoints):
    """``compare_packings(a, b)`` is a's one-row pass time over b's: about level for a model
    against itself, and below 1 exactly when a is the faster (a pass that sleeps 2 ms against one
    that does not)."""
    import time

    from staged_engine.model.backend import compare_packings

    model = load_model(checkpoints["odd96"])
    native = TorchBackend(native=True, wide_weights=False).native_model(model)

    class Slow:
        def forward_ids(self, *args):
            time.sleep(0.002)
            return native.forward_ids(*args)

    assert 0.5 < compare_packings(native, native, model.config) < 2.0
    assert compare_packings(native, Slow(), model.config, rounds=3) < 0.5
    assert compare_packings(Slow(), native, model.config, rounds=3) > 2.0


def test_a_draft_s_packings_are_timed_right_after_its_oracle_s_pass(checkpoints):
    """``compare_packings(a, b, before=f)`` (a draft's comparison) times each pass right after a
    call of ``f`` (its oracle's pass), one pass a unit: a packing whose pass is slow only after
    ``f`` ran (a draft whose weights the oracle's pass evicted) loses there, and ties without."""
    import time

    from staged_engine.model.backend import compare_packings

    model = load_model(checkpoints["odd96"])
    native = TorchBackend(native=True, wide_weights=False).native_model(model)
    calls = []

    class Cold:
        """Sleeps 2 ms in its first pass after the oracle's."""
        evicted = False

        def forward_ids(self, *args):
            if Cold.evicted:
                time.sleep(0.002)
                Cold.evicted = False
            return native.forward_ids(*args)

    def oracle_pass():
        calls.append(1)
        Cold.evicted = True

    assert 0.5 < compare_packings(Cold(), native, model.config) < 2.0  # never after the oracle's pass
    assert compare_packings(Cold(), native, model.config, rounds=3, before=oracle_pass) > 2.0
    assert compare_packings(native, Cold(), model.config, rounds=3, before=oracle_pass) < 0.5
    assert len(calls) == 2 * 2 * (2 * 3 + 1)  # before every timed pass of both, warm-up round included


def test_an_engine_s_draft_is_packed_for_the_pass_after_its_oracle_s(pair, monkeypatch):
    """The Engine pairs its draft with its oracle (``Backend.pair``): the draft's packings are
    compared with the oracle's pass before each timed pass, the oracle's without, and the draft
    keeps one packing (no float32 copy for many rows, which a round would fetch again too). A
    draft packed before it was paired is packed again. The same bits either way."""
    import staged_engine.model.backend as backend_mod
    from staged_engine import Engine

    oracle, draft = load_model(pair[0]), load_model(pair[1])
    with torch.no_grad():
        for m in (oracle, draft):
            for p in m.parameters():
                p.copy_(p.half().float())
    monkeypatch.setattr(backend_mod, "last_level_cache_bytes", lambda: 1 << 40)
    seen = []

    def compare(a, b, cfg, before=None):
        if before is not None:
            out = before()
            assert out.shape == (1, oracle.config.vocab_size)
        seen.append((cfg.n_embd, before is not None))
        return 2.0 if before is not None else 0.5  # float16 faster after the oracle's pass, float32 warm

    monkeypatch.setattr(backend_mod, "compare_packings", compare)
    monkeypatch.setattr(backend_mod, "wide_crossover", lambda wide, narrow, cfg: (2, {}))  # were it asked
    backend = TorchBackend(native=True)
    ids = list(range(1, 9))
    with torch.inference_mode():
        alone = backend.native_model(draft).forward_ids(ids, list(range(8)), *_scratch(draft, 8), 0, 8, None, False)
    assert backend.packing[id(draft)]["why"] == "timed" and backend.packing[id(draft)]["packed"] == "float32"
    eng = Engine(oracle, draft=draft, backend=backend)
    with torch.inference_mode():
        paired = backend.native_model(draft).forward_ids(ids, list(range(8)), *_scratch(draft, 8), 0, 8, None, False)
    how = backend.packing[id(draft)]
    assert how["why"] == "timed after the oracle's pass" and how["packed"] == "float16"
    assert how["float32_from_rows"] is None and backend.wide_rows_model(draft) == (None, None)
    assert backend.packing[id(oracle)]["why"] == "timed" and backend.packing[id(oracle)]["packed"] == "float32"
    assert seen == [(draft.config.n_embd, False), (oracle.config.n_embd, False), (draft.config.n_embd, True)]
    assert torch.equal(alone, paired)
    pinned = TorchBackend(native=True, wide_rows=3)  # a pinned row count still holds for a draft
    Engine(oracle, draft=draft, backend=pinned)
    assert pinned.wide_rows_model(draft)[1] == 3
    assert pinned._oracle_of(draft) is oracle and pinned._oracle_of(oracle) is None
    pinned._oracles[id(oracle)] = (draft, oracle)  # as if the oracle had a collected draft's id
    assert pinned._oracle_of(oracle) is None
    out = eng.generate(ids, max_new_tokens=12, strategy="chain", stop_at_eos=False).token_ids
    assert out == Engine(oracle, backend=TorchBackend(native=False)).generate(
        ids, max_new_tokens=12, strategy="plain", stop_at_eos=False).token_ids


def _scratch(model, n):
    c = model.config
    shape = (c.n_layer, 1, c.n_head, n, c.n_embd // c.n_head)
    return torch.zeros(shape), torch.zeros(shape)


class _Counting:
    """A packed model that records the rows of every pass it runs."""

    def __init__(self, native, calls: list[int]) -> None:
        self.native, self.calls = native, calls

    def forward_ids(self, tokens, *args):
        self.calls.append(len(tokens))
        return self.native.forward_ids(tokens, *args)

    def forward(self, tokens, *args):
        self.calls.append(tokens.numel())
        return self.native.forward(tokens, *args)


@pytest.mark.parametrize("from_lists", [False, True])
def test_passes_of_many_rows_take_the_float32_packing_with_the_same_bits(streams, from_lists):
    """From ``wide_rows`` rows on, passes of a float16-packed model run on its float32 packing
    (one native call from lists after ``reset``; the tensor call without): the prompt's prefill,
    a 7-row chain and a 3-node tree go there, one-token steps stay on float16, and every logit
    and K/V entry has the bits of the float16 packing alone."""
    model = load_model(streams)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    g = torch.Generator().manual_seed(10)
    prompt = torch.randint(0, 8192, (9,), generator=g).tolist()
    new = torch.randint(0, 8192, (12,), generator=g).tolist()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    out = {}
    for wide_rows in (None, 3):
        backend = TorchBackend(native=True, wide_weights=False, wide_rows=wide_rows)
        assert backend.native_model(model).half
        calls: list[int] = []
        if wide_rows:
            entry = backend._natives[id(model)]
            assert not entry.wide.half and entry.wide_from == 3
            assert backend.packing[id(model)]["float32_from_rows"] == 3
            backend._natives[id(model)] = entry._replace(wide=_Counting(entry.wide, calls))
        else:
            assert backend.wide_rows_model(model) == (None, None)
        with torch.inference_mode():
            runner = ModelRunner(model, backend)
            chain = ModelRunner(model, backend)
            if from_lists:
                runner.reset()
                chain.reset()
            runner.prefill(prompt)
            seq = torch.stack([runner.step(t) for t in new])
            chain.prefill(prompt)
            rows = chain.forward_nodes(new[:7], list(range(9, 16)), None)
            chain.discard()
            nodes = chain.forward_nodes(new[:3], [9, 10, 10], tree)
        n = len(prompt) + len(new)
        out[wide_rows] = (seq, rows, nodes, runner.cache.k[:, :, :, :n].clone(), runner.cache.v[:, :, :, :n].clone(),
                          chain.cache.k[:, :, :, :12].clone())
        if wide_rows:
            assert calls == [9, 9, 7, 3]
    for a, b in zip(out[None], out[3]):
        assert torch.equal(a, b)


def test_the_float32_packing_for_many_rows_is_kept_where_it_measures_faster(checkpoints, monkeypatch):
    """By default (``wide_rows=0``) a float16-packed model gets a float32 packing for passes from
    the row count ``wide_crossover`` measures it faster from, recorded; none where it never
    wins, where the copy would pass ``wide_memory_cap``, or with ``wide_rows=None``."""
    import staged_engine.model.backend as backend_mod

    model = load_model(checkpoints["odd96"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    seen = []

    def crossover(wide, narrow, cfg):
        seen.append((wide.half, narrow.half))
        return found, {"2": 1.2, "4": 0.8}

    monkeypatch.setattr(backend_mod, "wide_crossover", crossover)
    found = 4
    backend = TorchBackend(native=True, wide_weights=False)
    wide, start = backend.wide_rows_model(model)
    assert start == 4 and not wide.half and seen == [(False, True)]
    assert backend.packing[id(model)]["float32_from_rows"] == 4
    assert backend.packing[id(model)]["float32_over_float16_by_rows"] == {"2": 1.2, "4": 0.8}
    found = None
    backend = TorchBackend(native=True, wide_weights=False)
    assert backend.wide_rows_model(model) == (None, None)
    assert backend.packing[id(model)]["float32_from_rows"] is None
    found = 2
    monkeypatch.setattr(backend_mod, "wide_memory_cap", lambda: 1024)
    assert TorchBackend(native=True, wide_weights=False).wide_rows_model(model) == (None, None)
    assert TorchBackend(native=True, wide_weights=False, wide_rows=5).wide_rows_model(model)[1] == 5  # pinned
    monkeypatch.setattr(backend_mod, "wide_memory_cap", lambda: 1 << 40)
    assert TorchBackend(native=True, wide_weights=False, wide_rows=None).wide_rows_model(model) == (None, None)
    assert len(seen) == 2  # never measured when capped, pinned or off


def test_the_crossover_reads_the_clock_from_few_rows_up(checkpoints):
    """``wide_crossover(a, b)``: the first row count from which a's passes beat b's twice running
    (a pass that sleeps 2 ms against one that does not), None when they never do, and counts past
    the context window are not tried."""
    import time

    from staged_engine.model.backend import WIDE_LADDER, wide_crossover

    model = load_model(checkpoints["odd96"])
    native = TorchBackend(native=True, wide_weights=False).native_model(model)

    class Slow:
        def forward_ids(self, *args):
            time.sleep(0.002)
            return native.forward_ids(*args)

    start, ratios = wide_crossover(native, Slow(), model.config)
    assert start == WIDE_LADDER[0] and list(ratios) == [str(n) for n in WIDE_LADDER[:2]]
    start, ratios = wide_crossover(Slow(), native, model.config)
    tried = [n for n in WIDE_LADDER if min(32, model.config.n_positions // 2) + n <= model.config.n_positions]
    assert start is None and list(ratios) == [str(n) for n in tried] and all(r > 1 for r in ratios.values())


def test_a_spent_budget_still_times_the_first_counts(checkpoints):
    """The budget stops a slow model's later counts, never its first ``least``: with no budget
    at all, a packing that never wins is timed at the ladder's first six counts (2-12 rows),
    and the one that wins from 2 rows is still confirmed at 3."""
    import time

    from staged_engine.model.backend import WIDE_LADDER, wide_crossover

    model = load_model(checkpoints["odd96"])
    native = TorchBackend(native=True, wide_weights=False).native_model(model)

    class Slow:
        def forward_ids(self, *args):
            time.sleep(0.002)
            return native.forward_ids(*args)

    start, ratios = wide_crossover(Slow(), native, model.config, budget=0.0)
    assert start is None and list(ratios) == [str(n) for n in WIDE_LADDER[:6]]
    start, ratios = wide_crossover(native, Slow(), model.config, budget=0.0)
    assert start == WIDE_LADDER[0] and list(ratios) == [str(n) for n in WIDE_LADDER[:2]]


class _FakeClock:
    """``time.perf_counter`` for the crossover's timing tests: passes advance it by exact
    durations, so a loaded machine (the suite's other workers) cannot reorder what they time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_crossover_is_not_swayed_by_which_packing_runs_first(checkpoints, monkeypatch):
    """Two packings of equal speed (1 ms a pass), where the pass run second in a round is 2 ms
    slower (as a pass after another packing's can be): each runs second in half the rounds, so
    neither is found faster (with an odd count of rounds one of them would be)."""
    import time

    from staged_engine.model.backend import wide_crossover

    model = load_model(checkpoints["odd96"])
    native = TorchBackend(native=True, wide_weights=False).native_model(model)
    last = []
    clock = _FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    class Timed:
        def forward_ids(self, *args):
            clock.now += 0.001 + (0.002 if last and last[-1] is not self else 0.0)
            last.append(self)
            return native.forward_ids(*args)

    start, ratios = wide_crossover(Timed(), Timed(), model.config)
    assert start is None and ratios and all(r > 1 for r in ratios.values())


def test_a_narrow_win_must_hold_over_more_rounds(checkpoints, monkeypatch):
    """A packing 0.95x the other's time over a count's first rounds (a win by less than three
    margins) and 1.10x after: timed again, it loses, at every count; one 0.80x throughout wins
    at once. Passes advance a fake clock by exact durations."""
    import time

    from staged_engine.model.backend import WIDE_LADDER, wide_crossover

    model = load_model(checkpoints["odd96"])
    calls: dict[int, int] = {}
    clock = _FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    class Spin:
        def __init__(self, early, late):
            self.early, self.late = early, late

        def forward_ids(self, ids, *args):
            if self.early != self.late:  # the first 9 passes of a count (warm-up + 8 rounds) are early
                calls[len(ids)] = calls.get(len(ids), 0) + 1
            late = calls.get(len(ids), 0) > 9
            clock.now += self.late if late else self.early

    start, ratios = wide_crossover(Spin(0.00095, 0.0011), Spin(0.001, 0.001), model.config, rows=WIDE_LADDER[:4])
    assert start is None and all(r > 1 for r in ratios.values())
    assert all(c == 9 + 17 for c in calls.values())  # every count timed again
    start, ratios = wide_crossover(Spin(0.0008, 0.0008), Spin(0.001, 0.001), model.config, rows=WIDE_LADDER[:4])
    assert start == WIDE_LADDER[0] and all(r < 0.9 for r in ratios.values())


@pytest.mark.parametrize("bad", [1, -1, 2.5, True, "4"])
def test_wide_rows_refuses_what_is_not_a_row_count(bad):
    with pytest.raises(ValueError, match="wide_rows must be None"):
        TorchBackend(native=True, wide_rows=bad)


def test_the_block_form_is_probed_once_and_can_be_pinned():
    """``narrow_rows`` is the probe's choice (0-3; 0 on 256-bit builds, which have no wider
    form); ``set_narrow_rows`` pins 0-3, returns to the probe with -1, and refuses the rest."""
    probed = _cpu.narrow_rows()
    assert probed in (0, 1, 2, 3)
    avx512 = "avx512f" in open("/proc/cpuinfo").read().split()
    try:
        assert _cpu.set_narrow_rows(3) == (3 if avx512 else 0)
        assert _cpu.narrow_rows() == (3 if avx512 else 0)
        assert _cpu.set_narrow_rows(2) == (2 if avx512 else 0)
        assert _cpu.set_narrow_rows(0) == 0
        for bad in (4, -2):
            with pytest.raises(ValueError, match="narrow_rows must be -1"):
                _cpu.set_narrow_rows(bad)
    finally:
        assert _cpu.set_narrow_rows(-1) == probed


def test_group_runs_are_chosen_per_model_in_avx2_builds_and_can_be_pinned():
    """``group_runs``: blocks of one to three rows over several panel groups at once. 'auto' by
    default in AVX2 builds (each model chooses from its passes' clock) and 'off' (absent) in
    AVX-512 ones; ``set_group_runs`` pins either form and refuses anything else."""
    avx512 = "avx512f" in open("/proc/cpuinfo").read().split()
    assert _cpu.group_runs() == ("off" if avx512 else "auto")
    try:
        assert _cpu.set_group_runs("off") == "off" and _cpu.group_runs() == "off"
        assert _cpu.set_group_runs("on") == ("off" if avx512 else "on")
        for bad in ("yes", "", "ON"):
            with pytest.raises(ValueError, match="group_runs must be 'auto', 'on' or 'off'"):
                _cpu.set_group_runs(bad)
    finally:
        assert _cpu.set_group_runs("auto") == ("off" if avx512 else "auto")


def test_a_model_choosing_its_form_pass_by_pass_gives_the_pinned_forms_bits(head64):
    """With group_runs 'auto' a model plays both forms (its first passes of each row count are
    pairs, one each way) and then the one its clock prefers: every pass's logits and cache
    entries are those of both pinned forms, bit for bit, for one to three rows."""
    model = load_model(head64)
    runner = ModelRunner(model, TorchBackend(native=True))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=g).tolist()
    avx512 = "avx512f" in open("/proc/cpuinfo").read().split()
    try:
        for rows in (1, 2, 3):
            toks = [torch.randint(0, model.config.vocab_size, (rows,), generator=g).tolist() for _ in range(12)]
            got = {}
            for mode in ("on", "off", "auto"):
                _cpu.set_group_runs(mode)
                runner.reset()
                outs = []
                with torch.inference_mode():
                    runner.prefill(prompt)
                    for t in toks:  # the first 8 passes of a row count in 'auto' compare the forms
                        logits = runner.forward_nodes(t, list(range(20, 20 + rows)), None)
                        outs.append((logits, runner.cache.k[:, :, :, 20:20 + rows].clone(),
                                     runner.cache.v[:, :, :, 20:20 + rows].clone()))
                        runner.discard()
                got[mode] = outs
            for a, b, c in zip(got["on"], got["off"], got["auto"]):
                for x, y, z in zip(a, b, c):
                    assert torch.equal(x, y) and torch.equal(x, z)
            score, pairs, passes, on_passes = runner.native.group_runs_state(rows)
            if not avx512:  # 'auto' played both forms, then one
                assert pairs >= 4 and passes == 12 and 4 <= on_passes <= 8, (rows, pairs, passes, on_passes)
    finally:
        _cpu.set_group_runs("auto")


def test_the_form_chooser_plays_the_faster_form_and_follows_a_change():
    """FormChooser's rule against a scripted clock: pairs of passes, one each way, four back to
    back, then one 32 passes on, the wait doubling after each pair that agrees with the form
    played (up to 1024) and back to 32 after one that disagrees; it plays the form whose pairs
    said faster and follows the machine when the other form becomes the faster."""
    ch = _cpu.FormChooser()

    def run(passes, on_seconds, off_seconds):
        played = []
        for _ in range(passes):
            on, role = ch.pick(1)
            played.append(on)
            ch.record(1, on, role, on_seconds if on else off_seconds)
        return played

    def pairs_at(played, form):  # where the form not played shows up: one pass of each pair
        return [i for i, on in enumerate(played) if on == form]

    first = run(8, 1.3, 1.0)
    assert sum(first) == 4  # four pairs, one pass each way
    later = run(4000, 1.3, 1.0)  # off is faster: on is played only in the pairs
    at = pairs_at(later, True)
    gaps = [b - a for a, b in zip(at, at[1:])]
    # 32, 64, .. 1024 passes played between pairs, plus the pair's two (+-1: the form that goes
    # first in a pair alternates)
    assert len(gaps) >= 6 and all(abs(g - e) <= 1 for g, e in zip(gaps, [66, 130, 258, 514, 1026, 1026]))
    assert ch.state(1)[0] == pytest.approx(math.log(1.3)) and ch.state(1)[1] == 4 + len(at)
    flipped = run(1500, 1.0, 1.3)  # now on is faster: the first pair disagrees, the next comes 32 on
    at = pairs_at(flipped, True)
    assert at[0] <= 1026 and abs(at[1] - at[0] - 34) <= 1
    assert sum(flipped[at[0] + 200:]) >= len(flipped) - at[0] - 200 - 4  # on is played, but for the pairs
    assert ch.state(2)[2] == 0  # row counts are apart
    for bad in (0, 4):
        with pytest.raises(ValueError, match="rows must be 1-3"):
            ch.pick(bad)


@pytest.mark.parametrize("out,inp", [(17, 5), (200, 96)])
def test_the_linear_kernel_alone_is_timed_as_the_decoder_packs_it(out, inp):
    """``_cpu.linear_seconds`` (bench/linear.py) times the decoder's own packing: fp16 when every
    value is fp16-exact, fp32 otherwise, padded to whole panels of output features."""
    w = (torch.randn(out, inp, generator=torch.Generator().manual_seed(0)) * 0.1).half().float()
    seconds, half, nbytes = _cpu.linear_seconds(w, 3, 5)
    lanes = 16 if "avx512f" in open("/proc/cpuinfo").read() else 8
    panels = -(-out // lanes)
    assert len(seconds) == 5 and all(s > 0 for s in seconds)
    assert half and nbytes == panels * lanes * inp * 2
    w[0, 0] += 1e-4  # not on the fp16 grid there
    _, half, nbytes = _cpu.linear_seconds(w, 1, 1)
    assert not half and nbytes == panels * lanes * inp * 4


def test_huge_page_buffers_hold_the_same_model(tmp_path):
    """A model of 2 MiB and more of packed weights, packed with huge pages advised and without
    (``set_huge_pages``): the same logits bit for bit, both within rounding of stock torch; the
    switch reports what it was set to and defaults to on."""
    from ckpt_util import make_hf_checkpoint

    assert _cpu.huge_pages()
    path = make_hf_checkpoint(str(tmp_path / "wide"), seed=3, vocab_size=3001, n_positions=64, n_embd=256,
                              n_layer=2, n_head=4)  # 1.6M + 0.8M float32 weights: ~9.5 MB packed
    ids, pos = [5, 9, 2, 7, 3000], [0, 1, 2, 3, 4]
    out = {}
    try:
        for on in (False, True):
            assert _cpu.set_huge_pages(on) is on and _cpu.huge_pages() is on
            model = load_model(path)
            backend = TorchBackend(native=True)
            with torch.inference_mode():
                out[on] = ModelRunner(model, backend).forward_nodes(ids, pos, None)
    finally:
        _cpu.set_huge_pages(True)
    assert torch.equal(out[True], out[False])
    with torch.inference_mode():
        ref = ModelRunner(model, TorchBackend(native=False)).forward_nodes(ids, pos, None)
    assert ((out[True] - ref).abs().max() / ref.abs().max()).item() < 1e-5
    seconds = _cpu.read_seconds(5 << 20, 2)  # a 5 MiB probe buffer: three huge pages
    assert len(seconds) == 2 and all(0 < s < 1 for s in seconds)


def test_the_read_probe_reports_each_read():
    seconds = _cpu.read_seconds(1 << 20, 4)
    assert len(seconds) == 4 and all(0 < s < 1 for s in seconds)


def test_the_widening_probe_reports_each_pass_and_scales_with_its_bytes():
    seconds = _cpu.widen_seconds(1 << 20, 4)
    assert len(seconds) == 4 and all(0 < s < 1 for s in seconds)
    # 64 times the bytes: the same L1-resident slices, widened 64 times as often
    small = statistics.median(_cpu.widen_seconds(64 << 10, 9))
    large = statistics.median(_cpu.widen_seconds(4 << 20, 9))
    assert large > 8 * small, (small, large)


BAD = '''
import torch
from staged_engine import _cpu
C, H = 8, 2
blocks = [torch.ones(C), torch.zeros(C), torch.zeros(3 * C, C), torch.zeros(3 * C), torch.zeros(C, C), torch.zeros(C),
          torch.ones(C), torch.zeros(C), torch.zeros(4 * C, C), torch.zeros(4 * C), torch.zeros(C, 4 * C), torch.zeros(C)]
wte, wpe = torch.randn(11, C), torch.randn(16, C)
ok = _cpu.NativeGPT2(wte, wpe, blocks, torch.ones(C), torch.zeros(C), H, 1e-5, "gelu_tanh")
k = torch.zeros(1, 1, H, 16, C // H)
t = torch.tensor([[1, 2]]); p = torch.tensor([[0, 1]])
cases = {
    "12 tensors per block": lambda: _cpu.NativeGPT2(wte, wpe, blocks[:11], torch.ones(C), torch.zeros(C), H, 1e-5, "relu"),
    "activation": lambda: _cpu.NativeGPT2(wte, wpe, blocks, torch.ones(C), torch.zeros(C), H, 1e-5, "swish"),
    "must divide": lambda: _cpu.NativeGPT2(wte, wpe, blocks, torch.ones(C), torch.zeros(C), 3, 1e-5, "relu"),
    "attn.c_attn": lambda: _cpu.NativeGPT2(wte, wpe, [blocks[0], blocks[1], torch.zeros(2 * C, C), torch.zeros(2 * C)] + blocks[4:],
                                            torch.ones(C), torch.zeros(C), H, 1e-5, "relu"),
    "float32": lambda: _cpu.NativeGPT2(wte.double(), wpe, blocks, torch.ones(C), torch.zeros(C), H, 1e-5, "relu"),
    "outside the vocabulary": lambda: ok.forward(torch.tensor([[1, 11]]), p, k, k.clone(), [0], [0], 2),
    "position": lambda: ok.forward(t, torch.tensor([[0, 16]]), k, k.clone(), [0], [0], 2),
    "slots exceed": lambda: ok.forward(t, p, k, k.clone(), [15], [15], 2),
    "last of the m entries": lambda: ok.forward(t, p, k, k.clone(), [1], [0], 2),
    "the cache must be": lambda: ok.forward(t, p, k[:, :, :1], k[:, :, :1].clone(), [0], [0], 2),
    "unit stride": lambda: ok.forward(t, p, k.transpose(3, 4), k.clone().transpose(3, 4), [0], [0], 2),
    "mask must be": lambda: ok.forward(t, p, k, k.clone(), [0], [0], 2, torch.ones(2, 3, dtype=torch.bool)),
    "one entry per row": lambda: ok.forward(t, p, k, k.clone(), [0, 0], [0], 2),
    "one entry each": lambda: ok.forward_ids([1, 2], [0], k, k.clone(), 0, 2),
    "is outside the vocabulary": lambda: ok.forward_ids([1, -1], [0, 1], k, k.clone(), 0, 2),
    "exceed the cache": lambda: ok.forward_ids([1, 2], [0, 1], k, k.clone(), 15, 2),
    "m (uncommitted": lambda: ok.forward_ids([1, 2], [0, 1], k, k.clone(), 0, 1),
    "must be (1, ": lambda: ok.forward_ids([1, 2], [0, 1], torch.zeros(1, 2, H, 16, C // H),
                                           torch.zeros(1, 2, H, 16, C // H), 0, 2),
    "nbytes must be": lambda: _cpu.read_seconds(100, 1),
    "repeats must be in": lambda: _cpu.read_seconds(1 << 16, 0),
    "nbytes must be in [4096": lambda: _cpu.widen_seconds(4095, 1),
    "repeats must be in [1, ": lambda: _cpu.widen_seconds(1 << 16, 0),
    "rows must be": lambda: _cpu.linear_seconds(torch.zeros(4, 3), 0, 1),
    "repeats must be": lambda: _cpu.linear_seconds(torch.zeros(4, 3), 1, 0),
    "weight must be 2-D": lambda: _cpu.linear_seconds(torch.zeros(4), 1, 1),
    "weight must be float32": lambda: _cpu.linear_seconds(torch.zeros(4, 3, dtype=torch.float64), 1, 1),
}
for name, call in cases.items():
    try:
        call()
    except ValueError as exc:
        assert name in str(exc), (name, str(exc))
        print("ok", name)
    else:
        raise SystemExit(f"{name}: no error")
'''


def test_bad_arguments_raise_value_error_in_a_subprocess():
    out = subprocess.run([sys.executable, "-c", BAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("ok") == 26


def test_a_dtype_the_native_path_does_not_run_falls_back_with_one_warning(checkpoints):
    model = load_model(checkpoints["odd96"]).double()
    backend = TorchBackend(native=True)
    runner, ref = ModelRunner(model, backend), ModelRunner(model, TorchBackend(native=False))
    with torch.inference_mode(), pytest.warns(UserWarning, match="float32 models") as record:
        a = runner.forward_nodes([1, 2, 3], [0, 1, 2], None)
        b = runner.forward_nodes([4], [3], None)
    assert len([w for w in record if "float32 models" in str(w.message)]) == 1
    with torch.inference_mode():
        ra = ref.forward_nodes([1, 2, 3], [0, 1, 2], None)
        rb = ref.forward_nodes([4], [3], None)
    assert torch.equal(a, ra) and torch.equal(b, rb)


NO_EXTENSION = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):  # what a CPU without AVX2 installs: no _cpu extension
    def find_spec(self, name, path=None, target=None):
        if name == "staged_engine._cpu":
            raise ImportError("blocked for the test")
        return None
sys.meta_path.insert(0, Block())
from staged_engine import Engine
from staged_engine.model import backend
assert backend._cpu is None
for _ in range(2):
    eng = Engine.from_pretrained(sys.argv[1])
    assert not eng.backend.native
    out = eng.generate([5, 6, 7], max_new_tokens=12, strategy="plain", stop_at_eos=False)
print(" ".join(map(str, out.token_ids)))
"""


def test_setup_builds_the_native_extension_only_where_the_cpu_has_avx2_fma_and_f16c():
    """setup.py's gate, read from /proc/cpuinfo's flags (here a fake file)."""
    import ast
    import io
    import pathlib

    src = pathlib.Path(__file__).resolve().parents[2] / "setup.py"
    fn = next(n for n in ast.parse(src.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "_cpu_has_avx2")
    for flags, expected in (("fpu sse2 avx avx2 fma f16c", True), ("fpu sse2 avx fma f16c", False),
                            ("fpu avx2 fma", False), ("", False)):
        ns = {"open": lambda *a, flags=flags, **k: io.StringIO(f"processor : 0\nflags\t: {flags}\n")}
        exec(compile(ast.Module([fn], []), str(src), "exec"), ns)
        assert ns["_cpu_has_avx2"]() is expected, flags


def test_without_the_native_extension_decoding_runs_on_torch_with_one_warning(checkpoints):
    """Where the extension is not built (a CPU without AVX2: see setup.py), engines run on the
    stock torch path, warn once per process however many are made, and decode the same greedy
    tokens as the native path."""
    from staged_engine import Engine

    out = subprocess.run([sys.executable, "-c", NO_EXTENSION, checkpoints["odd96"]], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.count("staged_engine._cpu is not built") == 1, out.stderr
    native = Engine.from_pretrained(checkpoints["odd96"])
    assert native.backend.native
    ref = native.generate([5, 6, 7], max_new_tokens=12, strategy="plain", stop_at_eos=False).token_ids
    assert out.stdout.split() == [str(t) for t in ref]


def test_a_tree_mask_of_the_wrong_shape_is_refused_on_both_paths(checkpoints):
    """The list path (one-row runner) and the tensor path (model.forward) check the mask in the
    same place, before any slot is reserved."""
    model = load_model(checkpoints["odd96"])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    bad = torch.ones(2, 3, dtype=torch.bool)  # 2 new tokens after 0 pending need (2, 2)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"tree_mask must be \(2, 2\)"):
            runner.forward_nodes([1, 2], [0, 1], bad)
        assert runner.pending == 0
        cache = model.new_cache()
        with pytest.raises(ValueError, match=r"tree_mask must be \(2, 2\)"):
            model.forward(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, bad)
        assert cache.pending == 0


def test_kv_prefetch_is_on_by_default_and_can_be_set():
    """``kv_ahead``: slots of software prefetch in attention's K/V streams, 8 by default;
    ``set_kv_ahead`` takes 0-1024 and refuses the rest with the argument named. (Prefetching has
    no effect on results; the bit-identity tests above run with it on.)"""
    assert _cpu.kv_ahead() == 8
    try:
        for bad in (-1, 1025):
            with pytest.raises(ValueError, match="slots must be 0-1024"):
                _cpu.set_kv_ahead(bad)
        assert _cpu.set_kv_ahead(0) == 0
    finally:
        assert _cpu.set_kv_ahead(8) == 8


def test_l2_prefetch_bound_is_64k_by_default_and_refuses_bad_values():
    """``l2_ahead``: the longest run of weight groups whose next run a two- or three-row block
    prefetches into L2, 64 KB by default; ``set_l2_ahead`` takes multiples of 64 in [0, 1 MiB] and
    refuses the rest with the argument named. (A prefetch moves no value; the bit-identity tests
    above run with it on.)"""
    assert _cpu.l2_ahead() == 65536
    try:
        for bad in (-64, 100, (1 << 20) + 64):
            with pytest.raises(ValueError, match="bytes must be a multiple of 64"):
                _cpu.set_l2_ahead(bad)
        assert _cpu.set_l2_ahead(0) == 0
    finally:
        assert _cpu.set_l2_ahead(65536) == 65536


@pytest.mark.parametrize("rows", [1, 5])
def test_a_cut_lm_head_scores_its_rows_alone(checkpoints, rows):
    """``GPT2.head_rows``: the native pass packs the LM head over token ids [0, N) alone; their
    logits are the bits of the whole head's, the rest are -inf, on the native and the stock torch
    path alike; ``NativeGPT2`` refuses a head of more rows than the vocabulary."""
    model = load_model(checkpoints["odd96"])
    vocab, n = model.config.vocab_size, 37
    ids, pos = list(range(3, 3 + rows)), list(range(rows))
    with torch.inference_mode():
        whole = ModelRunner(model, TorchBackend(native=True)).forward_nodes(ids, pos, None)
        model.head_rows = n
        try:
            cut = ModelRunner(model, TorchBackend(native=True)).forward_nodes(ids, pos, None)
            stock = ModelRunner(model, TorchBackend(native=False)).forward_nodes(ids, pos, None)
            assert model.weight_bytes() < (model.config.weight_bytes_fp32 * model.wte.weight.element_size() // 4)
        finally:
            model.head_rows = None
    assert torch.equal(cut[:, :n], whole[:, :n])
    assert torch.isneginf(cut[:, n:]).all() and torch.isneginf(stock[:, n:]).all()
    assert _close(cut[:, :n], stock[:, :n])
    native = TorchBackend(native=True).native_model(model)
    assert native is not None
    tensors = TorchBackend._model_tensors(model)
    wte, wpe, lnf_w, lnf_b, *blocks = tensors
    with pytest.raises(ValueError, match="head_rows must be 0"):
        _cpu.NativeGPT2(wte, wpe, blocks, lnf_w, lnf_b, model.config.n_head, model.config.layer_norm_epsilon,
                        model.act_kind, vocab + 1)


def test_phase_timing_counts_each_pass_and_changes_no_bit(checkpoints):
    """With ``_cpu.set_phase_timing(True)`` each native pass adds its threads' seconds per phase
    (bench/phases.py): one pass counted per pass (a call of 8 plain steps counts 8), every
    phase of a layer timed on thread 0, no thread's phases longer than the call's wall time
    measured around it, the totals starting again after each read; the logits bit for bit those
    of an untimed pass; with it off nothing is counted."""
    model = load_model(checkpoints["odd96"])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    assert runner.native is not None
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, model.config.vocab_size, (24,), generator=g).tolist()
    new = torch.randint(0, model.config.vocab_size, (3,), generator=g).tolist()
    runner.prefill(prompt)
    try:
        with torch.inference_mode():
            _cpu.set_phase_timing(False)
            off = runner.forward_nodes(new, [24, 25, 26], None)
            runner.discard()
            passes, names, seconds = _cpu.phase_seconds()
            assert passes == 0 and not any(v for row in seconds for v in row)
            assert _cpu.set_phase_timing(True) is True
            t0 = time.perf_counter()
            on = runner.forward_nodes(new, [24, 25, 26], None)
            wall = time.perf_counter() - t0
            runner.discard()
            passes, names, seconds = _cpu.phase_seconds()
            assert torch.equal(on, off)
            assert passes == 1 and names == ["norms", "qkv", "attention", "proj", "fc", "mproj", "head", "wait"]
            assert seconds and all(len(row) == len(names) for row in seconds)
            assert 0 < max(sum(row) for row in seconds) <= wall
            assert all(seconds[0][names.index(p)] > 0 for p in names[:-1]), dict(zip(names, seconds[0]))
            assert _cpu.phase_seconds()[0] == 0  # read: the totals start again
            runner.steps(new[0], 8, (0.0, 0, 1.0, 0))
            assert _cpu.phase_seconds()[0] == 8
    finally:
        _cpu.set_phase_timing(False)


def test_region_passes_write_what_forward_ids_writes_and_refuse_bad_input(checkpoints):
    """``NativeGPT2.region_passes`` (bench/phases.py --region) runs its passes back to back in one
    step region: each writes the very K/V entries one ``forward_ids`` pass over the same chain
    writes, bit for bit, and it returns one positive time a pass; each bad argument is refused
    by name, a pass past the cache after the region."""
    model = load_model(checkpoints["odd96"])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    native = runner.packing(3)
    assert native is not None
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, model.config.vocab_size, (20,), generator=g).tolist()
    new = torch.randint(0, model.config.vocab_size, (3,), generator=g).tolist()
    runner.prefill(prompt)
    k, v = runner.cache.k, runner.cache.v
    with torch.inference_mode():
        native.forward_ids(new, [20, 21, 22], k, v, 20, 3, None, False)
        want_k, want_v = k[:, 0, :, 20:23].clone(), v[:, 0, :, 20:23].clone()
        committed_k, committed_v = k[:, 0, :, :20].clone(), v[:, 0, :, :20].clone()
        k[:, 0, :, 20:23] = 0.0
        v[:, 0, :, 20:23] = 0.0
        seconds = native.region_passes(k, v, 20, new, 5)
        assert len(seconds) == 5 and all(s > 0 for s in seconds)
        assert torch.equal(k[:, 0, :, 20:23], want_k) and torch.equal(v[:, 0, :, 20:23], want_v)
        assert torch.equal(k[:, 0, :, :20], committed_k) and torch.equal(v[:, 0, :, :20], committed_v)
        for args, needle in [((20, [], 1), "tokens must hold 1-9 tokens, got 0"),
                             ((20, [1] * 10, 1), "tokens must hold 1-9 tokens, got 10"),
                             ((20, new, 0), r"passes must be in \[1, 1000000\], got 0"),
                             ((-1, new, 1), "start must be >= 0, got -1"),
                             ((runner.max_len - 1, new, 1), "exceed the cache"),
                             ((20, [model.config.vocab_size], 1), "outside the vocabulary")]:
            with pytest.raises(ValueError, match=needle):
                native.region_passes(k, v, *args)


def test_the_runner_runs_region_passes_and_leaves_its_cache_as_it_was(checkpoints):
    """``ModelRunner.region_passes`` (the benches' way in): one positive time a pass after the
    row's committed slots, the pending entries discarded after (the committed length and the
    committed entries unchanged, nothing pending), and None on the tensor path."""
    model = load_model(checkpoints["odd96"])
    runner = ModelRunner(model, TorchBackend(native=True))
    runner.reset()
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    with torch.inference_mode():
        runner.prefill(prompt)
        committed = runner.cache.k[:, 0, :, :12].clone()
        seconds = runner.region_passes([3, 4, 5], 4)
    assert len(seconds) == 4 and all(s > 0 for s in seconds)
    assert runner.length == 12 and runner.pending == 0
    assert torch.equal(runner.cache.k[:, 0, :, :12], committed)
    stock = ModelRunner(model, TorchBackend(native=False))
    stock.reset()
    assert stock.region_passes([3], 1) is None
