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

// Scalar form: the elements [begin, end) one by one (the tail of the vector form, and builds without AVX-512).
template <typename scalar_t>
void dropout_scalar(const scalar_t* x, scalar_t* out, int64_t begin, int64_t end, uint64_t stream, uint64_t threshold,
                    float scale) {
  for (int64_t i = begin; i < end; ++i) {
    const bool keep = dropout_keep32(stream, static_cast<uint64_t>(i), threshold);
    out[i] = static_cast<scalar_t>(keep ? static_cast<float>(x[i]) * scale : 0.f);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// mix64 on eight 64-bit lanes (vpmullq: AVX-512DQ).
inline __m512i mix64_lanes(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xBF58476D1CE4E5B9ll));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94D049BB133111EBll));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// dropout_keep32 of eight consecutive elements whose stream states are `state` (stream + (index + 1) * golden).
inline __mmask8 keep_lanes(__m512i state, __m512i threshold) {
  return _mm512_cmpge_epu64_mask(_mm512_srli_epi64(mix64_lanes(state), 32), threshold);
}

// Sixteen elements per step (two groups of eight stream states, advanced by adding 16 * golden), the kept ones
// multiplied by the scale under the mask; the same mask as `dropout_scalar`, which takes the tail.
template <typename scalar_t>
void dropout_chunk(const scalar_t* x, scalar_t* out, int64_t begin, int64_t end, uint64_t stream, uint64_t threshold,
                   float scale) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  const __m512i lane = _mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1);  // index + 1 for the lanes of the first group
  const __m512i step8 = _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden));
  const __m512i step16 = _mm512_set1_epi64(static_cast<int64_t>(16 * kGolden));
  const __m512i limit = _mm512_set1_epi64(static_cast<int64_t>(threshold));
  const __m512 factor = _mm512_set1_ps(scale);
  __m512i low = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(stream + static_cast<uint64_t>(begin) * kGolden)),
                                 _mm512_mullo_epi64(lane, _mm512_set1_epi64(static_cast<int64_t>(kGolden))));
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512i high = _mm512_add_epi64(low, step8);
    const __mmask16 keep = static_cast<__mmask16>(keep_lanes(low, limit) | (keep_lanes(high, limit) << 8));
    store_f(out + i, Vec(_mm512_maskz_mul_ps(keep, load_f(x + i), factor)));
    low = _mm512_add_epi64(low, step16);
  }
  dropout_scalar(x, out, i, end, stream, threshold, scale);
}
#else
template <typename scalar_t>
void dropout_chunk(const scalar_t* x, scalar_t* out, int64_t begin, int64_t end, uint64_t stream, uint64_t threshold,
                   float scale) {
  dropout_scalar(x, out, begin, end, stream, threshold, scale);
}
#endif

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
