// Vector helpers shared by tandem's native ops (GCC vector extensions over AVX-512 or AVX2 lanes):
// deterministic, as every operation in them is. Included by row_attention.cpp and decoder_ops.cpp.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace tandem_vec {

#if defined(__AVX512F__)
constexpr int V = 16;
#else
constexpr int V = 8;
#endif
typedef float vf __attribute__((vector_size(V * 4)));
typedef int32_t vi __attribute__((vector_size(V * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }

inline float lanes_sum(vf v) {
  // A fixed tree over the lanes (halves added until one lane is left).
#if defined(__AVX512F__)
  __m512 z;
  std::memcpy(&z, &v, sizeof(z));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
  __m256 h;
  std::memcpy(&h, &v, sizeof(h));
#endif
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// exp for a vector (Cephes' expf: 2^n times a degree-5 polynomial on the remainder), to ~1 ulp on
// the softmax's range (arguments <= 0; clamped to [-87.3, 88]); deterministic, as every operation here is.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f, hi = vf{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf t = x * 1.44269504088896341f + 0.5f;
  vi n = __builtin_convertvector(t, vi);
  vf fn = __builtin_convertvector(n, vf);
  const vi adjust = fn > t;  // truncation rounded negative values up: step down
  n += adjust;
  fn = __builtin_convertvector(n, vf);
  vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
  vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits;
  std::memcpy(&bits, &p, sizeof(vf));
  bits += (n << 23);
  std::memcpy(&p, &bits, sizeof(vf));
  return p;
}

}  // namespace tandem_vec
