// The native decode path: a whole GPT-2 forward pass over a few rows (1-64 tree nodes per cache
// row) in one call, with no torch operator inside.
//
// Why: for models of a few million parameters a forward pass through torch pays ~100 operator
// dispatches (layer norms, adds, views, copies) that cost more than the arithmetic. Here the
// weights are packed once, every step is a plain loop over preallocated buffers, and the two
// (or more) threads share one OpenMP region per forward, meeting at a spin barrier after each
// matrix product whose output the next step reads in full, as llama.cpp's graph executor does.
//
// Packed weights: a linear's (M, K) weight becomes panels of kLanes output features, each
// stored k-major: panel p holds w[p*kLanes + l, k] at [p][k][l]. A product then broadcasts one
// activation x[r, k] against a whole panel vector, so each output lane is a single FMA chain over
// k = 0, 1, ..., K-1 with no horizontal reduction. That chain depends on nothing but the row
// itself: results do not depend on how many rows a call computes, so a tree node's logits and
// K/V are bit-identical to what plain one-token decoding computes for the same token (the
// speculative strategies' exactness rests on this). Weights whose values float16 holds exactly
// (checkpoints stored in fp16) are packed as fp16 and widened in registers: same bits, half the
// bytes streamed; weights bfloat16 holds exactly (checkpoints stored in bf16, whose small values
// float16 cannot hold) likewise as bf16.
//
// Layout of the caches: k, v (L, B, H, S, D) float32, unit stride over D. Row b's committed slots are
// [0, starts[b]); the M uncommitted entries sit at [starts[b], starts[b] + M), the new N of this
// call at [writes[b], writes[b] + N) (the last N of them). The mask (N, M) or (B, N, M) bool tells
// which uncommitted entries each new token sees; none means one chain (j <= M - N + i).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>

#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <unordered_map>
#include <vector>

#include "cpu_errors.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

namespace py = pybind11;
using namespace se_simd;

namespace {

using se_errors::fail;

// Panels per register block and rows per register block at most. Registers: kMaxRows * kPanels
// accumulators, kPanels weight vectors and one broadcast row value.
#if defined(__AVX512F__)
constexpr int kPanels = 4;  // 64 output features; 6 x 4 + 4 + 1 = 29 of the 32 zmm registers
#else
constexpr int kPanels = 2;  // 16 output features; 6 x 2 + 2 + 1 = 15 of the 16 ymm registers
#endif
constexpr int kMaxRows = 6;
constexpr int64_t kPrefetchBytes = 4096;  // software prefetch distance in a weight stream

// Whether buffers of at least kHugeBytes ask the kernel for transparent huge pages (Linux,
// madvise; a hint the kernel may decline). A weight stream larger than the TLBs' reach in 4 KiB
// pages (Zen 3's 2,048 second-level entries cover 8 MiB) pays a page walk every 4 KiB it reads;
// in 2 MiB pages the demo oracle's 17 MB are 9 pages. Switchable for side-by-side comparisons:
// it applies to buffers allocated after the call (a model packs its weights when first used).
constexpr size_t kHugeBytes = size_t(2) << 20;
std::atomic<bool> g_huge_pages{true};

bool huge_pages() { return g_huge_pages.load(); }
bool set_huge_pages(bool on) {
  g_huge_pages.store(on);
  return on;
}

// Allocates on 64-byte boundaries: a vector load from a weight stream never splits a cache line.
// Buffers of kHugeBytes or more start on a 2 MiB boundary, their size rounded up to whole 2 MiB
// pages, and are advised as huge pages (before anything touches them, so faults take them).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = (n * sizeof(T) + 63) / 64 * 64;
    const bool huge = bytes >= kHugeBytes && g_huge_pages.load();
    const size_t size = huge ? (bytes + kHugeBytes - 1) / kHugeBytes * kHugeBytes : bytes;
    void* p = std::aligned_alloc(huge ? kHugeBytes : 64, size);
    if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (huge) madvise(p, size, MADV_HUGEPAGE);  // a hint: without it, 4 KiB pages as before
#endif
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <class T>
using aligned_vector = std::vector<T, CacheLineAllocator<T>>;

enum class Epilogue { kStore, kResidual, kGeluTanh, kGelu, kRelu };

// bfloat16 bits, a type of their own so that a weight stream's element type picks its widening
// (vloadw); a product packed so holds them in the same 16-bit buffers as float16 bits.
enum class bf16_t : uint16_t {};

struct PackedLinear {
  int64_t M = 0, K = 0, panels = 0;
  bool half = false;   // packed as 16-bit values: float16 bits, or bfloat16 bits where ``brain``
  bool brain = false;  // packed as bfloat16 bits (weights bfloat16 holds exactly and float16 does not)
  // Every weight is a float16 value, or (``brain``'s case) a bfloat16 one: 2 bytes each in the
  // checkpoint, packed so unless told otherwise.
  bool exact = false;
  // Panels come in groups of at most kPanels, group g holding panels [first[g], first[g + 1]),
  // np of them, stored k-major and interleaved, (K, np, kLanes), so a register block streams one
  // sequential run. The groups are cut within the shares of the ``split`` threads a forward pass
  // runs on, panels [panels * t / split, panels * (t + 1) / split) for thread t, so each thread
  // computes its even share in whole groups (``shares``): an 80-wide product, 5 panels, goes 3
  // and 2 on two threads, where groups of 4 made it 4 and 1. The groups lie one after another
  // in wh / wf, or, once a model has laid its products out in the order its threads read them
  // (NativeGPT2::lay_out), wherever ``at`` says in its buffer.
  aligned_vector<uint16_t> wh;  // float16 bits
  aligned_vector<float> wf;     // float32
  const uint16_t* wh_base = nullptr;  // the laid-out buffer, or null: wh / wf
  const float* wf_base = nullptr;
  std::vector<int64_t> at;      // per group: its first element in that buffer
  std::vector<float> bias;   // (panels * kLanes), zero-padded; empty when there is none
  int64_t ahead = 0;         // bytes of software prefetch ahead of the weight stream; 0: none
  // Whether those prefetches are non-temporal (PREFETCHNTA): set for a model whose weights
  // outgrow the last-level cache (NativeGPT2::set_streaming), which then holds none of them from
  // one pass to the next, and whose lines would only evict what it can hold (see there).
  bool stream = false;
  std::vector<int64_t> first{0};   // per group its first panel, and the panel count at the end
  std::vector<int64_t> shares{0, 0};  // thread t of ``split``: groups [shares[t], shares[t + 1])
  int split = 1;

  int64_t groups() const { return static_cast<int64_t>(first.size()) - 1; }
  int64_t group_panels(int64_t g) const { return first[g + 1] - first[g]; }
  int64_t group_elems(int64_t g) const { return group_panels(g) * K * kLanes; }
  // Where group g starts before lay_out: the groups in panel order, each (K, np, kLanes).
  int64_t packed_offset(int64_t g) const { return first[g] * K * kLanes; }
  int64_t offset(int64_t g) const { return at.empty() ? packed_offset(g) : at[static_cast<size_t>(g)]; }
  // Whether every group but the last holds kPanels panels, starting at a multiple of kPanels.
  bool even_groups() const {
    for (int64_t g = 0; g + 1 < groups(); ++g)
      if (first[g] != g * kPanels || group_panels(g) != kPanels) return false;
    return true;
  }
  const uint16_t* group_h(int64_t g) const { return (wh_base ? wh_base : wh.data()) + offset(g); }
  const bf16_t* group_b(int64_t g) const { return reinterpret_cast<const bf16_t*>(group_h(g)); }
  const float* group_f(int64_t g) const { return (wf_base ? wf_base : wf.data()) + offset(g); }
  size_t bytes() const { return static_cast<size_t>(panels * K * kLanes) * (half ? 2 : 4); }
  // Bytes of one whole group (kPanels panels): one stream of a register block.
  int64_t group_bytes() const { return K * kPanels * kLanes * (half ? 2 : 4); }
};

// The software prefetch distance in a product's weight streams once the weights outgrow the L2
// caches: kPrefetchBytes, where that stays within the stream's own group; none for shorter
// groups. A block over several groups reads them side by side, so the line kPrefetchBytes past
// a short group lies in a group the same block is reading at that moment, or its neighbour is:
// the prefetch fetches nothing new and costs a load slot per k. On an AVX2 Zen 3 (AMD EPYC), the
// demo draft's K = 80 products have 2.5 KB groups: without it its LM head alone (1.3 MB) took
// 0.60-0.84x the time over one row (6 pairs of processes; one pair 1.2x) and the draft's one-row
// pass 0.93x (median of 10 pairs in one process). Its K = 320 product and all of the demo
// oracle's (K >= 256) keep it. (The AVX2 form over several groups at once, block_groups, has
// since dropped this prefetch altogether and keeps only its second one, into L2: see there.)
int64_t weight_ahead(const PackedLinear& L) { return L.group_bytes() >= kPrefetchBytes ? kPrefetchBytes : 0; }

// Cuts panels [0, panels) into groups of at most kPanels within each of ``split`` threads' even
// shares (see PackedLinear).
void cut_groups(PackedLinear& p, int split) {
  p.split = split;
  p.first.assign(1, 0);
  p.shares.assign(1, 0);
  for (int t = 0; t < split; ++t) {
    const int64_t end = p.panels * (t + 1) / split;
    for (int64_t at = p.first.back(); at < end; at = p.first.back()) p.first.push_back(std::min(at + kPanels, end));
    p.shares.push_back(p.groups());
  }
}

PackedLinear pack_linear(const torch::Tensor& w_in, const c10::optional<torch::Tensor>& b_in, const char* name,
                         int split, bool allow_half = true) {
  SE_CHECK(w_in.dim() == 2, name, " must be 2-D (out, in), got ", w_in.dim(), " dimensions");
  SE_CHECK(w_in.scalar_type() == torch::kFloat32, name, " must be float32, got ", w_in.scalar_type());
  const torch::Tensor w = w_in.contiguous();
  PackedLinear p;
  p.M = w.size(0);
  p.K = w.size(1);
  SE_CHECK(p.M >= 1 && p.K >= 1, name, " is empty");
  p.panels = (p.M + kLanes - 1) / kLanes;
  const float* src = w.data_ptr<float>();
  // float16 where it holds every weight; else bfloat16 where that does (its low 16 bits zero:
  // widening shifts them back in, exactly); else float32.
  bool f16 = true, bf16 = true;
  for (int64_t i = 0, n = w.numel(); i < n && (f16 || bf16); ++i) {
    const float x = src[i];
    const bool finite = std::isfinite(x);
    f16 = f16 && finite && static_cast<float>(c10::Half(x)) == x;
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bf16 = bf16 && finite && (bits & 0xFFFFu) == 0;
  }
  p.exact = f16 || bf16;
  p.half = p.exact && allow_half;
  p.brain = p.half && !f16;
  cut_groups(p, std::max(1, split));
  const int64_t total = p.panels * p.K * kLanes;
  if (p.half) p.wh.assign(total, 0); else p.wf.assign(total, 0.f);
  for (int64_t g = 0; g < p.groups(); ++g) {
    const int64_t np = p.group_panels(g), base = p.packed_offset(g);
    for (int64_t m = p.first[g] * kLanes; m < std::min(p.M, p.first[g + 1] * kLanes); ++m) {
      const int64_t j = m / kLanes - p.first[g], lane = m % kLanes;
      for (int64_t k = 0; k < p.K; ++k) {
        const float x = src[m * p.K + k];
        const int64_t at = base + (k * np + j) * kLanes + lane;
        if (!p.half) {
          p.wf[at] = x;
        } else if (p.brain) {  // panels in pairs, interleaved (vload_bf16_pair); an odd last one alone
          uint32_t bits;
          std::memcpy(&bits, &x, sizeof bits);
          const int64_t pairs = np / 2 * 2;
          const int64_t slot = j < pairs ? base + (k * np + (j & ~int64_t(1))) * kLanes + 2 * lane + (j & 1) : at;
          p.wh[slot] = static_cast<uint16_t>(bits >> 16);
        } else {
          p.wh[at] = c10::Half(x).x;
        }
      }
    }
  }
  if (b_in.has_value() && b_in->defined()) {
    const torch::Tensor b = b_in->contiguous();
    SE_CHECK(b.dim() == 1 && b.size(0) == p.M && b.scalar_type() == torch::kFloat32,
             name, " bias must be float32 (", p.M, "), got ", b.sizes());
    p.bias.assign(p.panels * kLanes, 0.f);
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + p.M, p.bias.begin());
  }
  return p;
}


// gelu with tanh (HF gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// tanh(u) = 1 - 2 / (exp(2u) + 1), exact at both saturations.
inline vec vgelu_tanh(vec x) {
  const vec u = vmul(vset1(0.7978845608028654f), vfma(vmul(vset1(0.044715f), vmul(x, x)), x, x));
  const vec e = vexp(vadd(u, u));
  const vec t = vsub(vset1(1.f), vdiv(vset1(2.f), vadd(e, vset1(1.f))));
  return vmul(vmul(vset1(0.5f), x), vadd(vset1(1.f), t));
}

inline vec vloadw(const uint16_t* p) { return vload_h(p); }
inline vec vloadw(const float* p) { return vload(p); }

// The NP panel vectors of one k of a panel group, widened to float32. bfloat16 groups hold their
// panels in interleaved pairs and an odd last panel alone (pack_linear).
template <int NP, typename W>
inline void load_panels(const W* w, vec (&wv)[NP]) {
  if constexpr (std::is_same_v<W, bf16_t>) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(w);
    for (int j = 0; j + 1 < NP; j += 2) vload_bf16_pair(h + j * kLanes, wv[j], wv[j + 1]);
    if constexpr (NP % 2 == 1) wv[NP - 1] = vload_bf16(h + (NP - 1) * kLanes);
  } else {
    for (int j = 0; j < NP; ++j) wv[j] = vloadw(w + j * kLanes);
  }
}

// The epilogue of one register block: y rows [r0, r0 + NR) x panels [p0, p0 + NP) from the
// accumulated x W^T, plus the bias, then ``ep``.
template <int NR, int NP>
inline void finish(vec (&acc)[NR][NP], const PackedLinear& L, float* y, int64_t ldy, int64_t r0, int64_t p0,
                   Epilogue ep) {
  for (int j = 0; j < NP; ++j) {
    const int64_t col = (p0 + j) * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, L.M - col);
    const vec bv = L.bias.empty() ? vzero() : vload(L.bias.data() + col);
    for (int r = 0; r < NR; ++r) {
      float* out = y + (r0 + r) * ldy + col;
      vec v = L.bias.empty() ? acc[r][j] : vadd(acc[r][j], bv);
      switch (ep) {
        case Epilogue::kResidual: {  // y is the residual stream: y = y + (x W^T + b)
          const vec old = valid == kLanes ? vload(out) : vload_tail(out, valid);
          v = vadd(old, v);
          break;
        }
        case Epilogue::kGeluTanh: v = vgelu_tanh(v); break;
        case Epilogue::kRelu: v = vmax(v, vzero()); break;
        default: break;
      }
      if (ep == Epilogue::kGelu) {  // exact (erf) gelu: rare in GPT-2 checkpoints, done per lane
        alignas(64) float tmp[kLanes];
        vstore(tmp, v);
        for (int64_t l = 0; l < valid; ++l) out[l] = 0.5f * tmp[l] * (1.f + std::erf(tmp[l] * 0.70710678118654752f));
        continue;
      }
      if (valid == kLanes) vstore(out, v); else vstore_tail(out, v, valid);
    }
  }
}

// A software prefetch of weight bytes with the stream's usual ``Hint``, or non-temporal where
// the model streams its weights (PackedLinear::stream).
template <int Hint>
inline void prefetch_weights(const void* p, bool nta) {
  if (nta) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA);
  else _mm_prefetch(static_cast<const char*>(p), static_cast<_mm_hint>(Hint));
}

// One register block: rows [r0, r0 + NR) x panels [p0, p0 + NP) of y = x W^T + b, then the
// epilogue. w is the panel group's weights, (K, NP, kLanes) k-major, as float16 bits (widened in
// registers) or float32; ahead, bytes of software prefetch in that stream (0: none). x rows have
// stride ldx; y rows stride ldy (>= M; the features past M are not stored).
template <int NR, int NP, typename W>
inline void block(const W* w, int64_t ahead, const PackedLinear& L, const float* x, int64_t ldx, float* y,
                  int64_t ldy, int64_t r0, int64_t p0, Epilogue ep) {
  vec acc[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = vzero();
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + (r0 + r) * ldx;
  const bool nta = L.stream;
  // One row over bfloat16 weights without it, as block_narrow over float16: the hardware
  // prefetchers keep up with one row's pace (Zen 4, demo oracle's weights rounded to bf16, one
  // process, alternating: one-row passes 158-162 us without, 177-182 with; two rows level, three
  // 1.5-2% faster with it).
  const bool pf = ahead && !(std::is_same_v<W, bf16_t> && NR == 1);
  for (int64_t k = 0; k < L.K; ++k, w += NP * kLanes) {
    if (pf)
      for (int64_t off = 0; off < NP * kLanes * static_cast<int64_t>(sizeof(W)); off += 64)
        prefetch_weights<_MM_HINT_T0>(reinterpret_cast<const char*>(w) + ahead + off, nta);
    vec wv[NP];
    load_panels<NP>(w, wv);
    for (int r = 0; r < NR; ++r) {
      const vec xv = vset1(xr[r][k]);
      for (int j = 0; j < NP; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  finish<NR, NP>(acc, L, y, ldy, r0, p0, ep);
}

#if defined(__AVX512F__)
// The same block over float16 weights in 256-bit halves: each 16-lane panel is widened and
// accumulated as two 8-lane vectors (VCVTPH2PS ymm, FMA ymm), joined for the epilogue. Every lane
// is the same FMA chain over k, so the bits are those of ``block``. Where the 512-bit widening is
// the bottleneck (Zen 4 issues VCVTPH2PS zmm at half the rate of two ymm ones: one row streamed
// fp16 weights at 95 GB/s a core in ymm against 56 in zmm) it is faster for the few rows whose
// FMAs do not hide the widening; ``narrow_rows`` measures where. Blocks of three rows widen each
// vector just before its FMAs (6 x 4 accumulators, 3 broadcasts and one weight vector: 28 of the
// 32 registers, where holding all eight widened vectors would spill): the demo oracle's products
// over three rows took 0.86-0.89x the time of the 512-bit block, its three-row passes 0.95x and
// the draft's 0.93x (Zen 4, one process, alternating). One and two rows keep the eight widened
// vectors: with the three-row loop for every row count the demo oracle's one-row passes took
// about 1.15x the time (Zen 4, the two builds alternating over 8 process pairs). No software
// prefetch: at this rate the hardware prefetchers keep up, and the prefetch instructions cost
// more than they saved
// (demo oracle, one row: 0.19-0.21 ms a pass without, 0.21-0.24 with 4 KB ahead, alternating).
template <int NR, int NP>
inline void block_narrow(const uint16_t* w, int64_t /*ahead*/, const PackedLinear& L, const float* x, int64_t ldx,
                         float* y, int64_t ldy, int64_t r0, int64_t p0, Epilogue ep) {
  __m256 acc[NR][2 * NP];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + (r0 + r) * ldx;
  for (int64_t k = 0; k < L.K; ++k, w += NP * kLanes) {
    if constexpr (NR <= 2) {
      __m256 wv[2 * NP];
      for (int j = 0; j < 2 * NP; ++j) wv[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * 8)));
      for (int r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_set1_ps(xr[r][k]);
        for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    } else {
      __m256 xv[NR];
      for (int r = 0; r < NR; ++r) xv[r] = _mm256_set1_ps(xr[r][k]);
      for (int j = 0; j < 2 * NP; ++j) {
        const __m256 wv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * 8)));
        for (int r = 0; r < NR; ++r) acc[r][j] = _mm256_fmadd_ps(wv, xv[r], acc[r][j]);
      }
    }
  }
  vec joined[NR][NP];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NP; ++j)
      joined[r][j] = _mm512_insertf32x8(_mm512_castps256_ps512(acc[r][2 * j]), acc[r][2 * j + 1], 1);
  finish<NR, NP>(joined, L, y, ldy, r0, p0, ep);
}
#endif

#if !defined(__AVX512F__)
// A pass over one to three rows, 8 lanes a vector: a group of kPanels = 2 panels gives a block of
// one row 2 accumulators, of two rows 4 and of three 6, each one FMA chain over k, so the FMAs
// wait on their own latency (4 cycles, 2 pipes: 8 chains keep an FMA unit busy). On an
// AVX2 Zen 3 one row of the demo draft's products took the same time with float16 and float32
// weights (74-75 us on one thread): neither the widening nor the stream set it. So blocks of
// one row take kGroupsAtOnce<1> = 4 of the thread's groups at once and of two or three rows 2
// (12 accumulators, 3 broadcasts and a weight vector: the 16 ymm registers), each
// group its own stream and its own accumulators: every output is still the same one chain over
// k = 0..K-1, so the bits are those of ``block``. There, one row of the draft's 1.8 MB of fp16
// weights took 44 us instead of 73 on one thread, 34 instead of 53 on two; two and three rows
// ran 1.1-1.4x faster on two threads and, over the oracle's 16.8 MB on one thread, 1.44-1.49x
// and 1.12-1.14x, except in minutes when other guests had cut this one's L3 read rate (one
// group a block then took 1.05-1.19 ms instead of 0.69-0.74): 0.83-0.93x. So neither form is
// the default: each model chooses (FormChooser, below). Two rows over three or four groups at
// once (12 or 16 accumulators) were slower: the demo oracle's two-row passes took 358 / 405 / 464
// us with 2 / 3 / 4 groups, and 422 / 477 / 508 in a second process, the draft's level at 3 and
// 1.2x at 4 (AVX2 Zen 3, the forms alternating in one process, the same bits).
// (The AVX-512 build has 4 zmm chains a row, or 8 ymm ones in block_narrow, and keeps its blocks.)
template <int NR>
constexpr int kGroupsAtOnce = NR == 1 ? 4 : NR <= 3 ? 2 : 1;
#endif

// A second software prefetch, into L2, in each weight stream of a block of two or three rows
// over several groups (block_groups), where the weights outgrow the L2 caches: at the same k of
// the group NG groups on, i.e. the stream the thread's next run will read (the layout places it
// right after this run). With two or three rows the loop issues its loads at half the pace per
// weight byte and the weights came in slower than the FMAs used them (the demo oracle's two-row
// pass cost 1.12-1.24x its one-row pass). It applies where a run spans at most ``l2_ahead`` bytes
// (0: never; 64 KB by default, so the lookahead of every stream stays a fraction of L2) and the
// product has a prefetch distance, i.e. groups at least as long as it (weight_ahead; over the demo draft's
// K = 80 groups, prefetching the next run made two-row passes 1.03-1.11x slower). Demo oracle at 200
// cached tokens, AVX2 Zen 3, on and off alternating per pass in one process: two-row passes
// 0.91-0.95x (4 runs), three-row 0.98-0.99x; GPT-2-small shape, one run of 12 passes each, two
// rows 0.98x and three 0.94x. In a slower hour (one-row passes ~600 us instead of ~400) two runs
// showed no difference beyond the noise either way, and a sampled chain of one token end to end
// 0.993x: the gain depends on what the other guests leave of the L3, and no run measured a loss.
// Never changes a bit; ``set_l2_ahead`` sets the bound for comparisons.
std::atomic<int64_t> g_l2_ahead{65536};

int64_t l2_ahead() { return g_l2_ahead.load(std::memory_order_relaxed); }

int64_t set_l2_ahead(int64_t bytes) {
  SE_CHECK(bytes >= 0 && bytes <= (int64_t(1) << 20) && bytes % 64 == 0,
           "bytes must be a multiple of 64 in [0, 1 MiB], got ", bytes);
  g_l2_ahead.store(bytes, std::memory_order_relaxed);
  return l2_ahead();
}

// Whether blocks of one to three rows take several groups at once (AVX2 builds; the AVX-512 build
// has no such form): kAuto (the default) lets each model choose pass by pass (FormChooser), kOn
// and kOff pin the form for the tests and benches that compare the two. The bits are the same
// either way, so the choice changes speed only.
enum GroupRuns : int { kRunsOff = 0, kRunsOn = 1, kRunsAuto = 2 };
std::atomic<int> g_group_runs{kRunsAuto};

int group_runs_mode() {
#if defined(__AVX512F__)
  return kRunsOff;
#else
  return g_group_runs.load(std::memory_order_relaxed);
#endif
}

const char* group_runs_name(int mode) { return mode == kRunsOn ? "on" : mode == kRunsOff ? "off" : "auto"; }

std::string group_runs() { return group_runs_name(group_runs_mode()); }

std::string set_group_runs(const std::string& mode) {
  SE_CHECK(mode == "auto" || mode == "on" || mode == "off", "group_runs must be 'auto', 'on' or 'off', got '",
           mode, "'");
  g_group_runs.store(mode == "on" ? kRunsOn : mode == "off" ? kRunsOff : kRunsAuto, std::memory_order_relaxed);
  return group_runs();
}

// Which form a pass over one to three rows takes, per model and row count, from the passes' own
// clock. Neither form is faster everywhere: on the project's AVX2 Zen 3 VMs several groups at
// once ran the oracle's one-row pass 5-8% faster in one hour and 4-5% slower in another, and the
// draft's first pass after an oracle pass 12% slower while its warm passes were even; over the
// oracle's weights on one thread the forms were 1.44x apart one way when other guests left the
// L3 alone and 0.83-0.93x the other way when they did not. So a model compares them in pairs of
// adjacent passes of the same row count, one each way (the first four pairs back to back, then
// a pair kPeriod passes on), and plays the form whose running log ratio of seconds is lower.
// A pair is two passes a few hundred microseconds to a round apart, so the machine's drift over
// seconds cancels out; one pass's log ratio is clipped to kClip (a pass that lost its core).
// Each pair that agrees with the form played (the played form's pass the faster) lets the next
// wait twice as long, up to kMaxPeriod passes; one that disagrees brings the wait back to
// kPeriod, so a change of the machine is followed within a few pairs. A pair every kPeriod
// passes, whatever the pairs said, cost the demo oracle's plain decoding on an AVX2 Zen 3 4.1-4.5%
// of its greedy speed and 0.5-1.5% at T 1 / top-k 50 (form chosen against pinned on, 16 held-out
// prompts x 4 repeats, two runs each: a one-row pass the other way took ~1.9x as long, 2.9% of
// passes). Thread-safe: two threads may share a packed model; a pair is whichever passes of its
// row count come next.
class FormChooser {
 public:
  static constexpr int64_t kPeriod = 32;
  static constexpr int64_t kMaxPeriod = 1024;
  static constexpr int64_t kWarm = 4;
  static constexpr double kClip = 0.4;
  static constexpr double kMinWeight = 0.25;
  enum Role : int { kExploit = 0, kFirst = 1, kSecond = 2 };
  struct Pick {
    bool on;
    int role;
  };

  Pick pick(int64_t rows) {
    std::lock_guard<std::mutex> lock(mu_);
    Bucket& b = bucket(rows);
    if (b.state == kHaveFirst) {
      b.state = kSecondOut;
      return {!b.first_on, kSecond};
    }
    if (b.state == kIdle && (b.pairs < kWarm || b.since >= b.period)) {
      b.state = kFirstOut;
      return {b.pairs % 2 == 0, kFirst};  // the form that goes first alternates
    }
    return {b.favours_on(), kExploit};
  }

  void record(int64_t rows, Pick p, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    Bucket& b = bucket(rows);
    ++b.passes;
    b.on_passes += p.on;
    if (p.role == kFirst) {
      b.first_on = p.on;
      b.first_seconds = seconds;
      b.state = kHaveFirst;
    } else if (p.role == kSecond) {
      const double on_s = p.on ? seconds : b.first_seconds, off_s = p.on ? b.first_seconds : seconds;
      if (on_s > 0.0 && off_s > 0.0) {
        const bool played_on = b.favours_on();  // the form played before this pair
        const double r = std::max(-kClip, std::min(kClip, std::log(on_s / off_s)));
        ++b.pairs;
        const double w = std::max(kMinWeight, 1.0 / static_cast<double>(b.pairs));
        b.score += w * (r - b.score);
        const bool agrees = played_on ? r <= 0.0 : r > 0.0;
        b.period = agrees && b.pairs > kWarm ? std::min(2 * b.period, kMaxPeriod) : kPeriod;
      }
      b.since = 0;
      b.state = kIdle;
    } else {
      ++b.since;
    }
  }

  // (running log(on seconds / off seconds), pairs compared, passes, passes with the form on) of
  // passes over ``rows`` rows.
  std::tuple<double, int64_t, int64_t, int64_t> state(int64_t rows) {
    std::lock_guard<std::mutex> lock(mu_);
    const Bucket& b = bucket(rows);
    return {b.score, b.pairs, b.passes, b.on_passes};
  }

 private:
  enum State : int { kIdle, kFirstOut, kHaveFirst, kSecondOut };
  struct Bucket {
    double score = 0.0, first_seconds = 0.0;
    int64_t pairs = 0, passes = 0, on_passes = 0, since = 0;
    int64_t period = kPeriod;  // passes played between pairs, once the first kWarm are done
    bool first_on = true;
    State state = kIdle;
    // The form played outside the pairs: on unless off has been seen faster.
    bool favours_on() const { return pairs == 0 || score <= 0.0; }
  };
  Bucket& bucket(int64_t rows) {
    SE_CHECK(rows >= 1 && rows <= 3, "rows must be 1-3, got ", rows);
    return buckets_[rows - 1];
  }
  std::mutex mu_;
  Bucket buckets_[3];
};

#if !defined(__AVX512F__)

// ``finish``'s epilogue for one vector v = x W^T (+ b) headed for ``out``, with ``EP`` known
// at compile time: the same operations in the same order, so the same bits.
template <Epilogue EP>
inline vec epilogue(vec v, const float* out) {
  if constexpr (EP == Epilogue::kResidual) return vadd(vload(out), v);
  else if constexpr (EP == Epilogue::kGeluTanh) return vgelu_tanh(v);
  else if constexpr (EP == Epilogue::kRelu) return vmax(v, vzero());
  else return v;
}

// Rows [r0, r0 + NR) of NG whole panel groups (kPanels panels each, first panels p0[0..NG)),
// weights w[0..NG); as ``block`` for each group, interleaved. Its loop broadcasts the rows first
// and widens each weight vector just before its FMAs, which suits these few rows; ``block``
// widens the weights first and broadcasts one row at a time, which keeps a block of 6 rows
// within the 16 ymm registers (6 broadcasts held at once would not fit), so the two loops stay
// apart.
template <int NR, int NG, Epilogue EP, typename W>
inline void block_groups(const W* const* w, int64_t ahead, const PackedLinear& L, const float* x, int64_t ldx,
                         float* y, int64_t ldy, int64_t r0, const int64_t* p0) {
  constexpr int NP = kPanels;
  // One stream pointer and each group's distance from it, so that GCC keeps the pointers and
  // the accumulators in registers (an array of NG pointers advanced in the loop, or accumulators
  // whose address the epilogue takes, went to the stack on every k).
  const W* ws = w[0];
  // No prefetch into L1, unlike ``block``: the hardware prefetchers follow the NG streams, and
  // the prefetch instructions (one a stream a k, two to a cache line of a float16 pair) cost more
  // than they brought. Demo oracle at 200 cached tokens, AVX2 Zen 3, with and without alternating
  // in one process (both forms pinned on): passes of 1, 2, 3 rows 0.82-0.91x, 0.75-0.85x and
  // 0.76-0.92x the time; with the form chosen per pass (FormChooser) 0.90x, 0.86x and 0.96x;
  // the demo draft and a GPT-2-small shape (weights from DRAM) 0.98-1.02x. The single-group
  // form keeps it: without, its passes took 1.12-1.21x the time. End to end (demo pair, 16
  // prompts, greedy, the prefetch switched per prompt in one process) plain decoding gained
  // 1.17-1.21x in tokens/s, while chains of 1 and 3 and ``staged`` kept theirs (0.99-1.03x):
  // within speculative rounds the passes did not gain what they gained alone.
  // The L2 prefetch reads the same k of the group NG groups on: the next run's stream, which the
  // thread's layout places right after this run (see l2_ahead).
  const int64_t run_bytes = NG * L.group_bytes();
  const int64_t far = NR >= 2 && ahead && run_bytes <= l2_ahead() ? run_bytes : 0;
  const bool nta = L.stream;
  int64_t off[NG];
  for (int g = 0; g < NG; ++g) off[g] = w[g] - w[0];
  vec acc[NG][NR][NP];
  for (int g = 0; g < NG; ++g)
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NP; ++j) acc[g][r][j] = vzero();
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + (r0 + r) * ldx;
  for (int64_t k = 0; k < L.K; ++k, ws += NP * kLanes) {
    vec xv[NR];
    for (int r = 0; r < NR; ++r) xv[r] = vset1(xr[r][k]);
    for (int g = 0; g < NG; ++g) {
      if (far && (k & 1) == 0) prefetch_weights<_MM_HINT_T1>(reinterpret_cast<const char*>(ws + off[g]) + far, nta);
      if constexpr (std::is_same_v<W, bf16_t>) {
        // The group's pair of panels widened together (pack_linear's interleaved pairs). Two named
        // vectors, not load_panels' array: with that, GCC kept every accumulator on the stack
        // (the AVX2 build's one-row passes over the demo oracle's weights in bf16 took 1.5x
        // float16's). Nor vload_bf16_pair, whose shift and mask this repeats: through its two
        // references the AVX2 build's FMAs with a stack operand went from 94 to 163 (objdump).
        static_assert(NP == 2, "bfloat16 panel groups of several runs are pairs");
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws + off[g]));
        const vec w0 = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        const vec w1 = _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
        for (int r = 0; r < NR; ++r) {
          acc[g][r][0] = vfma(w0, xv[r], acc[g][r][0]);
          acc[g][r][1] = vfma(w1, xv[r], acc[g][r][1]);
        }
      } else {
        for (int j = 0; j < NP; ++j) {
          const vec wv = vloadw(ws + off[g] + j * kLanes);
          for (int r = 0; r < NR; ++r) acc[g][r][j] = vfma(wv, xv[r], acc[g][r][j]);
        }
      }
    }
  }
  // The epilogue straight from the registers, with EP fixed at compile time: the generic
  // ``finish`` takes the accumulators through the stack and tests the epilogue, the bias and the
  // tail for every vector, which over the short groups of a small model (K = 80 in the demo
  // draft) cost as much as a tenth of the loop. Only a group that ends past M (never in the demo
  // pair) and the per-lane erf gelu go through ``finish``.
  const float* bias = L.bias.empty() ? nullptr : L.bias.data();
  for (int g = 0; g < NG; ++g) {
    if (EP != Epilogue::kGelu && (p0[g] + NP) * kLanes <= L.M) {
      for (int j = 0; j < NP; ++j) {
        const int64_t col = (p0[g] + j) * kLanes;
        const vec bv = bias ? vload(bias + col) : vzero();
        for (int r = 0; r < NR; ++r) {
          float* out = y + (r0 + r) * ldy + col;
          vstore(out, epilogue<EP>(bias ? vadd(acc[g][r][j], bv) : acc[g][r][j], out));
        }
      }
      continue;
    }
    vec out[NR][NP];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < NP; ++j) out[r][j] = acc[g][r][j];
    finish<NR, NP>(out, L, y, ldy, r0, p0[g], EP);
  }
}

// block_groups with the epilogue chosen at run time.
template <int NR, int NG, typename W>
inline void block_groups_ep(const W* const* w, int64_t ahead, const PackedLinear& L, const float* x, int64_t ldx,
                            float* y, int64_t ldy, int64_t r0, const int64_t* p0, Epilogue ep) {
  switch (ep) {
    case Epilogue::kStore: block_groups<NR, NG, Epilogue::kStore>(w, ahead, L, x, ldx, y, ldy, r0, p0); break;
    case Epilogue::kResidual: block_groups<NR, NG, Epilogue::kResidual>(w, ahead, L, x, ldx, y, ldy, r0, p0); break;
    case Epilogue::kGeluTanh: block_groups<NR, NG, Epilogue::kGeluTanh>(w, ahead, L, x, ldx, y, ldy, r0, p0); break;
    case Epilogue::kGelu: block_groups<NR, NG, Epilogue::kGelu>(w, ahead, L, x, ldx, y, ldy, r0, p0); break;
    case Epilogue::kRelu: block_groups<NR, NG, Epilogue::kRelu>(w, ahead, L, x, ldx, y, ldy, r0, p0); break;
  }
}

// Groups [g0, g1) for R = NR rows: runs of kGroupsAtOnce<NR> whole groups in one block, the
// rest (and any narrower group) one at a time.
template <int NR, typename W>
void few_rows_groups(const PackedLinear& L, const W* (PackedLinear::*group)(int64_t) const, const float* x,
                     int64_t ldx, float* y, int64_t ldy, Epilogue ep, int64_t g0, int64_t g1) {
  constexpr int NG = kGroupsAtOnce<NR>;
  int64_t g = g0;
  for (; g + NG <= g1; g += NG) {
    const W* w[NG];
    int64_t p0[NG];
    bool whole = true;
    for (int i = 0; i < NG; ++i) {
      w[i] = (L.*group)(g + i);
      p0[i] = L.first[g + i];
      whole = whole && L.group_panels(g + i) == kPanels;
    }
    if (!whole) break;
    block_groups_ep<NR, NG>(w, L.ahead, L, x, ldx, y, ldy, 0, p0, ep);
  }
  for (; g < g1; ++g) {
    const int np = static_cast<int>(L.group_panels(g));
    if (np == kPanels) block<NR, kPanels>((L.*group)(g), L.ahead, L, x, ldx, y, ldy, 0, L.first[g], ep);
    else block<NR, 1>((L.*group)(g), L.ahead, L, x, ldx, y, ldy, 0, L.first[g], ep);
  }
}
#endif

// The most rows a float16 register block computes in 256-bit halves (block_narrow): 0-3, chosen
// once per process by timing both forms on a panel group the L1 cache holds, or set by
// ``set_narrow_rows``. The two give the same bits, so the choice changes speed only.
std::atomic<int> g_narrow_rows{-1};
int narrow_rows();

template <int NR, typename W>
inline void block_np(int np, const W* w, int64_t ahead, const PackedLinear& L, const float* x,
                     int64_t ldx, float* y, int64_t ldy, int64_t r0, int64_t p0, Epilogue ep) {
  switch (np) {
#if defined(__AVX512F__)
    case 4: block<NR, 4>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 3: block<NR, 3>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
#endif
    case 2: block<NR, 2>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    default: block<NR, 1>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
  }
}

#if defined(__AVX512F__)
template <int NR>
inline void block_narrow_np(int np, const uint16_t* w, int64_t ahead, const PackedLinear& L, const float* x,
                            int64_t ldx, float* y, int64_t ldy, int64_t r0, int64_t p0, Epilogue ep) {
  switch (np) {
    case 4: block_narrow<NR, 4>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 3: block_narrow<NR, 3>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 2: block_narrow<NR, 2>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    default: block_narrow<NR, 1>(w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
  }
}
#endif

// A block of ``rows`` rows; up to ``narrow`` rows (narrow_rows(), read once per product) of
// float16 weights in 256-bit halves.
template <typename W>
void block_rows(int rows, int narrow, int np, const W* w, int64_t ahead, const PackedLinear& L, const float* x,
                int64_t ldx, float* y, int64_t ldy, int64_t r0, int64_t p0, Epilogue ep) {
  static_assert(kMaxRows == 6, "block_rows dispatches 1..6 rows");
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (rows <= narrow) {
      if (rows == 1) block_narrow_np<1>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep);
      else if (rows == 2) block_narrow_np<2>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep);
      else block_narrow_np<3>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep);
      return;
    }
  }
#else
  (void)narrow;
#endif
  switch (rows) {
    case 6: block_np<6>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 5: block_np<5>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 4: block_np<4>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 3: block_np<3>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    case 2: block_np<2>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
    default: block_np<1>(np, w, ahead, L, x, ldx, y, ldy, r0, p0, ep); break;
  }
}

// Panel groups [g0, g1) of y (R, M) = epilogue(x (R, K) W^T + b), every row. A group is at
// most kPanels * kLanes output features. Its rows go in register blocks of at most kMaxRows, as
// even as possible (7 rows: 3 + 4, not 6 + 1); every block streams the group's weights, from L1
// after the first. Each output is one FMA chain over k = 0..K-1
// whatever the block, so a row's bits do not depend on R.
void linear_groups(const PackedLinear& L, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t R,
                   Epilogue ep, int64_t g0, int64_t g1, bool runs) {
#if !defined(__AVX512F__)
  if (R <= 3 && runs) {  // one block of 1-3 rows: several groups at once (kGroupsAtOnce)
    auto runs = [&](auto group) {  // group: &PackedLinear::group_h, group_b or group_f
      if (R == 1) few_rows_groups<1>(L, group, x, ldx, y, ldy, ep, g0, g1);
      else if (R == 2) few_rows_groups<2>(L, group, x, ldx, y, ldy, ep, g0, g1);
      else few_rows_groups<3>(L, group, x, ldx, y, ldy, ep, g0, g1);
    };
    if (L.brain) runs(&PackedLinear::group_b);
    else if (L.half) runs(&PackedLinear::group_h);
    else runs(&PackedLinear::group_f);
    return;
  }
#else
  (void)runs;
#endif
  const int64_t blocks = (R + kMaxRows - 1) / kMaxRows;
  const int narrow = narrow_rows();
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t p0 = L.first[g];
    const int np = static_cast<int>(L.group_panels(g));
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = R * b / blocks;
      const int rows = static_cast<int>(R * (b + 1) / blocks - r0);
      if (L.brain) block_rows(rows, narrow, np, L.group_b(g), L.ahead, L, x, ldx, y, ldy, r0, p0, ep);
      else if (L.half) block_rows(rows, narrow, np, L.group_h(g), L.ahead, L, x, ldx, y, ldy, r0, p0, ep);
      else block_rows(rows, narrow, np, L.group_f(g), L.ahead, L, x, ldx, y, ldy, r0, p0, ep);
    }
  }
}

// Thread tid's share of a product's panel groups: [first, second).
std::pair<int64_t, int64_t> thread_groups(const PackedLinear& L, int tid, int nt) {
  if (nt == L.split) return {L.shares[tid], L.shares[tid + 1]};  // the even shares the groups were cut for
  return {L.groups() * tid / nt, L.groups() * (tid + 1) / nt};
}

// This thread's share of y: a contiguous range of panel groups, every row. Ends without a barrier.
void linear_part(const PackedLinear& L, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t R,
                 Epilogue ep, int tid, int nt, bool runs) {
  const auto [g0, g1] = thread_groups(L, tid, nt);
  linear_groups(L, x, ldx, y, ldy, R, ep, g0, g1, runs);
}

// Times one block form: the fastest of 32 timings of 8 calls each over the probe's panel group.
template <class F>
double fastest(F&& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 32; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int j = 0; j < 8; ++j) f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// narrow_rows' measurement: one, two and three rows of a float16 panel group of K = 128 (16 KB,
// held by L1), in 512-bit and in 256-bit form, alternately three times each. A form must be 5%
// faster to be chosen, and n rows only in 256-bit halves when n - 1 rows are. About a millisecond.
int probe_narrow_rows() {
#if defined(__AVX512F__)
  PackedLinear L;
  L.K = 128;
  L.panels = kPanels;
  L.first = {0, kPanels};
  L.M = L.panels * kLanes;
  L.half = true;
  L.wh.resize(L.panels * L.K * kLanes);
  for (size_t i = 0; i < L.wh.size(); ++i) L.wh[i] = c10::Half(static_cast<float>(i % 97) * 0.01f - 0.5f).x;
  std::vector<float> x(3 * L.K), y(3 * L.M);  // up to three rows
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.1f;
  // Whether NR rows run 5% faster in 256-bit halves: both forms alternately, the best of three.
  auto narrow_wins = [&](auto rows) {
    constexpr int NR = decltype(rows)::value;
    double wide = std::numeric_limits<double>::infinity(), narrow = wide;
    for (int trial = 0; trial < 3; ++trial) {
      wide = std::min(wide, fastest([&] { block<NR, kPanels>(L.wh.data(), 0, L, x.data(), L.K, y.data(), L.M, 0, 0, Epilogue::kStore); }));
      narrow = std::min(narrow, fastest([&] { block_narrow<NR, kPanels>(L.wh.data(), 0, L, x.data(), L.K, y.data(), L.M, 0, 0, Epilogue::kStore); }));
    }
    return narrow < 0.95 * wide;
  };
  if (!narrow_wins(std::integral_constant<int, 1>{})) return 0;
  if (!narrow_wins(std::integral_constant<int, 2>{})) return 1;
  return narrow_wins(std::integral_constant<int, 3>{}) ? 3 : 2;
#else
  return 0;  // 256-bit vectors already
#endif
}

// The probed choice, measured once per process (thread-safe static).
int probed_narrow_rows() {
  static const int probed = probe_narrow_rows();
  return probed;
}

int narrow_rows() {
  const int n = g_narrow_rows.load(std::memory_order_relaxed);
  if (n >= 0) return n;
  const int probed = probed_narrow_rows();
  g_narrow_rows.store(probed, std::memory_order_relaxed);
  return probed;
}

// Pins the choice (0-3 rows; 0: every block 512-bit wide), or with -1 returns to the probed one.
// For the tests and benches that compare the two forms: results are the same bits either way.
int set_narrow_rows(int n) {
  SE_CHECK(n >= -1 && n <= 3, "narrow_rows must be -1 (probe) or 0-3, got ", n);
#if !defined(__AVX512F__)
  if (n > 0) n = 0;  // no wider form to leave
#endif
  g_narrow_rows.store(n < 0 ? probed_narrow_rows() : n, std::memory_order_relaxed);
  return g_narrow_rows.load(std::memory_order_relaxed);
}

// The threads a forward pass (and the microbenchmarks of its kernels) runs on: torch's, at most 64.
int forward_threads() { return std::max(1, std::min<int>(at::get_num_threads(), 64)); }

// Where a forward pass's time goes (bench/phases.py): with ``set_phase_timing(true)``, each thread
// adds the wall seconds between the marks of its part of a pass (``body``) to its row of
// g_phase_seconds, one column a phase, and thread 0 counts the passes. A product's phase is its
// thread's share of it; ``kPhaseWait`` is the time a thread spins at the barriers inside the pass
// for its partners (what the slower thread's work costs the others); the choice of a token, the
// fork and join of a call's threads and the barriers around ``next`` lie outside ``body`` and
// its marks. Off (the default), a pass reads the switch once and each mark is a branch on a
// local; on, a mark reads the clock (~20 ns; a thread marks ~12 times a layer, ~100 times a pass
// over the demo oracle's 8 layers). The timing never changes a bit of the pass. It is for one
// pass at a time (a bench): passes running at once on other threads (a server's) would add to
// the same rows.
enum Phase : int { kPhaseNorms, kPhaseQKV, kPhaseAttention, kPhaseProj, kPhaseFC, kPhaseMProj, kPhaseHead,
                   kPhaseWait, kPhases };
const char* const kPhaseNames[kPhases] = {"norms", "qkv", "attention", "proj", "fc", "mproj", "head", "wait"};
constexpr int kPhaseThreads = 64;  // forward_threads()' most
std::atomic<bool> g_phase_timing{false};
double g_phase_seconds[kPhaseThreads][kPhases];  // row tid: written by thread tid only, inside passes
std::atomic<int64_t> g_phase_passes{0};
std::atomic<int> g_phase_threads{0};  // the most threads a timed pass ran on

// The totals start again from zero.
void clear_phase_totals() {
  std::memset(g_phase_seconds, 0, sizeof(g_phase_seconds));
  g_phase_passes.store(0, std::memory_order_relaxed);
  g_phase_threads.store(0, std::memory_order_relaxed);
}

// Turns the timing on or off; either way the totals start again from zero. Returns the setting.
bool set_phase_timing(bool on) {
  g_phase_timing.store(false, std::memory_order_relaxed);
  clear_phase_totals();
  g_phase_timing.store(on, std::memory_order_relaxed);
  return on;
}

// (passes timed, the phases' names, seconds[thread][phase] over them) since the last call or
// set_phase_timing, and starts the totals again. Call it between passes, not during one.
std::tuple<int64_t, std::vector<std::string>, std::vector<std::vector<double>>> phase_seconds() {
  const int nt = g_phase_threads.load(std::memory_order_relaxed);
  std::vector<std::vector<double>> seconds(nt, std::vector<double>(kPhases));
  for (int t = 0; t < nt; ++t)
    for (int i = 0; i < kPhases; ++i) seconds[t][i] = g_phase_seconds[t][i];
  const int64_t passes = g_phase_passes.load(std::memory_order_relaxed);
  clear_phase_totals();
  return {passes, std::vector<std::string>(kPhaseNames, kPhaseNames + kPhases), seconds};
}

// One thread's marks within a pass: ``mark(phase)`` adds the time since the previous mark (or
// the start) to ``phase``.
class PhaseClock {
 public:
  PhaseClock(int tid, int nth) : tid_(tid), on_(g_phase_timing.load(std::memory_order_relaxed) && tid < kPhaseThreads) {
    if (!on_) return;
    if (tid == 0) {
      g_phase_passes.fetch_add(1, std::memory_order_relaxed);
      if (g_phase_threads.load(std::memory_order_relaxed) < nth) g_phase_threads.store(std::min(nth, kPhaseThreads));
    }
    last_ = std::chrono::steady_clock::now();
  }
  void mark(int phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    g_phase_seconds[tid_][phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  int tid_;
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

// Whether weights of this many bytes outgrow the L2 caches of the threads that stream them (then
// every pass reads them from L3 or DRAM, and the decoder prefetches ahead in each stream).
bool outgrows_l2(int64_t bytes) {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > (l2 > 0 ? l2 : (1L << 20)) * static_cast<int64_t>(std::max(1, omp_get_max_threads()));
}

// The threads of one forward meet here after each step that the next reads in full. A pass
// over a few rows has ~40 of them and each step takes microseconds, so the wait is a spin on
// one cache line (tens of ns) instead of the OpenMP barrier's (~300 ns here); a thread that
// spins long (its partner descheduled) yields its core.
class SpinBarrier {
 public:
  void wait(int n) {
    if (n <= 1) return;
    const int g = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(g + 1, std::memory_order_release);
      return;
    }
    for (uint32_t spins = 0; gen_.load(std::memory_order_acquire) == g; ++spins) {
      if (spins < (1u << 16)) _mm_pause(); else std::this_thread::yield();
    }
  }

 private:
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
};

// y = (x - mean) / sqrt(var + eps) * w + b over one row of C, in a fixed order.
void layer_norm_row(const float* x, const float* w, const float* b, float eps, int64_t C, float* y) {
  const int64_t full = C - C % kLanes;
  vec s = vzero();
  for (int64_t c = 0; c < full; c += kLanes) s = vadd(s, vload(x + c));
  float sum = vsum(s);
  for (int64_t c = full; c < C; ++c) sum += x[c];
  const float mean = sum / static_cast<float>(C);
  const vec vm = vset1(mean);
  vec q = vzero();
  for (int64_t c = 0; c < full; c += kLanes) {
    const vec d = vsub(vload(x + c), vm);
    q = vfma(d, d, q);
  }
  float var = vsum(q);
  for (int64_t c = full; c < C; ++c) var += (x[c] - mean) * (x[c] - mean);
  const float rstd = 1.f / std::sqrt(var / static_cast<float>(C) + eps);
  const vec vr = vset1(rstd);
  for (int64_t c = 0; c < full; c += kLanes)
    vstore(y + c, vfma(vmul(vsub(vload(x + c), vm), vr), vload(w + c), vload(b + c)));
  for (int64_t c = full; c < C; ++c) y[c] = (x[c] - mean) * rstd * w[c] + b[c];
}

// Slots of software prefetch ahead in a head's K and V streams (0: none). The score loop walks
// the committed K rows in order and fetches rows ``kv_ahead`` slots on into L1, and the same V rows
// into L2 for the value pass that follows. At a few hundred cached tokens the cache is a quarter
// or more of what a pass reads, and without it the attention read it at about half the rate the
// weight streams reach. Demo oracle on an AVX2 Zen 3, 1 and 2 rows, on and off alternating in
// one process, two runs: 0.87-0.96x the pass time at 256 cached tokens, 0.71-0.90x at 512, no
// change at 64; 4 to 32 slots alike within the noise. ``set_kv_ahead`` changes it for
// comparisons; it never changes a bit.
std::atomic<int> g_kv_ahead{8};

int kv_ahead() { return g_kv_ahead.load(std::memory_order_relaxed); }

int set_kv_ahead(int slots) {
  SE_CHECK(slots >= 0 && slots <= 1024, "slots must be 0-1024, got ", slots);
  g_kv_ahead.store(slots, std::memory_order_relaxed);
  return kv_ahead();
}

// Prefetches rows [s, s + n) of a head's cache stream, D entries each (T: float or float16 bits),
// stride ks.
template <int Hint, typename T>
inline void prefetch_rows(const T* base, int64_t s, int64_t n, int64_t ks, int64_t D) {
  for (int64_t r = 0; r < n; ++r) {
    const char* row = reinterpret_cast<const char*>(base + (s + r) * ks);
    for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(T)); o += 64)
      _mm_prefetch(row + o, static_cast<_mm_hint>(Hint));
  }
}

// ---------------------------------------------------------------- attention of one (row, head)
// All of a head's new tokens (queries) at once. Query q sees the slot list lists[q]: the
// committed slots 0..common-1 (shared by every query), then its visible pending slots. Each K and
// V row of the shared part is loaded once for all queries, instead of once per query (with a
// float32 cache of a few hundred slots, re-reading it per query cost as much memory traffic as
// the weights). Per query the arithmetic is one fixed sequence, whatever the other queries are:
// scores four list entries at a time (an FMA chain over D, then vsum4), softmax, and values in
// even/odd pairs of list entries; the shared part is cut at a multiple of 4 (scores) and of 2
// (values) of the list index, so the pairing and grouping match the per-query continuation.
// The score loops' prefetch, at the group of four committed slots from s0: the K rows ``ahead``
// slots on into L1 and the same V rows into L2 for the value pass that follows (0: none).
template <typename T>
inline void prefetch_group(const T* kbase, const T* vbase, int64_t s0, int64_t ahead, int64_t common,
                           int64_t ks, int64_t D) {
  if (ahead && s0 + ahead < common) {
    const int64_t n = std::min<int64_t>(4, common - s0 - ahead);
    prefetch_rows<_MM_HINT_T0>(kbase, s0 + ahead, n, ks, D);
    prefetch_rows<_MM_HINT_T1>(vbase, s0 + ahead, n, ks, D);
  }
}

struct HeadQuery {
  const float* q;          // (D)
  const int64_t* pending;  // its visible pending slots: list entries common, common + 1, ..
  int64_t common;          // committed slots: list entry s < common is slot s
  int64_t n;               // list length
  float* p;                // scratch, >= n + kLanes
  float* out;              // (D)

  int64_t slot(int64_t s) const { return s < common ? s : pending[s - common]; }
};

template <typename T>
inline void score4(const float* qi, const T* const* kr, int64_t D, float sc, float* dst, int64_t cnt) {
  vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const vec qv = vload(qi + d);
    for (int u = 0; u < 4; ++u) acc[u] = vfma(qv, kv_load(kr[u] + d), acc[u]);
  }
  if (d < D) {
    const vec qv = vload_tail(qi + d, D - d);
    for (int u = 0; u < 4; ++u) acc[u] = vfma(qv, kv_load_tail(kr[u] + d, D - d), acc[u]);
  }
  alignas(16) float four[4];
  _mm_store_ps(four, _mm_mul_ps(vsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(sc)));
  for (int64_t u = 0; u < cnt; ++u) dst[u] = four[u];
}

// Values of the queries qs[0 .. QN) over the head's columns [d0, d0 + Dc), C = ceil(Dc / kLanes)
// vectors, the last of them whole when Full (Dc a multiple of kLanes) and a masked tail otherwise
// (QN = 1 or 2: their accumulators fit the registers; counts known at compile time keep them
// there). With the tail test left to run time, GCC kept the accumulators on the stack: each FMA
// stored its sum and the next read it back, a store-to-load round trip per FMA on the chain. On a
// Zen 4 (AMD EPYC, AVX-512) that made a 64-wide head's value pass ~15% slower over 256 cached slots.
template <int C, int QN, bool Full, typename T>
void head_values_group(HeadQuery* qs, int64_t common, const T* vbase, int64_t ks, int64_t d0, int64_t Dc) {
  const int64_t tail = Dc - (C - 1) * kLanes;
  vbase += d0;
  auto vrow = [&](const T* v, int c) {
    return (Full || c < C - 1) ? kv_load(v + c * kLanes) : kv_load_tail(v + c * kLanes, tail);
  };
  const int64_t shared = common - common % 2;
  vec even[QN][C], odd[QN][C];
#pragma GCC unroll 8
  for (int u = 0; u < QN; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) even[u][c] = odd[u][c] = vzero();
  for (int64_t s = 0; s < shared; s += 2) {
    const T* v0 = vbase + s * ks;
    const T* v1 = v0 + ks;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const vec a = vrow(v0, c), b = vrow(v1, c);
#pragma GCC unroll 8
      for (int u = 0; u < QN; ++u) {
        even[u][c] = vfma(vset1(qs[u].p[s]), a, even[u][c]);
        odd[u][c] = vfma(vset1(qs[u].p[s + 1]), b, odd[u][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < QN; ++u) {
    HeadQuery& hq = qs[u];
    int64_t s = shared;
    for (; s + 1 < hq.n; s += 2) {
      const T* v0 = vbase + hq.slot(s) * ks;
      const T* v1 = vbase + hq.slot(s + 1) * ks;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        even[u][c] = vfma(vset1(hq.p[s]), vrow(v0, c), even[u][c]);
        odd[u][c] = vfma(vset1(hq.p[s + 1]), vrow(v1, c), odd[u][c]);
      }
    }
    if (s < hq.n) {
      const T* v0 = vbase + hq.slot(s) * ks;
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) even[u][c] = vfma(vset1(hq.p[s]), vrow(v0, c), even[u][c]);
    }
    float den = 0.f;  // the softmax normaliser was left in p[n] by head_attention
    std::memcpy(&den, hq.p + hq.n, sizeof(float));
    const vec vinv = vset1(den);
    float* out = hq.out + d0;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const vec r = vmul(vadd(even[u][c], odd[u][c]), vinv);
      if (Full || c < C - 1) vstore(out + c * kLanes, r); else vstore_tail(out + c * kLanes, r, tail);
    }
  }
}

// Vectors of a head's columns one value pass holds per query: two accumulators each (even and odd
// list entries), so that with a pair of queries they fill half the registers (8 of AVX2's 16,
// 16 of AVX-512's 32) and leave room for the V rows and the broadcasts. Three in AVX2 (12
// accumulators, a 64-wide head in 3 chunks instead of 4) spilled and measured level: the demo
// oracle's attention grew 1.45-1.55x from one row to two against 1.45-1.64x (the phases bench,
// 3 process pairs, AVX2 Zen 3, the same bits).
constexpr int kValueVecs = kLanes == 16 ? 4 : 2;

// Values of QN queries, the head's columns in chunks of at most 4 (one query) or kValueVecs (a
// pair) vectors. Every column is the same sum whatever the chunk (each V element enters only its
// own column's accumulators), so the chunking is free to follow the registers: a 64-wide head in
// the AVX2 build takes 2 chunks for one query and 4 for a pair. (Before, the AVX2 build sent any
// head wider than 4 vectors, GPT-2's 64 among them, to a loop with one FMA chain per 8 columns:
// at a few hundred cached tokens that loop took as long as the layer's weights.)
template <int QN, typename T>
void head_values_cols(HeadQuery* qs, int64_t common, const T* vbase, int64_t ks, int64_t D) {
  const int64_t width = (QN == 1 ? 4 : kValueVecs) * kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += width) {
    const int64_t Dc = std::min(width, D - d0);
    const bool full = Dc % kLanes == 0;
#define SE_VALUES(C)                                                 \
  (full ? head_values_group<C, QN, true>(qs, common, vbase, ks, d0, Dc) \
        : head_values_group<C, QN, false>(qs, common, vbase, ks, d0, Dc))
    switch ((Dc + kLanes - 1) / kLanes) {
      case 1: SE_VALUES(1); break;
      case 2: SE_VALUES(2); break;
      case 3: SE_VALUES(3); break;
      default: SE_VALUES(4); break;
    }
#undef SE_VALUES
  }
}

// Values of every query, two at a time: each V row of the shared part is loaded once per pair
// (and chunk of columns).
template <typename T>
void head_values(HeadQuery* qs, int64_t nq, int64_t common, const T* vbase, int64_t ks, int64_t D) {
  int64_t q = 0;
  for (; q + 2 <= nq; q += 2) head_values_cols<2>(qs + q, common, vbase, ks, D);
  if (q < nq) head_values_cols<1>(qs + q, common, vbase, ks, D);
}

// Vector registers of the build: 32 in AVX-512, 16 in AVX2.
constexpr int kVecRegs = kLanes == 16 ? 32 : 16;

// Scores of QN queries (1 or 2) against the committed slots [0, shared) (a multiple of 4), four
// slots a group: per (query, slot) the very FMA chain over D and vsum4 tree of score4, so the same
// bits, with the loops over D unrolled and each K row loaded once for both queries of a pair. The
// queries' NV vectors (the last a tail of ``tail`` lanes when Tail) are loaded into registers
// once where they fit beside the 4 QN accumulators (every AVX-512 case; in AVX2, up to 24
// columns a pair, 64 alone), else once a group from L1: holding a pair's 64 columns in AVX2's 16
// registers, GCC spilled an accumulator instead, a store-to-load round trip per FMA on its chain.
// Prefetches ``ahead`` slots on in the K and V streams (0: none).
template <int NV, bool Tail, int QN, typename T>
void scores_shared(HeadQuery* qs, int64_t shared, int64_t common, const T* kbase, const T* vbase, int64_t ks,
                   int64_t D, int64_t tail, float sc, int64_t ahead) {
  constexpr bool hold = QN * NV + 4 * QN + 2 <= kVecRegs;
  auto qload = [&](int u, int c) {
    return (Tail && c == NV - 1) ? vload_tail(qs[u].q + c * kLanes, tail) : vload(qs[u].q + c * kLanes);
  };
  vec qv[QN][hold ? NV : 1];
  if constexpr (hold) {
#pragma GCC unroll 8
    for (int u = 0; u < QN; ++u)
#pragma GCC unroll 16
      for (int c = 0; c < NV; ++c) qv[u][c] = qload(u, c);
  }
  const __m128 vsc = _mm_set1_ps(sc);
  for (int64_t s0 = 0; s0 < shared; s0 += 4) {
    prefetch_group(kbase, vbase, s0, ahead, common, ks, D);
    const T* k0 = kbase + s0 * ks;
    vec acc[QN][4];
#pragma GCC unroll 8
    for (int u = 0; u < QN; ++u)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[u][j] = vzero();
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      vec qc[QN];
#pragma GCC unroll 8
      for (int u = 0; u < QN; ++u) qc[u] = hold ? qv[u][hold ? c : 0] : qload(u, c);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const T* kr = k0 + j * ks + c * kLanes;
        const vec kv = (Tail && c == NV - 1) ? kv_load_tail(kr, tail) : kv_load(kr);
#pragma GCC unroll 8
        for (int u = 0; u < QN; ++u) acc[u][j] = vfma(qc[u], kv, acc[u][j]);
      }
    }
#pragma GCC unroll 8
    for (int u = 0; u < QN; ++u)
      _mm_storeu_ps(qs[u].p + s0, _mm_mul_ps(vsum4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]), vsc));
  }
}

// scores_shared for every query, a pair at a time; the first pair prefetches for the rest.
template <int NV, bool Tail, typename T>
void scores_shared_all(HeadQuery* qs, int64_t nq, int64_t shared, int64_t common, const T* kbase,
                       const T* vbase, int64_t ks, int64_t D, int64_t tail, float sc, int64_t ahead) {
  int64_t q = 0;
  for (; q + 2 <= nq; q += 2, ahead = 0)
    scores_shared<NV, Tail, 2>(qs + q, shared, common, kbase, vbase, ks, D, tail, sc, ahead);
  if (q < nq) scores_shared<NV, Tail, 1>(qs + q, shared, common, kbase, vbase, ks, D, tail, sc, ahead);
}

// The widest head scores_shared serves, in vectors (128 columns in AVX-512, 64 in AVX2); wider
// heads take score4 for every group.
constexpr int64_t kMaxScoreVecs = 8;

// scores_shared for a head of D columns: its vector count and tail as template arguments.
template <typename T>
void head_scores_shared(HeadQuery* qs, int64_t nq, int64_t shared, int64_t common, const T* kbase,
                        const T* vbase, int64_t ks, int64_t D, float sc, int64_t ahead) {
  const int64_t nv = (D + kLanes - 1) / kLanes, tail = D - (nv - 1) * kLanes;
  const bool t = tail != kLanes;
#define SE_SCORES(N) \
  case N: \
    return t ? scores_shared_all<N, true>(qs, nq, shared, common, kbase, vbase, ks, D, tail, sc, ahead) \
             : scores_shared_all<N, false>(qs, nq, shared, common, kbase, vbase, ks, D, tail, sc, ahead);
  switch (nv) {
    SE_SCORES(1) SE_SCORES(2) SE_SCORES(3) SE_SCORES(4) SE_SCORES(5) SE_SCORES(6) SE_SCORES(7) SE_SCORES(8)
  }
#undef SE_SCORES
}

// Scores, softmax and values for the queries of one (row, head).
template <typename T>
void head_attention(HeadQuery* qs, int64_t nq, int64_t common, const T* kbase, const T* vbase, int64_t ks,
                    int64_t D, float sc) {
  const int64_t shared = common - common % 4;
  const int64_t ahead = kv_ahead();
  if ((D + kLanes - 1) / kLanes <= kMaxScoreVecs) {
    head_scores_shared(qs, nq, shared, common, kbase, vbase, ks, D, sc, ahead);
  } else {
    for (int64_t s0 = 0; s0 < shared; s0 += 4) {
      prefetch_group(kbase, vbase, s0, ahead, common, ks, D);
      const T* kr[4] = {kbase + s0 * ks, kbase + (s0 + 1) * ks, kbase + (s0 + 2) * ks, kbase + (s0 + 3) * ks};
      for (int64_t q = 0; q < nq; ++q) score4(qs[q].q, kr, D, sc, qs[q].p + s0, 4);
    }
  }
  for (int64_t q = 0; q < nq; ++q) {
    HeadQuery& hq = qs[q];
    for (int64_t s0 = shared; s0 < hq.n; s0 += 4) {
      const int64_t cnt = std::min<int64_t>(4, hq.n - s0);
      const T* kr[4];
      for (int64_t u = 0; u < 4; ++u) kr[u] = kbase + hq.slot(s0 + std::min(u, cnt - 1)) * ks;
      score4(hq.q, kr, D, sc, hq.p + s0, cnt);
    }
    // The largest score, a vector at a time (a maximum is exact in any order).
    vec vmx = vset1(-std::numeric_limits<float>::infinity());
    int64_t m = 0;
    for (; m + kLanes <= hq.n; m += kLanes) vmx = vmax(vmx, vload(hq.p + m));
    float mx = vmax_all(vmx);
    for (; m < hq.n; ++m) mx = std::max(mx, hq.p[m]);
    const vec vmxs = vset1(mx);
    vec vden = vzero();
    for (int64_t s = 0; s < hq.n; s += kLanes) {
      const int64_t t = std::min<int64_t>(kLanes, hq.n - s);
      if (t == kLanes) {
        const vec e = vexp(vsub(vload(hq.p + s), vmxs));
        vstore(hq.p + s, e);
        vden = vadd(vden, e);
      } else {
        const vec e = vexp(vsub(vload_tail(hq.p + s, t), vmxs));
        vstore_tail(hq.p + s, e, t);
        vden = vadd(vden, vload_tail(hq.p + s, t));
      }
    }
    const float inv = 1.f / vsum(vden);
    std::memcpy(hq.p + hq.n, &inv, sizeof(float));
  }
  head_values(qs, nq, common, vbase, ks, D);
}

struct Block {
  std::vector<float> ln1w, ln1b, ln2w, ln2b;
  PackedLinear qkv, proj, fc, mproj;
};

std::vector<float> to_vec(const torch::Tensor& t, int64_t n, const char* name) {
  SE_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == torch::kFloat32, name,
           " must be float32 (", n, "), got ", t.scalar_type(), " ", t.sizes());
  const torch::Tensor c = t.contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + n);
}

}  // namespace

// A GPT-2 model packed for the native decode path. Holds its own copy of the weights.
class NativeGPT2 {
 public:
  NativeGPT2(const torch::Tensor& wte, const torch::Tensor& wpe, const std::vector<torch::Tensor>& blocks,
             const torch::Tensor& lnf_w, const torch::Tensor& lnf_b, int64_t n_head, double eps,
             const std::string& activation, int64_t head_rows, bool half)
      : n_head_(n_head), eps_(static_cast<float>(eps)) {
    SE_CHECK(wte.dim() == 2 && wte.scalar_type() == torch::kFloat32, "wte must be float32 (vocab, n_embd)");
    SE_CHECK(wpe.dim() == 2 && wpe.scalar_type() == torch::kFloat32 && wpe.size(1) == wte.size(1),
             "wpe must be float32 (n_positions, n_embd)");
    V_ = wte.size(0);
    C_ = wte.size(1);
    P_ = wpe.size(0);
    SE_CHECK(head_rows >= 0 && head_rows <= V_, "head_rows must be 0 (every row) or 1-", V_, ", got ", head_rows);
    head_rows_ = head_rows == 0 ? V_ : head_rows;
    SE_CHECK(blocks.size() % 12 == 0 && !blocks.empty(), "blocks needs 12 tensors per block, got ", blocks.size());
    SE_CHECK(n_head >= 1 && C_ % n_head == 0, "n_head (", n_head, ") must divide n_embd (", C_, ")");
    if (activation == "gelu_tanh") act_ = Epilogue::kGeluTanh;
    else if (activation == "gelu") act_ = Epilogue::kGelu;
    else if (activation == "relu") act_ = Epilogue::kRelu;
    else fail("activation must be gelu_tanh, gelu or relu, got ", activation);
    D_ = C_ / n_head;
    const int nt = forward_threads();  // the threads each product's groups are cut and laid out for
    wte_ = wte.contiguous();
    wpe_ = wpe.contiguous();
    for (size_t i = 0; i < blocks.size(); i += 12) {
      const torch::Tensor* w = &blocks[i];
      Block b;
      b.ln1w = to_vec(w[0], C_, "ln_1.weight");
      b.ln1b = to_vec(w[1], C_, "ln_1.bias");
      b.qkv = pack_linear(w[2], w[3], "attn.c_attn", nt, half);
      b.proj = pack_linear(w[4], w[5], "attn.c_proj", nt, half);
      b.ln2w = to_vec(w[6], C_, "ln_2.weight");
      b.ln2b = to_vec(w[7], C_, "ln_2.bias");
      b.fc = pack_linear(w[8], w[9], "mlp.c_fc", nt, half);
      b.mproj = pack_linear(w[10], w[11], "mlp.c_proj", nt, half);
      SE_CHECK(b.qkv.M == 3 * C_ && b.qkv.K == C_, "attn.c_attn must be (", 3 * C_, ", ", C_, ")");
      SE_CHECK(b.proj.M == C_ && b.proj.K == C_, "attn.c_proj must be (", C_, ", ", C_, ")");
      SE_CHECK(b.fc.K == C_ && b.mproj.M == C_ && b.mproj.K == b.fc.M, "mlp shapes do not chain");
      inner_ = b.fc.M;
      blocks_.push_back(std::move(b));
    }
    lnfw_ = to_vec(lnf_w, C_, "ln_f.weight");
    lnfb_ = to_vec(lnf_b, C_, "ln_f.bias");
    // A drafting model may score only the first head_rows tokens (``Engine(draft_head_rows=)``):
    // its LM head, most of a small draft's weights, is packed over those rows alone, and the
    // logits of the rest are -inf, so the draft never proposes them.
    head_ = pack_linear(head_rows_ < V_ ? wte_.narrow(0, 0, head_rows_) : wte_, c10::nullopt, "wte (LM head)", nt, half);
    lay_out(nt);
    narrow_rows();  // the block form's probe, if this process has not run it, outside any pass
    // Weights that outgrow the threads' L2 caches stream from L3 or DRAM on every pass, further
    // ahead than the hardware prefetchers reach in a short run of one panel group: prefetch
    // 4 KB ahead (measured on the demo oracle, 17 MB: 0.90-0.95x the pass time without), in each
    // product whose groups are that long (weight_ahead). Weights the L2 caches hold gain nothing
    // from it and pay its instructions.
    if (outgrows_l2(weight_bytes())) {
      head_.ahead = weight_ahead(head_);
      for (auto& b : blocks_)
        for (PackedLinear* p : {&b.qkv, &b.proj, &b.fc, &b.mproj}) p->ahead = weight_ahead(*p);
    }
  }

  // Non-temporal software prefetch in every product's weight stream (PackedLinear::stream), for a
  // model whose weights outgrow the last-level cache: a pass over them evicts each line before the
  // next pass comes back to it, so every line it leaves in the caches only pushes out what they
  // could keep (the K/V cache, activations, another model's weights). The caller decides
  // (``TorchBackend._pack``: the cache size is the OS's to report). Demo oracle (16.8 MB of
  // float16 weights, 8 MB L3, AVX2 Zen 1, one process, alternating): one-row passes 0.87x, two
  // rows 0.90x, four 0.96x the time with temporal prefetch, plain decoding end to end 0.84-0.91x
  // (two runs); GPT-2-small shape (247 MB) unchanged (1.00-1.01x); the demo draft (3.9 MB packed,
  // fits) 1.0x alone and 1.12-1.17x slower in speculative rounds with it (its lines then leave
  // the L3), so it keeps temporal prefetch. Never changes a bit.
  void set_streaming(bool on) {
    head_.stream = on;
    for (auto& b : blocks_)
      for (PackedLinear* p : {&b.qkv, &b.proj, &b.fc, &b.mproj}) p->stream = on;
  }
  bool streaming() const { return head_.stream; }

  int64_t vocab_size() const { return V_; }
  int64_t n_positions() const { return P_; }

  int64_t weight_bytes() const {
    size_t total = head_.bytes();
    for (const auto& b : blocks_) total += b.qkv.bytes() + b.proj.bytes() + b.fc.bytes() + b.mproj.bytes();
    return static_cast<int64_t>(total);
  }
  bool half() const { return head_.half; }
  // How the products' weights are packed: "float16", "bfloat16" or "float32" where every product
  // is packed alike, else "mixed" (a checkpoint some of whose products neither holds exactly).
  std::string weight_format() const {
    auto name = [](const PackedLinear& L) { return L.brain ? "bfloat16" : L.half ? "float16" : "float32"; };
    const std::string head = name(head_);
    for (const auto& b : blocks_)
      for (const PackedLinear* p : {&b.qkv, &b.proj, &b.fc, &b.mproj})
        if (name(*p) != head) return "mixed";
    return head;
  }
  // Bytes of the weights one pass reads at the checkpoint's precision: 2 where every weight of a
  // product is a float16 or every one a bfloat16 value, whether or not it was packed so.
  int64_t checkpoint_bytes() const {
    auto at = [](const PackedLinear& L) { return static_cast<int64_t>(L.panels * L.K * kLanes) * (L.exact ? 2 : 4); };
    int64_t total = at(head_);
    for (const auto& b : blocks_) total += at(b.qkv) + at(b.proj) + at(b.fc) + at(b.mproj);
    return total;
  }

  // tokens, positions (B, N) int64; returns logits (B, N, V), or (B, 1, V) with last_only.
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions, torch::Tensor k_all,
                        torch::Tensor v_all, const std::vector<int64_t>& writes, const std::vector<int64_t>& starts,
                        int64_t M, const c10::optional<torch::Tensor>& mask_in, bool last_only) {
    SE_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kInt64 && positions.sizes() == tokens.sizes() &&
                 positions.scalar_type() == torch::kInt64,
             "tokens and positions must be int64 (B, N) and alike");
    const torch::Tensor tok = tokens.contiguous(), pos = positions.contiguous();
    return run(tok.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), tokens.size(0), tokens.size(1), k_all, v_all,
               writes, starts, M, mask_in, last_only, /*flat=*/false);
  }

  // One cache row (B = 1) from Python lists: the N new tokens go to slots start + M - N ..; returns
  // logits (N, V), or (1, V) with last_only. Spares the caller two tensors and a (1, N, V) view.
  torch::Tensor forward_ids(const std::vector<int64_t>& tokens, const std::vector<int64_t>& positions,
                            torch::Tensor k_all, torch::Tensor v_all, int64_t start, int64_t M,
                            const c10::optional<torch::Tensor>& mask_in, bool last_only) {
    SE_CHECK(tokens.size() == positions.size(), "tokens and positions must have one entry each, got ",
             tokens.size(), " and ", positions.size());
    const int64_t N = static_cast<int64_t>(tokens.size());
    return run(tokens.data(), positions.data(), 1, N, k_all, v_all, {start + M - N}, {start}, M, mask_in, last_only,
               /*flat=*/true);
  }

  // The K/V cache's checks (a ``B``-row cache of this model's shape); returns its slots a row.
  int64_t check_cache(const torch::Tensor& k_all, const torch::Tensor& v_all, int64_t B) const {
    const int64_t L = static_cast<int64_t>(blocks_.size());
    SE_CHECK(k_all.dim() == 5 && v_all.dim() == 5 && k_all.sizes() == v_all.sizes() &&
                 k_all.strides() == v_all.strides() && k_all.stride(4) == 1 &&
                 (k_all.scalar_type() == torch::kFloat32 || k_all.scalar_type() == torch::kHalf) &&
                 v_all.scalar_type() == k_all.scalar_type(),
             "k_cache and v_cache must be float32 or float16 (L, B, H, S, D) with unit stride over D, and alike");
    SE_CHECK(k_all.size(0) == L && k_all.size(1) == B && k_all.size(2) == n_head_ && k_all.size(4) == D_,
             "the cache must be (", L, ", ", B, ", ", n_head_, ", S, ", D_, "), got ", k_all.sizes());
    return k_all.size(3);
  }

  // The most tokens a step region's pass takes (lookup_steps: the root and up to 8 guesses).
  static constexpr int64_t kStepRows = 9;

  // One pass of a step region: over ``n`` tokens at positions ``position``.., with ``start``
  // committed slots of row 0 and ``m`` entries past them visible to it, its own the last n (slots
  // start + m - n ..; each token sees those before it), as forward_ids(.., start, m, ..) computes
  // a pass over a chain.
  struct Step {
    int64_t n = 0;
    std::array<int64_t, kStepRows> tokens{};
    int64_t position = -1, start = -1, m = 0;

    static Step one(int64_t token, int64_t position, int64_t start, int64_t m) {
      Step s;
      s.n = 1;
      s.tokens[0] = token;
      s.position = position;
      s.start = start;
      s.m = m;
      return s;
    }
    // A chain of tokens at slots and positions from ``at`` (one of more than kStepRows tokens keeps
    // its count, which step_region refuses).
    static Step chain(const std::vector<int64_t>& tokens, int64_t at) {
      Step s;
      s.n = static_cast<int64_t>(tokens.size());
      std::copy(tokens.begin(), tokens.begin() + std::min<int64_t>(s.n, kStepRows), s.tokens.begin());
      s.position = s.start = at;
      s.m = s.n;
      return s;
    }
  };

  // Passes over cache row 0 in one OpenMP region, from ``first`` on, each over at most
  // ``max_rows`` (<= kStepRows) tokens: after each, thread 0 calls ``next(logits, step)`` (logits:
  // step.n rows of V floats), which returns false to stop or sets ``step`` to the next pass.
  // Each pass is forward_ids' over its tokens, so the logits and the cache entries are the bits of
  // a call a pass; what the region spares is each pass's fork and join of the threads and its
  // setup: between passes the partners spin at a barrier while thread 0 chooses and embeds the
  // next tokens. A step outside the cache, the model's positions, the vocabulary or ``max_rows``
  // ends the run before its pass and is reported after the region. Returns the region's seconds.
  template <typename Next>
  double step_region(torch::Tensor& k_all, torch::Tensor& v_all, const Step& first, int64_t max_rows, Next&& next) {
    const int64_t S = check_cache(k_all, v_all, 1);
    SE_CHECK(max_rows >= 1 && max_rows <= kStepRows, "max_rows must be in [1, ", kStepRows, "], got ", max_rows);
    const int64_t C = C_;
    std::vector<float> x(max_rows * C), qkv(max_rows * 3 * C), att(max_rows * C), ff(max_rows * inner_),
        logits(max_rows * V_);
    Step cur = first;
    int64_t write = 0;
    Pass ps = cache_pass(k_all, v_all);
    ps.starts = &cur.start;
    ps.writes = &write;
    ps.x = x.data();
    ps.qkv = qkv.data();
    ps.att = att.data();
    ps.ff = ff.data();
    ps.lp = logits.data();
    FormChooser::Pick pick{};
    bool choose = false;
    std::chrono::steady_clock::time_point t_pass;
    // A step refused (thread 0 sets it; reported after the region): 1 its rows, 2 its slots, 3 its
    // positions, 4 a token (forward_ids' order of checks).
    Step bad;
    int why = 0;
    int64_t bad_token = 0;
    const auto begin = [&]() {  // thread 0, the partners at a barrier (or not yet forked)
      why = cur.n < 1 || cur.n > max_rows                                 ? 1
            : cur.start < 0 || cur.m < cur.n || cur.start + cur.m > S     ? 2
            : cur.position < 0 || cur.position + cur.n > P_               ? 3
                                                                          : 0;
      for (int64_t i = 0; why == 0 && i < cur.n; ++i)
        if (cur.tokens[i] < 0 || cur.tokens[i] >= V_) {
          why = 4;
          bad_token = cur.tokens[i];
        }
      if (why != 0) {
        bad = cur;
        return false;
      }
      write = cur.start + cur.m - cur.n;
      ps.N = ps.out_rows = cur.n;
      ps.M = cur.m;
      for (int64_t i = 0; i < cur.n; ++i) embed(cur.tokens[i], cur.position + i, x.data() + i * C);
      pick = pick_form(cur.n, choose);
      ps.runs = pick.on;
      t_pass = std::chrono::steady_clock::now();
      return true;
    };
    const auto t0 = std::chrono::steady_clock::now();
    if (begin()) {
      bool done = false;
      SpinBarrier barrier;
#pragma omp parallel num_threads(forward_threads())
      {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        Scratch s(max_rows * C, max_rows);
        while (true) {
          body(ps, tid, nth, barrier, s);
          barrier.wait(nth);  // the logits are whole
          if (tid == 0) {
            if (choose)
              chooser_.record(cur.n, pick,
                              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_pass).count());
            done = !next(static_cast<const float*>(logits.data()), cur) || !begin();
          }
          barrier.wait(nth);  // the next pass's tokens, slots and form are set (or done)
          if (done) break;
        }
      }
    }
    SE_CHECK(why != 1, "a pass over ", bad.n, " tokens: the region takes 1-", max_rows);
    SE_CHECK(why != 2, "a pass's slots [", bad.start + bad.m - bad.n, ", ", bad.start + bad.m, ") exceed the cache's ", S);
    SE_CHECK(why != 3, "a pass's positions [", bad.position, ", ", bad.position + bad.n, ") exceed the model's ", P_);
    SE_CHECK(why != 4, "token id ", bad_token, " is outside the vocabulary [0, ", V_, ")");
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  // ``passes`` passes over the chain ``tokens`` (1-kStepRows of them) at slots and positions
  // start.. of row 0 with ``start`` committed slots, back to back in one step region: what
  // forward_ids(tokens, start.., k, v, start, n) computes, each pass writing the same pending
  // entries. It is the regime of plain decoding's steps, the threads spinning at a barrier
  // between passes and no call from Python in between, for the benches that time passes there
  // (bench/phases.py --region; the demo oracle on an AVX2 Zen 3, both ways in one sitting:
  // one-row passes 0.75-0.81x the wall time of a native call a pass from Python, two-row passes
  // 0.87-1.03x). Returns each pass's seconds on thread 0, from the end of the pass before (the
  // first: from the call, its fork included).
  std::vector<double> region_passes(torch::Tensor k_all, torch::Tensor v_all, int64_t start,
                                    const std::vector<int64_t>& tokens, int64_t passes) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    SE_CHECK(n >= 1 && n <= kStepRows, "tokens must hold 1-", kStepRows, " tokens, got ", n);
    SE_CHECK(passes >= 1 && passes <= 1000000, "passes must be in [1, 1000000], got ", passes);
    SE_CHECK(start >= 0, "start must be >= 0, got ", start);
    std::vector<double> seconds;
    seconds.reserve(static_cast<size_t>(passes));
    auto last = std::chrono::steady_clock::now();
    step_region(k_all, v_all, Step::chain(tokens, start), n, [&](const float*, Step&) {
      const auto now = std::chrono::steady_clock::now();
      seconds.push_back(std::chrono::duration<double>(now - last).count());
      last = now;
      return static_cast<int64_t>(seconds.size()) < passes;  // the same step again, or stop
    });
    return seconds;
  }

 private:
  // Whether each head's q, k and v columns are whole panel groups of c_attn (groups of kPanels
  // from panel 0, as the even shares of heads that divide by the threads cut them) and the heads
  // divide evenly between ``nth`` threads: then heads go to threads round robin, and a thread computes
  // its own heads' q/k/v, writes their K/V and attends, with no barrier in between.
  bool heads_own(int nth) const {
    const int64_t group = static_cast<int64_t>(kPanels) * kLanes;
    return D_ % group == 0 && C_ % group == 0 && n_head_ % nth == 0 && blocks_.front().qkv.even_groups();
  }

  // The panel groups of c_attn holding part (0 q, 1 k, 2 v) of head hh, when heads_own.
  std::pair<int64_t, int64_t> head_groups(int64_t hh, int64_t part) const {
    const int64_t group = static_cast<int64_t>(kPanels) * kLanes;
    const int64_t g0 = (part * C_ + hh * D_) / group;
    return {g0, g0 + D_ / group};
  }

  // Lays every product's panel groups out in one buffer (one per weight type) in the order
  // ``nt`` threads read them in a pass: thread 0's groups of layer 0's products, of layer 1's,
  // .., of the LM head, then thread 1's, and so on. Each thread then streams one sequential run
  // of memory through a pass, instead of a short run per product that starts where another
  // thread's share ends: the hardware prefetchers carry on from one product into the next. (In
  // a microbenchmark of one row over 16.8 MB of fp16 weights, two threads, 64 products a pass
  // read at 119 GB/s laid out by product and at 150 GB/s laid out by thread.) The layout moves
  // no value and changes no arithmetic; with another thread count a pass reads the same groups,
  // only in shorter runs.
  void lay_out(int nt) {
    std::vector<std::pair<PackedLinear*, int64_t>> order;  // (product, group) in reading order
    for (int t = 0; t < nt; ++t) {
      auto share = [&](PackedLinear& L) {
        const auto [g0, g1] = thread_groups(L, t, nt);
        for (int64_t g = g0; g < g1; ++g) order.emplace_back(&L, g);
      };
      for (Block& b : blocks_) {
        if (heads_own(nt)) {
          for (int64_t hh = t; hh < n_head_; hh += nt)
            for (int64_t part = 0; part < 3; ++part) {
              const auto [g0, g1] = head_groups(hh, part);
              for (int64_t g = g0; g < g1; ++g) order.emplace_back(&b.qkv, g);
            }
        } else {
          share(b.qkv);
        }
        share(b.proj);
        share(b.fc);
        share(b.mproj);
      }
      share(head_);
    }
    int64_t nh = 0, nf = 0;
    std::vector<PackedLinear*> all{&head_};
    for (Block& b : blocks_) all.insert(all.end(), {&b.qkv, &b.proj, &b.fc, &b.mproj});
    for (PackedLinear* L : all) {
      L->at.assign(static_cast<size_t>(L->groups()), -1);
      (L->half ? nh : nf) += static_cast<int64_t>(L->bytes()) / (L->half ? 2 : 4);
    }
    arena_h_.assign(static_cast<size_t>(nh), 0);
    arena_f_.assign(static_cast<size_t>(nf), 0.f);
    int64_t ph = 0, pf = 0;
    auto place = [&](PackedLinear* L, int64_t g) {
      if (L->at[static_cast<size_t>(g)] >= 0) return;
      const int64_t n = L->group_elems(g), from = L->packed_offset(g);
      if (L->half) {
        std::copy(L->wh.begin() + from, L->wh.begin() + from + n, arena_h_.begin() + ph);
        L->at[static_cast<size_t>(g)] = ph;
        ph += n;
      } else {
        std::copy(L->wf.begin() + from, L->wf.begin() + from + n, arena_f_.begin() + pf);
        L->at[static_cast<size_t>(g)] = pf;
        pf += n;
      }
    };
    for (const auto& [L, g] : order) place(L, g);
    for (PackedLinear* L : all)  // any group no thread reads (none, with the rules above)
      for (int64_t g = 0; g < L->groups(); ++g) place(L, g);
    SE_CHECK(ph == nh && pf == nf, "internal: the weight layout lost groups");  // every group placed once
    for (PackedLinear* L : all) {
      L->wh_base = arena_h_.data();
      L->wf_base = arena_f_.data();
      aligned_vector<uint16_t>().swap(L->wh);
      aligned_vector<float>().swap(L->wf);
    }
  }

  torch::Tensor run(const int64_t* tp, const int64_t* pp, int64_t B, int64_t N, torch::Tensor& k_all,
                    torch::Tensor& v_all, const std::vector<int64_t>& writes, const std::vector<int64_t>& starts,
                    int64_t M, const c10::optional<torch::Tensor>& mask_in, bool last_only, bool flat) {
    const int64_t R = B * N;
    SE_CHECK(B >= 1 && N >= 1, "tokens must not be empty");
    const int64_t S = check_cache(k_all, v_all, B);
    SE_CHECK(static_cast<int64_t>(writes.size()) == B && static_cast<int64_t>(starts.size()) == B,
             "writes and starts need one entry per row");
    SE_CHECK(M >= N, "m (uncommitted entries) must be >= the new tokens");
    for (int64_t b = 0; b < B; ++b) {
      SE_CHECK(starts[b] >= 0 && starts[b] + M <= S, "row ", b, ": slots exceed the cache");
      SE_CHECK(writes[b] == starts[b] + M - N, "row ", b, ": the new tokens must be the last of the m entries");
    }
    for (int64_t r = 0; r < R; ++r) {
      SE_CHECK(tp[r] >= 0 && tp[r] < V_, "token id ", tp[r], " is outside the vocabulary [0, ", V_, ")");
      SE_CHECK(pp[r] >= 0 && pp[r] < P_, "position ", pp[r], " is outside [0, ", P_, ")");
    }
    const bool* mp = nullptr;
    bool mask_per_row = false;
    torch::Tensor mask;
    if (mask_in.has_value() && mask_in->defined()) {
      mask = mask_in->contiguous();
      SE_CHECK(mask.scalar_type() == torch::kBool, "mask must be bool");
      SE_CHECK((mask.dim() == 2 && mask.size(0) == N && mask.size(1) == M) ||
                   (mask.dim() == 3 && mask.size(0) == B && mask.size(1) == N && mask.size(2) == M),
               "mask must be (N, m) or (B, N, m) = (", N, ", ", M, ")");
      mask_per_row = mask.dim() == 3;
      mp = mask.data_ptr<bool>();
    }

    const int64_t C = C_, C3 = 3 * C_, F = inner_;
    const int64_t out_rows = last_only ? B : R;
    auto logits = flat ? torch::empty({last_only ? 1 : N, V_}, torch::dtype(torch::kFloat32))
                       : torch::empty({B, last_only ? 1 : N, V_}, torch::dtype(torch::kFloat32));
    std::vector<float> x(R * C), qkv(R * C3), att(R * C), ff(R * F);
    for (int64_t r = 0; r < R; ++r) embed(tp[r], pp[r], &x[r * C]);
    Pass ps = cache_pass(k_all, v_all);
    ps.B = B;
    ps.N = N;
    ps.M = M;
    ps.out_rows = out_rows;
    ps.last_only = last_only;
    ps.starts = starts.data();
    ps.writes = writes.data();
    ps.mp = mp;
    ps.mask_per_row = mask_per_row;
    ps.x = x.data();
    ps.qkv = qkv.data();
    ps.att = att.data();
    ps.ff = ff.data();
    ps.lp = logits.data_ptr<float>();
    const int nt = forward_threads();
    SpinBarrier barrier;
    bool choose = false;
    const FormChooser::Pick pick = pick_form(R, choose);
    ps.runs = pick.on;
    const auto t_start = std::chrono::steady_clock::now();

#pragma omp parallel num_threads(nt)
    {
      Scratch s(R * C, N);
      body(ps, omp_get_thread_num(), omp_get_num_threads(), barrier, s);
    }
    if (choose) chooser_.record(R, pick, std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count());
    return logits;
  }

  // The register-block form of a pass over ``rows`` rows' products: pinned by set_group_runs, or
  // chosen by this model for passes over one to three rows (FormChooser; ``timed``: the pass's
  // clock is to inform it, chooser_.record).
  FormChooser::Pick pick_form(int64_t rows, bool& timed) {
    const int mode = group_runs_mode();
    timed = mode == kRunsAuto && rows <= 3;
    return timed ? chooser_.pick(rows) : FormChooser::Pick{mode != kRunsOff, FormChooser::kExploit};
  }

  // Everything the threads of one pass share: set up by run or step_region, read by body.
  struct Pass {
    int64_t B = 1, N = 1, M = 1, out_rows = 1;
    bool last_only = false;
    const int64_t* starts = nullptr;  // per row: its committed slots
    const int64_t* writes = nullptr;  // per row: the slot of its first new token
    const bool* mp = nullptr;         // the tree mask, (N, M) or (B, N, M) with mask_per_row; null: causal
    bool mask_per_row = false;
    // The cache's entries: float32, or float16 bits (KVCache's kv_dtype).
    bool half_kv = false;
    float *kp = nullptr, *vp = nullptr;
    uint16_t *kp16 = nullptr, *vp16 = nullptr;
    int64_t s_l = 0, s_b = 0, s_h = 0, s_s = 0;
    float *x = nullptr, *qkv = nullptr, *att = nullptr, *ff = nullptr, *lp = nullptr;  // (R, C) .. (out_rows, V)
    bool runs = true;  // the register-block form of the products (FormChooser)
  };

  // One thread's scratch for a pass over ``rows`` rows of ``n`` new tokens each.
  struct Scratch {
    Scratch(int64_t rows_c, int64_t n) : h(rows_c), pend(n), hq(n) {}
    std::vector<float> h;                     // this thread's copy of the normalised rows
    std::vector<std::vector<int64_t>> pend;   // per query: its visible pending slots
    std::vector<HeadQuery> hq;
    std::vector<float> p;
  };

  Pass cache_pass(torch::Tensor& k_all, torch::Tensor& v_all) const {
    Pass ps;
    ps.half_kv = k_all.scalar_type() == torch::kHalf;
    if (ps.half_kv) {
      ps.kp16 = reinterpret_cast<uint16_t*>(k_all.data_ptr<at::Half>());
      ps.vp16 = reinterpret_cast<uint16_t*>(v_all.data_ptr<at::Half>());
    } else {
      ps.kp = k_all.data_ptr<float>();
      ps.vp = v_all.data_ptr<float>();
    }
    ps.s_l = k_all.stride(0);
    ps.s_b = k_all.stride(1);
    ps.s_h = k_all.stride(2);
    ps.s_s = k_all.stride(3);
    return ps;
  }

  // The residual stream of one row: token + position embeddings.
  void embed(int64_t token, int64_t position, float* x) const {
    const float* te = wte_.data_ptr<float>() + token * C_;
    const float* pe = wpe_.data_ptr<float>() + position * C_;
    for (int64_t c = 0; c < C_; ++c) x[c] = te[c] + pe[c];
  }

  // Thread ``tid`` of ``nth``'s part of a pass: every layer, the final norm and its share of the
  // LM head's columns. Ends without a barrier: the caller meets its partners before reading the logits.
  void body(const Pass& ps, int tid, int nth, SpinBarrier& barrier, Scratch& s) const {
    const int64_t B = ps.B, N = ps.N, M = ps.M, R = B * N, L = static_cast<int64_t>(blocks_.size());
    const int64_t C = C_, C3 = 3 * C_, F = inner_, H = n_head_, D = D_;
    const float scale = 1.f / std::sqrt(static_cast<float>(D));
    float *x = ps.x, *qkv = ps.qkv, *att = ps.att, *ff = ps.ff, *h = s.h.data();
    const bool runs = ps.runs;
    const bool own = heads_own(nth);
    // The new tokens' K/V of (row b, head hh) to their cache slots, then its attention.
    auto attend_in = [&](auto* kc, auto* vc, int64_t l, int64_t b, int64_t hh) {
      const int64_t start = ps.starts[b];
      auto* kh = kc + l * ps.s_l + b * ps.s_b + hh * ps.s_h;
      auto* vh = vc + l * ps.s_l + b * ps.s_b + hh * ps.s_h;
      for (int64_t i = 0; i < N; ++i) {
        const float* src = &qkv[(b * N + i) * C3 + hh * D];
        kv_store_row(kh + (ps.writes[b] + i) * ps.s_s, src + C, D);
        kv_store_row(vh + (ps.writes[b] + i) * ps.s_s, src + 2 * C, D);
      }
      s.p.resize(N * (start + M + 2 * kLanes));
      for (int64_t i = 0; i < N; ++i) {
        std::vector<int64_t>& sl = s.pend[i];
        sl.clear();
        for (int64_t j = 0; j < M; ++j) {
          const bool visible = ps.mp ? ps.mp[(ps.mask_per_row ? b * N * M : 0) + i * M + j] : (j <= M - N + i);
          if (visible) sl.push_back(start + j);
        }
        s.hq[i] = HeadQuery{&qkv[(b * N + i) * C3 + hh * D], sl.data(), start, start + static_cast<int64_t>(sl.size()),
                            s.p.data() + i * (start + M + 2 * kLanes), &att[(b * N + i) * C + hh * D]};
      }
      head_attention(s.hq.data(), N, start, kh, vh, ps.s_s, D, scale);
    };
    auto attend = [&](int64_t l, int64_t b, int64_t hh) {
      if (ps.half_kv) attend_in(ps.kp16, ps.vp16, l, b, hh); else attend_in(ps.kp, ps.vp, l, b, hh);
    };
    PhaseClock clock(tid, nth);  // bench/phases.py's marks (off: a branch each)
    for (int64_t l = 0; l < L; ++l) {
      const Block& blk = blocks_[l];
      for (int64_t r = 0; r < R; ++r)
        layer_norm_row(&x[r * C], blk.ln1w.data(), blk.ln1b.data(), eps_, C, &h[r * C]);
      clock.mark(kPhaseNorms);
      if (own) {
        for (int64_t hh = tid; hh < H; hh += nth) {
          for (int64_t part = 0; part < 3; ++part) {  // q, k, v columns of head hh
            const auto [g0, g1] = head_groups(hh, part);
            linear_groups(blk.qkv, h, C, qkv, C3, R, Epilogue::kStore, g0, g1, runs);
          }
          clock.mark(kPhaseQKV);
          for (int64_t b = 0; b < B; ++b) attend(l, b, hh);
          clock.mark(kPhaseAttention);
        }
      } else {
        linear_part(blk.qkv, h, C, qkv, C3, R, Epilogue::kStore, tid, nth, runs);
        clock.mark(kPhaseQKV);
        barrier.wait(nth);
        clock.mark(kPhaseWait);
        for (int64_t w = tid; w < B * H; w += nth) attend(l, w / H, w % H);
        clock.mark(kPhaseAttention);
      }
      barrier.wait(nth);
      clock.mark(kPhaseWait);
      linear_part(blk.proj, att, C, x, C, R, Epilogue::kResidual, tid, nth, runs);
      clock.mark(kPhaseProj);
      barrier.wait(nth);
      clock.mark(kPhaseWait);
      for (int64_t r = 0; r < R; ++r)
        layer_norm_row(&x[r * C], blk.ln2w.data(), blk.ln2b.data(), eps_, C, &h[r * C]);
      clock.mark(kPhaseNorms);
      linear_part(blk.fc, h, C, ff, F, R, act_, tid, nth, runs);
      clock.mark(kPhaseFC);
      barrier.wait(nth);
      clock.mark(kPhaseWait);
      linear_part(blk.mproj, ff, F, x, C, R, Epilogue::kResidual, tid, nth, runs);
      clock.mark(kPhaseMProj);
      barrier.wait(nth);
      clock.mark(kPhaseWait);
    }
    for (int64_t o = 0; o < ps.out_rows; ++o) {
      const int64_t r = ps.last_only ? o * N + N - 1 : o;
      layer_norm_row(&x[r * C], lnfw_.data(), lnfb_.data(), eps_, C, &h[o * C]);
    }
    clock.mark(kPhaseNorms);
    linear_part(head_, h, C, ps.lp, V_, ps.out_rows, Epilogue::kStore, tid, nth, runs);
    if (head_rows_ < V_)  // the columns past the packed head: never written by linear_part
      for (int64_t o = tid; o < ps.out_rows; o += nth)
        std::fill(ps.lp + o * V_ + head_rows_, ps.lp + (o + 1) * V_, -std::numeric_limits<float>::infinity());
    clock.mark(kPhaseHead);
  }

 public:
  // What this model's chooser has seen of passes over ``rows`` (1-3) rows: (running log of on
  // seconds over off seconds, pairs compared, passes, passes with group runs on).
  std::tuple<double, int64_t, int64_t, int64_t> group_runs_state(int64_t rows) { return chooser_.state(rows); }

 private:
  FormChooser chooser_;

  int64_t V_ = 0, C_ = 0, P_ = 0, D_ = 0, inner_ = 0, n_head_ = 0, head_rows_ = 0;
  float eps_ = 1e-5f;
  Epilogue act_ = Epilogue::kGeluTanh;
  torch::Tensor wte_, wpe_;
  std::vector<Block> blocks_;
  std::vector<float> lnfw_, lnfb_;
  PackedLinear head_;
  aligned_vector<uint16_t> arena_h_;  // every product's float16 groups, in reading order (lay_out)
  aligned_vector<float> arena_f_;     // and its float32 ones
};

// Whether runs of passes take one OpenMP region (NativeGPT2::step_region: plain steps with or
// without prompt lookup, lookup_steps, and a draft chain's passes after its first) or a
// forward_ids call a pass: the same tokens and cache entries either way. On by default; the
// switch is for the tests and benches that compare the two.
std::atomic<bool> g_step_region{true};
bool step_region() { return g_step_region.load(std::memory_order_relaxed); }
bool set_step_region(bool on) {
  g_step_region.store(on, std::memory_order_relaxed);
  return on;
}

// The oracle's pass over a chain (its root first) at positions position.., written to cache slots
// slot.. of row 0 as pending entries, walked with the sampling rule (verify_tree: each row's choice
// at its position's noise; a token is kept while the choice equals it): (path, emitted). Adds the
// pass's seconds to ``seconds``. A chain of the root alone is a plain step.
std::pair<std::vector<int64_t>, std::vector<int64_t>> verify_chain(NativeGPT2& oracle, torch::Tensor k, torch::Tensor v,
                                                                   const std::vector<int64_t>& chain, int64_t slot,
                                                                   int64_t position, double temperature, int64_t top_k,
                                                                   double top_p, uint64_t seed, double& seconds) {
  const int64_t n = static_cast<int64_t>(chain.size());
  std::vector<int64_t> pos(n), parents(n);
  for (int64_t i = 0; i < n; ++i) {
    pos[i] = position + i;
    parents[i] = i - 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const torch::Tensor logits = oracle.forward_ids(chain, pos, k, v, slot, n, c10::nullopt, false);
  auto walked = verify_tree(logits, chain, parents, seed, pos, temperature, top_k, top_p);
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return walked;
}

// One round of a draft chain (fixed, or planned: below), drafted and verified without returning
// to Python (the Python round costs as much as a small draft's passes: ~150 us of interpreter
// work, most of it cache misses after the oracle's pass has streamed its weights through L2).
//
// The draft runs its passes over cache row 0: the first over the tokens it has not seen
// (``unseen``, ending in the root, at positions d_pos0..), each later one over the chain's tip,
// and chooses each next token as drafters.py's chain builder does (the draft's argmax at
// temperature 0, else its best perturbed child under the draft rule), stopping at ``depth``
// tokens or at a child of probability 0. The oracle then runs one pass over the root and the
// chain at positions root_position.. and walks it with the sampling rule (verify_tree). Nothing
// is committed: the entries stay pending in both caches (slots start.., as forward_ids writes
// them), and the caller keeps the accepted prefixes. Returns (chain tokens after the root, their
// log r, accepted path, emitted tokens, draft passes, draft seconds, oracle seconds); with no
// token drafted, the path and emitted lists are empty and the oracle did not run.
//
// A planned chain (``calibration`` not empty) stops where the planner's cost rule says, as
// drafters.py's chain builder does with a planner: the value A(i) of chain token i is the
// product of calibration[bin(r)] along the chain (r the draft's probability of each token, ten
// bins of width 0.1); another pass runs after token i only while A(i) > go[i - 1], and the
// chain then keeps its tokens while A(i) > keep[i - 1] (the planner's prices of a pass and of
// a node, divided out beforehand).
//
// A fixed chain's log r is for a caller's planner alone: with ``with_logr`` false (chain_rounds'
// fixed blocks), the draft's choices skip it (best_child_token: the same tokens, without the
// normaliser over the whole row's noise) and the log r list comes back empty. A planned chain
// computes it whatever ``with_logr`` says: its rule reads it.
std::tuple<std::vector<int64_t>, std::vector<double>, std::vector<int64_t>, std::vector<int64_t>, int64_t, double,
           double>
chain_round(NativeGPT2& draft, torch::Tensor dk, torch::Tensor dv, int64_t d_start, const std::vector<int64_t>& unseen,
            int64_t d_pos0, NativeGPT2& oracle, torch::Tensor ok, torch::Tensor ov, int64_t o_start,
            int64_t root_position, int64_t depth, double temperature, int64_t top_k, double top_p, uint64_t seed,
            double d_temperature, int64_t d_top_k, uint64_t d_seed, const std::vector<double>& calibration,
            const std::vector<double>& go, const std::vector<double>& keep, bool with_logr, double d_top_p) {
  SE_CHECK(!unseen.empty(), "unseen must hold at least the root");
  SE_CHECK(depth >= 1 && depth <= 63, "depth must be in [1, 63], got ", depth);
  const bool planned = !calibration.empty();
  SE_CHECK(!planned || (calibration.size() == 10 && static_cast<int64_t>(go.size()) >= depth &&
                        static_cast<int64_t>(keep.size()) >= depth),
           "a planned chain needs 10 calibration bins and go and keep thresholds for each of the ", depth,
           " depths, got ", calibration.size(), ", ", go.size(), " and ", keep.size());
  SE_CHECK(d_start >= 0 && o_start >= 0 && d_pos0 >= 0 && root_position >= 0,
           "starts and positions must be >= 0");
  using clock = std::chrono::steady_clock;
  const auto secs = [](clock::time_point a, clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  // The draft's positions may start later in the text than the oracle's (a draft that keeps a
  // window of the context: ModelDrafter.window): its root sits at d_root in its own positions and
  // at root_position in the text. The noise of every draft choice is keyed by the text's
  // position, as the oracle's is, so the draft follows the oracle's draws either way.
  const int64_t d_root = d_pos0 + static_cast<int64_t>(unseen.size()) - 1;
  SE_CHECK(d_root <= root_position, "the draft's root position (", d_root, ") must not be past the oracle's (",
           root_position, ")");
  const int64_t offset = root_position - d_root;
  std::vector<int64_t> chain{unseen.back()};
  std::vector<double> logr, value;
  int64_t written = 0, passes = 0;
  double draft_seconds = 0.0;
  const DraftChoice choice = draft_choice(d_temperature, d_top_k, d_top_p, d_seed);
  DraftScratch scratch;
  const int64_t vocab = draft.vocab_size();
  // The draft's choice after its pass at draft position ``pos``: whether another pass follows.
  const bool want_logr = planned || with_logr;
  const auto take = [&](const float* row, int64_t pos) {
    int64_t token = 0;
    float lr = 0.f;
    if (want_logr) best_child(row, vocab, pos + 1 + offset, choice, scratch, token, lr);
    else best_child_token(row, vocab, pos + 1 + offset, choice, scratch, token, lr);
    if (lr == -std::numeric_limits<float>::infinity()) return false;
    chain.push_back(token);
    if (want_logr) logr.push_back(lr);
    if (planned) {
      const int bin = std::min(9, std::max(0, static_cast<int>(std::exp(static_cast<double>(lr)) * 10)));
      value.push_back((value.empty() ? 1.0 : value.back()) * calibration[bin]);
      if (!(value.back() > go[value.size() - 1])) return false;
    }
    return static_cast<int64_t>(chain.size()) - 1 < depth;
  };
  // A pass over ``tokens`` at positions from ``pos0``, as forward_ids computes it, and the choice.
  const auto pass = [&](const std::vector<int64_t>& tokens, int64_t pos0) {
    const auto t0 = clock::now();
    std::vector<int64_t> positions(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) positions[i] = pos0 + static_cast<int64_t>(i);
    written += static_cast<int64_t>(tokens.size());
    const torch::Tensor logits = draft.forward_ids(tokens, positions, dk, dv, d_start, written, c10::nullopt, true);
    ++passes;
    const bool more = take(logits.data_ptr<float>(), positions.back());
    draft_seconds += secs(t0, clock::now());
    return more;
  };
  // The first pass over the tokens the draft has not seen; then passes of one token each, in one
  // step region (NativeGPT2::step_region) or, for comparisons, a forward_ids call each.
  const bool alone = unseen.size() == 1;  // the root alone: the first pass is one token's too
  bool more = alone || pass(unseen, d_pos0);
  if (more && step_region()) {
    const NativeGPT2::Step first = alone ? NativeGPT2::Step::one(unseen[0], d_pos0, d_start, 1)
                                         : NativeGPT2::Step::one(chain.back(), d_root + 1, d_start, written + 1);
    draft_seconds += draft.step_region(dk, dv, first, 1, [&](const float* row, NativeGPT2::Step& step) {
      ++passes;
      written = step.m;
      if (!take(row, step.position)) return false;
      step = NativeGPT2::Step::one(chain.back(), step.position + 1, step.start, step.m + 1);
      return true;
    });
  } else if (more) {
    if (alone) more = pass(unseen, d_pos0);
    while (more) more = pass({chain.back()}, d_root + static_cast<int64_t>(chain.size()) - 1);
  }
  if (planned)
    while (chain.size() > 1 && !(value[chain.size() - 2] > keep[chain.size() - 2])) {
      chain.pop_back();
      logr.pop_back();
    }
  std::vector<int64_t> path, emitted;
  double oracle_seconds = 0.0;
  if (chain.size() > 1)
    std::tie(path, emitted) =
        verify_chain(oracle, ok, ov, chain, o_start, root_position, temperature, top_k, top_p, seed, oracle_seconds);
  chain.erase(chain.begin());
  return {chain, logr, path, emitted, passes, draft_seconds, oracle_seconds};
}

// Prompt lookup (ContextLookup.propose): the index that followed the latest earlier occurrence of
// seq's last m tokens (-1: none), by a scan back from the end: a few thousand compares over a
// context window of contiguous ids, where a hash index over the history cost more to build each
// call than the scans of a block.
int64_t latest_follower(const std::vector<int64_t>& seq, int m) {
  const int64_t len = static_cast<int64_t>(seq.size());
  if (m < 1 || len < m) return -1;
  const int64_t* tail = seq.data() + len - m;
  for (int64_t i = len - 1; i >= m; --i)  // the occurrence seq[i - m, i), followed by index i
    if (seq[static_cast<size_t>(i - 1)] == tail[m - 1] && std::equal(tail, tail + m - 1, seq.data() + i - m))
      return i;
  return -1;
}

// Prompt lookup's chain: appends to ``chain`` (the root) the tokens of seq from index ``from`` on,
// until the chain holds ``take`` tokens after its root or seq ends.
void extend_lookup_chain(std::vector<int64_t>& chain, const std::vector<int64_t>& seq, int64_t from, int64_t take) {
  for (int64_t j = from; j < static_cast<int64_t>(seq.size()) && static_cast<int64_t>(chain.size()) <= take; ++j)
    chain.push_back(seq[static_cast<size_t>(j)]);
}

// A block of rounds of a fixed draft chain in one native call: chain_round after chain_round,
// each round's kept entries committed in place before the next, without returning to Python
// between them. What it spares is the interpreter between rounds: the engine's loop, the
// planner's bookkeeping and the caches' commits, ~0.2 ms a round on the demo pair (AVX2 Zen 1,
// measured around chain_round in the e2e's generations), 7-8% of a round of a chain of two.
//
// The rounds are chain_round's with ``depth`` tokens each, fewer where the block's ``n`` tokens
// run out (depth at most the tokens left less one). A round whose draft offers no token, or with
// one token left, is a plain step (the oracle's pass over the root alone and its choice), as the
// Python round makes it. After each round the oracle keeps its accepted prefix, in place (the
// root and the accepted chain tokens), and the draft keeps its entries of the unseen tokens and
// of the chain tokens it evaluated that were accepted (ModelDrafter.accept_chain); the next
// round's unseen tokens are the emitted ones the draft has not evaluated. The block stops after
// ``max_rounds`` rounds, after ``n`` tokens, or after a round that emitted ``stop_token``
// (-1: none), whose tokens it returns whole as a round would. The oracle writes at most ``n``
// entries from ``o_start`` and the draft at most ``unseen.size() + n - 1`` from ``d_start``
// (each round's chain is cut to fit: checked here and in forward_ids): the caller reserves them.
//
// With ``lookup_first`` (the planner's lookup-or-draft arms), a round where the context's last 3
// tokens were seen before (in ``history``, every token before the root, and what the block
// emits) verifies prompt lookup's chain instead, up to ``depth`` of the tokens that followed the
// latest earlier occurrence, with no draft pass: the draft falls behind by that round's tokens
// and catches up in its next pass, as the Python rounds make it (ModelDrafter.build_lookup).
// Returns (tokens, tokens emitted by each round, the draft's unseen tokens after the block, its
// entries kept from d_start, draft passes, draft rows, draft seconds, oracle seconds, oracle rows,
// lookup rounds).
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double,
           int64_t, int64_t>
chain_rounds(NativeGPT2& draft, torch::Tensor dk, torch::Tensor dv, int64_t d_start, std::vector<int64_t> unseen,
             NativeGPT2& oracle, torch::Tensor ok, torch::Tensor ov, int64_t o_start, int64_t root_position, int64_t depth,
             int64_t n, int64_t max_rounds, double temperature, int64_t top_k, double top_p, uint64_t seed,
             double d_temperature, int64_t d_top_k, uint64_t d_seed, int64_t stop_token, bool lookup_first,
             const std::vector<int64_t>& history, double d_top_p) {
  constexpr int kOrder = 3;  // ContextLookup.ORDER: a lookup-first round needs a 3-token match
  SE_CHECK(!unseen.empty(), "unseen must hold at least the root");
  SE_CHECK(depth >= 1 && depth <= 63, "depth must be in [1, 63], got ", depth);
  SE_CHECK(n >= 1, "n must be >= 1, got ", n);
  SE_CHECK(max_rounds >= 1, "max_rounds must be >= 1, got ", max_rounds);
  SE_CHECK(d_start >= 0 && o_start >= 0 && root_position >= 0, "starts and positions must be >= 0");
  const int64_t vocab = oracle.vocab_size();
  SE_CHECK(unseen.back() >= 0 && unseen.back() < vocab, "the root must be a token id in [0, ", vocab, "), got ",
           unseen.back());
  for (const int64_t t : history)
    SE_CHECK(t >= 0 && t < vocab, "history must hold token ids in [0, ", vocab, "), got ", t);
  std::vector<int64_t> seq;  // the text to the root, for prompt lookup
  if (lookup_first) {
    seq.reserve(history.size() + static_cast<size_t>(n) + 1);
    seq.assign(history.begin(), history.end());
    seq.push_back(unseen.back());
  }
  std::vector<int64_t> out, lengths;
  out.reserve(static_cast<size_t>(n));
  int64_t d_kept = 0, d_passes = 0, d_rows = 0, o_rows = 0, lookup_rounds = 0;
  double d_seconds = 0.0, o_seconds = 0.0;
  for (int64_t round = 0; round < max_rounds && static_cast<int64_t>(out.size()) < n; ++round) {
    const int64_t done = static_cast<int64_t>(out.size());
    const int64_t left = n - done, take = std::min(depth, left - 1);  // this round's chain, at most
    const int64_t o_at = o_start + done, root_at = root_position + done, d_at = d_start + d_kept;
    const int64_t unseen_n = static_cast<int64_t>(unseen.size());
    std::vector<int64_t> path, emitted;
    int64_t passes = 0;
    // The chain the oracle verifies when the draft does not run or offers nothing: prompt
    // lookup's (no draft pass), or the root alone (a plain step).
    std::vector<int64_t> chain{unseen.back()};
    const int64_t from = lookup_first && left >= 2 ? latest_follower(seq, kOrder) : -1;
    if (from >= 0) {
      extend_lookup_chain(chain, seq, from, take);
      ++lookup_rounds;
    } else if (left >= 2) {
      auto [drafted, logr, p, e, dp, ds, os] =
          chain_round(draft, dk, dv, d_at, unseen, d_at, oracle, ok, ov, o_at, root_at, take, temperature, top_k, top_p,
                      seed, d_temperature, d_top_k, d_seed, {}, {}, {}, /*with_logr=*/false, d_top_p);
      path = std::move(p);
      emitted = std::move(e);
      passes = dp;
      d_passes += dp;
      d_rows += unseen_n + dp - 1;
      d_seconds += ds;
      o_seconds += os;
      if (!path.empty()) o_rows += static_cast<int64_t>(drafted.size()) + 1;  // the root and the drafted tokens
    }
    if (path.empty()) {
      std::tie(path, emitted) = verify_chain(oracle, ok, ov, chain, o_at, root_at, temperature, top_k, top_p, seed, o_seconds);
      o_rows += static_cast<int64_t>(chain.size());
    }
    // The draft's entries kept (its accept_chain): the unseen tokens' and those of the accepted
    // chain tokens it evaluated (chain token i was the input of its pass i); with no pass, none.
    const int64_t evaluated = std::min<int64_t>(static_cast<int64_t>(path.size()), passes);
    if (evaluated > 0) {
      d_kept += unseen_n - 1 + evaluated;
      unseen.assign(emitted.begin() + (evaluated - 1), emitted.end());
    } else {
      unseen.insert(unseen.end(), emitted.begin(), emitted.end());
    }
    lengths.push_back(static_cast<int64_t>(emitted.size()));
    out.insert(out.end(), emitted.begin(), emitted.end());
    if (lookup_first) seq.insert(seq.end(), emitted.begin(), emitted.end());
    if (stop_token >= 0 && std::find(emitted.begin(), emitted.end(), stop_token) != emitted.end()) break;
  }
  return {out, lengths, unseen, d_kept, d_passes, d_rows, d_seconds, o_seconds, o_rows, lookup_rounds};
}

// Plain decoding's steps with prompt lookup, the cheapest stage of all (no draft model), without
// returning to Python: up to ``n`` oracle passes over cache row 0, which holds every position
// before each pass (the token at position p is written to slot p, from slot ``start``; the first
// pass is over ``root``). Before each pass, the tokens that followed the most recent earlier
// occurrence of the context's last 3 tokens (else 2, ... down to ``min_order``), as
// ContextLookup.propose finds them, up to ``depth`` of them, ride along: one pass over the root
// and that chain, walked with the sampling rule by verify_tree (each row's choice at its
// position's noise; a token is kept while the choice equals it). With no proposal, or at depth
// 0 (plain_steps), the pass is over the root alone: forward_ids over one token and the rule's
// choice, as a Python step makes them. What this spares is the interpreter between passes: on
// the demo oracle ~20-27 us a token, most of it cache misses after each pass has streamed the
// weights. A pass over 2-3 rows costs about what one row does where the weights stream from the
// caches (demo oracle, AVX2 Zen 3: 1.06-1.13x), and the oracle's own text repeats its context,
// so a kept guess is a token for a fraction of a pass. Every token is the oracle's choice at its
// position, so the tokens and the cache entries are those of plain steps (tested bit for bit):
// the kept entries of a pass are a prefix of its chain, in place, and the rejected ones are
// overwritten by the next pass before any pass can see them. ``history`` is every token before
// ``root`` (the lookup's context). At most ``n`` tokens and ``max_passes`` passes (-1: no limit
// but n), stopping after ``stop_token`` (-1: none); the kept entries stay pending, one per token
// returned. A caller with a budget of passes (the planner's block of rounds) asks for up to
// depth + 1 tokens a pass and spends it in one call: asked for tokens alone, a block whose
// guesses were kept ended early and its rest took a call of its own, and the rest of that one
// another (demo pair, greedy, AVX2 Zen 3: a 16-round block in calls of 16, 7, 4, 2 and 1
// tokens, each return to Python ~150 us and its next pass slower; the tail calls had no room
// for guesses). End to end the change measured neutral (decode time 0.991x and 1.002x, in-process
// A/B): fewer returns to Python, no gain the clock tells from the noise. Returns (tokens, forward
// seconds, tokens emitted by each pass, tokens proposed, proposed tokens kept).
std::tuple<std::vector<int64_t>, double, std::vector<int64_t>, int64_t, int64_t> lookup_steps(
    NativeGPT2& model, torch::Tensor k, torch::Tensor v, int64_t start, const std::vector<int64_t>& history, int64_t root,
    int64_t n, double temperature, int64_t top_k, double top_p, uint64_t seed, int64_t stop_token, int64_t depth,
    int64_t min_order, int64_t max_passes) {
  constexpr int kOrder = 3;  // ContextLookup.ORDER
  SE_CHECK(n >= 1, "n must be >= 1, got ", n);
  SE_CHECK(max_passes == -1 || max_passes >= 1, "max_passes must be -1 (no limit) or >= 1, got ", max_passes);
  SE_CHECK(start >= 0, "start must be >= 0, got ", start);
  SE_CHECK(depth >= 0 && depth <= 8, "depth must be in [0, 8], got ", depth);
  SE_CHECK(min_order >= 1 && min_order <= kOrder, "min_order must be in [1, ", kOrder, "], got ", min_order);
  const int64_t vocab = model.vocab_size();
  SE_CHECK(root >= 0 && root < vocab, "root must be a token id in [0, ", vocab, "), got ", root);
  for (const int64_t t : history)
    SE_CHECK(t >= 0 && t < vocab, "history must hold token ids in [0, ", vocab, "), got ", t);
  // A pass writes at most up to the slot and position of the call's last token: every one fits,
  // or nothing is written.
  const int64_t S = model.check_cache(k, v, 1);
  SE_CHECK(start + n <= S, "the steps' slots [", start, ", ", start + n, ") exceed the cache's ", S);
  SE_CHECK(start + n <= model.n_positions(), "the steps' positions [", start, ", ", start + n,
           ") exceed the model's ", model.n_positions());
  const bool lookup = depth > 0;
  std::vector<int64_t> seq;
  if (lookup) seq.reserve(history.size() + static_cast<size_t>(n) + 1);
  if (lookup) seq.assign(history.begin(), history.end());
  seq.push_back(root);
  std::vector<int64_t> out, chain, path, emitted, lengths;
  out.reserve(static_cast<size_t>(n));
  int64_t slot = start, proposed = 0, kept = 0;
  double forward_seconds = 0.0;
  // The next pass's chain: the root and what prompt lookup proposes.
  const auto propose = [&]() {
    const int64_t len = static_cast<int64_t>(seq.size());
    const int64_t room = std::min<int64_t>(depth, n - static_cast<int64_t>(out.size()) - 1);
    chain.assign(1, seq.back());
    for (int m = std::min<int64_t>(kOrder, len); room > 0 && m >= min_order; --m) {
      const int64_t from = latest_follower(seq, m);
      if (from < 0) continue;
      extend_lookup_chain(chain, seq, from, room);
      break;
    }
  };
  // A pass's walk emitted ``emitted``: keep them; whether another pass follows.
  const auto settle = [&]() {
    proposed += static_cast<int64_t>(chain.size()) - 1;
    // The root and path.size() - 1 kept tokens are in place; the rest is overwritten by the next pass.
    const auto stop = std::find(emitted.begin(), emitted.end(), stop_token);
    const bool stopped = stop != emitted.end();
    if (stopped) emitted.erase(stop + 1, emitted.end());
    lengths.push_back(static_cast<int64_t>(emitted.size()));
    kept += static_cast<int64_t>(emitted.size()) - 1;
    out.insert(out.end(), emitted.begin(), emitted.end());
    if (lookup)
      seq.insert(seq.end(), emitted.begin(), emitted.end());
    else
      seq.back() = emitted.back();
    if (stopped) return false;
    slot += static_cast<int64_t>(emitted.size());
    return static_cast<int64_t>(out.size()) < n &&
           (max_passes < 0 || static_cast<int64_t>(lengths.size()) < max_passes);
  };
  if (step_region()) {  // every pass in one region (NativeGPT2::step_region), walked as verify_tree walks a chain
    // (plain steps, at depth 0, are passes over the root alone)
    const ChoiceRule rule = choice_rule(temperature, top_k, top_p, seed);
    std::vector<float> z;
    propose();
    forward_seconds += model.step_region(
        k, v, NativeGPT2::Step::chain(chain, slot), depth + 1, [&](const float* logits, NativeGPT2::Step& step) {
          emitted.clear();
          for (int64_t node = 0;; ++node) {
            const int64_t y = choose_at(logits + node * vocab, vocab, slot + node + 1, rule, z);
            emitted.push_back(y);
            if (node + 1 >= step.n || step.tokens[node + 1] != y) break;
          }
          if (!settle()) return false;
          propose();
          step = NativeGPT2::Step::chain(chain, slot);
          return true;
        });
    return {out, forward_seconds, lengths, proposed, kept};
  }
  do {
    propose();
    // Slots slot.. as a committed row of length ``slot`` with the chain's new entries (bounds
    // checked in forward_ids).
    std::tie(path, emitted) = verify_chain(model, k, v, chain, slot, slot, temperature, top_k, top_p, seed, forward_seconds);
  } while (settle());
  return {out, forward_seconds, lengths, proposed, kept};
}

// Plain decoding's steps in one native call: lookup_steps with nothing riding along. Returns
// (tokens, seconds in the forward passes).
std::tuple<std::vector<int64_t>, double> plain_steps(NativeGPT2& model, torch::Tensor k, torch::Tensor v, int64_t start,
                                                     int64_t root, int64_t n, double temperature, int64_t top_k,
                                                     double top_p, uint64_t seed, int64_t stop_token) {
  auto [tokens, seconds, lengths, proposed, kept] =
      lookup_steps(model, k, v, start, {}, root, n, temperature, top_k, top_p, seed, stop_token, 0, 3, -1);
  return {std::move(tokens), seconds};
}

// The native linear kernel alone, for the microbenchmark of what bounds an N-node pass
// (bench/linear.py): seconds of each of ``repeats`` calls of y (rows, M) = x (rows, K) W^T, with W
// packed as the decoder packs it (float16 when every value is fp16-exact, else float32; the same
// prefetch rule) and the output features split over the threads as in a forward pass, one
// OpenMP region a call. Blocks of 1-3 rows take the form group_runs pins; under 'auto', several
// groups at once (a model's form before its first comparisons): there is no pass clock here to
// choose by. Returns (seconds per call, packed as float16, packed weight bytes).
std::tuple<std::vector<double>, bool, int64_t> linear_seconds(const torch::Tensor& weight, int64_t rows,
                                                             int64_t repeats) {
  SE_CHECK(rows >= 1 && rows <= 4096, "rows must be in [1, 4096], got ", rows);
  SE_CHECK(repeats >= 1 && repeats <= 100000, "repeats must be in [1, 100000], got ", repeats);
  const int nt = forward_threads();
  PackedLinear L = pack_linear(weight, c10::nullopt, "weight", nt);
  if (outgrows_l2(static_cast<int64_t>(L.bytes()))) L.ahead = weight_ahead(L);
  std::vector<float> x(rows * L.K), y(rows * L.M);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  std::vector<double> seconds;
  seconds.reserve(repeats);
  for (int64_t i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nt)
    linear_part(L, x.data(), L.K, y.data(), L.M, rows, Epilogue::kStore, omp_get_thread_num(), omp_get_num_threads(),
                group_runs_mode() != kRunsOff);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return {seconds, L.half, static_cast<int64_t>(L.bytes())};
}

// The arguments of the probes below.
static void check_probe_args(int64_t nbytes, int64_t repeats) {
  SE_CHECK(nbytes >= 4096 && nbytes <= (int64_t(16) << 30), "nbytes must be in [4096, 16 GiB], got ", nbytes);
  SE_CHECK(repeats >= 1 && repeats <= 100000, "repeats must be in [1, 100000], got ", repeats);
}

// Seconds of each of ``repeats`` runs of ``part(tid, nth)`` on the forward's threads, one OpenMP
// region a run, as a forward pass runs its products. ``part`` returns what its thread summed:
// kept, so the compiler keeps the work, and checked to be positive.
template <class Part>
static std::vector<double> time_parts(int64_t repeats, const char* what, const Part& part) {
  const int nt = forward_threads();
  std::vector<float> sink(16 * static_cast<size_t>(nt), 0.f);  // a cache line a thread
  std::vector<double> seconds;
  seconds.reserve(repeats);
  for (int64_t i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nt)
    {
      const int tid = omp_get_thread_num();
      sink[tid * 16] += part(tid, omp_get_num_threads());
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  SE_CHECK(sink[0] > 0.f, "the ", what, " probe summed nothing");
  return seconds;
}

// Seconds of each of ``repeats`` reads of a float32 buffer of ``nbytes`` (every thread sums its
// slice with eight independent vector accumulators): the read bandwidth a weight stream of that
// size can reach here, cache-resident when it fits, for the bandwidth bounds of
// bench/roofline.py and bench/linear.py. (torch's sum, the probe it replaces, read a 1.8 MB
// buffer at 87 GB/s on a Zen 4 where this one read 163, slower than the decoder's own kernel
// streamed the draft's weights: a bound its reduction set, not the caches.)
std::vector<double> read_seconds(int64_t nbytes, int64_t repeats) {
  check_probe_args(nbytes, repeats);
  const int64_t unit = 8 * kLanes;
  const int64_t n = nbytes / 4 / unit * unit;
  aligned_vector<float> buf(n, 1.f);
  return time_parts(repeats, "read", [&](int tid, int nth) {
    const int64_t units = n / unit, u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
    vec acc[8];
    for (auto& a : acc) a = vzero();
    for (const float* q = buf.data() + u0 * unit; q < buf.data() + u1 * unit; q += unit)
      for (int j = 0; j < 8; ++j) acc[j] = vadd(acc[j], vload(q + j * kLanes));
    for (int j = 1; j < 8; ++j) acc[0] = vadd(acc[0], acc[j]);
    return vsum(acc[0]);
  });
}

// Seconds of each of ``repeats`` passes that widen ``nbytes`` of float16 weights to float32 as
// a one-row product does, split over the threads, each re-reading a 16 KiB slice that its L1
// cache holds: the rate this CPU widens at with no weight stream to wait on. Each widened vector
// goes into an FMA, as in the product: in the form that product takes (block_narrow's 256-bit
// halves where narrow_rows() >= 1 in an AVX-512 build, sixteen 256-bit accumulators; else
// vloadw at the build's width, eight). It bounds a pass over fp16-packed weights from below as
// the weight stream does (bench/roofline.py, bench/linear.py): on the project's AVX2 Zen 1 a
// 256-bit widening took ~3 cycles, 13 GB/s of float16 a core, below what its DRAM delivers to
// two. (Until this form the widened vectors were summed with adds at the build's width, which
// on a Zen 4, AMD EPYC, ran at neither rate a product runs at: a 512-bit VCVTPH2PS issues at
// half the rate of two 256-bit ones, and 256-bit widening into adds was as slow, 50-57 GB/s a
// core either way against 81-88 for 256-bit widening into FMAs in the same run, one core, L1;
// the old probe read 117 GB/s on two threads while one-row products over 1 MB of weights in L2
// widened 155-164 GB/s, so its "bound" was not one.)
std::vector<double> widen_seconds(int64_t nbytes, int64_t repeats) {
  check_probe_args(nbytes, repeats);
  constexpr int64_t kSlice = 8192;  // halves a thread re-reads: 16 KiB
  const int64_t unit = 8 * kLanes;  // halves a step
  aligned_vector<uint16_t> buf(kSlice * forward_threads(), 0x3c00);  // float16 1.0
  const int64_t halves = nbytes / 2 / unit * unit;
#if defined(__AVX512F__)
  const bool halves256 = narrow_rows() >= 1;
#endif
  return time_parts(repeats, "widening", [&](int tid, int nth) {
    const int64_t units = halves / unit, todo = (units * (tid + 1) / nth - units * tid / nth) * unit;
    const uint16_t* slice = buf.data() + static_cast<int64_t>(tid) * kSlice;
#if defined(__AVX512F__)
    if (halves256) {  // block_narrow<1, kPanels>'s loop: a 256-bit widening, then its FMA
      const __m256 one = _mm256_set1_ps(1.f);
      __m256 acc[16];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t done = 0; done < todo;) {
        const int64_t n = std::min(kSlice, todo - done);
        for (const uint16_t* q = slice; q < slice + n; q += unit)
          for (int j = 0; j < 16; ++j)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 8))),
                                     one, acc[j]);
        done += n;
      }
      for (int j = 1; j < 16; ++j) acc[0] = _mm256_add_ps(acc[0], acc[j]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[0]);
      float sum = 0.f;
      for (float v : lanes) sum += v;
      return sum;
    }
#endif
    const vec one = vset1(1.f);
    vec acc[8];
    for (auto& a : acc) a = vzero();
    for (int64_t done = 0; done < todo;) {
      const int64_t n = std::min(kSlice, todo - done);
      for (const uint16_t* q = slice; q < slice + n; q += unit)
        for (int j = 0; j < 8; ++j) acc[j] = vfma(vloadw(q + j * kLanes), one, acc[j]);
      done += n;
    }
    for (int j = 1; j < 8; ++j) acc[0] = vadd(acc[0], acc[j]);
    return vsum(acc[0]);
  });
}

void register_native_forward(py::module& m) {
  py::class_<NativeGPT2>(m, "NativeGPT2",
                         "A GPT-2 model packed for the native decode path: one call per forward pass")
      .def(py::init<const torch::Tensor&, const torch::Tensor&, const std::vector<torch::Tensor>&,
                    const torch::Tensor&, const torch::Tensor&, int64_t, double, const std::string&, int64_t, bool>(),
           "half=False packs float16- or bfloat16-valued weights as float32 too: the same values, so the same "
           "bits out of every pass, read at twice the bytes without widening (faster where the widening, not the "
           "weight stream, sets a pass's time)",
           py::arg("wte"), py::arg("wpe"), py::arg("blocks"), py::arg("ln_f_weight"), py::arg("ln_f_bias"),
           py::arg("n_head"), py::arg("eps"), py::arg("activation"), py::arg("head_rows") = 0, py::arg("half") = true)
      .def("forward", &NativeGPT2::forward, "logits (B, N or 1, V) of N new tokens per row; writes their K/V",
           py::arg("tokens"), py::arg("positions"), py::arg("k_cache"), py::arg("v_cache"), py::arg("writes"),
           py::arg("starts"), py::arg("m"), py::arg("mask") = py::none(), py::arg("last_only") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("forward_ids", &NativeGPT2::forward_ids,
           "logits (N, V), or (1, V) with last_only, of N new tokens of cache row 0 (lists of ids and "
           "positions); their K/V go to slots start + m - N ..",
           py::arg("tokens"), py::arg("positions"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"),
           py::arg("m"), py::arg("mask") = py::none(), py::arg("last_only") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("group_runs_state", &NativeGPT2::group_runs_state,
           "what this model has seen of its passes over `rows` (1-3) rows with group_runs 'auto': (running log of "
           "seconds with the form on over off, pairs compared, passes, passes with the form on)", py::arg("rows"))
      .def_property_readonly("weight_bytes", &NativeGPT2::weight_bytes)
      .def_property_readonly("half", &NativeGPT2::half)
      .def_property_readonly("weight_format", &NativeGPT2::weight_format,
                             "float16, bfloat16 or float32: how the weights are packed (mixed where products differ)")
      .def_property_readonly("streaming", &NativeGPT2::streaming)
      .def("set_streaming", &NativeGPT2::set_streaming,
           "non-temporal prefetch of the weight streams (for weights that outgrow the last-level cache); "
           "never changes a bit", py::arg("on"))
      .def_property_readonly("checkpoint_bytes", &NativeGPT2::checkpoint_bytes)
      .def("region_passes", &NativeGPT2::region_passes,
           "`passes` passes over the chain `tokens` (1-9) at slots and positions start.. of row 0, back to back in "
           "one step region (as plain decoding's steps run), each writing the same pending entries forward_ids "
           "would; returns each pass's seconds (the first with the threads' fork)",
           py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("tokens"), py::arg("passes"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<FormChooser>(m, "FormChooser",
                          "the rule a model chooses its group_runs form by, alone (for its tests): pick, then record")
      .def(py::init<>())
      .def("pick", [](FormChooser& c, int64_t rows) {
             const FormChooser::Pick p = c.pick(rows);
             return std::make_tuple(p.on, p.role);
           }, "(on, role) of the next pass over `rows` (1-3) rows; role 0 plays, 1 and 2 compare", py::arg("rows"))
      .def("record", [](FormChooser& c, int64_t rows, bool on, int role, double seconds) {
             SE_CHECK(role >= 0 && role <= 2, "role must be 0-2, got ", role);
             c.record(rows, FormChooser::Pick{on, role}, seconds);
           }, "the seconds a picked pass took", py::arg("rows"), py::arg("on"), py::arg("role"), py::arg("seconds"))
      .def("state", &FormChooser::state, "(running log of on over off seconds, pairs, passes, passes on)",
           py::arg("rows"));
  m.def("read_seconds", &read_seconds,
        "seconds of each of `repeats` reads of an `nbytes` float32 buffer split over the threads: the read "
        "bandwidth a weight stream of that size reaches here", py::arg("nbytes"), py::arg("repeats"),
        py::call_guard<py::gil_scoped_release>());
  m.def("widen_seconds", &widen_seconds,
        "seconds of each of `repeats` passes that widen `nbytes` of float16 weights to float32 as a one-row "
        "product does (its vector form, each widened vector into an FMA), split over the threads, from "
        "L1-resident slices: the widening rate with no weight stream to wait on",
        py::arg("nbytes"), py::arg("repeats"), py::call_guard<py::gil_scoped_release>());
  m.def("huge_pages", &huge_pages,
        "whether native buffers of 2 MiB or more (packed weights, the read probe's buffer) are advised as "
        "transparent huge pages");
  m.def("set_huge_pages", &set_huge_pages,
        "advise buffers allocated from now on as huge pages (True, the default) or not; returns the setting",
        py::arg("on"));
  m.def("narrow_rows", &narrow_rows,
        "the most rows a float16 register block computes in 256-bit halves (0-3; probed once per process): "
        "the same bits as 512-bit blocks, faster where 512-bit widening is slow");
  m.def("set_narrow_rows", &set_narrow_rows,
        "pin narrow_rows to 0-3, or -1 for the probed choice; returns the value in force", py::arg("n"));
  m.def("group_runs", &group_runs,
        "whether blocks of one to three rows take several panel groups at once (AVX2 builds; the same bits as one "
        "group a block): 'auto' (each model chooses from its passes' clock), 'on' or 'off'; always 'off' in "
        "AVX-512 builds");
  m.def("set_phase_timing", &set_phase_timing,
        "time the phases of every native forward pass (bench/phases.py) or stop; the totals start again from zero",
        py::arg("on"));
  m.def("phase_seconds", &phase_seconds,
        "(passes, phase names, seconds[thread][phase]) timed since the last call or set_phase_timing; starts "
        "the totals again");
  m.def("set_group_runs", &set_group_runs,
        "set group_runs to 'auto', 'on' or 'off' (pinned, for comparisons of the two forms); returns the mode in "
        "force", py::arg("mode"));
  m.def("l2_ahead", &l2_ahead, "the longest run of weight groups, in bytes, whose next run a block of 2-3 rows "
        "prefetches into L2 (0: never)");
  m.def("set_l2_ahead", &set_l2_ahead, "set l2_ahead (a multiple of 64 in [0, 1 MiB]; for comparisons); returns "
        "the value in force", py::arg("bytes"));
  m.def("kv_ahead", &kv_ahead, "slots of software prefetch ahead in attention's K and V streams (0: none)");
  m.def("set_kv_ahead", &set_kv_ahead, "set kv_ahead (0-1024 slots; for comparisons); returns the value in force",
        py::arg("slots"));
  m.def("linear_seconds", &linear_seconds,
        "seconds of each call of the native linear kernel alone over `rows` rows of a (out, in) float32 weight, "
        "packed as the decoder packs it: (seconds, packed as float16, packed bytes)",
        py::arg("weight"), py::arg("rows"), py::arg("repeats"), py::call_guard<py::gil_scoped_release>());
  m.def("plain_steps", &plain_steps,
        "up to n plain decoding steps of cache row 0 in one call, from `root` at position `start`, stopping after "
        "`stop_token` (-1: none); entries left pending; (tokens, forward seconds)",
        py::arg("model"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("root"), py::arg("n"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_token"),
        py::call_guard<py::gil_scoped_release>());
  m.def("set_step_region", &set_step_region,
        "run plain steps (plain_steps, lookup_steps) and a draft chain's passes after its first in one OpenMP "
        "region (True, the default) or a forward pass a call (False; the same tokens and cache entries, for "
        "comparisons); returns the setting",
        py::arg("on"));
  m.def("step_region", &step_region, "whether runs of passes take one OpenMP region (set_step_region)");
  m.def("lookup_steps", &lookup_steps,
        "up to n decoding steps of cache row 0 in one call, as plain_steps, each pass also verifying the tokens "
        "prompt lookup finds after the context's last 3 (down to `min_order`) tokens, at most `depth`; at most "
        "`max_passes` passes (-1: no limit but n); entries left pending; (tokens, forward seconds, tokens of each "
        "pass, proposed, kept)",
        py::arg("model"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("history"), py::arg("root"),
        py::arg("n"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_token"),
        py::arg("depth"), py::arg("min_order"), py::arg("max_passes") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("chain_rounds", &chain_rounds,
        "a block of rounds of a fixed draft chain in one call, each round's kept entries committed in place before "
        "the next, or with lookup_first prompt lookup's chain where the context's last 3 tokens were seen before; "
        "(tokens, tokens of each round, the draft's unseen tokens, its entries kept, draft passes, draft rows, "
        "draft seconds, oracle seconds, oracle rows, lookup rounds)",
        py::arg("draft"), py::arg("draft_k"), py::arg("draft_v"), py::arg("draft_start"), py::arg("unseen"),
        py::arg("oracle"), py::arg("oracle_k"), py::arg("oracle_v"), py::arg("oracle_start"), py::arg("root_position"),
        py::arg("depth"), py::arg("n"), py::arg("max_rounds"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("seed"), py::arg("draft_temperature"), py::arg("draft_top_k"),
        py::arg("draft_seed"), py::arg("stop_token"), py::arg("lookup_first") = false,
        py::arg("history") = std::vector<int64_t>(), py::arg("draft_top_p") = 1.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("chain_round", &chain_round,
        "one round of a draft chain, fixed or planned: the draft's passes, the oracle's pass and the acceptance walk, "
        "entries left pending; (chain, log r, path, emitted, draft passes, draft seconds, oracle seconds); with "
        "with_logr false a fixed chain's log r is not computed (the same tokens) and comes back empty",
        py::arg("draft"), py::arg("draft_k"), py::arg("draft_v"), py::arg("draft_start"), py::arg("unseen"),
        py::arg("draft_position"), py::arg("oracle"), py::arg("oracle_k"), py::arg("oracle_v"), py::arg("oracle_start"),
        py::arg("root_position"), py::arg("depth"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("draft_temperature"), py::arg("draft_top_k"), py::arg("draft_seed"),
        py::arg("calibration") = std::vector<double>(), py::arg("go") = std::vector<double>(),
        py::arg("keep") = std::vector<double>(), py::arg("with_logr") = true, py::arg("draft_top_p") = 1.0,
        py::call_guard<py::gil_scoped_release>());
}
