// Backward of fastbert::attention on CPU (the cpp backend's autograd formula, fastbert/cpp_backend.py): dq, dk, dv
// from q, k, v and the output's gradient, with probabilities recomputed per block, so no [S, S] matrix exists for the
// batch and the cost follows each sequence's real length (packed form) or real keys (padded form with a mask).
//
// Work item: one (sequence, head), claimed by threads longest first. Its real keys' K and V rows, and per chunk of
// query rows their Q and dO rows, are packed into fp32 tiles; per chunk, the keys that chunk's windows reach:
//   S  = Q K^T                                   (scores before the scale)
//   P  = softmax(S * scale) per row over its allowed keys (a row without one: zeros, as the forward's output)
//   dP = dO V^T, times the keep mask and 1 / (1 - p) with dropout (regenerated: csrc/dropout_rng.h)
//   delta = rowsum(P * dP)                       (= rowsum(dO * out): no need to keep the output)
//   dS = P * (dP - delta) * scale
//   dQ = dS K,  dK += dS^T Q,  dV += dropped(P)^T dO
// The products are BLAS GEMMs (at::mm_out on the scratch, one thread each inside the item threads), everything in fp32
// (bf16 in, bf16 out). The chunk height keeps a chunk's score tiles under ~2 MiB whatever the sequence length.
// Masked keys are never read (NaN stored there reaches nothing) and their dk, dv are zero; padded query rows (padded
// form) get the gradient of the output the forward computed for them.
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "dropout_rng.h"
#include "fastbert.h"

namespace fastbert {
namespace {

constexpr int64_t kScoreElements = 1 << 18;  // per chunk: rows x keys of one score tile (fp32: 1 MiB)
constexpr int64_t kMinChunkRows = 16, kMaxChunkRows = 256;

// Row-major C[m, n] = op(A) op(B) (+ C when accumulate), op(X) = X^T when trans_x; fp32 matrices with unit column
// stride and row stride ld_x (as stored, before op). at::mm_out on views of the scratch: PyTorch's BLAS (MKL where
// built with it), single-threaded inside the item threads.
inline void gemm_rm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                    const float* b, int64_t ldb, bool accumulate, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  auto view = [&](const float* p, int64_t rows, int64_t cols, int64_t ld, bool trans) {
    const int64_t sizes[2] = {trans ? cols : rows, trans ? rows : cols};  // as stored
    at::Tensor t = at::from_blob(const_cast<float*>(p), at::IntArrayRef(sizes, 2), {ld, 1}, options);
    return trans ? t.t() : t;
  };
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, options);
  if (accumulate) {
    at::addmm_out(out, out, view(a, m, k, lda, trans_a), view(b, k, n, ldb, trans_b));
  } else {
    at::mm_out(out, view(a, m, k, lda, trans_a), view(b, k, n, ldb, trans_b));
  }
}

// One tensor's element strides (packed: per token and head; padded: per sequence, position and head).
struct Strides {
  int64_t batch, pos, head;
};

inline Strides strides_of(const at::Tensor& t, bool packed) {
  return packed ? Strides{0, t.stride(0), t.stride(1)} : Strides{t.stride(0), t.stride(1), t.stride(2)};
}

struct Problem {
  bool packed;
  const int32_t* cu_seqlens;
  int64_t batch, heads, dim, seqlen;  // seqlen: padded S, or max_seqlen (the dropout index's layout)
  std::vector<int64_t> lengths;       // query rows per sequence
  std::vector<int64_t> num_keys;      // real keys per sequence
  std::vector<int64_t> key_positions;  // [batch, S] real keys' positions (padded form with a mask), else empty
  int64_t half_width;                  // -1: global
  float scale;
  // dropout
  bool dropout;
  uint64_t stream;
  float drop_p, keep_scale;

  int64_t offset(const Strides& s, int64_t b, int64_t pos, int64_t h) const {
    return packed ? (cu_seqlens[b] + pos) * s.pos + h * s.head : b * s.batch + pos * s.pos + h * s.head;
  }
  const int64_t* positions(int64_t b) const {
    return key_positions.empty() ? nullptr : key_positions.data() + b * seqlen;
  }
};

struct Scratch {
  std::vector<float> k, v, dk, dv, q, dout, dq, p, dp, keep;
};

inline int64_t key_position(const int64_t* positions, int64_t key) { return positions ? positions[key] : key; }

// Keys [begin, end) of the sequence's real-key list that query position `query` may attend.
inline void row_keys(const Problem& pr, const int64_t* positions, int64_t n_keys, int64_t query, int64_t* begin,
                     int64_t* end) {
  if (pr.half_width < 0) {
    *begin = 0, *end = n_keys;
  } else if (positions == nullptr) {
    *begin = std::clamp<int64_t>(query - pr.half_width, 0, n_keys);
    *end = std::clamp<int64_t>(query + pr.half_width + 1, 0, n_keys);
  } else {
    *begin = std::lower_bound(positions, positions + n_keys, query - pr.half_width) - positions;
    *end = std::upper_bound(positions, positions + n_keys, query + pr.half_width) - positions;
  }
  *end = std::max(*begin, *end);
}

template <typename scalar_t>
void load_rows(const scalar_t* base, const Strides& s, const Problem& pr, int64_t b, int64_t h,
               const int64_t* positions, int64_t first, int64_t count, float* dst) {
  const int64_t dim = pr.dim;
  for (int64_t r = 0; r < count; ++r) {
    const scalar_t* src = base + pr.offset(s, b, key_position(positions, first + r), h);
    float* row = dst + r * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(src[d]);
  }
}

template <typename scalar_t>
void store_rows(const float* src, const Strides& s, const Problem& pr, int64_t b, int64_t h,
                const int64_t* positions, int64_t first, int64_t count, scalar_t* base) {
  const int64_t dim = pr.dim;
  for (int64_t r = 0; r < count; ++r) {
    scalar_t* dst = base + pr.offset(s, b, key_position(positions, first + r), h);
    const float* row = src + r * dim;
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<scalar_t>(row[d]);
  }
}

struct Tensors {
  Strides q, k, v, grad, out;  // out: dq, dk, dv (contiguous, shaped like q)
};

template <typename scalar_t>
void backward_item(const Problem& pr, const Tensors& st, int64_t b, int64_t h, const scalar_t* q, const scalar_t* k,
                   const scalar_t* v, const scalar_t* grad, scalar_t* dq, scalar_t* dk, scalar_t* dv, Scratch& w) {
  const int64_t dim = pr.dim, rows = pr.lengths[b], n_keys = pr.num_keys[b];
  const int64_t* positions = pr.positions(b);
  if (rows == 0 || n_keys == 0) return;  // no query, or no key: every gradient stays zero
  w.k.resize(n_keys * dim), w.v.resize(n_keys * dim);
  w.dk.assign(n_keys * dim, 0.f), w.dv.assign(n_keys * dim, 0.f);
  load_rows(k, st.k, pr, b, h, positions, 0, n_keys, w.k.data());
  load_rows(v, st.v, pr, b, h, positions, 0, n_keys, w.v.data());

  // Chunk height: a score tile of rows x (keys a chunk may reach) under kScoreElements.
  const int64_t reach = pr.half_width < 0 ? n_keys : std::min(n_keys, 2 * pr.half_width + 1 + kMaxChunkRows);
  const int64_t chunk = std::clamp<int64_t>(kScoreElements / std::max<int64_t>(reach, 1), kMinChunkRows, kMaxChunkRows);
  w.q.resize(chunk * dim), w.dout.resize(chunk * dim), w.dq.resize(chunk * dim);
  std::vector<int64_t> lo(chunk), hi(chunk);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  for (int64_t q0 = 0; q0 < rows; q0 += chunk) {
    const int64_t nq = std::min(chunk, rows - q0);
    // Keys of this chunk: the union of its rows' ranges (rows' ranges are monotone in the query position).
    int64_t key_begin = n_keys, key_end = 0;
    for (int64_t r = 0; r < nq; ++r) {
      row_keys(pr, positions, n_keys, q0 + r, &lo[r], &hi[r]);
      if (hi[r] > lo[r]) key_begin = std::min(key_begin, lo[r]), key_end = std::max(key_end, hi[r]);
    }
    if (key_end <= key_begin) continue;  // no row has a key: zero gradients (dq stays zero)
    load_rows(grad, st.grad, pr, b, h, nullptr, q0, nq, w.dout.data());
    const int64_t nk = key_end - key_begin;
    w.p.resize(nq * nk), w.dp.resize(nq * nk), w.keep.resize(nk);
    load_rows(q, st.q, pr, b, h, nullptr, q0, nq, w.q.data());
    const float* kc = w.k.data() + key_begin * dim;
    const float* vc = w.v.data() + key_begin * dim;
    float* p = w.p.data();
    float* dp = w.dp.data();
    gemm_rm(false, true, nq, nk, dim, w.q.data(), dim, kc, dim, false, p, nk);      // S = Q K^T
    gemm_rm(false, true, nq, nk, dim, w.dout.data(), dim, vc, dim, false, dp, nk);  // dP = dO V^T
    for (int64_t r = 0; r < nq; ++r) {
      float* pr_row = p + r * nk;
      float* dp_row = dp + r * nk;
      const int64_t first = lo[r] - key_begin, last = hi[r] - key_begin;  // allowed columns [first, last)
      if (last <= first) {
        std::fill(pr_row, pr_row + nk, 0.f), std::fill(dp_row, dp_row + nk, 0.f);
        continue;
      }
      std::fill(pr_row, pr_row + first, 0.f), std::fill(pr_row + last, pr_row + nk, 0.f);
      const Vec scale_v(pr.scale);
      Vec max_v(neg_inf);
      int64_t j = first;
      for (; j + kLanes <= last; j += kLanes) max_v = at::vec::maximum(max_v, Vec::loadu(pr_row + j) * scale_v);
      float row_max = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, max_v);
      for (; j < last; ++j) row_max = std::max(row_max, pr_row[j] * pr.scale);
      const Vec row_max_v(row_max);
      Vec sum_v(0.f);
      for (j = first; j + kLanes <= last; j += kLanes) {
        const Vec e = (Vec::loadu(pr_row + j) * scale_v - row_max_v).exp();
        e.store(pr_row + j);
        sum_v = sum_v + e;
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum_v);
      for (; j < last; ++j) {
        const float e = std::exp(pr_row[j] * pr.scale - row_max);
        pr_row[j] = e;
        sum += e;
      }
      const float inv = 1.f / sum;
      float delta = 0.f;
      if (pr.dropout) {  // dP sees the mask (out = dropped(P) V), V the dropped probabilities
        float* keep = w.keep.data();
        const uint64_t base = attention_dropout_index(b, h, pr.heads, pr.seqlen, q0 + r, 0);
        for (int64_t j = first; j < last; ++j) {
          const int64_t key = key_position(positions, key_begin + j);
          keep[j] = dropout_uniform(pr.stream, base + key) >= pr.drop_p ? pr.keep_scale : 0.f;
          pr_row[j] *= inv;
          dp_row[j] *= keep[j];
          delta += pr_row[j] * dp_row[j];
        }
        for (int64_t j = first; j < last; ++j) {
          dp_row[j] = pr_row[j] * (dp_row[j] - delta) * pr.scale;
          pr_row[j] *= keep[j];
        }
      } else {
        for (int64_t j = first; j < last; ++j) {
          pr_row[j] *= inv;
          delta += pr_row[j] * dp_row[j];
        }
        for (int64_t j = first; j < last; ++j) dp_row[j] = pr_row[j] * (dp_row[j] - delta) * pr.scale;
      }
      std::fill(dp_row, dp_row + first, 0.f), std::fill(dp_row + last, dp_row + nk, 0.f);
    }
    // dQ = dS K; dK += dS^T Q; dV += P^T dO
    gemm_rm(false, false, nq, dim, nk, dp, nk, kc, dim, false, w.dq.data(), dim);
    gemm_rm(true, false, nk, dim, nq, dp, nk, w.q.data(), dim, true, w.dk.data() + key_begin * dim, dim);
    gemm_rm(true, false, nk, dim, nq, p, nk, w.dout.data(), dim, true, w.dv.data() + key_begin * dim, dim);
    store_rows(w.dq.data(), st.out, pr, b, h, nullptr, q0, nq, dq);
  }
  store_rows(w.dk.data(), st.out, pr, b, h, positions, 0, n_keys, dk);
  store_rows(w.dv.data(), st.out, pr, b, h, positions, 0, n_keys, dv);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& cu_seqlens, std::optional<int64_t> max_seqlen,
    const std::optional<at::Tensor>& key_padding_mask, std::optional<double> scale, std::optional<int64_t> window,
    double dropout_p, int64_t dropout_seed) {
  constexpr const char* op = "attention_backward";
  for (const at::Tensor* t : {&grad_in, &q_in, &k_in, &v_in}) {
    check_cpu(*t, op, "q, k, v and grad");
    check_float_dtype(*t, op, "q, k, v and grad");
    TORCH_CHECK(t->scalar_type() == q_in.scalar_type() && t->sizes() == q_in.sizes(),
                "fastbert::attention_backward: q, k, v and grad must share q's dtype and shape ", shape_str(q_in),
                ", got ", t->scalar_type(), " ", shape_str(*t));
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "fastbert::attention_backward: dropout_p must be in [0, 1], got ",
              dropout_p);
  TORCH_CHECK(!window.has_value() || *window >= 0, "fastbert::attention_backward: window must be >= 0, got ",
              window.value_or(0));
  auto unit_last = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in), grad = unit_last(grad_in);

  Problem pr{};
  pr.packed = cu_seqlens.has_value();
  pr.heads = q.size(-2);
  pr.dim = q.size(-1);
  pr.scale = static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(pr.dim)));
  at::Tensor cu, mask;
  if (pr.packed) {
    TORCH_CHECK(q.dim() == 3 && !key_padding_mask.has_value() && max_seqlen.has_value(),
                "fastbert::attention_backward: the packed form takes q [T, heads, D], cu_seqlens and max_seqlen, no "
                "key_padding_mask; got q ", shape_str(q));
    cu = cu_seqlens->contiguous();
    check_cpu(cu, op, "cu_seqlens");
    TORCH_CHECK(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 2,
                "fastbert::attention_backward: cu_seqlens must be int32 [batch + 1]");
    pr.cu_seqlens = cu.data_ptr<int32_t>();
    pr.batch = cu.numel() - 1;
    pr.seqlen = *max_seqlen;
    TORCH_CHECK(pr.cu_seqlens[0] == 0 && pr.cu_seqlens[pr.batch] == q.size(0),
                "fastbert::attention_backward: cu_seqlens must run from 0 to total_tokens=", q.size(0));
    for (int64_t b = 0; b < pr.batch; ++b) {
      const int64_t len = pr.cu_seqlens[b + 1] - pr.cu_seqlens[b];
      TORCH_CHECK(len >= 0 && len <= pr.seqlen, "fastbert::attention_backward: sequence ", b, " has ", len,
                  " tokens (max_seqlen ", pr.seqlen, ")");
      pr.lengths.push_back(len);
    }
    pr.num_keys = pr.lengths;
  } else {
    TORCH_CHECK(q.dim() == 4, "fastbert::attention_backward: the padded form takes q [B, S, heads, D], got ",
                shape_str(q));
    pr.cu_seqlens = nullptr;
    pr.batch = q.size(0);
    pr.seqlen = q.size(1);
    pr.lengths.assign(pr.batch, pr.seqlen);
    pr.num_keys = pr.lengths;
    if (key_padding_mask.has_value()) {
      mask = key_padding_mask->contiguous();
      check_cpu(mask, op, "key_padding_mask");
      TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == pr.batch &&
                      mask.size(1) == pr.seqlen,
                  "fastbert::attention_backward: key_padding_mask must be bool [", pr.batch, ", ", pr.seqlen, "]");
      const bool* m = mask.data_ptr<bool>();
      pr.key_positions.resize(pr.batch * pr.seqlen);
      for (int64_t b = 0; b < pr.batch; ++b) {
        int64_t n = 0;
        for (int64_t s = 0; s < pr.seqlen; ++s)
          if (m[b * pr.seqlen + s]) pr.key_positions[b * pr.seqlen + n++] = s;
        pr.num_keys[b] = n;
      }
    }
  }
  // The forward's rule: a window as wide as the longest sequence is global.
  const int64_t longest = pr.lengths.empty() ? 0 : *std::max_element(pr.lengths.begin(), pr.lengths.end());
  pr.half_width = window.has_value() && *window / 2 < longest - 1 ? *window / 2 : -1;
  pr.dropout = dropout_p > 0.0;
  pr.stream = dropout_stream(dropout_seed);
  pr.drop_p = static_cast<float>(dropout_p);
  pr.keep_scale = dropout_p >= 1.0 ? 0.f : static_cast<float>(1.0 / (1.0 - dropout_p));

  at::Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(q.sizes(), q.options()),
             dv = at::zeros(q.sizes(), q.options());
  Tensors st{strides_of(q, pr.packed), strides_of(k, pr.packed), strides_of(v, pr.packed),
             strides_of(grad, pr.packed), strides_of(dq, pr.packed)};

  // (sequence, head) items, the most work first; threads claim the next as they finish.
  std::vector<std::pair<int64_t, int64_t>> items;  // (cost, sequence)
  for (int64_t b = 0; b < pr.batch; ++b) {
    const int64_t reach = pr.half_width < 0 ? pr.num_keys[b] : std::min(pr.num_keys[b], 2 * pr.half_width + 1);
    if (pr.lengths[b] > 0 && pr.num_keys[b] > 0) items.emplace_back(pr.lengths[b] * reach, b);
  }
  std::stable_sort(items.begin(), items.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  const int64_t n_items = static_cast<int64_t>(items.size()) * pr.heads;
  if (n_items == 0) return {dq, dk, dv};
  FASTBERT_DISPATCH_FLOAT(q.scalar_type(), "fastbert_attention_backward", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* dqp = dq.data_ptr<scalar_t>();
    scalar_t* dkp = dk.data_ptr<scalar_t>();
    scalar_t* dvp = dv.data_ptr<scalar_t>();
    std::atomic<int64_t> next{0};
    const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t worker = begin; worker < end; ++worker) {
        for (int64_t i = next++; i < n_items; i = next++) {
          const int64_t b = items[i / pr.heads].second, h = i % pr.heads;
          backward_item<scalar_t>(pr, st, b, h, qp, kp, vp, gp, dqp, dkp, dvp, scratch);
        }
      }
    });
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_FRAGMENT(fastbert, m) {
  // Gradients (dq, dk, dv) of fastbert::attention given the output's gradient, the forward's arguments after it.
  m.def("cpp_attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens, int? max_seqlen, "
        "Tensor? key_padding_mask, float? scale, int? window=None, float dropout_p=0.0, int dropout_seed=0) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastbert, CPU, m) { m.impl("cpp_attention_backward", &fastbert::attention_backward_cpu); }
