// Block-FP8 weights (float8_e4m3fn, one float32 scale per row and block of columns) to
// bf16 or fp32, on AVX2 CPUs: what a kept-FP8 projection does before each product
// (engine/fp8.py). torch converts float8 element by element (about 200 M elements/s on
// this CPU); here 8 lanes at a time, from the bits:
//
//   e4m3: sign s, 4 exponent bits e (bias 7), 3 mantissa bits m.
//   e > 0: (-1)^s * 2^(e-7) * (1 + m/8): the bits (e, m) shifted into an fp32's exponent
//          and mantissa fields read as 2^(e-127) * (1 + m/8), times 2^120.
//   e = 0: (-1)^s * 2^-6 * m/8 = m * 2^-9 (subnormal), computed from m as an integer.
//   e = 15, m = 7: NaN (e4m3fn has no infinities).
//
// Each value is then multiplied by its block's scale in fp32 and rounded once to the
// output dtype (round to nearest even), as torch's `fp8.float() * scale` then `.to(dtype)`.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

namespace {

using tandem_cpu::store8;

inline __m256 e4m3_to_fp32x8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(magnitude, 20)),
                                      _mm256_set1_ps(0x1p120f));
  const __m256 subnormal = _mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0x07))), _mm256_set1_ps(0x1p-9f));
  const __m256i exponent = _mm256_and_si256(x, _mm256_set1_epi32(0x78));
  const __m256 is_subnormal =
      _mm256_castsi256_ps(_mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
  __m256 v = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  const __m256 is_nan =
      _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, _mm256_set1_epi32(0x7F)));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

template <typename T>
void dequant_rows(const uint8_t* w, const float* scale, T* out, int64_t begin, int64_t end,
                  int64_t K, int64_t KB, int64_t block_k) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = w + n * K;
    const float* row_scale = scale + n * KB;
    T* dst = out + n * K;
    for (int64_t k = 0; k < K; k += 8) {  // K is a multiple of 8; a block of 16 or more
      const __m256 s = _mm256_set1_ps(row_scale[k / block_k]);
      store8(dst + k, _mm256_mul_ps(e4m3_to_fp32x8(row + k), s));
    }
  }
}

}  // namespace

// weight [N, K] float8_e4m3fn, scale [N, ceil(K / block_k)] float32 (a row's scale per
// block of block_k columns; block_k a multiple of 16), K a multiple of 8 -> [N, K] in
// out_dtype (bfloat16 or float32).
at::Tensor fp8_dequant(const at::Tensor& weight, const at::Tensor& scale, int64_t block_k,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat8_e4m3fn && weight.is_contiguous(),
              "fp8_dequant: weight must be a contiguous [N, K] float8_e4m3fn tensor");
  TORCH_CHECK(block_k > 0 && block_k % 16 == 0, "fp8_dequant: block_k ", block_k,
              " must be a positive multiple of 16");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 8 == 0, "fp8_dequant: ", K, " columns, not a multiple of 8");
  const int64_t KB = (K + block_k - 1) / block_k;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == N && scale.size(1) == KB,
              "fp8_dequant: scale must be a contiguous float32 [", N, ", ", KB, "]");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "fp8_dequant: out_dtype must be bfloat16 or float32");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(out_dtype));
  const auto* w = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  const float* s = scale.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (out_dtype == at::kFloat) {
      dequant_rows(w, s, out.data_ptr<float>(), begin, end, K, KB, block_k);
    } else {
      auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
      dequant_rows(w, s, o, begin, end, K, KB, block_k);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("fp8_dequant(Tensor weight, Tensor scale, int block_k, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("fp8_dequant", &fp8_dequant); }
