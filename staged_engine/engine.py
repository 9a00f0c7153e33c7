"""The public API: ``Engine.from_pretrained``, ``Engine.demo``, ``generate``, ``stream``, ``logits``."""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import torch

from staged_engine.beam.decoders import make_beam_decoder
from staged_engine.checks import check_int, is_int
from staged_engine.config import GenerationConfig, SpecConfig
from staged_engine.demo_pair import DEMO_DIR, demo_ngram
from staged_engine.model.backend import Backend, make_backend
from staged_engine.model.checkpoint import load_model, load_tokenizer
from staged_engine.model.gpt2 import GPT2
from staged_engine.model.runner import ModelRunner
from staged_engine.sampling import SamplingConfig, choose
from staged_engine.spec.cost import CostProfile, keyed_path, load_or_measure, profile_key
from staged_engine.spec.decoders import Decoder, PlainDecoder, SpeculativeDecoder
from staged_engine.spec.drafters import ModelDrafter, NGramDrafter, TreeShape
from staged_engine.spec.planner import (
    PlannerMemory,
    RoundPlanner,
    arms_for,
    dsbd_arms,
    load_memory,
    save_memory,
)

# Token healing favours keeping the prompt's own last token by this many logits, as HF
# transformers does, so that 'http' is not healed to 'https' on a whim.
HEALING_KEEP_BONUS = 1.0


class GenerationStats(TypedDict, total=False):
    """What ``generate().stats`` (and a stream's ``stats`` dict) holds after a generation."""

    strategy: str
    new_tokens: int
    finish_reason: str  # "length", "context" or "eos"
    oracle_calls: int  # oracle forward passes after the prompt
    draft_calls: int
    tokens_per_oracle_call: float
    seconds: float  # wall time of the call, prefill included
    decode_seconds: float  # after the prefill
    tokens_per_second: float  # new tokens over decode_seconds
    prefill_tokens: int
    forward_seconds: float  # inside model forward passes (oracle and drafts)
    overhead_share: float  # 1 - forward_seconds / seconds
    accepted_lengths: list[int]  # tokens emitted per round
    relative_memory_traffic: float  # weight bytes read over plain decoding's
    healed_token: int  # with token_healing: the prompt token that was replaced
    planner: dict  # planned speculation: drafted and plain rounds, calibrated acceptance, cost scales
    # beam / dsbd: num_beams, layout, beam_scores, beam_token_ids, best_beam, beam_widths, ...


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new tokens (None without a tokenizer)
    stats: GenerationStats = field(default_factory=dict)


class TextStreamer:
    """Incremental detokenizer: text pieces whose concatenation is decode(all tokens).

    A byte-level tokenizer can split one UTF-8 character across tokens; the decoded text then
    ends in U+FFFD until the last byte arrives, so such a tail is held back.
    """

    def __init__(self, decode) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, new: list[int]) -> str:
        self.tokens.extend(new)
        text = self._decode(self.tokens)
        if text.endswith("\ufffd") or len(text) <= self.emitted:
            return ""
        piece, self.emitted = text[self.emitted:], len(text)
        return piece

    def finish(self) -> str:
        text = self._decode(self.tokens)
        piece, self.emitted = text[self.emitted:], len(text)
        return piece


class StatePool:
    """A bounded pool of generation states: each holds the KV caches (model runners) of one
    generation in progress. The models' weights are shared and read-only; everything a
    generation writes lives in its state, so concurrent threads and interleaved streams never
    see each other's caches. A call that finds the pool exhausted waits for a state, up to
    ``timeout`` seconds (None: for ever), then raises TimeoutError."""

    def __init__(self, size: int, timeout: float | None) -> None:
        self.size = check_int("pool_size", size, 1)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise ValueError(f"pool_timeout must be a number >= 0 or None, got {timeout!r}")
        self.timeout = timeout
        self._free: list[dict] = []
        self._made = 0
        self._cv = threading.Condition()

    def acquire(self) -> dict:
        with self._cv:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            while not self._free and self._made >= self.size:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"all {self.size} generation states are in use (pool_size={self.size}) and none "
                        f"was freed within pool_timeout={self.timeout} s; finish or close open streams, "
                        "or construct the Engine with a larger pool_size")
                self._cv.wait(left)
            if self._free:
                return self._free.pop()
            self._made += 1
            return {}

    def release(self, state: dict) -> None:
        with self._cv:
            self._free.append(state)
            self._cv.notify()

    def states(self) -> int:
        """States allocated so far (at most ``size``)."""
        return self._made


def temperature_band(temperature: float) -> int:
    """The planner memory's band of a sampling temperature: [0, 0.4) is 0, [0.4, 0.8) 1,
    [0.8, 1.2) 2, [1.2, 1.6) 3, and 4 above (greedy is band 0)."""
    return min(4, int(temperature * 2.5 + 1e-9))


def _flush_memories(memories) -> None:
    """Save every planner memory of ``memories`` whose latest state is not on disk yet: at exit,
    when its engine is collected, when one falls out of the 32 kept."""
    for memory in list(memories):
        if memory.unsaved:
            memory.unsaved = False
            save_memory(memory.path, memory)


class Engine:
    """An oracle model, optional drafters, a tokenizer and a backend; decoding strategies on top."""

    def __init__(self, oracle: GPT2, draft: GPT2 | None = None, tokenizer=None,
                 backend: Backend | None = None, ngram=None, draft2: GPT2 | None = None,
                 pool_size: int = 4, pool_timeout: float | None = 60.0, draft_head_rows: int | None = None,
                 kv_dtype: torch.dtype | str | None = None) -> None:
        self.oracle = oracle
        self.draft = draft
        self.draft2 = draft2
        self.ngram = ngram
        self.tokenizer = tokenizer
        self.config = oracle.config
        self.device = oracle.wte.weight.device
        self.backend = backend or make_backend("auto", self.device)
        for name, m in (("draft", draft), ("draft2", draft2)):
            if m is not None and m.config.vocab_size != oracle.config.vocab_size:
                raise ValueError(f"{name} vocabulary ({m.config.vocab_size}) differs from the "
                                 f"oracle's ({oracle.config.vocab_size}); they must share a tokenizer")
        if draft2 is not None and draft is None:
            raise ValueError("draft2 needs a draft: the cascade is oracle <- draft <- draft2")
        if draft is not None:
            self.backend.pair(draft, oracle)  # the draft's passes follow the oracle's: packed for that
        if draft_head_rows is not None:
            # The draft scores only token ids below draft_head_rows (its LM head cut to those rows,
            # the rest -inf): a small draft's head is most of its weights, so each draft pass reads
            # less, while verification keeps every output exact; the draft just cannot propose
            # the rest. BPE vocabularies number tokens roughly by frequency. (DSBD's law holds
            # too: its layer rule is exact for drafts with zero-probability tokens, which the law
            # tests enumerate.) It is set on the draft model object (``GPT2.head_rows``), so
            # engines given one draft object share it. What a cut costs depends on the pair's
            # text: for the demo pair (its draft's head is 74% of the weights a pass reads) the
            # oracle's plain output on 24 held-out prompts lay below 4096 for 99.8% of greedy
            # tokens, 96.3% at T 0.8 / top-p 0.95 and 97.9% at T 1 / top-k 50, and the draft's
            # proposal was the oracle's token 76.4%, 59.9% and 60.0% of the time (76.4%, 61.0% and
            # 60.5% uncut; below 2048, 73.7%, 58.1% and 58.2%). Cut at 4096 and uncut engines
            # alternating in one process (those prompts, 128 tokens, 3 runs each, AVX2 Zen 3),
            # fixed chains of 1-3 ran 0.99-1.06x faster cut, while staged, which there drafts
            # little, moved 1.11x greedy, 0.99x and 0.97x sampling: the planner's noise. Not a
            # default until a bench weighs it where drafting plays.
            draft_head_rows = check_int("draft_head_rows", draft_head_rows, 1)
            if draft is None:
                raise ValueError("draft_head_rows needs a draft model")
            if draft_head_rows > draft.config.vocab_size:
                raise ValueError(f"draft_head_rows must be at most the vocabulary size "
                                 f"{draft.config.vocab_size}, got {draft_head_rows}")
            if draft is oracle:
                raise ValueError("draft_head_rows needs a draft other than the oracle model object")
            draft.head_rows = draft_head_rows
        # The oracle's K/V caches in float16 (``kv_dtype``): attention reads half the bytes, which at
        # long contexts is as much as the weights (demo oracle, AMD EPYC Zen 4, bench/results/
        # kv_dtype*.json: its one-row pass at 1,000 cached tokens 1.27-1.67x faster, plain decoding
        # of 853-886-token prompts 1.23-1.60x), at the price of rounding each entry to float16: the
        # logits moved up to 4.0e-4 relative from the float32 cache's (9.6e-4 past 850 tokens).
        # Every strategy still emits what plain decoding with the same cache emits. The drafts keep
        # float32 caches: theirs are small, and the demo draft's passes ran 0.95-1.00x in float16.
        # Set on the oracle model object (``GPT2.kv_dtype``), so engines given one oracle object share it.
        oracle.kv_dtype = _parse_kv_dtype(kv_dtype, oracle, self.backend)
        eos = oracle.config.eos_token_id
        self.eos_token_id = eos if isinstance(eos, int) and 0 <= eos < oracle.config.vocab_size else None
        self._pool = StatePool(pool_size, pool_timeout)
        self._healer = None
        self._healer_lock = threading.Lock()
        self._profiles: dict[str, CostProfile] = {}
        self._memories: dict[tuple, PlannerMemory] = {}
        self._profile_lock = threading.Lock()
        # Saves are at most every 5 s a memory (``_keep_memory``): what the last seconds taught
        # is kept when the engine is collected or the process exits. Without it a short-lived
        # process (the demo, a CLI call) left the memory of its first generation, and the next
        # one started from that: the demo's greedy half, restored so, ran 1.15-1.19x plain
        # against 1.35x fresh (AMD EPYC Zen 1, 3 prompts of 256 tokens).
        weakref.finalize(self, _flush_memories, self._memories.values())  # a live view
        # how each cost profile was obtained: "cached", "measured" or "re-measured"
        self.profile_sources: dict[str, str] = {}

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, oracle: str, draft: str | None = None, ngram: str | None = None,
                        device: str | torch.device = "cpu", dtype: torch.dtype | str | None = None,
                        backend: str = "auto", draft2: str | None = None, pool_size: int = 4,
                        pool_timeout: float | None = 60.0, draft_head_rows: int | None = None,
                        kv_dtype: torch.dtype | str | None = None) -> "Engine":
        """Load HF GPT-2 checkpoint directories (config.json + model.safetensors).

        ``draft2`` adds a third model stage between the draft and the n-gram model. Up to
        ``pool_size`` generations (threads, open streams) run at once, each with its own KV
        caches; another waits up to ``pool_timeout`` seconds for one to finish. With
        ``draft_head_rows`` the draft scores only token ids below it (outputs are unchanged).
        ``kv_dtype="float16"`` keeps the oracle's K/V cache in float16 (CPU, float32 weights):
        faster at long contexts, its logits rounded (every strategy still equals plain decoding).
        """
        dev = _parse_device(device)
        dt = _parse_dtype(dtype, dev)
        be = make_backend(backend, dev)
        oracle_model = load_model(oracle, dev, dt)
        draft_model = load_model(draft, dev, dt) if draft is not None else None
        draft2_model = load_model(draft2, dev, dt) if draft2 is not None else None
        tokenizer = load_tokenizer(oracle)
        ngram_model = None
        if ngram is not None:
            from staged_engine.ngram import NGramModel

            ngram_model = NGramModel.load(ngram)
            if ngram_model.vocab_size > oracle_model.config.vocab_size:
                raise ValueError(f"ngram file {ngram}: vocabulary {ngram_model.vocab_size} exceeds "
                                 f"the oracle's {oracle_model.config.vocab_size}")
        return cls(oracle_model, draft_model, tokenizer, be, ngram_model, draft2_model, pool_size, pool_timeout,
                   draft_head_rows, kv_dtype)

    @classmethod
    def demo(cls, device: str | torch.device = "cpu", backend: str = "auto", ngram: bool = True,
             pool_size: int = 4, pool_timeout: float | None = 60.0, draft_head_rows: int | None = None,
             kv_dtype: torch.dtype | str | None = None) -> "Engine":
        """The embedded default pair shipped inside the package (nothing is downloaded).

        With ``ngram`` the staged n-gram stage is loaded from the local cache, or built from the
        stdlib training split on first use (tens of seconds, once).
        """
        oracle_dir = os.path.join(DEMO_DIR, "oracle")
        if not os.path.isfile(os.path.join(oracle_dir, "model.safetensors")):
            raise FileNotFoundError(f"the demo models are not in this build: {oracle_dir}")
        draft_dir = os.path.join(DEMO_DIR, "draft")
        eng = cls.from_pretrained(oracle_dir, draft=draft_dir, device=device, backend=backend,
                                  pool_size=pool_size, pool_timeout=pool_timeout, draft_head_rows=draft_head_rows,
                                  kv_dtype=kv_dtype)
        if ngram:
            eng.ngram = demo_ngram(os.path.join(oracle_dir, "tokenizer.json"))
        return eng

    # ---------------------------------------------------------------- inputs
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt`` (a string needs a tokenizer), validated against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must hold at least one token")
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the checkpoint has no tokenizer.json; "
                                 "pass a sequence of token ids")
            ids = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point():
                raise ValueError(f"prompt tensor must be 1-D integer token ids, got shape "
                                 f"{tuple(prompt.shape)} dtype {prompt.dtype}")
            ids = prompt.tolist()
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        vocab = self.config.vocab_size
        for t in ids:
            if not is_int(t) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        if len(ids) >= self.config.n_positions:
            raise ValueError(f"prompt has {len(ids)} tokens but the context window is "
                             f"{self.config.n_positions}: at most {self.config.n_positions - 1} "
                             "prompt tokens leave room to generate")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---------------------------------------------------------------- decoding
    def _runner(self, state: dict, key: str, model: GPT2) -> ModelRunner:
        runner = state.get(key)
        if runner is None:
            runner = ModelRunner(model, self.backend)
            state[key] = runner
        return runner

    def memory(self) -> dict:
        """Bytes of the shared weights, of the backend's packings of them built so far (the
        native path's float16 or float32 copy, and the float32 one for passes of many rows), of
        one generation state (the KV caches of every model), and in total with the states
        allocated so far (at most ``pool_size``)."""
        def cache_bytes(m: GPT2 | None) -> int:
            if m is None:
                return 0
            c = m.config
            size = (m.kv_dtype or m.wte.weight.dtype).itemsize
            return 2 * c.n_layer * c.n_positions * c.n_embd * size

        weights = sum(sum(p.numel() * p.element_size() for p in m.parameters())
                      for m in (self.oracle, self.draft, self.draft2) if m is not None)
        packed = sum(self.backend.packed_bytes(m) for m in (self.oracle, self.draft, self.draft2) if m is not None)
        per_state = sum(cache_bytes(m) for m in (self.oracle, self.draft, self.draft2))
        return {"weights": weights, "packed": packed, "per_state": per_state, "pool_size": self._pool.size,
                "states_allocated": self._pool.states(),
                "total": weights + packed + per_state * self._pool.states()}

    def cost_profile(self, which: str = "oracle", force: bool = False) -> CostProfile:
        """The measured forward cost of ``which`` ("oracle", "draft" or "draft2") on this
        machine: loaded from the user's cache, or measured (about a second) and cached. ``force``
        measures it again."""
        model = {"oracle": self.oracle, "draft": self.draft, "draft2": self.draft2}.get(which)
        if model is None:
            raise ValueError(f"which must name a model this engine has ('oracle', 'draft', 'draft2'), got {which!r}")
        with self._profile_lock:
            prof = None if force else self._profiles.get(which)
            if prof is None:
                with torch.inference_mode():
                    prof, how = load_or_measure(model, self.backend, lambda: ModelRunner(model, self.backend),
                                                force=force)
                self.profile_sources[which] = how
                self._profiles[which] = prof
            return prof

    def warm_up(self) -> dict:
        """Do now what a process's first request would otherwise wait for: pack each model for the
        native path (which times its packings to choose one) and load its cost profile, or measure
        it (about a second a model, once per machine and build). A server calls this before it
        accepts requests: on the AVX2 Zen 1 the demo pair's first staged request of 32 tokens
        took 298-391 ms without it and 26-36 ms after it (the warm-up 265-307 ms, profiles
        cached). Returns the seconds it took and where each profile came from."""
        t0 = time.perf_counter()
        for which, model in (("oracle", self.oracle), ("draft", self.draft), ("draft2", self.draft2)):
            if model is not None:
                self.cost_profile(which)
        return {"seconds": time.perf_counter() - t0, "profiles": dict(self.profile_sources)}

    def _planner_memory(self, config: GenerationConfig, costs: tuple[CostProfile, CostProfile]) -> PlannerMemory:
        """What the planner learned so far for this strategy and shape, greedy or sampling in a
        band of temperatures (kept for the 32 most recent combinations). Temperatures share one
        memory within a band of 0.4 (T 0.8 and 1.0 do, not 0.8 and 1.2): whether drafting pays
        moves little within a band, and a request should not start from scratch for a small
        change, but at T 1.2 the draft's chains that paid at T 0.8 lose to plain steps (0.95x
        plain measured with one shared memory). A new one starts from what an earlier process
        kept on disk for these models on this machine (``spec.planner.load_memory``)."""
        band = temperature_band(config.params.temperature)
        spec = config.spec
        key = (config.strategy, spec.shape, spec.ngram_widths, spec.draft_window, config.params.greedy, band)
        return self._memory(key, lambda: {
            "schema": 6, "oracle": costs[0].key, "draft": costs[1].key, "strategy": config.strategy,
            "shape": vars(spec.shape), "ngram_widths": list(spec.ngram_widths), "draft_window": spec.draft_window,
            "greedy": config.params.greedy, "temperature_band": band},
            arms_for(config.strategy == "staged", config.params.greedy))

    def _dsbd_memory(self, config: GenerationConfig) -> PlannerMemory:
        """DSBD's planner memory for this width, layout and set of knobs, greedy or sampling;
        on disk keyed by the models and this machine as the profiles are."""
        cfg, layout, window = config.beam.dsbd, config.beam.layout, config.beam.draft_window
        key = ("dsbd", layout, cfg, window, config.params.greedy)
        return self._memory(key, lambda: {
            "schema": 2, "oracle": profile_key(self.oracle, self.backend),
            "draft": profile_key(self.draft, self.backend), "strategy": "dsbd", "layout": layout,
            "dsbd": vars(cfg), "draft_window": window, "greedy": config.params.greedy}, dsbd_arms(cfg.gamma))

    def _memory(self, key: tuple, disk_key, arms) -> PlannerMemory:
        """The memory kept in process under ``key`` (the 32 most recent), else the one on disk
        under ``disk_key()`` (built only then: it hashes the models' weights), else a new one."""
        with self._profile_lock:
            memory = self._memories.pop(key, None)
            if memory is None:
                path = keyed_path("planner", disk_key())
                memory = load_memory(path, arms)
                memory.path = path
            self._memories[key] = memory  # most recent last
            dropped = [self._memories.pop(next(iter(self._memories))) for _ in range(len(self._memories) - 32)]
        _flush_memories(dropped)
        return memory

    def _keep_memory(self, memory: PlannerMemory) -> None:
        """Save what a generation's planner learned, at most every 5 seconds per memory (until
        then it is marked ``unsaved``: see ``_flush_memories``)."""
        now = time.monotonic()
        if memory.saved_at and now - memory.saved_at < 5.0:
            memory.unsaved = True
            return
        memory.saved_at, memory.unsaved = now, False
        save_memory(memory.path, memory)

    def _check_shape(self, config: GenerationConfig) -> None:
        """A pinned shape must fit the context window; the error names the option."""
        spec = config.spec
        if spec is None:
            return
        n_ctx = self.config.n_positions
        depth_name = "chain_length" if config.strategy == "chain" else "max_depth"
        if spec.shape.max_depth > n_ctx - 2:
            raise ValueError(f"{depth_name}={spec.shape.max_depth} cannot fit the context window of "
                             f"{n_ctx} tokens: it must be at most {n_ctx - 2}")
        if config.strategy != "chain" and spec.shape.budget > n_ctx:
            raise ValueError(f"budget={spec.shape.budget} cannot fit the context window of {n_ctx} "
                             f"tokens: it must be at most {n_ctx}")

    def _decoder(self, state: dict, config: GenerationConfig, sampling: SamplingConfig,
                 whole: bool = False) -> Decoder:
        """The generation's decoder. ``whole``: nobody reads the tokens before the generation
        ends (``generate``), so plain steps run as long a native call as they can (a stream takes
        its pieces every few tokens)."""
        oracle = self._runner(state, "oracle", self.oracle)
        if config.spec is not None:
            drafter = self._drafter(state, config.strategy, config.spec, sampling)
            factory = None
            if config.spec.adaptive:
                costs = (self.cost_profile("oracle"), self.cost_profile("draft"))
                memory = self._planner_memory(config, costs)
                factory = lambda: RoundPlanner(*costs, memory)  # noqa: E731
            stop = self.eos_token_id if config.stop_at_eos else None
            return SpeculativeDecoder(oracle, sampling, drafter, config.strategy, factory, stop, whole=whole)
        if config.beam is not None:
            memory = None
            if config.beam.adaptive and config.strategy == "dsbd" and self.draft is not None:
                memory = self._dsbd_memory(config)
            return make_beam_decoder(self, config.strategy, sampling, config.num_beams, config.beam, memory)
        return PlainDecoder(oracle, sampling, self.eos_token_id if config.stop_at_eos else None, whole=whole)

    def _drafter(self, state: dict, strategy: str, spec: SpecConfig, sampling: SamplingConfig) -> ModelDrafter:
        if self.draft is None:
            raise ValueError(f"strategy {strategy!r} needs a draft model (Engine.from_pretrained(draft=...))")
        inner = None
        if strategy == "staged":
            inner = NGramDrafter(self._ngram_model(), spec.ngram_widths, spec.ngram_learn)
            if self.draft2 is not None:
                inner = ModelDrafter(self._runner(state, "draft2", self.draft2), sampling,
                                     TreeShape(budget=8, max_depth=4, children=2, expand=2), inner)
        return ModelDrafter(self._runner(state, "draft", self.draft), sampling, spec.shape, inner, spec.draft_window)

    def _ngram_model(self):
        if self.ngram is None:
            raise ValueError("strategy 'staged' needs an n-gram model: pass ngram= to "
                             "Engine.from_pretrained (build one with `staged-engine ngram-build`)")
        return self.ngram

    def healer(self):
        """The token-healing helper of this engine's tokenizer (built on first use)."""
        with self._healer_lock:
            if self._healer is None:
                if self.tokenizer is None:
                    raise ValueError("token_healing needs a tokenizer (tokenizer.json in the oracle directory)")
                from staged_engine.healing import TokenHealer

                self._healer = TokenHealer(self.tokenizer, self.config.vocab_size)
            return self._healer

    def _heal(self, ids: list[int], sampling: SamplingConfig) -> tuple[list[int], int] | None:
        """(prompt without its last token, the healed first token), or None when there is nothing
        to heal (a one-token prompt, or a last token with no byte-level extension)."""
        if len(ids) < 2:
            return None
        allowed = self.healer().extensions(ids[-1])
        if not allowed:
            return None
        trimmed = ids[:-1]
        logits = self.logits(trimmed)[-1]
        masked = self.healer().mask(logits, allowed)
        masked[ids[-1]] += HEALING_KEEP_BONUS
        return trimmed, int(choose(masked[None], [len(trimmed)], sampling.params, sampling.noise)[0])

    def _rounds(self, prompt, config: GenerationConfig, stats: dict, whole: bool = False) -> Iterator[list[int]]:
        """Yield the new tokens of each round; fills ``stats`` as it goes. With token healing the
        first yield is the healed token alone, and ``stats["healed_token"]`` names the prompt
        token it replaced. ``whole``: the caller reads the tokens only at the end (``_decoder``)."""
        ids = self.encode(prompt)
        self._check_shape(config)
        sampling = SamplingConfig.make(config.params, self.config.vocab_size, self.device)
        state = self._pool.acquire()
        try:
            yield from self._generate_in(state, ids, sampling, config, stats, whole)
        finally:  # also when a stream is closed, garbage-collected or abandoned mid-way
            self._pool.release(state)

    def _generate_in(self, state: dict, ids: list[int], sampling: SamplingConfig, config: GenerationConfig,
                     stats: dict, whole: bool = False) -> Iterator[list[int]]:
        decoder = self._decoder(state, config, sampling, whole)
        strategy, max_new_tokens, stop_at_eos = config.strategy, config.max_new_tokens, config.stop_at_eos
        n_ctx = self.config.n_positions
        t0 = time.perf_counter()
        produced = 0
        finish = "length"
        # Inference mode is entered per model call, never held across a yield: a generator
        # suspended inside the context would leave it switched on (or off) for whatever code
        # runs next on this thread, such as another stream or the caller's own model code.
        with torch.inference_mode():
            healed = self._heal(ids, sampling) if config.token_healing else None
        if healed is not None:
            stats["healed_token"] = ids[-1]
            ids = healed[0] + [healed[1]]
            produced = 1
            yield [healed[1]]
        with torch.inference_mode():
            decoder.start(ids)
        prefill_seconds = time.perf_counter() - t0
        prefill_calls = decoder.oracle.calls
        # What the prompt's passes took, kept apart: the decode's forward time is what follows.
        prefill_forward, prefill_draft = decoder.oracle.forward_seconds, decoder.draft_seconds()
        while True:
            remaining = min(max_new_tokens - produced, n_ctx - len(ids) - produced + (healed is not None))
            if remaining <= 0:
                finish = "length" if produced >= max_new_tokens else "context"
                break
            with torch.inference_mode():
                new = decoder.round(remaining)[:remaining]
            if stop_at_eos and self.eos_token_id is not None and self.eos_token_id in new:
                new = new[:new.index(self.eos_token_id) + 1]
                produced += len(new)
                yield new
                finish = "eos"
                break
            produced += len(new)
            yield new
        seconds = time.perf_counter() - t0
        oracle = decoder.oracle
        calls = oracle.calls - prefill_calls
        forward = oracle.forward_seconds + decoder.draft_seconds()
        stats.update(
            strategy=strategy, new_tokens=produced, oracle_calls=calls,
            draft_calls=decoder.draft_calls(),
            tokens_per_oracle_call=(produced - (healed is not None)) / calls if calls else 0.0,
            seconds=seconds, decode_seconds=seconds - prefill_seconds,
            tokens_per_second=produced / max(seconds - prefill_seconds, 1e-9),
            prefill_tokens=len(ids) - 1 - (healed is not None), finish_reason=finish,
            forward_seconds=forward,
            oracle_decode_seconds=oracle.forward_seconds - prefill_forward,
            draft_decode_seconds=decoder.draft_seconds() - prefill_draft,
            overhead_share=max(0.0, 1.0 - forward / seconds) if seconds > 0 else 0.0,
            accepted_lengths=list(decoder.accepted_lengths),
        )
        stats.update(decoder.extra_stats())
        planner = getattr(decoder, "planner", None)
        if planner is not None:
            self._keep_memory(planner.m)
        if getattr(decoder, "memory", None) is not None:
            self._keep_memory(decoder.memory)
        oracle_bytes = oracle.model.weight_bytes()
        if produced:
            stats["relative_memory_traffic"] = (
                calls * oracle_bytes + decoder.draft_weight_bytes()) / (produced * oracle_bytes)

    def generate(self, prompt, max_new_tokens: int = 128, strategy: str = "staged",
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, num_beams: int = 1, stop_at_eos: bool = True,
                 token_healing: bool = False, **options) -> GenerationResult:
        """Generate up to ``max_new_tokens`` new tokens; see README for strategies and options.

        With ``token_healing`` the prompt's last token is removed and the first new token is
        constrained to start with its bytes; ``token_ids`` then begins with that token and
        ``text`` is what follows the prompt."""
        config = GenerationConfig.make(strategy, max_new_tokens, temperature, top_k, top_p, seed, num_beams,
                                       stop_at_eos, token_healing, **options)
        stats: GenerationStats = {}
        tokens: list[int] = []
        for new in self._rounds(prompt, config, stats, whole=True):
            tokens.extend(new)
        return GenerationResult(tokens, self._text(tokens, stats), stats)

    def _text(self, tokens: list[int], stats: dict) -> str | None:
        if "healed_token" in stats and tokens:
            return self.healer().text_after(stats["healed_token"], tokens)
        return self.decode(tokens)

    def stream(self, prompt, max_new_tokens: int = 128, strategy: str = "staged",
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, num_beams: int = 1, stop_at_eos: bool = True,
               token_healing: bool = False, stats: dict | None = None, **options) -> Iterator[str]:
        """Text pieces as rounds complete; never splits a UTF-8 character. Needs a tokenizer.

        ``stats``, if given, is a dict this stream fills with the generation's statistics (the
        same keys as ``generate().stats``) when it ends."""
        if self.tokenizer is None:
            raise ValueError("stream needs a tokenizer (tokenizer.json in the oracle directory)")
        if stats is None:
            stats = {}
        elif not isinstance(stats, dict):
            raise ValueError(f"stats must be a dict or None, got {type(stats).__name__}")
        config = GenerationConfig.make(strategy, max_new_tokens, temperature, top_k, top_p, seed, num_beams,
                                       stop_at_eos, token_healing, **options)
        streamer = TextStreamer(lambda toks: self._text(toks, stats))
        for new in self._rounds(prompt, config, stats):
            piece = streamer.push(new)
            if piece:
                yield piece
        piece = streamer.finish()
        if piece:
            yield piece

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """(len, V) float32 oracle logits at every position of one plain forward pass."""
        ids = self.encode(token_ids)
        if len(ids) > self.config.n_positions:
            raise ValueError(f"token_ids has {len(ids)} tokens; the context window is {self.config.n_positions}")
        with torch.inference_mode():
            cache = self.oracle.new_cache(batch=1, max_len=len(ids))
            x = torch.tensor([ids], dtype=torch.int64, device=self.device)
            pos = torch.arange(len(ids), device=self.device)[None]
            return self.oracle(x, pos, cache, backend=self.backend)[0].float()


def _parse_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be like 'cpu' or 'cuda:0', got {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


# The names ``dtype`` and ``kv_dtype`` take.
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _parse_kv_dtype(kv_dtype, oracle: GPT2, backend: Backend) -> torch.dtype | None:
    """The oracle's K/V cache dtype for ``GPT2.kv_dtype``: None (the weights' dtype, the default)
    or float16 (under float32 weights, on the torch backend: the Triton kernels keep the cache in
    the model's dtype)."""
    if kv_dtype is None:
        return None
    dt = _DTYPES.get(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if dt not in (torch.float32, torch.float16):
        raise ValueError(f"kv_dtype must be None, 'float32' or 'float16', got {kv_dtype!r}")
    weights = oracle.wte.weight.dtype
    if dt == weights:
        return None
    if weights != torch.float32:
        raise ValueError(f"kv_dtype={kv_dtype!r} needs float32 weights (dtype='float32'); the oracle's are "
                         f"{str(weights).replace('torch.', '')}")
    if getattr(backend, "name", "") != "torch":
        raise ValueError(f"kv_dtype={kv_dtype!r} runs on the torch backend (CPU); the {backend.name} backend "
                         "keeps the cache in the model's dtype")
    return dt


def _parse_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    return dtype
