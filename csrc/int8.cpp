// The elementwise steps around FBGEMM's int8 GEMM in fastbert/quantization.py (per-token activation scales):
// - int8_unit_rows: each row of x [T, K] mapped onto [0, 1] by its own minimum and range, in one pass over an
//   L1/L2-resident row: unit = (x - low) / spread, low = min(row), spread = max(row) - min(row) (> 0).
// - int8_rescale: the GEMM's result g = unit @ W^T back to x @ W^T (+ bias), in place:
//   g = spread * g + low * wsum (+ bias), wsum [N] the quantized weight's row sums.
// float32 only (the int8 path runs float32 models).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "fastbert.h"

namespace fastbert {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> int8_unit_rows_cpu(const at::Tensor& x) {
  constexpr const char* op = "int8_unit_rows";
  check_cpu(x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "fastbert::int8_unit_rows: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "fastbert::int8_unit_rows: x must be [T, K], got ", shape_str(x));
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor src = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor unit = at::empty({rows, n}, x.options());
  at::Tensor low = at::empty({rows, 1}, x.options());
  at::Tensor spread = at::empty({rows, 1}, x.options());
  const float* xp = src.data_ptr<float>();
  const int64_t stride = src.stride(0);
  float* up = unit.data_ptr<float>();
  float* lp = low.data_ptr<float>();
  float* sp = spread.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * stride;
      Vec lo(std::numeric_limits<float>::infinity()), hi(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        const Vec v = load_f(row + i);
        lo = at::vec::minimum(lo, v);
        hi = at::vec::maximum(hi, v);
      }
      float mn = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::minimum(a, b); }, lo);
      float mx = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, hi);
      for (; i < n; ++i) {
        mn = std::min(mn, row[i]);
        mx = std::max(mx, row[i]);
      }
      const float width = std::max(mx - mn, 1e-30f);
      lp[r] = mn;
      sp[r] = width;
      const Vec shift(mn), inv(1.f / width);
      float* out = up + r * n;
      i = 0;
      for (; i + kLanes <= n; i += kLanes) store_f(out + i, (load_f(row + i) - shift) * inv);
      if (i < n) store_f(out + i, (load_f(row + i, n - i) - shift) * inv, n - i);
    }
  });
  return {unit, low, spread};
}

at::Tensor int8_rescale_cpu(at::Tensor g, const at::Tensor& low, const at::Tensor& spread, const at::Tensor& wsum,
                            const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "int8_rescale";
  check_cpu(g, op, "g");
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 2 && g.is_contiguous(),
              "fastbert::int8_rescale: g must be a contiguous float32 [T, N], got ", g.scalar_type(), " ",
              shape_str(g));
  const int64_t rows = g.size(0), n = g.size(1);
  check_vector(wsum, n, at::kFloat, op, "wsum");
  if (bias.has_value()) check_vector(*bias, n, at::kFloat, op, "bias");
  TORCH_CHECK(low.numel() == rows && spread.numel() == rows && low.is_contiguous() && spread.is_contiguous(),
              "fastbert::int8_rescale: low and spread must hold one value per row (", rows, ")");
  float* gp = g.data_ptr<float>();
  const float* wp = wsum.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const float* lp = low.data_ptr<float>();
  const float* sp = spread.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = gp + r * n;
      const Vec scale(sp[r]), shift(lp[r]);
      int64_t i = 0;
      for (; i < n; i += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - i);
        Vec v = at::vec::fmadd(load_f(row + i, count), scale, shift * load_f(wp + i, count));
        if (bp != nullptr) v = v + load_f(bp + i, count);
        store_f(row + i, v, count);
      }
    }
  });
  return g;
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_FRAGMENT(fastbert, m) {
  m.def("cpp_int8_unit_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("cpp_int8_rescale(Tensor(a!) g, Tensor low, Tensor spread, Tensor wsum, Tensor? bias) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_int8_unit_rows", &fastbert::int8_unit_rows_cpu);
  m.impl("cpp_int8_rescale", &fastbert::int8_rescale_cpu);
}
