// Attention of a few query tokens per row (decode and speculative verification steps)
// straight from the paged KV cache, on AVX2 CPUs.
//
// The plain-torch path gathers every row's K/V into a padded [B, Hkv, C, D] copy, converts
// bf16 caches to fp32 (SDPA on CPU is slower in bf16) and attends through a [B, Q, C] mask:
// at 64 rows of ~300 tokens those copies took twice the time of the attention itself, and
// attention as much as all of the step's matrix products. Here each (row, KV head) reads
// its K/V rows where they lie in the cache, converting as it goes: from memory for the
// first of the row's queries of that head group (Q tokens x Hq/Hkv heads), then from L1/L2
// for the others.
//
// Per (row, KV head), per query: the scores of every context position it may see (causal:
// positions <= its own; else the whole context), their softmax (fp32, max subtracted),
// then the probability-weighted sum of V rows, the query and the sum held in registers.
// The result is rounded once to q's dtype.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tandem_cpu::exp8;
using tandem_cpu::hsum;
using tandem_cpu::load8;
using tandem_cpu::store8;

struct Shapes {
  // slot_stride: elements from one token's K/V row to the next one's (num_kv_heads * D for
  // a pool of its own; more for one rank's heads of a pool that holds every rank's).
  int64_t num_kv_heads, group, block_size, max_blocks, slot_stride;
};

// One row's tokens [t0, t1) and one KV head h. T: the element type of q, the caches and
// out (uint16_t for bf16, float); NV: head_dim / 8, so that a query and its output sum sit
// in registers. Each query (token t0 + i / G, head h * G + i % G) reads the K rows, then the
// V rows, of the context it sees: they stay in L1/L2 across the G * (t1 - t0) queries.
template <typename T, int NV>
void attend_row_head(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                     int64_t context_len, const int64_t* positions, int64_t t0, int64_t t1,
                     int64_t h, const Shapes& s, float scale, bool is_causal, T* out,
                     std::vector<float>& scores, std::vector<int64_t>& offsets) {
  constexpr int64_t D = NV * 8;
  const int64_t G = s.group, Hq = s.num_kv_heads * G;
  int64_t span = 0;  // context positions any of the row's queries sees
  for (int64_t t = t0; t < t1; ++t) {
    span = std::max(span, is_causal ? std::min(positions[t] + 1, context_len) : context_len);
  }
  offsets.resize(span);  // element offset of position p's K/V row of head h in a cache
  for (int64_t p = 0; p < span; ++p) {
    const int64_t slot = table[p / s.block_size] * s.block_size + p % s.block_size;
    offsets[p] = slot * s.slot_stride + h * D;
  }
  scores.resize(span);
  float* row = scores.data();
  for (int64_t i = 0; i < (t1 - t0) * G; ++i) {
    const int64_t t = t0 + i / G;
    const int64_t n = is_causal ? std::min(positions[t] + 1, context_len) : context_len;
    const int64_t at = (t * Hq + h * G + i % G) * D;
    __m256 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_mul_ps(load8(q + at + 8 * v), _mm256_set1_ps(scale));

    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < n; ++p) {  // scores
      const T* k = k_cache + offsets[p];
      __m256 dot0 = _mm256_setzero_ps(), dot1 = _mm256_setzero_ps();
      for (int v = 0; v + 1 < NV; v += 2) {
        dot0 = _mm256_fmadd_ps(qv[v], load8(k + 8 * v), dot0);
        dot1 = _mm256_fmadd_ps(qv[v + 1], load8(k + 8 * v + 8), dot1);
      }
      if constexpr (NV % 2 == 1) dot0 = _mm256_fmadd_ps(qv[NV - 1], load8(k + 8 * (NV - 1)), dot0);
      row[p] = hsum(_mm256_add_ps(dot0, dot1));
      m = std::max(m, row[p]);
    }

    const __m256 vm = _mm256_set1_ps(m);  // probabilities, unnormalised, and their sum
    __m256 vsum = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 8 <= n; p += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + p), vm));
      _mm256_storeu_ps(row + p, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    if (p < n) {  // the tail, through a padded copy
      alignas(32) float tail[8];
      for (int j = 0; j < 8; ++j) tail[j] = p + j < n ? row[p + j] - m : -1000.0f;
      _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
      for (int64_t j = 0; p + j < n; ++j) {
        row[p + j] = tail[j];
        sum += tail[j];
      }
    }

    __m256 acc[NV];  // probability-weighted V rows
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; ++p) {
      const T* vr = v_cache + offsets[p];
      const __m256 w = _mm256_set1_ps(row[p]);
      for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(w, load8(vr + 8 * v), acc[v]);
    }
    const __m256 inv = _mm256_set1_ps(n > 0 ? 1.0f / sum : 0.0f);
    for (int v = 0; v < NV; ++v) store8(out + at + 8 * v, _mm256_mul_ps(acc[v], inv));
  }
}

template <typename T>
using RowHeadFn = decltype(&attend_row_head<T, 8>);

// The head sizes compiled in: 64 (SmolLM2, Llama-3.2 1B) and 128 (Llama-3 8B/70B, 3.2 3B).
template <typename T>
RowHeadFn<T> row_head_fn(int64_t head_dim) {
  switch (head_dim) {
    case 64: return attend_row_head<T, 8>;
    case 128: return attend_row_head<T, 16>;
    default: return nullptr;
  }
}

}  // namespace

// q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] in q's dtype (bf16 or
// fp32), each head's D elements contiguous and the slots evenly spaced (a contiguous pool,
// or a tensor-parallel rank's heads of one that holds every rank's: engine.executor.shared_kv); block_tables [B, M], context_lens [B] (KV length after this step, this step's
// K/V already written), row_offsets [B + 1] (row b owns tokens row_offsets[b] ..
// row_offsets[b+1]), positions [T], all int64. Returns [T, Hq, D] in q's dtype.
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& tables_in,
                           const at::Tensor& lens_in, const at::Tensor& offsets_in,
                           const at::Tensor& positions_in, double scale, bool is_causal) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q must be [T, Hq, D] and the caches [blocks, block_size, Hkv, D]");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type() && q_in.scalar_type() == v_cache.scalar_type() &&
                  (q_in.scalar_type() == at::kBFloat16 || q_in.scalar_type() == at::kFloat),
              "paged_attention: q and the caches must share one dtype, bfloat16 or float32");
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t Hkv = k_cache.size(2);
  const int64_t slot_stride = k_cache.stride(1);
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) && slot_stride >= Hkv * k_cache.size(3) &&
                  k_cache.stride(0) == k_cache.size(1) * slot_stride,
              "paged_attention: the caches' heads and slots must be evenly spaced, alike in both");
  TORCH_CHECK(k_cache.size(3) == D && (D == 64 || D == 128), "paged_attention: head_dim ", D,
              " must match the caches and be 64 or 128 (the sizes compiled in)");
  TORCH_CHECK(Hq % Hkv == 0, "paged_attention: ", Hq, " query heads for ", Hkv, " KV heads");
  for (const at::Tensor* t : {&tables_in, &lens_in, &offsets_in, &positions_in}) {
    TORCH_CHECK(t->scalar_type() == at::kLong,
                "paged_attention: tables, lengths, offsets and positions must be int64");
  }
  const at::Tensor block_tables = tables_in.contiguous(), context_lens = lens_in.contiguous();
  const at::Tensor row_offsets = offsets_in.contiguous(), positions = positions_in.contiguous();
  const int64_t B = row_offsets.numel() - 1;
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B &&
                  positions.numel() == T,
              "paged_attention: ", B, " rows need [", B, ", M] tables and ", B, " lengths; ", T,
              " tokens need ", T, " positions");
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty_like(q);
  const Shapes s{Hkv, Hq / Hkv, k_cache.size(1), block_tables.size(1), slot_stride};
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* offsets = row_offsets.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(offsets[0] == 0 && offsets[B] == T, "paged_attention: row_offsets must run from 0 to ", T);
  const float fscale = static_cast<float>(scale);

  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(qp)>>;
    const RowHeadFn<T> fn = row_head_fn<T>(D);
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<int64_t> kv_offsets;
      for (int64_t w = begin; w < end; ++w) {
        const int64_t b = w / Hkv, h = w % Hkv;
        if (offsets[b + 1] > offsets[b]) {
          fn(qp, kp, vp, tables + b * s.max_blocks, lens[b], pos, offsets[b], offsets[b + 1], h,
             s, fscale, is_causal, op, scores, kv_offsets);
        }
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>());
  } else {
    auto u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run(static_cast<const uint16_t*>(u16(q)), static_cast<const uint16_t*>(u16(k_cache)),
        static_cast<const uint16_t*>(u16(v_cache)), u16(out));
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, Tensor row_offsets, Tensor positions, float scale, bool is_causal) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
