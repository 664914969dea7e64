// QKV projection + rotary position embedding (ModernBERT's Wqkv + apply_rotary_pos_emb), the cpp backend of
// fastbert/ops/qkv_rotary.py:
// - a PyTorch GEMM (addmm with the bias, mm without: MKL/oneDNN) into the packed [T, 3 * heads * D] buffer;
// - then every head vector of q and k rotated in place, vectorised with at::vec over each half of the head and
//   threaded over tokens: out1 = u1 * cos - u2 * sin, out2 = u2 * cos + u1 * sin, with the fp32 cos/sin rows
//   [P, D/2] of the token's position. v is left as the GEMM wrote it.
// Math in fp32 (bf16 in, bf16 out: as transformers does, the GEMM's bf16 output is rotated in fp32 and rounded
// once more). Limits: CPU, float32 or bfloat16 activations and weights, float32 tables, int32/int64 positions.
// cpp_rotary_qk_ is the rotary step alone, in place on a packed [T, 3 * heads * D] buffer another GEMM wrote (the
// int8 ModernBERT layer of fastbert/quantization.py).
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "fastbert.h"

namespace fastbert {
namespace {

// Rotate n pairs (first[i], second[i]) in place by the angles whose cos/sin are cos[i], sin[i].
template <typename scalar_t>
inline void rotate_pairs(scalar_t* first, scalar_t* second, const float* cos, const float* sin, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec a = load_f(first + i), b = load_f(second + i);
    const Vec c = Vec::loadu(cos + i), s = Vec::loadu(sin + i);
    store_f(first + i, at::vec::fmsub(a, c, b * s));
    store_f(second + i, at::vec::fmadd(a, s, b * c));
  }
  if (i < n) {
    const int64_t m = n - i;
    const Vec a = load_f(first + i, m), b = load_f(second + i, m);
    const Vec c = Vec::loadu(cos + i, m), s = Vec::loadu(sin + i, m);
    store_f(first + i, at::vec::fmsub(a, c, b * s), m);
    store_f(second + i, at::vec::fmadd(a, s, b * c), m);
  }
}

// Rotate the first `rotated_heads` heads (q's and k's) of each of `tokens` rows of `out` (rows `row_stride` apart,
// heads of `head_dim` contiguous) at the rows of the [P, head_dim / 2] tables given by `positions`.
template <typename scalar_t, typename index_t>
void rotary_inplace(scalar_t* out, int64_t tokens, int64_t row_stride, int64_t rotated_heads, int64_t head_dim,
                    const index_t* positions, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, row_grain(rotated_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = static_cast<int64_t>(positions[t]);
      const float* c = cos + p * half;
      const float* s = sin + p * half;
      scalar_t* row = out + t * row_stride;
      for (int64_t h = 0; h < rotated_heads; ++h) {
        scalar_t* head = row + h * head_dim;
        rotate_pairs(head, head + half, c, s, half);
      }
    }
  });
}

template <typename index_t>
void check_position_range(const at::Tensor& positions, int64_t max_positions, const char* op) {
  const index_t* p = positions.data_ptr<index_t>();
  int64_t low = 0, high = 0;
  for (int64_t t = 0; t < positions.numel(); ++t) {
    low = std::min<int64_t>(low, p[t]);
    high = std::max<int64_t>(high, p[t]);
  }
  TORCH_CHECK(low >= 0 && high < max_positions, "fastbert::", op, ": positions must lie in [0, ", max_positions,
              ") (the tables' rows), got values in [", low, ", ", high, "]");
}

void check_table(const at::Tensor& t, int64_t half, const char* name, const char* op) {
  check_cpu(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, "fastbert::", op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(1) == half && t.size(0) > 0, "fastbert::", op, ": ", name,
              " must be [max_positions, head_dim/2 = ", half, "], got ", shape_str(t));
}

// positions (int32/int64, `leading` shape, every value a row of the tables) and the fp32 [P, half] cos/sin tables.
void check_rotary_inputs(const at::Tensor& positions, at::IntArrayRef leading, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t half, const char* op) {
  check_cpu(positions, op, "positions");
  TORCH_CHECK(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong, "fastbert::", op,
              ": positions must be int32 or int64, got ", positions.scalar_type());
  TORCH_CHECK(positions.sizes() == leading, "fastbert::", op, ": positions must have the rows' leading shape ",
              leading, ", got ", shape_str(positions));
  check_table(cos, half, "cos", op);
  check_table(sin, half, "sin", op);
  TORCH_CHECK(cos.sizes() == sin.sizes(), "fastbert::", op, ": cos ", shape_str(cos), " and sin ", shape_str(sin),
              " must have one shape");
  const at::Tensor pos = positions.contiguous();
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastbert_qkv_rotary_range",
                          [&] { check_position_range<index_t>(pos, cos.size(0), op); });
}

// q's and k's heads (the first 2 * num_heads of each row of y [T, 3 * num_heads * head_dim]) rotated in place.
void rotate_qk(at::Tensor& y, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
               int64_t num_heads, int64_t head_dim) {
  const at::Tensor pos = positions.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  FASTBERT_DISPATCH_FLOAT(y.scalar_type(), "fastbert_qkv_rotary", [&] {
    scalar_t* out = y.data_ptr<scalar_t>();
    AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "fastbert_qkv_rotary_positions", [&] {
      rotary_inplace<scalar_t, index_t>(out, y.size(0), y.stride(0), 2 * num_heads, head_dim,
                                        pos.data_ptr<index_t>(), c.data_ptr<float>(), s.data_ptr<float>());
    });
  });
}

at::Tensor qkv_rotary_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                          int64_t num_heads) {
  constexpr const char* op = "qkv_rotary";
  check_cpu(x, op, "x");
  check_float_dtype(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "fastbert::qkv_rotary: x must be [..., H], got a scalar");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(num_heads > 0, "fastbert::qkv_rotary: num_heads must be positive, got ", num_heads);
  check_cpu(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == hidden && weight.size(0) % (3 * num_heads) == 0,
              "fastbert::qkv_rotary: weight must be [3*heads*head_dim, ", hidden, "] with heads=", num_heads,
              ", got ", shape_str(weight));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "fastbert::qkv_rotary: weight must be ", x.scalar_type(),
              " like x, got ", weight.scalar_type());
  const int64_t n = weight.size(0);
  const int64_t head_dim = n / (3 * num_heads);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "fastbert::qkv_rotary: head_dim = ", head_dim,
              " must be even and positive");
  if (bias.has_value()) check_vector(*bias, n, x.scalar_type(), op, "bias");
  check_rotary_inputs(positions, x.sizes().slice(0, x.dim() - 1), cos, sin, head_dim / 2, op);

  const at::Tensor rows = x.reshape({-1, hidden});
  at::Tensor y = bias.has_value() ? at::addmm(*bias, rows, weight.t()) : at::mm(rows, weight.t());
  rotate_qk(y, positions, cos, sin, num_heads, head_dim);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  return y.view(out_sizes);
}

at::Tensor rotary_qk_cpu(at::Tensor packed, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t num_heads) {
  constexpr const char* op = "rotary_qk_";
  check_cpu(packed, op, "packed");
  check_float_dtype(packed, op, "packed");
  TORCH_CHECK(num_heads > 0, "fastbert::rotary_qk_: num_heads must be positive, got ", num_heads);
  TORCH_CHECK(packed.dim() == 2 && packed.stride(1) == 1 && packed.size(1) % (3 * num_heads) == 0,
              "fastbert::rotary_qk_: packed must be [T, 3*heads*head_dim] with unit column stride and heads=",
              num_heads, ", got ", shape_str(packed));
  const int64_t head_dim = packed.size(1) / (3 * num_heads);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "fastbert::rotary_qk_: head_dim = ", head_dim,
              " must be even and positive");
  check_rotary_inputs(positions, packed.sizes().slice(0, 1), cos, sin, head_dim / 2, op);
  rotate_qk(packed, positions, cos, sin, num_heads, head_dim);
  return packed;
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_FRAGMENT(fastbert, m) {
  m.def("cpp_rotary_qk_(Tensor(a!) packed, Tensor positions, Tensor cos, Tensor sin, int num_heads) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_qkv_rotary", &fastbert::qkv_rotary_cpu);
  m.impl("cpp_rotary_qk_", &fastbert::rotary_qk_cpu);
}
