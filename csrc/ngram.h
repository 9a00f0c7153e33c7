// Back-off n-gram draft model: counts, ranking, online update and the binary file format.
//
// This header holds the whole model and knows nothing of Python (the bindings live in
// ngram.cpp), so it can also be compiled alone, e.g. under AddressSanitizer for fuzzing.
//
// Contract (ALGORITHMS.md sec. 6): for a context, the continuations of its last n-1 tokens by
// count descending, ties by smaller token id; if fewer than k, fill from the context one token
// shorter, and so on down to the unigram counts; never a repeated token, never an unseen one.
//
// Storage. For every context length L in 0..order-1 the model keeps, per context, a ranked list
// of (token, count) entries. The lists of one length are concatenated in `ent[L]` and found
// through an open-addressing hash map keyed by the packed context (21 bits per id, oldest id in
// the highest bits; three ids fit in 63 bits, so the key ~0 never occurs and marks empty slots).
// L = 0 is the unigram list, stored alone in ent[0]. Online updates write the merged list of a
// touched context to an "overlay" (one std::vector per context) that shadows the base list; the
// overlay is folded back into the compact base when it grows large, and on save.
//
// File format, version 1 (all integers little-endian):
//   header, 128 bytes:
//     0   magic "SENGRAM\0"            8 bytes
//     8   u32 version (1)              12  u32 header size (128)
//     16  u32 order (1..4)             20  u32 vocab size (1..2^21)
//     24  u64 top_m (0 = unpruned)     32  u64 min_count (>= 1)
//     40  u64 n_ctx[1..3]  (contexts stored per context length; 0 for L >= order)
//     64  u64 n_ent[0..3]  (entries stored per context length; 0 for L >= order)
//     96  u64 body size in bytes (file size - 128)
//     104 u32 CRC-32 of the body        108 u32 CRC-32 of header bytes [0, 108)
//     112 16 reserved bytes, zero
//   body, for L = 0 .. order-1:
//     L = 0:  n_ent[0] x (u32 token, u32 count)           the ranked unigram list
//     L >= 1: n_ctx[L] x u64 key, strictly ascending      packed contexts
//             n_ctx[L] x u32 length, each >= 1             list length per context
//             n_ent[L] x (u32 token, u32 count)           the ranked lists, in key order
//   CRC-32 is the zlib one (reflected polynomial 0xEDB88320), so Python's zlib.crc32 agrees.
// The loader checks every size against the real byte count before allocating anything, and
// every key, length, token id and ranking before use: a bad file raises FormatError.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the n-gram file format code assumes a little-endian host"
#endif

namespace ngram {

constexpr int kMaxOrder = 4;                      // orders 1..4: contexts of at most 3 ids
constexpr int kIdBits = 21;                       // bits per id in a packed context key
constexpr uint32_t kMaxVocab = 1u << kIdBits;     // ids must lie in [0, 2^21)
constexpr uint64_t kEmptyKey = ~uint64_t{0};      // never a valid packed context (<= 63 bits)
constexpr uint32_t kCountMax = 0xFFFFFFFFu;       // counts saturate here
constexpr int kLenBits = 22;                      // base map value: offset << 22 | length
constexpr uint64_t kLenMask = (uint64_t{1} << kLenBits) - 1;
constexpr size_t kHeaderSize = 128;
constexpr uint32_t kFormatVersion = 1;
constexpr char kMagic[8] = {'S', 'E', 'N', 'G', 'R', 'A', 'M', '\0'};

// A bad argument (maps to Python ValueError).
struct ArgError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// A corrupt, truncated or hostile file (maps to Python ValueError).
struct FormatError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// One continuation of a context: token id and its (saturating) count.
struct Entry {
  uint32_t token;
  uint32_t count;
};
static_assert(sizeof(Entry) == 8, "Entry must be two packed u32");

// True when a ranks strictly before b: larger count first, then smaller token id.
inline bool ranks_before(const Entry& a, const Entry& b) {
  return a.count > b.count || (a.count == b.count && a.token < b.token);
}

inline uint32_t sat_add(uint32_t a, uint64_t b) {
  uint64_t s = uint64_t{a} + b;
  return s > kCountMax ? kCountMax : static_cast<uint32_t>(s);
}

// Pack ids (oldest first) into a context key, 21 bits each.
inline uint64_t pack_context(const uint32_t* ids, int len) {
  uint64_t key = 0;
  for (int i = 0; i < len; ++i) key = (key << kIdBits) | ids[i];
  return key;
}

// splitmix64 finaliser: a cheap, well-mixed hash of a packed key.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// ---------------------------------------------------------------------------------------------
// CRC-32 (zlib polynomial), slicing-by-8.

class Crc32 {
 public:
  static uint32_t compute(const uint8_t* data, size_t n, uint32_t crc = 0) {
    const auto& t = tables();
    crc = ~crc;
    while (n >= 8) {
      uint32_t lo, hi;
      std::memcpy(&lo, data, 4);
      std::memcpy(&hi, data + 4, 4);
      lo ^= crc;
      crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
            t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
      data += 8;
      n -= 8;
    }
    while (n--) crc = t[0][(crc ^ *data++) & 0xFF] ^ (crc >> 8);
    return ~crc;
  }

 private:
  using Tables = std::array<std::array<uint32_t, 256>, 8>;
  static const Tables& tables() {
    static const Tables t = [] {
      Tables r{};
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int j = 0; j < 8; ++j) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        r[0][i] = c;
      }
      for (int s = 1; s < 8; ++s)
        for (uint32_t i = 0; i < 256; ++i) r[s][i] = (r[s - 1][i] >> 8) ^ r[0][r[s - 1][i] & 0xFF];
      return r;
    }();
    return t;
  }
};

// ---------------------------------------------------------------------------------------------
// Open-addressing hash map: u64 key (never kEmptyKey) -> u64 value, linear probing, load <= 1/2.

class FlatMap {
 public:
  size_t size() const { return size_; }

  const uint64_t* find(uint64_t key) const {
    if (size_ == 0) return nullptr;
    size_t i = mix64(key) & mask_;
    while (true) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.val;
      if (s.key == kEmptyKey) return nullptr;
      i = (i + 1) & mask_;
    }
  }

  uint64_t* find(uint64_t key) {
    return const_cast<uint64_t*>(static_cast<const FlatMap*>(this)->find(key));
  }

  // Make room for n keys in total without rehashing.
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    if (cap <= slots_.size()) return;
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(cap, Slot{kEmptyKey, 0});
    mask_ = cap - 1;
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != kEmptyKey) put(s.key, s.val);
  }

  void insert_or_assign(uint64_t key, uint64_t val) {
    if (2 * (size_ + 1) > slots_.size()) reserve(std::max<size_t>(size_ + 1, 2 * size_));
    put(key, val);
  }

  // Insert n distinct keys (prefetching ahead: the table is usually far larger than the cache).
  void bulk_insert(const uint64_t* keys, const uint64_t* vals, size_t n) {
    reserve(size_ + n);
    constexpr size_t kAhead = 16;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) __builtin_prefetch(&slots_[mix64(keys[i + kAhead]) & mask_]);
      put(keys[i], vals[i]);
    }
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.key != kEmptyKey) f(s.key, s.val);
  }

  void clear() {
    slots_.clear();
    mask_ = 0;
    size_ = 0;
  }

  size_t memory_bytes() const { return slots_.capacity() * sizeof(Slot); }

 private:
  struct Slot {
    uint64_t key;
    uint64_t val;
  };
  void put(uint64_t key, uint64_t val) {
    size_t i = mix64(key) & mask_;
    while (true) {
      Slot& s = slots_[i];
      if (s.key == kEmptyKey) {
        s.key = key;
        s.val = val;
        ++size_;
        return;
      }
      if (s.key == key) {
        s.val = val;
        return;
      }
      i = (i + 1) & mask_;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------
// LSD radix sort of unsigned keys (uint64_t or unsigned __int128) over their low `nbits` bits;
// 8-bit digits, passes whose digit is the same for every key are skipped.

template <typename K>
void radix_sort(std::vector<K>& a, int nbits) {
  const size_t n = a.size();
  if (n < 2) return;
  if (n < 512) {
    std::sort(a.begin(), a.end());
    return;
  }
  const int passes = (nbits + 7) / 8;
  std::vector<std::array<size_t, 256>> hist(passes);
  for (auto& h : hist) h.fill(0);
  for (const K& k : a)
    for (int p = 0; p < passes; ++p) ++hist[p][static_cast<uint64_t>(k >> (8 * p)) & 0xFF];
  std::vector<K> tmp(n);
  K* src = a.data();
  K* dst = tmp.data();
  for (int p = 0; p < passes; ++p) {
    auto& h = hist[p];
    bool trivial = false;
    for (size_t c : h)
      if (c == n) trivial = true;
    if (trivial) continue;
    size_t pos = 0;
    for (size_t& c : h) {
      size_t cnt = c;
      c = pos;
      pos += cnt;
    }
    const int shift = 8 * p;
    for (size_t i = 0; i < n; ++i) {
      const K k = src[i];
      dst[h[static_cast<uint64_t>(k >> shift) & 0xFF]++] = k;
    }
    std::swap(src, dst);
  }
  if (src != a.data()) std::memcpy(a.data(), src, n * sizeof(K));
}

// ---------------------------------------------------------------------------------------------
// Little-endian byte reader/writer with bounds checks.

// memcpy that accepts the null data() of an empty vector when n == 0.
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

class Writer {
 public:
  explicit Writer(size_t reserve) { buf_.reserve(reserve); }
  template <typename T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_bytes(const void* p, size_t n) {
    if (n == 0) return;
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  T get() {
    if (n_ - pos_ < sizeof(T)) throw FormatError("n-gram file: truncated");
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // Pointer to the next n bytes, checked against the end.
  const uint8_t* take(size_t n) {
    if (n_ - pos_ < n) throw FormatError("n-gram file: truncated");
    const uint8_t* r = p_ + pos_;
    pos_ += n;
    return r;
  }
  size_t pos() const { return pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// A read-only view of one ranked continuation list.
struct Span {
  const Entry* p = nullptr;
  size_t n = 0;
};

// ---------------------------------------------------------------------------------------------

class Model {
 public:
  int order() const { return order_; }
  uint32_t vocab_size() const { return vocab_; }
  uint64_t top_m() const { return top_m_; }
  uint64_t min_count() const { return min_count_; }
  // Stored contexts / entries of context length L (base and overlay merged).
  uint64_t num_contexts(int L) const { return L == 0 ? (n_ent_[0] > 0) : n_ctx_[L]; }
  uint64_t num_entries(int L) const { return n_ent_[L]; }

  // Build from a flat token array split into documents: document d is
  // tokens[doc_off[d], doc_off[d+1]). Counts every n-gram of length 1..order inside a document;
  // keeps per context the entries with count >= min_count, ranked, the first top_m (0 = all).
  static std::unique_ptr<Model> build(const int64_t* tokens, size_t n, const int64_t* doc_off,
                                      size_t n_off, int order, uint32_t vocab, uint64_t top_m,
                                      uint64_t min_count) {
    check_params(order, vocab, min_count);
    // One validated copy: later passes never see an id that was not checked, even if the
    // caller's buffer changes meanwhile (the GIL is released during the build).
    std::vector<uint32_t> ids(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t t = tokens[i];
      if (t < 0 || t >= static_cast<int64_t>(vocab))
        throw ArgError("token_ids: token id " + std::to_string(t) + " at position " +
                       std::to_string(i) + " is outside [0, " + std::to_string(vocab) + ")");
      ids[i] = static_cast<uint32_t>(t);
    }
    std::vector<int64_t> offs(doc_off, doc_off + n_off);
    bool offs_ok = n_off >= 1 && offs[0] == 0 && static_cast<uint64_t>(offs[n_off - 1]) == n;
    for (size_t d = 0; offs_ok && d + 1 < n_off; ++d) offs_ok = offs[d] <= offs[d + 1];
    if (!offs_ok) throw ArgError("doc_offsets: must be non-decreasing, from 0 to the number of tokens");
    auto m = std::unique_ptr<Model>(new Model(order, vocab, top_m, min_count));
    m->build_unigrams(ids.data(), n);
    int bits = 1;
    while ((uint64_t{1} << bits) < vocab) ++bits;
    for (int L = 1; L < order; ++L) {
      if ((L + 1) * bits <= 64)
        m->build_level<uint64_t>(L, bits, ids.data(), offs.data(), n_off);
      else
        m->build_level<unsigned __int128>(L, bits, ids.data(), offs.data(), n_off);
    }
    return m;
  }

  // The ranked list of exactly this context of length L (empty span when not stored).
  Span lookup(int L, uint64_t key) const {
    if (n_overlay_ != 0) {
      if (const uint64_t* v = ov_idx_[L].find(key)) {
        const auto& vec = ov_[*v];
        return Span{vec.data(), vec.size()};
      }
    }
    if (L == 0) return Span{ent_[0].data(), ent_[0].size()};
    if (const uint64_t* v = idx_[L].find(key))
      return Span{ent_[L].data() + (*v >> kLenBits), static_cast<size_t>(*v & kLenMask)};
    return Span{};
  }

  // Ranking of ALGORITHMS.md sec. 6. ctx holds the last clen (<= order-1) ids, oldest first,
  // all already checked to be < vocab. Appends at most k tokens to out (cleared first).
  void topk_into(const uint32_t* ctx, int clen, size_t k, std::vector<uint32_t>& out) const {
    out.clear();
    if (k == 0) return;
    if (k > vocab_) k = vocab_;
    const bool use_mark = k > 32;  // linear membership scans are cheaper for short results
    if (use_mark && mark_.size() != vocab_) mark_.assign(vocab_, 0);
    for (int L = clen; L >= 0 && out.size() < k; --L) {
      const Span s = lookup(L, pack_context(ctx + (clen - L), L));
      if (s.n == 0) continue;
      if (out.empty()) {  // a list never repeats a token
        const size_t take = std::min(k, s.n);
        for (size_t i = 0; i < take; ++i) out.push_back(s.p[i].token);
        if (use_mark)
          for (uint32_t t : out) mark_[t] = 1;
        continue;
      }
      for (size_t i = 0; i < s.n && out.size() < k; ++i) {
        const uint32_t t = s.p[i].token;
        bool seen;
        if (use_mark) {
          seen = mark_[t] != 0;
          mark_[t] = 1;
        } else {
          seen = std::find(out.begin(), out.end(), t) != out.end();
        }
        if (!seen) out.push_back(t);
      }
    }
    if (use_mark)
      for (uint32_t t : out) mark_[t] = 0;
  }

  // Mini-tree proposal: level j holds topk(context + [first token of each earlier level],
  // widths[j]) hung below the first token of level j-1 (parent -1 = the context tip). Stops at
  // the first level that yields nothing. tokens/parents are appended in topological order.
  void propose(const uint32_t* ctx, int clen, const uint64_t* widths, size_t nw,
               std::vector<uint32_t>& tokens, std::vector<int32_t>& parents) const {
    uint32_t c[kMaxOrder];
    const int cmax = order_ - 1;
    int cl = std::min(clen, cmax);
    for (int i = 0; i < cl; ++i) c[i] = ctx[clen - cl + i];
    std::vector<uint32_t> level;
    int32_t parent = -1;
    for (size_t j = 0; j < nw; ++j) {
      topk_into(c, cl, widths[j], level);
      if (level.empty()) break;
      if (tokens.size() + level.size() > static_cast<size_t>(INT32_MAX))
        throw ArgError("widths: the proposal would exceed 2^31 - 1 nodes");
      const int32_t first = static_cast<int32_t>(tokens.size());
      for (uint32_t t : level) {
        tokens.push_back(t);
        parents.push_back(parent);
      }
      parent = first;
      if (cmax == 0) continue;
      if (cl == cmax) {
        std::memmove(c, c + 1, sizeof(uint32_t) * (cmax - 1));
        c[cmax - 1] = level[0];
      } else {
        c[cl++] = level[0];
      }
    }
  }

  // Add the counts of the n-grams of tokens[0, n) that end at a position >= skip (the first
  // `skip` tokens are history only). Per context the stored and the new counts are summed, the
  // list re-ranked and cut to top_m; min_count is not applied (it prunes the build corpus only).
  void update(const int64_t* buf, size_t n, size_t skip) {
    std::vector<uint32_t> tokens(n);
    for (size_t i = 0; i < n; ++i) {
      if (buf[i] < 0 || buf[i] >= static_cast<int64_t>(vocab_))
        throw ArgError("tokens: token id " + std::to_string(buf[i]) + " is outside [0, " +
                       std::to_string(vocab_) + ")");
      tokens[i] = static_cast<uint32_t>(buf[i]);
    }
    if (skip >= n) return;
    struct Inc {
      uint64_t ctx;
      uint32_t tok;
    };
    std::vector<Inc> incs;
    std::vector<Entry> group;
    for (int L = 0; L < order_; ++L) {
      incs.clear();
      for (size_t i = std::max<size_t>(skip, L); i < n; ++i) {
        uint64_t key = 0;
        for (size_t j = i - L; j < i; ++j) key = (key << kIdBits) | tokens[j];
        incs.push_back(Inc{key, tokens[i]});
      }
      std::sort(incs.begin(), incs.end(), [](const Inc& a, const Inc& b) {
        return a.ctx < b.ctx || (a.ctx == b.ctx && a.tok < b.tok);
      });
      for (size_t i = 0; i < incs.size();) {
        const uint64_t ctx = incs[i].ctx;
        group.clear();
        for (; i < incs.size() && incs[i].ctx == ctx; ++i) {
          if (!group.empty() && group.back().token == incs[i].tok)
            group.back().count = sat_add(group.back().count, 1);
          else
            group.push_back(Entry{incs[i].tok, 1});
        }
        merge_counts(L, ctx, group);
      }
    }
    if (n_overlay_ > std::max<uint64_t>(uint64_t{1} << 16, (n_ctx_[1] + n_ctx_[2] + n_ctx_[3]) / 4))
      fold();
  }

  // Serialise to the version-1 file format (see the top of this file).
  std::vector<uint8_t> to_bytes() const {
    std::vector<std::vector<std::pair<uint64_t, Span>>> lists(order_);
    uint64_t body = 0;
    const Span uni = lookup(0, 0);
    body += uni.n * sizeof(Entry);
    for (int L = 1; L < order_; ++L) {
      lists[L] = merged_contexts(L);
      body += lists[L].size() * 12;
      for (const auto& kv : lists[L]) body += kv.second.n * sizeof(Entry);
    }
    Writer w(kHeaderSize + body);
    w.put_bytes(kMagic, 8);
    w.put<uint32_t>(kFormatVersion);
    w.put<uint32_t>(kHeaderSize);
    w.put<uint32_t>(order_);
    w.put<uint32_t>(vocab_);
    w.put<uint64_t>(top_m_);
    w.put<uint64_t>(min_count_);
    for (int L = 1; L < kMaxOrder; ++L) w.put<uint64_t>(L < order_ ? lists[L].size() : 0);
    w.put<uint64_t>(uni.n);
    for (int L = 1; L < kMaxOrder; ++L) {
      uint64_t e = 0;
      if (L < order_)
        for (const auto& kv : lists[L]) e += kv.second.n;
      w.put<uint64_t>(e);
    }
    w.put<uint64_t>(body);
    w.put<uint32_t>(0);  // body CRC, patched below
    w.put<uint32_t>(0);  // header CRC, patched below
    for (int i = 0; i < 16; ++i) w.put<uint8_t>(0);
    w.put_bytes(uni.p, uni.n * sizeof(Entry));
    for (int L = 1; L < order_; ++L) {
      for (const auto& kv : lists[L]) w.put<uint64_t>(kv.first);
      for (const auto& kv : lists[L]) w.put<uint32_t>(static_cast<uint32_t>(kv.second.n));
      for (const auto& kv : lists[L]) w.put_bytes(kv.second.p, kv.second.n * sizeof(Entry));
    }
    std::vector<uint8_t>& b = w.bytes();
    const uint32_t body_crc = Crc32::compute(b.data() + kHeaderSize, b.size() - kHeaderSize);
    std::memcpy(b.data() + 104, &body_crc, 4);
    const uint32_t head_crc = Crc32::compute(b.data(), 108);
    std::memcpy(b.data() + 108, &head_crc, 4);
    return std::move(b);
  }

  // Parse and validate a version-1 file image. Throws FormatError on anything inconsistent.
  static std::unique_ptr<Model> from_bytes(const uint8_t* data, size_t size) {
    if (size < kHeaderSize)
      throw FormatError("n-gram file: truncated (" + std::to_string(size) +
                        " bytes, the header alone is 128)");
    Reader r(data, size);
    if (std::memcmp(r.take(8), kMagic, 8) != 0)
      throw FormatError("n-gram file: bad magic (not a staged-engine n-gram file)");
    const uint32_t version = r.get<uint32_t>();
    if (version != kFormatVersion)
      throw FormatError("n-gram file: unsupported version " + std::to_string(version));
    if (r.get<uint32_t>() != kHeaderSize) throw FormatError("n-gram file: bad header size");
    const uint32_t order = r.get<uint32_t>();
    const uint32_t vocab = r.get<uint32_t>();
    const uint64_t top_m = r.get<uint64_t>();
    const uint64_t min_count = r.get<uint64_t>();
    uint64_t n_ctx[kMaxOrder] = {0, 0, 0, 0};
    uint64_t n_ent[kMaxOrder];
    for (int L = 1; L < kMaxOrder; ++L) n_ctx[L] = r.get<uint64_t>();
    for (int L = 0; L < kMaxOrder; ++L) n_ent[L] = r.get<uint64_t>();
    const uint64_t body = r.get<uint64_t>();
    const uint32_t body_crc = r.get<uint32_t>();
    const uint32_t head_crc = r.get<uint32_t>();
    const uint8_t* reserved = r.take(16);
    if (Crc32::compute(data, 108) != head_crc)
      throw FormatError("n-gram file: header checksum mismatch");
    for (int i = 0; i < 16; ++i)
      if (reserved[i] != 0) throw FormatError("n-gram file: reserved header bytes are not zero");
    if (order < 1 || order > static_cast<uint32_t>(kMaxOrder))
      throw FormatError("n-gram file: order " + std::to_string(order) + " outside 1..4");
    if (vocab < 1 || vocab > kMaxVocab)
      throw FormatError("n-gram file: vocab size " + std::to_string(vocab) + " outside 1..2^21");
    if (min_count < 1) throw FormatError("n-gram file: min_count is 0");
    if (body != size - kHeaderSize)
      throw FormatError("n-gram file: body size " + std::to_string(body) + " in the header, " +
                        std::to_string(size - kHeaderSize) + " bytes in the file (truncated?)");
    // Every count is bounded by the body size before any product or sum is formed.
    uint64_t expect = 0;
    for (int L = 0; L < kMaxOrder; ++L) {
      if (L >= static_cast<int>(order) && (n_ctx[L] != 0 || n_ent[L] != 0))
        throw FormatError("n-gram file: sections beyond the order are not empty");
      if (n_ctx[L] > body / 12 || n_ent[L] > body / 8)
        throw FormatError("n-gram file: section sizes exceed the file size");
      expect += n_ctx[L] * 12 + n_ent[L] * 8;  // each term <= 2 * body: no overflow
    }
    if (expect != body) throw FormatError("n-gram file: section sizes do not add up to the body size");
    if (n_ent[0] > vocab) throw FormatError("n-gram file: more unigrams than the vocabulary");
    if (Crc32::compute(data + kHeaderSize, body) != body_crc)
      throw FormatError("n-gram file: body checksum mismatch (corrupt file)");

    auto m = std::unique_ptr<Model>(new Model(order, vocab, top_m, min_count));
    ListChecker checker(vocab);
    const uint64_t max_len = std::min<uint64_t>(vocab, top_m == 0 ? vocab : top_m);
    // Unigrams.
    if (n_ent[0] > max_len) throw FormatError("n-gram file: unigram list longer than top_m");
    m->ent_[0].resize(n_ent[0]);
    copy_bytes(m->ent_[0].data(), r.take(n_ent[0] * 8), n_ent[0] * 8);
    checker.check(m->ent_[0].data(), m->ent_[0].size());
    m->n_ent_[0] = n_ent[0];
    // Contexts of length 1..order-1.
    for (int L = 1; L < static_cast<int>(order); ++L) {
      const uint64_t nc = n_ctx[L];
      const uint8_t* keys_p = r.take(nc * 8);
      const uint8_t* lens_p = r.take(nc * 4);
      const uint8_t* ent_p = r.take(n_ent[L] * 8);
      std::vector<uint64_t> keys(nc), vals(nc);
      copy_bytes(keys.data(), keys_p, nc * 8);
      uint64_t off = 0;
      for (uint64_t c = 0; c < nc; ++c) {
        const uint64_t key = keys[c];
        if (c > 0 && key <= keys[c - 1]) throw FormatError("n-gram file: context keys not ascending");
        if ((key >> (kIdBits * L)) != 0) throw FormatError("n-gram file: context key out of range");
        for (int j = 0; j < L; ++j)
          if (((key >> (kIdBits * j)) & (kMaxVocab - 1)) >= vocab)
            throw FormatError("n-gram file: context token id outside the vocabulary");
        uint32_t len;
        std::memcpy(&len, lens_p + 4 * c, 4);
        if (len < 1 || len > max_len) throw FormatError("n-gram file: bad continuation list length");
        if (len > n_ent[L] - off) throw FormatError("n-gram file: list lengths exceed the entries");
        vals[c] = (off << kLenBits) | len;
        off += len;
      }
      if (off != n_ent[L]) throw FormatError("n-gram file: list lengths do not cover the entries");
      m->ent_[L].resize(n_ent[L]);
      copy_bytes(m->ent_[L].data(), ent_p, n_ent[L] * 8);
      for (uint64_t c = 0; c < nc; ++c)
        checker.check(m->ent_[L].data() + (vals[c] >> kLenBits), vals[c] & kLenMask);
      m->idx_[L].bulk_insert(keys.data(), vals.data(), nc);
      m->n_ctx_[L] = nc;
      m->n_ent_[L] = n_ent[L];
    }
    return m;
  }

  // Fold the overlay into the compact base arrays.
  void fold() {
    if (n_overlay_ == 0) return;
    const Span uni = lookup(0, 0);
    std::vector<Entry> new_uni(uni.p, uni.p + uni.n);
    for (int L = 1; L < order_; ++L) {
      const auto lists = merged_contexts(L);
      std::vector<Entry> ent;
      ent.reserve(n_ent_[L]);
      std::vector<uint64_t> keys(lists.size()), vals(lists.size());
      for (size_t c = 0; c < lists.size(); ++c) {
        keys[c] = lists[c].first;
        vals[c] = (uint64_t{ent.size()} << kLenBits) | lists[c].second.n;
        ent.insert(ent.end(), lists[c].second.p, lists[c].second.p + lists[c].second.n);
      }
      FlatMap idx;
      idx.bulk_insert(keys.data(), vals.data(), keys.size());
      ent_[L].swap(ent);
      idx_[L] = std::move(idx);
    }
    ent_[0].swap(new_uni);
    ov_.clear();
    for (auto& m : ov_idx_) m.clear();
    std::vector<uint32_t>().swap(uni_pos_);
    n_overlay_ = 0;
  }

  size_t memory_bytes() const {
    size_t b = 0;
    for (int L = 0; L < kMaxOrder; ++L)
      b += ent_[L].capacity() * sizeof(Entry) + idx_[L].memory_bytes() + ov_idx_[L].memory_bytes();
    for (const auto& v : ov_) b += v.capacity() * sizeof(Entry) + sizeof(v);
    return b;
  }

 private:
  Model(int order, uint32_t vocab, uint64_t top_m, uint64_t min_count)
      : order_(order), vocab_(vocab), top_m_(top_m), min_count_(min_count) {}

  static void check_params(int order, uint32_t vocab, uint64_t min_count) {
    if (order < 1 || order > kMaxOrder)
      throw ArgError("order: must be in 1..4, got " + std::to_string(order));
    if (vocab < 1 || vocab > kMaxVocab)
      throw ArgError("vocab_size: must be in 1..2097152 (2^21), got " + std::to_string(vocab));
    if (min_count < 1) throw ArgError("min_count: must be >= 1");
  }

  // Checks stored lists: ids < vocab, counts > 0, strictly ranked, no token twice. `seen` holds
  // one stamp per token id (size vocab); each list gets a fresh stamp.
  class ListChecker {
   public:
    explicit ListChecker(uint32_t vocab) : vocab_(vocab), seen_(vocab, 0) {}
    void check(const Entry* e, size_t n) {
      if (++stamp_ == 0) {  // wrapped: reset the stamps
        std::fill(seen_.begin(), seen_.end(), 0);
        stamp_ = 1;
      }
      for (size_t i = 0; i < n; ++i) {
        const uint32_t t = e[i].token;
        if (t >= vocab_) throw FormatError("n-gram file: token id outside the vocabulary");
        if (e[i].count == 0) throw FormatError("n-gram file: zero count");
        if (i > 0 && !ranks_before(e[i - 1], e[i]))
          throw FormatError("n-gram file: continuation list not ranked");
        if (seen_[t] == stamp_) throw FormatError("n-gram file: a token repeats in a list");
        seen_[t] = stamp_;
      }
    }

   private:
    uint32_t vocab_;
    std::vector<uint32_t> seen_;
    uint32_t stamp_ = 0;
  };

  void rank_and_cut(std::vector<Entry>& v) const {
    std::sort(v.begin(), v.end(), ranks_before);
    if (top_m_ != 0 && v.size() > top_m_) v.resize(top_m_);
  }

  void build_unigrams(const uint32_t* tokens, size_t n) {
    std::vector<uint64_t> cnt(vocab_, 0);
    for (size_t i = 0; i < n; ++i) ++cnt[tokens[i]];
    std::vector<Entry>& v = ent_[0];
    for (uint32_t t = 0; t < vocab_; ++t)
      if (cnt[t] >= min_count_) v.push_back(Entry{t, sat_add(0, cnt[t])});
    rank_and_cut(v);
    v.shrink_to_fit();
    n_ent_[0] = v.size();
  }

  // Count all (L+1)-grams by sorting their packed keys (`bits` bits per id, oldest first).
  template <typename K>
  void build_level(int L, int bits, const uint32_t* tokens, const int64_t* doc_off, size_t n_off) {
    const int m = L + 1;
    const int nbits = m * bits;
    const K mask = nbits >= static_cast<int>(8 * sizeof(K)) ? ~K(0) : ((K(1) << nbits) - 1);
    const K tok_mask = (K(1) << bits) - 1;
    std::vector<K> keys;
    size_t total = 0;
    for (size_t d = 0; d + 1 < n_off; ++d) {
      const int64_t len = doc_off[d + 1] - doc_off[d];
      if (len > L) total += static_cast<size_t>(len - L);
    }
    keys.reserve(total);
    for (size_t d = 0; d + 1 < n_off; ++d) {
      const int64_t s = doc_off[d], e = doc_off[d + 1];
      K key = 0;
      for (int64_t i = s; i < e; ++i) {
        key = ((key << bits) | static_cast<K>(tokens[i])) & mask;
        if (i - s >= L) keys.push_back(key);
      }
    }
    radix_sort(keys, nbits);
    std::vector<uint64_t> ctx_keys, ctx_vals;
    std::vector<Entry>& ent = ent_[L];
    std::vector<Entry> group;
    const size_t nk = keys.size();
    for (size_t i = 0; i < nk;) {
      const K ctx = keys[i] >> bits;
      group.clear();
      while (i < nk && (keys[i] >> bits) == ctx) {
        const K k = keys[i];
        size_t j = i + 1;
        while (j < nk && keys[j] == k) ++j;
        if (j - i >= min_count_)
          group.push_back(Entry{static_cast<uint32_t>(k & tok_mask), sat_add(0, j - i)});
        i = j;
      }
      if (group.empty()) continue;
      rank_and_cut(group);
      uint64_t key21 = 0;  // repack the context with 21 bits per id
      for (int j = L - 1; j >= 0; --j)
        key21 = (key21 << kIdBits) | static_cast<uint64_t>((ctx >> (bits * j)) & tok_mask);
      ctx_keys.push_back(key21);
      ctx_vals.push_back((uint64_t{ent.size()} << kLenBits) | group.size());
      ent.insert(ent.end(), group.begin(), group.end());
    }
    std::vector<K>().swap(keys);
    ent.shrink_to_fit();
    idx_[L].bulk_insert(ctx_keys.data(), ctx_vals.data(), ctx_keys.size());
    n_ctx_[L] = ctx_keys.size();
    n_ent_[L] = ent.size();
  }

  // Add new counts (`inc`: distinct tokens, ascending) to the list of context (L, key): the
  // result is the stored and new counts summed, ranked and cut to top_m. Counts only grow, so
  // a touched entry only moves toward the front: only the region from the new place of the
  // best touched entry to the last touched one is rewritten. The unigram list keeps a dense
  // token -> position index (uni_pos_) so that it is never scanned.
  void merge_counts(int L, uint64_t key, const std::vector<Entry>& inc) {
    std::vector<Entry>* list;
    if (uint64_t* v = ov_idx_[L].find(key)) {
      list = &ov_[*v];
    } else {
      const Span base = lookup(L, key);
      if (base.n == 0 && L > 0) ++n_ctx_[L];
      ov_idx_[L].insert_or_assign(key, ov_.size());
      ov_.emplace_back(base.p, base.p + base.n);
      ++n_overlay_;
      list = &ov_.back();
      if (L == 0) {
        uni_pos_.assign(vocab_, 0);
        for (size_t i = 0; i < list->size(); ++i) uni_pos_[(*list)[i].token] = i + 1;
      }
    }
    std::vector<Entry>& e = *list;
    const size_t old_n = e.size();
    // 1. Find the touched entries already in the list.
    std::vector<std::pair<size_t, Entry>> found;  // (index, entry with the new count)
    std::vector<char> is_old(inc.size(), 0);
    if (L == 0) {
      for (size_t j = 0; j < inc.size(); ++j)
        if (const uint32_t p = uni_pos_[inc[j].token]) {
          found.emplace_back(p - 1, Entry{inc[j].token, sat_add(e[p - 1].count, inc[j].count)});
          is_old[j] = 1;
        }
    } else {
      for (size_t i = 0; i < old_n && found.size() < inc.size(); ++i) {
        auto it = std::lower_bound(inc.begin(), inc.end(), e[i].token,
                                   [](const Entry& a, uint32_t t) { return a.token < t; });
        if (it != inc.end() && it->token == e[i].token) {
          found.emplace_back(i, Entry{e[i].token, sat_add(e[i].count, it->count)});
          is_old[it - inc.begin()] = 1;
        }
      }
    }
    std::vector<Entry> touched;
    touched.reserve(inc.size());
    size_t lo = old_n, hi = 0;  // touched old entries lie in [lo, hi)
    for (const auto& f : found) {
      touched.push_back(f.second);
      lo = std::min(lo, f.first);
      hi = std::max(hi, f.first + 1);
    }
    for (size_t j = 0; j < inc.size(); ++j)
      if (!is_old[j]) {
        touched.push_back(inc[j]);
        hi = old_n;  // new entries go somewhere before the end of the grown list
      }
    std::sort(touched.begin(), touched.end(), ranks_before);
    // 2. Entries before `start` rank before every touched entry and are untouched.
    const size_t start = static_cast<size_t>(
        std::lower_bound(e.begin(), e.begin() + std::min(lo, old_n), touched.front(), ranks_before) -
        e.begin());
    // 3. Rewrite [start, hi) plus the new entries: untouched ones keep their order.
    //    With no new entries [hi, old_n) stays where it is; new entries set hi = old_n.
    std::vector<char> drop(hi - start, 0);  // start <= lo <= hi, or hi == old_n
    for (const auto& f : found) drop[f.first - start] = 1;
    std::vector<Entry> rest;
    rest.reserve(hi - start);
    for (size_t i = start; i < hi; ++i)
      if (!drop[i - start]) rest.push_back(e[i]);
    const size_t n_new = inc.size() - found.size();
    e.resize(old_n + n_new);
    std::merge(rest.begin(), rest.end(), touched.begin(), touched.end(), e.begin() + start,
               ranks_before);
    const size_t end = hi + n_new;
    if (L == 0)
      for (size_t i = start; i < end; ++i) uni_pos_[e[i].token] = i + 1;
    // 4. Cut to top_m.
    if (top_m_ != 0 && e.size() > top_m_) {
      if (L == 0)
        for (size_t i = top_m_; i < e.size(); ++i) uni_pos_[e[i].token] = 0;
      e.resize(top_m_);
    }
    n_ent_[L] += e.size();
    n_ent_[L] -= old_n;
  }

  // All contexts of length L >= 1 (overlay shadowing base), ascending by key.
  std::vector<std::pair<uint64_t, Span>> merged_contexts(int L) const {
    std::vector<std::pair<uint64_t, Span>> out;
    out.reserve(n_ctx_[L]);
    idx_[L].for_each([&](uint64_t key, uint64_t val) {
      if (n_overlay_ != 0 && ov_idx_[L].find(key) != nullptr) return;
      out.emplace_back(key, Span{ent_[L].data() + (val >> kLenBits), static_cast<size_t>(val & kLenMask)});
    });
    ov_idx_[L].for_each([&](uint64_t key, uint64_t val) {
      out.emplace_back(key, Span{ov_[val].data(), ov_[val].size()});
    });
    std::sort(out.begin(), out.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    return out;
  }

  int order_;
  uint32_t vocab_;
  uint64_t top_m_;      // 0 = no cut
  uint64_t min_count_;  // applied at build
  std::vector<Entry> ent_[kMaxOrder];   // base ranked lists per context length
  FlatMap idx_[kMaxOrder];              // L >= 1: key -> offset << 22 | length into ent_[L]
  std::vector<std::vector<Entry>> ov_;  // overlay lists (updated contexts)
  FlatMap ov_idx_[kMaxOrder];           // key -> index into ov_ (L = 0 uses key 0)
  uint64_t n_overlay_ = 0;
  uint64_t n_ctx_[kMaxOrder] = {0, 0, 0, 0};  // merged view
  uint64_t n_ent_[kMaxOrder] = {0, 0, 0, 0};  // merged view
  // topk scratch for large k, one byte per token id, all zero between calls. Callers must not
  // query one model from two threads at once (the Python bindings hold the GIL throughout).
  mutable std::vector<uint8_t> mark_;
  std::vector<uint32_t> uni_pos_;  // overlay unigram list: token -> index + 1 (0 = absent)
};

}  // namespace ngram
