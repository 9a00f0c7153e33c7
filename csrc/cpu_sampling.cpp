// The oracle's choice, tree verification, the draft's perturbed child scoring and the KV-cache
// path commit, each one native call on CPU (spec/verify.py, spec/drafters.py and
// model/kv_cache.py call them through TorchBackend; the torch code in sampling.py is the
// reference they are tested against).
//
// The rule is ALGORITHMS.md sec. 3: at T = 0 the first argmax of the logits; at T > 0 the
// argmax over the kept tokens (top-k, then top-p) of log p'(i) + g(seed, t)[i], ties to the
// smaller id. g is the Gumbel noise of sampling.py, bit for bit in its uniforms: a 32-bit
// counter hash of (seed, position, token) -> u in (0, 1) -> -log(-log u). Noise is computed only
// for tokens that can still win: g never exceeds kGumbelMax, so over a sorted kept list a token
// whose log p' is more than kGumbelMax below the best score found so far is skipped without
// hashing; over a whole row, a bound on g from the hash alone (no logarithm) skips the rest.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_errors.h"
#include "cpu_ops.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

using namespace se_simd;
using se_errors::fail;

constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr uint32_t kVocabSalt = 0x632BE5ABu;
// The largest u is 1 - 2^-24, so g <= -log(-log(1 - 2^-24)) = 16.6355; the margin covers the
// rounding of float scores.
constexpr float kGumbelMax = 16.64f + 0.01f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline uint32_t noise_key(uint64_t seed, int64_t position) {
  uint32_t k = mix32(static_cast<uint32_t>(seed) ^ kGolden);
  k = mix32(k ^ static_cast<uint32_t>(seed >> 32));
  return mix32(k ^ static_cast<uint32_t>(position));
}

// The noise of kLanes consecutive tokens in one fixed sequence of vector operations per lane:
// the hash in 32-bit integer lanes, u exact, then -log(-log u) with vlog (below). A token's noise
// is the same whichever block computes it, so every caller sees the same g.
#if defined(__AVX512F__)
using ivec = __m512i;
inline ivec iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
inline ivec ixor(ivec a, ivec b) { return _mm512_xor_si512(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec imul(ivec a, ivec b) { return _mm512_mullo_epi32(a, b); }
template <int N> inline ivec isrl(ivec a) { return _mm512_srli_epi32(a, N); }
inline ivec iramp(int64_t base) {
  return _mm512_add_epi32(iset1(static_cast<uint32_t>(base)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline vec itof(ivec a) { return _mm512_cvtepi32_ps(a); }
inline ivec isub(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
inline ivec icast(vec a) { return _mm512_castps_si512(a); }
inline ivec iload(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline void istore(uint32_t* p, ivec a) { _mm512_storeu_si512(p, a); }
// log x for normal x > 0 (Cephes logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)], a degree-8
// polynomial in m - 1; about 1 ulp).
inline vec vlog(vec x) {
  vec e = _mm512_getexp_ps(x);
  vec m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, vset1(1.41421356237f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, vset1(0.5f));
  e = _mm512_mask_add_ps(e, big, e, vset1(1.f));
#else
using ivec = __m256i;
inline ivec iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
inline ivec ixor(ivec a, ivec b) { return _mm256_xor_si256(a, b); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec imul(ivec a, ivec b) { return _mm256_mullo_epi32(a, b); }
template <int N> inline ivec isrl(ivec a) { return _mm256_srli_epi32(a, N); }
inline ivec iramp(int64_t base) {
  return _mm256_add_epi32(iset1(static_cast<uint32_t>(base)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec itof(ivec a) { return _mm256_cvtepi32_ps(a); }
inline ivec isub(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
inline ivec icast(vec a) { return _mm256_castps_si256(a); }
inline ivec iload(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void istore(uint32_t* p, ivec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
inline vec vlog(vec x) {
  const __m256i bits = _mm256_castps_si256(x);
  vec e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  vec m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007FFFFF)), _mm256_set1_epi32(0x3F800000)));
  const vec big = _mm256_cmp_ps(m, vset1(1.41421356237f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, vmul(m, vset1(0.5f)), big);
  e = vadd(e, _mm256_and_ps(big, vset1(1.f)));
#endif
  const vec t = vsub(m, vset1(1.f));
  const vec t2 = vmul(t, t);
  vec y = vset1(7.0376836292E-2f);
  y = vfma(y, t, vset1(-1.1514610310E-1f));
  y = vfma(y, t, vset1(1.1676998740E-1f));
  y = vfma(y, t, vset1(-1.2420140846E-1f));
  y = vfma(y, t, vset1(1.4249322787E-1f));
  y = vfma(y, t, vset1(-1.6668057665E-1f));
  y = vfma(y, t, vset1(2.0000714765E-1f));
  y = vfma(y, t, vset1(-2.4999993993E-1f));
  y = vfma(y, t, vset1(3.3333331174E-1f));
  y = vmul(vmul(y, t), t2);
  y = vfma(e, vset1(-2.12194440e-4f), y);
  y = vfma(t2, vset1(-0.5f), y);
  return vfma(e, vset1(0.693359375f), vadd(t, y));
}

inline ivec vmix32(ivec x) {
  x = ixor(x, isrl<16>(x));
  x = imul(x, iset1(0x7FEB352Du));
  x = ixor(x, isrl<15>(x));
  x = imul(x, iset1(0x846CA68Bu));
  return ixor(x, isrl<16>(x));
}

// The per-token half of the hash: it depends on the token id alone.
inline ivec vsalt(int64_t token0) { return vmix32(iadd(imul(iramp(token0), iset1(kGolden)), iset1(kVocabSalt))); }

// u(key) of kLanes tokens from their salts (vsalt): an odd multiple of 2^-24 in (0, 1).
inline vec vuniform_salted(uint32_t key, ivec salt) {
  const ivec k = iset1(key);
  const ivec h = vmix32(iadd(vmix32(ixor(salt, k)), k));
  return vmul(vadd(itof(isrl<9>(h)), vset1(0.5f)), vset1(1.0f / 8388608.0f));
}

// g(key) of kLanes tokens from their salts.
inline vec vgumbel_salted(uint32_t key, ivec salt) {
  return vsub(vzero(), vlog(vsub(vzero(), vlog(vuniform_salted(key, salt)))));
}

// g(key)[token0 .. token0 + kLanes)
inline vec vgumbel(uint32_t key, int64_t token0) { return vgumbel_salted(key, vsalt(token0)); }

// An upper bound of g(key) for kLanes tokens from their salts: the same hash and u, then an
// exponent read off instead of g's two logarithms. With w = 1 - u (exact in float: u is an odd
// multiple of 2^-24), -log u >= w, so g = -log(-log u) <= -log w; and w = 2^e m with m in [1, 2)
// gives -log w = -(e + log2 m) ln 2 <= -e ln 2. The bound is at most ln 2 above -log w.
inline vec vgumbel_bound_salted(uint32_t key, ivec salt) {
  const vec u = vuniform_salted(key, salt);
  const ivec biased = isrl<23>(icast(vsub(vset1(1.f), u)));  // w > 0: the sign bit is 0
  return vmul(vset1(0.693147242f), itof(isub(iset1(127), biased)));  // the float above ln 2
}

// The salts of tokens 0 .. n-1 (n a whole number of vectors), computed once per thread: a whole
// row's noise then costs two rounds of the hash per token instead of three.
const uint32_t* salts(int64_t n) {
  thread_local std::vector<uint32_t> table;
  const int64_t have = static_cast<int64_t>(table.size());
  if (have < n) {
    table.resize(n);
    for (int64_t j = have; j < n; j += kLanes) istore(table.data() + j, vsalt(j));
  }
  return table.data();
}

inline float gumbel(uint32_t key, int64_t token) {
  alignas(64) float lanes[kLanes];
  vstore(lanes, vgumbel(key, token));
  return lanes[0];
}

struct Rule {
  float temperature;
  int64_t top_k;
  double top_p;
  bool greedy() const { return temperature == 0.f; }
};

// The first i < n with p[i] == v, 16 lanes at a time (a lane mask, then its first bit); -1 when
// there is none (v NaN, or not in p).
int64_t first_equal(const float* p, int64_t n, float v) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    if (const uint32_t eq = vmask_eq(vload(p + i), v)) return i + __builtin_ctz(eq);
  for (; i < n; ++i)
    if (p[i] == v) return i;
  return -1;
}

// z / T for a whole row, and its log-sum-exp; its largest z to ``max_z`` where given.
// z is padded with -inf to a whole number of vectors.
float scaled_row(const float* row, int64_t V, float T, std::vector<float>& z, float* max_z = nullptr) {
  z.assign(((V + kLanes - 1) / kLanes) * kLanes, kNegInf);
  for (int64_t i = 0; i < V; ++i) z[i] = row[i] / T;
  // The largest z, in vector lanes (the padding is -inf). max_ps(x, m) keeps m where x is NaN,
  // as std::max(mx, x) does; a scalar loop of it was a chain of dependent maxes, a third of a
  // top-p choice's time over 8192 tokens.
  vec vm = vset1(kNegInf);
  for (int64_t i = 0; i < static_cast<int64_t>(z.size()); i += kLanes) vm = vmax(vload(z.data() + i), vm);
  const float mx = vmax_all(vm);
  if (max_z != nullptr) *max_z = mx;
  if (!std::isfinite(mx)) return mx;
  const vec vmx = vset1(mx);
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) acc = vadd(acc, vexp(vsub(vload(z.data() + i), vmx)));
  float sum = vsum(acc);
  for (; i < V; ++i) sum += std::exp(z[i] - mx);
  return mx + std::log(sum);
}

// s = (z - lse) + g(key) of the kLanes tokens at z, salts at salt: the one sequence of operations
// every exact perturbed score takes (perturbed_scores, pruned_best; the scalar paths do the same
// two float additions on gumbel()), so the paths that skip tokens agree bit for bit on the rest.
inline vec vscore(const float* z, vec lse, uint32_t key, const uint32_t* salt) {
  return vadd(vsub(vload(z), lse), vgumbel_salted(key, iload(salt)));
}

// s[i] = (z[i] - lse) + g(key)[i] for every token (padding stays -inf); returns the first argmax.
int64_t perturbed_scores(const std::vector<float>& z, int64_t V, float lse, uint32_t key, std::vector<float>& s) {
  const int64_t padded = static_cast<int64_t>(z.size());
  s.resize(padded);
  const vec vl = vset1(lse);
  vec best = vset1(kNegInf);
  const uint32_t* salt = salts(padded);
  for (int64_t j = 0; j < padded; j += kLanes) {
    const vec x = vscore(z.data() + j, vl, key, salt + j);
    vstore(s.data() + j, x);
    best = vmax(best, x);
  }
  for (int64_t j = V; j < padded; ++j) s[j] = kNegInf;
  const int64_t first = first_equal(s.data(), V, vmax_all(best));
  return first >= 0 ? first : 0;  // every score NaN: 0
}

// Bit l set where lane l of a is NaN.
inline uint32_t vmask_nan(vec a) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
#else
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
#endif
}

// What perturbed_scores returns (the first argmax of s = (z - lse) + g(key) over the first V
// tokens), with g computed only for the vectors of tokens that can reach the best score. s is
// computed exactly (perturbed_scores' operations) for the vector of token ``top`` (the largest
// z) first; its best lane is a floor under the answer. Then each vector's bound, (z - lse) +
// vgumbel_bound_salted, is compared with the floor, and only a vector with a lane above
// floor - kBoundSlack is scored exactly, raising the floor. A token skipped scores below the
// floor (kBoundSlack covers the rounding of g and of its bound, ~1e-6 at these magnitudes), so
// it is neither the argmax nor tied with it. A token passes with probability about twice its
// p e^-floor, so a row's vectors scored exactly are a few, where every token's g cost two
// logarithms. Demo oracle rows (8,192 tokens) on an AVX2 Zen 3, old and new builds alternating:
// a choice at T 1 took 31.6-32.2 us before and 13.7-14.0 us now, at T 0.8 / top-p 0.95 35.6-35.7
// and 17.7-17.9 us. Returns -1 for a row with a NaN (its rule is perturbed_scores' own).
constexpr float kBoundSlack = 1e-3f;

int64_t pruned_best(const std::vector<float>& z, int64_t V, float lse, uint32_t key, int64_t top) {
  const int64_t padded = static_cast<int64_t>(z.size());
  const uint32_t* salt = salts(padded);
  const vec vl = vset1(lse);
  int64_t best_id = -1;
  float best = kNegInf;
  auto score = [&](int64_t j) {  // the vector at j exactly; the padding past V stays out
    const vec x = vscore(z.data() + j, vl, key, salt + j);
    alignas(64) float lanes[kLanes];
    vstore(lanes, x);
    for (int64_t l = 0; l < kLanes && j + l < V; ++l)
      if (lanes[l] > best || (lanes[l] == best && j + l < best_id)) {
        best = lanes[l];
        best_id = j + l;
      }
  };
  const int64_t j0 = top / kLanes * kLanes;
  score(j0);
  uint32_t nan = 0;
  for (int64_t j = 0; j < padded; j += kLanes) {
    const vec d = vsub(vload(z.data() + j), vl);
    nan |= vmask_nan(d);
    if (j != j0 && vmask_gt(vadd(d, vgumbel_bound_salted(key, iload(salt + j))), best - kBoundSlack)) score(j);
  }
  return nan ? -1 : best_id;
}

// The least log p' vexp resolves: below it (p' < 1.2e-38) vprob gives 0.
constexpr float kProbFloor = -87.3365f;

// exp(z - lse) of kLanes tokens, the float32 precision of the torch reference's softmax; 0 below
// vexp's range (z - lse < kProbFloor, and -inf: masked tokens, the padding of a row).
inline vec vprob(vec z, vec lse) {
  const vec x = vsub(z, lse), e = vexp(x), lo = vset1(kProbFloor);
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), e);
#else
  return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), e);
#endif
}

inline bool ranks_before(float za, int64_t a, float zb, int64_t b) { return za > zb || (za == zb && a < b); }

// The k largest of z (ties to the smaller id), best first. For k <= 64 one pass keeps the best k
// so far in a heap whose root is the worst of them, and skips every vector of z whose largest
// entry cannot enter it (an insertion into a sorted buffer moved half of it each time: over 8192
// tokens, most of a top-k choice's time); else nth_element.
std::vector<int64_t> top_ids(const std::vector<float>& z, int64_t k) {
  const int64_t V = static_cast<int64_t>(z.size());
  k = std::min(k, V);
  if (k <= 64) {
    std::pair<float, int64_t> heap[64];
    int64_t filled = 0;
    // a ranks before b. Under this order a std heap's root is its largest entry: the worst kept.
    auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return ranks_before(a.first, a.second, b.first, b.second);
    };
    float thresh = kNegInf;
    auto offer = [&](int64_t j) {
      const float x = z[j];
      if (filled == k) {
        // j is larger than every id inside, so an equal value ranks after them all
        if (!(x > thresh)) return;
        std::pop_heap(heap, heap + k, better);
        heap[k - 1] = {x, j};
        std::push_heap(heap, heap + k, better);
      } else {
        if (x != x) return;  // NaN never enters (a sorted insertion skipped it the same way)
        heap[filled++] = {x, j};
        std::push_heap(heap, heap + filled, better);
      }
      if (filled == k) thresh = heap[0].first;
    };
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      if (filled < k) {
        for (int64_t u = 0; u < kLanes; ++u) offer(j + u);
        continue;
      }
      // only the lanes above the threshold, in order (it rises as they enter)
      for (uint32_t m = vmask_gt(vload(z.data() + j), thresh); m; m &= m - 1) offer(j + __builtin_ctz(m));
    }
    for (; j < V; ++j) offer(j);
    std::sort(heap, heap + filled, better);  // best first
    std::vector<int64_t> ids(filled);
    for (int64_t i = 0; i < filled; ++i) ids[i] = heap[i].second;
    return ids;
  }
  std::vector<int64_t> ids(V);
  std::iota(ids.begin(), ids.end(), 0);
  auto cmp = [&](int64_t a, int64_t b) { return ranks_before(z[a], a, z[b], b); };
  if (k < V) {
    std::nth_element(ids.begin(), ids.begin() + k, ids.end(), cmp);
    ids.resize(k);
  }
  std::sort(ids.begin(), ids.end(), cmp);
  return ids;
}

// The kept set of top-k then top-p over ids sorted best first (logp: log p' before the top-p cut,
// over those ids); returns how many stay.
int64_t top_p_cut(const std::vector<float>& logp, double top_p) {
  if (top_p >= 1.0) return static_cast<int64_t>(logp.size());
  double mass = 0.0;
  int64_t n = 0;
  for (float lp : logp) {
    if (mass >= top_p) break;
    mass += std::exp(static_cast<double>(lp));
    ++n;
  }
  return std::max<int64_t>(n, 1);
}

// The tokens a top-k rule keeps, before and after its top-p cut: z = row / T (into z, not
// padded), the k likeliest ids best first (top_ids), their log p' = z - lse into logp (lse over
// those k, summed in double) and how many of them the cut keeps (top_p_cut) into ``kept``.
// Returns lse. A sampled token (choose_row), a draft's children (perturbed_row) and beam
// sampling's p' (processed_row) take their kept set from here, so the three keep the same tokens.
float top_k_kept(const float* row, int64_t V, const Rule& rule, std::vector<float>& z, std::vector<int64_t>& ids,
                 std::vector<float>& logp, int64_t& kept) {
  z.resize(V);
  for (int64_t i = 0; i < V; ++i) z[i] = row[i] / rule.temperature;
  ids = top_ids(z, rule.top_k);
  const float mx = z[ids[0]];
  double sum = 0.0;
  for (int64_t id : ids) sum += std::exp(static_cast<double>(z[id] - mx));
  const float lse = mx + static_cast<float>(std::log(sum));
  logp.resize(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) logp[j] = z[ids[j]] - lse;
  kept = top_p_cut(logp, rule.top_p);
  return lse;
}

// Best of log p'(i) + g(i) over an explicit kept list, ties to the smaller id.
int64_t argmax_kept(const std::vector<int64_t>& ids, const std::vector<float>& logp, int64_t n, uint32_t key) {
  // ids are best first, so logp falls: stop once even the largest noise cannot catch up.
  int64_t best = -1;
  float best_s = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    if (best >= 0 && logp[j] + kGumbelMax < best_s) break;
    const float s = logp[j] + gumbel(key, ids[j]);
    if (best < 0 || s > best_s || (s == best_s && ids[j] < best)) {
      best = ids[j];
      best_s = s;
    }
  }
  return best;
}

// The probability mass ranked ahead of token i (larger z, or equal z and a smaller id) under
// softmax(z) = exp(z - lse); z is padded with -inf to whole vectors.
double mass_before(const std::vector<float>& z, int64_t i, float lse) {
  const float zi = z[i];
  const vec vzi = vset1(zi), vl = vset1(lse);
  vec acc = vzero();
  for (int64_t j = 0; j < static_cast<int64_t>(z.size()); j += kLanes) {  // padding is -inf: adds 0
    const vec x = vload(z.data() + j);
    const vec e = vexp(vsub(x, vl));
#if defined(__AVX512F__)
    acc = _mm512_mask_add_ps(acc, _mm512_cmp_ps_mask(x, vzi, _CMP_GT_OQ), acc, e);
#else
    acc = vadd(acc, _mm256_and_ps(_mm256_cmp_ps(x, vzi, _CMP_GT_OQ), e));
#endif
  }
  double before = vsum(acc);
  for (int64_t j = 0; j < i; ++j)  // equal probability, smaller id: ranked ahead too
    if (z[j] == zi) before += std::exp(static_cast<double>(z[j] - lse));
  return before;
}

// mass_before of several tokens, one pass over the row for each kAtOnce of them (their
// thresholds and sums stay in registers, or close): out[c] the mass ranked ahead of ids[c]. The ties
// (equal z, a smaller id) are folded into the vector loop, where mass_before adds them after it
// in double, so the two can round apart in the last bits. A draft's children under top-p test
// up to kk + 8 candidates outside the head it found the cut in: one pass each made four children
// cost 44-49 us a demo-draft row against 26-27 without the cut (AVX2 Zen 3).
void masses_before(const std::vector<float>& z, const std::vector<int64_t>& ids, float lse, std::vector<double>& out) {
  constexpr int kAtOnce = 8;
  const int64_t padded = static_cast<int64_t>(z.size());
  out.assign(ids.size(), 0.0);
  if (padded > (int64_t(1) << 24)) {  // a lane's index must be exact in float
    for (size_t c = 0; c < ids.size(); ++c) out[c] = mass_before(z, ids[c], lse);
    return;
  }
  const vec vl = vset1(lse);
  for (size_t c0 = 0; c0 < ids.size(); c0 += kAtOnce) {
    const int nc = static_cast<int>(std::min<size_t>(kAtOnce, ids.size() - c0));
    vec zc[kAtOnce], ic[kAtOnce], acc[kAtOnce];
    for (int c = 0; c < nc; ++c) {
      zc[c] = vset1(z[static_cast<size_t>(ids[c0 + c])]);
      ic[c] = vset1(static_cast<float>(ids[c0 + c]));
      acc[c] = vzero();
    }
    for (int64_t j = 0; j < padded; j += kLanes) {  // padding is -inf: adds 0
      const vec x = vload(z.data() + j);
      const vec e = vexp(vsub(x, vl));
      const vec lane = itof(iramp(j));
      for (int c = 0; c < nc; ++c) {
#if defined(__AVX512F__)
        const __mmask16 ahead = _mm512_cmp_ps_mask(x, zc[c], _CMP_GT_OQ) |
                                (_mm512_cmp_ps_mask(x, zc[c], _CMP_EQ_OQ) & _mm512_cmp_ps_mask(lane, ic[c], _CMP_LT_OQ));
        acc[c] = _mm512_mask_add_ps(acc[c], ahead, acc[c], e);
#else
        const __m256 ahead = _mm256_or_ps(_mm256_cmp_ps(x, zc[c], _CMP_GT_OQ),
                                          _mm256_and_ps(_mm256_cmp_ps(x, zc[c], _CMP_EQ_OQ),
                                                        _mm256_cmp_ps(lane, ic[c], _CMP_LT_OQ)));
        acc[c] = vadd(acc[c], _mm256_and_ps(ahead, e));
#endif
      }
    }
    for (int c = 0; c < nc; ++c) out[c0 + c] = vsum(acc[c]);
  }
}

// The token ranked right after ``prev`` by score (descending, ties to the smaller id) among the
// first V of sc, or -1 when none has a finite score.
int64_t next_ranked(const std::vector<float>& sc, int64_t V, int64_t prev) {
  const float sp = sc[prev];
  for (int64_t j = prev + 1; j < V; ++j)
    if (sc[j] == sp) return j;
  const vec vsp = vset1(sp), ninf = vset1(kNegInf);
  vec best = ninf;
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) {
    const vec x = vload(sc.data() + j);
#if defined(__AVX512F__)
    best = vmax(best, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vsp, _CMP_LT_OQ), ninf, x));
#else
    best = vmax(best, _mm256_blendv_ps(ninf, x, _mm256_cmp_ps(x, vsp, _CMP_LT_OQ)));
#endif
  }
  float mx = vmax_all(best);
  for (; j < V; ++j)
    if (sc[j] < sp) mx = std::max(mx, sc[j]);
  if (!(mx > kNegInf)) return -1;
  for (int64_t i = 0; i < V; ++i)
    if (sc[i] == mx) return i;
  return -1;
}

int64_t choose_row(const float* row, int64_t V, uint32_t key, const Rule& rule, std::vector<float>& z) {
  if (rule.greedy()) {  // the largest value in one vector pass, then its first index in another
    vec m = vset1(kNegInf);
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) m = vmax(m, vload(row + j));
    float mx = vmax_all(m);
    for (; j < V; ++j) mx = std::max(mx, row[j]);
    if (const int64_t first = first_equal(row, V, mx); first >= 0) return first;
    int64_t best = 0;  // NaN rows: the scalar rule
    for (int64_t i = 1; i < V; ++i)
      if (row[i] > row[best]) best = i;
    return best;
  }
  const bool sparse = rule.top_k > 0 && rule.top_k < V;
  if (sparse) {  // the best perturbed score among the kept (renormalising them is a shift: the same argmax)
    std::vector<int64_t> ids;
    std::vector<float> logp;
    int64_t n = 0;
    top_k_kept(row, V, rule, z, ids, logp, n);
    return argmax_kept(ids, logp, n, key);
  }
  float max_z = kNegInf;
  const float lse = scaled_row(row, V, rule.temperature, z, &max_z);
  const int64_t top = std::isfinite(lse) ? first_equal(z.data(), V, max_z) : -1;
  if (top >= 0) {  // the best perturbed score without most of the noise
    const int64_t best = pruned_best(z, V, lse, key, top);
    // Nothing is ranked ahead of the row's first argmax (no larger z, no equal z at a smaller
    // id): its mass before is 0 < top_p, and the pass over the row that sums it is skipped. The
    // argmax won 47% of the demo oracle's rows at T 0.8 / top-p 0.95 (768 rows of its sampled
    // text on held-out prompts); there a choice took 15.0-17.3 us a row against 16.3-17.6 before
    // (AVX2 Zen 3, the two builds alternating over 3 process pairs; the same tokens).
    if (best >= 0 && (rule.top_p >= 1.0 || best == top || mass_before(z, best, lse) < rule.top_p)) return best;
  }
  std::vector<float> sc;
  const int64_t best = perturbed_scores(z, V, lse, key, sc);
  if (rule.top_p >= 1.0) return best;
  // Top-p: the winner is the best-scored token that the cut keeps. Tokens are tried in the
  // order of their scores (ties to the smaller id); each is kept if the mass ranked ahead of it
  // is < top_p. The first is kept unless the noise lifted a token of the tail above the whole
  // nucleus, so this is one pass over the vocabulary, rarely a few: no sort, however many tokens
  // the nucleus holds (hundreds to thousands for a small model at T 0.8).
  for (int64_t cand = best, tries = 0; cand >= 0 && tries < 64; cand = next_ranked(sc, V, cand), ++tries)
    if (mass_before(z, cand, lse) < rule.top_p) return cand;
  // Pathological rows (NaN, or 64 tail tokens in a row): sort the likeliest tokens.
  z.resize(V);
  std::vector<int64_t> ids;
  std::vector<float> logp;
  int64_t n = 0;
  for (int64_t m = std::min<int64_t>(256, V);; m = V) {
    ids = top_ids(z, m);
    logp.resize(m);
    for (int64_t j = 0; j < m; ++j) logp[j] = z[ids[j]] - lse;
    n = top_p_cut(logp, rule.top_p);
    if (n < m || m == V) break;
  }
  int64_t winner = ids[0];
  for (int64_t j = 1; j < n; ++j)  // the kept tokens' scores, as computed above
    if (sc[ids[j]] > sc[winner] || (sc[ids[j]] == sc[winner] && ids[j] < winner)) winner = ids[j];
  return winner;
}

void check_logits(const torch::Tensor& t, const char* name) {
  SE_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  SE_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  SE_CHECK(t.is_contiguous(), name, " must be contiguous");
  SE_CHECK(t.dim() == 2 && t.size(1) >= 1, name, " must be (N, V) with V >= 1, got ", t.sizes());
}

Rule make_rule(double temperature, int64_t top_k, double top_p) {
  SE_CHECK(std::isfinite(temperature) && temperature >= 0, "temperature must be finite and >= 0, got ", temperature);
  SE_CHECK(top_k >= 0, "top_k must be >= 0, got ", top_k);
  SE_CHECK(top_p > 0 && top_p <= 1, "top_p must be in (0, 1], got ", top_p);
  return Rule{static_cast<float>(temperature), top_k, top_p};
}

}  // namespace

ChoiceRule choice_rule(double temperature, int64_t top_k, double top_p, uint64_t seed) {
  const Rule r = make_rule(temperature, top_k, top_p);
  return ChoiceRule{r.temperature, r.top_k, r.top_p, seed};
}

int64_t choose_at(const float* row, int64_t V, int64_t position, const ChoiceRule& rule, std::vector<float>& z) {
  return choose_row(row, V, noise_key(rule.seed, position), Rule{rule.temperature, rule.top_k, rule.top_p}, z);
}

// The choice for every row of logits (N, V): row r chooses the token at positions[r].
std::vector<int64_t> choose_rows(const torch::Tensor& logits, uint64_t seed, const std::vector<int64_t>& positions,
                                 double temperature, int64_t top_k, double top_p) {
  check_logits(logits, "logits");
  const Rule rule = make_rule(temperature, top_k, top_p);
  const int64_t N = logits.size(0), V = logits.size(1);
  SE_CHECK(static_cast<int64_t>(positions.size()) == N, "positions must hold one entry per row (", N, "), got ",
           positions.size());
  std::vector<int64_t> out(N);
  std::vector<float> z;
  const float* p = logits.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) out[r] = choose_row(p + r * V, V, noise_key(seed, positions[r]), rule, z);
  return out;
}

// ALGORITHMS.md sec. 4 over a tree of N nodes: node 0 is the root, parents[i] < i, node i's
// logits row chooses the token at positions[i] + 1. Returns (accepted path, emitted tokens).
std::pair<std::vector<int64_t>, std::vector<int64_t>> verify_tree(
    const torch::Tensor& logits, const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
    uint64_t seed, const std::vector<int64_t>& positions, double temperature, int64_t top_k, double top_p) {
  check_logits(logits, "logits");
  const Rule rule = make_rule(temperature, top_k, top_p);
  const int64_t N = logits.size(0), V = logits.size(1);
  SE_CHECK(static_cast<int64_t>(tokens.size()) == N && static_cast<int64_t>(parents.size()) == N &&
               static_cast<int64_t>(positions.size()) == N,
           "tokens, parents and positions must hold one entry per logits row (", N, "), got ", tokens.size(), ", ",
           parents.size(), ", ", positions.size());
  SE_CHECK(N >= 1 && parents[0] == -1, "node 0 must be the root (parent -1)");
  for (int64_t i = 1; i < N; ++i)
    SE_CHECK(parents[i] >= 0 && parents[i] < i, "parents[", i, "] must be in [0, ", i, "), got ", parents[i]);
  std::vector<int64_t> path{0}, emitted;
  std::vector<float> z;
  const float* p = logits.data_ptr<float>();
  int64_t node = 0;
  while (true) {
    const int64_t y = choose_row(p + node * V, V, noise_key(seed, positions[node] + 1), rule, z);
    emitted.push_back(y);
    int64_t child = -1;
    for (int64_t i = node + 1; i < N; ++i)
      if (parents[i] == node && tokens[i] == y) {
        child = i;
        break;
      }
    if (child < 0) return {path, emitted};
    path.push_back(child);
    node = child;
  }
}

// The k best children of a dense row by s = log p' + g, best first (ties to the smaller id),
// and log sum_i e^(s_i), without g for every token: e^s = p' e^g = p' / (-log u), so the sum
// takes one logarithm a token where g takes two and e^s an exponential, and the best scores are
// those of the best ratios p' / (-log u). Their exact s (as perturbed_scores computes it) is then
// computed for the k + 2 best ratios and ranked: the ratio and the float s round differently,
// so two scores within rounding could trade places, never two further apart. The sum equals
// sum_i e^(s_i - max) e^max in exact arithmetic and rounds differently in float: log r moved by
// at most 3e-6 over 504 test rows. Demo oracle rows (8,192 tokens), AVX2 Zen 3, one child, old
// and new builds alternating twice: 37.0-38.2 us became 28.2-28.5. Returns false (the caller
// takes perturbed_scores' path) for a row with a NaN, and for one so peaked that a candidate
// scores within reach of tokens whose p' underflowed.
bool children_by_ratio(const std::vector<float>& z, int64_t V, float lse, uint32_t key, int64_t k,
                       std::vector<float>& q, std::vector<std::pair<float, int64_t>>& cand, float& norm) {
  const int64_t padded = static_cast<int64_t>(z.size());
  q.resize(padded);
  const uint32_t* salt = salts(padded);
  const vec vl = vset1(lse);
  vec acc = vzero();
  uint32_t nan = 0;
  for (int64_t j = 0; j < padded; j += kLanes) {  // the padding's p' is 0
    const vec zj = vload(z.data() + j);
    nan |= vmask_nan(zj);
    const vec ratio = vdiv(vprob(zj, vl), vsub(vzero(), vlog(vuniform_salted(key, iload(salt + j)))));
    vstore(q.data() + j, ratio);
    acc = vadd(acc, ratio);
  }
  if (nan) return false;
  norm = static_cast<float>(std::log(static_cast<double>(vsum(acc))));
  q.resize(V);
  cand.clear();
  for (int64_t id : top_ids(q, std::min(k + 2, V))) cand.emplace_back(z[id] - lse + gumbel(key, id), id);
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  // A token whose p' underflowed (log p' < kProbFloor) has ratio 0 and is ranked by id among the
  // others alike; its s is below kProbFloor + kGumbelMax, so the ranking holds only where every
  // candidate kept scores above that.
  if (!(cand.back().first > kProbFloor + kGumbelMax)) return false;
  cand.resize(std::min<int64_t>(k, static_cast<int64_t>(cand.size())));
  return std::isfinite(norm);
}

namespace {

// One row of perturbed_children: its kk best children (ids to ip, log r to lp; -inf past the
// candidates). ``z``, ``sc`` and ``cand``: scratch.
void perturbed_row(const float* row, int64_t V, const Rule& rule, uint32_t key, int64_t kk, int64_t* ip, float* lp,
                   std::vector<float>& z, std::vector<float>& sc, std::vector<std::pair<float, int64_t>>& cand) {
  const bool sparse = rule.top_k > 0 && rule.top_k < V;
  const bool cut = rule.top_p < 1.0;
  const auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  // The children: cand[0 .. n) best first, log r = score - norm; the rest -inf.
  const auto fill = [&](int64_t n, float norm) {
    for (int64_t c = 0; c < kk; ++c) {
      const bool have = c < n;
      ip[c] = have ? cand[c].second : 0;
      lp[c] = have ? cand[c].first - norm : kNegInf;
    }
  };
  cand.clear();
  if (sparse) {
    std::vector<int64_t> ids;
    std::vector<float> logp;
    int64_t kept = 0;  // the top-p cut over the top-k, choose_row's: the first ``kept`` ids
    const float lse = top_k_kept(row, V, rule, z, ids, logp, kept);
    for (int64_t id : ids) cand.emplace_back(z[id] - lse + gumbel(key, id), id);
    float mx = kNegInf;  // log r's normaliser: every token the top-k keeps
    for (auto& c : cand) mx = std::max(mx, c.first);
    double total = 0.0;
    for (auto& c : cand) total += std::exp(static_cast<double>(c.first - mx));
    const float norm = mx + static_cast<float>(std::log(total));
    cand.resize(kept);  // the children: the tokens the cut keeps
    const int64_t take = std::min<int64_t>(kk, kept);
    std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), better);
    fill(take, norm);
    return;
  }
  const float lse = scaled_row(row, V, rule.temperature, z);
  const int64_t want = cut ? std::min<int64_t>(kk + 6, V) : kk;
  // Whether token id survives the cut: the mass ranked ahead of it is < top_p (choose_row's test,
  // so that best_child_token's choice is this row's best child). The likeliest candidates by
  // perturbed score almost always survive it, so children_by_ratio offers a few more than kk and
  // the first kk kept are the children.
  const auto kept_by_cut = [&](int64_t id) { return !cut || mass_before(z, id, lse) < rule.top_p; };
  // Where they do not (a row so peaked that the cut keeps fewer tokens than that), its
  // ``want`` likeliest tokens hold the cut: the first ``nucleus`` of them are every token it
  // keeps. -1: the cut keeps more. The tokens ranked ahead of head[j] are head[0 .. j), so the
  // mass ahead of each is a running sum over the head (top_p_cut's, in double, as choose_row
  // cuts its sorted tokens) instead of a pass over the row per test (a bisection took up to
  // four; the candidates' tests below were what cost).
  std::vector<int64_t> head;
  const auto find_nucleus = [&]() -> int64_t {
    head = top_ids(z, want);  // the padding is -inf: it ranks after every token of the row
    double mass = 0.0;
    for (size_t j = 0; j < head.size(); ++j) {
      if (j > 0 && mass >= rule.top_p) return static_cast<int64_t>(j);  // head[0] is always kept
      mass += std::exp(static_cast<double>(z[head[j]] - lse));
    }
    return -1;
  };
  int64_t nucleus = -1;
  const auto children_of_nucleus = [&](const auto& score) {
    cand.clear();
    for (int64_t j = 0; j < nucleus; ++j) cand.emplace_back(score(head[j]), head[j]);
    const int64_t take = std::min<int64_t>(kk, nucleus);
    std::partial_sort(cand.begin(), cand.begin() + take, cand.end(), better);
    cand.resize(take);
  };
  float sum_norm = 0.f;
  if (std::isfinite(lse) && children_by_ratio(z, V, lse, key, want, sc, cand, sum_norm)) {
    // One child: test the candidates (the first is kept ~top_p of the time). Several: find the
    // cut among the head first (a test or, in a peaked row, a few), so that the candidates
    // inside a head the cut keeps whole need none.
    bool searched = false;
    if (cut && kk > 1) {
      nucleus = find_nucleus();
      searched = true;
    }
    if (nucleus < 0) {
      const int64_t seen = static_cast<int64_t>(cand.size());
      const auto in_head = [&](int64_t id) { return std::find(head.begin(), head.end(), id) != head.end(); };
      // Several children: the head is kept whole, and the candidates outside it are tested at
      // once, in one pass (masses_before). One child: each in turn, the first kept (~top_p of
      // the time) ending the tests.
      std::vector<int64_t> outside;
      std::vector<double> ahead;
      if (searched) {
        for (int64_t c = 0; c < seen; ++c)
          if (!in_head(cand[c].second)) outside.push_back(cand[c].second);
        masses_before(z, outside, lse, ahead);
      }
      size_t next_outside = 0;
      const auto kept = [&](int64_t id) {
        if (!searched) return kept_by_cut(id);
        return in_head(id) || ahead[next_outside++] < rule.top_p;  // outside: in the candidates' order
      };
      int64_t n = 0;
      for (int64_t c = 0; c < seen && n < kk; ++c)
        if (kept(cand[c].second)) cand[n++] = cand[c];
      if (n == kk || seen == V || !cut) {
        fill(std::min<int64_t>(n, kk), sum_norm);
        return;
      }
      if (!searched) nucleus = find_nucleus();
    }
    if (nucleus >= 0) {
      children_of_nucleus([&](int64_t id) { return z[id] - lse + gumbel(key, id); });
      fill(static_cast<int64_t>(cand.size()), sum_norm);
      return;
    }
  } else if (cut && std::isfinite(lse)) {
    nucleus = find_nucleus();
  }
  // Every token's perturbed score: a row with a NaN, one so peaked that children_by_ratio cannot
  // rank it, or a wide cut that left fewer than kk of its candidates.
  cand.clear();
  perturbed_scores(z, V, lse, key, sc);
  sc.resize(V);
  if (!cut) {
    for (int64_t id : top_ids(sc, kk)) cand.emplace_back(sc[id], id);
  } else if (nucleus >= 0) {
    children_of_nucleus([&](int64_t id) { return sc[id]; });
  } else {  // best first (ties to the smaller id) while the cut keeps them, up to 64 + kk tried
    int64_t id = first_equal(sc.data(), V, *std::max_element(sc.begin(), sc.end()));
    for (int64_t tries = 0; id >= 0 && static_cast<int64_t>(cand.size()) < kk && tries < 64 + kk; ++tries) {
      if (kept_by_cut(id)) cand.emplace_back(sc[id], id);
      id = next_ranked(sc, V, id);
    }
  }
  const float top = cand.empty() ? kNegInf : cand[0].first;
  const vec vmx = vset1(top);
  vec acc = vzero();
  int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes) acc = vadd(acc, vexp(vsub(vload(sc.data() + j), vmx)));
  double total = vsum(acc);
  for (; j < V; ++j) total += std::exp(static_cast<double>(sc[j] - top));
  fill(static_cast<int64_t>(cand.size()), top + static_cast<float>(std::log(total)));
}

}  // namespace

// The draft's children of each row at T > 0: the k best tokens by the perturbed score
// s = log p' + g among the tokens the rule keeps (its top-k, then its top-p cut: the oracle's own
// rule on the draft's logits), and log r = s - logsumexp(s) over the tokens the top-k keeps (the
// cut picks the children, it does not renormalise r; over a whole row, the tokens that matter:
// those within kGumbelMax + 30 of the best, the rest weigh < e^-30).
std::vector<torch::Tensor> perturbed_children(const torch::Tensor& logits, uint64_t seed,
                                              const std::vector<int64_t>& positions, double temperature,
                                              int64_t top_k, int64_t k, double top_p) {
  check_logits(logits, "logits");
  const Rule rule = make_rule(temperature, top_k, top_p);
  SE_CHECK(!rule.greedy(), "perturbed_children needs temperature > 0");
  const int64_t N = logits.size(0), V = logits.size(1);
  SE_CHECK(static_cast<int64_t>(positions.size()) == N, "positions must hold one entry per row (", N, "), got ",
           positions.size());
  SE_CHECK(k >= 1 && k <= 64, "k must be in [1, 64], got ", k);
  const bool sparse = rule.top_k > 0 && rule.top_k < V;
  const int64_t kk = std::min(k, sparse ? rule.top_k : V);
  auto idx = torch::empty({N, kk}, torch::dtype(torch::kInt64));
  auto logr = torch::empty({N, kk}, torch::dtype(torch::kFloat32));
  int64_t* ip = idx.data_ptr<int64_t>();
  float* lp = logr.data_ptr<float>();
  const float* p = logits.data_ptr<float>();
  std::vector<float> z, sc;
  std::vector<std::pair<float, int64_t>> cand;
  for (int64_t r = 0; r < N; ++r)
    perturbed_row(p + r * V, V, rule, noise_key(seed, positions[r]), kk, ip + r * kk, lp + r * kk, z, sc, cand);
  return {idx, logr};
}

DraftChoice draft_choice(double temperature, int64_t top_k, double top_p, uint64_t seed) {
  if (temperature == 0) return DraftChoice{0.f, 0, 1.0, seed};
  const Rule rule = make_rule(temperature, top_k, top_p);
  return DraftChoice{rule.temperature, rule.top_k, rule.top_p, seed};
}

void best_child(const float* row, int64_t V, int64_t position, const DraftChoice& choice, DraftScratch& s,
                int64_t& token, float& logr) {
  if (choice.temperature == 0.f) {
    top_row(row, V, 1, &token, &logr);
    return;
  }
  perturbed_row(row, V, Rule{choice.temperature, choice.top_k, choice.top_p}, noise_key(choice.seed, position), 1, &token,
                &logr, s.z, s.sc, s.cand);
}

void best_child_token(const float* row, int64_t V, int64_t position, const DraftChoice& choice, DraftScratch& s,
                      int64_t& token, float& logr) {
  if (choice.temperature == 0.f) {
    top_row(row, V, 1, &token, &logr);
    return;
  }
  token = choose_row(row, V, noise_key(choice.seed, position),
                     Rule{choice.temperature, choice.top_k, choice.top_p}, s.z);
  logr = std::isfinite(s.z[static_cast<size_t>(token)]) ? 0.f : kNegInf;
}

namespace {
// A cache entry's bits, whatever its float type: the moves copy them as they are.
template <typename T>
T* entries(torch::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// k and v of one cache, as the moves below take them: contiguous CPU tensors (L, B, H, S, D) of
// one float type (float32 or float16) and one shape.
void check_kv_pair(const torch::Tensor& k, const torch::Tensor& v) {
  for (const torch::Tensor* t : {&k, &v}) {
    SE_CHECK(t->device().is_cpu() && (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kHalf) &&
                 t->is_contiguous() && t->dim() == 5,
             "k and v must be contiguous float32 or float16 CPU tensors (L, B, H, S, D)");
  }
  SE_CHECK(k.scalar_type() == v.scalar_type(), "k and v must have one dtype, got ", k.scalar_type(), " and ",
           v.scalar_type());
  SE_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, got ", k.sizes(), " and ", v.sizes());
}

template <typename T>
void kv_move_entries(torch::Tensor& k, torch::Tensor& v, int64_t row, int64_t start, const std::vector<int64_t>& path) {
  const int64_t L = k.size(0), B = k.size(1), H = k.size(2), S = k.size(3), D = k.size(4);
  for (torch::Tensor* t : {&k, &v}) {
    T* base = entries<T>(*t);
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h) {
        T* slots = base + (((l * B + row) * H + h) * S + start) * D;
        for (size_t m = 0; m < path.size(); ++m)
          if (path[m] != static_cast<int64_t>(m)) std::copy_n(slots + path[m] * D, D, slots + m * D);
      }
  }
}
}  // namespace

// Keep the pending entries ``path`` of one cache row: entry at slot start + path[m] moves to slot
// start + m in every layer and head of k and v, (L, B, H, S, D) float32 or float16 (path[m] >= m,
// increasing).
void kv_move(torch::Tensor& k, torch::Tensor& v, int64_t row, int64_t start, const std::vector<int64_t>& path) {
  check_kv_pair(k, v);
  const int64_t B = k.size(1), S = k.size(3);
  SE_CHECK(row >= 0 && row < B, "row must be in [0, ", B, "), got ", row);
  SE_CHECK(!path.empty() && start >= 0, "path must be non-empty and start >= 0");
  for (size_t m = 0; m < path.size(); ++m) {
    SE_CHECK(path[m] >= static_cast<int64_t>(m) && (m == 0 || path[m] > path[m - 1]),
             "path must be strictly increasing with path[m] >= m, got ", path[m], " at ", m);
  }
  SE_CHECK(start + path.back() < S, "path reaches slot ", start + path.back(), " of ", S);
  if (k.scalar_type() == torch::kHalf) kv_move_entries<uint16_t>(k, v, row, start, path);
  else kv_move_entries<float>(k, v, row, start, path);
}

// Beam reselection's row copies as one parallel move: row i <- row sources[i] over slots
// [lows[i], span) in every layer and head of k and v (L, B, H, S, D) float32 or float16, for each i with
// sources[i] != i. A row is overwritten only once no copy still to come reads it; in a cycle (a
// swap), where every row left is read by exactly one other, one row's slots are saved aside first.
// As KVCache.reselect's Python copies, without a torch operator and two strided views per row: at
// 8 beams those took ~0.3 ms a step, a tenth of the demo oracle's pass over the 8 rows.
void kv_copy_rows(torch::Tensor& k, torch::Tensor& v, const std::vector<int64_t>& sources,
                  const std::vector<int64_t>& lows, int64_t span) {
  check_kv_pair(k, v);
  const int64_t L = k.size(0), B = k.size(1), H = k.size(2), S = k.size(3), D = k.size(4);
  const int64_t W = static_cast<int64_t>(sources.size());
  SE_CHECK(W <= B, "sources must name at most ", B, " rows, got ", W);
  SE_CHECK(static_cast<int64_t>(lows.size()) == W, "lows must hold one slot per source (", W, "), got ", lows.size());
  SE_CHECK(span >= 0 && span <= S, "span must be in [0, ", S, "], got ", span);
  for (int64_t i = 0; i < W; ++i) {
    SE_CHECK(sources[i] >= 0 && sources[i] < B, "sources[", i, "] must be a row in [0, ", B, "), got ", sources[i]);
    SE_CHECK(lows[i] >= 0 && lows[i] <= span, "lows[", i, "] must be in [0, ", span, "], got ", lows[i]);
  }
  // The copies move each entry's bits, whatever its float type.
  auto copy = [&](auto tag) {
    using T = decltype(tag);
    T* bases[2] = {entries<T>(k), entries<T>(v)};
    auto at = [&](T* base, int64_t l, int64_t row, int64_t h) { return base + ((l * B + row) * H + h) * S * D; };
    std::vector<int64_t> todo, readers(B, 0);  // destinations left; copies left that read each row
    for (int64_t i = 0; i < W; ++i)
      if (sources[i] != i && lows[i] < span) {
        todo.push_back(i);
        ++readers[sources[i]];
      }
    std::vector<T> saved;  // a cycle's row, (2, L, H, span - low, D)
    int64_t saved_for = -1;  // the destination that reads ``saved`` instead of its source
    while (!todo.empty()) {
      auto it = std::find_if(todo.begin(), todo.end(), [&](int64_t i) { return readers[i] == 0; });
      if (it == todo.end()) {  // a cycle: save todo[0]'s slots for the one copy that reads them
        const int64_t row = todo.front();
        const auto reader = std::find_if(todo.begin(), todo.end(), [&](int64_t j) { return sources[j] == row; });
        SE_CHECK(reader != todo.end() && saved_for < 0, "kv_copy_rows: no free destination and no cycle");
        const int64_t j = *reader, n = (span - lows[j]) * D;
        saved.resize(static_cast<size_t>(2 * L * H * n));
        for (int t = 0; t < 2; ++t)
          for (int64_t l = 0; l < L; ++l)
            for (int64_t h = 0; h < H; ++h)
              std::copy_n(at(bases[t], l, row, h) + lows[j] * D, n, saved.data() + ((t * L + l) * H + h) * n);
        saved_for = j;
        --readers[row];
        continue;
      }
      const int64_t i = *it, src = sources[i], n = (span - lows[i]) * D;
      todo.erase(it);
      for (int t = 0; t < 2; ++t)
        for (int64_t l = 0; l < L; ++l)
          for (int64_t h = 0; h < H; ++h) {
            const T* from = i == saved_for ? saved.data() + ((t * L + l) * H + h) * n : at(bases[t], l, src, h) + lows[i] * D;
            std::copy_n(from, n, at(bases[t], l, i, h) + lows[i] * D);
          }
      if (i == saved_for)
        saved_for = -1;
      else
        --readers[src];
    }
  };
  if (k.scalar_type() == torch::kHalf) copy(uint16_t{}); else copy(float{});
}

namespace {

// Top-p over a whole row without ranking it: the kept set is every token whose mass ranked ahead
// of it (larger z, or equal z and a smaller id) is < top_p. Tokens go to buckets of z below the
// row's largest (equal z, one bucket; a higher bucket ranks wholly ahead of a lower one), each
// bucket's mass is summed, and the bucket where the running mass reaches top_p is the only one
// ranked token by token. Masses are vprob's, as at top-p 1, summed in float64; only the order of the
// sums differs from a full ranking's. Before, a nucleus of thousands of tokens (a small model at
// T 0.8) ranked the row in growing prefixes, ~150 us of a row's time. z is padded with -inf to
// whole vectors (scaled_row) and holds V tokens. out: zeros, then p' of the kept tokens.
void top_p_buckets(const float* z, int64_t V, float lse, double top_p, double* out) {
  constexpr int kBuckets = 1024;
  const int64_t padded = (V + kLanes - 1) / kLanes * kLanes;
  const vec ninf = vset1(-std::numeric_limits<float>::infinity()), pinf = vset1(std::numeric_limits<float>::infinity());
  vec vhi = ninf, vlo = pinf;
  for (int64_t i = 0; i < padded; i += kLanes) {  // -inf (the padding too) has no mass: not the lowest
    const vec x = vload(z + i);
    vhi = vmax(vhi, x);
#if defined(__AVX512F__)
    vlo = vmin(vlo, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_EQ_OQ), x, pinf));
#else
    vlo = vmin(vlo, _mm256_blendv_ps(x, pinf, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ)));
#endif
  }
  const float hi = vmax_all(vhi), lo = vmin_all(vlo);
  // Buckets span [hi - range, hi]; lower z (and -inf: no mass) go to the last.
  const float range = std::min(64.f, std::max(hi - lo, 1e-3f));
  const vec vscale = vset1(static_cast<float>(kBuckets - 1) / range), vtop = vset1(static_cast<float>(kBuckets - 1));
  const vec vl = vset1(lse), vh = vset1(hi);
  thread_local std::vector<float> mass_tl;
  thread_local std::vector<int32_t> bucket_tl;
  mass_tl.resize(padded);
  bucket_tl.resize(padded);
  float* mass = mass_tl.data();
  int32_t* bucket = bucket_tl.data();
  for (int64_t i = 0; i < padded; i += kLanes) {
    const vec x = vload(z + i);
    vstore(mass + i, vprob(x, vl));
    alignas(64) float b[kLanes];
    vstore(b, vmin(vmul(vsub(vh, x), vscale), vtop));  // +inf for -inf: the last bucket
    for (int l = 0; l < kLanes; ++l) bucket[i + l] = static_cast<int32_t>(b[l]);
  }
  double bucket_mass[kBuckets] = {0.0};
  for (int64_t i = 0; i < V; ++i) bucket_mass[bucket[i]] += mass[i];
  double ahead = 0.0;
  int cut = 0;
  for (; cut < kBuckets; ++cut) {
    if (ahead + bucket_mass[cut] >= top_p) break;
    ahead += bucket_mass[cut];
  }
  // Tokens of buckets before ``cut`` are kept; the cut bucket's are ranked and kept while the mass
  // ahead of them is < top_p (the first token of the row always is: nothing is ahead of it).
  std::vector<int64_t> ranked;
  double kept = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    if (bucket[i] < cut) kept += mass[i];
    else if (bucket[i] == cut) ranked.push_back(i);
  }
  std::sort(ranked.begin(), ranked.end(), [&](int64_t a, int64_t b) { return ranks_before(z[a], a, z[b], b); });
  size_t n = 0;
  for (double before = ahead; n < ranked.size() && before < top_p; ++n) {
    kept += mass[ranked[n]];
    before += mass[ranked[n]];
  }
  for (int64_t i = 0; i < V; ++i)
    if (bucket[i] < cut) out[i] = mass[i] / kept;
  for (size_t j = 0; j < n; ++j) out[ranked[j]] = mass[ranked[j]] / kept;
}

// p'(. | row) of one row into out[0, V) (float64): the one-hot of the first argmax at T = 0;
// else softmax(row / T), top-k, then top-p, renormalised over the kept tokens (the rest 0). The
// kept set is sampling.py's: the tokens ranked (by probability, ties to the smaller id) so that
// the mass ranked ahead of each is < top_p. Top-k ranks its k (top_ids); top-p alone cuts the
// row by buckets (top_p_buckets), where torch.sort ranks all of it (~0.5 ms a row of 8192 here).
void processed_row(const float* row, int64_t V, const Rule& rule, std::vector<float>& z, double* out) {
  std::fill(out, out + V, 0.0);
  if (rule.greedy()) {  // the choice's own argmax (no noise is drawn at T = 0)
    out[choose_row(row, V, 0, rule, z)] = 1.0;
    return;
  }
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(row[i])) {  // no distribution (torch's softmax gives NaN too)
      std::fill(out, out + V, std::numeric_limits<double>::quiet_NaN());
      return;
    }
  const bool sparse = rule.top_k > 0 && rule.top_k < V;  // top-k ranks its k once, below
  std::vector<int64_t> ids;
  std::vector<float> logp;
  int64_t n = 0;
  if (sparse) {
    top_k_kept(row, V, rule, z, ids, logp, n);
  } else {
    const float lse = scaled_row(row, V, rule.temperature, z);
    if (!std::isfinite(lse)) {  // infinite logits: no distribution either
      std::fill(out, out + V, std::numeric_limits<double>::quiet_NaN());
      return;
    }
    if (rule.top_p >= 1.0) {
      // vprob over whole vectors (z is padded with -inf), widened: a scalar double exp per token
      // took 60 of a row's 90 us.
      const vec vl = vset1(lse);
      alignas(64) float lanes[kLanes];
      for (int64_t i = 0; i < V; i += kLanes) {
        vstore(lanes, vprob(vload(z.data() + i), vl));
        const int64_t m = std::min<int64_t>(kLanes, V - i);
        for (int64_t l = 0; l < m; ++l) out[i + l] = lanes[l];
      }
      z.resize(V);
      return;
    }
    top_p_buckets(z.data(), V, lse, rule.top_p, out);  // z still padded
    z.resize(V);
    return;
  }
  // Top-k (then top-p over its k, already ranked best first).
  double kept = 0.0;
  for (int64_t j = 0; j < n; ++j) kept += std::exp(static_cast<double>(logp[j]));
  for (int64_t j = 0; j < n; ++j) out[ids[j]] = std::exp(static_cast<double>(logp[j])) / kept;
}

}  // namespace

// The processed distribution p' of every row of logits (N, V), float64 (N, V): beam sampling's
// conditionals (beam/decoders.py), the torch reference being sampling.processed_probs.
torch::Tensor processed_probs(const torch::Tensor& logits, double temperature, int64_t top_k, double top_p) {
  check_logits(logits, "logits");
  const Rule rule = make_rule(temperature, top_k, top_p);
  const int64_t N = logits.size(0), V = logits.size(1);
  torch::Tensor out = torch::empty({N, V}, torch::kFloat64);
  const float* p = logits.data_ptr<float>();
  double* o = out.data_ptr<double>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> z;
    for (int64_t r = r0; r < r1; ++r) processed_row(p + r * V, V, rule, z, o + r * V);
  });
  return out;
}

// Beam sampling's joint over (beam, token) pairs (beam/core.py beam_joint, whose torch code is the
// reference): S(b_i) p(v | b_i) at i * V + v with S(b_i) = exp(log_scores[i] - the largest finite
// one), divided by its sum when that is positive; all zeros when no score is finite. float64.
// One native call instead of nine torch operators over a few beams' 8,192-token rows: after a
// forward pass has streamed the weights through the caches, each operator's dispatch cost
// 30-50 us, more than the arithmetic.
torch::Tensor beam_joint(const torch::Tensor& log_scores, const torch::Tensor& probs) {
  SE_CHECK(log_scores.device().is_cpu() && log_scores.scalar_type() == torch::kFloat64 && log_scores.dim() == 1,
           "log_scores must be a 1-D float64 CPU tensor, got ", log_scores.scalar_type(), " ", log_scores.sizes());
  SE_CHECK(probs.device().is_cpu() && probs.scalar_type() == torch::kFloat64 && probs.dim() == 2 &&
               probs.size(0) == log_scores.size(0),
           "probs must be a float64 CPU tensor (W, V) with W = ", log_scores.size(0), " rows, got ",
           probs.scalar_type(), " ", probs.sizes());
  const torch::Tensor ls = log_scores.contiguous(), pr = probs.contiguous();
  const int64_t W = pr.size(0), V = pr.size(1);
  const double* l = ls.data_ptr<double>();
  double mx = -std::numeric_limits<double>::infinity();
  bool any = false;
  for (int64_t i = 0; i < W; ++i)
    if (std::isfinite(l[i])) {
      mx = any ? std::max(mx, l[i]) : l[i];
      any = true;
    }
  if (!any) return torch::zeros({W * V}, torch::kFloat64);
  torch::Tensor out = torch::empty({W * V}, torch::kFloat64);
  const double* p = pr.data_ptr<double>();
  double* o = out.data_ptr<double>();
  // Eight running sums in two 4-lane vectors: no chain of dependent adds.
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  double tail = 0.0;
  for (int64_t i = 0; i < W; ++i) {
    const double w = std::exp(l[i] - mx);  // -inf -> 0
    const __m256d vw = _mm256_set1_pd(w);
    const double* pi = p + i * V;
    double* oi = o + i * V;
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
      const __m256d a = _mm256_mul_pd(vw, _mm256_loadu_pd(pi + v)), b = _mm256_mul_pd(vw, _mm256_loadu_pd(pi + v + 4));
      _mm256_storeu_pd(oi + v, a);
      _mm256_storeu_pd(oi + v + 4, b);
      acc0 = _mm256_add_pd(acc0, a);
      acc1 = _mm256_add_pd(acc1, b);
    }
    for (; v < V; ++v) tail += (oi[v] = w * pi[v]);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(acc0, acc1));
  const double total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + tail;
  if (total > 0.0) {  // divided, as the reference divides (not a multiply by 1 / total)
    const __m256d vt = _mm256_set1_pd(total);
    int64_t c = 0;
    for (; c + 4 <= W * V; c += 4) _mm256_storeu_pd(o + c, _mm256_div_pd(_mm256_loadu_pd(o + c), vt));
    for (; c < W * V; ++c) o[c] /= total;
  }
  return out;
}

// ``num`` draws by inverse CDF (beam/core.py TorchRandom.categorical, whose torch code is the
// reference): for each u, the first index whose running sum of probs exceeds u times the total
// (a zero-mass entry is never drawn), or, where u * total rounded up to the total, the last
// entry of positive mass. probs (n,) float64 of positive total (else an error, as torch's clamp to
// the last positive entry would fail), u (num,) float64 in [0, 1).
std::vector<int64_t> inverse_cdf(const torch::Tensor& probs, const torch::Tensor& u) {
  SE_CHECK(probs.device().is_cpu() && probs.scalar_type() == torch::kFloat64 && probs.dim() == 1 && probs.size(0) >= 1,
           "probs must be a non-empty 1-D float64 CPU tensor, got ", probs.scalar_type(), " ", probs.sizes());
  SE_CHECK(u.device().is_cpu() && u.scalar_type() == torch::kFloat64 && u.dim() == 1,
           "u must be a 1-D float64 CPU tensor, got ", u.scalar_type(), " ", u.sizes());
  const torch::Tensor pr = probs.contiguous(), uc = u.contiguous();
  const int64_t n = pr.size(0);
  const double* p = pr.data_ptr<double>();
  thread_local std::vector<double> cdf;
  cdf.resize(static_cast<size_t>(n));
  double run = 0.0;
  int64_t last_positive = -1;
  for (int64_t i = 0; i < n; ++i) {
    run += p[i];
    cdf[i] = run;
    if (p[i] > 0) last_positive = i;
  }
  SE_CHECK(cdf[n - 1] > 0, "probs must have positive mass (non-negative entries, not NaN), got a total of ",
           cdf[n - 1]);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(uc.size(0)));
  const double* up = uc.data_ptr<double>();
  for (int64_t j = 0; j < uc.size(0); ++j) {
    const double target = up[j] * cdf[n - 1];
    int64_t index = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
    if (index >= n) index = last_positive;  // >= 0: the total is positive
    out.push_back(index);
  }
  return out;
}

void register_sampling(pybind11::module& m) {
  m.def("choose_rows", &choose_rows, "the sampling rule's choice for each row of logits", py::arg("logits"),
        py::arg("seed"), py::arg("positions"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
  m.def("verify_tree", &verify_tree, "the acceptance walk over a tree's logits: (path, emitted)",
        py::arg("logits"), py::arg("tokens"), py::arg("parents"), py::arg("seed"), py::arg("positions"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
  m.def("perturbed_children", &perturbed_children,
        "the draft's k best children by perturbed score among the tokens the rule keeps, and log r",
        py::arg("logits"), py::arg("seed"), py::arg("positions"), py::arg("temperature"), py::arg("top_k"),
        py::arg("k"), py::arg("top_p") = 1.0);
  m.def("processed_probs", &processed_probs, "the processed distribution p' of each row of logits, float64",
        py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
  m.def("beam_joint", &beam_joint, "beam sampling's joint over (beam, token): S(b_i) p(v | b_i), normalised, float64",
        py::arg("log_scores"), py::arg("probs"));
  m.def("inverse_cdf", &inverse_cdf, "draws by inverse CDF: the first index whose running mass exceeds u * total",
        py::arg("probs"), py::arg("u"));
  m.def("kv_move", &kv_move, "commit a tree path in one cache row", py::arg("k"), py::arg("v"), py::arg("row"),
        py::arg("start"), py::arg("path"));
  m.def("kv_copy_rows", &kv_copy_rows, "beam reselection's row copies: row i <- row sources[i] over slots "
        "[lows[i], span), as one parallel move", py::arg("k"), py::arg("v"), py::arg("sources"), py::arg("lows"),
        py::arg("span"));
}
