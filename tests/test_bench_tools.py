"""The benchmark plumbing: the progress bar's log output, the PNG plots, the benches' tables and arguments (test models at most)."""
from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
import statistics
import sys
import types

import pytest
import torch

from staged_engine.model.backend import _cpu

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench_module(name: str):
    """bench/<name>.py by path, with bench/ on sys.path only while it loads (for its imports of
    bench/common.py): left there, bench/kernels.py would shadow the kernels package for the
    rest of the session."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, BENCH)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(BENCH)
    return module


def _tiny_results(d) -> None:
    runs = {"runs": []}
    modes = {}
    for mode in ("greedy", "sampled"):
        rows = {}
        for i, s in enumerate(("hf", "hf_assisted", "plain", "chain", "tree", "staged")):
            rows[s] = {"median_tokens_per_s": 100.0 + 50 * i, "median_speedup_vs_hf": 1.0 + 0.5 * i, **runs}
            if s in ("chain", "tree", "staged"):
                rows[s]["accepted_length_histogram"] = {"1": 5, "2": 3, str(3 + i): 2}
        modes[mode] = rows
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "x", "torch_threads": 2}
    with open(os.path.join(d, "e2e.json"), "w") as f:
        json.dump({"machine": machine, "n_prompts": 4, "new_tokens": 16, "modes": modes}, f)
    curve = {str(n): {"seconds": 1e-3 * (1 + 0.1 * n), "relative_to_1": 1 + 0.1 * (n - 1)} for n in (1, 2, 4, 8)}
    with open(os.path.join(d, "forward_cost.json"), "w") as f:
        json.dump({"machine": machine, "prefix": 16, "curves": {"native": curve, "stock torch": curve}}, f)
    rows = [{"temperature": t, "best_fixed": "chain 2", "tokens_per_s": {"plain": 100.0, "staged": 105.0 - 5 * t,
                                                                       "chain 2": 110.0 - 20 * t}}
            for t in (0.0, 0.5, 1.0)]
    with open(os.path.join(d, "temperature.json"), "w") as f:
        json.dump({"machine": machine, "n_prompts": 4, "new_tokens": 16, "rows": rows}, f)


def test_plots_write_four_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _bench_module("plots")

    _tiny_results(str(tmp_path))
    assert plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    names = sorted(os.listdir(tmp_path / "png"))
    assert names == ["e2e_accepted_lengths.png", "e2e_speedup.png", "forward_cost.png", "temperature.png"]
    for name in names:
        with open(tmp_path / "png" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_say_how_to_get_it(monkeypatch, capsys):
    plots = _bench_module("plots")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert plots.main([]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_llama_cpp_steps_that_cannot_run_say_which_and_why(tmp_path, monkeypatch):
    """The roofline bench goes on without llama.cpp when it cannot be built or run here; the
    reason names the step (no cmake; a failing command, with its exit code and log)."""
    llamacpp = _bench_module("llamacpp")
    monkeypatch.setenv("STAGED_ENGINE_CACHE", str(tmp_path))
    src = tmp_path / "llama.cpp" / f"llama_cpp_python-{llamacpp.VERSION}" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="needs cmake"):
        llamacpp.llama_bench_binary()
    with pytest.raises(llamacpp.LlamaCppUnavailable, match=r"running the test step failed \(exit 3\)"):
        llamacpp.run_step([sys.executable, "-c", "import sys; sys.exit(3)"], "running the test step",
                      str(tmp_path / "log.txt"))


def test_the_bench_command_finds_every_script_of_the_checkout():
    """`staged-engine bench NAME` runs bench/NAME.py of this checkout: every listed script exists
    there, and `--help` of one runs it (exit 0, its own usage)."""
    import subprocess

    from staged_engine.cli import bench

    assert os.path.realpath(bench.bench_dir()) == os.path.realpath(BENCH)
    for name, script in bench.BENCHES.items():
        assert os.path.isfile(os.path.join(BENCH, script)), name
    out = subprocess.run([sys.executable, "-c", "import sys; from staged_engine.cli.main import main; "
                          "sys.exit(main(['bench', 'ngram', '--help']))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_every_result_names_the_native_kernels_it_timed():
    """A result records the CPU (with its x86 family and model) and its vector extensions, and
    with the extension built the digest of the kernels' build and the block forms in force
    (results differ by both)."""
    from staged_engine.model.backend import _cpu

    info = _bench_module("common").machine()
    assert info["cpu"] and isinstance(info["vector_extensions"], list)
    with open("/proc/cpuinfo") as f:  # a guest's model name may not tell core generations apart
        fields = {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in f if ":" in line}
    if "cpu family" in fields and "model" in fields:
        assert info["cpu_family_model"] == f"family {fields['cpu family']} model {fields['model']}"
    if _cpu is None:
        assert "native_build" not in info
        return
    assert info["narrow_rows"] == _cpu.narrow_rows()
    assert info["group_runs"] == _cpu.group_runs()
    assert len(info["native_build"]) == 16 and int(info["native_build"], 16) >= 0


@pytest.mark.parametrize("argv,needle", [(["--repeats", "1"], "--repeats must be >= 2"),
                                         (["--gaps", "0", "-5"], "--gaps must be >= 0"),
                                         (["--models", "/nonexistent"], "no config.json")])
def test_the_idle_gap_bench_refuses_bad_arguments_by_name(argv, needle):
    idle_gap = _bench_module("idle_gap")
    with pytest.raises((ValueError, FileNotFoundError), match=needle):
        idle_gap.main(argv)


def test_the_idle_gap_table_reports_each_gap_against_the_first():
    idle_gap = _bench_module("idle_gap")
    model = {"pass_us": {"0": 600.0, "500": 750.0}, "ratio_to_first_gap": {"0": 1.0, "500": 1.25}}
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx2"]}, "threads": 2, "context": 200,
              "repeats": 4, "gaps_us": [0, 500], "models": {"oracle": model}}
    text = idle_gap.table(result)
    assert "| oracle | 600 us (1.00x) | 750 us (1.25x) |" in text and "Test CPU" in text


@pytest.mark.parametrize("argv,needle", [(["--repeats", "4"], "--repeats must be >= 5"),
                                         (["--contexts", "0"], "--contexts must be >= 1"),
                                         (["--rows", "0"], r"--rows must be in \[1, 64\]"),
                                         (["--rows", "65"], r"--rows must be in \[1, 64\]"),
                                         (["--contexts", "1020", "--rows", "8"], "must fit demo oracle's 1024"),
                                         (["--models", "/nonexistent"], "no config.json"),
                                         (["--region", "--rows", "1", "10"], "--rows must be at most 9 with --region")])
def test_the_phases_bench_refuses_bad_arguments_by_name(argv, needle):
    phases = _bench_module("phases")
    with pytest.raises((ValueError, FileNotFoundError), match=needle):
        phases.main(argv)


def test_the_phases_bench_averages_the_fastest_repeats_so_the_phases_add_up():
    """The means are over the repeats with the fastest 80% of the wall times (a hiccup left out),
    the same repeats for the wall time and every phase, so the phases and `outside` sum to the
    wall time; the table gives each phase's microseconds and share."""
    phases = _bench_module("phases")
    walls = [1.0, 2.0, 3.0, 4.0, 100.0]  # the 100 is the hiccup
    per = [[0.5, 0.25], [1.0, 0.5], [1.5, 1.0], [2.0, 1.5], [50.0, 49.0]]
    wall, mean = phases.trimmed(walls, per)
    assert wall == pytest.approx(2.5) and mean == pytest.approx([1.25, 0.8125])
    row = {"wall_us": 400.0, "phase_us": {"qkv": 100.0, "attention": 250.0, "outside": 50.0},
           "share": {"qkv": 0.25, "attention": 0.625, "outside": 0.125}}
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx2"]}, "threads": 2, "repeats": 10,
              "models": {"oracle": {"params": 8.7e6, "phases": ["qkv", "attention", "outside"],
                                    "contexts": {"256": {"2": row}}}}}
    text = phases.table(result)
    assert "| 256 | 2 | 400 | 100 (25%) | 250 (62%) | 50 (12%) |" in text and "Test CPU" in text
    assert "busy by thread" not in text  # a result from before the per-thread figures renders as it did
    # Per thread, over the same repeats: thread 1 of repeat i works (i + 1) x thread 0's time.
    per_repeat = [[[walls[i] / 4], [walls[i] / 4 * (i + 1)]] for i in range(5)]  # [repeat][thread][phase]
    per = phases.by_thread(walls, per_repeat, ["qkv"])
    assert [t["qkv"] for t in per] == pytest.approx([2.5 / 4 * 1e6, (0.25 + 1 + 2.25 + 4) / 4 * 1e6])
    row["busy_us"] = [210.4, 226.6]
    assert "| busy by thread |" in phases.table(result) and "| 50 (12%) | 210 / 227 |" in phases.table(result)


@pytest.mark.parametrize("argv,needle", [(["--repeats", "1"], "--repeats must be >= 2"),
                                         (["--contexts", "0"], "--contexts must be >= 1"),
                                         (["--contexts", "64", "1024"], "--contexts must be at most 1023"),
                                         (["--oracle", "/nonexistent"], "--oracle /nonexistent: no config.json")])
def test_the_working_set_bench_refuses_bad_arguments_by_name(argv, needle):
    working_set = _bench_module("working_set")
    with pytest.raises((ValueError, FileNotFoundError), match=needle):
        working_set.main(argv)


def test_the_working_set_probe_sizes_reach_four_times_the_cache():
    working_set = _bench_module("working_set")
    mib = 1 << 20
    sizes = working_set.probe_sizes(96 * mib)
    assert sizes == sorted(set(sizes)) and sizes[0] == mib and sizes[-1] >= 4 * 96 * mib
    assert 96 * mib in sizes and 80 * mib in sizes  # quarter steps around the cache's edge
    assert working_set.probe_sizes(None)[-1] == 128 * mib


def test_the_working_set_table_reads_the_probe_at_each_pass_working_set():
    working_set = _bench_module("working_set")
    mib = 1 << 20
    curve = {str(16 * mib): 160.0, str(32 * mib): 40.0}
    # 16 MiB * 2**0.5 lies halfway in log size: the rate halfway, 100 GB/s, and the bytes there take
    # ws / rate; against a brute-force reading of the formula.
    ws = int(16 * mib * 2 ** 0.5)
    assert working_set.rate_at({k: v * 1e9 for k, v in curve.items()}, ws) == pytest.approx(100e9)
    assert working_set.rate_at(curve, mib) == 160.0 and working_set.rate_at(curve, 64 * mib) == 40.0
    ctx = {"oracle_pass_us": 300.0, "oracle_working_set_bytes": ws, "oracle_kv_bytes": 1, "draft_pass_us": 30.0,
           "draft_working_set_bytes": 2e6,
           "oracle_after_draft_us": {"after 1 draft pass": 330.0, "after 3 draft passes": 360.0},
           "oracle_after_draft_ratio": {"after 1 draft pass": 1.1, "after 3 draft passes": 1.2},
           "draft_after_oracle_us": {"after the oracle's 2-row pass": 45.0},
           "draft_after_oracle_ratio": {"after the oracle's 2-row pass": 1.5}}
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx512f"]}, "threads": 2, "rounds": 5,
              "repeats": 60, "last_level_cache_bytes": 32 * mib, "read_rate_GBps": curve,
              "passes": {"oracle": {"weight_bytes": 16.8e6}, "draft": {"weight_bytes": 1.8e6},
                         "contexts": {"128": ctx}}}
    text = working_set.table(result)
    assert "last-level cache 32 MiB" in text and "| GB/s | 160 | 40 |" in text
    row = (f"| 128 | {ws / 1e6:.1f} MB | 100 GB/s | 300 us | {ws / 100e9 * 1e6:.0f} us | 2.0 MB | 30 us | "
           "330 us (1.10x) | 360 us (1.20x) | 45 us (1.50x) |")
    assert row in text and "| draft pass after the oracle's 2-row pass |" in text
    del ctx["draft_after_oracle_us"], ctx["draft_after_oracle_ratio"]  # a run from before those columns
    assert "| 330 us (1.10x) | 360 us (1.20x) |\n" in working_set.table(result)


def _roofline_model(ms: float, widening_ms: float | None) -> dict:
    nodes = {}
    for n in (1, 2, 4, 8, 16, 32, 64):
        nodes[str(n)] = {"ratio_to_bound": 1.0 + n / 100}
        if widening_ms:
            nodes[str(n)]["ratio_to_widening_plus_compute"] = 0.5 + n / 100
    return {"params": 8.7e6, "weight_bytes": 16.8e6, "weights": "float16", "read_bandwidth_at_weight_size_GBps": 22.0,
            "ms_per_token": ms, "bound_ms": 0.769, "share_of_bound": 0.769 / ms, "share_of_bound_paired": 0.9,
            "share_of_dram_bound": 0.87, "widening_bound_ms": widening_ms, "nodes": nodes}


def test_the_roofline_table_shows_the_widening_bound_of_fp16_packed_models_only():
    roofline = _bench_module("roofline")
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx2"]}, "threads": 2, "rounds": 5,
              "dram_read_GBps": 21.1, "gemm_GFLOPs": 68.0, "widening_GBps": 26.9,
              "models": {"oracle": _roofline_model(0.911, 0.625), "draft": _roofline_model(0.076, None)}}
    text = roofline.table(result)
    assert "float16 widened to float32 at 26.9 GB/s" in text
    assert "| 87% | 0.625 |" in text and "| 87% | none (float32) |" in text
    result["models"]["draft"]["packed_as"] = "bfloat16"  # 16-bit, widened by a shift: no F16C bound either
    assert "| 87% | none (bfloat16) |" in roofline.table(result)
    widened = text.split("widening bound + compute bound")[1]
    assert "| oracle | 0.51 | 0.52 |" in widened and "| draft |" not in widened
    # passes from the row count the model takes its float32 packing at are marked
    result["models"]["oracle"]["float32_from_rows"] = 8
    marked = roofline.table(result).split("widening bound + compute bound")[1]
    assert "| oracle | 0.51 | 0.52 | 0.54 | 0.58* | 0.66* | 0.82* | 1.14* |" in marked
    # without the extension: no rate, no widening bound, no second table
    result["widening_GBps"] = None
    result["models"]["oracle"] = _roofline_model(0.911, None)
    text = roofline.table(result)
    assert "widened" not in text and "widening bound + compute" not in text


def test_passes_on_the_float32_packing_are_held_to_its_stream_not_the_widening():
    roofline = _bench_module("roofline")
    ref = roofline.widening_reference
    assert ref(4, compute=0.3, bound_bw=0.5, bound_widen=0.6, float32_from=8) == 0.6 + 0.3
    assert ref(4, compute=0.3, bound_bw=1.5, bound_widen=0.6, float32_from=None) == 1.5
    assert ref(8, compute=0.3, bound_bw=0.5, bound_widen=0.6, float32_from=8) == 1.0  # twice the stream
    assert ref(64, compute=4.0, bound_bw=0.5, bound_widen=0.6, float32_from=8) == 4.0
    row = {"widening_bound_ms": 600.0, "packing": {"float32_from_rows": 8},
           "nodes": {"4": {"seconds": 1.8, "compute_bound_s": 0.3, "bandwidth_bound_s": 0.5},
                     "8": {"seconds": 1.5, "compute_bound_s": 0.6, "bandwidth_bound_s": 0.5}}}
    roofline.derive_widening_ratios(row)
    assert row["float32_from_rows"] == 8
    assert row["nodes"]["4"]["ratio_to_widening_plus_compute"] == pytest.approx(1.8 / 0.9)
    assert row["nodes"]["8"]["ratio_to_widening_plus_compute"] == pytest.approx(1.5 / 1.0)
    # The widening probe runs one row's FMAs with the widening: those are not counted twice
    # (results measured before it did carry no row_compute_s, and keep the plain sum).
    assert ref(4, compute=0.3, bound_bw=0.5, bound_widen=0.6, float32_from=8, first_row=0.075) == \
        pytest.approx(0.6 + 0.225)
    assert ref(1, compute=0.1, bound_bw=0.5, bound_widen=0.6, float32_from=None, first_row=0.1) == 0.6
    row["nodes"]["4"]["row_compute_s"] = 0.075
    roofline.derive_widening_ratios(row)
    assert row["nodes"]["4"]["ratio_to_widening_plus_compute"] == pytest.approx(1.8 / 0.825)


def test_a_pass_is_bounded_by_what_its_attention_reads_and_computes_too():
    """An N-node pass reads the K/V cache of its prefix and nodes and scores and weighs every key
    its nodes see, besides the weights: the bounds count both (by hand: 2 layers, width 4, a
    16-token prefix, 3 nodes scoring 50 keys in all)."""
    roofline = _bench_module("roofline")
    b = roofline.pass_bounds(3, 50, n_layer=2, n_embd=4, weight_bytes=1000.0, flop_per_node=500.0,
                             bandwidth=100.0, rate=10.0, prefix=16)
    assert b["kv_bytes"] == 2 * 2 * 19 * 4 * 4  # K and V, 2 layers, 19 slots, 4 floats
    assert b["attention_flop"] == 4 * 2 * 4 * 50
    assert b["bandwidth_bound_s"] == pytest.approx((1000 + 1216) / 100)
    assert b["compute_bound_s"] == pytest.approx((1500 + 1600) / 10)
    assert b["kv_bound_s"] == pytest.approx(12.16)
    assert b["weights_bound_s"] == pytest.approx(max(1500 / 10, 1000 / 100))
    assert b["row_compute_s"] == pytest.approx(500 / 10)  # one row's products
    # a pass on the float32 packing reads its weights twice over, its K/V cache once
    ref = roofline.widening_reference
    assert ref(8, compute=0.3, bound_bw=0.6, bound_widen=0.6, float32_from=8, kv_bw=0.1) == pytest.approx(1.1)


def test_the_linear_table_shows_what_widening_adds_to_fp32_packing():
    linear = _bench_module("linear")
    rows = {str(n): {"fp16_us": 100.0 + 10 * n, "fp16_over_bound": 1.5, "torch_fp32_us": 300.0,
                     "fp32_packed_us": 80.0 + 10 * n} for n in linear.ROWS}
    shape = {"params": 0.9e6, "packed_bytes": 1.8e6, "read_bandwidth_GBps": 100.0, "rows": rows,
             "fit_us": {"a": 54.0, "b": 25.2}, "a_over_bandwidth_bound": 2.97, "b_over_compute_per_row": 0.9,
             "widening_bound_us": 69.0, "a_over_widening_bound": 0.78,
             "fp16_minus_fp32_at_6_over_widening_bound": 20.0 / 69.0}
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx2", "f16c"]}, "threads": 2,
              "gemm_GFLOPs": 66.0, "widening_GBps": 26.8, "shapes": {"draft": shape}}
    text = linear.table(result)
    assert "float16 widened at 26.8 GB/s" in text
    assert "| 140 | 69 | 0.78 | 0.29 |" in text
    result["widening_GBps"] = None
    shape = {k: v for k, v in shape.items() if "widening" not in k}
    result["shapes"]["draft"] = shape
    text = linear.table(result)
    assert "widened at" not in text and "| 140 | n/a |  |  |" in text


def test_the_readme_results_are_made_from_the_result_files(tmp_path, monkeypatch):
    """README.md's results section is what bench/report.py makes of bench/results/ (a result
    file committed without regenerating it fails here); --check writes nothing and says so."""
    report = _bench_module("report")
    assert report.main(["--check"]) == 0
    readme = tmp_path / "README.md"
    with open(report.README, encoding="utf-8") as f:
        text = f.read()
    readme.write_text(text.replace("| system |", "| System |", 1), encoding="utf-8")
    monkeypatch.setattr(report, "README", str(readme))
    before = readme.read_text(encoding="utf-8")
    assert report.main(["--check"]) == 1
    assert readme.read_text(encoding="utf-8") == before
    assert report.main([]) == 0 and readme.read_text(encoding="utf-8") == text


def test_plots_draw_the_second_machines_temperature_run_beside_the_first(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _bench_module("plots")

    _tiny_results(str(tmp_path))
    os.rename(tmp_path / "temperature.json", tmp_path / "temperature_avx2.json")
    assert plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    assert "temperature_avx2.png" in os.listdir(tmp_path / "png")
    assert "temperature.png" not in os.listdir(tmp_path / "png")


def test_the_widening_bench_reads_its_loops_output_and_tables_the_cost_of_each_row():
    widening = _bench_module("widening")
    lines = []
    for form, one, step in (("f16c", 1.0, 0.5), ("f16c_128", 1.5, 0.25), ("integer", 1.2, 0.5), ("mixed", 0.9, 0.3),
                            ("fp32", 0.4, 0.4)):
        lines += [f"{form} {r} {one + step * (r - 1):.6f} 12.5" for r in widening.ROWS]
    ns = widening.parse("\n".join(lines) + "\n")
    assert ns["f16c"] == {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5} and ns["fp32"][4] == pytest.approx(1.6)
    md = widening.table({"machine": {"cpu": "Test CPU", "isa": "avx2"}, "ns_per_vector": ns})
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 1.00 | 1.50 (+0.50) | 2.00 (+0.50) | 2.50 (+0.50) | 1.00x |" in rows["f16c"]
    assert "| 1.50 | 1.75 (+0.25) |" in rows["f16c_128"] and rows["f16c_128"].endswith("| 1.50x |")
    assert rows["fp32"].endswith("| 0.40x |")
    assert "| 0.90 | 1.20 (+0.30) |" in rows["mixed"] and rows["mixed"].endswith("| 0.90x |")
    # a result kept before a form was added tables the forms it has
    del ns["mixed"]
    md = widening.table({"machine": {"cpu": "Test CPU", "isa": "avx2"}, "ns_per_vector": ns})
    assert "| mixed |" not in md and "| fp32 | 0.40 |" in md


def test_the_widening_bench_says_why_when_it_cannot_build_its_loop(monkeypatch, capsys):
    widening = _bench_module("widening")
    monkeypatch.setattr(widening, "machine", lambda: {"vector_extensions": ["avx", "avx2", "f16c", "fma"]})
    monkeypatch.setattr(widening.shutil, "which", lambda name: None)
    assert widening.main([]) == 2
    assert "no C++ compiler" in capsys.readouterr().err
    monkeypatch.setattr(widening, "machine", lambda: {"vector_extensions": ["avx"]})
    assert widening.main([]) == 2
    assert "lacks avx2, fma, f16c" in capsys.readouterr().err


def test_the_e2e_table_gives_the_speedup_over_prompts_that_do_not_loop():
    e2e = _bench_module("e2e")

    def run(i, tps, **kw):
        return {"id": f"P/{i}", "seconds": 1.0, "tokens_per_s": tps, **kw}

    plain = [run(i, 100.0, loops=i < 2) for i in range(5)]  # prompts 0 and 1 loop
    staged = [run(0, 300.0), run(1, 250.0), run(2, 110.0), run(3, 90.0), run(4, 130.0)]
    rows = e2e._summarise({"plain": plain, "staged": staged}, None, ["plain", "staged"])
    assert rows["staged"]["median_speedup_vs_plain"] == pytest.approx(1.3)  # all five
    assert rows["staged"]["median_speedup_vs_plain_fresh"] == pytest.approx(1.1)  # 1.1, 0.9, 1.3
    assert rows["staged"]["fresh_prompts"] == 3
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "x"}
    text = e2e.markdown({"machine": machine, "n_prompts": 5, "new_tokens": 16, "modes": {"greedy": rows}})
    assert "vs our plain, the 3 prompts that do not loop (median)" in text and "40% of plain continuations loop" in text
    assert "| staged | 130.0 |  |  | 1.30x | 1.76x | 0.90x | 1.10x |" in text


def test_e2e_runs_a_cut_draft_head_as_the_staged_strategy(monkeypatch):
    """--draft-head-rows N adds system staged_cutN, run as the staged strategy (with staged's own
    options and the mode's sampling knobs) on the engine run() gives it."""
    e2e = _bench_module("e2e")
    seen = {}

    def run(args):  # what main hands on, instead of loading engines and running them
        seen["args"] = args
        return {"modes": {}}

    monkeypatch.setattr(e2e, "run", run)
    monkeypatch.setattr(e2e, "publish", lambda *a, **k: None)
    monkeypatch.setattr(e2e, "markdown", lambda r: "")
    assert e2e.main(["--systems", "staged", "--chains", "1", "--draft-head-rows", "2048", "4096", "--no-aa"]) == 0
    assert seen["args"].systems == ["plain", "staged", "chain_1", "staged_cut2048", "staged_cut4096"]
    with pytest.raises(SystemExit):
        e2e.main(["--draft-head-rows", "0"])
    calls = []

    class Engine:
        def generate(self, ids, **kw):
            calls.append(kw)
            return types.SimpleNamespace(token_ids=[7, 8], stats={"oracle_calls": 2})

    tokens, stats = e2e._run_system(Engine(), None, "staged_cut2048", [5], 4, "topp", 3, {"staged": {"budget": 8}})
    assert tokens == [7, 8] and stats == {"oracle_calls": 2}
    assert calls == [dict(max_new_tokens=4, strategy="staged", stop_at_eos=False, seed=3, temperature=0.8,
                          top_p=0.95, budget=8)]


def test_the_round_cost_table_splits_a_chains_round_into_its_parts():
    """section_round_cost: per fixed chain of 1-4 tokens, the round's cost in plain steps and its
    parts (the rest is what the draft and the oracle pass leave), hand-computed; shapes that are
    not such chains, and sweeps measured before the split was recorded, add no row."""
    report = _bench_module("report")

    def chain(k, **kw):
        return {"strategy": "chain", "planned": False, "options": {"chain_length": k}, "label": f"chain {k}",
                "tokens_per_oracle_call": 1.75, "speedup_vs_plain": 0.875, **kw}

    split = dict(round_plain_steps=2.0, draft_plain_steps=0.25, oracle_pass_plain_steps=1.5, plain_pass_share=0.96)
    rows = [chain(1, **split), chain(5, **split), {**chain(2, **split), "planned": True},
            {**chain(3, **split), "strategy": "tree"}, chain(4)]
    table = "\n".join(report.section_round_cost([{"mode": "greedy", "rows": rows}]))
    assert "| greedy | 1 | 1.75 | 2.00 | 0.25 | 1.50 | 0.25 | 0.96 | 0.88x |" in table
    assert table.count("| greedy |") == 1  # chain 5, the planned chain, a tree, chain 4 without the split
    assert "`bench/results/sweep_greedy.json`" in table
    assert report.section_round_cost([{"mode": "greedy", "rows": [chain(1)]}]) == []


def test_the_round_cost_plot_is_drawn_from_sweeps_that_split_a_round(tmp_path):
    """plots.py draws round_cost.png from the sweeps that recorded the split, and skips it, saying
    so, when none did."""
    pytest.importorskip("matplotlib")
    plots = _bench_module("plots")
    machine = {"cpu": "Test CPU", "cores": 2, "torch": "x", "torch_threads": 2}
    split = dict(round_plain_steps=2.0, draft_plain_steps=0.25, oracle_pass_plain_steps=1.5, plain_pass_share=0.96)
    rows = [{"strategy": "chain", "planned": False, "options": {"chain_length": k}, "label": f"chain {k}",
             "tokens_per_oracle_call": 1.0 + 0.5 * k, "speedup_vs_plain": 0.9, **split} for k in (1, 2, 3)]
    for mode, with_split in (("greedy", True), ("topp", False)):
        data = {"machine": machine, "mode": mode,
                "rows": rows if with_split else [{k: v for k, v in r.items() if k not in split} for r in rows]}
        with open(tmp_path / f"sweep_{mode}.json", "w") as f:
            json.dump(data, f)
    assert plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    with open(tmp_path / "png" / "round_cost.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.remove(tmp_path / "sweep_greedy.json")
    os.remove(tmp_path / "png" / "round_cost.png")
    assert plots.main(["--results", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    assert not os.path.exists(tmp_path / "png" / "round_cost.png")


@pytest.mark.parametrize("argv,needle", [(["--repeats", "0"], "--repeats must be >= 1"),
                                         (["--limit", "0"], "--limit must be >= 1"),
                                         (["--lengths", "0", "900"], "--lengths must be in \\[0, 896\\)"),
                                         (["--lengths", "-1"], "--lengths must be in")])
def test_the_kv_dtype_bench_refuses_bad_arguments_by_name(argv, needle):
    kv_dtype = _bench_module("kv_dtype")
    with pytest.raises(ValueError, match=needle):
        kv_dtype.main(argv)


def test_the_kv_dtype_bench_joins_the_prompts_before_each_to_reach_a_length():
    kv_dtype = _bench_module("kv_dtype")
    texts = ["a b\n", "c d e\n", "f\n", "g h i j\n"]
    encode = str.split  # a token a word
    assert kv_dtype.long_prompts(texts, encode, 2, 0, 100) == texts[:2]  # each as it is
    # Each prompt after the ones before it, nearest first and cycling past the start, until it
    # has 5 words; each still ends as its own prompt does.
    assert kv_dtype.long_prompts(texts, encode, 3, 5, 100) == [
        "g h i j\n\n\na b\n", "a b\n\n\nc d e\n", "a b\n\n\nc d e\n\n\nf\n"]
    # One that would pass the room (6 words of 5) is left out; too few that fit is an error.
    assert kv_dtype.long_prompts(texts, encode, 2, 5, 5) == ["a b\n\n\nc d e\n", "f\n\n\ng h i j\n"]
    with pytest.raises(ValueError, match="only 2 prompts of 5-5 tokens"):
        kv_dtype.long_prompts(texts, encode, 3, 5, 5)
    with pytest.raises(ValueError, match="fewer than 50 tokens"):
        kv_dtype.long_prompts(texts, encode, 1, 50, 100)


def test_the_kv_dtype_table_reports_each_length_and_mode():
    kv_dtype = _bench_module("kv_dtype")
    run = {"tokens_per_s": {"float32": 2000.0, "float16": 3000.0}, "ratio": 1.5, "with_prefill_ratio": 1.1,
           "same_output": 3, "first_difference": [17]}
    result = {"machine": {"cpu": "Test CPU", "isa": "avx2"}, "threads": 2, "repeats": 3, "prompts": 4,
              "new_tokens": 128, "lengths": {"450": {"prompt_tokens": [460, 520, 480, 455],
                                                     "logit_error_max": 4.2e-4, "runs": {"greedy plain": run}}}}
    text = kv_dtype.table(result)
    assert "| 455-520 | greedy plain | 2000 | 3000 | 1.50x | 1.10x | 3/4 | 17 | 4.2e-04 |" in text
    assert "Test CPU" in text


def test_a_result_written_outside_the_checkout_takes_its_plot_beside_it(tmp_path):
    common = _bench_module("common")
    plots = os.path.join(BENCH, "results", "plots")
    assert common.plot_path("phases.json", "phases.json", "phases") == os.path.join(plots, "phases.png")
    assert common.plot_path("phases_avx2.json", "phases.json", "phases") == os.path.join(plots, "phases_avx2.png")
    out = str(tmp_path / "trial.json")
    assert common.plot_path(out, "phases.json", "phases") == str(tmp_path / "trial.png")
    # a relative name with a directory: the JSON under bench/results/, its plot beside it
    assert common.result_path("sub/x.json") == os.path.join(BENCH, "results", "sub", "x.json")
    assert common.plot_path("sub/x.json", "phases.json", "phases") == os.path.join(BENCH, "results", "sub", "x.png")
    nested = str(tmp_path / "a" / "b" / "r.json")
    assert common.save({"x": 1}, nested) == nested
    with open(nested) as f:
        assert json.load(f) == {"x": 1}


@pytest.mark.parametrize("n", range(1, 10))
def test_interleaved_orders_let_every_system_follow_every_other_equally_often(n):
    # Counted by brute force over the orders, against the design's two promises: each item in
    # each place equally often, and each ordered pair of neighbours equally often.
    items = [f"s{j}" for j in range(n)]
    orders = _bench_module("common").balanced_orders(items)
    assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(o) == sorted(items) for o in orders)
    places = collections.Counter((o[j], j) for o in orders for j in range(n))
    assert set(places.values()) == {len(orders) // n} and len(places) == n * n
    pairs = collections.Counter((o[j], o[j + 1]) for o in orders for j in range(n - 1))
    assert len(pairs) == n * (n - 1)  # every ordered pair of two systems occurs
    assert len(set(pairs.values())) <= 1  # and each as often as any other


@pytest.mark.parametrize("repeats", [3, 4])
def test_carryover_reads_each_run_by_the_system_that_ran_right_before_it(repeats):
    # A made-up e2e mode whose runs are walked as e2e.py walks them (repeat r of prompt i takes
    # the order (i * repeats + r) % len(orders)), each taking longer after a drafting system, and
    # the prompts at different speeds. The groups are counted here by brute force from that walk:
    # each run's log ratio to its prompt and system's median repeat, by its predecessor's kind.
    common = _bench_module("common")
    systems = ["plain", "chain_1", "staged", "plain_again"]
    orders = common.balanced_orders(systems)
    n_prompts = 3
    after = {"chain_1": 1.1, "staged": 1.25}  # a run right after these takes this much longer
    seconds = {s: [[0.0] * repeats for _ in range(n_prompts)] for s in systems}
    walk, before = [], None
    for i in range(n_prompts):
        for rep in range(repeats):
            for s in orders[(i * repeats + rep) % len(orders)]:
                seconds[s][i][rep] = (1.0 + i) * after.get(before, 1.0)
                if before is not None:
                    walk.append((s, i, rep, "drafting" if before in after else "plain"))
                before = s
    rows = {s: {"runs": [{"repeat_seconds": t} for t in seconds[s]]} for s in systems}
    found = common.carryover(rows, repeats)
    for s in systems:
        for kind in ("plain", "drafting"):
            xs = [math.log(seconds[s][i][rep] / statistics.median(seconds[s][i]))
                  for t, i, rep, k in walk if t == s and k == kind]
            assert found[s][kind]["n"] == len(xs)
            assert found[s][kind]["mean"] == pytest.approx(sum(xs) / len(xs), abs=1e-12)
        assert found[s]["drafting"]["mean"] > found[s]["plain"]["mean"]
    with pytest.raises(ValueError, match="repeat seconds"):
        common.carryover(rows, repeats + 1)


def test_first_divergence_names_where_two_outputs_part():
    common = _bench_module("common")
    assert common.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert common.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert common.first_divergence([1, 2], [1, 2, 3]) == 2  # one extends the other: not the same output


@pytest.mark.parametrize("argv,needle", [(["--repeats", "0"], "--repeats must be >= 1"),
                                         (["--blocks", "1"], "--blocks must be >= 2"),
                                         (["--limit", "0"], "--limit must be >= 1")])
def test_the_weight_formats_bench_refuses_bad_arguments_by_name(argv, needle):
    weight_formats = _bench_module("weight_formats")
    with pytest.raises(ValueError, match=needle):
        weight_formats.main(argv)


@pytest.mark.skipif(_cpu is None, reason="the packings are the native CPU pass's")
def test_the_weight_formats_bench_packs_each_form_as_it_names_it(checkpoints):
    """The bf16 copy holds bfloat16 values within bfloat16's rounding of the original, leaves the
    original alone, and its forms pack as float16, bfloat16 and float32 (checked by ``forms``)."""
    from staged_engine.model.checkpoint import load_model

    weight_formats = _bench_module("weight_formats")
    model = load_model(checkpoints["odd96"])
    before = model.wte.weight.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())  # as stored in fp16, as the demo pair is
    fs = weight_formats.forms(model)
    assert list(fs) == list(weight_formats.FORMS)
    copy = fs["bfloat16"][0]
    assert copy is fs["bfloat16 as float32"][0] and copy is not model
    w = copy.wte.weight
    assert torch.equal(w, w.bfloat16().float()) and w.view(-1)[0].item() == pytest.approx(1e-7, rel=1e-2)
    assert torch.allclose(w.view(-1)[1:], model.wte.weight.view(-1)[1:], rtol=2 ** -8, atol=0)
    assert torch.equal(model.wte.weight, before.half().float())


def test_the_weight_formats_table_reports_each_model_and_row_count():
    weight_formats = _bench_module("weight_formats")
    us = {"float16": 150.0, "bfloat16": 140.0, "bfloat16 as float32": 420.0}
    result = {"machine": {"cpu": "Test CPU", "isa": "avx2"}, "threads": 2, "repeats": 3, "new_tokens": 128,
              "passes": {"oracle": {"rows": {"2": {"pass_us": us, "bfloat16_speedup_over_float32": 3.0,
                                                   "bfloat16_over_float16": 0.93}}}},
              "decode": {"tokens_per_s": {"float16": 5000.0, "bfloat16": 5100.0, "bfloat16 as float32": 2000.0},
                         "bfloat16_speedup_over_float32": 2.55, "bfloat16_over_float16": 1.02,
                         "bfloat16_packings_same_output": 8, "prompts": 8}}
    text = weight_formats.table(result)
    assert "| oracle | 2 | 150.0 | 140.0 | 420.0 | 3.00x | 0.93x |" in text
    assert "| 5000 | 5100 | 2000 | 2.55x | 1.02x | 8/8 |" in text
    assert "Test CPU" in text


@pytest.mark.skipif(_cpu is None, reason="the packings are the native CPU pass's")
def test_the_roofline_s_bf16_copy_is_stored_in_bfloat16_and_made_once(checkpoints):
    """``--bf16``'s checkpoint: saved in bfloat16, read back as bfloat16 values (and not all float16
    ones), so it packs as bfloat16 and llama.cpp converts it at bf16; a second call reuses it."""
    from staged_engine.model.backend import TorchBackend
    from staged_engine.model.checkpoint import load_model

    roofline = _bench_module("roofline")
    path = roofline.bf16_checkpoint(checkpoints["odd96"])
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    model = load_model(path)
    assert roofline.stored_format(model) == "bfloat16" and roofline.LLAMA_TYPES["bfloat16"] == "bf16"
    assert roofline.stored_format(load_model(checkpoints["odd96"])) == "float32"
    assert TorchBackend(native=True, wide_weights=False).native_model(model).weight_format == "bfloat16"
    stamp = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert roofline.bf16_checkpoint(checkpoints["odd96"]) == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == stamp


def test_a_bench_refusing_its_arguments_says_so_in_one_line_with_exit_code_2():
    import subprocess

    proc = subprocess.run([sys.executable, os.path.join(BENCH, "weight_formats.py"), "--blocks", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "weight_formats.py: error: --blocks must be >= 2, got 1"
    assert "Traceback" not in proc.stderr


def test_the_phases_bench_times_passes_in_calls_and_back_to_back(checkpoints):
    """Both regimes of bench/phases.py measure: a pass a call, and with ``--region`` 8 passes back
    to back in one native call, each repeat's phases divided over its passes (so a pass's phases
    stay within its wall time in both) and every row count and context reported."""
    import types

    phases = _bench_module("phases")
    from staged_engine.model.backend import _cpu

    class Bar:
        def update(self, n):
            pass

    rows = {}
    _cpu.set_phase_timing(True)
    try:
        for region in (False, True):
            args = types.SimpleNamespace(contexts=[8, 16], rows=[1, 3], repeats=5, region=region)
            out = phases.measure(checkpoints["odd96"], args, Bar())
            rows[region] = out["contexts"]
    finally:
        _cpu.set_phase_timing(False)
    for region, contexts in rows.items():
        assert list(contexts) == ["8", "16"] and all(list(r) == ["1", "3"] for r in contexts.values())
        for r in contexts.values():
            for row in r.values():
                inside = sum(v for k, v in row["phase_us"].items() if k != "outside")
                assert 0 < inside <= row["wall_us"] * 1.05, (region, row)
                assert row["phase_us"]["qkv"] > 0 and row["phase_us"]["attention"] > 0
                # Each thread's phases, over the same repeats, average to the table's, and a thread's
                # busy time and waits stay within the pass.
                per = row["thread_us"]
                assert len(per) == len(row["busy_us"]) >= 1
                for name, us in row["phase_us"].items():
                    if name != "outside":
                        assert sum(t[name] for t in per) / len(per) == pytest.approx(us, rel=1e-9), (name, row)
                for t, b in zip(per, row["busy_us"]):
                    assert 0 < b <= b + t["wait"] <= row["wall_us"] * 1.05, (region, row)


def test_the_roofline_times_chains_back_to_back_against_their_own_bounds(checkpoints):
    """A chain of N tokens below the prefix, passes back to back in one native call: a positive
    median for every N up to 8 (an empty curve would mean the native path was not taken); a
    chain's keys are the prefix's and the tokens before it for each
    token; the table gains the chains' ratios where a result has them and not otherwise."""
    roofline = _bench_module("roofline")
    from staged_engine.model.backend import TorchBackend
    from staged_engine.model.checkpoint import load_model

    model = load_model(checkpoints["odd96"])
    curve = roofline.chain_curve(model, TorchBackend(), prefix=16, repeats=2, passes=3)
    assert list(curve) == roofline.CHAIN_NODES == [1, 2, 4, 8] and all(t > 0 for t in curve.values())
    assert roofline.chain_keys(3, prefix=10) == 3 * 10 + 1 + 2 + 3
    result = {"machine": {"cpu": "Test CPU", "vector_extensions": ["avx2"]}, "threads": 2, "rounds": 5,
              "dram_read_GBps": 21.1, "gemm_GFLOPs": 68.0, "widening_GBps": None,
              "models": {"oracle": _roofline_model(0.911, None), "draft": _roofline_model(0.076, None)}}
    assert "A chain of N tokens" not in roofline.table(result)
    result["models"]["oracle"]["chains"] = {str(n): {"ratio_to_bound": 1.2 + n / 100} for n in (1, 2, 4, 8)}
    text = roofline.table(result).split("A chain of N tokens")[1]
    assert "| oracle | 1.21 | 1.22 | 1.24 | 1.28 |" in text and "| draft |" not in text
