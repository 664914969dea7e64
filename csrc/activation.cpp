// Bias + activation, vectorised with at::vec and threaded over rows:
// - bias_activation: act(x + bias) into a new tensor; activations "gelu" (exact, erf), "gelu_tanh", "relu",
//   "silu".
// - linear_activation: a PyTorch GEMM without bias, then bias + activation in place on its output (one pass
//   over the GEMM output instead of addmm's bias broadcast plus a separate activation pass).
// - linear_glu: a PyTorch GEMM without bias into [rows, 2I], then one pass act(input + b_in) * (gate + b_gate)
//   over its two halves into the [rows, I] output (ModernBERT's GeGLU).
// Math in fp32 (bf16 in, bf16 out). Limits: CPU, float32 or bfloat16.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <type_traits>

#include "fastbert.h"

namespace fastbert {
namespace {

enum class Activation { Gelu, GeluTanh, Relu, Silu };

Activation parse_activation(c10::string_view name, const char* op) {
  if (name == "gelu") return Activation::Gelu;
  if (name == "gelu_tanh") return Activation::GeluTanh;
  if (name == "relu") return Activation::Relu;
  if (name == "silu") return Activation::Silu;
  TORCH_CHECK(false, "fastbert::", op, ": activation must be one of \"gelu\", \"gelu_tanh\", \"relu\", \"silu\", got \"",
              name, "\"");
}

template <Activation act>
inline Vec activate(const Vec& x) {
  if constexpr (act == Activation::Gelu) {
    return gelu_erf(x);
  } else if constexpr (act == Activation::GeluTanh) {
    // 0.5 x (1 + tanh(z)) == x * sigmoid(2 z) == x / (1 + exp(-2 z)), z = sqrt(2/pi) (x + 0.044715 x^3)
    const Vec one(1.f), minus_two_k0(-2.f * 0.7978845608028654f), k1(0.044715f);
    const Vec z = at::vec::fmadd(k1 * x * x, x, x);
    return x / (one + (minus_two_k0 * z).exp_u20());
  } else if constexpr (act == Activation::Silu) {
    // x * sigmoid(x) == x / (1 + exp(-x)); exp overflows to inf for x < -88, giving -0 as it should.
    const Vec one(1.f);
    return x / (one + (Vec(0.f) - x).exp_u20());
  } else {
    return at::vec::clamp_min(x, Vec(0.f));
  }
}

// Call body(tag) with the activation as a compile-time constant, decltype(tag)::value (one loop per activation).
template <Activation act>
using ActivationTag = std::integral_constant<Activation, act>;

template <typename Body>
void with_activation(Activation act, Body&& body) {
  switch (act) {
    case Activation::Gelu: body(ActivationTag<Activation::Gelu>{}); break;
    case Activation::GeluTanh: body(ActivationTag<Activation::GeluTanh>{}); break;
    case Activation::Relu: body(ActivationTag<Activation::Relu>{}); break;
    case Activation::Silu: body(ActivationTag<Activation::Silu>{}); break;
  }
}

// out[r, :] = act(x[r, :] + bias) for rows of width n; x rows `x_stride` apart, out contiguous (may alias x).
template <typename scalar_t, Activation act>
void bias_activation_kernel(const scalar_t* x, int64_t x_stride, const scalar_t* bias, int64_t rows, int64_t n,
                            scalar_t* out) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* orow = out + r * n;
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        Vec v = load_f(xr + i);
        if (bias != nullptr) v = v + load_f(bias + i);
        store_f(orow + i, activate<act>(v));
      }
      if (i < n) {
        const int64_t m = n - i;
        Vec v = load_f(xr + i, m);
        if (bias != nullptr) v = v + load_f(bias + i, m);
        store_f(orow + i, activate<act>(v), m);
      }
    }
  });
}

// act(y + bias) for y [rows, n] with unit column stride, written to out [rows, n] contiguous (out may be y).
void bias_activation_into(const at::Tensor& y, const std::optional<at::Tensor>& bias, Activation act,
                          at::Tensor& out) {
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  FASTBERT_DISPATCH_FLOAT(y.scalar_type(), "fastbert_bias_activation", [&] {
    const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    const scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t rows = y.size(0), n = y.size(1), stride = y.stride(0);
    with_activation(act, [&](auto tag) {
      bias_activation_kernel<scalar_t, decltype(tag)::value>(yp, stride, bp, rows, n, op);
    });
  });
}

// out[r, :] = act(y[r, :I] + b_in) * (y[r, I:] + b_gate) for y [rows, 2I] (rows `y_stride` apart, unit column
// stride) and out [rows, I] contiguous; bias [2I] or null.
template <typename scalar_t, Activation act>
void glu_kernel(const scalar_t* y, int64_t y_stride, const scalar_t* bias, int64_t rows, int64_t inner,
                scalar_t* out) {
  at::parallel_for(0, rows, row_grain(2 * inner), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* input_row = y + r * y_stride;
      const scalar_t* gate_row = input_row + inner;
      scalar_t* orow = out + r * inner;
      for (int64_t i = 0; i < inner; i += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, inner - i);
        Vec a = load_f(input_row + i, m);
        Vec g = load_f(gate_row + i, m);
        if (bias != nullptr) {
          a = a + load_f(bias + i, m);
          g = g + load_f(bias + inner + i, m);
        }
        const Vec v = activate<act>(a) * g;
        if (m == kLanes) {
          store_f(orow + i, v);
        } else {
          store_f(orow + i, v, m);
        }
      }
    }
  });
}

at::Tensor bias_activation_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                               c10::string_view activation) {
  constexpr const char* op = "bias_activation";
  const Activation act = parse_activation(activation, op);
  check_cpu(x, op, "x");
  check_float_dtype(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "fastbert::bias_activation: x must be [..., N], got a scalar");
  const int64_t n = x.size(-1);
  if (bias.has_value()) check_vector(*bias, n, x.scalar_type(), op, "bias");
  const at::Tensor rows = as_rows(x, n);
  at::Tensor out = at::empty(rows.sizes(), x.options());
  bias_activation_into(rows, bias, act, out);
  return out.view(x.sizes());
}

at::Tensor linear_activation_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                 c10::string_view activation) {
  constexpr const char* op = "linear_activation";
  const Activation act = parse_activation(activation, op);
  check_cpu(x, op, "x");
  check_float_dtype(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "fastbert::linear_activation: x must be [..., K], got a scalar");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1), "fastbert::linear_activation: weight must be [N, ",
              x.size(-1), "], got ", shape_str(weight));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "fastbert::linear_activation: weight must be ",
              x.scalar_type(), " like x, got ", weight.scalar_type());
  const int64_t n = weight.size(0);
  if (bias.has_value()) check_vector(*bias, n, x.scalar_type(), op, "bias");
  at::Tensor y = at::mm(x.reshape({-1, x.size(-1)}), weight.t());
  bias_activation_into(y, bias, act, y);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  return y.view(out_sizes);
}

at::Tensor linear_glu_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          c10::string_view activation) {
  constexpr const char* op = "linear_glu";
  const Activation act = parse_activation(activation, op);
  check_cpu(x, op, "x");
  check_float_dtype(x, op, "x");
  TORCH_CHECK(x.dim() >= 1, "fastbert::linear_glu: x must be [..., K], got a scalar");
  check_cpu(weight, op, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(-1) && weight.size(0) % 2 == 0,
              "fastbert::linear_glu: weight must be [2I, ", x.size(-1), "] (input rows, then gate rows), got ",
              shape_str(weight));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "fastbert::linear_glu: weight must be ", x.scalar_type(),
              " like x, got ", weight.scalar_type());
  const int64_t inner = weight.size(0) / 2;
  if (bias.has_value()) check_vector(*bias, 2 * inner, x.scalar_type(), op, "bias");
  const at::Tensor y = at::mm(x.reshape({-1, x.size(-1)}), weight.t());
  at::Tensor out = at::empty({y.size(0), inner}, x.options());
  at::Tensor b;
  if (bias.has_value()) b = bias->contiguous();
  FASTBERT_DISPATCH_FLOAT(x.scalar_type(), "fastbert_linear_glu", [&] {
    const scalar_t* bp = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    const scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* op_out = out.data_ptr<scalar_t>();
    const int64_t rows = y.size(0), stride = y.stride(0);
    with_activation(act, [&](auto tag) {
      glu_kernel<scalar_t, decltype(tag)::value>(yp, stride, bp, rows, inner, op_out);
    });
  });
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = inner;
  return out.view(out_sizes);
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_bias_activation", &fastbert::bias_activation_cpu);
  m.impl("cpp_linear_activation", &fastbert::linear_activation_cpu);
  m.impl("cpp_linear_glu", &fastbert::linear_glu_cpu);
}
