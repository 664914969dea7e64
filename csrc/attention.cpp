// Scaled dot-product attention on CPU, blocked with an online softmax: for each (sequence, head, chunk of up to
// kQueryChunk query rows) a thread walks the sequence's real keys in blocks of kKeyBlock, so memory per thread is
// bounded (no [S, S] score matrix, whatever the length) and cost follows the real lengths.
//
// Forms (as fastbert.ops.attention):
// - packed: q, k, v [T, heads, D] + cu_seqlens int32 [B + 1]: tokens attend within their own sequence;
// - padded: q, k, v [B, S, heads, D] + optional key_padding_mask bool [B, S] (True = real key, holes allowed).
// q, k, v may be strided views (e.g. slices of one packed QKV GEMM output) as long as the head dim is unit-stride;
// they are packed per block into fp32 tiles (K transposed, Q pre-scaled) that the register-tiled micro-kernels
// read. The output is contiguous and shaped like q; a query whose keys are all masked gets zeros. Only real keys'
// K and V rows are read, so NaN or Inf stored at masked keys never reaches a real query's output.
// Softmax statistics and accumulation in fp32 (bf16 in, bf16 out). Limits: CPU, float32 or bfloat16.
//
// Dropout (dropout_p > 0): each probability is kept with probability 1 - p and scaled by 1 / (1 - p) after the
// softmax, the keep decision a counter-based hash of (seed, [sequence, head, query, key] of the padded layout)
// (csrc/dropout_rng.h), which the backward (csrc/attention_backward.cpp) regenerates.
//
// Sliding window (`window`, ModernBERT's local_attention): a query at position i attends the keys j with
// |i - j| <= window / 2 (positions within the sequence; the padded form's index along S). Each work item walks only
// the key blocks its rows' windows reach, and each 4-row tile only the columns of that block its rows' windows
// cover, so a local layer costs about S * window instead of S^2; the band's edges are masked per row inside the
// register tiles.
//
// bfloat16 products on CPUs that compute bf16 natively (`bf16_attention_kernel`: an AVX-512 build, AVX512-BF16,
// an even head dim up to 256), without dropout and with a positive scale: K and V are packed per block into VNNI
// pairs (two bf16 values along the reduced dimension in one 32-bit unit), and
// - with AMX-BF16 and no window, each work item runs its two products on oneDNN's brgemm micro-kernels through ATen
//   (`attend_item_bf16_products`), bf16 x bf16 -> fp32 on AMX tiles; query rows are padded to a multiple of
//   kBrgemmRows and keys to a multiple of kBf16Keys, so few distinct micro-kernels are generated;
// - without AMX (AMD Zen 4 and later, Cooper Lake), on register tiles of kVnniRows query rows x 32 columns with
//   vdpbf16ps (`gemm_tile_bf16`): ATen's brgemm is AMX-only, and with these products in fp32 the vector kernel
//   took 1.5-2.1x as long (benchmarks/results/cpu-2core-amd-bf16-attention). Each tile of rows runs Q K^T, its
//   softmax and P V while it is in L1, over the columns of the block its rows' windows reach (with a window, the
//   band's edges masked per row in the softmax).
// Either way the softmax statistics stay in fp32, the probabilities are rounded to bf16 for the P V product (as
// PyTorch's own CPU flash attention does) and each row is normalised by the sum of exactly those bf16 values.
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "dropout_rng.h"
#include "fastbert.h"

namespace fastbert {
namespace {

constexpr int64_t kRows = 4;             // query rows per register tile
constexpr int64_t kCols = 2 * kLanes;    // key columns (QK^T) or head-dim columns (PV) per register tile
constexpr int64_t kQueryChunk = 128;     // query rows per work item
constexpr int64_t kKeyBlock = 256;       // keys per online-softmax step

constexpr int64_t kPrefetchRows = 6;    // rows ahead to prefetch while packing strided q/k/v rows

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Rows of q/k/v views are a whole QKV token row apart (often more than a page), beyond the hardware prefetcher's
// reach: without this, packing waits on a cache miss per row.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) __builtin_prefetch(p + byte);
}

// s[r][j] = sum_d q[r][d] * kt[d][j] for r < kRows and j < ncols (a multiple of kCols).
// q: kRows rows of `dim` floats; kt: dim rows of `ldk` floats (K transposed); s: kRows rows of `lds` floats.
// Row r keeps columns [lo[r], hi[r]) (the real keys, within its window); the others (the zero padding of the last
// tile, keys outside the window) are stored as -inf so that the softmax ignores them. Also returns each row's
// maximum over its kept columns in row_max[r] (-inf when it keeps none).
inline void scores_tile(const float* q, int64_t dim, const float* kt, int64_t ldk, int64_t ncols, const int64_t* lo,
                        const int64_t* hi, float* s, int64_t lds, float* row_max) {
  const Vec neg_inf(-std::numeric_limits<float>::infinity());
  const Vec lane = Vec::arange(0.f, 1.f);
  const int64_t widest_lo = std::max(std::max(lo[0], lo[1]), std::max(lo[2], lo[3]));
  const int64_t narrowest_hi = std::min(std::min(hi[0], hi[1]), std::min(hi[2], hi[3]));
  Vec m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
  for (int64_t j = 0; j < ncols; j += kCols) {
    Vec a00(0.f), a01(0.f), a10(0.f), a11(0.f), a20(0.f), a21(0.f), a30(0.f), a31(0.f);
    const float* kp = kt + j;
    for (int64_t d = 0; d < dim; ++d, kp += ldk) {
      const Vec k0 = Vec::loadu(kp), k1 = Vec::loadu(kp + kLanes);
      const Vec q0(q[d]), q1(q[dim + d]), q2(q[2 * dim + d]), q3(q[3 * dim + d]);
      a00 = at::vec::fmadd(q0, k0, a00);
      a01 = at::vec::fmadd(q0, k1, a01);
      a10 = at::vec::fmadd(q1, k0, a10);
      a11 = at::vec::fmadd(q1, k1, a11);
      a20 = at::vec::fmadd(q2, k0, a20);
      a21 = at::vec::fmadd(q2, k1, a21);
      a30 = at::vec::fmadd(q3, k0, a30);
      a31 = at::vec::fmadd(q3, k1, a31);
    }
    if (j < widest_lo || j + kCols > narrowest_hi) {  // a tile on an edge of some row's kept columns
      auto keep = [&](int64_t r, int64_t first) {  // lanes first.. of row r that lie in [lo[r], hi[r])
        return (lane >= Vec(static_cast<float>(lo[r] - first))) & (lane < Vec(static_cast<float>(hi[r] - first)));
      };
      a00 = Vec::blendv(neg_inf, a00, keep(0, j));
      a10 = Vec::blendv(neg_inf, a10, keep(1, j));
      a20 = Vec::blendv(neg_inf, a20, keep(2, j));
      a30 = Vec::blendv(neg_inf, a30, keep(3, j));
      a01 = Vec::blendv(neg_inf, a01, keep(0, j + kLanes));
      a11 = Vec::blendv(neg_inf, a11, keep(1, j + kLanes));
      a21 = Vec::blendv(neg_inf, a21, keep(2, j + kLanes));
      a31 = Vec::blendv(neg_inf, a31, keep(3, j + kLanes));
    }
    m0 = at::vec::maximum(m0, at::vec::maximum(a00, a01));
    m1 = at::vec::maximum(m1, at::vec::maximum(a10, a11));
    m2 = at::vec::maximum(m2, at::vec::maximum(a20, a21));
    m3 = at::vec::maximum(m3, at::vec::maximum(a30, a31));
    a00.store(s + j);
    a01.store(s + j + kLanes);
    a10.store(s + lds + j);
    a11.store(s + lds + j + kLanes);
    a20.store(s + 2 * lds + j);
    a21.store(s + 2 * lds + j + kLanes);
    a30.store(s + 3 * lds + j);
    a31.store(s + 3 * lds + j + kLanes);
  }
  auto vmax = [](Vec& a, Vec& b) { return at::vec::maximum(a, b); };
  row_max[0] = at::vec::vec_reduce_all<float>(vmax, m0);
  row_max[1] = at::vec::vec_reduce_all<float>(vmax, m1);
  row_max[2] = at::vec::vec_reduce_all<float>(vmax, m2);
  row_max[3] = at::vec::vec_reduce_all<float>(vmax, m3);
}

// acc[r][c] += sum_{j < nk} p[r][j] * v[j][c] for r < kRows and c < dp (a multiple of kCols).
// p: kRows rows of `ldp` floats; v: nk rows of `ldv` floats; acc: kRows rows of `lda` floats.
inline void pv_tile(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t nk, float* acc, int64_t lda,
                    int64_t dp) {
  for (int64_t c = 0; c < dp; c += kCols) {
    float* a = acc + c;
    Vec a00 = Vec::loadu(a), a01 = Vec::loadu(a + kLanes);
    Vec a10 = Vec::loadu(a + lda), a11 = Vec::loadu(a + lda + kLanes);
    Vec a20 = Vec::loadu(a + 2 * lda), a21 = Vec::loadu(a + 2 * lda + kLanes);
    Vec a30 = Vec::loadu(a + 3 * lda), a31 = Vec::loadu(a + 3 * lda + kLanes);
    const float* vp = v + c;
    for (int64_t j = 0; j < nk; ++j, vp += ldv) {
      const Vec v0 = Vec::loadu(vp), v1 = Vec::loadu(vp + kLanes);
      const Vec p0(p[j]), p1(p[ldp + j]), p2(p[2 * ldp + j]), p3(p[3 * ldp + j]);
      a00 = at::vec::fmadd(p0, v0, a00);
      a01 = at::vec::fmadd(p0, v1, a01);
      a10 = at::vec::fmadd(p1, v0, a10);
      a11 = at::vec::fmadd(p1, v1, a11);
      a20 = at::vec::fmadd(p2, v0, a20);
      a21 = at::vec::fmadd(p2, v1, a21);
      a30 = at::vec::fmadd(p3, v0, a30);
      a31 = at::vec::fmadd(p3, v1, a31);
    }
    a00.store(a);
    a01.store(a + kLanes);
    a10.store(a + lda);
    a11.store(a + lda + kLanes);
    a20.store(a + 2 * lda);
    a21.store(a + 2 * lda + kLanes);
    a30.store(a + 3 * lda);
    a31.store(a + 3 * lda + kLanes);
  }
}

// Where sequence b lives: element offset of its position 0 and the stride between its positions, per tensor.
struct Layout {
  const int32_t* cu_seqlens;  // packed form, else nullptr
  int64_t q_batch, q_pos, q_head, k_batch, k_pos, k_head, v_batch, v_pos, v_head;  // element strides
  int64_t seqlen;                                                                  // padded form: S
  int64_t heads, dim;

  int64_t first_row(int64_t b) const { return cu_seqlens ? cu_seqlens[b] : b * seqlen; }
  int64_t q_offset(int64_t b) const { return cu_seqlens ? cu_seqlens[b] * q_pos : b * q_batch; }
  int64_t k_offset(int64_t b) const { return cu_seqlens ? cu_seqlens[b] * k_pos : b * k_batch; }
  int64_t v_offset(int64_t b) const { return cu_seqlens ? cu_seqlens[b] * v_pos : b * v_batch; }
};

// Rows [q_begin, q_end) of one sequence and head; their keys are entries [key_begin, key_end) of the sequence's
// real keys (all of them without a window).
struct WorkItem {
  int64_t batch, head, q_begin, q_end, key_begin, key_end, cost;
};

// Per-thread fp32 scratch, sized once per call.
struct Scratch {
  std::vector<float> q, kt, v, s, acc, row_max, row_sum;
  Scratch(int64_t dim, int64_t dim_padded)
      : q(kQueryChunk * dim), kt(dim * kKeyBlock), v(kKeyBlock * dim_padded, 0.f), s(kRows * kKeyBlock),
        acc(kQueryChunk * dim_padded), row_max(kQueryChunk), row_sum(kQueryChunk) {}
};

// The first rows of an item's q, k and v (its whole sequence when short), fetched while the previous item runs.
template <typename scalar_t>
void prefetch_item_start(const WorkItem& item, const Layout& L, const scalar_t* q, const scalar_t* k,
                         const scalar_t* v, int64_t dim) {
  constexpr int64_t kRowsAhead = 16;
  const scalar_t* qb = q + L.q_offset(item.batch) + item.head * L.q_head + item.q_begin * L.q_pos;
  const scalar_t* kb = k + L.k_offset(item.batch) + item.head * L.k_head;
  const scalar_t* vb = v + L.v_offset(item.batch) + item.head * L.v_head;
  for (int64_t r = 0; r < std::min(kRowsAhead, item.q_end - item.q_begin); ++r) prefetch_row(qb + r * L.q_pos, dim);
  // Rows key_begin.. of the sequence: a masked padded batch's real keys may be others, a harmless guess.
  for (int64_t r = item.key_begin; r < std::min(item.key_begin + kRowsAhead, item.key_end); ++r) {
    prefetch_row(kb + r * L.k_pos, dim);
    prefetch_row(vb + r * L.v_pos, dim);
  }
}

// Columns [lo[r], hi[r]) of the block of keys key_begin.. (nk of them) that query row q_position + r may attend, for
// r < count: |position - key position| <= half_width (half_width < 0: every column). key_positions: the sequence's
// real keys' positions (sorted), nullptr when key index = position.
inline void window_columns(int64_t q_position, int64_t half_width, const int64_t* key_positions, int64_t key_begin,
                           int64_t nk, int64_t count, int64_t* lo, int64_t* hi) {
  for (int64_t r = 0; r < count; ++r) {
    if (half_width < 0) {
      lo[r] = 0, hi[r] = nk;
    } else if (key_positions == nullptr) {
      lo[r] = std::clamp<int64_t>(q_position + r - half_width - key_begin, 0, nk);
      hi[r] = std::clamp<int64_t>(q_position + r + half_width + 1 - key_begin, 0, nk);
    } else {
      const int64_t* first = key_positions + key_begin;
      lo[r] = std::lower_bound(first, first + nk, q_position + r - half_width) - first;
      hi[r] = std::upper_bound(first, first + nk, q_position + r + half_width) - first;
    }
  }
}

// Dropout on the probabilities (csrc/dropout_rng.h): keep (sequence, head, query, key) iff its uniform >= p.
struct Dropout {
  bool active;
  uint64_t stream;
  float p, keep_scale;
  int64_t seqlen;  // S of the padded layout the mask is indexed over (the packed form's max_seqlen)
};

template <typename scalar_t>
void attend_item(const WorkItem& item, const Layout& L, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 const int64_t* key_positions, int64_t half_width, float scale, const Dropout& drop, scalar_t* out,
                 Scratch& w) {
  const int64_t dim = L.dim, dp = round_up(dim, kCols);
  const int64_t rows = item.q_end - item.q_begin, rows_padded = round_up(rows, kRows);
  const scalar_t* qb = q + L.q_offset(item.batch) + item.head * L.q_head;
  const scalar_t* kb = k + L.k_offset(item.batch) + item.head * L.k_head;
  const scalar_t* vb = v + L.v_offset(item.batch) + item.head * L.v_head;
  float* qs = w.q.data();
  for (int64_t r = 0; r < rows_padded; ++r) {
    if (r < rows) {
      if (r + kPrefetchRows < rows) prefetch_row(qb + (item.q_begin + r + kPrefetchRows) * L.q_pos, dim);
      const scalar_t* src = qb + (item.q_begin + r) * L.q_pos;
      for (int64_t d = 0; d < dim; ++d) qs[r * dim + d] = static_cast<float>(src[d]) * scale;
    } else {
      std::fill(qs + r * dim, qs + (r + 1) * dim, 0.f);
    }
  }
  std::fill(w.acc.begin(), w.acc.begin() + rows_padded * dp, 0.f);
  std::fill(w.row_max.begin(), w.row_max.begin() + rows_padded, -std::numeric_limits<float>::infinity());
  std::fill(w.row_sum.begin(), w.row_sum.begin() + rows_padded, 0.f);

  for (int64_t k0 = item.key_begin; k0 < item.key_end; k0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, item.key_end - k0), nk_padded = round_up(nk, kCols);
    // Pack the block: K transposed [dim][kKeyBlock] (zero columns past nk), V [nk][dp].
    int64_t j_transposed = 0;
    if constexpr (std::is_same_v<scalar_t, float>) {
      // Whole 8-key x 8-dim tiles of contiguous key positions: an in-register transpose instead of scalar stores.
      if (key_positions == nullptr && dim % 8 == 0) {
        for (; j_transposed + 8 <= nk; j_transposed += 8) {
          const float* src = kb + (k0 + j_transposed) * L.k_pos;
          for (int64_t d = 0; d < dim; d += 8) {
            at::vec::transpose_mxn<float, 8, 8>(src + d, L.k_pos, w.kt.data() + d * kKeyBlock + j_transposed,
                                                kKeyBlock);
          }
        }
      }
    }
    for (int64_t j = 0; j < nk; ++j) {
      if (j + kPrefetchRows < nk) {
        const int64_t ahead = key_positions ? key_positions[k0 + j + kPrefetchRows] : k0 + j + kPrefetchRows;
        prefetch_row(kb + ahead * L.k_pos, dim);
        prefetch_row(vb + ahead * L.v_pos, dim);
      }
      const int64_t pos = key_positions ? key_positions[k0 + j] : k0 + j;
      const scalar_t* ks = kb + pos * L.k_pos;
      const scalar_t* vs = vb + pos * L.v_pos;
      float* vrow = w.v.data() + j * dp;
      for (int64_t d = 0; d < dim; ++d) vrow[d] = static_cast<float>(vs[d]);
      if (j >= j_transposed) {
        for (int64_t d = 0; d < dim; ++d) w.kt[d * kKeyBlock + j] = static_cast<float>(ks[d]);
      }
    }
    for (int64_t d = 0; d < dim; ++d) {
      std::fill(w.kt.data() + d * kKeyBlock + nk, w.kt.data() + d * kKeyBlock + nk_padded, 0.f);
    }

    for (int64_t r0 = 0; r0 < rows_padded; r0 += kRows) {
      // The columns this tile's rows attend, widened to whole register tiles: [first, last). (Rows past the
      // item's end are zero queries whose output is never stored.)
      int64_t lo[kRows], hi[kRows];
      window_columns(item.q_begin + r0, half_width, key_positions, k0, nk, kRows, lo, hi);
      const int64_t first = *std::min_element(lo, lo + kRows) / kCols * kCols;
      const int64_t last = round_up(*std::max_element(hi, hi + kRows), kCols);
      if (last <= first) continue;  // no row of this tile has a key in this block
      for (int64_t r = 0; r < kRows; ++r) lo[r] -= first, hi[r] -= first;
      const int64_t ncols = last - first;
      float* s = w.s.data();
      float tile_max[kRows];
      scores_tile(qs + r0 * dim, dim, w.kt.data() + first, kKeyBlock, ncols, lo, hi, s, kKeyBlock, tile_max);
      for (int64_t r = 0; r < kRows; ++r) {
        float* sr = s + r * kKeyBlock;
        const float block_max = tile_max[r];
        const float old_max = w.row_max[r0 + r];
        const float new_max = std::isnan(block_max) ? block_max : std::max(old_max, block_max);  // NaN in, NaN out
        if (new_max == -std::numeric_limits<float>::infinity()) {  // no key for this row yet: nothing to add
          std::fill(sr, sr + ncols, 0.f);
          continue;
        }
        const Vec new_max_v(new_max);
        Vec sum(0.f);
        for (int64_t j = 0; j < ncols; j += kLanes) {
          const Vec p = (Vec::loadu(sr + j) - new_max_v).exp_u20();
          p.store(sr + j);
          sum = sum + p;
        }
        const float block_sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
        const float alpha = old_max == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(old_max - new_max);
        w.row_sum[r0 + r] = w.row_sum[r0 + r] * alpha + block_sum;
        w.row_max[r0 + r] = new_max;
        if (alpha != 1.f && old_max != -std::numeric_limits<float>::infinity()) {  // first block: acc is 0
          float* ar = w.acc.data() + (r0 + r) * dp;
          const Vec alpha_v(alpha);
          for (int64_t c = 0; c < dp; c += kLanes) (Vec::loadu(ar + c) * alpha_v).store(ar + c);
        }
        if (drop.active && r0 + r < rows) {  // the sum above is of the kept and dropped: softmax, then dropout
          const uint64_t base = attention_dropout_index(item.batch, item.head, L.heads, drop.seqlen,
                                                        item.q_begin + r0 + r, 0);
          for (int64_t j = lo[r]; j < hi[r]; ++j) {
            const int64_t key = k0 + first + j;
            const int64_t position = key_positions ? key_positions[key] : key;
            sr[j] = dropout_uniform(drop.stream, base + position) >= drop.p ? sr[j] * drop.keep_scale : 0.f;
          }
        }
      }
      pv_tile(s, kKeyBlock, w.v.data() + first * dp, dp, std::min(last, nk) - first, w.acc.data() + r0 * dp, dp, dp);
    }
  }

  const int64_t out_row0 = L.first_row(item.batch) + item.q_begin;
  for (int64_t r = 0; r < rows; ++r) {
    const float total = w.row_sum[r];
    const Vec inv(total > 0.f ? 1.f / total : 0.f);  // no real key: zeros, not NaN
    const float* ar = w.acc.data() + r * dp;
    scalar_t* dst = out + ((out_row0 + r) * L.heads + item.head) * dim;
    for (int64_t c = 0; c < dim; c += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, dim - c);
      store_f(dst + c, Vec::loadu(ar + c, m) * inv, m);
    }
  }
}

// ------------------------------------------------------------------------ bf16 products: AMX or AVX512-BF16
#if defined(CPU_CAPABILITY_AVX512)  // bf16 CPUs all have AVX-512: builds for narrower ISAs use the vector kernel
constexpr int64_t kBrgemmRows = 32;       // AMX: query rows are padded to a multiple of this
constexpr int64_t kVnniRows = 8;          // AVX512-BF16: query rows per register tile (and their padding)
constexpr int64_t kBf16QueryChunk = 256;  // query rows per work item
constexpr int64_t kBf16Keys = 32;         // keys per block are padded to a multiple of this
constexpr int64_t kBf16KeyBlock = 256;    // keys per online-softmax step (128 ran slower on both, 512 on AMX)
constexpr int64_t kBf16MaxDim = 256;

// Per-thread bf16 tiles and fp32 accumulators for up to `rows` query rows and `keys` keys per block; scores and
// probabilities for `score_rows` of them at a time (all rows on AMX, one register tile's on AVX512-BF16). Allocated
// once per call and not initialised: every element read is written first, or read under a mask that drops it.
struct Bf16Scratch {
  std::unique_ptr<c10::BFloat16[]> q, k_rows, kt, v, p;
  std::unique_ptr<float[]> s, acc, row_max, row_sum;
  std::unique_ptr<int64_t[]> lo, hi;  // each row's columns of a block
  Bf16Scratch(int64_t rows, int64_t score_rows, int64_t keys, int64_t dim)
      : q(new c10::BFloat16[rows * dim]), k_rows(new c10::BFloat16[keys * dim]), kt(new c10::BFloat16[dim * keys]),
        v(new c10::BFloat16[keys * dim]), p(new c10::BFloat16[score_rows * keys]), s(new float[score_rows * keys]),
        acc(new float[rows * dim]), row_max(new float[rows]), row_sum(new float[rows]), lo(new int64_t[rows]),
        hi(new int64_t[rows]) {}
};

// Releases the AMX tile state a thread's brgemm calls configured, also when one of them throws.
struct BrgemmRelease {
  ~BrgemmRelease() { at::native::cpublas::brgemm_release(); }
};

// dst[0, n) = src[0, n) for a short bf16 row (a head's dim), inline: memmove's call costs more at these sizes.
inline void copy_row(const c10::BFloat16* src, int64_t n, c10::BFloat16* dst) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) BVec::loadu(src + i).store(dst + i);
  if (i < n) BVec::loadu(src + i, n - i).store(dst + i, n - i);
}

// out[2 i] = a[i], out[2 i + 1] = b[i] for i < n (b null: zeros): two V rows as VNNI pairs.
inline void interleave_rows(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n, c10::BFloat16* out) {
  // Word indices into (a, b) for permutex2var: even outputs from a (0..31), odd from b (32..63).
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  auto mask = [](int64_t count) { return count >= 32 ? ~__mmask32(0) : (__mmask32(1) << count) - 1; };
  for (int64_t i = 0; i < n; i += 32) {
    const int64_t m = std::min<int64_t>(32, n - i);
    const __m512i va = _mm512_maskz_loadu_epi16(mask(m), a + i);
    const __m512i vb = b ? _mm512_maskz_loadu_epi16(mask(m), b + i) : _mm512_setzero_si512();
    _mm512_mask_storeu_epi16(out + 2 * i, mask(2 * m), _mm512_permutex2var_epi16(va, low, vb));
    if (m > 16) _mm512_mask_storeu_epi16(out + 2 * i + 32, mask(2 * m - 32), _mm512_permutex2var_epi16(va, high, vb));
  }
}

// Pack keys [k0, k0 + nk) of one sequence and head for the two products, zero past nk up to nk_padded (even):
// kt = K^T in VNNI pairs [dim / 2][nk_padded][2], the B operand of Q K^T (a 32-bit transpose of K's rows, each
// pair (d, d + 1) one unit); v = V in VNNI pairs [nk_padded / 2][dim][2], the B operand of P V.
void pack_keys_vnni(const c10::BFloat16* kb, int64_t k_pos, const c10::BFloat16* vb, int64_t v_pos,
                    const int64_t* key_positions, int64_t k0, int64_t nk, int64_t nk_padded, int64_t dim,
                    Bf16Scratch& w) {
  auto position = [&](int64_t j) { return key_positions ? key_positions[k0 + j] : k0 + j; };
  c10::BFloat16* k_rows = w.k_rows.get();
  for (int64_t j = 0; j < nk_padded; j += 2) {
    if (j + kPrefetchRows < nk) {
      prefetch_row(kb + position(j + kPrefetchRows) * k_pos, dim);
      prefetch_row(vb + position(j + kPrefetchRows) * v_pos, dim);
    }
    const c10::BFloat16* v0 = j < nk ? vb + position(j) * v_pos : nullptr;
    const c10::BFloat16* v1 = j + 1 < nk ? vb + position(j + 1) * v_pos : nullptr;
    if (v0 == nullptr) {
      std::fill(w.v.get() + j * dim, w.v.get() + (j + 2) * dim, c10::BFloat16(0.f));
    } else {
      interleave_rows(v0, v1, dim, w.v.get() + j * dim);
    }
    for (int64_t r = j; r < j + 2; ++r) {
      if (r < nk) {
        copy_row(kb + position(r) * k_pos, dim, k_rows + r * dim);
      } else {
        std::fill(k_rows + r * dim, k_rows + (r + 1) * dim, c10::BFloat16(0.f));
      }
    }
  }
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(k_rows), dim / 2, reinterpret_cast<float*>(w.kt.get()),
                                nk_padded, static_cast<int>(nk_padded), static_cast<int>(dim / 2));
}

// exp(s * scale - shift) of 16 scores, computed as 2^x with x = s * scale log2(e) - shift log2(e): 2^n * p(f),
// n = round(x), p a degree-4 fit of 2^f on [-1/2, 1/2] (relative error 3.6e-6: the result is rounded to bf16,
// 3.9e-3, next; about half the instructions of at::vec's exp_u20). x is clamped at -150 (2^-150 is 0 in fp32), so
// -inf gives 0; NaN stays NaN.
inline __m512 exp_scaled(__m512 s, __m512 scale_log2e, __m512 shift_log2e) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-150.f), _mm512_fmsub_ps(s, scale_log2e, shift_log2e));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(0.0096760371f), f, _mm512_set1_ps(0.0559220356f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.240221074f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(0.693121034f));
  poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.00000008f));
  return _mm512_scalef_ps(poly, n);
}

// The lanes of columns col..col + 15 that lie in [lo, hi).
inline __mmask16 lanes_within(int64_t col, int64_t lo, int64_t hi) {
  const int64_t begin = std::clamp<int64_t>(lo - col, 0, 16), end = std::clamp<int64_t>(hi - col, 0, 16);
  return static_cast<__mmask16>(((1u << end) - 1) & ~((1u << begin) - 1));
}

// The largest of a row's scores in columns [lo, hi) (-inf when there are none; 0 <= lo), NaN when one is NaN
// (vmaxps alone would drop it).
inline float row_block_max(const float* s, int64_t lo, int64_t hi) {
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m[4] = {none, none, none, none};  // four chains of vmaxps, not one: latency, not throughput, bounded it
  __mmask16 nan = 0;
  auto take = [&](int i, __mmask16 lanes, __m512 x) {
    m[i] = _mm512_mask_max_ps(m[i], lanes, m[i], x);
    nan |= _mm512_mask_cmp_ps_mask(lanes, x, x, _CMP_UNORD_Q);
  };
  int64_t j = lo;
  for (; j + 64 <= hi; j += 64) {
    for (int i = 0; i < 4; ++i) take(i, 0xFFFF, _mm512_loadu_ps(s + j + 16 * i));
  }
  for (; j + 16 <= hi; j += 16) take(0, 0xFFFF, _mm512_loadu_ps(s + j));
  if (j < hi) take(1, lanes_within(j, lo, hi), _mm512_loadu_ps(s + j));
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
}

// p[0, n_padded) = bf16(exp(s * scale - shift)) for the scores in columns [lo, hi) and zeros elsewhere; returns the
// sum of the bf16 values, the weights P V multiplies by, so that the output is normalised by exactly them
// (normalising by the unrounded sum put a ModernBERT bf16 training step's loss 6.7e-3 off where plain PyTorch's was
// 1.1e-3).
__attribute__((target("avx512bf16")))  // vcvtne2ps2bf16 (bf16_attention_kernel checks the CPU has it)
inline float exp_row_bf16(const float* s, int64_t lo, int64_t hi, int64_t n_padded, float scale, float shift,
                          c10::BFloat16* p) {
  const __m512 scale_log2e = _mm512_set1_ps(scale * static_cast<float>(M_LOG2E));
  const __m512 shift_log2e = _mm512_set1_ps(shift * static_cast<float>(M_LOG2E));
  auto exp_at = [&](int64_t col) { return exp_scaled(_mm512_loadu_ps(s + col), scale_log2e, shift_log2e); };
  auto exp_within = [&](int64_t col) { return _mm512_maskz_mov_ps(lanes_within(col, lo, hi), exp_at(col)); };
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n_padded; j += 32) {  // n_padded is a multiple of kBf16Keys (32)
    const bool inside = j >= lo && j + 32 <= hi;  // most steps: no column to zero
    const __m512 low = inside ? exp_at(j) : exp_within(j), high = inside ? exp_at(j + 16) : exp_within(j + 16);
    const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(high, low);
    _mm512_storeu_si512(p + j, rounded);
    sum = _mm512_add_ps(sum, _mm512_add_ps(widen_bf16(_mm512_castsi512_si256(rounded)),
                                           widen_bf16(_mm512_extracti64x4_epi64(rounded, 1))));
  }
  return _mm512_reduce_add_ps(sum);
}

// One query row's online-softmax step over its scores in columns [lo, hi) of a block (unscaled; scale > 0): the
// running max and sum updated, the row's accumulator rescaled when the max moved, and the block's probabilities in
// bf16 into p[0, n_padded) (zeros outside [lo, hi)). row_max is -inf while the row has had no key (row_sum 0, acc
// unread); such a row keeps that state through a block without its keys.
inline void softmax_row_bf16(const float* s, int64_t lo, int64_t hi, int64_t n_padded, float scale, float& row_max,
                             float& row_sum, float* acc, int64_t dim, c10::BFloat16* p) {
  constexpr float kNoKey = -std::numeric_limits<float>::infinity();
  const float block_max = row_block_max(s, lo, hi) * scale;
  const float new_max = std::isnan(block_max) ? block_max : std::max(row_max, block_max);  // NaN in, NaN out
  if (new_max == kNoKey) {
    std::fill(p, p + n_padded, c10::BFloat16(0.f));
    return;
  }
  const float block_sum = exp_row_bf16(s, lo, hi, n_padded, scale, new_max, p);
  const bool had_keys = row_max != kNoKey;
  const float alpha = had_keys ? std::exp(row_max - new_max) : 0.f;
  if (had_keys && alpha != 1.f) {
    const Vec alpha_v(alpha);
    for (int64_t c = 0; c < dim; c += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, dim - c);
      (Vec::loadu(acc + c, m) * alpha_v).store(acc + c, m);
    }
  }
  row_sum = row_sum * alpha + block_sum;
  row_max = new_max;
}

// The item's query rows into w.q, zero rows after them up to rows_padded (the A operand of Q K^T).
void gather_queries(const c10::BFloat16* qb, int64_t q_pos, int64_t rows, int64_t rows_padded, int64_t dim,
                    Bf16Scratch& w) {
  for (int64_t r = 0; r < rows_padded; ++r) {
    if (r < rows) {
      copy_row(qb + r * q_pos, dim, w.q.get() + r * dim);
    } else {
      std::fill(w.q.get() + r * dim, w.q.get() + (r + 1) * dim, c10::BFloat16(0.f));
    }
  }
}

// out rows of the item = acc / row_sum in bf16 (zeros for a row without keys, whose acc may never have been
// written; NaN where the scores were).
void store_rows(const WorkItem& item, const Layout& L, int64_t rows, const Bf16Scratch& w, c10::BFloat16* out) {
  const int64_t dim = L.dim, out_row0 = L.first_row(item.batch) + item.q_begin;
  for (int64_t r = 0; r < rows; ++r) {
    c10::BFloat16* dst = out + ((out_row0 + r) * L.heads + item.head) * dim;
    if (w.row_max[r] == -std::numeric_limits<float>::infinity()) {
      std::fill(dst, dst + dim, c10::BFloat16(0.f));
      continue;
    }
    const Vec inv(1.f / w.row_sum[r]);
    const float* ar = w.acc.get() + r * dim;
    for (int64_t c = 0; c < dim; c += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, dim - c);
      store_f(dst + c, Vec::loadu(ar + c, m) * inv, m);
    }
  }
}

// Score rows [0, count) (ld_scores apart) hold query rows first.. of the item (`rows` of them real): each real
// row's online-softmax step over its columns [lo[r], hi[r]) of the block (its probabilities into the same row of
// w.p, n_padded of them), zero probabilities for padding rows, so that their (unused) accumulator rows stay finite.
void softmax_rows_bf16(int64_t first, int64_t count, int64_t rows, const int64_t* lo, const int64_t* hi,
                       int64_t n_padded, int64_t ld_scores, float scale, int64_t dim, Bf16Scratch& w) {
  for (int64_t r = 0; r < count; ++r) {
    c10::BFloat16* pr = w.p.get() + r * ld_scores;
    const int64_t row = first + r;
    if (row < rows) {
      softmax_row_bf16(w.s.get() + r * ld_scores, lo[r], hi[r], n_padded, scale, w.row_max[row], w.row_sum[row],
                       w.acc.get() + row * dim, dim, pr);
    } else {
      std::fill(pr, pr + n_padded, c10::BFloat16(0.f));
    }
  }
}

// What both bf16 kernels do around their products, for one item without dropout (scale > 0): its query rows
// gathered (padded to a multiple of row_padding), then per block of keys k0.. K and V packed into VNNI pairs and
// `products(k0, rows, rows_padded, nk, nk_padded, first_block)` run (S = Q K^T, the softmax, acc (+)= P V), then the
// rows stored.
template <typename Products>
void attend_item_bf16(const WorkItem& item, const Layout& L, const c10::BFloat16* q, const c10::BFloat16* k,
                      const c10::BFloat16* v, const int64_t* key_positions, int64_t row_padding, c10::BFloat16* out,
                      Bf16Scratch& w, const Products& products) {
  const int64_t dim = L.dim;
  const int64_t rows = item.q_end - item.q_begin, rows_padded = round_up(rows, row_padding);
  const c10::BFloat16* kb = k + L.k_offset(item.batch) + item.head * L.k_head;
  const c10::BFloat16* vb = v + L.v_offset(item.batch) + item.head * L.v_head;
  gather_queries(q + L.q_offset(item.batch) + item.head * L.q_head + item.q_begin * L.q_pos, L.q_pos, rows,
                 rows_padded, dim, w);
  std::fill_n(w.row_max.get(), rows, -std::numeric_limits<float>::infinity());
  std::fill_n(w.row_sum.get(), rows, 0.f);
  for (int64_t k0 = item.key_begin; k0 < item.key_end; k0 += kBf16KeyBlock) {
    const int64_t nk = std::min(kBf16KeyBlock, item.key_end - k0), nk_padded = round_up(nk, kBf16Keys);
    pack_keys_vnni(kb, L.k_pos, vb, L.v_pos, key_positions, k0, nk, nk_padded, dim, w);
    products(k0, rows, rows_padded, nk, nk_padded, k0 == item.key_begin);
  }
  store_rows(item, L, rows, w, out);
}

// c[r][0, n) (+)= sum_{i < 2 pairs} a[r][i] * b[i][0, n) for r < kVnniRows, with vdpbf16ps: a is bf16 rows of lda
// elements, b the VNNI pairs [pairs][ldb][2] (ldb >= n), c fp32 rows of ldc. 32 columns (two vectors) per step,
// the last step masked: columns at n and past it are neither read nor written.
__attribute__((target("avx512bf16")))
void gemm_tile_bf16(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* b, int64_t ldb, int64_t pairs,
                    int64_t n, float* c, int64_t ldc, bool accumulate) {
  auto lanes = [](int64_t count) {
    return count >= 16 ? __mmask16(0xFFFF) : count > 0 ? __mmask16((1u << count) - 1) : __mmask16(0);
  };
  for (int64_t col = 0; col < n; col += 32) {
    const __mmask16 m0 = lanes(n - col), m1 = lanes(n - col - 16);
    __m512 acc[kVnniRows][2];
#pragma GCC unroll 8
    for (int64_t r = 0; r < kVnniRows; ++r) {
      acc[r][0] = accumulate ? _mm512_maskz_loadu_ps(m0, c + r * ldc + col) : _mm512_setzero_ps();
      acc[r][1] = accumulate ? _mm512_maskz_loadu_ps(m1, c + r * ldc + col + 16) : _mm512_setzero_ps();
    }
    const c10::BFloat16* bp = b + 2 * col;
    for (int64_t i = 0; i < pairs; ++i, bp += 2 * ldb) {
      const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, bp);
      const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, bp + 32);
#pragma GCC unroll 8
      for (int64_t r = 0; r < kVnniRows; ++r) {
        int32_t pair;  // a[r][2 i], a[r][2 i + 1] as one unit, broadcast to every lane
        std::memcpy(&pair, a + r * lda + 2 * i, sizeof(pair));
        const __m512bh ar = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < kVnniRows; ++r) {
      _mm512_mask_storeu_ps(c + r * ldc + col, m0, acc[r][0]);
      _mm512_mask_storeu_ps(c + r * ldc + col + 16, m1, acc[r][1]);
    }
  }
}

// One item on the kernel's products: on AMX all its rows at once on brgemm micro-kernels, every key of each block
// (no window); with AVX512-BF16 alone, per tile of kVnniRows query rows, S = Q K^T over the columns its rows'
// windows reach (all of them without a window), the softmax and acc (+)= P V while the tile is in L1.
void attend_item_bf16_products(Bf16Kernel kernel, const WorkItem& item, const Layout& L, const c10::BFloat16* q,
                               const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* key_positions,
                               int64_t half_width, float scale, c10::BFloat16* out, Bf16Scratch& w) {
  const int64_t dim = L.dim;
  if (kernel == Bf16Kernel::kAmx) {
    attend_item_bf16(item, L, q, k, v, key_positions, kBrgemmRows, out, w,
                     [&](int64_t, int64_t rows, int64_t rows_padded, int64_t nk, int64_t nk_padded, bool first_block) {
                       at::native::cpublas::brgemm(rows_padded, nk_padded, dim, dim, nk_padded, nk_padded, false,
                                                   w.q.get(), w.kt.get(), w.s.get());
                       std::fill_n(w.lo.get(), rows_padded, 0);
                       std::fill_n(w.hi.get(), rows_padded, nk);
                       softmax_rows_bf16(0, rows_padded, rows, w.lo.get(), w.hi.get(), nk_padded, nk_padded, scale,
                                         dim, w);
                       // acc = P V on the first block, acc += P V after (acc already rescaled per row).
                       at::native::cpublas::brgemm(rows_padded, dim, nk_padded, nk_padded, dim, dim, !first_block,
                                                   w.p.get(), w.v.get(), w.acc.get());
                     });
    return;
  }
  bool tile_written[kBf16QueryChunk / kVnniRows] = {};  // whether a tile's acc rows hold anything yet
  attend_item_bf16(
      item, L, q, k, v, key_positions, kVnniRows, out, w,
      [&](int64_t k0, int64_t rows, int64_t rows_padded, int64_t nk, int64_t nk_padded, bool) {
        for (int64_t r0 = 0; r0 < rows_padded; r0 += kVnniRows) {
          int64_t lo[kVnniRows], hi[kVnniRows];
          const int64_t real_rows = std::min(kVnniRows, rows - r0);
          window_columns(item.q_begin + r0, half_width, key_positions, k0, nk, real_rows, lo, hi);
          // The tile's columns [first, last): from the first pair any real row attends to the last key any attends.
          int64_t first = nk, last = 0;
          for (int64_t r = 0; r < real_rows; ++r) {
            if (lo[r] < hi[r]) first = std::min(first, lo[r]), last = std::max(last, hi[r]);
          }
          if (last <= first) continue;  // no row of this tile has a key in this block
          first -= first % 2;
          for (int64_t r = 0; r < real_rows; ++r) {  // rows without a key here: the empty range [0, 0)
            const bool empty = lo[r] >= hi[r];
            lo[r] = empty ? 0 : lo[r] - first;
            hi[r] = empty ? 0 : hi[r] - first;
          }
          const int64_t n = last - first;
          gemm_tile_bf16(w.q.get() + r0 * dim, dim, w.kt.get() + 2 * first, nk_padded, dim / 2, n, w.s.get(),
                         nk_padded, false);
          softmax_rows_bf16(r0, kVnniRows, rows, lo, hi, round_up(n, kBf16Keys), nk_padded, scale, dim, w);
          // Columns past hi have zero probabilities (and keys past nk zero V rows): stop at the last pair with a key.
          bool& written = tile_written[r0 / kVnniRows];
          gemm_tile_bf16(w.p.get(), nk_padded, w.v.get() + first * dim, dim, (n + 1) / 2, dim, w.acc.get() + r0 * dim,
                         dim, written);
          written = true;
        }
      });
}

// Every item on one of the bf16-product kernels, threads taking the next item as they finish (`attention_cpu`'s
// contract).
void attend_items_bf16(Bf16Kernel kernel, const std::vector<WorkItem>& items, const Layout& L, const at::Tensor& q,
                       const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& key_positions,
                       int64_t positions_stride, int64_t longest, int64_t longest_keys, int64_t half_width, float scale,
                       at::Tensor& out) {
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const bool amx = kernel == Bf16Kernel::kAmx;
  const int64_t row_padding = amx ? kBrgemmRows : kVnniRows;
  const int64_t rows = std::min(round_up(kBf16QueryChunk, row_padding), round_up(longest, row_padding));
  const int64_t keys = std::min(kBf16KeyBlock, round_up(longest_keys, kBf16Keys));
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::optional<BrgemmRelease> release;
    if (amx) release.emplace();
    Bf16Scratch scratch(rows, amx ? rows : kVnniRows, keys, L.dim);
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next++; i < n_items; i = next++) {
        const int64_t* positions =
            key_positions.empty() ? nullptr : key_positions.data() + items[i].batch * positions_stride;
        attend_item_bf16_products(kernel, items[i], L, qp, kp, vp, positions, half_width, scale, op, scratch);
      }
    }
  });
}
#endif  // CPU_CAPABILITY_AVX512

void check_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen,
                          const std::optional<at::Tensor>& key_padding_mask) {
  constexpr const char* op = "attention";
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  check_float_dtype(q, op, "q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "fastbert::attention: q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(), "fastbert::attention: q, k, v must share one shape, got ",
              shape_str(q), ", ", shape_str(k), ", ", shape_str(v));
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(!key_padding_mask.has_value(),
                "fastbert::attention: give either cu_seqlens (packed) or key_padding_mask (padded), not both");
    TORCH_CHECK(q.dim() == 3, "fastbert::attention: the packed form takes q [total_tokens, heads, head_dim], got ",
                shape_str(q));
    const at::Tensor& cu = *cu_seqlens;
    check_cpu(cu, op, "cu_seqlens");
    TORCH_CHECK(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 2,
                "fastbert::attention: cu_seqlens must be int32 [batch + 1], got ", cu.scalar_type(), " ", shape_str(cu));
    TORCH_CHECK(max_seqlen.has_value(), "fastbert::attention: the packed form needs max_seqlen");
  } else {
    TORCH_CHECK(q.dim() == 4, "fastbert::attention: the padded form takes q [batch, seq, heads, head_dim], got ",
                shape_str(q));
    if (key_padding_mask.has_value()) {
      const at::Tensor& mask = *key_padding_mask;
      check_cpu(mask, op, "key_padding_mask");
      TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == q.size(0) &&
                      mask.size(1) == q.size(1),
                  "fastbert::attention: key_padding_mask must be bool [", q.size(0), ", ", q.size(1), "], got ",
                  mask.scalar_type(), " ", shape_str(mask));
    }
  }
  TORCH_CHECK(q.size(-1) > 0, "fastbert::attention: head_dim must be positive, got ", shape_str(q));
}

at::Tensor attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const std::optional<at::Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen,
                         const std::optional<at::Tensor>& key_padding_mask, std::optional<double> scale,
                         std::optional<int64_t> window, double dropout_p, int64_t dropout_seed) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "fastbert::attention: dropout_p must be in [0, 1], got ",
              dropout_p);
  check_attention_args(q_in, k_in, v_in, cu_seqlens, max_seqlen, key_padding_mask);
  TORCH_CHECK(!window.has_value() || *window >= 0,
              "fastbert::attention: window must be >= 0 (the total width, ModernBERT's local_attention), got ",
              window.value_or(0));
  auto unit_last = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);
  const bool packed = cu_seqlens.has_value();
  const int64_t heads = q.size(-2), dim = q.size(-1);
  const float softmax_scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(dim)));

  Layout L{};
  L.heads = heads;
  L.dim = dim;
  int64_t batch;
  at::Tensor cu;
  std::vector<int64_t> seq_lengths;
  if (packed) {
    cu = cu_seqlens->contiguous();
    const int32_t* c = cu.data_ptr<int32_t>();
    batch = cu.numel() - 1;
    TORCH_CHECK(c[0] == 0 && c[batch] == q.size(0), "fastbert::attention: cu_seqlens must run from 0 to total_tokens=",
                q.size(0), ", got ", c[0], " .. ", c[batch]);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = c[b + 1] - c[b];
      TORCH_CHECK(len >= 0, "fastbert::attention: cu_seqlens must be non-decreasing, got ", c[b], " then ", c[b + 1]);
      TORCH_CHECK(len <= *max_seqlen, "fastbert::attention: sequence ", b, " has ", len, " tokens, more than max_seqlen=",
                  *max_seqlen);
      seq_lengths.push_back(len);
    }
    L.cu_seqlens = c;
    L.q_pos = q.stride(0), L.q_head = q.stride(1);
    L.k_pos = k.stride(0), L.k_head = k.stride(1);
    L.v_pos = v.stride(0), L.v_head = v.stride(1);
  } else {
    batch = q.size(0);
    L.cu_seqlens = nullptr;
    L.seqlen = q.size(1);
    L.q_batch = q.stride(0), L.q_pos = q.stride(1), L.q_head = q.stride(2);
    L.k_batch = k.stride(0), L.k_pos = k.stride(1), L.k_head = k.stride(2);
    L.v_batch = v.stride(0), L.v_pos = v.stride(1), L.v_head = v.stride(2);
    seq_lengths.assign(batch, q.size(1));
  }

  // Real keys of each sequence: a position list when a padding mask has holes, else positions 0..len-1.
  std::vector<int64_t> key_positions, num_keys(seq_lengths);
  if (!packed && key_padding_mask.has_value()) {
    const at::Tensor mask = key_padding_mask->contiguous();
    const bool* m = mask.data_ptr<bool>();
    const int64_t S = L.seqlen;
    key_positions.resize(batch * S);
    for (int64_t b = 0; b < batch; ++b) {
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (m[b * S + s]) key_positions[b * S + n++] = s;
      num_keys[b] = n;
    }
  }

  // A window as wide as the longest sequence is global: -1, every key of the sequence.
  const int64_t longest = seq_lengths.empty() ? 0 : *std::max_element(seq_lengths.begin(), seq_lengths.end());
  const int64_t half_width = window.has_value() && *window / 2 < longest - 1 ? *window / 2 : -1;
  const int64_t S = packed ? 0 : L.seqlen;
#if defined(CPU_CAPABILITY_AVX512)
  Bf16Kernel bf16_kernel =
      dropout_p == 0.0 && softmax_scale > 0.f ? bf16_attention_kernel(q.scalar_type(), dim) : Bf16Kernel::kNone;
  // The AMX path computes whole blocks of keys; only the AVX512-BF16 tiles follow a window.
  if (half_width >= 0 && bf16_kernel == Bf16Kernel::kAmx) bf16_kernel = Bf16Kernel::kNone;
  // The bf16 kernels pack each block of keys once per item: longer chunks of queries pack them fewer times.
  const int64_t chunk = bf16_kernel != Bf16Kernel::kNone ? kBf16QueryChunk : kQueryChunk;
#else
  const int64_t chunk = kQueryChunk;
#endif
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* positions = key_positions.empty() ? nullptr : key_positions.data() + b * S;
    for (int64_t q0 = 0; q0 < seq_lengths[b]; q0 += chunk) {
      const int64_t q1 = std::min(seq_lengths[b], q0 + chunk);
      // The real keys that some row of q0..q1-1 may attend: a range of the sequence's key list.
      int64_t key_begin = 0, key_end = num_keys[b];
      if (half_width >= 0 && positions == nullptr) {
        key_begin = std::max<int64_t>(0, q0 - half_width);
        key_end = std::min(num_keys[b], q1 + half_width);
      } else if (half_width >= 0) {
        key_begin = std::lower_bound(positions, positions + num_keys[b], q0 - half_width) - positions;
        key_end = std::upper_bound(positions, positions + num_keys[b], q1 - 1 + half_width) - positions;
      }
      key_end = std::max(key_begin, key_end);
      const int64_t cost = (q1 - q0) * (key_end - key_begin + kRows);
      for (int64_t h = 0; h < heads; ++h) items.push_back({b, h, q0, q1, key_begin, key_end, cost});
    }
  }
  // Longest first, then threads take the next item as they finish: balanced even for very uneven lengths.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const Dropout drop{dropout_p > 0.0, dropout_stream(dropout_seed), static_cast<float>(dropout_p),
                     dropout_p >= 1.0 ? 0.f : static_cast<float>(1.0 / (1.0 - dropout_p)),
                     packed ? *max_seqlen : L.seqlen};
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
#if defined(CPU_CAPABILITY_AVX512)
  if (bf16_kernel != Bf16Kernel::kNone) {
    const int64_t longest_keys = num_keys.empty() ? 0 : *std::max_element(num_keys.begin(), num_keys.end());
    attend_items_bf16(bf16_kernel, items, L, q, k, v, key_positions, S, longest, longest_keys, half_width,
                      softmax_scale, out);
    return out;
  }
#endif
  const int64_t dp = round_up(dim, kCols);
  FASTBERT_DISPATCH_FLOAT(q.scalar_type(), "fastbert_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    std::atomic<int64_t> next{0};
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(dim, dp);
      for (int64_t worker = begin; worker < end; ++worker) {
        // Claim the next item before working on this one, so its first rows can be prefetched meanwhile.
        int64_t i = next++;
        while (i < n_items) {
          const int64_t following = next++;
          if (following < n_items) {
            prefetch_item_start(items[following], L, qp, kp, vp, dim);
          }
          const WorkItem& item = items[i];
          const int64_t* positions = key_positions.empty() ? nullptr : key_positions.data() + item.batch * S;
          attend_item<scalar_t>(item, L, qp, kp, vp, positions, half_width, softmax_scale, drop, op, scratch);
          i = following;
        }
      }
    });
  });
  return out;
}

}  // namespace

Bf16Kernel bf16_attention_kernel(at::ScalarType dtype, int64_t dim) {
#if defined(CPU_CAPABILITY_AVX512)
  const bool even_dim = dim > 0 && dim % 2 == 0 && dim <= kBf16MaxDim;
  if (dtype != at::kBFloat16 || !even_dim || !__builtin_cpu_supports("avx512bf16")) {
    return Bf16Kernel::kNone;
  }
  // ATen's brgemm needs AMX (could_pack: oneDNN's ukernel wants B packed for AMX tiles).
  return at::native::cpublas::could_pack(at::kBFloat16) ? Bf16Kernel::kAmx : Bf16Kernel::kAvx512Bf16;
#else
  return Bf16Kernel::kNone;
#endif
}

}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert, CPU, m) { m.impl("cpp_attention", &fastbert::attention_cpu); }
