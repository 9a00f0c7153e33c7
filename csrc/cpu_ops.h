// The sampling and child-scoring entry points of staged_engine._cpu, tensor and one-row forms:
// defined in cpu_kernels.cpp and cpu_sampling.cpp (which include this header, so a declaration
// cannot drift from its definition); cpu_forward.cpp's step regions and chain rounds call the
// one-row forms (choose_at, best_child) and verify_tree directly.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <utility>
#include <vector>

// k largest scores per row of (N, V) and their log-softmax values: (idx (N, k), logr (N, k)).
std::vector<torch::Tensor> top_children(const torch::Tensor& scores, int64_t k);

// The draft's k best children by perturbed score under a sampling rule (temperature > 0) among the
// tokens its top-k and top-p keep, and log r (normalised over the tokens its top-k keeps: the
// top-p cut picks the children, it does not renormalise r).
std::vector<torch::Tensor> perturbed_children(const torch::Tensor& logits, uint64_t seed,
                                              const std::vector<int64_t>& positions, double temperature,
                                              int64_t top_k, int64_t k, double top_p = 1.0);

// The sampling rule's choice for each row of logits (N, V), row r choosing the token at positions[r].
std::vector<int64_t> choose_rows(const torch::Tensor& logits, uint64_t seed, const std::vector<int64_t>& positions,
                                 double temperature, int64_t top_k, double top_p);

// A sampling rule and noise seed, checked once (choice_rule), for callers that choose a row at a time.
struct ChoiceRule {
  float temperature;
  int64_t top_k;
  double top_p;
  uint64_t seed;
};
ChoiceRule choice_rule(double temperature, int64_t top_k, double top_p, uint64_t seed);

// The rule's choice of the token at ``position`` from one row of V logits: choose_rows' and
// verify_tree's choice (the noise of ``position``). ``z``: scratch.
int64_t choose_at(const float* row, int64_t V, int64_t position, const ChoiceRule& rule, std::vector<float>& z);

// One row of top_children: its k (1-64) largest entries (ties to the smaller id) to ip and their
// log-softmax values to lp.
void top_row(const float* row, int64_t V, int64_t k, int64_t* ip, float* lp);

// The draft's rule for its best child (draft_choice checks it once): temperature 0, the largest
// logit (top_children's); else the best perturbed score at the position's noise (perturbed_children's).
struct DraftChoice {
  float temperature;
  int64_t top_k;
  double top_p;
  uint64_t seed;
};
DraftChoice draft_choice(double temperature, int64_t top_k, double top_p, uint64_t seed);

// Scratch for best_child.
struct DraftScratch {
  std::vector<float> z, sc;
  std::vector<std::pair<float, int64_t>> cand;
};

// The draft's best child of one row of V logits under ``choice`` at ``position``'s noise, and its
// log r: the bits of top_children(row, 1) or perturbed_children(row, .., 1). log r is -inf where
// the row offers no child.
void best_child(const float* row, int64_t V, int64_t position, const DraftChoice& choice, DraftScratch& s,
                int64_t& token, float& logr);

// best_child's token alone, for chains whose log r nobody reads (fixed chains: only a planner
// prices nodes by it). With noise, log r needs the normaliser of every token's perturbed score,
// the noise of the whole row; the token is the first argmax of the same scores among the tokens
// the rule keeps, which the sampler's pruned search finds hashing the noise of a few tokens only
// (choose_row at the draft rule: its top-p test is best_child's). Demo draft, 565 held-out rows
// in one call, AVX2 Zen 3: 11-12 us a row against best_child's 24 over the whole row (T 0.8 and
// 1), 16 against 30 under a top-p 0.95 cut at T 0.8 (held to the 64 likeliest tokens, as drafts
// once were, 18 either way). ``logr`` is 0 where the child's scaled logit is finite and -inf
// where it is not (a row with no child to offer), so a chain stops where best_child's would on
// any row of finite logits.
void best_child_token(const float* row, int64_t V, int64_t position, const DraftChoice& choice, DraftScratch& s,
                      int64_t& token, float& logr);

// ALGORITHMS.md sec. 4 over a tree's logits: (accepted path, emitted tokens).
std::pair<std::vector<int64_t>, std::vector<int64_t>> verify_tree(
    const torch::Tensor& logits, const std::vector<int64_t>& tokens, const std::vector<int64_t>& parents,
    uint64_t seed, const std::vector<int64_t>& positions, double temperature, int64_t top_k, double top_p);
