"""Regenerate README.md's results section from the JSON files in bench/results/.

    python bench/report.py            # rewrites the block between the results markers
    python bench/report.py --check    # exit 1 when that block is out of date
"""
from __future__ import annotations

import json
import os
import sys

from common import carryover, chain_round_costs, run_main

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
DEMO = os.path.join(os.path.dirname(HERE), "staged_engine", "assets", "demo")


_STALE: list[str] = []  # results measured on another pair than the embedded one
_OLD_CODE: list[str] = []  # results measured before a change to the code they time


def _demo_params(role: str) -> int | None:
    path = os.path.join(DEMO, role, "training.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("num_params")


def _load(name: str) -> dict | None:
    """A result file, or None when it is missing or was measured on another demo pair than the
    embedded one (those are listed at the end of the section instead of shown)."""
    path = os.path.join(RESULTS, name)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        r = json.load(f)
    params = r.get("oracle_params", r.get("params"))
    where = str(r.get("oracle", "")).rstrip("/")
    role = "draft" if where.endswith("draft") else "oracle"
    if isinstance(params, int) and "assets/demo" in where and params != _demo_params(role):
        _STALE.append(name)
        return None
    return r


def _machine(m: dict) -> str:
    vec = [v for v in m.get("vector_extensions", []) if v in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16")]
    isa = ", ".join(vec) if vec else m.get("isa", "")
    cpu = f"{m['cpu']} ({m['cpu_family_model']})" if m.get("cpu_family_model") else m["cpu"]
    return f"{cpu}, {m['cores']} cores ({isa}), torch {m['torch']}, {m['torch_threads']} threads"


def section_e2e(r: dict, title: str = "End to end on the demo pair (`staged-engine bench e2e`)",
                source: str = "e2e.json") -> list[str]:
    out = [f"### {title}\n"] + [
           f"Oracle {r['oracle_params'] / 1e6:.1f}M parameters, draft {r['draft_params'] / 1e6:.2f}M; "
           f"{r['n_prompts']} prompts ({' + '.join(r['prompt_sets'])}), {r['new_tokens']} new tokens, fp32; "
           f"{_machine(r['machine'])}. Medians over prompts after a warm-up; "
           + (f"each prompt ran {r['repeats']} times with the systems alternating ("
              + ("each time the next of orders balanced for carryover: every system as often right after every "
                 "other" if "orders" in r else "in reverse order every other time")
              + f"), its time the {'median' if 'per_prompt_seconds' in r else 'mean'} of the repeats; "
              if r.get("repeats", 1) > 1 else "")
           + "speedups are medians of per-prompt ratios (and all tokens over all seconds) measured in the "
           f"same run. Source: `bench/results/{source}`.\n"]
    out.append(r["markdown"])
    if "orders" in r and r.get("repeats", 1) > 1:
        out += carryover_table(r)
    return out


_MODE_NAMES = {"greedy": "greedy", "topp": "T 0.8, top-p 0.95", "sampled": "T 1, top-k 50"}
_AFTER = {"plain": "after plain", "drafting": "after a drafting run", "hf": "after HF"}


def carryover_table(r: dict) -> list[str]:
    """The e2e's runs by what ran right before them (common.carryover), one column pair a mode."""
    modes = list(r["modes"])
    found = {m: carryover(r["modes"][m], r["repeats"]) for m in modes}
    kinds = [k for k in _AFTER if any(k in g for c in found.values() for g in c.values())]
    systems = list(r["modes"][modes[0]])

    def pct(x: dict) -> str:
        return f"{100 * x['mean']:+.1f}" + (f" ± {100 * x['se']:.1f}" if x["se"] is not None else "")

    out = ["Carryover: each run's time against the median repeat of its prompt and system (mean log ratio "
           "over the runs, in percent, ± its standard error), by what ran right before it. The orders "
           "give every system each predecessor equally often, so this moves no figure above: it is what "
           "an unbalanced order would have added to one system and not another.\n",
           "| system | " + " | ".join(f"{_MODE_NAMES.get(m, m)}: {_AFTER[k]}" for m in modes for k in kinds) + " |",
           "|---|" + "---|" * (len(modes) * len(kinds))]
    for s in systems:
        cells = [pct(found[m][s][k]) if k in found[m][s] else "" for m in modes for k in kinds]
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def section_plain_vs_hf(r: dict, source: str = "plain_vs_hf.json") -> list[str]:
    out = ["### Plain decoding against HF `generate` (`staged-engine bench plain-vs-hf`)\n",
           f"Random weights, greedy, fp32, 128 new tokens; {_machine(r['machine'])}. "
           "Source: `bench/results/plain_vs_hf.json`.\n",
           "| shape | params | HF generate tok/s | staged-engine plain tok/s | speedup | outputs identical |",
           "|---|---|---|---|---|---|"]
    for x in r["results"]:
        out.append(f"| GPT-2 {x['shape']} | {x['params'] / 1e6:.0f}M | {x['hf_tokens_per_s']:.1f} | "
                   f"{x['ours_tokens_per_s']:.1f} | {x['speedup']:.2f}x | {x['all_identical']} |")
    out.append("")
    return out


def section_forward_cost(r: dict, source: str = "forward_cost.json") -> list[str]:
    names = list(r["curves"])
    role = "draft" if str(r.get("oracle", "")).rstrip("/").endswith("draft") else "oracle"
    out = [f"### Demo {role}: forward cost against tree nodes (`staged-engine bench forward-cost`)\n",
           f"Demo {role} ({r['params'] / 1e6:.2f}M parameters), prefix {r['prefix']} tokens; {_machine(r['machine'])}. "
           "Time of one pass over N tree nodes, and relative to a 1-node pass, per kernel path, measured "
           f"in one run. Source: `bench/results/{source}`.\n",
           "| nodes | " + " | ".join(f"{n}: ms | {n}: x 1-node" for n in names) + " |",
           "|---|" + "---|---|" * len(names)]
    for n in r["curves"][names[0]]:
        out.append(f"| {n} | " + " | ".join(
            f"{r['curves'][b][n]['seconds'] * 1e3:.2f} | {r['curves'][b][n]['relative_to_1']:.2f}" for b in names) + " |")
    out.append("")
    return out


def section_generic(title: str, r: dict, source: str) -> list[str]:
    if "markdown" in r:
        return [f"### {title}\n"] + [f"{_machine(r['machine'])}. Source: `bench/results/{source}`.\n", r["markdown"], ""]
    return []


def _plot(name: str, alt: str) -> list[str]:
    """A markdown image line for bench/results/plots/<name> if that PNG exists."""
    if os.path.isfile(os.path.join(RESULTS, "plots", name)):
        return [f"![{alt}](bench/results/plots/{name})\n"]
    return []


def section_sweep(sweeps: list[dict], suffix: str = "", where: str = "") -> list[str]:
    """The sweeps of ``sweep_<mode><suffix>.json``; ``where`` qualifies the title (the machine)."""
    cmd = "staged-engine bench sweep --mode MODE" + (f" --out sweep_MODE{suffix}.json" if suffix else "")
    machines = {_machine(r["machine"]) for r in sweeps}
    out = [f"### The planned default against fixed shapes{where} (`{cmd}`)\n",
           "Per strategy and mode: the planned default (each round drafts and verifies what pays) and the "
           "best fixed shape of the sweep (chains of 1-10, trees of 4-16 nodes, staged shapes), as speedups "
           "over plain decoding, every generation paired with a plain one of the same prompt just before it "
           "(all tokens over all seconds; per-prompt median and minimum); "
           f"{'; '.join(sorted(machines))}. Sources: "
           + ", ".join(f"`bench/results/sweep_{r['mode']}{suffix}.json`" for r in sweeps) + ".\n",
           "| mode | strategy | shape | tok/s | vs plain | per-prompt median | slowest prompt | tokens/oracle call "
           "| planned / best fixed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sweeps:
        for strategy, b in r["best"].items():
            d = r["planned"][strategy]
            for x in (d, b):
                ratio = f"{d['tokens_per_s'] / b['tokens_per_s']:.2f}" if x is d else ""
                out.append(f"| {r['mode']} | {strategy} | {x['label']} | {x['tokens_per_s']:.0f} | "
                           f"{x['speedup_vs_plain']:.2f}x | {x['median_speedup_vs_plain']:.2f}x | "
                           f"{x['min_speedup_vs_plain']:.2f}x | {x['tokens_per_oracle_call']:.2f} | {ratio} |")
    out.append("")
    return out


def section_round_cost(sweeps: list[dict], suffix: str = "") -> list[str]:
    """What a round of each fixed chain of ``common.ROUND_COST_CHAINS`` costs in plain steps, and
    its parts, from the sweeps that recorded them (``chain_round_costs``)."""
    lines = []
    for r in sweeps:
        for x in chain_round_costs(r):
            k = x["options"]["chain_length"]
            rest = x["round_plain_steps"] - x["draft_plain_steps"] - x["oracle_pass_plain_steps"]
            lines.append(f"| {r['mode']} | {k} | {x['tokens_per_oracle_call']:.2f} | {x['round_plain_steps']:.2f} | "
                         f"{x['draft_plain_steps']:.2f} | {x['oracle_pass_plain_steps']:.2f} | {rest:.2f} | "
                         f"{x['plain_pass_share']:.2f} | {x['speedup_vs_plain']:.2f}x |")
    if not lines:
        return []
    sources = ", ".join(f"`bench/results/sweep_{r['mode']}{suffix}.json`" for r in sweeps)
    return ["#### What a fixed chain's round costs\n",
            "From the same sweeps: per round (oracle pass) of a fixed chain of k drafted tokens, the tokens it "
            "emits and its cost in plain steps (a plain step's seconds in the paired plain runs), split into "
            "the draft's passes, the oracle's pass over the root and the chain, and the rest (sampling, "
            "verification, the interpreter), from the engine's forward timers (`draft_decode_seconds`, "
            "`oracle_decode_seconds`; the prompt's prefill, the draft's too, runs before the decode and is in "
            "none of them). A chain beats plain decoding where its tokens per round exceed its "
            "round's cost; the plain step's own pass is given as its share of the step. Sources: "
            f"{sources}.\n",
            "| mode | k | tokens a round | round, plain steps | draft passes | oracle pass | rest "
            "| plain step's pass | vs plain |", "|---|---|---|---|---|---|---|---|---|", *lines, "",
            *(_plot("round_cost.png", "a chain's round in plain steps beside the tokens it emits") if not suffix
              else [])]


def section_temperature(r: dict, source: str = "temperature.json", where: str = "") -> list[str]:
    cmd = "staged-engine bench temperature" + (f" --out {source}" if source != "temperature.json" else "")
    out = [f"### Tokens/s against temperature{where} (`{cmd}`)\n",
           f"{r['n_prompts']} held-out prompts x {r['new_tokens']} tokens, {r['repeats']} repeats, systems "
           f"alternating; {_machine(r['machine'])}. The best fixed chain is picked per temperature after the "
           f"fact. Source: `bench/results/{source}`.\n",
           "| temperature | plain tok/s | staged (planned) | best fixed chain | staged / best fixed |",
           "|---|---|---|---|---|"]
    for x in r["rows"]:
        out.append(f"| {x['temperature']:.1f} | {x['tokens_per_s']['plain']:.0f} | {x['staged_vs_plain']:.2f}x | "
                   f"{x['best_fixed']}: {x['best_fixed_vs_plain']:.2f}x | {x['staged_vs_best_fixed']:.2f} |")
    out.append("")
    return out


def section_demo_pair() -> list[str]:
    recs = {}
    for role in ("oracle", "draft"):
        path = os.path.join(DEMO, role, "training.json")
        if not os.path.isfile(path):
            return []
        with open(path) as f:
            recs[role] = json.load(f)
    o, d = recs["oracle"], recs["draft"]
    if "evaluation" not in o:
        return []
    m = o["corpus"]["manifest"]
    cpu = o.get("cpu", {})
    out = ["### The demo pair (`staged-engine train-demo`)\n",
           f"Trained on {cpu.get('model', '?')} ({', '.join(cpu.get('vector_extensions', []))}), "
           f"{o['threads']} threads, torch {o['torch']}. Corpus: {m['files_train']:,} files / "
           f"{m['bytes_train'] / 1e6:.0f} MB (the standard library and {len(m['packages']) - 1} installed packages, "
           f"deduplicated by content); held out whole: {', '.join(m['held_out_packages'])} "
           f"({m['files_held_out']} files, {m['bytes_held_out'] / 1e6:.1f} MB). "
           "Bits per byte compare across tokenizers. Sources: `staged_engine/assets/demo/*/training.json`.\n",
           "| model | params | shape | tokens seen | wall time | bits/byte held out | bits/byte val | "
           "top-1 agreement with the oracle (held out) |",
           "|---|---|---|---|---|---|---|---|"]
    for role, r in (("oracle", o), ("draft", d)):
        c = r["config"]
        out.append(f"| {role} | {r['num_params'] / 1e6:.2f}M | {c['n_embd']} x {c['n_layer']} layers x "
                   f"{c['n_head']} heads | {r['tokens_seen'] / 1e6:.1f}M | {r['wall_time_s'] / 60:.0f} min | "
                   f"{r['evaluation']['held_out']['bits_per_byte']:.3f} | {r['evaluation']['val']['bits_per_byte']:.3f} | "
                   + (f"{r['top1_agreement_with_oracle']:.3f}" if role == "draft" else "") + " |")
    pilots = o.get("pilots") or []
    if pilots:
        out += ["", "Pilots at equal wall time that chose the oracle's shape:", "",
                "| pilot | params | minutes | threads | tokens | bits/byte held out |", "|---|---|---|---|---|---|"]
        for p in pilots:
            out.append(f"| {p['name']} | {p['num_params'] / 1e6:.1f}M | {p['seconds'] / 60:.0f} | {p['threads']} | "
                       f"{p['tokens_seen'] / 1e6:.2f}M | {p['held_out']['bits_per_byte']:.3f} |")
    out.append("")
    return out


def render() -> str:
    _STALE.clear()  # filled afresh by each rendering (a second one in a process listed files twice)
    _OLD_CODE.clear()
    parts: list[str] = section_demo_pair()
    r = _load("pair_quality.json")
    if r:
        parts += section_generic("The demo pair on the held-out packages (`staged-engine bench pair-quality`)",
                                 r, "pair_quality.json")
    r = _load("draft_rule.json")
    if r:
        parts += section_generic("Sampled drafting: the draft's proposal against the oracle's token, by the draft's "
                                 "rule (`staged-engine bench draft-rule`)", r, "draft_rule.json")
    r = _load("e2e.json")
    if r:
        parts += section_e2e(r, "End to end on the demo pair (`staged-engine bench e2e --prompt-sets heldout --limit 24 "
                                f"--repeats {r.get('repeats', 1)} --systems hf plain chain tree staged --chains 1 2 3`)")
        parts += _plot("e2e_speedup.png", "speedup over HF generate per system")
        parts += _plot("e2e_accepted_lengths.png", "tokens emitted per oracle call")
    r = _load("e2e_repeats15.json")
    if r:
        parts += section_e2e(r, "End to end, each prompt repeated more, no HF (`staged-engine bench e2e --prompt-sets "
                                f"heldout --limit 24 --repeats {r.get('repeats', 1)} --systems plain staged --chains 1 2 3 "
                                "--out e2e_repeats15.json`): the slowest-prompt column with less noise",
                             "e2e_repeats15.json")
    r = _load("e2e_avx2.json")
    if r:
        parts += section_e2e(r, "End to end on an AVX2-only machine (`staged-engine bench e2e --prompt-sets heldout "
                                f"--limit 24 --repeats {r.get('repeats', 1)} --systems plain chain tree staged "
                                "--chains 1 2 3 --out e2e_avx2.json`)", "e2e_avx2.json")
    r = _load("e2e_repeats15_avx2.json")
    if r:
        parts += section_e2e(r, "End to end on an AVX2-only machine, each prompt repeated more (`staged-engine bench e2e "
                                f"--prompt-sets heldout --limit 24 --repeats {r.get('repeats', 1)} --systems plain staged "
                                "--chains 1 2 3 --out e2e_repeats15_avx2.json`)", "e2e_repeats15_avx2.json")
    r = _load("e2e_head_rows_avx2.json")
    if r:
        parts += section_e2e(r, "End to end on an AVX2-only machine, the draft's LM head cut (`staged-engine bench e2e "
                                f"--prompt-sets heldout --limit 24 --repeats {r.get('repeats', 1)} --systems plain staged "
                                "--chains 1 2 3 --draft-head-rows 2048 4096 --out e2e_head_rows_avx2.json`)",
                             "e2e_head_rows_avx2.json")
    r = _load("roofline.json")
    if r:
        parts += section_generic("Decode roofline: bandwidth and compute bounds, HF `generate` and llama.cpp "
                                 "(`staged-engine bench roofline`)", r, "roofline.json")
        parts += _plot("roofline.png", "share of the weight-streaming bound; N-node passes against the roofline")
    r = _load("roofline_avx2.json")
    if r:
        parts += section_generic("Decode roofline on an AVX2-only machine (`staged-engine bench roofline --rounds 5 "
                                 "--out roofline_avx2.json`)", r, "roofline_avx2.json")
        parts += _plot("roofline_avx2.png", "AVX2: share of the weight-streaming bound; N-node passes against the "
                                            "roofline")
    r = _load("working_set.json")
    if r:
        parts += section_generic("What a pass's working set costs it: the context and the other model's passes "
                                 "(`staged-engine bench working-set`)", r, "working_set.json")
        parts += _plot("working_set.png", "read rate against the bytes read, with the oracle's passes; each model's "
                                          "pass after the other's")
    r = _load("kv_dtype.json")
    if r:
        parts += section_generic("The oracle's K/V cache in float16 (`staged-engine bench kv-dtype`)", r,
                                 "kv_dtype.json")
        parts += _plot("kv_dtype.png", "decode tokens/s against prompt length, float32 and float16 K/V caches")
    for name, when in (("kv_dtype_run2.json", "again, a minute later"), ("kv_dtype_run3.json", "a third time, "
                                                                                       "with 5 repeats")):
        r = _load(name)
        if r:
            parts += section_generic(f"The oracle's K/V cache in float16, {when} (`staged-engine bench kv-dtype "
                                     f"--out {name}`)", r, name)
    r = _load("kv_dtype_avx2.json")
    if r:
        parts += section_generic("The oracle's K/V cache in float16 on an AVX2-only machine (`staged-engine bench "
                                 "kv-dtype --out kv_dtype_avx2.json`)", r, "kv_dtype_avx2.json")
        parts += _plot("kv_dtype_avx2.png", "AVX2: decode tokens/s against prompt length, float32 and float16 K/V "
                                            "caches")
    r = _load("roofline_bf16.json")
    if r:
        parts += section_generic("The demo oracle stored in bfloat16 against llama.cpp's bf16 (`staged-engine bench "
                                 "roofline --models staged_engine/assets/demo/oracle --bf16 --rounds 5 --out "
                                 "roofline_bf16.json`)", r, "roofline_bf16.json")
    r = _load("roofline_bf16_gpt2small.json")
    if r:
        parts += section_generic("The GPT-2-small shape and its bfloat16 copy against llama.cpp's f16 and bf16 "
                                 "(`staged-engine bench roofline --models ~/.cache/staged-engine/gpt2-small-shaped-"
                                 "random-fp16 --bf16 --rounds 5 --out roofline_bf16_gpt2small.json`)", r,
                                 "roofline_bf16_gpt2small.json")
    r = _load("weight_formats.json")
    if r:
        parts += section_generic("A checkpoint stored in bfloat16: packed as bfloat16 against float32 "
                                 "(`staged-engine bench weight-formats`)", r, "weight_formats.json")
        parts += _plot("weight_formats.png", "pass time over 1-8 rows: float16, bfloat16 and bfloat16 packed as float32")
    r = _load("linear_cpu.json")
    if r:
        parts += section_generic("The native linear kernel alone: what bounds an N-node pass "
                                 "(`staged-engine bench linear`)", r, "linear_cpu.json")
        parts += _plot("linear.png", "the native linear kernel against rows, with its bounds")
    r = _load("linear_avx2.json")
    if r:
        parts += section_generic("The native linear kernel alone on an AVX2-only machine (`staged-engine bench linear "
                                 "--out linear_avx2.json`)", r, "linear_avx2.json")
        parts += _plot("linear_avx2.png", "AVX2: the native linear kernel against rows, with its bounds")
    r = _load("e2e_identity_all_prompts.json")
    if r:
        parts += section_e2e(r, "Exactness at scale: every prompt of both sets, engine strategies, "
                                f"{', '.join(r['modes'])}",
                             "e2e_identity_all_prompts.json")
    # Measured before the native forward pass (f1b769e, 66644b7 and after): not shown until re-run.
    _OLD_CODE.extend(n for n in ("plain_vs_hf.json",) if os.path.isfile(os.path.join(RESULTS, n)))
    sweeps = [r for r in (_load(f"sweep_{m}.json") for m in ("greedy", "topp", "sampled"))
              if r is not None and "planned" in r and f"sweep_{r['mode']}.json" not in _OLD_CODE]
    if sweeps:
        parts += section_sweep(sweeps)
        parts += section_round_cost(sweeps)
    r = _load("temperature.json") if "temperature.json" not in _OLD_CODE else None
    if r:
        parts += section_temperature(r)
        parts += _plot("temperature.png", "tokens/s against temperature")
    sweeps = [r for r in (_load(f"sweep_{m}_avx2.json") for m in ("greedy", "topp", "sampled")) if r is not None]
    if sweeps:
        parts += section_sweep(sweeps, "_avx2", " on an AVX2-only machine")
        parts += section_round_cost(sweeps, "_avx2")
    r = _load("temperature_avx2.json")
    if r:
        parts += section_temperature(r, "temperature_avx2.json", " on an AVX2-only machine")
        parts += _plot("temperature_avx2.png", "AVX2: tokens/s against temperature")
    for name, fn in (("plain_vs_hf.json", section_plain_vs_hf), ("forward_cost.json", section_forward_cost),
                     ("forward_cost_draft.json", section_forward_cost)):
        r = _load(name) if name not in _OLD_CODE else None
        if r:
            parts += fn(r, name)
            if name == "forward_cost.json":
                parts += _plot("forward_cost.png", "oracle forward time against tree nodes")
    # Measured before the native KV path commit that beams use (csrc/cpu_sampling.cpp): not shown.
    _OLD_CODE.extend(n for n in ("dsbd.json", "dsbd_static.json") if os.path.isfile(os.path.join(RESULTS, n)))
    for name, title in (("dsbd_fixed_w2.json", "DSBD with a fixed width, W = 2, one cache row per beam "
                         "(`staged-engine bench dsbd --num-beams 2 --limit 12 --systems dsbd beam_rows beam --options "
                         "'{\"dsbd\": {\"dynamic\": false, \"layout\": \"rows\", \"adaptive\": true}}'`)"),
                        ("dsbd_fixed_w4.json", "DSBD with a fixed width, W = 4, one cache row per beam"),
                        ("dsbd_fixed_w8.json", "DSBD with a fixed width, W = 8, one cache row per beam"),
                        ("dsbd_fixed_w2_topp.json", "DSBD with a fixed width, W = 2, T 0.8 / top-p 0.95 (the same "
                         "command with `--temperature 0.8 --top-p 0.95 --out dsbd_fixed_w2_topp.json`)"),
                        ("dsbd_fixed_w4_topp.json", "DSBD with a fixed width, W = 4, T 0.8 / top-p 0.95"),
                        ("dsbd_fixed_w8_topp.json", "DSBD with a fixed width, W = 8, T 0.8 / top-p 0.95"),
                        ("dsbd_fixed_w2_topk.json", "DSBD with a fixed width, W = 2, T 1 / top-k 50 (the same command "
                         "with `--top-k 50 --out dsbd_fixed_w2_topk.json`)"),
                        ("dsbd_fixed_w4_topk.json", "DSBD with a fixed width, W = 4, T 1 / top-k 50"),
                        ("dsbd_fixed_w8_topk.json", "DSBD with a fixed width, W = 8, T 1 / top-k 50"),
                        ("dsbd_fixed_w2_avx2.json", "DSBD with a fixed width, W = 2, one cache row per beam, on an "
                         "AVX2-only machine (the same command with `--out dsbd_fixed_w2_avx2.json`)"),
                        ("dsbd_fixed_w4_avx2.json", "DSBD with a fixed width, W = 4, one cache row per beam, AVX2"),
                        ("dsbd_fixed_w8_avx2.json", "DSBD with a fixed width, W = 8, one cache row per beam, AVX2"),
                        ("dsbd_fixed_w2_topp_avx2.json", "DSBD with a fixed width, W = 2, T 0.8 / top-p 0.95, AVX2 "
                         "(the same command with `--temperature 0.8 --top-p 0.95 --out dsbd_fixed_w2_topp_avx2.json`)"),
                        ("dsbd_fixed_w4_topp_avx2.json", "DSBD with a fixed width, W = 4, T 0.8 / top-p 0.95, AVX2"),
                        ("dsbd_fixed_w8_topp_avx2.json", "DSBD with a fixed width, W = 8, T 0.8 / top-p 0.95, AVX2"),
                        ("dsbd_fixed_w2_topk_avx2.json", "DSBD with a fixed width, W = 2, T 1 / top-k 50, AVX2 "
                         "(the same command with `--top-k 50 --out dsbd_fixed_w2_topk_avx2.json`)"),
                        ("dsbd_fixed_w4_topk_avx2.json", "DSBD with a fixed width, W = 4, T 1 / top-k 50, AVX2"),
                        ("dsbd_fixed_w8_topk_avx2.json", "DSBD with a fixed width, W = 8, T 1 / top-k 50, AVX2"),
                        ("idle_gap_avx2.json", "A forward pass after idle time, AVX2 (`staged-engine bench idle-gap "
                         "--out idle_gap_avx2.json`)"),
                        ("widening_avx2.json", "What a row costs over float16 weights, AVX2 (`staged-engine bench "
                         "widening --out widening_avx2.json`)"),
                        ("phases_avx2.json", "Where a forward pass goes, AVX2 (`staged-engine bench phases --out "
                         "phases_avx2.json`)"),
                        ("phases_region_avx2.json", "Where a forward pass goes back to back in one native call, as "
                         "plain decoding's steps run, AVX2 (`staged-engine bench phases --region --rows 1 2 3 4 8 --out "
                         "phases_region_avx2.json`)"),
                        ("phases_gpt2small_avx2.json", "Where a forward pass goes, the GPT-2-small shape, AVX2 "
                         "(`staged-engine bench phases --models ~/.cache/staged-engine/gpt2-small-shaped-random-fp16 "
                         "--out phases_gpt2small_avx2.json`)"),
                        ("serve_load.json", "Serving under load (`staged-engine bench serve-load`)"),
                        ("ngram.json", "N-gram stage (`staged-engine bench ngram`)"),
                        ("kernels_cpu.json", "Kernel microbenchmarks (`staged-engine bench kernels`)")):
        r = _load(name) if name not in _OLD_CODE else None
        if r:
            parts += section_generic(title, r, name)
            if name == "idle_gap_avx2.json":
                parts += _plot("idle_gap_avx2.png", "AVX2: a forward pass after idle time, against the same pass "
                                                    "back to back")
            if name == "phases_avx2.json":
                parts += _plot("phases_avx2.png", "AVX2: a forward pass by phase, against cached tokens and rows")
            if name == "phases_region_avx2.json":
                parts += _plot("phases_region_avx2.png", "AVX2: a pass by phase, back to back in one native call")
            if name == "phases_gpt2small_avx2.json":
                parts += _plot("phases_gpt2small_avx2.png", "AVX2: a pass of the GPT-2-small shape by phase")
    if _OLD_CODE:
        parts.append("Not re-run on the current code (measured before a change to the code they time, so not "
                     "shown): " + ", ".join(f"`bench/results/{n}`" for n in _OLD_CODE) + ".\n")
    if _STALE:
        parts.append("Not re-run on the embedded pair (measured on the previous one, so not shown): "
                     + ", ".join(f"`bench/results/{n}`" for n in sorted(set(_STALE))) + ".\n")
    return "\n".join(parts) if parts else "No benchmark results yet."


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description="Regenerate README.md's results section (the block between the "
                    f"'{BEGIN}' and '{END}' markers) from the JSON files in bench/results/.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the README's results section differs from "
                             "what the result files make")
    args = parser.parse_args(argv)
    with open(README, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        print(f"{README} lacks the {BEGIN} / {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + BEGIN + "\n" + render() + "\n" + END + tail
    if args.check:
        if new != text:
            print(f"{README}'s results section is out of date: run python bench/report.py", file=sys.stderr)
            return 1
        print(f"{README}'s results section is up to date")
        return 0
    with open(README, "w", encoding="utf-8") as f:
        f.write(new)
    print(f"updated {README}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
