// Few-row CPU kernels whose per-row results do not depend on how many rows are computed.
//
// Small-batch decoding multiplies 1..64 activation rows by each weight matrix. The stock BLAS
// routines are slow for 2..16 rows and, worse for speculation, give a row a different rounding
// depending on the row count. Here every output y[n, j] is one fixed sequence of FMAs over k
// (16 lanes, then a masked tail, then one horizontal reduction), whatever N is: a tree node's
// activations are bit-identical to those of plain one-token decoding. Weights stream from
// memory once per 32-row tile and are reused from L2 for every group of 4 activation rows.
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
inline void vstore_tail(float* p, vec a, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), a);
}
#elif defined(__AVX2__) && defined(__FMA__)
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
inline void vstore_tail(float* p, vec a, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), a); }
#else
#error "staged_engine._cpu needs AVX2+FMA or AVX-512 (built with -march=native)"
#endif

// Dot products of rows x[0..nr) with weight rows w[0..nj), nr, nj <= 4, all over K.
template <int NR, int NJ>
inline void block_dot(const float* const* x, const float* const* w, int64_t K, float out[4][4]) {
  vec acc[NR][NJ];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) acc[r][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = vload(w[j] + k);
    for (int r = 0; r < NR; ++r) {
      const vec xv = vload(x[r] + k);
      for (int j = 0; j < NJ; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  if (k < K) {
    const int64_t t = K - k;
    vec wv[NJ];
    for (int j = 0; j < NJ; ++j) wv[j] = vload_tail(w[j] + k, t);
    for (int r = 0; r < NR; ++r) {
      const vec xv = vload_tail(x[r] + k, t);
      for (int j = 0; j < NJ; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NJ; ++j) out[r][j] = vsum(acc[r][j]);
}

template <int NR>
inline void block_dot_nj(int nj, const float* const* x, const float* const* w, int64_t K,
                         float out[4][4]) {
  switch (nj) {
    case 4: block_dot<NR, 4>(x, w, K, out); break;
    case 3: block_dot<NR, 3>(x, w, K, out); break;
    case 2: block_dot<NR, 2>(x, w, K, out); break;
    default: block_dot<NR, 1>(x, w, K, out); break;
  }
}

inline void dispatch_block(int nr, int nj, const float* const* x, const float* const* w,
                           int64_t K, float out[4][4]) {
  switch (nr) {
    case 4: block_dot_nj<4>(nj, x, w, K, out); break;
    case 3: block_dot_nj<3>(nj, x, w, K, out); break;
    case 2: block_dot_nj<2>(nj, x, w, K, out); break;
    default: block_dot_nj<1>(nj, x, w, K, out); break;
  }
}

void check_f32_contig(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
}

}  // namespace

// y (N, M) = x (N, K) @ w (M, K)^T + bias (M,)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  check_f32_contig(x, "x", 2);
  check_f32_contig(w, "weight", 2);
  const int64_t N = x.size(0), K = x.size(1), M = w.size(0);
  TORCH_CHECK(w.size(1) == K, "weight has ", w.size(1), " input features, x has ", K);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_f32_contig(*bias, "bias", 1);
    TORCH_CHECK(bias->size(0) == M, "bias has ", bias->size(0), " entries, weight has ", M, " rows");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({N, M}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kTile = 32;  // weight rows per tile: streamed once, reused from L2
  const int64_t tiles = (M + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t j_begin = t * kTile, j_end = std::min(M, j_begin + kTile);
      for (int64_t n0 = 0; n0 < N; n0 += 4) {
        const int nr = static_cast<int>(std::min<int64_t>(4, N - n0));
        const float* xr[4];
        for (int r = 0; r < 4; ++r) xr[r] = xp + (n0 + std::min(r, nr - 1)) * K;
        for (int64_t j0 = j_begin; j0 < j_end; j0 += 4) {
          const int nj = static_cast<int>(std::min<int64_t>(4, j_end - j0));
          const float* wr[4];
          for (int j = 0; j < 4; ++j) wr[j] = wp + (j0 + std::min(j, nj - 1)) * K;
          float out[4][4];
          dispatch_block(nr, nj, xr, wr, K, out);
          for (int r = 0; r < nr; ++r)
            for (int j = 0; j < nj; ++j)
              yp[(n0 + r) * M + j0 + j] = bp ? out[r][j] + bp[j0 + j] : out[r][j];
        }
      }
    }
  });
  return y;
}

// out (B, H, N, D): query i of row b attends to slots [0, starts[b]) and to slots
// starts[b] + j for j < M with mask[b, i, j] (mask (B, N, M) bool; undefined = a chain:
// j <= M - N + i), in slot order.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::vector<int64_t>& starts, int64_t M,
                        const c10::optional<torch::Tensor>& mask, double scale) {
  check_f32_contig(q, "q", 4);
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 && v.scalar_type() == torch::kFloat32,
              "k_cache and v_cache must be float32");
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(), "k_cache/v_cache must be (B, H, S, D)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.strides() == v.strides(),
              "k_cache/v_cache need unit stride over D and equal strides");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == D, "cache shape does not match q");
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == B, "starts needs one entry per row");
  TORCH_CHECK(M >= N, "M (uncommitted entries) must be >= N");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(starts[b] >= 0 && starts[b] + M <= S, "row ", b, ": slots exceed the cache");
  const bool* mp = nullptr;
  bool mask_per_row = false;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous(), "mask must be contiguous bool");
    TORCH_CHECK((mask->dim() == 2 && mask->size(0) == N && mask->size(1) == M) ||
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
      float mx = -std::numeric_limits<float>::infinity();
      for (size_t s = 0; s < slots.size(); ++s) {
        const float* kr = kbase + slots[s] * ks;
        vec acc = vzero();
        int64_t d = 0;
        for (; d + kLanes <= D; d += kLanes) acc = vfma(vload(qi + d), vload(kr + d), acc);
        if (d < D) acc = vfma(vload_tail(qi + d, D - d), vload_tail(kr + d, D - d), acc);
        p[s] = vsum(acc) * sc;
        mx = std::max(mx, p[s]);
      }
      float denom = 0.f;
      for (size_t s = 0; s < slots.size(); ++s) {
        p[s] = std::exp(p[s] - mx);
        denom += p[s];
      }
      const float inv = 1.f / denom;
      float* oi = op + ((b * H + h) * N + i) * D;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Row-count-independent few-row linear and slot-ordered attention for CPU decoding";
  m.def("linear", &linear, "y = x @ w.T + bias, per-row results independent of the row count",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("attention", &attention, "tree attention over the committed prefix and visible pending entries",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("starts"), py::arg("m"),
        py::arg("mask") = py::none(), py::arg("scale"));
}
