// Few-row CPU kernels whose per-row results do not depend on how many rows are computed.
//
// Small-batch decoding multiplies 1..64 activation rows by each weight matrix. The stock BLAS
// routines are slow for 2..16 rows and, worse for speculation, give a row a different rounding
// depending on the row count. Here every output y[n, j] is one fixed sequence of FMAs over k
// (16 lanes, then a masked tail, then one horizontal reduction), whatever N is: a tree node's
// activations are bit-identical to those of plain one-token decoding. Each weight row streams
// from memory once (software-prefetched two blocks ahead, since few-row products are bound by
// memory, not arithmetic) and is reused from cache for every group of 4 activation rows.
// Weights may be float16: a checkpoint stored in fp16 and loaded as fp32 holds exactly the same
// values, so streaming the fp16 copy and widening in registers halves the memory traffic and
// gives the very same bits as the fp32 weights.
//
// attention(): one query attends to the committed prefix and to its visible pending entries,
// visited in slot order with a fixed reduction order, so a tree node's output equals what
// sequential decoding computes for the same token once its ancestors sit in consecutive slots.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <sstream>
#include <string>

#define SE_CHECK(cond, ...) \
  do {                      \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmax_all(vec a) { return _mm512_reduce_max_ps(a); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vec vexp2i(vec y, vec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
// The lane sums of four vectors, as 4 floats; each sum uses one fixed tree of its own lanes.
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  auto half = [](vec a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline void vstore_tail(float* p, vec a, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), a);
}
// float16 weights, widened to float32 in registers (exact).
inline vec vload_h(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec vload_h_tail(const uint16_t* p, int64_t n) {
  alignas(32) uint16_t buf[16] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(buf)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i tail_mask(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}
inline vec vload_tail(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vmax_all(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline __m128 vsum4(vec a0, vec a1, vec a2, vec a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
inline vec vexp2i(vec y, vec n) {  // y * 2^n for integral n in [-127, 128]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline void vstore_tail(float* p, vec a, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), a); }
inline vec vload_h(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec vload_h_tail(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t buf[8] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = p[i];
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}
#else
#error "staged_engine._cpu needs AVX2+FMA+F16C or AVX-512 (built with -march=native)"
#endif

// exp() on every lane (Cephes expf: range reduction by ln 2, degree-6 polynomial; about 1 ulp).
// One fixed sequence of operations per lane, so a lane's result never depends on its neighbours.
inline vec vexp(vec x) {
  x = vmax(x, vset1(-87.3365f));
  x = vmin(x, vset1(88.3762f));
  const vec n = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(n, vset1(-0.693359375f), x);
  x = vfma(n, vset1(2.12194440e-4f), x);
  vec y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
  return vexp2i(y, n);
}

// How a weight row is read: float32 as is, float16 widened (exactly) to float32.
struct F32Weights {
  using T = float;
  static vec load(const float* p) { return vload(p); }
  static vec load_tail(const float* p, int64_t n) { return vload_tail(p, n); }
};
struct F16Weights {
  using T = uint16_t;
  static vec load(const uint16_t* p) { return vload_h(p); }
  static vec load_tail(const uint16_t* p, int64_t n) { return vload_h_tail(p, n); }
};

// Dot products of rows x[0..nr) with weight rows w[0..nj), nr, nj <= 4, all over K.
template <class W, int NR, int NJ>
inline void block_dot(const float* const* x, const typename W::T* const* w, int64_t K, float out[4][4]) {
  vec acc[NR][NJ];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = W::load(w[j] + k);
    for (int r = 0; r < NR; ++r) {
      const vec xv = vload(x[r] + k);
      for (int j = 0; j < NJ; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  if (k < K) {
    const int64_t t = K - k;
    vec wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = W::load_tail(w[j] + k, t);
    for (int r = 0; r < NR; ++r) {
      const vec xv = vload_tail(x[r] + k, t);
      for (int j = 0; j < NJ; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) out[r][j] = vsum(acc[r][j]);
}

template <class W, int NR>
inline void block_dot_nj(int nj, const float* const* x, const typename W::T* const* w, int64_t K,
                         float out[4][4]) {
  switch (nj) {
    case 4: block_dot<W, NR, 4>(x, w, K, out); break;
    case 3: block_dot<W, NR, 3>(x, w, K, out); break;
    case 2: block_dot<W, NR, 2>(x, w, K, out); break;
    default: block_dot<W, NR, 1>(x, w, K, out); break;
  }
}

template <class W>
inline void dispatch_block(int nr, int nj, const float* const* x, const typename W::T* const* w,
                           int64_t K, float out[4][4]) {
  switch (nr) {
    case 4: block_dot_nj<W, 4>(nj, x, w, K, out); break;
    case 3: block_dot_nj<W, 3>(nj, x, w, K, out); break;
    case 2: block_dot_nj<W, 2>(nj, x, w, K, out); break;
    default: block_dot_nj<W, 1>(nj, x, w, K, out); break;
  }
}

// y (N, M) = x (N, K) @ w (M, K)^T + bias. Work splits over tiles of 32 weight rows. Within a
// tile, float32 weights go block-of-4-rows outer (4 rows stay in L1 for all activation rows);
// float16 weights, half the bytes, go activation-group outer, which measured faster. Either
// way the 4 weight rows two blocks ahead are prefetched while the current block computes.
template <class W, bool kWeightOuter>
void linear_impl(const float* xp, const typename W::T* wp, const float* bp, float* yp,
                 int64_t N, int64_t K, int64_t M) {
  constexpr int64_t kTile = 32, kAhead = 2;
  const int64_t tiles = (M + kTile - 1) / kTile;
  const int64_t block_bytes = 4 * K * static_cast<int64_t>(sizeof(typename W::T));
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j_begin = t * kTile, j_end = std::min(M, j_begin + kTile);
      auto prefetch_ahead = [&](int64_t j0) {
        const int64_t pj = j0 + 4 * kAhead;
        if (pj + 4 > M) return;
        const char* base = reinterpret_cast<const char*>(wp + pj * K);
        for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(base + off, _MM_HINT_T0);
      };
      auto block = [&](int64_t n0, int64_t j0) {
        const int nr = static_cast<int>(std::min<int64_t>(4, N - n0));
        const int nj = static_cast<int>(std::min<int64_t>(4, j_end - j0));
        const float* xr[4];
        for (int r = 0; r < 4; ++r) xr[r] = xp + (n0 + std::min(r, nr - 1)) * K;
        const typename W::T* wr[4];
        for (int j = 0; j < 4; ++j) wr[j] = wp + (j0 + std::min(j, nj - 1)) * K;
        float out[4][4];
        dispatch_block<W>(nr, nj, xr, wr, K, out);
        for (int r = 0; r < nr; ++r)
          for (int j = 0; j < nj; ++j)
            yp[(n0 + r) * M + j0 + j] = bp ? out[r][j] + bp[j0 + j] : out[r][j];
      };
      if (kWeightOuter) {
        for (int64_t j0 = j_begin; j0 < j_end; j0 += 4) {
          prefetch_ahead(j0);
          for (int64_t n0 = 0; n0 < N; n0 += 4) block(n0, j0);
        }
      } else {
        // The first activation group streams the tile from memory (prefetching two blocks
        // ahead); meanwhile, spread evenly over the tile's work, the next tile is prefetched
        // into L2 one block at a time, so memory stays busy while the later groups compute.
        const int64_t groups = (N + 3) / 4;
        const int64_t next = j_end, next_end = std::min(M, j_end + kTile);
        int64_t step = 0, fetched = 0;
        for (int64_t n0 = 0; n0 < N; n0 += 4)
          for (int64_t j0 = j_begin; j0 < j_end; j0 += 4, ++step) {
            if (n0 == 0) prefetch_ahead(j0);
            if (fetched * groups <= step && next + 4 * fetched < next_end) {
              const int64_t pj = next + 4 * fetched++;
              const char* base = reinterpret_cast<const char*>(wp + pj * K);
              const int64_t bytes = std::min<int64_t>(4, next_end - pj) * K *
                                    static_cast<int64_t>(sizeof(typename W::T));
              for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(base + off, _MM_HINT_T1);
            }
            block(n0, j0);
          }
      }
    }
  });
}

// Argument checks raise Python's ValueError through pybind11, with the message formatted here.
// They do not go through TORCH_CHECK: on one toolchain (gcc 13.3, torch 2.11+cu130) a failed
// TORCH_CHECK whose message formats integers killed the interpreter instead of raising, and
// keeping the error path inside this library leaves it nothing to disagree with torch about.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw pybind11::value_error(os.str());
}

void check_f32_contig(const torch::Tensor& t, const char* name, int64_t dim) {
  SE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  SE_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  SE_CHECK(t.is_contiguous(), name, " must be contiguous");
  SE_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
}

}  // namespace

// y (N, M) = x (N, K) @ w (M, K)^T + bias (M,); w float32 or float16, x and bias float32.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check_f32_contig(x, "x", 2);
  SE_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, "weight must be a contiguous 2-D CPU tensor");
  SE_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kFloat16,
              "weight must be float32 or float16, got ", w.scalar_type());
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  SE_CHECK(w.size(1) == K, "weight has ", w.size(1), " input features, x has ", K);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32_contig(*bias, "bias", 1);
    SE_CHECK(bias->size(0) == M, "bias has ", bias->size(0), " entries, weight has ", M, " rows");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({N, M}, x.options());
  if (w.scalar_type() == torch::kFloat16)
    linear_impl<F16Weights, false>(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                                   bp, y.data_ptr<float>(), N, K, M);
  else
    linear_impl<F32Weights, true>(x.data_ptr<float>(), w.data_ptr<float>(), bp, y.data_ptr<float>(), N, K, M);
  return y;
}

namespace {
// out[0..D) = inv * sum_s p[s] * V[slots[s]], with D <= C * kLanes held in registers; even and
// odd slots accumulate apart (two FMA chains per chunk), then add. The order of operations
// depends only on the slot count, never on the other queries of the call.
template <int C>
inline void weighted_values(const float* p, const int64_t* slots, int64_t n_slots, const float* vbase,
                            int64_t ks, int64_t D, float inv, float* out) {
  const int64_t tail = D - (C - 1) * kLanes;
  vec even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = vzero();
  int64_t s = 0;
  for (; s + 1 < n_slots; s += 2) {
    const float* v0 = vbase + slots[s] * ks;
    const float* v1 = vbase + slots[s + 1] * ks;
    const vec p0 = vset1(p[s]), p1 = vset1(p[s + 1]);
    for (int c = 0; c < C - 1; ++c) {
      even[c] = vfma(p0, vload(v0 + c * kLanes), even[c]);
      odd[c] = vfma(p1, vload(v1 + c * kLanes), odd[c]);
    }
    const int64_t o = (C - 1) * kLanes;
    even[C - 1] = vfma(p0, tail == kLanes ? vload(v0 + o) : vload_tail(v0 + o, tail), even[C - 1]);
    odd[C - 1] = vfma(p1, tail == kLanes ? vload(v1 + o) : vload_tail(v1 + o, tail), odd[C - 1]);
  }
  if (s < n_slots) {
    const float* v0 = vbase + slots[s] * ks;
    const vec p0 = vset1(p[s]);
    for (int c = 0; c < C - 1; ++c) even[c] = vfma(p0, vload(v0 + c * kLanes), even[c]);
    const int64_t o = (C - 1) * kLanes;
    even[C - 1] = vfma(p0, tail == kLanes ? vload(v0 + o) : vload_tail(v0 + o, tail), even[C - 1]);
  }
  const vec vinv = vset1(inv);
  for (int c = 0; c < C; ++c) {
    const vec r = vmul(vadd(even[c], odd[c]), vinv);
    if (c < C - 1 || tail == kLanes) vstore(out + c * kLanes, r); else vstore_tail(out + c * kLanes, r, tail);
  }
}
}  // namespace

// out (B, H, N, D): query i of row b attends to slots [0, starts[b]) and to slots
// starts[b] + j for j < M with mask[b, i, j] (mask (B, N, M) bool; undefined = a chain:
// j <= M - N + i), in slot order.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::vector<int64_t>& starts, int64_t M,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  check_f32_contig(q, "q", 4);
  SE_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "k_cache and v_cache must be float32");
  SE_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "k_cache/v_cache must be (B, H, S, D)");
  SE_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "k_cache/v_cache need unit stride over D and equal strides");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), S = k.size(2);
  SE_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, "cache shape does not match q");
  SE_CHECK(static_cast<int64_t>(starts.size()) == B, "starts needs one entry per row");
  SE_CHECK(M >= N, "M (uncommitted entries) must be >= N");
  for (int64_t b = 0; b < B; ++b)
    SE_CHECK(starts[b] >= 0 && starts[b] + M <= S, "row ", b, ": slots exceed the cache");
  const bool* mp = nullptr;
  bool mask_per_row = false;
  if (mask.has_value() && mask->defined()) {
    SE_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous(), "mask must be contiguous bool");
    SE_CHECK((mask->dim() == 2 && mask->size(0) == N && mask->size(1) == M) ||
                (mask->dim() == 3 && mask->size(0) == B && mask->size(1) == N && mask->size(2) == M),
                "mask must be (N, M) or (B, N, M)");
    mask_per_row = mask->dim() == 3;
    mp = mask->data_ptr<bool>();
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H * N, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int64_t> slots;
    std::vector<float> p;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (H * N), h = (w / N) % H, i = w % N;
      const int64_t L = starts[b];
      slots.clear();
      for (int64_t s = 0; s < L; ++s) slots.push_back(s);
      for (int64_t j = 0; j < M; ++j) {
        const bool visible = mp ? mp[(mask_per_row ? b * N * M : 0) + i * M + j] : (j <= M - N + i);
        if (visible) slots.push_back(L + j);
      }
      const float* qi = qp + ((b * H + h) * N + i) * D;
      const float* kbase = kp + b * kb + h * kh;
      const float* vbase = vp + b * kb + h * kh;
      p.resize(slots.size());
      // Scores four slots at a time: one FMA chain over D per slot, then vsum4's fixed tree.
      const int64_t n_slots = static_cast<int64_t>(slots.size());
      for (int64_t s0 = 0; s0 < n_slots; s0 += 4) {
        const int64_t cnt = std::min<int64_t>(4, n_slots - s0);
        const float* kr[4];
        for (int64_t u = 0; u < 4; ++u) kr[u] = kbase + slots[s0 + std::min(u, cnt - 1)] * ks;
        vec acc[4] = {vzero(), vzero(), vzero(), vzero()};
        int64_t d = 0;
        for (; d + kLanes <= D; d += kLanes) {
          const vec qv = vload(qi + d);
          for (int u = 0; u < 4; ++u) acc[u] = vfma(qv, vload(kr[u] + d), acc[u]);
        }
        if (d < D) {
          const vec qv = vload_tail(qi + d, D - d);
          for (int u = 0; u < 4; ++u) acc[u] = vfma(qv, vload_tail(kr[u] + d, D - d), acc[u]);
        }
        alignas(16) float four[4];
        _mm_store_ps(four, _mm_mul_ps(vsum4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(sc)));
        for (int64_t u = 0; u < cnt; ++u) p[s0 + u] = four[u];
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n_slots; ++s) mx = std::max(mx, p[s]);
      // p = exp(p - max) and their sum, kLanes slots at a time (the tail lanes are masked off).
      const vec vmx = vset1(mx);
      vec vden = vzero();
      for (int64_t s = 0; s < n_slots; s += kLanes) {
        const int64_t t = std::min<int64_t>(kLanes, n_slots - s);
        if (t == kLanes) {
          const vec e = vexp(vsub(vload(p.data() + s), vmx));
          vstore(p.data() + s, e);
          vden = vadd(vden, e);
        } else {
          const vec e = vexp(vsub(vload_tail(p.data() + s, t), vmx));
          vstore_tail(p.data() + s, e, t);
          vden = vadd(vden, vload_tail(p.data() + s, t));
        }
      }
      const float inv = 1.f / vsum(vden);
      float* oi = op + ((b * H + h) * N + i) * D;
      if (D <= 4 * kLanes) {
        switch ((D + kLanes - 1) / kLanes) {
          case 1: weighted_values<1>(p.data(), slots.data(), n_slots, vbase, ks, D, inv, oi); break;
          case 2: weighted_values<2>(p.data(), slots.data(), n_slots, vbase, ks, D, inv, oi); break;
          case 3: weighted_values<3>(p.data(), slots.data(), n_slots, vbase, ks, D, inv, oi); break;
          default: weighted_values<4>(p.data(), slots.data(), n_slots, vbase, ks, D, inv, oi); break;
        }
        continue;
      }
      for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
        const int64_t t = std::min<int64_t>(kLanes, D - d0);
        vec acc = vzero();
        for (size_t s = 0; s < slots.size(); ++s) {
          const float* vr = vbase + slots[s] * ks + d0;
          acc = vfma(vset1(p[s]), t == kLanes ? vload(vr) : vload_tail(vr, t), acc);
        }
        acc = vmul(acc, vset1(inv));
        if (t == kLanes) vstore(oi + d0, acc); else vstore_tail(oi + d0, acc, t);
      }
    }
  });
  return out;
}

// For each row of scores (N, V): the k largest entries (descending, ties to the smaller id) and
// their log-softmax values, scores[idx] - logsumexp(scores), in one pass for the selection and
// two vectorised passes for the normaliser. The tree builder's child scoring (drafters.py).
std::vector<torch::Tensor> top_children(const torch::Tensor& scores, int64_t k) {
  check_f32_contig(scores, "scores", 2);
  const int64_t N = scores.size(0), V = scores.size(1);
  SE_CHECK(k >= 1 && k <= V && k <= 64, "k must be in [1, min(V, 64)], got ", k);
  auto idx = torch::empty({N, k}, scores.options().dtype(torch::kInt64));
  auto logr = torch::empty({N, k}, scores.options());
  const float* sp = scores.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = logr.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    float bv[64];
    int64_t bi[64];
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = sp + r * V;
      int64_t filled = 0;
      float thresh = -std::numeric_limits<float>::infinity();
      auto offer = [&](int64_t j) {
        const float x = row[j];
        if (filled == k && !(x > thresh)) return;
        int64_t pos = filled < k ? filled++ : k - 1;
        while (pos > 0 && x > bv[pos - 1]) {  // strictly greater: the earlier id stays ahead
          bv[pos] = bv[pos - 1];
          bi[pos] = bi[pos - 1];
          --pos;
        }
        bv[pos] = x;
        bi[pos] = j;
        if (filled == k) thresh = bv[k - 1];
      };
      vec vm = vset1(-std::numeric_limits<float>::infinity());
      int64_t j = 0;
      for (; j + kLanes <= V; j += kLanes) {
        const vec x = vload(row + j);
        vm = vmax(vm, x);
        if (filled < k) {
          for (int64_t u = 0; u < kLanes; ++u) offer(j + u);
        } else if (vmax_all(x) > thresh) {
          for (int64_t u = 0; u < kLanes; ++u) offer(j + u);
        }
      }
      float mx = vmax_all(vm);
      for (; j < V; ++j) {
        mx = std::max(mx, row[j]);
        offer(j);
      }
      float lse = mx;
      if (std::isfinite(mx)) {
        const vec vmx = vset1(mx);
        vec acc = vzero();
        int64_t t = 0;
        for (; t + kLanes <= V; t += kLanes) acc = vadd(acc, vexp(vsub(vload(row + t), vmx)));
        float sum = vsum(acc);
        for (; t < V; ++t) sum += std::exp(row[t] - mx);
        lse = mx + std::log(sum);
      }
      for (int64_t u = 0; u < k; ++u) {
        ip[r * k + u] = bi[u];
        lp[r * k + u] = bv[u] - lse;
      }
    }
  });
  return {idx, logr};
}

// Every decoder block of one forward pass, in one call: x (B, N, C) float32 -> x after the last
// block. The same kernels and ATen ops, in the same order and on the same values, as the Python
// loop of GPT2.forward on the native backend, so the result is bit-identical to it; what goes
// away is the Python around them (about a dozen dispatches per block, which cost more than the
// arithmetic for models of a few million parameters). weights: 12 per block, in the order of
// GPT2._layer_tensors, each linear weight float32 or its exact float16 twin. The new tokens' K/V
// go to slots writes[b] .. + N of each row; attention sees [0, starts[b]) and the M uncommitted
// entries from starts[b] (mask as in attention()).
torch::Tensor forward_blocks(torch::Tensor x, const std::vector<torch::Tensor>& weights,
                             const torch::Tensor& k_all, const torch::Tensor& v_all,
                             const std::vector<int64_t>& writes, const std::vector<int64_t>& starts, int64_t M,
                             const c10::optional<torch::Tensor>& mask, int64_t n_head, double eps, double scale,
                             const std::string& activation) {
  check_f32_contig(x, "x", 3);
  const int64_t B = x.size(0), N = x.size(1), C = x.size(2);
  SE_CHECK(k_all.dim() == 5 && v_all.dim() == 5 && k_all.sizes() == v_all.sizes(),
           "k_cache and v_cache must be (L, B, H, S, D) and alike");
  SE_CHECK(k_all.scalar_type() == torch::kFloat32 && v_all.scalar_type() == torch::kFloat32,
           "k_cache and v_cache must be float32");
  const int64_t L = k_all.size(0);
  SE_CHECK(L >= 1, "the cache has no blocks");
  SE_CHECK(static_cast<int64_t>(weights.size()) == 12 * L, "weights needs 12 tensors per block, got ",
           weights.size(), " for ", L, " blocks");
  SE_CHECK(n_head >= 1 && C % n_head == 0, "n_head must divide n_embd");
  SE_CHECK(static_cast<int64_t>(writes.size()) == B, "writes needs one entry per row");
  SE_CHECK(activation == "gelu_tanh" || activation == "gelu" || activation == "relu",
           "activation must be gelu_tanh, gelu or relu, got ", activation);
  const int64_t D = C / n_head;
  {
    SE_CHECK(k_all.size(1) == B && k_all.size(2) == n_head && k_all.size(4) == D,
             "the cache must be (L, ", B, ", ", n_head, ", S, ", D, "), got ", k_all.sizes());
  }
  for (int64_t b = 0; b < B; ++b)
    SE_CHECK(writes[b] >= 0 && writes[b] + N <= k_all.size(3), "row ", b, ": writes exceed the cache");
  c10::optional<torch::Tensor> m;
  if (mask.has_value() && mask->defined()) m = mask->contiguous();
  bool same_write = true;
  for (int64_t b = 1; b < B; ++b) same_write = same_write && writes[b] == writes[0];
  auto lin = [&](const torch::Tensor& h, const torch::Tensor& w, const torch::Tensor& bias) {
    return ::linear(h.reshape({B * N, h.size(2)}).contiguous(), w, c10::optional<torch::Tensor>(bias)).view({B, N, w.size(0)});
  };
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &weights[12 * l];
    auto h = at::layer_norm(x, {C}, w[0], w[1], eps);
    auto qkv = lin(h, w[2], w[3]);
    auto parts = qkv.view({B, N, 3, n_head, D}).permute({2, 0, 3, 1, 4}).unbind(0);
    auto kc = k_all.select(0, l);
    auto vc = v_all.select(0, l);
    if (same_write) {
      kc.slice(2, writes[0], writes[0] + N).copy_(parts[1]);
      vc.slice(2, writes[0], writes[0] + N).copy_(parts[2]);
    } else {
      for (int64_t b = 0; b < B; ++b) {
        kc.select(0, b).slice(1, writes[b], writes[b] + N).copy_(parts[1].select(0, b));
        vc.select(0, b).slice(1, writes[b], writes[b] + N).copy_(parts[2].select(0, b));
      }
    }
    auto a = ::attention(parts[0].contiguous(), kc, vc, starts, M, m, scale);
    a = a.transpose(1, 2).reshape({B, N, C});
    x = x + lin(a, w[4], w[5]);
    h = at::layer_norm(x, {C}, w[6], w[7], eps);
    h = lin(h, w[8], w[9]);
    if (activation == "gelu_tanh") h = at::gelu(h, "tanh");
    else if (activation == "gelu") h = at::gelu(h);
    else h = at::relu(h);
    x = x + lin(h, w[10], w[11]);
  }
  return x;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Row-count-independent few-row linear and slot-ordered attention for CPU decoding";
  m.def("linear", &linear, "y = x @ w.T + bias (w float32 or float16), per-row results independent of the row count",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("attention", &attention, "tree attention over the committed prefix and visible pending entries",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("starts"), py::arg("m"),
        py::arg("mask") = py::none(), py::arg("scale"));
  m.def("top_children", &top_children, "k largest scores per row and their log-softmax values",
        py::arg("scores"), py::arg("k"));
  m.def("forward_blocks", &forward_blocks, "every decoder block of a forward pass in one call",
        py::arg("x"), py::arg("weights"), py::arg("k_cache"), py::arg("v_cache"), py::arg("writes"),
        py::arg("starts"), py::arg("m"), py::arg("mask"), py::arg("n_head"), py::arg("eps"), py::arg("scale"),
        py::arg("activation"));
}
