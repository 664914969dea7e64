// Shared helpers of fastbert's CPU kernels: fp32 vector loads/stores from float or bfloat16 memory, the exact
// GELU (fast_erf, gelu_erf), argument checks with messages that name the argument, and the thread-count heuristic.
//
// Vector width comes from at::vec::Vectorized<float>, whose implementation is chosen by the CPU_CAPABILITY_*
// macro that setup.py defines from the build host (AVX512: 16 lanes, AVX2: 8 lanes, DEFAULT: scalar emulation).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <string>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

// Instantiate a kernel for the two supported dtypes (float32, bfloat16) as `scalar_t`.
#define FASTBERT_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace fastbert {

using Vec = at::vec::Vectorized<float>;
using BVec = at::vec::Vectorized<c10::BFloat16>;
constexpr int64_t kLanes = Vec::size();

// ---------------------------------------------------------------------------------------------- loads / stores
// load_f(p) reads kLanes elements; load_f(p, n) reads n < kLanes elements and zero-fills the rest.
inline Vec load_f(const float* p) { return Vec::loadu(p); }
inline Vec load_f(const float* p, int64_t n) { return Vec::loadu(p, n); }
#if defined(CPU_CAPABILITY_AVX512)
// 16 bf16 values (raw bits) as fp32: each is the high half of its fp32 value.
inline __m512 widen_bf16(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }
#endif

inline Vec load_f(const c10::BFloat16* p, int64_t n = kLanes) {
#if defined(CPU_CAPABILITY_AVX512)
  // kLanes values widened directly (at::vec would convert 2 * kLanes).
  return widen_bf16(n == kLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
#else
  // A bf16 vector holds 2 * kLanes values; the low half converts to one fp32 vector.
  auto halves = at::vec::convert_to_float<c10::BFloat16>(BVec::loadu(p, n));
  return std::get<0>(halves);
#endif
}

inline void store_f(float* p, const Vec& v) { v.store(p); }
inline void store_f(float* p, const Vec& v, int64_t n) { v.store(p, n); }
inline void store_f(c10::BFloat16* p, const Vec& v, int64_t n = kLanes) {
#if defined(CPU_CAPABILITY_AVX512)
  // Round to nearest even on the fp32 bits, NaN -> 0xffff (as at::vec's conversion, which converts 2 * kLanes).
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0xffff));
  const __m256i packed = _mm512_cvtepi32_epi16(rounded);
  if (n == kLanes) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
  } else {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), packed);
  }
#else
  at::vec::convert_from_float<c10::BFloat16>(v, v).store(p, n);
#endif
}

// ---------------------------------------------------------------------------------------------- math
// erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7) with at::vec's inline polynomial exp: at::vec's own erf
// calls Sleef's exp through the PLT, which spills every constant around the call and ran 1.7x slower here.
inline Vec fast_erf(const Vec& x) {
  const Vec one(1.f), p(0.3275911f), a1(0.254829592f), a2(-0.284496736f), a3(1.421413741f), a4(-1.453152027f),
      a5(1.061405429f);
  const Vec ax = x.abs();
  const Vec t = one / at::vec::fmadd(p, ax, one);
  const Vec poly = at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(a5, t, a4), t, a3), t, a2), t, a1) * t;
  const Vec e = (Vec(0.f) - ax * ax).exp_u20();
  const Vec magnitude = one - poly * e;
  return Vec::blendv(magnitude, Vec(0.f) - magnitude, x < Vec(0.f));
}

// Exact GELU, x * Phi(x), through `fast_erf`: the one GELU of the float kernels and the int8 epilogue.
inline Vec gelu_erf(const Vec& x) {
  const Vec half(0.5f), one(1.f), inv_sqrt2(static_cast<float>(M_SQRT1_2));
  return x * half * (one + fast_erf(x * inv_sqrt2));
}

// ---------------------------------------------------------------------------------------------- checks
inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "fastbert::", op, ": ", name, " must be a CPU tensor, got ", t.device());
}

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "fastbert::", op, ": ", name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

inline void check_vector(const at::Tensor& t, int64_t width, at::ScalarType dtype, const char* op,
                         const char* name) {
  check_cpu(t, op, name);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == width, "fastbert::", op, ": ", name, " must be [", width, "], got ",
              shape_str(t));
  TORCH_CHECK(t.stride(0) == 1 || width <= 1, "fastbert::", op, ": ", name, " must be contiguous (the kernels read ",
              "it as a plain array), got stride ", t.stride(0));
  TORCH_CHECK(t.scalar_type() == dtype, "fastbert::", op, ": ", name, " must be ", dtype, " like the input, got ",
              t.scalar_type());
}

// Rows per task so that one task touches at least ~16K elements: below that, threading costs more than it saves.
// Rows view [rows, N] of a [..., N] tensor that is only read, with unit column stride (copies only when it has to).
inline at::Tensor as_rows(const at::Tensor& t, int64_t width) {
  at::Tensor rows = t.reshape({-1, width});
  return rows.stride(1) == 1 ? rows : rows.contiguous();
}

// Which kernel computes the products of the CPU attention's bf16 calls of head dim `dim` (without dropout or a
// window; csrc/attention.cpp): AMX tiles (oneDNN's brgemm), AVX512-BF16 register tiles, or none of them (the
// vector kernel, its products in fp32).
enum class Bf16Kernel { kNone, kAmx, kAvx512Bf16 };
Bf16Kernel bf16_attention_kernel(at::ScalarType dtype, int64_t dim);

inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// ---------------------------------------------------------------------------------------------- LayerNorm
// Normalise one fp32 row in place (two passes over an L1-resident row: the mean first, then the centred
// variance, which is exact enough where a one-pass E[x^2] - E[x]^2 loses digits), then apply weight and bias (null:
// no shift) and store in the output dtype.
template <typename out_t, typename param_t>
inline void layernorm_row(float* row, int64_t n, const param_t* weight, const param_t* bias, double eps,
                          out_t* out) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = acc + Vec::loadu(row + i);
  float sum = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += row[i];
  const float mean = sum / static_cast<float>(n);
  const Vec mean_v(mean);
  acc = Vec(0.f);
  for (i = 0; i + kLanes <= n; i += kLanes) {
    Vec d = Vec::loadu(row + i) - mean_v;
    acc = at::vec::fmadd(d, d, acc);
  }
  float sq = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sq += (row[i] - mean) * (row[i] - mean);
  const float rstd = 1.f / std::sqrt(sq / static_cast<float>(n) + static_cast<float>(eps));
  const Vec rstd_v(rstd);
  for (i = 0; i < n; i += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - i);
    Vec y = (Vec::loadu(row + i, m) - mean_v) * rstd_v;
    y = bias != nullptr ? at::vec::fmadd(y, load_f(weight + i, m), load_f(bias + i, m)) : y * load_f(weight + i, m);
    if (m == kLanes) {
      store_f(out + i, y);
    } else {
      store_f(out + i, y, m);
    }
  }
}

}  // namespace fastbert
