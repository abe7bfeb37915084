// bf16 GEMM for decode and verify steps: out[M, N] = x[M, K] @ W[N, K]^T + bias.
//
// aten's bf16 GEMM on CPUs without native bf16 dot products converts the weight to fp32
// once per row, so the few rows of a decode or verify step cost about M matrix-vector
// products. Here every weight element is read from memory once per call, whatever M is,
// from a copy packed in panels of 16 output columns (`pack`), in one of two layouts:
//
// - AVX2 + FMA ([N/16][K][16] bf16): a panel is multiplied with up to kMaxRows rows held
//   in registers (2 * rows accumulators of 8 floats), each weight converted to fp32 on
//   the way. With more rows the panel is first converted to an fp32 buffer that stays in
//   L1/L2 while every 6-row tile of x passes over it, which makes large M (prefill) run
//   like an fp32 GEMM.
// - AVX512-BF16 ([N/16][K/2][16 x 2] bf16, pairs of consecutive k per column): one
//   `vdpbf16ps` multiplies 16 columns by two k each, 4x the multiply-adds of an AVX2 FMA
//   and no conversion, so a few rows cost about what one does. An fp32 x is split exactly
//   into three bf16 parts (hi + mid + lo), each multiplied in turn.
//
// Accumulation is fp32 (products of bf16 numbers are exact in fp32); the result is
// rounded once to the output dtype, as aten's bf16 GEMM does.

#include <immintrin.h>
#include <torch/extension.h>

#include "vec.h"
#include <ATen/Parallel.h>

#include <cstdint>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using tandem_cpu::to_bf16x8;

constexpr int64_t kPanel = 16;   // output columns per panel: two AVX2 vectors of floats
constexpr int64_t kMaxRows = 6;  // rows per register tile: 12 accumulators + 2 weights + 1 x

// One k of a packed panel: 16 bf16 (32 bytes), stored as 8 u32 lanes whose low half is
// column j and high half column j + 8 (`pack`). A bf16 is the upper half of an fp32, so
// shifting the low halves up gives columns 0-7 and masking the low halves off gives
// columns 8-15: one load and two integer ops, no shuffle.
inline void load_panel_row(const uint16_t* p, __m256& lo, __m256& hi) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// One register tile: ROWS rows of x (fp32, row stride K) times one packed panel, into
// acc_out [ROWS][16]. With few rows there are too few independent accumulators to hide
// the FMA latency, so even and odd k accumulate apart (SPLIT sets) and are summed at the end.
// W is uint16_t (a packed bf16 panel) or float (a panel converted by `widen_panel`).
inline void load_panel_row(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_load_ps(p);
  hi = _mm256_load_ps(p + 8);
}

template <int ROWS, typename W>
inline void tile(const float* x, int64_t K, const W* panel, float* acc_out) {
  constexpr int SPLIT = ROWS <= 2 ? 2 : 1;
  __m256 acc0[SPLIT][ROWS], acc1[SPLIT][ROWS];
#pragma GCC unroll 16
  for (int s = 0; s < SPLIT; ++s) {
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      acc0[s][r] = _mm256_setzero_ps();
      acc1[s][r] = _mm256_setzero_ps();
    }
  }
  int64_t k = 0;
  for (; k + SPLIT <= K; k += SPLIT) {
#pragma GCC unroll 2
    for (int s = 0; s < SPLIT; ++s) {
      __m256 w0, w1;
      load_panel_row(panel + (k + s) * kPanel, w0, w1);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        __m256 xv = _mm256_broadcast_ss(x + r * K + k + s);
        acc0[s][r] = _mm256_fmadd_ps(xv, w0, acc0[s][r]);
        acc1[s][r] = _mm256_fmadd_ps(xv, w1, acc1[s][r]);
      }
    }
  }
  for (; k < K; ++k) {  // odd K with SPLIT == 2
    __m256 w0, w1;
    load_panel_row(panel + k * kPanel, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      acc0[0][r] = _mm256_fmadd_ps(xv, w0, acc0[0][r]);
      acc1[0][r] = _mm256_fmadd_ps(xv, w1, acc1[0][r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    __m256 lo = acc0[0][r], hi = acc1[0][r];
    if constexpr (SPLIT == 2) {
      lo = _mm256_add_ps(lo, acc0[1][r]);
      hi = _mm256_add_ps(hi, acc1[1][r]);
    }
    _mm256_storeu_ps(acc_out + r * kPanel, lo);
    _mm256_storeu_ps(acc_out + r * kPanel + 8, hi);
  }
}

template <typename W>
using TileFn = void (*)(const float*, int64_t, const W*, float*);
template <typename W>
constexpr TileFn<W> kTiles[kMaxRows + 1] = {nullptr,     tile<1, W>, tile<2, W>, tile<3, W>,
                                            tile<4, W>, tile<5, W>, tile<6, W>};

// A packed bf16 panel -> fp32, columns back in natural order: [K][16] floats.
inline void widen_panel(const uint16_t* panel, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    load_panel_row(panel + k * kPanel, lo, hi);
    _mm256_store_ps(out + k * kPanel, lo);
    _mm256_store_ps(out + k * kPanel + 8, hi);
  }
}

// Rows [m0, m0 + rows) of one panel's result (tile_out [rows][16] floats), plus the bias
// of its columns (bias + n0, or null), into out.
inline void store_tile(float* tile_out, int rows, int64_t m0, int64_t n0, int64_t cols,
                       int64_t N, const float* bias, bool out_bf16, char* out) {
  for (int r = 0; r < rows; ++r) {
    float* src = tile_out + r * kPanel;
    if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) src[c] += bias[c];
    }
    if (out_bf16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(out) + (m0 + r) * N + n0;
      alignas(16) uint16_t tmp[kPanel];
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16x8(_mm256_load_ps(src)));
      _mm_store_si128(reinterpret_cast<__m128i*>(tmp + 8), to_bf16x8(_mm256_load_ps(src + 8)));
      std::memcpy(dst, tmp, cols * sizeof(uint16_t));
    } else {
      float* dst = reinterpret_cast<float*>(out) + (m0 + r) * N + n0;
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

// -- AVX512-BF16 ---------------------------------------------------------------------

// Whether this CPU has `vdpbf16ps` (the build targets AVX2; these functions alone are
// compiled for AVX-512, and run only where the CPU has it).
bool cpu_has_bf16_dot() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  return has;
}

constexpr int64_t kDotMaxRows = 12;  // rows per register tile: 12 accumulators of 16 floats

// ROWS rows of x in PARTS bf16 parts (u32 pairs of consecutive k; part p of row r at
// x + p * part_stride + r * K2) times one dot-layout panel ([K2][16] u32), into
// acc_out [ROWS][16]. With few rows, pairs accumulate in SPLIT sets apart to hide the
// latency of `vdpbf16ps`. SPLIT depends on ROWS alone: a bf16 x gives the same sums whether
// passed as bf16 or as fp32 (whose mid and lo parts are then zero).
template <int ROWS, int PARTS>
__attribute__((target("avx512f,avx512bf16"))) void dot_tile(const uint32_t* x,
                                                           int64_t part_stride, int64_t K2,
                                                           const uint32_t* panel,
                                                           float* acc_out) {
  constexpr int SPLIT = ROWS >= 4 ? 1 : (ROWS >= 2 ? 2 : 4);
  __m512 acc[SPLIT][ROWS];
#pragma GCC unroll 16
  for (int s = 0; s < SPLIT; ++s) {
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) acc[s][r] = _mm512_setzero_ps();
  }
  int64_t kk = 0;
  for (; kk + SPLIT <= K2; kk += SPLIT) {
#pragma GCC unroll 4
    for (int s = 0; s < SPLIT; ++s) {
      const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + (kk + s) * kPanel);
#pragma GCC unroll 12
      for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 3
        for (int part = 0; part < PARTS; ++part) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(x[part * part_stride + r * K2 + kk + s]));
          acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xv, w);
        }
      }
    }
  }
  for (; kk < K2; ++kk) {  // K2 not a multiple of SPLIT
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + kk * kPanel);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
#pragma GCC unroll 3
      for (int part = 0; part < PARTS; ++part) {
        const __m512bh xv =
            (__m512bh)_mm512_set1_epi32(static_cast<int>(x[part * part_stride + r * K2 + kk]));
        acc[0][r] = _mm512_dpbf16_ps(acc[0][r], xv, w);
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    __m512 sum = acc[0][r];
#pragma GCC unroll 4
    for (int s = 1; s < SPLIT; ++s) sum = _mm512_add_ps(sum, acc[s][r]);
    _mm512_storeu_ps(acc_out + r * kPanel, sum);
  }
}

using DotTileFn = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, float*);

template <int PARTS, size_t... R>
constexpr std::array<DotTileFn, kDotMaxRows + 1> dot_tiles(std::index_sequence<R...>) {
  return {nullptr, &dot_tile<static_cast<int>(R) + 1, PARTS>...};
}
// [rows] -> the tile for 1 part (bf16 x) and for 3 parts (fp32 x)
constexpr auto kDotTiles1 = dot_tiles<1>(std::make_index_sequence<kDotMaxRows>{});
constexpr auto kDotTiles3 = dot_tiles<3>(std::make_index_sequence<kDotMaxRows>{});

// fp32 x [M, K] -> three bf16 parts [3][M][K] with x = hi + mid + lo exactly: each part
// keeps the top 8 significant bits of what the parts before it left (truncation, so every
// remainder is exact in fp32).
std::vector<uint16_t> split_fp32(const float* x, int64_t n) {
  std::vector<uint16_t> parts(3 * n);
  for (int64_t i = 0; i < n; ++i) {
    float rest = x[i];
    for (int part = 0; part < 3; ++part) {
      uint32_t bits;
      std::memcpy(&bits, &rest, sizeof(bits));
      const uint32_t top = bits & 0xffff0000u;
      float head;
      std::memcpy(&head, &top, sizeof(head));
      parts[part * n + i] = static_cast<uint16_t>(top >> 16);
      rest -= head;
    }
  }
  return parts;
}

}  // namespace

// Whether this CPU runs the AVX512-BF16 layout (`pack(weight, dot=true)`).
bool bf16_dot_supported() { return cpu_has_bf16_dot(); }

// [N, K] bf16 -> panels of 16 output columns, zero-padded past N:
// - dot=false: [ceil(N/16), K, 16]; within a panel row the columns are interleaved
//   0, 8, 1, 9, ..., 7, 15 (see load_panel_row);
// - dot=true (AVX512-BF16, K even): [ceil(N/16), K/2, 32], each panel row holding columns
//   0..15 as pairs (k, k+1) for `vdpbf16ps`.
at::Tensor pack(const at::Tensor& weight, bool dot) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack: expected a 2-D bfloat16 weight, got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  if (dot) {
    TORCH_CHECK(K % 2 == 0, "pack: the AVX512-BF16 layout needs an even K, got K=", K);
    // [panels, 16, K/2, 2] -> [panels, K/2, 16, 2]
    return padded.view({panels, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view(
        {panels, K / 2, 2 * kPanel});
  }
  // [panels, 2, 8, K] -> [panels, K, 8, 2]: column c = half * 8 + j lands at j * 2 + half
  return padded.view({panels, 2, kPanel / 2, K}).permute({0, 3, 2, 1}).contiguous().view(
      {panels, K, kPanel});
}

namespace {

void run_avx2(const float* xp, int64_t M, int64_t K, int64_t N, const uint16_t* wp,
              int64_t panels, const float* bp, bool out_bf16, char* op) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float tile_out[kMaxRows * kPanel];
    std::vector<float> wide;  // the current panel in fp32, when more rows than one tile
    if (M > kMaxRows) wide.resize(K * kPanel + 8);
    float* wide_p = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(wide.data()) + 31) & ~static_cast<uintptr_t>(31));
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = wp + p * K * kPanel;
      const float* pb = bp ? bp + p * kPanel : nullptr;  // this panel's columns' bias
      const int64_t n0 = p * kPanel;
      const int64_t cols = std::min(kPanel, N - n0);
      if (M <= kMaxRows) {
        const int rows = static_cast<int>(M);
        kTiles<uint16_t>[rows](xp, K, panel, tile_out);
        store_tile(tile_out, rows, 0, n0, cols, N, pb, out_bf16, op);
        continue;
      }
      widen_panel(panel, K, wide_p);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int rows = static_cast<int>(std::min(kMaxRows, M - m0));
        kTiles<float>[rows](xp + m0 * K, K, wide_p, tile_out);
        store_tile(tile_out, rows, m0, n0, cols, N, pb, out_bf16, op);
      }
    }
  });
}

// x as u32 pairs: [parts][M][K/2]. The panel stays in L1/L2 while the row tiles pass.
void run_dot(const uint32_t* xp, int parts, int64_t M, int64_t K2, int64_t N,
             const uint32_t* wp, int64_t panels, const float* bp, bool out_bf16, char* op) {
  const auto& tiles = parts == 1 ? kDotTiles1 : kDotTiles3;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float tile_out[kDotMaxRows * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const uint32_t* panel = wp + p * K2 * kPanel;
      const float* pb = bp ? bp + p * kPanel : nullptr;
      const int64_t n0 = p * kPanel;
      const int64_t cols = std::min(kPanel, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kDotMaxRows) {
        const int rows = static_cast<int>(std::min(kDotMaxRows, M - m0));
        tiles[rows](xp + m0 * K2, M * K2, K2, panel, tile_out);
        store_tile(tile_out, rows, m0, n0, cols, N, pb, out_bf16, op);
      }
    }
  });
}

}  // namespace

// x [..., K] (bf16 or fp32), packed from `pack`, bias [N] or none -> [..., N] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                  int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kPanel || packed.size(2) == 2 * kPanel) &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "linear: packed weight must come from pack()");
  const bool dot = packed.size(2) == 2 * kPanel;
  TORCH_CHECK(!dot || cpu_has_bf16_dot(),
              "linear: the weight is packed for AVX512-BF16, which this CPU lacks; pack it "
              "with dot=False");
  const int64_t K = dot ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(x.size(-1) == K, "linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "linear: N=", N, " does not match the packed weight");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "linear: x must be bfloat16 or float32");
  const int64_t M = x.numel() / K;
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "linear: bias has ", bias->numel(), " values, N=", N);
    bias32 = bias->reshape({N}).to(at::kFloat).contiguous();
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end() - 1);
  out_shape.push_back(N);
  at::Tensor out = at::empty({M, N}, x.options());
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  const float* bp = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  char* op = static_cast<char*>(out.data_ptr());
  const int64_t panels = packed.size(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());

  if (dot) {
    const uint32_t* w32 = reinterpret_cast<const uint32_t*>(wp);
    if (out_bf16) {
      at::Tensor x16 = x.reshape({M, K}).contiguous();
      run_dot(reinterpret_cast<const uint32_t*>(x16.data_ptr<at::BFloat16>()), 1, M, K / 2, N,
              w32, panels, bp, out_bf16, op);
    } else {
      at::Tensor x32 = x.reshape({M, K}).contiguous();
      std::vector<uint16_t> parts = split_fp32(x32.data_ptr<float>(), M * K);
      run_dot(reinterpret_cast<const uint32_t*>(parts.data()), 3, M, K / 2, N, w32, panels, bp,
              out_bf16, op);
    }
  } else {
    at::Tensor x32 = x.reshape({M, K}).to(at::kFloat).contiguous();
    run_avx2(x32.data_ptr<float>(), M, K, N, wp, panels, bp, out_bf16, op);
  }
  return out.view(out_shape);
}

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("pack_bf16(Tensor weight, bool dot=False) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("bf16_dot_supported() -> bool", &bf16_dot_supported);
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("pack_bf16", &pack);
  m.impl("bf16_linear", &linear);
}
