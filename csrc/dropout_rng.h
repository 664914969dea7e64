// Counter-based dropout for the CPU kernels: whether an element is kept is a pure function of (seed, flat index),
// so a backward kernel regenerates exactly its forward's mask without storing it, whatever the threading.
//
// The uniform of element `index` is the index-th output of a splitmix64 stream whose state starts from the mixed
// seed (Steele, Lea, Flood 2014: passes BigCrush per stream), top 24 bits as a float in [0, 1); an element is kept
// iff that uniform >= p (as `fastbert.ops.dropout.keep_mask` keeps `torch.rand >= p`), and kept values are scaled by
// 1 / (1 - p). Masks differ from the eager backend's (torch.Generator) for p > 0.
#pragma once

#include <cstdint>

namespace fastbert {

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The stream's starting state for a seed (mixed, so that nearby seeds give unrelated streams).
inline uint64_t dropout_stream(int64_t seed) { return mix64(static_cast<uint64_t>(seed) ^ 0x6A09E667F3BCC909ull); }

inline float dropout_uniform(uint64_t stream, uint64_t index) {
  const uint64_t z = mix64(stream + (index + 1) * 0x9E3779B97F4A7C15ull);
  return static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
}

// Elementwise dropout (csrc/dropout.cpp) keeps element `index` iff the top 32 bits of the stream's index-th output
// are >= `threshold` = round(p * 2**32): kept with probability 1 - threshold / 2**32 exactly, so that scaling kept
// values by 2**32 / (2**32 - threshold) is unbiased. A threshold of 2**32 (p = 1) keeps nothing.
inline bool dropout_keep32(uint64_t stream, uint64_t index, uint64_t threshold) {
  return (mix64(stream + (index + 1) * 0x9E3779B97F4A7C15ull) >> 32) >= threshold;
}

// Attention's mask is indexed [sequence, head, query, key] over the padded layout ([batch, heads, S, S], S the padded
// length or the packed form's max_seqlen; query and key are positions within the sequence).
inline uint64_t attention_dropout_index(int64_t batch_index, int64_t head, int64_t heads, int64_t seqlen,
                                        int64_t query, int64_t key) {
  return ((static_cast<uint64_t>(batch_index) * heads + head) * seqlen + query) * seqlen + key;
}

}  // namespace fastbert
