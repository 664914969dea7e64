// Elementwise dropout with a counter-based mask (csrc/dropout_rng.h): out[i] = x[i] * scale where element i is kept,
// 0 elsewhere, in one pass over x (no mask tensor, no random-number tensor). The mask is a pure function of
// (seed, p, flat index), so the backward is the same kernel applied to the gradient with the same (p, seed).
// float32 or bfloat16 (computed in fp32); any shape (x is read as if contiguous); threaded over chunks of elements.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>

#include "dropout_rng.h"
#include "fastbert.h"

namespace fastbert {
namespace {

constexpr double kTwo32 = 4294967296.0;

// round(p * 2**32), in [0, 2**32].
uint64_t keep_threshold(double p) { return static_cast<uint64_t>(std::llround(std::min(std::max(p, 0.0), 1.0) * kTwo32)); }

template <typename scalar_t>
void dropout_chunk(const scalar_t* x, scalar_t* out, int64_t begin, int64_t end, uint64_t stream, uint64_t threshold,
                   float scale) {
  // Plain loop over a pure function of the index: the compiler vectorises the 64-bit mixing (vpmullq on AVX-512).
  for (int64_t i = begin; i < end; ++i) {
    const bool keep = dropout_keep32(stream, static_cast<uint64_t>(i), threshold);
    out[i] = static_cast<scalar_t>(keep ? static_cast<float>(x[i]) * scale : 0.f);
  }
}

at::Tensor dropout_cpu(const at::Tensor& x, double p, int64_t seed) {
  check_cpu(x, "dropout", "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "fastbert::cpp_dropout: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "fastbert::cpp_dropout: p must be in [0, 1], got ", p);
  TORCH_CHECK(seed >= 0, "fastbert::cpp_dropout: seed must be >= 0, got ", seed);
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options());
  const uint64_t threshold = keep_threshold(p);
  const float scale = threshold >= (1ull << 32) ? 0.f : static_cast<float>(kTwo32 / (kTwo32 - threshold));
  const uint64_t stream = dropout_stream(seed);
  FASTBERT_DISPATCH_FLOAT(src.scalar_type(), "cpp_dropout", [&] {
    const scalar_t* in = src.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, src.numel(), 32768, [&](int64_t begin, int64_t end) {
      dropout_chunk(in, dst, begin, end, stream, threshold, scale);
    });
  });
  return out;
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert, CPU, m) { m.impl("cpp_dropout", &fastbert::dropout_cpu); }
