// The draft's child scoring on CPU: top_children() picks, per row of scores, the k largest
// entries and their log-softmax values in one selection pass and two vectorised passes for the
// normaliser (spec/drafters.py ranks a node's children with it). The whole decode forward pass
// is cpu_forward.cpp (NativeGPT2); both build into staged_engine._cpu.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_errors.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace se_simd;

using se_errors::fail;

void check_f32_contig(const torch::Tensor& t, const char* name, int64_t dim) {
  SE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  SE_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  SE_CHECK(t.is_contiguous(), name, " must be contiguous");
  SE_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got ", t.dim());
}

}  // namespace

// One row of top_children: its k (1-64) largest entries to ip and their log-softmax values to lp.
void top_row(const float* row, int64_t V, int64_t k, int64_t* ip, float* lp) {
  float bv[64];
  int64_t bi[64];
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
    } else {  // full: only lanes above the threshold can enter, in id order
      for (uint32_t m = vmask_gt(x, thresh); m; m &= m - 1) offer(j + __builtin_ctz(m));
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
    ip[u] = bi[u];
    lp[u] = bv[u] - lse;
  }
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
    for (int64_t r = r0; r < r1; ++r) top_row(sp + r * V, V, k, ip + r * k, lp + r * k);
  });
  return {idx, logr};
}

void register_native_forward(pybind11::module& m);  // cpu_forward.cpp
void register_sampling(pybind11::module& m);  // cpu_sampling.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_native_forward(m);
  register_sampling(m);
  m.doc() = "The native CPU decode path (NativeGPT2), the sampling rule and tree verification, the draft's "
            "child scoring and the KV-cache path commit";
  m.def("top_children", &top_children, "k largest scores per row and their log-softmax values",
        py::arg("scores"), py::arg("k"));
}
