// LayerNorm kernels, one pass over memory each:
// - embedding_layernorm: gather word (+ position) (+ token type) rows, sum, LayerNorm, store.
// - bias_residual_layernorm: LayerNorm(x + bias + residual), written over x's buffer when the caller owns it.
// - linear_residual_layernorm: a PyTorch GEMM without bias, then the fused kernel above in place on its output.
// - linear_residual_prenorm: a PyTorch GEMM without bias, then one pass writing both the sum x + bias + residual
//   (over the GEMM output) and its LayerNorm (pre-LN layers: the sum is the next residual stream).
// Every LayerNorm bias may be absent (no shift: ModernBERT's norm_bias=False).
// Rows are independent and split over threads with at::parallel_for; statistics in fp32 in an L1-resident row
// buffer. Limits: CPU, float32 or bfloat16 (tables/activations and LayerNorm parameters of one dtype).
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "fastbert.h"

namespace fastbert {
namespace {

// ---------------------------------------------------------------------------------------------- embedding + LN
template <typename scalar_t, typename index_t>
void embedding_layernorm_kernel(const index_t* ids, const index_t* positions, const index_t* types, int64_t rows,
                                const scalar_t* word, int64_t vocab, const scalar_t* position_table,
                                int64_t max_positions, const scalar_t* type_table, int64_t type_vocab,
                                const scalar_t* weight, const scalar_t* bias, double eps, int64_t width,
                                scalar_t* out) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t id = ids[r];
      TORCH_CHECK(id >= 0 && id < vocab, "fastbert::embedding_layernorm: input_ids holds ", id,
                  ", outside the vocabulary [0, ", vocab, ")");
      const scalar_t* w = word + id * width;
      const scalar_t* p = nullptr;
      if (position_table != nullptr) {
        const int64_t pos = positions[r];
        TORCH_CHECK(pos >= 0 && pos < max_positions, "fastbert::embedding_layernorm: position_ids holds ", pos,
                    ", outside [0, ", max_positions, ")");
        p = position_table + pos * width;
      }
      const scalar_t* t = nullptr;
      if (type_table != nullptr) {
        const int64_t type = types == nullptr ? 0 : types[r];
        TORCH_CHECK(type >= 0 && type < type_vocab, "fastbert::embedding_layernorm: token_type_ids holds ", type,
                    ", outside [0, ", type_vocab, ")");
        t = type_table + type * width;
      }
      for (int64_t i = 0; i < width; i += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, width - i);
        Vec s = load_f(w + i, m);
        if (p != nullptr) s = s + load_f(p + i, m);
        if (t != nullptr) s = s + load_f(t + i, m);
        s.store(row.data() + i, m);
      }
      layernorm_row(row.data(), width, weight, bias, eps, out + r * width);
    }
  });
}

at::Tensor embedding_layernorm_cpu(const at::Tensor& input_ids, const std::optional<at::Tensor>& position_ids,
                                   const std::optional<at::Tensor>& token_type_ids, const at::Tensor& word_embeddings,
                                   const std::optional<at::Tensor>& position_embeddings,
                                   const std::optional<at::Tensor>& token_type_embeddings, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, double eps, double dropout_p,
                                   int64_t dropout_seed) {
  // Dropout: the schema's arguments (one schema for every backend); this kernel has none, its supports() says so.
  TORCH_CHECK(dropout_p == 0.0, "fastbert::embedding_layernorm: the cpp kernel has no dropout");
  constexpr const char* op = "embedding_layernorm";
  check_cpu(input_ids, op, "input_ids");
  TORCH_CHECK(input_ids.scalar_type() == at::kLong || input_ids.scalar_type() == at::kInt,
              "fastbert::embedding_layernorm: input_ids must be int64 or int32, got ", input_ids.scalar_type());
  TORCH_CHECK(word_embeddings.dim() == 2, "fastbert::embedding_layernorm: word_embeddings must be [V, E], got ",
              shape_str(word_embeddings));
  check_cpu(word_embeddings, op, "word_embeddings");
  check_float_dtype(word_embeddings, op, "word_embeddings");
  const auto dtype = word_embeddings.scalar_type();
  const int64_t width = word_embeddings.size(1);
  auto check_table = [&](const at::Tensor& table, const char* name) {
    check_cpu(table, op, name);
    TORCH_CHECK(table.dim() == 2 && table.size(1) == width, "fastbert::embedding_layernorm: ", name,
                " must be [rows, ", width, "] like word_embeddings, got ", shape_str(table));
    TORCH_CHECK(table.scalar_type() == dtype, "fastbert::embedding_layernorm: ", name, " must be ", dtype,
                " like word_embeddings, got ", table.scalar_type());
  };
  auto check_ids = [&](const at::Tensor& ids, const char* name) {
    check_cpu(ids, op, name);
    TORCH_CHECK(ids.sizes() == input_ids.sizes(), "fastbert::embedding_layernorm: ", name, " must have input_ids' shape ",
                shape_str(input_ids), ", got ", shape_str(ids));
    TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "fastbert::embedding_layernorm: ",
                name, " must be int64 or int32, got ", ids.scalar_type());
  };
  TORCH_CHECK(position_ids.has_value() == position_embeddings.has_value(),
              "fastbert::embedding_layernorm: position_ids and position_embeddings must be given together (or both "
              "None: no position table)");
  if (position_embeddings.has_value()) check_table(*position_embeddings, "position_embeddings");
  if (position_ids.has_value()) check_ids(*position_ids, "position_ids");
  if (token_type_embeddings.has_value()) check_table(*token_type_embeddings, "token_type_embeddings");
  if (token_type_ids.has_value()) check_ids(*token_type_ids, "token_type_ids");
  check_vector(weight, width, dtype, op, "weight");
  if (bias.has_value()) check_vector(*bias, width, dtype, op, "bias");

  // One index dtype for the kernel: int64 unless every id tensor is int32 (narrowing an int64 id could wrap it
  // past the range checks).
  const bool all_int32 = input_ids.scalar_type() == at::kInt &&
                         (!position_ids.has_value() || position_ids->scalar_type() == at::kInt) &&
                         (!token_type_ids.has_value() || token_type_ids->scalar_type() == at::kInt);
  const auto index_type = all_int32 ? at::kInt : at::kLong;
  auto as_index = [&](const at::Tensor& ids) { return ids.to(index_type).contiguous(); };
  const at::Tensor ids = as_index(input_ids);
  at::Tensor positions, pos_table;
  if (position_embeddings.has_value()) {
    positions = as_index(*position_ids);
    pos_table = position_embeddings->contiguous();
  }
  at::Tensor types;
  if (token_type_ids.has_value() && token_type_embeddings.has_value()) types = as_index(*token_type_ids);
  const at::Tensor word = word_embeddings.contiguous();
  at::Tensor type_table;
  if (token_type_embeddings.has_value()) type_table = token_type_embeddings->contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();

  auto out_sizes = input_ids.sizes().vec();
  out_sizes.push_back(width);
  at::Tensor out = at::empty(out_sizes, word.options());
  const int64_t rows = ids.numel();
  FASTBERT_DISPATCH_FLOAT(dtype, "fastbert_embedding_layernorm", [&] {
    AT_DISPATCH_INDEX_TYPES(index_type, "fastbert_embedding_layernorm_ids", [&] {
      embedding_layernorm_kernel<scalar_t, index_t>(
          ids.data_ptr<index_t>(), positions.defined() ? positions.data_ptr<index_t>() : nullptr,
          types.defined() ? types.data_ptr<index_t>() : nullptr, rows, word.data_ptr<scalar_t>(), word.size(0),
          pos_table.defined() ? pos_table.data_ptr<scalar_t>() : nullptr, pos_table.defined() ? pos_table.size(0) : 0,
          type_table.defined() ? type_table.data_ptr<scalar_t>() : nullptr,
          type_table.defined() ? type_table.size(0) : 0, w.data_ptr<scalar_t>(),
          b.defined() ? b.data_ptr<scalar_t>() : nullptr, eps, width, out.data_ptr<scalar_t>());
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------- bias + residual + LN
// x and residual: row-major with row strides x_stride / residual_stride (unit column stride); out contiguous,
// and may be x itself. bias and ln_bias may be null. summed (null, or [rows, width] contiguous, and may be x):
// where to store x + bias + residual as well, in which case out is the LayerNorm of that stored (rounded) sum.
template <typename scalar_t>
void bias_residual_layernorm_kernel(const scalar_t* x, int64_t x_stride, const scalar_t* bias,
                                    const scalar_t* residual, int64_t residual_stride, const scalar_t* weight,
                                    const scalar_t* ln_bias, double eps, int64_t rows, int64_t width, scalar_t* out,
                                    scalar_t* summed) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      const scalar_t* rr = residual + r * residual_stride;
      for (int64_t i = 0; i < width; i += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, width - i);
        Vec s = load_f(xr + i, m) + load_f(rr + i, m);
        if (bias != nullptr) s = s + load_f(bias + i, m);
        if (summed != nullptr) {  // normalise the sum as stored, so that normed == LayerNorm(summed) exactly
          scalar_t* sr = summed + r * width + i;
          store_f(sr, s, m);
          s = load_f(sr, m);
        }
        s.store(row.data() + i, m);
      }
      layernorm_row(row.data(), width, weight, ln_bias, eps, out + r * width);
    }
  });
}

void check_residual_ln_args(const at::Tensor& x, const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                            const at::Tensor& ln_weight, const std::optional<at::Tensor>& ln_bias, int64_t width,
                            const char* op) {
  check_cpu(x, op, "x");
  check_float_dtype(x, op, "x");
  const auto dtype = x.scalar_type();
  if (bias.has_value()) check_vector(*bias, width, dtype, op, "bias");
  check_cpu(residual, op, "residual");
  TORCH_CHECK(residual.scalar_type() == dtype, "fastbert::", op, ": residual must be ", dtype, ", got ",
              residual.scalar_type());
  check_vector(ln_weight, width, dtype, op, "ln_weight");
  if (ln_bias.has_value()) check_vector(*ln_bias, width, dtype, op, "ln_bias");
}

// out = LayerNorm(x + bias + residual) for rows x [rows, N] (unit column stride); out [rows, N] contiguous, and may
// be x itself (a GEMM output this op owns, normalised in place). summed: undefined, or [rows, N] contiguous (may be
// x) to receive x + bias + residual, whose stored value is then what is normalised.
void residual_layernorm_into(const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& bias,
                             const at::Tensor& residual, const at::Tensor& ln_weight,
                             const std::optional<at::Tensor>& ln_bias, double eps, at::Tensor summed = {}) {
  const int64_t width = x.size(1);
  const at::Tensor res = as_rows(residual, width);
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  const at::Tensor w = ln_weight.contiguous();
  at::Tensor lb;
  if (ln_bias.has_value()) lb = ln_bias->contiguous();
  FASTBERT_DISPATCH_FLOAT(x.scalar_type(), "fastbert_residual_layernorm", [&] {
    bias_residual_layernorm_kernel<scalar_t>(
        x.data_ptr<scalar_t>(), x.stride(0), b.defined() ? b.data_ptr<scalar_t>() : nullptr,
        res.data_ptr<scalar_t>(), res.stride(0), w.data_ptr<scalar_t>(), lb.defined() ? lb.data_ptr<scalar_t>() : nullptr,
        eps, x.size(0), width, out.data_ptr<scalar_t>(), summed.defined() ? summed.data_ptr<scalar_t>() : nullptr);
  });
}

at::Tensor bias_residual_layernorm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                       const at::Tensor& residual, const at::Tensor& ln_weight,
                                       const at::Tensor& ln_bias, double eps) {
  constexpr const char* op = "bias_residual_layernorm";
  TORCH_CHECK(x.dim() >= 1, "fastbert::bias_residual_layernorm: x must be [..., N], got a scalar");
  const int64_t width = x.size(-1);
  check_residual_ln_args(x, bias, residual, ln_weight, ln_bias, width, op);
  TORCH_CHECK(residual.sizes() == x.sizes(), "fastbert::bias_residual_layernorm: residual must be ", shape_str(x),
              " like x, got ", shape_str(residual));
  const at::Tensor rows = as_rows(x, width);
  at::Tensor out = at::empty({rows.size(0), width}, x.options());
  residual_layernorm_into(rows, out, bias, residual, ln_weight, ln_bias, eps);
  return out.view(x.sizes());
}

// Checks of the linear + residual + LayerNorm ops; returns the output sizes [..., N].
std::vector<int64_t> check_linear_residual_ln_args(const at::Tensor& x, const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                                                   const at::Tensor& ln_weight,
                                                   const std::optional<at::Tensor>& ln_bias, const char* op) {
  TORCH_CHECK(x.dim() >= 1, "fastbert::", op, ": x must be [..., K], got a scalar");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "fastbert::", op, ": weight must be [N, ",
              x.size(-1), "], got ", shape_str(weight));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "fastbert::", op, ": weight must be ", x.scalar_type(),
              " like x, got ", weight.scalar_type());
  const int64_t width = weight.size(0);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = width;
  check_residual_ln_args(x, bias, residual, ln_weight, ln_bias, width, op);
  TORCH_CHECK(residual.sizes() == at::IntArrayRef(out_sizes), "fastbert::", op, ": residual must be ",
              at::IntArrayRef(out_sizes), ", got ", shape_str(residual));
  return out_sizes;
}

at::Tensor linear_residual_layernorm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias, const at::Tensor& residual,
                                         const at::Tensor& ln_weight, const std::optional<at::Tensor>& ln_bias,
                                         double eps, double dropout_p, int64_t dropout_seed) {
  TORCH_CHECK(dropout_p == 0.0, "fastbert::linear_residual_layernorm: the cpp kernel has no dropout");
  const auto out_sizes =
      check_linear_residual_ln_args(x, weight, bias, residual, ln_weight, ln_bias, "linear_residual_layernorm");
  at::Tensor y = at::mm(x.reshape({-1, x.size(-1)}), weight.t());
  residual_layernorm_into(y, y, bias, residual, ln_weight, ln_bias, eps);
  return y.view(out_sizes);
}

std::tuple<at::Tensor, at::Tensor> linear_residual_prenorm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               const at::Tensor& residual, const at::Tensor& ln_weight,
                                                               const std::optional<at::Tensor>& ln_bias, double eps,
                                                               double dropout_p, int64_t dropout_seed) {
  TORCH_CHECK(dropout_p == 0.0, "fastbert::linear_residual_prenorm: the cpp kernel has no dropout");
  const auto out_sizes =
      check_linear_residual_ln_args(x, weight, bias, residual, ln_weight, ln_bias, "linear_residual_prenorm");
  at::Tensor summed = at::mm(x.reshape({-1, x.size(-1)}), weight.t());  // contiguous: the sum is written over it
  at::Tensor normed = at::empty(summed.sizes(), summed.options());
  residual_layernorm_into(summed, normed, bias, residual, ln_weight, ln_bias, eps, summed);
  return {summed.view(out_sizes), normed.view(out_sizes)};
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_embedding_layernorm", &fastbert::embedding_layernorm_cpu);
  m.impl("cpp_bias_residual_layernorm", &fastbert::bias_residual_layernorm_cpu);
  m.impl("cpp_linear_residual_layernorm", &fastbert::linear_residual_layernorm_cpu);
  m.impl("cpp_linear_residual_prenorm", &fastbert::linear_residual_prenorm_cpu);
}
