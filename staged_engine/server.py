"""``staged-engine serve``: an OpenAI-compatible completions server over one Engine.

Endpoints: ``POST /v1/completions`` (``stream: true`` sends server-sent events), ``GET
/v1/models``, ``GET /health``. Per request: ``prompt``, ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, and the extensions ``strategy`` and ``token_healing``.

Generation runs in worker threads over the Engine's pool of generation states (``pool_size``
at once; each request has its own KV caches, so outputs equal stand-alone runs). At most
``max_queue`` more requests wait for a state; beyond that a request gets 429. A request that
runs past ``timeout`` seconds is stopped (finish_reason ``"timeout"``, or 504 without
streaming). A client that disconnects mid-stream has its generation closed and its state
returned. SIGTERM stops accepting connections, lets in-flight requests finish, and exits 0.

Built on FastAPI/Starlette and uvicorn; imported only by ``serve``.
"""

import json
import sys
import threading
import time
import uuid

from staged_engine.checks import is_int
from staged_engine.config import STRATEGIES
from staged_engine.engine import Engine

DEFAULTS = dict(max_tokens=16, temperature=1.0, top_p=1.0, strategy="staged")  # OpenAI's defaults


class RequestError(ValueError):
    """A 400: ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _number(body: dict, name: str, default, low: float, high: float | None = None, low_open: bool = False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{name} must be a number, got {json.dumps(v)}", name)
    if (v <= low if low_open else v < low) or (high is not None and v > high):
        bound = f"in ({low}, {high}]" if low_open else (f"in [{low}, {high}]" if high is not None else f">= {low}")
        raise RequestError(f"{name} must be {bound}, got {v}", name)
    return v


def parse_request(body, engine: Engine) -> dict:
    """Validate a /v1/completions body; returns the generation arguments or raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", "body")
    known = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "strategy",
             "token_healing", "n", "echo", "logprobs", "user", "stream_options", "frequency_penalty",
             "presence_penalty"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}", unknown[0])
    for name, ok in (("n", 1), ("echo", False), ("logprobs", None), ("frequency_penalty", 0), ("presence_penalty", 0)):
        if name in body and body[name] not in (ok, None):
            raise RequestError(f"{name} is not supported (only {json.dumps(ok)})", name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string", "prompt")
    n_ids = len(engine.tokenizer.encode(prompt).ids)
    if n_ids >= engine.config.n_positions:
        raise RequestError(f"prompt has {n_ids} tokens; the context window is {engine.config.n_positions}", "prompt")
    max_tokens = body.get("max_tokens", DEFAULTS["max_tokens"])
    if not is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, got {json.dumps(max_tokens)}", "max_tokens")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2 ** 63):
        raise RequestError(f"seed must be an integer in [0, 2^63), got {json.dumps(seed)}", "seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(x, str) and x for x in stop)):
        raise RequestError("stop must be a non-empty string or a list of at most 4 of them", "stop")
    strategy = body.get("strategy", DEFAULTS["strategy"])
    if strategy not in STRATEGIES or strategy in ("beam", "dsbd"):
        raise RequestError(f"strategy must be one of {[s for s in STRATEGIES if s not in ('beam', 'dsbd')]}, "
                           f"got {json.dumps(strategy)}", "strategy")
    if strategy in ("chain", "tree", "staged") and engine.draft is None:
        strategy = "plain"  # no draft loaded: speculation is not available, and plain is its output
    if strategy == "staged" and engine.ngram is None:
        strategy = "tree"
    for name in ("stream", "token_healing"):
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false, got {json.dumps(body[name])}", name)
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string", "model")
    return dict(prompt=prompt, max_new_tokens=max_tokens, strategy=strategy,
                temperature=_number(body, "temperature", DEFAULTS["temperature"], 0.0, 2.0),
                top_p=_number(body, "top_p", DEFAULTS["top_p"], 0.0, 1.0, low_open=True), seed=seed,
                token_healing=body.get("token_healing", False), stop=stop or [],
                stream=body.get("stream", False))


class StopScanner:
    """Cuts text at the first stop string; holds back a tail that could begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.sent = self.text[self.sent:cut], cut
            return out
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def flush(self) -> str:
        out, self.sent = ("" if self.stopped else self.text[self.sent:]), len(self.text)
        return out


class Limiter:
    """Requests admitted: at most ``capacity`` (running + waiting for a generation state)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        self.lock = threading.Lock()
        self.served = 0

    def enter(self) -> bool:
        with self.lock:
            if self.active >= self.capacity:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            self.served += 1


def create_app(engine: Engine, model_name: str = "staged-engine-demo", max_queue: int = 16,
               timeout: float = 120.0):
    """The ASGI application (FastAPI)."""
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="staged-engine", version="0.1.0")
    limiter = Limiter(engine._pool.size + max_queue)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                            status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active_requests": limiter.active,
                "served_requests": limiter.served, "pool_size": engine._pool.size,
                "generation_states": engine._pool.states()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "staged-engine"}]}

    def chunk(rid: str, created: int, text: str, finish: str | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return error(400, f"body: malformed JSON ({exc})", "body")
        try:
            req = parse_request(body, engine)
        except RequestError as exc:
            return error(400, str(exc), exc.param)
        if not limiter.enter():
            return error(429, f"too many requests: {limiter.capacity} are running or queued", None, "rate_limit_error")
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        deadline = time.monotonic() + timeout
        stats: dict = {}
        scanner = StopScanner(req["stop"])
        gen_args = {k: req[k] for k in ("max_new_tokens", "strategy", "temperature", "top_p", "seed",
                                        "token_healing")}
        try:
            it = await anyio.to_thread.run_sync(
                lambda: engine.stream(req["prompt"], stats=stats, **gen_args))
        except (ValueError, TimeoutError) as exc:
            limiter.leave()
            return error(400 if isinstance(exc, ValueError) else 503, str(exc))
        end = object()

        async def pieces():
            """(text, finish_reason or None) in order; closes the engine stream in every case."""
            try:
                while True:
                    if time.monotonic() > deadline:
                        yield "", "timeout"
                        return
                    piece = await anyio.to_thread.run_sync(next, it, end)
                    if piece is end:
                        tail = scanner.flush()
                        reason = "length" if stats.get("finish_reason") in ("length", "context") else "stop"
                        yield tail, reason
                        return
                    text = scanner.push(piece)
                    if scanner.stopped:
                        yield text, "stop"
                        return
                    if text:
                        yield text, None
            finally:  # shielded: on a client disconnect this runs inside a cancelled scope
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(it.close)  # frees the generation state
                    limiter.leave()

        if req["stream"]:
            async def events():
                source = pieces()
                try:
                    async for text, finish in source:
                        if text or finish:
                            yield f"data: {json.dumps(chunk(rid, created, text, finish))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # a disconnect cancels this generator: close the source now, not at GC
                    with anyio.CancelScope(shield=True):
                        await source.aclose()

            return StreamingResponse(events(), media_type="text/event-stream")
        parts, finish = [], None
        async for text, reason in pieces():
            parts.append(text)
            finish = reason or finish
        if finish == "timeout":
            return error(504, f"the generation ran past the {timeout} s request timeout", None, "timeout_error")
        out = chunk(rid, created, "".join(parts), finish)
        out["usage"] = {"prompt_tokens": stats.get("prefill_tokens", 0) + 1,
                        "completion_tokens": stats.get("new_tokens", 0),
                        "total_tokens": stats.get("prefill_tokens", 0) + 1 + stats.get("new_tokens", 0)}
        return out

    return app


def _bound_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives every thread that allocates its own malloc arena (up to 8 per core); the
    server's generation threads each grew one, and the process kept ~100 MB more after warming
    up. Two arenas are plenty for a process whose heavy buffers are torch tensors. A no-op where
    glibc's mallopt is not available."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def _freeze_startup_heap() -> None:
    """Moves what the process holds at startup (torch, which imports dynamo and triton, the
    models, the app: about 300k objects the cyclic GC tracks) to its permanent generation. A
    long-running server now and then triggers a full collection, which walked them all: 215-290 ms
    with the demo pair loaded, every stream paused, against well under a millisecond once frozen.
    What requests allocate later is collected as before. Unfrozen at exit, so that shutdown still
    frees them (triton's bindings report what is left then as leaks)."""
    import atexit
    import gc

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def serve(engine: Engine, host: str, port: int, model_name: str, max_queue: int, timeout: float,
          drain_seconds: float = 30.0) -> int:
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured signal once it has drained, so a drained SIGTERM would
        end the process as killed (-15). Draining is what SIGTERM asks of a server: exit 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    _bound_malloc_arenas()
    # Before the first request, not inside it: the models' packing and cost profiles
    # (Engine.warm_up; the first request otherwise waits ~0.3 s for them, seconds on a machine
    # that has not measured them yet).
    print("staged-engine serve: preparing the models ...", file=sys.stderr, flush=True)
    ready = engine.warm_up()
    sources = ", ".join(f"{k} {v}" for k, v in ready["profiles"].items())
    print(f"staged-engine serve: ready in {ready['seconds']:.1f} s (forward costs: {sources})",
          file=sys.stderr, flush=True)
    app = create_app(engine, model_name, max_queue, timeout)
    _freeze_startup_heap()
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=drain_seconds)
    Server(config).run()  # SIGTERM/SIGINT: stop accepting, drain in-flight requests, return
    return 0
