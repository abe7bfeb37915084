// Products with GGUF's Q4_0, Q4_1 and Q8_0 weights as they are, on AVX-512 CPUs: what a
// GGUF projection computes (engine/gguf_weights.py, which packs the weights and holds the
// plain-torch reference, `reference_linear`).
//
// GGUF blocks hold 32 elements of one row: Q4_0 an fp16 scale d and 4-bit q (w = d (q - 8));
// Q4_1 d, an fp16 minimum m and 4-bit q (w = d q + m); Q8_0 d and int8 q (w = d q). Packed
// at load time, 16 rows side by side per block ("group-block"), one zmm lane per row:
//
//   Q4_0: d[16] fp16 | q[4 j][16 rows][4 bytes]                                     288 B
//   Q4_1: d[16] fp16 | m[16] fp16 | q[4 j][16 rows][4 bytes]                          320 B
//   Q8_0: d[16] fp16 | q[16 pairs][16 rows][2] int8                                 544 B
//
// the bytes of the file's blocks reordered, no more (a Q4 row's byte k holds elements k
// and k + 16 in its low and high nibbles). Each row of x is quantized per block, to int16
// for Q8_0 and to 15 bits for Q4 (scale = max |x| / 32767 or / 16383: errors far below
// bf16's rounding), and a block's dot product is an exact int32 sum: of 16-bit pairs
// (VNNI's vpdpwssd) for Q8_0; for Q4, of nibbles times bytes (vpdpbusd), the 15-bit
// activations split as 128 h + l into a signed byte h and l in 0..127. Scaled in fp32
// per block:
//
//   Q4_0: d (s Σ q a - 8 s Σ a)   Q4_1: d s Σ q a + m s Σ a   Q8_0: d s Σ q a
//
// with a the int16 activations and s their scale. The products out in x's dtype (bf16
// rounded to nearest even), the bias added in fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 16;   // rows per group: one zmm lane each
constexpr int64_t kBlock = 32;  // elements per GGUF block
constexpr int kTile = 8;        // rows of x per pass over a group's weights
constexpr int64_t kAhead = 4;   // group-blocks prefetched ahead (past a group's end: the next's)
// ggml's type ids (gguf.GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

int64_t group_block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 32 + 256;
    case kQ4_1: return 64 + 256;
    case kQ8_0: return 32 + 512;
    default: return 0;
  }
}

// x quantized per row and block (64 bytes each), with a scale and s Σ a:
//   Q8_0: 32 int16 in order, dword p = elements (2p, 2p + 1), for vpdpwssd;
//   Q4:   15-bit values a = 128 h + l (h signed, l in 0..127) as bytes for vpdpbusd:
//         the 32 h in order, then the 32 l (dword j: elements 4j..4j+3).
struct Activations {
  std::vector<int8_t> q;     // [M, B, 64]
  std::vector<float> scale;  // [M, B]
  std::vector<float> sum;    // [M, B]
};

// Built for AVX-512 with VNNI whatever the library's flags; called only where the CPU has it.
#define TANDEM_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

TANDEM_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

TANDEM_AVX512 inline __m512 load16(const at::BFloat16* p) {  // a bf16 is an fp32's top half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
TANDEM_AVX512 Activations quantize_rows(const T* x, int64_t M, int64_t K, int64_t type) {
  const int64_t B = K / kBlock;
  Activations a{std::vector<int8_t>(M * B * 64), std::vector<float>(M * B),
                std::vector<float>(M * B)};
  const float top = type == kQ8_0 ? 32767.f : 16383.f;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      const T* src = x + m * K + b * kBlock;
      const __m512 v0 = load16(src), v1 = load16(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? top / amax : 0.f);
      // Round to nearest even, as lrintf does.
      const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
      const __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      int8_t* q = a.q.data() + (m * B + b) * 64;
      if (type == kQ8_0) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(r0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm512_cvtepi32_epi16(r1));
      } else {  // h = floor(r / 128) (an arithmetic shift), l = r - 128 h = r & 127
        const __m512i seven = _mm512_set1_epi32(127);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_srai_epi32(r0, 7)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(r1, 7)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32), _mm512_cvtepi32_epi8(_mm512_and_si512(r0, seven)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 48), _mm512_cvtepi32_epi8(_mm512_and_si512(r1, seven)));
      }
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
      a.scale[m * B + b] = amax / top;
      a.sum[m * B + b] = amax / top * static_cast<float>(total);
    }
  }
  return a;
}

TANDEM_AVX512 inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }

TANDEM_AVX512 inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Rows [m0, m0 + MT) of x against group g's 16 rows of weights: out[m, 16 g : 16 g + 16].
template <int64_t kType, int MT, typename T>
TANDEM_AVX512 void group_tile(const uint8_t* group, int64_t B, const Activations& a,
                                   int64_t m0, const float* bias, T* out, int64_t N,
                                   int64_t g) {
  constexpr int64_t kBytes = kType == kQ4_0 ? 288 : kType == kQ4_1 ? 320 : 544;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* blk = group + b * kBytes;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    const int32_t* act[MT];
    for (int i = 0; i < MT; ++i) {
      act[i] = reinterpret_cast<const int32_t*>(a.q.data() + ((m0 + i) * B + b) * 64);
    }
    // Independent sums per row of x (chains), added at the block's end: one chain of 16
    // dependent vpdpwssd would wait on each one's latency.
    // Q4: h and l sums kept apart (2 chains), 4 where one row leaves room.
    constexpr int kChains = MT == 1 ? 4 : MT <= 3 ? 2 : 1;
    constexpr int kQ4Chains = MT <= 3 ? 4 : 2;
    constexpr int kSums = kType == kQ8_0 ? kChains : kQ4Chains;
    __m512i iacc[MT][kSums];
    for (int i = 0; i < MT; ++i) {
      for (int c = 0; c < kSums; ++c) iacc[i][c] = _mm512_setzero_si512();
    }
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 256), _MM_HINT_T0);
    if constexpr (kType == kQ8_0) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 320), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 384), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 448), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead * kBytes + 512), _MM_HINT_T0);
      const uint8_t* qs = blk + 32;
      for (int p = 0; p < 16; ++p) {
        const __m512i w =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p)));
        for (int i = 0; i < MT; ++i) {
          __m512i& sum = iacc[i][p % kChains];
          sum = _mm512_dpwssd_epi32(sum, w, _mm512_set1_epi32(act[i][p]));
        }
      }
    } else {
      // Chunk j: per row, bytes 4j..4j+3: low nibbles elements 4j.., high 16+4j..; sums of
      // h products in chain 0 (and 2), of l products in chain 1 (and 3): 128 h + l.
      const uint8_t* qs = blk + (kType == kQ4_1 ? 64 : 32);
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(qs + 64 * j);
        const __m512i lo = _mm512_and_si512(bytes, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
        for (int i = 0; i < MT; ++i) {
          __m512i* sums = iacc[i];
          sums[0] = _mm512_dpbusd_epi32(sums[0], lo, _mm512_set1_epi32(act[i][j]));
          sums[1] = _mm512_dpbusd_epi32(sums[1], lo, _mm512_set1_epi32(act[i][8 + j]));
          sums[kQ4Chains - 2] =
              _mm512_dpbusd_epi32(sums[kQ4Chains - 2], hi, _mm512_set1_epi32(act[i][4 + j]));
          sums[kQ4Chains - 1] =
              _mm512_dpbusd_epi32(sums[kQ4Chains - 1], hi, _mm512_set1_epi32(act[i][12 + j]));
        }
      }
      for (int i = 0; i < MT; ++i) {
        __m512i* sums = iacc[i];
        if constexpr (kQ4Chains == 4) {
          sums[0] = _mm512_add_epi32(sums[0], sums[2]);
          sums[1] = _mm512_add_epi32(sums[1], sums[3]);
        }
        sums[0] = _mm512_add_epi32(_mm512_slli_epi32(sums[0], 7), sums[1]);
      }
    }
    if constexpr (kType == kQ8_0) {
      for (int i = 0; i < MT; ++i) {
        for (int c = 1; c < kChains; ++c) iacc[i][0] = _mm512_add_epi32(iacc[i][0], iacc[i][c]);
      }
    }
    for (int i = 0; i < MT; ++i) {
      const int64_t at = (m0 + i) * B + b;
      __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[i][0]), _mm512_set1_ps(a.scale[at]));
      if constexpr (kType == kQ4_0) {
        scaled = _mm512_sub_ps(scaled, _mm512_set1_ps(8.f * a.sum[at]));
      }
      acc[i] = _mm512_fmadd_ps(d, scaled, acc[i]);
      if constexpr (kType == kQ4_1) {
        const __m512 mins =
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
        acc[i] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.sum[at]), acc[i]);
      }
    }
  }
  const __m512 bias16 = bias ? _mm512_loadu_ps(bias + g * kRows) : _mm512_setzero_ps();
  for (int i = 0; i < MT; ++i) {
    store16(out + (m0 + i) * N + g * kRows, _mm512_add_ps(acc[i], bias16));
  }
}

template <int64_t kType, typename T>
void run_groups(const uint8_t* w, int64_t B, const Activations& a, int64_t M, const float* bias,
                T* out, int64_t N, int64_t g0, int64_t g1) {
  constexpr int64_t kBytes = kType == kQ4_0 ? 288 : kType == kQ4_1 ? 320 : 544;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w + g * B * kBytes;
    int64_t m = 0;
    for (; m + kTile <= M; m += kTile) {
      group_tile<kType, kTile>(group, B, a, m, bias, out, N, g);
    }
    switch (M - m) {  // the rows left over, fewer than a tile
      case 0: break;
      case 1: group_tile<kType, 1>(group, B, a, m, bias, out, N, g); break;
      case 2: group_tile<kType, 2>(group, B, a, m, bias, out, N, g); break;
      case 3: group_tile<kType, 3>(group, B, a, m, bias, out, N, g); break;
      case 4: group_tile<kType, 4>(group, B, a, m, bias, out, N, g); break;
      case 5: group_tile<kType, 5>(group, B, a, m, bias, out, N, g); break;
      case 6: group_tile<kType, 6>(group, B, a, m, bias, out, N, g); break;
      default: group_tile<kType, 7>(group, B, a, m, bias, out, N, g); break;
    }
  }
}

template <int64_t kType, typename T>
void run_type(const uint8_t* w, int64_t B, const Activations& a, int64_t M, const float* bias,
              T* out, int64_t N) {
  const int64_t groups = N / kRows;
  // Enough groups per task that a thread streams its weights: 8 groups of 16 rows.
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    run_groups<kType>(w, B, a, M, bias, out, N, g0, g1);
  });
}

bool supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
         __builtin_cpu_supports("f16c");
}

template <typename T>
void dispatch(const at::Tensor& x, const at::Tensor& packed, int64_t type, const float* bias,
              at::Tensor& out, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), B = K / kBlock;
  const Activations a = quantize_rows(x.data_ptr<T>(), M, K, type);
  const auto* w = packed.data_ptr<uint8_t>();
  T* o = out.data_ptr<T>();
  switch (type) {
    case kQ4_0: run_type<kQ4_0>(w, B, a, M, bias, o, N); break;
    case kQ4_1: run_type<kQ4_1>(w, B, a, M, bias, o, N); break;
    default: run_type<kQ8_0>(w, B, a, M, bias, o, N); break;
  }
}

}  // namespace

// Whether this CPU runs gguf_linear (AVX-512 with VNNI); else the plain-torch path.
bool gguf_kernel_supported() { return supported(); }

// x [M, K] bf16 or fp32, packed uint8 [N / 16, K / 32, group-block bytes] (the layout
// above), type a ggml type id (2 Q4_0, 3 Q4_1, 8 Q8_0), bias [N] or None -> [M, N] in x's
// dtype.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(supported(), "gguf_linear: this CPU has no AVX-512 VNNI (avx512f, bw, vl, vnni)");
  const int64_t bytes = group_block_bytes(type);
  TORCH_CHECK(bytes > 0, "gguf_linear: type ", type, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "gguf_linear: x must be a contiguous [M, K] bfloat16 or float32 tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && n % kRows == 0, "gguf_linear: K ", K, " (a multiple of 32) and N ",
              n, " (a multiple of 16)");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == n / kRows && packed.size(1) == K / kBlock &&
                  packed.size(2) == bytes,
              "gguf_linear: packed must be a contiguous uint8 [", n / kRows, ", ", K / kBlock, ", ",
              bytes, "]");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "gguf_linear: bias must be [", n, "]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat) {
    dispatch<float>(x, packed, type, b, out, n);
  } else {
    dispatch<at::BFloat16>(x, packed, type, b, out, n);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor packed, int type, int n, Tensor? bias) -> Tensor");
  m.def("gguf_kernel_supported() -> bool", &gguf_kernel_supported);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
