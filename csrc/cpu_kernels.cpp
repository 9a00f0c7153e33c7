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

#include "cpu_errors.h"
#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <sstream>
#include <string>


namespace {

using namespace se_simd;

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

using se_errors::fail;

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
      p.resize(slots.size() + kLanes);
      attend_one(qp + ((b * H + h) * N + i) * D, kp + b * kb + h * kh, vp + b * kb + h * kh, ks, slots.data(),
                 static_cast<int64_t>(slots.size()), D, sc, p.data(), op + ((b * H + h) * N + i) * D);
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

void register_native_forward(pybind11::module& m);  // cpu_forward.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_native_forward(m);
  m.doc() = "Row-count-independent few-row linear and slot-ordered attention for CPU decoding";
  m.def("linear", &linear, "y = x @ w.T + bias (w float32 or float16), per-row results independent of the row count",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("attention", &attention, "tree attention over the committed prefix and visible pending entries",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("starts"), py::arg("m"),
        py::arg("mask") = py::none(), py::arg("scale"));
  m.def("top_children", &top_children, "k largest scores per row and their log-softmax values",
        py::arg("scores"), py::arg("k"));
}
