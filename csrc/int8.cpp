// The elementwise steps around FBGEMM's int8 GEMM in fastbert/quantization.py (per-token activation scales):
// - int8_unit_rows: each row of x [T, K] mapped onto [0, 1] by its own minimum and range, in one pass over an
//   L1/L2-resident row: unit = (x - low) / spread, low = min(row), spread = max(row) - min(row) (> 0).
// - int8_rescale: the GEMM's result g = unit @ W^T back to x @ W^T (+ bias), in place:
//   g = spread * g + low * wsum (+ bias), wsum [N] the quantized weight's row sums.
// - the same mapping back fused with what follows it: + residual + LayerNorm (post-LN), + GELU + the next GEMM's
//   row mapping (post-LN FFN), + residual, keeping the sum, + LayerNorm (pre-LN), GEGLU + the row mapping (pre-LN).
// float32 only (the int8 path runs float32 models).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "fastbert.h"

namespace fastbert {
namespace {

// A row's running minimum and maximum, a vector at a time, then the row mapped onto [0, 1] by them: the per-token
// grid of the next int8 GEMM.
struct RowRange {
  Vec lo{std::numeric_limits<float>::infinity()};
  Vec hi{-std::numeric_limits<float>::infinity()};

  // v holds `count` values of the row; a partial load's zero-filled lanes are not the row's and are left out (their
  // places take the vector's first value, `first`).
  void add(const Vec& v, int64_t count, float first) {
    const Vec valid = count == kLanes ? v : Vec::set(Vec(first), v, count);
    lo = at::vec::minimum(lo, valid);
    hi = at::vec::maximum(hi, valid);
  }

  // out[0, n) <- (src - min) / (max - min) (out may be src); stores min and the range (> 0).
  void map_to_unit(const float* src, float* out, int64_t n, float* low, float* spread) const {
    const float mn = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::minimum(x, y); }, lo);
    const float mx = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, hi);
    const float range = std::max(mx - mn, 1e-30f);
    *low = mn;
    *spread = range;
    const Vec offset(mn), inv(1.f / range);
    for (int64_t i = 0; i < n; i += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, n - i);
      store_f(out + i, (load_f(src + i, count) - offset) * inv, count);
    }
  }
};

// Rows mapped onto [0, 1] for the next int8 GEMM (`unit` [T, n]: a new tensor, or a buffer the caller owns, written
// in place) with each row's minimum and range ([T, 1] each): what every row-mapping step returns.
struct UnitRows {
  at::Tensor unit, low, spread;
  float *up, *lp, *sp;

  explicit UnitRows(at::Tensor out)
      : unit(std::move(out)),
        low(at::empty({unit.size(0), 1}, unit.options())),
        spread(at::empty({unit.size(0), 1}, unit.options())),
        up(unit.data_ptr<float>()),
        lp(low.data_ptr<float>()),
        sp(spread.data_ptr<float>()) {}

  float* row(int64_t r) const { return up + r * unit.size(1); }

  // Row r of unit <- src (the row's values, whose minimum and maximum `range` gathered) mapped onto [0, 1].
  void map_row(const RowRange& range, const float* src, int64_t r) const {
    range.map_to_unit(src, row(r), unit.size(1), lp + r, sp + r);
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> tensors() const { return {unit, low, spread}; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_unit_rows_cpu(const at::Tensor& x) {
  constexpr const char* op = "int8_unit_rows";
  check_cpu(x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fastbert::int8_unit_rows: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "fastbert::int8_unit_rows: x must be [T, K], got ", shape_str(x));
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor src = x.stride(1) == 1 ? x : x.contiguous();
  const UnitRows out(at::empty({rows, n}, x.options()));
  const float* xp = src.data_ptr<float>();
  const int64_t stride = src.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      RowRange range;
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - i);
        range.add(load_f(row + i, count), count, row[i]);
      }
      out.map_row(range, row, r);
    }
  });
  return out.tensors();
}

struct RowArgs {
  const float* wsum;
  const float* bias;
  const float* low;
  const float* spread;
};

// row <- spread * row + low * wsum (+ bias) (+ residual), in place, for row r: one pass.
inline void rescale_row(float* row, int64_t r, int64_t n, const RowArgs& a, const float* residual = nullptr) {
  const Vec scale(a.spread[r]), shift(a.low[r]);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - i);
    Vec v = at::vec::fmadd(load_f(row + i, count), scale, shift * load_f(a.wsum + i, count));
    if (a.bias != nullptr) v = v + load_f(a.bias + i, count);
    if (residual != nullptr) v = v + load_f(residual + i, count);
    store_f(row + i, v, count);
  }
}

RowArgs row_args(const at::Tensor& g, const at::Tensor& low, const at::Tensor& spread, const at::Tensor& wsum,
                 const std::optional<at::Tensor>& bias, const char* op) {
  check_cpu(g, op, "g");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 2 && g.is_contiguous(), "fastbert::", op,
              ": g must be a contiguous float32 [T, N], got ", g.scalar_type(), " ", shape_str(g));
  check_vector(wsum, g.size(1), at::kFloat, op, "wsum");
  if (bias.has_value()) check_vector(*bias, g.size(1), at::kFloat, op, "bias");
  TORCH_CHECK(low.numel() == g.size(0) && spread.numel() == g.size(0) && low.is_contiguous() &&
                  spread.is_contiguous() && low.scalar_type() == at::kFloat && spread.scalar_type() == at::kFloat,
              "fastbert::", op, ": low and spread must hold one float32 per row (", g.size(0), ")");
  return {wsum.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, low.data_ptr<float>(),
          spread.data_ptr<float>()};
}

at::Tensor int8_rescale_cpu(at::Tensor g, const at::Tensor& low, const at::Tensor& spread, const at::Tensor& wsum,
                            const std::optional<at::Tensor>& bias) {
  const RowArgs a = row_args(g, low, spread, wsum, bias, "int8_rescale");
  const int64_t rows = g.size(0), n = g.size(1);
  float* gp = g.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rescale_row(gp + r * n, r, n, a);
  });
  return g;
}

// The residual stream spread * g + low * wsum + bias + residual into g (one pass), then its LayerNorm (fp32
// statistics; ln_bias may be absent) into `out`: g itself (post-LN: the sum is not needed again) or another [T, N]
// buffer (pre-LN: the sum is the next block's residual).
void rescale_residual_layernorm(at::Tensor& g, const RowArgs& a, const at::Tensor& residual,
                                const at::Tensor& ln_weight, const std::optional<at::Tensor>& ln_bias, double eps,
                                float* out, const char* op) {
  const int64_t rows = g.size(0), n = g.size(1);
  check_cpu(residual, op, "residual");
  TORCH_CHECK(!residual.is_same(g), "fastbert::", op, ": residual must not be g (g is overwritten first)");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.dim() == 2 && residual.size(0) == rows &&
                  residual.size(1) == n && residual.stride(1) == 1,
              "fastbert::", op, ": residual must be float32 [", rows, ", ", n, "], got ", shape_str(residual));
  check_vector(ln_weight, n, at::kFloat, op, "ln_weight");
  if (ln_bias.has_value()) check_vector(*ln_bias, n, at::kFloat, op, "ln_bias");
  float* gp = g.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const int64_t rstride = residual.stride(0);
  const float* wp = ln_weight.data_ptr<float>();
  const float* bp = ln_bias.has_value() ? ln_bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = gp + r * n;
      rescale_row(row, r, n, a, rp + r * rstride);
      layernorm_row(row, n, wp, bp, eps, out + r * n);
    }
  });
}

// LayerNorm(spread * g + low * wsum + bias + residual) into g: the post-LN attention output's and FFN output's
// epilogue.
at::Tensor int8_rescale_layernorm_cpu(at::Tensor g, const at::Tensor& low, const at::Tensor& spread,
                                      const at::Tensor& wsum, const std::optional<at::Tensor>& bias,
                                      const at::Tensor& residual, const at::Tensor& ln_weight,
                                      const at::Tensor& ln_bias, double eps) {
  constexpr const char* op = "int8_rescale_layernorm";
  const RowArgs a = row_args(g, low, spread, wsum, bias, op);
  rescale_residual_layernorm(g, a, residual, ln_weight, ln_bias, eps, g.data_ptr<float>(), op);
  return g;
}

// GELU (exact, erf) of spread * g + low * wsum + bias, then that row mapped onto [0, 1] by its own minimum and
// range for the next int8 GEMM, in place: the FFN's middle in one pass. Returns (g, low, spread) of the new rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_gelu_unit_rows_cpu(at::Tensor g, const at::Tensor& low,
                                                                      const at::Tensor& spread,
                                                                      const at::Tensor& wsum,
                                                                      const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_gelu_unit_rows";
  const RowArgs a = row_args(g, low, spread, wsum, bias, op);
  const int64_t rows = g.size(0), n = g.size(1);
  const UnitRows out(g);  // in place: the new rows replace g's
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = out.row(r);
      RowRange range;
      const Vec scale(a.spread[r]), shift(a.low[r]);
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - i);
        Vec v = at::vec::fmadd(load_f(row + i, count), scale, shift * load_f(a.wsum + i, count));
        if (a.bias != nullptr) v = v + load_f(a.bias + i, count);
        v = gelu_erf(v);
        store_f(row + i, v, count);
        range.add(v, count, row[i]);
      }
      out.map_row(range, row, r);
    }
  });
  return out.tensors();
}

// A pre-LN block's end (ModernBERT): the new residual stream spread * g + low * wsum + bias + residual into g, and
// its LayerNorm into a new tensor. Returns (g, normed).
std::tuple<at::Tensor, at::Tensor> int8_rescale_prenorm_cpu(at::Tensor g, const at::Tensor& low,
                                                           const at::Tensor& spread, const at::Tensor& wsum,
                                                           const std::optional<at::Tensor>& bias,
                                                           const at::Tensor& residual, const at::Tensor& ln_weight,
                                                           const std::optional<at::Tensor>& ln_bias, double eps) {
  constexpr const char* op = "int8_rescale_prenorm";
  const RowArgs a = row_args(g, low, spread, wsum, bias, op);
  at::Tensor normed = at::empty(g.sizes(), g.options());
  rescale_residual_layernorm(g, a, residual, ln_weight, ln_bias, eps, normed.data_ptr<float>(), op);
  return {g, normed};
}

// ModernBERT's GLU middle in one pass: the rescaled rows of g [T, 2I] = [input | gate] (spread * g + low * wsum +
// bias), GELU (exact, erf) of input times gate, each resulting row mapped onto [0, 1] by its own minimum and range
// for the next int8 GEMM. Returns (unit [T, I], low, spread) of the new rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_geglu_unit_rows_cpu(const at::Tensor& g, const at::Tensor& low,
                                                                       const at::Tensor& spread,
                                                                       const at::Tensor& wsum,
                                                                       const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_geglu_unit_rows";
  const RowArgs a = row_args(g, low, spread, wsum, bias, op);
  TORCH_CHECK(g.size(1) % 2 == 0, "fastbert::int8_geglu_unit_rows: g must be [T, 2 * I], got ", shape_str(g));
  const int64_t rows = g.size(0), width = g.size(1), n = width / 2;
  const UnitRows result(at::empty({rows, n}, g.options()));
  const float* gp = g.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* in = gp + r * width;
      float* out = result.row(r);
      RowRange range;
      const Vec scale(a.spread[r]), shift(a.low[r]);
      for (int64_t i = 0; i < n; i += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - i);
        Vec x = at::vec::fmadd(load_f(in + i, count), scale, shift * load_f(a.wsum + i, count));
        Vec gate = at::vec::fmadd(load_f(in + n + i, count), scale, shift * load_f(a.wsum + n + i, count));
        if (a.bias != nullptr) {
          x = x + load_f(a.bias + i, count);
          gate = gate + load_f(a.bias + n + i, count);
        }
        const Vec v = gelu_erf(x) * gate;
        store_f(out + i, v, count);
        range.add(v, count, out[i]);
      }
      result.map_row(range, out, r);
    }
  });
  return result.tensors();
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_FRAGMENT(fastbert, m) {
  m.def("cpp_int8_rescale_layernorm(Tensor(a!) g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias, "
        "Tensor residual, Tensor ln_weight, Tensor ln_bias, float eps) -> Tensor(a!)");
  m.def("cpp_int8_gelu_unit_rows(Tensor(a!) g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias) -> "
        "(Tensor(a!), Tensor, Tensor)");  // the unit rows are g's buffer
  m.def("cpp_int8_unit_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("cpp_int8_rescale(Tensor(a!) g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias) -> Tensor(a!)");
  m.def("cpp_int8_rescale_prenorm(Tensor(a!) g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias, "
        "Tensor residual, Tensor ln_weight, Tensor? ln_bias, float eps) -> (Tensor(a!), Tensor)");
  m.def("cpp_int8_geglu_unit_rows(Tensor g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_int8_unit_rows", &fastbert::int8_unit_rows_cpu);
  m.impl("cpp_int8_rescale", &fastbert::int8_rescale_cpu);
  m.impl("cpp_int8_rescale_layernorm", &fastbert::int8_rescale_layernorm_cpu);
  m.impl("cpp_int8_gelu_unit_rows", &fastbert::int8_gelu_unit_rows_cpu);
  m.impl("cpp_int8_rescale_prenorm", &fastbert::int8_rescale_prenorm_cpu);
  m.impl("cpp_int8_geglu_unit_rows", &fastbert::int8_geglu_unit_rows_cpu);
}
