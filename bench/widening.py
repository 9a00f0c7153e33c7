"""What a row costs over float16 weights: F16C's widening against the FMAs, on one core.

The native decode path keeps fp16 checkpoints packed as float16 and widens each weight vector in
registers (VCVTPH2PS), once per vector whatever the rows; every row then costs one FMA per
vector. Where the widening runs beside the FMAs, a pass over a few rows costs about what one row
does; where it takes the FMA pipes, every row adds its FMAs on top. This bench measures which,
with nothing else in the way: a small C++ loop (compiled here with g++) over 16 KiB of weights
that L1 holds, 1-4 rows (4 weight vectors a step for 1-3 rows, 2 for 4, as the engine's blocks
hold them), best of 7 runs, one thread, in four forms:

- ``f16c``: VCVTPH2PS ymm then an FMA per row (the engine's AVX2 loop);
- ``f16c_128``: the same in 128-bit halves (VCVTPH2PS xmm, 128-bit FMAs);
- ``integer``: the widening done with integer ops (sign-extend, shift, mask), exact for finite
  halves when the activations are scaled by 2^112: a form that stays off F16C's unit;
- ``mixed``: one weight vector in 4 widened with the integer ops, the rest with F16C: where the
  two run on different pipes, the widening's work is shared between them;
- ``fp32``: float32 weights (no widening, twice the bytes): the FMAs alone.

Reports nanoseconds per 8 weights (one vector) and the cost of each row beyond the first, and
writes bench/results/widening.json (``--out``). x86-64 with AVX2, FMA and F16C only.

    python bench/widening.py [--out widening_avx2.json]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from common import machine, publish, run_main

ROWS = (1, 2, 3, 4)
FORMS = ("f16c", "f16c_128", "integer", "mixed", "fp32")

SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

// Weight vectors of 8 a step of k, as the engine's blocks hold them: 4 for 1-3 rows (two panel
// groups of two), 2 for 4 rows (one group), so the accumulators stay in the 16 ymm registers.
template <int NR>
constexpr int kVectors = NR <= 3 ? 4 : 2;

template <int NR, int FORM>  // FORM: 0 f16c, 2 integer, 3 fp32, 4 mixed (every 4th vector integer)
__attribute__((noinline)) float run256(const uint16_t* h, const float* f, const float* x, int K, int reps) {
  constexpr int V = kVectors<NR>;
  __m256 acc[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(0x8FFFE000u));
  for (int rep = 0; rep < reps; ++rep) {
    const uint16_t* p = h;
    const float* q = f;
    for (int k = 0; k < K; ++k, p += V * 8, q += V * 8) {
      __m256 xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = _mm256_set1_ps(x[r * K + k]);
      for (int j = 0; j < V; ++j) {
        __m256 w;
        if (FORM == 3) {
          w = _mm256_loadu_ps(q + j * 8);
        } else {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * 8));
          if (FORM == 2 || (FORM == 4 && (k * V + j) % 4 == 3)) w = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(_mm256_cvtepi16_epi32(b), 13), mask));
          else w = _mm256_cvtph_ps(b);
        }
        for (int r = 0; r < NR; ++r) acc[r][j] = _mm256_fmadd_ps(w, xv[r], acc[r][j]);
      }
    }
  }
  __m256 s = _mm256_setzero_ps();
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < V; ++j) s = _mm256_add_ps(s, acc[r][j]);
  float o[8];
  _mm256_storeu_ps(o, s);
  return o[0];
}

template <int NR>
__attribute__((noinline)) float run128(const uint16_t* h, const float*, const float* x, int K, int reps) {
  constexpr int V = kVectors<NR>;
  __m128 acc[NR][2 * V];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * V; ++j) acc[r][j] = _mm_setzero_ps();
  for (int rep = 0; rep < reps; ++rep) {
    const uint16_t* p = h;
    for (int k = 0; k < K; ++k, p += V * 8) {
      __m128 xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = _mm_set1_ps(x[r * K + k]);
      for (int j = 0; j < 2 * V; ++j) {
        const __m128 w = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j * 4)));
        for (int r = 0; r < NR; ++r) acc[r][j] = _mm_fmadd_ps(w, xv[r], acc[r][j]);
      }
    }
  }
  __m128 s = _mm_setzero_ps();
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * V; ++j) s = _mm_add_ps(s, acc[r][j]);
  float o[4];
  _mm_storeu_ps(o, s);
  return o[0];
}

template <class F>
void one(const char* name, int nr, F&& f, double vectors) {
  double best = 1e30;
  float sink = 0.f;
  for (int t = 0; t < 7; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    sink += f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("%s %d %.6f %g\n", name, nr, best / vectors * 1e9, sink);
}

template <int NR>
void rows(const uint16_t* h, const float* f, const float* x, int reps) {
  constexpr int V = kVectors<NR>;
  const int K = 8192 / (V * 8);  // 8192 halves: 16 KiB of float16 weights
  const double vectors = static_cast<double>(K) * V * reps;
  one("f16c", NR, [&] { return run256<NR, 0>(h, f, x, K, reps); }, vectors);
  one("f16c_128", NR, [&] { return run128<NR>(h, f, x, K, reps); }, vectors);
  one("integer", NR, [&] { return run256<NR, 2>(h, f, x, K, reps); }, vectors);
  one("mixed", NR, [&] { return run256<NR, 4>(h, f, x, K, reps); }, vectors);
  // float32: the same 16 KiB, half the weights, twice the passes
  one("fp32", NR, [&] { return run256<NR, 3>(h, f, x, K / 2, 2 * reps); }, vectors);
}

int main() {
  std::vector<uint16_t> h(8192);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(0x3c00 ^ (i & 0x3ff));
  std::vector<float> f(h.size(), 1.0f), x(4 * 8192, 1e-3f);
  const int reps = 20000;
  rows<1>(h.data(), f.data(), x.data(), reps);
  rows<2>(h.data(), f.data(), x.data(), reps);
  rows<3>(h.data(), f.data(), x.data(), reps);
  rows<4>(h.data(), f.data(), x.data(), reps);
}
"""


def build(workdir: str) -> str:
    """Compile SOURCE with g++ into ``workdir``; the binary's path."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH: this bench compiles its own loop")
    src = os.path.join(workdir, "widening.cpp")
    exe = os.path.join(workdir, "widening")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run([cxx, "-O3", "-mavx2", "-mfma", "-mf16c", src, "-o", exe], check=True)
    return exe


def parse(stdout: str) -> dict[str, dict[int, float]]:
    """The binary's lines ``form rows ns_per_vector sink`` as {form: {rows: ns}}."""
    out: dict[str, dict[int, float]] = {form: {} for form in FORMS}
    for line in stdout.split("\n"):
        if line.strip():
            form, rows, ns, _ = line.split()
            out[form][int(rows)] = float(ns)
    return out


def table(result: dict) -> str:
    ns = result["ns_per_vector"]
    lines = [f"Nanoseconds per vector of 8 weights over 16 KiB that L1 holds, one thread, best of 7 "
             f"({result['machine']['cpu']}, {result['machine']['isa']}); in brackets, what each row beyond the first "
             "adds:\n",
             "| form | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in ROWS) + " | against f16c, 1 row |",
             "|---|" + "---|" * (len(ROWS) + 1)]
    for form in (f for f in FORMS if ns.get(f)):  # a result kept before a form was added has none of it
        cells = []
        for r in ROWS:
            extra = (ns[form][r] - ns[form][1]) / (r - 1) if r > 1 else None
            cells.append(f"{ns[form][r]:.2f}" + (f" (+{extra:.2f})" if extra is not None else ""))
        lines.append(f"| {form} | " + " | ".join(cells) + f" | {ns[form][1] / ns['f16c'][1]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="widening.json", help="result file name in bench/results/ (default widening.json)")
    args = ap.parse_args(argv)
    info = machine()
    missing = [f for f in ("avx2", "fma", "f16c") if f not in info.get("vector_extensions", [])]
    if missing:
        print(f"this CPU lacks {', '.join(missing)}: the loops this bench times need AVX2, FMA and F16C",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        try:
            exe = build(d)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            print(f"cannot build the bench's loop here: {exc}", file=sys.stderr)
            return 2
        done = subprocess.run([exe], check=True, capture_output=True, text=True)
    result = {"benchmark": "what a row costs over float16 weights", "machine": info,
              "ns_per_vector": parse(done.stdout)}
    publish(result, table(result), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
