// AVX2 helpers shared by the CPU kernels: 8 fp32 lanes from bf16 or fp32, back to bf16
// with round-to-nearest-even, a horizontal sum and exp.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tandem_cpu {

// 8 bf16 -> 8 fp32: a bf16 is the upper half of an fp32.
inline __m256 load8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// Round-to-nearest-even fp32 -> bf16 (NaN kept quiet), 8 lanes.
inline __m128i to_bf16x8(__m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  rounded = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(is_nan));
  __m256i hi = _mm256_srli_epi32(rounded, 16);
  // pack 8 x u32 (values < 2^16) into 8 x u16, keeping lane order
  __m128i lo128 = _mm256_castsi256_si128(hi);
  __m128i hi128 = _mm256_extracti128_si256(hi, 1);
  return _mm_packus_epi32(lo128, hi128);
}

inline void store8(uint16_t* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16x8(v));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (softmax after subtracting the max): x = n ln2 + r with |r| <= ln2 / 2
// (ln2 split in two for an exact product), exp(r) by its degree-7 Taylor polynomial in
// Horner form (truncation below 1e-8 relative on that range), times 2^n built in the
// exponent bits. Inputs below -87 give 0 rather than a denormal.
inline __m256 exp8(__m256 x) {
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

}  // namespace tandem_cpu
