// SGMV on the CPU: one projection's LoRA deltas added into its base product in one call.
//
// A step's tokens come in groups, each under one adapter slot (`lora_grouped_offsets`,
// `lora_ids`: -1 or a slot past the stacked ones is none). For every group with an
// adapter, its tokens are shrunk by the adapter's A (to the ranks of all the projection's
// parts at once: q, k and v share their input), then each part's columns expanded by
// that part's B and added into the part's columns of y, rounded once to y's dtype.
// Each used adapter's weights are read from memory once per chunk of its group's tokens
// (below; within a chunk, from the caches); the adapters no group uses are not read.
//
// Layouts (made by engine/lora/ops.py's CpuSgmv):
// - a [S, R/16, in, 16]: every slot's A of all parts, their ranks one after another
//   (part p's from rank_offsets[p] to rank_offsets[p + 1]), zero-padded to R (a
//   multiple of 16), in panels of 16 rank columns;
// - b[p] [S, ceil(out_p/64), r_p, 64]: part p's B transposed, its scaling in it, zero rows
//   past the slot's own rank, in blocks of 64 output columns (zero-padded).
// So a slot's A, and each part's B, are each one stretch of memory read in order.
// Weights and activations are both bf16 or both fp32; sums are fp32 (FMA).
//
// The threads share the work by token chunks: each chunk is up to 16 of one group's
// tokens (fewer where the step has few; a decode step's groups are often one token
// each), shrunk and then expanded by one thread, with no barrier between the two. A thread's streams are long and in order,
// prefetched ahead: these few-row products are bound by how fast memory answers, and
// one stream per thread reads faster than many short ones (bench/RESULTS.md, issue 40).

#include <torch/extension.h>

#include "vec.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using tandem_cpu::load8;
using tandem_cpu::store8;

constexpr int64_t kRankPanel = 16;  // shrink columns per panel: two AVX2 vectors
constexpr int kTokenTile = 3;       // tokens per shrink register tile (12 accumulators)
constexpr int64_t kBlock = 64;      // expand: output columns per task (8 vectors)
constexpr int64_t kChunk = 16;     // tokens per task: a group's tokens in chunks
constexpr int64_t kAhead = 1024;    // bytes prefetched ahead of the weights' stream

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

struct Group {
  int64_t start, end, slot;
};

inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(float v) { return v; }

// Tokens [0, ROWS) of x (row stride `in`) times one A panel [in][16] -> h rows (stride R).
// Even and odd k sum apart (more chains to hide the FMA latency), whatever ROWS: a
// token's sums run in one order, whichever tile it lands in, so its delta does not
// depend on the other tokens of the step.
template <int ROWS, typename T>
void shrink_tile(const T* x, int64_t in, const T* panel, float* h, int64_t R) {
  __m256 acc[ROWS][2][2];  // [token][k's parity][columns 0-7, 8-15]
  for (int i = 0; i < ROWS; ++i)
    for (int s = 0; s < 2; ++s) acc[i][s][0] = acc[i][s][1] = _mm256_setzero_ps();
  const char* stream = reinterpret_cast<const char*>(panel);
  for (int64_t k = 0; k < in; ++k) {
    const int s = static_cast<int>(k & 1);
    if (s == 0) prefetch(stream + k * kRankPanel * sizeof(T) + kAhead);
    const __m256 lo = load8(panel + k * kRankPanel);
    const __m256 hi = load8(panel + k * kRankPanel + 8);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 xv = _mm256_set1_ps(to_float(x[i * in + k]));
      acc[i][s][0] = _mm256_fmadd_ps(lo, xv, acc[i][s][0]);
      acc[i][s][1] = _mm256_fmadd_ps(hi, xv, acc[i][s][1]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm256_storeu_ps(h + i * R, _mm256_add_ps(acc[i][0][0], acc[i][1][0]));
    _mm256_storeu_ps(h + i * R + 8, _mm256_add_ps(acc[i][0][1], acc[i][1][1]));
  }
}

template <typename T>
void shrink(const T* x, int64_t rows, int64_t in, const T* panel, float* h, int64_t R) {
  int64_t i = 0;
  for (; i + kTokenTile <= rows; i += kTokenTile)
    shrink_tile<kTokenTile>(x + i * in, in, panel, h + i * R, R);
  if (rows - i == 2) shrink_tile<2>(x + i * in, in, panel, h + i * R, R);
  if (rows - i == 1) shrink_tile<1>(x + i * in, in, panel, h + i * R, R);
}

// One token's delta on columns [0, NV * 8) of a B block: sum over j < rank of
// h[j] * b[j][:] (b's row stride `ld`), added into y's columns, rounded once.
template <int NV, typename T>
void expand_block(const float* h, int64_t rank, const T* b, int64_t ld, T* y) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < rank; ++j) {
    for (size_t line = 0; line < NV * 8 * sizeof(T); line += 64)
      prefetch(reinterpret_cast<const char*>(b + j * ld) + kAhead + line);
    const __m256 hv = _mm256_set1_ps(h[j]);
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(load8(b + j * ld + v * 8), hv, acc[v]);
  }
  for (int v = 0; v < NV; ++v) store8(y + v * 8, _mm256_add_ps(load8(y + v * 8), acc[v]));
}

template <typename T>
void expand_columns(const float* h, int64_t rank, const T* b, int64_t ld, T* y, int64_t width) {
  int64_t c = 0;
  for (; c + kBlock <= width; c += kBlock) expand_block<8>(h, rank, b + c, ld, y + c);
  for (; c + 8 <= width; c += 8) expand_block<1>(h, rank, b + c, ld, y + c);
  for (; c < width; ++c) {  // a width that is not a multiple of 8
    float sum = 0.0f;
    for (int64_t j = 0; j < rank; ++j) sum += h[j] * to_float(b[j * ld + c]);
    const float out = to_float(y[c]) + sum;
    if constexpr (std::is_same_v<T, float>) {
      y[c] = out;
    } else {
      y[c] = c10::BFloat16(out).x;  // round to nearest even, as store8
    }
  }
}

template <typename T>
void run(T* y, int64_t ldy, const T* x, int64_t in, const T* a, int64_t R,
         const std::vector<const T*>& b, const std::vector<int64_t>& ranks,
         const std::vector<int64_t>& rank_offsets, const std::vector<int64_t>& widths,
         const std::vector<int64_t>& column_offsets, const std::vector<Group>& groups) {
  const int64_t panels = R / kRankPanel;
  // Tasks: each group's tokens in chunks, each shrunk then expanded by one thread that
  // streams its adapter's A, then each part's B, in order. Chunks of at most kChunk
  // tokens, fewer where the tokens are few, so that every thread has some.
  int64_t tokens = 0;
  for (const Group& g : groups) tokens += g.end - g.start;
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::clamp<int64_t>((tokens + threads - 1) / threads, 1, kChunk);
  std::vector<Group> tasks;
  for (const Group& g : groups)
    for (int64_t t = g.start; t < g.end; t += chunk)
      tasks.push_back({t, std::min(t + chunk, g.end), g.slot});
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> h(static_cast<size_t>(kChunk * R));
    for (int64_t task = lo; task < hi; ++task) {
      const Group& g = tasks[task];
      const int64_t rows = g.end - g.start;
      for (int64_t p = 0; p < panels; ++p)
        shrink(x + g.start * in, rows, in, a + (g.slot * panels + p) * in * kRankPanel,
               h.data() + p * kRankPanel, R);
      for (size_t p = 0; p < widths.size(); ++p) {
        if (ranks[p] == 0) continue;
        const int64_t blocks = (widths[p] + kBlock - 1) / kBlock;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const T* bp = b[p] + ((g.slot * blocks + blk) * ranks[p]) * kBlock;
          const int64_t c0 = blk * kBlock, width = std::min(kBlock, widths[p] - c0);
          for (int64_t i = 0; i < rows; ++i)
            expand_columns(h.data() + i * R + rank_offsets[p], ranks[p], bp, kBlock,
                           y + (g.start + i) * ldy + column_offsets[p] + c0, width);
        }
      }
    }
  });
}

}  // namespace

// Adds each token's LoRA delta into y [T, sum(out_p)] in place (see the file's comment).
void sgmv_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, at::TensorList b,
              at::IntArrayRef rank_offsets, at::IntArrayRef column_offsets,
              at::IntArrayRef lora_grouped_offsets, at::IntArrayRef lora_ids) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "sgmv_add: x must be contiguous [T, in]");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(0) == x.size(0),
              "sgmv_add: y must be [T, out] with unit column stride, T as x's");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "sgmv_add: x must be bfloat16 or float32");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type(),
              "sgmv_add: y, x and a must share one dtype");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && a.size(2) == x.size(1) &&
                  a.size(3) == kRankPanel,
              "sgmv_add: a must be contiguous [S, R/16, in, 16]");
  const int64_t slots = a.size(0), in = x.size(1), R = a.size(1) * kRankPanel;
  const size_t parts = b.size();
  TORCH_CHECK(rank_offsets.size() == parts + 1 && column_offsets.size() == parts + 1,
              "sgmv_add: rank_offsets and column_offsets need one more entry than b");
  TORCH_CHECK(rank_offsets[0] >= 0 && rank_offsets[parts] <= R,
              "sgmv_add: rank_offsets fall outside a's ", R, " columns");
  TORCH_CHECK(column_offsets[0] >= 0 && column_offsets[parts] <= y.size(1),
              "sgmv_add: column_offsets fall outside y's ", y.size(1), " columns");
  std::vector<int64_t> ranks(parts), widths(parts);
  for (size_t p = 0; p < parts; ++p) {
    ranks[p] = rank_offsets[p + 1] - rank_offsets[p];
    widths[p] = column_offsets[p + 1] - column_offsets[p];
    TORCH_CHECK(ranks[p] >= 0 && widths[p] >= 0,
                "sgmv_add: rank_offsets and column_offsets must not decrease");
    TORCH_CHECK(b[p].dim() == 4 && b[p].is_contiguous() && b[p].size(0) == slots &&
                    b[p].size(1) == (widths[p] + kBlock - 1) / kBlock &&
                    b[p].size(2) == ranks[p] && b[p].size(3) == kBlock &&
                    b[p].scalar_type() == x.scalar_type(),
                "sgmv_add: b[", p, "] must be contiguous [S, ceil(", widths[p], "/64), ",
                ranks[p], ", 64] of x's dtype");
  }
  TORCH_CHECK(lora_grouped_offsets.size() == lora_ids.size() + 1,
              "sgmv_add: lora_grouped_offsets needs one more entry than lora_ids");
  TORCH_CHECK(lora_grouped_offsets.back() == x.size(0),
              "sgmv_add: the groups cover ", lora_grouped_offsets.back(), " tokens, x has ",
              x.size(0));
  std::vector<Group> groups;
  for (size_t g = 0; g < lora_ids.size(); ++g) {
    const int64_t start = lora_grouped_offsets[g], end = lora_grouped_offsets[g + 1];
    TORCH_CHECK(0 <= start && start <= end, "sgmv_add: lora_grouped_offsets must not decrease");
    if (lora_ids[g] >= 0 && lora_ids[g] < slots && end > start)
      groups.push_back({start, end, lora_ids[g]});
  }
  if (groups.empty()) return;
  if (x.scalar_type() == at::kFloat) {
    std::vector<const float*> bp;
    for (const auto& t : b) bp.push_back(t.data_ptr<float>());
    run<float>(y.data_ptr<float>(), y.stride(0),
               x.data_ptr<float>(), in, a.data_ptr<float>(), R, bp, ranks,
               std::vector<int64_t>(rank_offsets.begin(), rank_offsets.end()), widths,
               std::vector<int64_t>(column_offsets.begin(), column_offsets.end()), groups);
  } else {
    using U = uint16_t;
    std::vector<const U*> bp;
    for (const auto& t : b) bp.push_back(reinterpret_cast<const U*>(t.data_ptr<at::BFloat16>()));
    run<U>(reinterpret_cast<U*>(y.data_ptr<at::BFloat16>()), y.stride(0),
           reinterpret_cast<const U*>(x.data_ptr<at::BFloat16>()), in,
           reinterpret_cast<const U*>(a.data_ptr<at::BFloat16>()), R, bp, ranks,
           std::vector<int64_t>(rank_offsets.begin(), rank_offsets.end()), widths,
           std::vector<int64_t>(column_offsets.begin(), column_offsets.end()), groups);
  }
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "sgmv_add(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b, int[] rank_offsets, "
      "int[] column_offsets, int[] lora_grouped_offsets, int[] lora_ids) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("sgmv_add", &sgmv_add); }
