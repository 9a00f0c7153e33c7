"""verify.py against sampling.py: exact noise bits, choice and the tree walk equal their references."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

pytest.importorskip("triton")

from staged_engine.kernels.verify import (  # noqa: E402
    choice,
    choice_ref,
    gumbel_noise,
    gumbel_noise_ref,
    unpack_verify,
    verify_tree,
    verify_tree_ref,
)

from staged_engine.sampling import (  # noqa: E402
    NoiseTable,
    SamplingParams,
    _hash_reference,
    choose,
    noise_key,
    vocab_salt,
)
from staged_engine.sampling import gumbel_noise as sampling_gumbel_noise  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NODES = [1, 7, 33]
# (temperature, top_k, top_p): greedy, temperature only (fused kernel), top-k, top-p, both
SAMPLING = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (0.9, 0, 0.8), (0.6, 5, 0.9)]
SEEDS_POSITIONS = [(0, 0), (1, 5), (2**64 - 1, 1000), (12345, 2**33 + 7)]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _keys(seed: int, first_position: int, n: int, device) -> torch.Tensor:
    return torch.tensor([noise_key(seed, first_position + i) for i in range(n)], dtype=torch.int64,
                        device=device)


# --- the noise ---------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [1, 1000, 2500])
def test_noise_bits_are_exact(device, vocab):
    keys = torch.tensor([noise_key(s, p) for s, p in SEEDS_POSITIONS], device=device)
    bits = gumbel_noise(keys, vocab, bits=True)
    assert torch.equal(bits.cpu(), gumbel_noise_ref(keys.cpu(), vocab, bits=True))
    rng = random.Random(vocab)
    for row, (s, p) in enumerate(SEEDS_POSITIONS):  # the pure-Python hash, independently
        for tok in {0, vocab - 1, *(rng.randrange(vocab) for _ in range(20))}:
            assert int(bits[row, tok]) == _hash_reference(s, p, tok)


def test_noise_values_match_sampling(device):
    vocab = 2500
    keys = torch.tensor([noise_key(s, p) for s, p in SEEDS_POSITIONS], device=device)
    g = gumbel_noise(keys, vocab).cpu()
    g_ref = gumbel_noise_ref(keys.cpu(), vocab)
    salt = vocab_salt(vocab)
    for row, (s, p) in enumerate(SEEDS_POSITIONS):
        assert torch.equal(g_ref[row], sampling_gumbel_noise(s, p, salt))
    # bits are exact; log() may differ from torch's in the last bit
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)


# --- choice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("n", NODES)
def test_choice_matches_reference(device, n, sampling, dtype):
    temperature, top_k, top_p = sampling
    gen = torch.Generator().manual_seed(_seed(n, sampling, dtype))
    vocab = 2500 if n == 7 else 997  # 2500: several vocabulary blocks
    logits = (3 * torch.randn(n, vocab, generator=gen)).to(dtype).to(device)
    keys = _keys(42, 100, n, device)
    got = choice(logits, keys, temperature, top_k, top_p)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, choice_ref(logits, keys, temperature, top_k, top_p))


@pytest.mark.parametrize("sampling", SAMPLING)
def test_choice_equals_sampling_choose(device, sampling):
    """The engine's torch rule (sampling.choose with a NoiseTable) picks the same tokens."""
    temperature, top_k, top_p = sampling
    n, vocab, seed = 7, 1000, 2024
    logits = 2 * torch.randn(n, vocab, generator=torch.Generator().manual_seed(_seed(sampling)))
    positions = list(range(50, 50 + n))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    expect = choose(logits, positions, params, NoiseTable(seed, vocab))
    keys = torch.tensor([noise_key(seed, p) for p in positions], device=device)
    assert torch.equal(choice(logits.to(device), keys, temperature, top_k, top_p).cpu(), expect)


def test_greedy_ties_go_to_smallest_id(device):
    vocab = 5000  # three vocabulary blocks
    logits = torch.zeros(4, vocab)
    logits[0, [7, 3]] = 5.0  # tie inside one block
    logits[1, [4500, 2100]] = 5.0  # tie across blocks
    logits[2, [4999, 10]] = 5.0
    logits[3] = 1.0  # all equal
    got = choice(logits.to(device), None, 0.0).tolist()
    assert got == [3, 2100, 10, 0] == choice_ref(logits, None, 0.0).tolist()


# --- the tree walk -----------------------------------------------------------------------------

def _random_tree(n: int, vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Tokens and parents of a random tree in topological order, siblings with distinct tokens."""
    tokens, parents, kids = [rng.randrange(vocab)], [-1], [set()]
    for i in range(1, n):
        while True:
            p, t = rng.randrange(i), rng.randrange(vocab)
            if t not in kids[p]:
                break
        kids[p].add(t)
        kids.append(set())
        tokens.append(t)
        parents.append(p)
    return tokens, parents


def _walk_inputs(n, vocab, seed, temperature, device):
    """A random tree and logits that favour one child per node, so walks go deep."""
    rng = random.Random(seed)
    tokens, parents = _random_tree(n, vocab, rng)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))
    for i in range(n):
        children = [c for c in range(n) if parents[c] == i]
        if children and rng.random() < 0.85:
            logits[i, tokens[rng.choice(children)]] += 8.0 if temperature == 0 else 12.0
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    committed = 30  # L: the root sits at position L; node i chooses the token at L + depth + 1
    keys = torch.tensor([noise_key(seed, committed + depth[i] + 1) for i in range(n)], device=device)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return logits.to(device), t(tokens), t(parents), keys


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[1], SAMPLING[3]])
@pytest.mark.parametrize("n", NODES)
@pytest.mark.parametrize("trial", range(2))
def test_verify_tree_matches_reference(device, trial, n, sampling):
    temperature, top_k, top_p = sampling
    logits, tokens, parents, keys = _walk_inputs(n, 100, _seed(trial, n, sampling), temperature, device)
    packed = verify_tree(logits, tokens, parents, keys, temperature, top_k, top_p)
    expect = verify_tree_ref(logits, tokens, parents, keys, temperature, top_k, top_p)
    assert packed.shape == (n + 2,) and packed.dtype == torch.int64
    assert torch.equal(packed, expect)
    path, bonus = unpack_verify(packed)
    assert path[0] == 0 and 1 <= len(path) <= n and 0 <= bonus < 100
    chosen = choice_ref(logits, keys, temperature, top_k, top_p).tolist()
    for a, b in zip(path, path[1:]):  # every step follows the choice at its parent
        assert int(parents[b]) == a and int(tokens[b]) == chosen[a]
    assert bonus == chosen[path[-1]]


def test_verify_tree_chain_walks_to_the_end(device):
    """A chain whose every token is the oracle's argmax is accepted whole, plus the bonus."""
    n, vocab = 9, 50
    tokens = [3, 11, 7, 7, 40, 2, 0, 49, 5]
    logits = torch.zeros(n, vocab)
    for i in range(n - 1):
        logits[i, tokens[i + 1]] = 1.0
    logits[n - 1, 17] = 1.0
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    packed = verify_tree(logits.to(device), t(tokens), t([-1] + list(range(n - 1))), None, 0.0)
    assert unpack_verify(packed) == (list(range(n)), 17)
    assert packed.tolist() == [n] + list(range(n)) + [17]


def test_verify_tree_rejects_root_only_mismatch(device):
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    logits = torch.zeros(3, 10)
    logits[0, 9] = 1.0  # the root's choice is no child's token
    packed = verify_tree(logits.to(device), t([0, 1, 2]), t([-1, 0, 0]), None, 0.0)
    assert packed.tolist() == [1, 0, 9, -1, -1]


# --- input validation --------------------------------------------------------------------------

def _verify_args(device):
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return dict(logits=torch.zeros(3, 10, device=device), tokens=t([0, 1, 2]), parents=t([-1, 0, 0]),
                keys=t([1, 2, 3]), temperature=1.0)


VERIFY_BAD = [
    ("logits", lambda a: a["logits"][0]),
    ("logits", lambda a: a["logits"].t()),  # not contiguous
    ("logits", lambda a: a["logits"].to(torch.int64)),
    ("logits", lambda a: a["logits"][:0]),
    ("tokens", lambda a: a["tokens"][:2]),
    ("tokens", lambda a: a["tokens"].to(torch.int32)),
    ("parents", lambda a: a["parents"][None]),
    ("parents", lambda a: a["parents"].to("meta")),
    ("keys", lambda a: None),
    ("keys", lambda a: a["keys"][:1]),
    ("keys", lambda a: a["keys"].float()),
    ("temperature", lambda a: -1.0),
    ("temperature", lambda a: float("inf")),
]


@pytest.mark.parametrize("arg,mutate", VERIFY_BAD)
def test_verify_tree_rejects_bad_input(device, arg, mutate):
    a = _verify_args(device)
    a[arg] = mutate(a)
    with pytest.raises(ValueError, match=arg):
        verify_tree(**a)


def test_choice_rejects_bad_sampling_options(device):
    logits = torch.zeros(2, 10, device=device)
    keys = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="top_k"):
        choice(logits, keys, 1.0, top_k=-1)
    with pytest.raises(ValueError, match="top_p"):
        choice(logits, keys, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        gumbel_noise(keys, 0)
    with pytest.raises(ValueError, match="keys"):
        gumbel_noise(keys.float(), 10)


# --- CUDA only ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", SAMPLING)
def test_verify_tree_gpt2_vocab_cuda(cuda_device, sampling):
    temperature, top_k, top_p = sampling
    logits, tokens, parents, keys = _walk_inputs(128, 50257, 7, temperature, cuda_device)
    for dtype in DTYPES:
        lg = logits.to(dtype)
        assert torch.equal(verify_tree(lg, tokens, parents, keys, temperature, top_k, top_p),
                           verify_tree_ref(lg, tokens, parents, keys, temperature, top_k, top_p))
