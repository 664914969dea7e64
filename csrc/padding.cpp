// Padding removal and restoration of token batches, row copies threaded over tokens:
// - unpad: x [B, S, ...] and int64 flat indices [T] (b * S + s of each kept token) -> [T, ...];
// - pad:   x [T, ...] back to [B, S, ...] with zeros at every position not in indices.
// Any dtype (rows are copied as bytes). Indices are range-checked; duplicates in pad are the caller's error
// (the last writer wins, as with index_copy_).
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>

#include "fastbert.h"

namespace fastbert {
namespace {

void check_indices(const at::Tensor& indices, const char* op) {
  check_cpu(indices, op, "indices");
  TORCH_CHECK(indices.scalar_type() == at::kLong && indices.dim() == 1, "fastbert::", op,
              ": indices must be int64 [total_tokens], got ", indices.scalar_type(), " ", shape_str(indices));
}

// dst row indices[i] (or i) <- src row i (or indices[i]); rows of `row_bytes` bytes.
void copy_rows(const char* src, char* dst, const int64_t* indices, int64_t count, int64_t limit, int64_t row_bytes,
               bool gather, const char* op) {
  at::parallel_for(0, count, std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t j = indices[i];
      TORCH_CHECK(j >= 0 && j < limit, "fastbert::", op, ": indices holds ", j, ", outside [0, ", limit, ")");
      if (gather) {
        std::memcpy(dst + i * row_bytes, src + j * row_bytes, row_bytes);
      } else {
        std::memcpy(dst + j * row_bytes, src + i * row_bytes, row_bytes);
      }
    }
  });
}

at::Tensor unpad_cpu(const at::Tensor& x, const at::Tensor& indices) {
  check_cpu(x, "unpad", "x");
  check_indices(indices, "unpad");
  TORCH_CHECK(x.dim() >= 2, "fastbert::unpad: x must be [batch, seq, ...], got ", shape_str(x));
  const at::Tensor src = x.contiguous(), idx = indices.contiguous();
  auto out_sizes = x.sizes().slice(2).vec();
  out_sizes.insert(out_sizes.begin(), idx.numel());
  at::Tensor out = at::empty(out_sizes, x.options());
  const int64_t row_bytes = (x.size(0) * x.size(1) == 0 ? 0 : src.numel() / (x.size(0) * x.size(1))) * x.element_size();
  copy_rows(static_cast<const char*>(src.data_ptr()), static_cast<char*>(out.data_ptr()), idx.data_ptr<int64_t>(),
            idx.numel(), x.size(0) * x.size(1), row_bytes, /*gather=*/true, "unpad");
  return out;
}

at::Tensor pad_cpu(const at::Tensor& x, const at::Tensor& indices, int64_t batch, int64_t seqlen) {
  check_cpu(x, "pad", "x");
  check_indices(indices, "pad");
  TORCH_CHECK(x.dim() >= 1 && x.size(0) == indices.numel(), "fastbert::pad: x must be [total_tokens=",
              indices.numel(), ", ...], got ", shape_str(x));
  TORCH_CHECK(batch >= 0 && seqlen >= 0, "fastbert::pad: batch and seqlen must be >= 0, got ", batch, ", ", seqlen);
  const at::Tensor src = x.contiguous(), idx = indices.contiguous();
  auto out_sizes = x.sizes().slice(1).vec();
  out_sizes.insert(out_sizes.begin(), {batch, seqlen});
  at::Tensor out = at::zeros(out_sizes, x.options());
  const int64_t row_bytes = (x.size(0) == 0 ? 0 : src.numel() / x.size(0)) * x.element_size();
  copy_rows(static_cast<const char*>(src.data_ptr()), static_cast<char*>(out.data_ptr()), idx.data_ptr<int64_t>(),
            idx.numel(), batch * seqlen, row_bytes, /*gather=*/false, "pad");
  return out;
}

}  // namespace
}  // namespace fastbert

TORCH_LIBRARY_IMPL(fastbert, CPU, m) {
  m.impl("cpp_unpad", &fastbert::unpad_cpu);
  m.impl("cpp_pad", &fastbert::pad_cpu);
}
