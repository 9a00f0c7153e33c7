"""Load on `staged-engine serve`: N concurrent clients for a fixed time, on localhost.

Starts the server as its own process (the demo pair by default), then N client threads send
completions requests drawn in turn from a fixed set (greedy and seeded sampling, streamed and
not, several strategies) until the time is up. Every response is compared with the same request
generated stand-alone in this process. Reports requests/s, p50/p99 time to first token and
latency, tokens/s, errors, mismatches and the server's RSS over time; writes
bench/results/serve_load.json.

    python bench/serve_load.py --clients 16 --seconds 60 --pool-size 1 2 4
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time

from common import load_prompts, machine, progress, publish, run_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _requests(n: int, max_tokens: int) -> list[dict]:
    prompts = [p["prompt"] for p in load_prompts(["heldout", "humaneval"], n)]
    modes = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.95), dict(temperature=1.0)]
    strategies = ["staged", "plain", "tree", "chain"]
    return [dict(prompt=p, max_tokens=max_tokens, seed=i, stream=bool(i % 2), strategy=strategies[i % 4],
                 **modes[i % 3]) for i, p in enumerate(prompts)]


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run(args, pool_size: int) -> dict:
    import httpx2 as httpx

    from staged_engine import Engine

    port = _free_port()
    cmd = [sys.executable, "-m", "staged_engine.cli", "serve", "--port", str(port), "--pool-size",
           str(pool_size), "--max-queue", str(max(args.clients, 1))]
    local = Engine.demo()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    reqs = _requests(args.distinct, args.max_tokens)
    progress(f"computing {len(reqs)} stand-alone outputs ...")
    want = []
    for r in reqs:
        kw = {k: r[k] for k in ("temperature", "seed", "strategy") if k in r}
        want.append(local.generate(r["prompt"], max_new_tokens=r["max_tokens"], top_p=r.get("top_p", 1.0),
                                   stop_at_eos=False, **kw).text)
    del local
    records: list[dict] = []
    lock = threading.Lock()
    counter = [0]
    stop_at = time.monotonic() + args.seconds

    def client():
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop_at:
                with lock:
                    i = counter[0] % len(reqs)
                    counter[0] += 1
                body = dict(reqs[i], model="demo")
                body["stop"] = None
                t0 = time.perf_counter()
                rec = {"i": i, "stream": body["stream"]}
                try:
                    if body["stream"]:
                        text, first = "", None
                        with c.stream("POST", url + "/v1/completions", json=body) as resp:
                            rec["status"] = resp.status_code
                            for line in resp.iter_lines():
                                if line.startswith("data: ") and line != "data: [DONE]":
                                    piece = json.loads(line[6:])["choices"][0]["text"]
                                    if piece and first is None:
                                        first = time.perf_counter() - t0
                                    text += piece
                        rec["ttft"] = first
                    else:
                        resp = c.post(url + "/v1/completions", json=body)
                        rec["status"] = resp.status_code
                        text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else ""
                        rec["ttft"] = time.perf_counter() - t0
                    rec["latency"] = time.perf_counter() - t0
                    rec["ok"] = rec["status"] == 200
                    rec["identical"] = text == want[i]
                    rec["chars"] = len(text)
                except Exception as exc:  # counted as an error
                    rec.update(ok=False, error=repr(exc), latency=time.perf_counter() - t0)
                with lock:
                    records.append(rec)

    rss = [(0.0, _rss_mb(proc.pid))]
    t_start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        rss.append((round(time.monotonic() - t_start, 1), _rss_mb(proc.pid)))
        sys.stderr.write(f"\r{len(records)} requests, server RSS {rss[-1][1]:.0f} MB ")
    wall = time.monotonic() - t_start
    proc.send_signal(signal.SIGTERM)
    exit_code = proc.wait(timeout=60)
    ok = [r for r in records if r.get("ok")]
    tokens = sum(reqs[r["i"]]["max_tokens"] for r in ok)
    result = {
        "benchmark": "serve load", "machine": machine(), "clients": args.clients, "seconds": round(wall, 1),
        "pool_size": pool_size, "max_tokens": args.max_tokens, "distinct_requests": len(reqs),
        "requests": len(records), "errors": len(records) - len(ok),
        "mismatches": sum(1 for r in ok if not r["identical"]),
        "requests_per_s": len(records) / wall, "tokens_per_s": tokens / wall,
        "ttft_p50_s": _percentile([r["ttft"] for r in ok if r.get("ttft") is not None], 0.5),
        "ttft_p99_s": _percentile([r["ttft"] for r in ok if r.get("ttft") is not None], 0.99),
        "latency_p50_s": _percentile([r["latency"] for r in ok], 0.5),
        "latency_p99_s": _percentile([r["latency"] for r in ok], 0.99),
        "rss_mb": rss, "rss_growth_mb": rss[-1][1] - rss[1][1] if len(rss) > 1 else 0.0,
        "server_exit_code": exit_code,
        "error_samples": [r.get("error") or r.get("status") for r in records if not r.get("ok")][:5],
    }
    return result


def markdown(r: dict) -> str:
    runs = r["runs"]
    lines = [f"{r['clients']} concurrent clients for {r['seconds']:.0f} s per server configuration against "
             f"`staged-engine serve` (demo pair, {r['max_tokens']} tokens per request, greedy and sampled, "
             "streamed and not), one after the other in one run:\n",
             "| pool size | requests | errors | outputs differing from stand-alone | requests/s | tokens/s | "
             "TTFT p50 / p99 | latency p50 / p99 | server RSS growth |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in runs:
        lines.append(
            f"| {x['pool_size']} | {x['requests']} | {x['errors']} | {x['mismatches']} | {x['requests_per_s']:.1f} | "
            f"{x['tokens_per_s']:.0f} | {x['ttft_p50_s'] * 1e3:.0f} / {x['ttft_p99_s'] * 1e3:.0f} ms | "
            f"{x['latency_p50_s'] * 1e3:.0f} / {x['latency_p99_s'] * 1e3:.0f} ms | {x['rss_growth_mb']:+.1f} MB |")
    if len(runs) > 1:
        best = max(runs, key=lambda x: x["requests_per_s"])
        lines.append(f"\nMost requests/s at pool size {best['pool_size']} "
                     f"({best['requests_per_s'] / min(x['requests_per_s'] for x in runs):.2f}x the slowest).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the clients send requests")
    ap.add_argument("--pool-size", type=int, nargs="+", default=[1, 2, 4],
                    help="the server's --pool-size; several values run one after the other (1 = a FIFO)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    ap.add_argument("--distinct", type=int, default=12, help="distinct requests per prompt set, cycled")
    ap.add_argument("--out", default="serve_load.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    for name in ("clients", "max_tokens", "distinct"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.pool_size) < 1:
        raise SystemExit("--pool-size must be >= 1")
    runs = []
    for size in args.pool_size:
        progress(f"pool size {size}: {args.clients} clients for {args.seconds:.0f} s")
        runs.append(run(args, size))
    result = {"benchmark": "serve load", "machine": runs[0]["machine"], "clients": args.clients,
              "seconds": args.seconds, "max_tokens": args.max_tokens, "runs": runs}
    publish(result, markdown(result), args.out)
    return 0 if all(x["errors"] == 0 and x["mismatches"] == 0 for x in runs) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
