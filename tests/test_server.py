"""The OpenAI-compatible server, as a real process on localhost driven by the official client."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from ckpt_util import make_hf_checkpoint, perturbed_copy

pytest.importorskip("fastapi")
# The openai client builds its pydantic response models lazily, at first use, and pydantic's lazy
# build is not thread-safe: sixteen threads parsing their first completion at once can see a class
# half rebuilt ("BaseModel cannot be instantiated directly"), a client-side race that has nothing to
# do with the server under test. Build them eagerly, at import.
os.environ.setdefault("DEFER_PYDANTIC_BUILD", "false")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")  # the HTTP client the openai package ships with

from staged_engine import Engine  # noqa: E402
from staged_engine.ngram import NGramModel  # noqa: E402
from staged_engine.training.tokenizer import train_tokenizer  # noqa: E402

TEXT = ["def add(a, b):\n    return a + b\n", "for item in items:\n    print(item.name, item.value)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    tok = train_tokenizer(TEXT * 30, vocab_size=400)
    oracle = make_hf_checkpoint(str(root / "oracle"), seed=7, std=0.05, vocab_size=tok.get_vocab_size(),
                                n_positions=160, n_embd=64, n_layer=2, n_head=2)
    tok.save(str(root / "oracle" / "tokenizer.json"))
    draft = perturbed_copy(oracle, str(root / "draft"), 0.02, seed=8)
    ng = NGramModel.build([tok.encode(t).ids for t in TEXT * 3], order=3, vocab_size=tok.get_vocab_size())
    ng.save(str(root / "t.ngram"))
    return oracle, draft, str(root / "t.ngram")


def _start(model_dirs, *extra):
    oracle, draft, ngram = model_dirs
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "staged_engine.cli", "serve", "--oracle", oracle, "--draft", draft,
                             "--ngram", ngram, "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def server(model_dirs):
    proc, url = _start(model_dirs, "--pool-size", "2", "--max-queue", "32")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def local(model_dirs):
    oracle, draft, ngram = model_dirs
    return Engine.from_pretrained(oracle, draft=draft, ngram=ngram)


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


REQUESTS = [dict(prompt=TEXT[i % 3][:12 + i], max_tokens=24 + i, temperature=[0.0, 0.8, 1.0][i % 3],
                 top_p=[1.0, 0.95, 0.9][i % 3], seed=i, extra_body={"strategy": ["staged", "tree", "chain", "plain"][i % 4]})
            for i in range(16)]


def _expected(local, r):
    kw = dict(max_new_tokens=r["max_tokens"], temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"],
              strategy=r["extra_body"]["strategy"])
    return local.generate(r["prompt"], **kw).text


def test_models_and_health(server):
    c = _client(server)
    assert [m.id for m in c.models.list().data] == ["oracle"]
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_sixteen_concurrent_clients_equal_stand_alone(server, local):
    want = [_expected(local, r) for r in REQUESTS]
    # One request of each kind from this thread first, in case openai was imported before this
    # module set DEFER_PYDANTIC_BUILD: its response models are then built before the threads race.
    warm = _client(server)
    warm.completions.create(model="oracle", prompt="x", max_tokens=1)
    list(warm.completions.create(model="oracle", prompt="x", max_tokens=1, stream=True))
    got: dict[int, str] = {}
    errors: list[Exception] = []

    def one(i):
        try:
            c = _client(server)
            r = REQUESTS[i]
            if i % 2:
                pieces = c.completions.create(model="oracle", stream=True, **r)
                got[i] = "".join(p.choices[0].text for p in pieces)
            else:
                got[i] = c.completions.create(model="oracle", **r).choices[0].text
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(16)] == want


def test_stop_sequences_cut_the_text(server, local):
    c = _client(server)
    full = _expected(local, REQUESTS[0])
    stop = full[5:8]
    assert stop and stop in full
    out = c.completions.create(model="oracle", stop=[stop], **REQUESTS[0]).choices[0]
    assert out.text == full[:full.index(stop)] and out.finish_reason == "stop"
    streamed = "".join(p.choices[0].text for p in c.completions.create(model="oracle", stop=stop, stream=True,
                                                                       **REQUESTS[0]))
    assert streamed == out.text


@pytest.mark.parametrize("body,field", [
    (b"{not json", "body"),
    (json.dumps({"prompt": "def", "strategy": "warp"}).encode(), "strategy"),
    (json.dumps({"prompt": "def", "max_tokens": -3}).encode(), "max_tokens"),
    (json.dumps({"prompt": "x " * 400}).encode(), "prompt"),
    (json.dumps({"prompt": "def", "temperature": "hot"}).encode(), "temperature"),
    (json.dumps({"prompt": "def", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": ""}).encode(), "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field):
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_disconnect_mid_stream_frees_the_slot(model_dirs):
    proc, url = _start(model_dirs, "--pool-size", "1", "--max-queue", "0")
    try:
        body = {"prompt": "def add(", "max_tokens": 120, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break  # one event, then hang up
        for _ in range(100):
            if httpx.get(url + "/health").json()["active_requests"] == 0:
                break
            time.sleep(0.05)
        assert httpx.get(url + "/health").json()["active_requests"] == 0
        out = _client(url).completions.create(model="oracle", prompt="def add(", max_tokens=5, temperature=0)
        assert out.choices[0].text is not None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_sigterm_drains_in_flight_requests_and_exits_zero(model_dirs):
    proc, url = _start(model_dirs, "--pool-size", "1")
    result = {}

    def slow():
        result["r"] = httpx.post(url + "/v1/completions", json={"prompt": "def add(", "max_tokens": 140,
                                                               "temperature": 0, "strategy": "plain"}, timeout=60)

    t = threading.Thread(target=slow)
    t.start()
    for _ in range(100):
        if httpx.get(url + "/health").json()["active_requests"] == 1:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_the_startup_heap_is_frozen_and_released_at_exit(model_dirs):
    """``serve`` freezes what the process holds once the engine is loaded, so that a full
    collection skips it, and unfreezes it at exit, so that shutdown frees it without the leak
    reports extension modules (triton's bindings, which torch imports) print for what is left."""
    oracle, draft, ngram = model_dirs
    code = ("import gc, time\n"
            "from staged_engine import Engine, server\n"
            f"e = Engine.from_pretrained({oracle!r}, draft={draft!r}, ngram={ngram!r})\n"
            "e.generate('def add', max_new_tokens=4)\n"
            "assert gc.get_freeze_count() == 0\n"
            "server._freeze_startup_heap()\n"
            "print(gc.get_freeze_count())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 10_000  # torch alone brings ~150k tracked objects
    assert "leaked" not in done.stderr, done.stderr


def test_serve_prepares_the_models_before_it_accepts_requests(model_dirs, tmp_path, monkeypatch, capsys):
    """``serve`` packs the models and loads or measures their cost profiles (``Engine.warm_up``)
    before uvicorn starts accepting requests, and says so on stderr."""
    import uvicorn

    from staged_engine import server as server_module

    monkeypatch.setenv("STAGED_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(server_module, "_freeze_startup_heap", lambda: None)
    monkeypatch.setattr(server_module, "_bound_malloc_arenas", lambda *args: None)
    oracle, draft, ngram = model_dirs
    eng = Engine.from_pretrained(oracle, draft=draft, ngram=ngram)
    at_start = {}
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: at_start.update(eng.profile_sources))
    assert server_module.serve(eng, "127.0.0.1", _free_port(), "m", 4, 30.0) == 0
    assert at_start == {"oracle": "measured", "draft": "measured"}
    assert "ready in" in capsys.readouterr().err
