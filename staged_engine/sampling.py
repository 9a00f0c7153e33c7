"""The engine's one sampling rule: processed distributions and position-keyed Gumbel-max.

ALGORITHMS.md sec. 2-3. For a seed s and an absolute position t, ``gumbel_noise(s, t, V)`` is a
fixed vector of V Gumbel(0, 1) variables that depends on (s, t) only. The token chosen at
position t is ``argmax(log p' + g(s, t))`` (T > 0) or ``argmax(z)`` (T = 0), with ties broken
by the smallest token id. Plain decoding and every speculative strategy call the same
``choose`` on the oracle's logits, so a seed fixes one output sequence for all of them.

The noise is a counter-based integer hash (Wellons' ``lowbias32`` finaliser, chained), chosen
because it is a handful of 32-bit operations: the torch code below and the Triton kernel in
``kernels/verify.py`` compute the same bits. ``_hash_reference`` is a pure-Python copy used
by the tests as an independent reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from staged_engine.checks import is_int

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_VOCAB_SALT = 0x632BE5AB


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int in [0, 2^32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    x ^= x >> 16
    return x


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor holding values in [0, 2^32); int64 products wrap mod 2^64,
    which keeps the low 32 bits exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the noise vector at (seed, position)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    k = mix32_int((s & _M32) ^ _GOLDEN)
    k = mix32_int(k ^ (s >> 32))
    return mix32_int(k ^ (position & _M32))


def vocab_salt(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(V,) int64: the per-token half of the hash, independent of seed and position."""
    v = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return mix32_tensor((v * _GOLDEN + _VOCAB_SALT) & _M32)


def _hash_reference(seed: int, position: int, token: int) -> int:
    """Pure-Python 32-bit hash of (seed, position, token); the tests' reference."""
    key = noise_key(seed, position)
    salt = mix32_int((token * _GOLDEN + _VOCAB_SALT) & _M32)
    return mix32_int((mix32_int(salt ^ key) + key) & _M32)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """23 hash bits -> float32 uniforms in (0, 1), exact: ((h >> 9) + 0.5) / 2^23."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_noise(seed: int, position: int, salt: torch.Tensor) -> torch.Tensor:
    """(V,) float32 Gumbel(0, 1) noise g(seed, position); ``salt`` comes from ``vocab_salt``."""
    key = noise_key(seed, position)
    h = mix32_tensor(((mix32_tensor(salt ^ key)) + key) & _M32)
    u = uniform_from_hash(h)
    return -torch.log(-torch.log(u))


@dataclass(frozen=True)
class SamplingParams:
    """How a logit vector becomes a token (ALGORITHMS.md sec. 2)."""

    temperature: float = 0.0  # 0 means greedy (argmax of the raw logits)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest prefix of the sorted distribution with mass >= top_p
    seed: int | None = None  # fixes the noise g(seed, position); None draws a random seed

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (not is_int(self.seed)
                                      or self.seed < 0 or self.seed >= 2**64):
            raise ValueError(f"seed must be an integer in [0, 2^64) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def rule(self) -> tuple:
        """(temperature, top_k, top_p, seed): what a native kernel needs to apply these."""
        return _rule(self)


def _top(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of z (..., V), descending, ties by smaller token id.

    torch.topk is far cheaper than a full sort but orders ties arbitrarily, so when any of the
    k + 1 largest values tie, the stable sort decides (exact float ties are rare).
    """
    vocab = z.shape[-1]
    if k < vocab:  # k + 1 values reveal a tie at the cut
        vals, idx = torch.topk(z, k + 1, dim=-1)
        if not (vals[..., 1:] == vals[..., :-1]).any():
            return vals[..., :k], idx[..., :k]
    vals, idx = torch.sort(z, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def kept_logprobs(logits: torch.Tensor, params: SamplingParams, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens and their log p' (top-p removals at -inf): ((..., k) float32 log
    probs in descending order, (..., k) int64 ids). Needs 0 < k <= V and temperature > 0."""
    z = logits.float() / params.temperature
    vals, idx = _top(z, k)
    logp = torch.log_softmax(vals, dim=-1)
    if params.top_p < 1.0:
        mass_before = torch.cumsum(logp.exp(), dim=-1) - logp.exp()
        logp = logp.masked_fill(mass_before >= params.top_p, float("-inf"))
        logp = torch.log_softmax(logp, dim=-1)
    return logp, idx


def _sparse(params: SamplingParams, vocab: int) -> bool:
    """Top-k keeps few tokens: only they need noise (same values, a fraction of the work)."""
    return not params.greedy and 0 < params.top_k < vocab


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """log p' for ``logits`` (..., V): softmax(z / T), then top-k, then top-p, renormalised.

    Removed tokens get -inf. Top-k keeps the k largest (ties by smaller id); top-p keeps, in
    that order, every token whose preceding cumulative mass is < top_p (so at least one).
    Returned in float32.
    """
    if params.greedy:
        raise ValueError("processed_logprobs needs temperature > 0; greedy uses the raw logits")
    vocab = logits.shape[-1]
    k = params.top_k if 0 < params.top_k < vocab else vocab
    if k == vocab and params.top_p >= 1.0:
        return torch.log_softmax(logits.float() / params.temperature, dim=-1)
    logp, idx = kept_logprobs(logits, params, k)
    out = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    return out.scatter_(-1, idx, logp)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p' as probabilities (..., V), float32; at T = 0 a one-hot on the argmax."""
    if params.greedy:
        onehot = torch.zeros_like(logits, dtype=torch.float32)
        return onehot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return processed_logprobs(logits, params).exp()


class NoiseTable:
    """Caches g(seed, t) per position for one generation; positions repeat across rounds."""

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu",
                 capacity: int = 80) -> None:
        # A round chooses at most max_depth + 2 consecutive positions (trees have <= 64 nodes),
        # so 80 vectors cover every live position; each is vocab_size floats (201 KB for GPT-2).
        self.seed = seed
        self.vocab_size, self.device = vocab_size, device
        self.capacity = capacity
        self._cache: dict[int, torch.Tensor] = {}

    @cached_property
    def salt(self) -> torch.Tensor:
        """``vocab_salt`` of the vocabulary, made on first use: the native paths hash the noise
        themselves, and a generation that never leaves them never needs it. Making it takes ~80
        us in a loop and took 0.21-0.28 ms where each sampled generation made it, before its
        first token (V 8192, AMD EPYC Zen 4); whole 128-token generations, alternating with it
        made at once, were level within the noise (1.0009x their time, a median of 120 pairs)."""
        return vocab_salt(self.vocab_size, self.device)

    def at(self, position: int) -> torch.Tensor:
        g = self._cache.get(position)
        if g is None:
            if len(self._cache) >= self.capacity:
                self._cache.pop(next(iter(self._cache)))
            g = gumbel_noise(self.seed, position, self.salt)
            self._cache[position] = g
        return g

    def rows(self, positions: list[int]) -> torch.Tensor:
        """(N, V) noise for N positions."""
        return torch.stack([self.at(p) for p in positions])

    def at_ids(self, positions: list[int], ids: torch.Tensor) -> torch.Tensor:
        """(N, k) noise g(seed, positions[i])[ids[i, j]]: the same values as ``rows(positions)``
        gathered at ``ids``, computed for those tokens only."""
        keys = torch.tensor([noise_key(self.seed, p) for p in positions], dtype=torch.int64,
                            device=ids.device).unsqueeze(1)
        h = mix32_tensor(((mix32_tensor(self.salt[ids] ^ keys)) + keys) & _M32)
        return -torch.log(-torch.log(uniform_from_hash(h)))


@dataclass(frozen=True)
class SamplingConfig:
    """One generation's sampling rule: the parameters and, when sampling, the noise table
    g(seed, position) every strategy draws with (ALGORITHMS.md sec. 3)."""

    params: SamplingParams
    noise: NoiseTable | None = None

    def __post_init__(self) -> None:
        if self.params.greedy != (self.noise is None):
            raise ValueError("SamplingConfig: a noise table goes with sampling, none with greedy decoding")

    @classmethod
    def make(cls, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu") -> "SamplingConfig":
        """The config of one generation (its seed must be set when sampling)."""
        if not params.greedy and params.seed is None:
            raise ValueError("SamplingConfig.make needs a seed when sampling")
        return cls(params, None if params.greedy else NoiseTable(params.seed, vocab_size, device))

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @cached_property
    def rule(self) -> tuple:
        """(temperature, top_k, top_p, seed): what a native kernel needs to apply this rule."""
        return _rule(self.params)

    @cached_property
    def draft_params(self) -> SamplingParams:
        """What a draft scores its children by at T > 0: the request's own rule (its temperature,
        top-k and top-p) applied to the draft's logits, over every token the rule keeps. The
        oracle's choice is the best of log p' + g over the tokens its rule keeps; the draft's guess
        is the same argmax over its own p'. Only the oracle's choice decides what is emitted.

        Drafts used to score only their 64 likeliest tokens, with no top-p cut, on the premise that
        the oracle's choice rarely lies outside them and that a cut costs a sort of the row.
        Measured on the demo pair (``staged-engine bench draft-rule``), the oracle's token lay
        outside the draft's 64 likeliest 25% of the time at T 1 / top-p 0.9 and 31% at T 1; over the
        oracle's plain sampled output on 24 held-out prompts (3,072 positions a rule, the draft
        teacher-forced) the draft's perturbed argmax was the oracle's token 62.3% of the time with
        the 64 and no cut, 63.7% over the whole row and 65.2% with the request's cut too, at T 0.8 /
        top-p 0.95; 53.5%, 57.3% and 60.6% at T 1 / top-p 0.9; 50.2% and 62.0% at T 1 (no cut to
        make); under top-k 50 the rule was already the request's. Nor did the 64 save much time:
        choosing them takes a selection over the row, and the native choice over the whole row skips
        the noise of tokens that cannot win (``pruned_best``). Over 565 rows of the demo draft's
        logits in one call (AVX2 Zen 3): a fixed chain's choice took 18 us a row with the 64, 11-12
        over the whole row, 16 with a top-p 0.95 cut at T 0.8; with its log r (planned chains:
        ``_cpu.perturbed_children``, whose normaliser needs the whole row's noise) 18, 24 and 30,
        and four children (trees) 18, 25 and 44 (38 since e4ee51f tests the candidates past the
        likeliest tokens in one pass over the row). The children's log r stays normalised over the
        tokens the top-k keeps (``draft_children``): the planner calibrates it online. A draft
        temperature of T times f proposes other tokens under the same noise, and for the demo pair
        no f is worth a knob: over 12 held-out prompts, the perturbed argmax was the oracle's token
        60.6% of the time at f 0.9 against 59.8% at f 1 (T 0.8, top-p 0.95) and 59.2% against 59.0%
        (T 1, top-k 50), and less often at every other f from 0.5 to 1.5 (measured with the 64
        candidates); under the request's own rule, at T 0.8 / top-p 0.95, f 1 was best, 65.3%
        against 64.6% at f 0.9, and at T 1 / top-k 50 f 0.9 led by 62.8% against 62.2%."""
        return self.params

    @cached_property
    def draft_rule(self) -> tuple:
        """``rule`` of ``draft_params``."""
        return _rule(self.draft_params)


def _rule(p: SamplingParams) -> tuple:
    return (float(p.temperature), int(p.top_k), float(p.top_p), 0 if p.seed is None else int(p.seed))


def choose(logits: torch.Tensor, positions: list[int], params: SamplingParams,
           noise: NoiseTable | None) -> torch.Tensor:
    """choice() of ALGORITHMS.md sec. 3 for N logit rows.

    logits: (N, V) oracle (or draft) logits; positions: the N absolute positions being chosen
    (the position of the token that will be emitted). Returns (N,) int64 token ids.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    if noise is None:
        raise ValueError("sampling at temperature > 0 needs a NoiseTable")
    sparse = perturbed_top(logits, positions, params, noise)
    if sparse is not None:
        idx, scores = sparse
        best = scores.max(dim=-1, keepdim=True).values
        return torch.where(scores == best, idx, logits.shape[-1]).min(dim=-1).values  # ties: smallest id
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)  # (N, V)
    scores = logp + noise.rows(positions)
    best = scores.argmax(dim=-1)  # the first maximum: ties go to the smallest id
    if params.top_p >= 1.0:
        return best
    # Top-p: renormalising the kept tokens shifts all their scores by one constant, so the
    # choice is the argmax of log p + g over the kept set. The unrestricted argmax is almost
    # always kept (it is, with probability about top_p), so check that first and sort the
    # vocabulary only when it is not.
    for row in range(best.shape[0]):
        c = int(best[row])
        lp = logp[row]
        before = lp > lp[c]
        before[:c] |= lp[:c] == lp[c]  # equal probability, smaller id: ranked before c
        if float(lp[before].exp().sum()) >= params.top_p:  # c is cut: choose among the kept
            cut = processed_logprobs(logits[row:row + 1], params)[0] == float("-inf")
            best[row] = scores[row].masked_fill(cut, float("-inf")).argmax()
    return best


def draft_children(logits: torch.Tensor, positions: list[int], params: SamplingParams, noise: NoiseTable,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's k best children of each row at T > 0, the torch path of
    ``_cpu.perturbed_children``: the best perturbed scores s = log p' + g among the tokens the
    rule keeps (top-k, then top-p), best first, ties to the smaller id, and log r = s - logsumexp
    of s over the tokens its top-k keeps (the top-p cut picks the children; it does not
    renormalise r). A child the cut leaves no room for has log r -inf. ((N, k) ids, (N, k) log r.)"""
    full = processed_logprobs(logits, replace(params, top_p=1.0)) + noise.rows(positions)
    norm = torch.logsumexp(full, dim=-1, keepdim=True)
    scores = full
    if params.top_p < 1.0:
        scores = full.masked_fill(processed_logprobs(logits, params) == float("-inf"), float("-inf"))
    vals, idx = _top(scores, min(k, logits.shape[-1]))
    return idx, vals - norm


def perturbed_top(logits: torch.Tensor, positions: list[int], params: SamplingParams,
                  noise: NoiseTable | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """With top-k sampling: the kept tokens and their perturbed scores log p' + g, ((N, k) ids,
    (N, k) scores); the other tokens score -inf. None when every token needs scoring."""
    if not _sparse(params, logits.shape[-1]):
        return None
    logp, idx = kept_logprobs(logits, params, params.top_k)
    return idx, logp + noise.at_ids(positions, idx)
