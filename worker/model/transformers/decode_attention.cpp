// Decode attention over the paged KV cache, reading the pools in place (no gather).
//
// One task per (decode row, kv head): the query heads sharing that kv head (GQA) score every
// key of the row's blocks in fp32, then a softmax and the weighted sum of the values, so each
// key and value is read once for all of its query heads. Built by worker/model/transformers/cpu_kernels.py with
// portable flags (AVX2 + FMA + F16C, never -march=native); a bfloat16 model over its bfloat16
// cache takes a second path on CPUs with AVX512-BF16 (attend_wide).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using llmq::exp8;
using llmq::hsum;
using llmq::load8;

// The sums of 8 vectors at once, [sum(v[0]), ..., sum(v[7])]: a horizontal sum per score
// took as long as its dot product.
inline __m256 hsum8(const __m256* v) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// n elements from p (a whole block: block size x kv heads x head dim, contiguous), a prefetch
// per cache line.
template <typename T>
inline void prefetch_whole(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}

// The blocks are scattered over the pool, so the hardware prefetcher cannot guess the next
// one: at block b (its first token t0), fetch the next block's keys and values (the second
// pass reads them back) ahead, and block 0's own at the start; whole: all kv heads' parts,
// which this row's next tasks (its other kv heads, on this thread) then find in cache (the
// pools' pointers are offset to this head: the whole block from there reaches a few lines into
// the next one, harmless for a prefetch). 30 layers of 64 rows of ~72 float16 tokens: 23.8 ->
// 21.8 ms against this head's part only (2 threads, medians of 40, the two builds in turn).
template <typename K>
inline void prefetch_ahead(const K* kpool, const K* vpool, const int64_t* blocks, int64_t b,
                           int64_t t0, int64_t length, int64_t block_size, int64_t token_stride) {
  const int64_t whole = block_size * token_stride;
  if (b == 0) {
    prefetch_whole(kpool + blocks[0] * whole, whole);
    prefetch_whole(vpool + blocks[0] * whole, whole);
  }
  if (t0 + block_size < length) {
    prefetch_whole(kpool + blocks[b + 1] * whole, whole);
    prefetch_whole(vpool + blocks[b + 1] * whole, whole);
  }
}

inline void store_out(float* o, float v) { *o = v; }
inline void store_out(at::BFloat16* o, float v) { *o = at::BFloat16(v); }
inline void store_out(at::Half* o, float v) { *o = at::Half(v); }

// One (row, kv head): REP query heads, DIM a multiple of 8 (checked by the caller). T is the
// queries' and output's type, K the pools' (a float16 cache under a float32 model halves the
// bytes read, and reading them is this kernel's cost).
template <typename T, typename K, int REP>
void attend(const T* q, int64_t q_head_stride, const K* kpool, const K* vpool,
            int64_t token_stride, const int64_t* blocks, int64_t length, int64_t block_size,
            int64_t dim, float scale, T* out, int64_t out_head_stride,
            std::vector<float>& scores, std::vector<float>& qf) {
  const int64_t chunks = dim / 8;
  qf.resize(REP * dim);
  for (int r = 0; r < REP; ++r)
    for (int64_t d = 0; d < dim; ++d)
      qf[r * dim + d] = static_cast<float>(q[r * q_head_stride + d]) * scale;
  // Scores laid [REP][length rounded up to 8], so the softmax runs on whole vectors.
  const int64_t padded = (length + 7) / 8 * 8;
  scores.resize(REP * padded);
  float best[REP];
  for (int r = 0; r < REP; ++r) best[r] = -INFINITY;
  for (int64_t t0 = 0, b = 0; t0 < length; t0 += block_size, ++b) {
    const int64_t n = std::min(block_size, length - t0);
    const K* k = kpool + blocks[b] * block_size * token_stride;
    prefetch_ahead(kpool, vpool, blocks, b, t0, length, block_size, token_stride);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8, k += 8 * token_stride) {   // 8 keys: one vector of scores each
      __m256 acc[REP][8];
      for (int j = 0; j < 8; ++j) {
        for (int r = 0; r < REP; ++r) acc[r][j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          __m256 kv = load8(k + j * token_stride + c * 8);
          for (int r = 0; r < REP; ++r)
            acc[r][j] = _mm256_fmadd_ps(load8(&qf[r * dim + c * 8]), kv, acc[r][j]);
        }
      }
      for (int r = 0; r < REP; ++r) {
        __m256 s8 = hsum8(acc[r]);
        _mm256_storeu_ps(&scores[r * padded + t0 + i], s8);
        alignas(32) float m8[8];
        _mm256_store_ps(m8, s8);
        for (int j = 0; j < 8; ++j) best[r] = std::max(best[r], m8[j]);
      }
    }
    for (; i < n; ++i, k += token_stride) {
      __m256 acc[REP];
      for (int r = 0; r < REP; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        __m256 kv = load8(k + c * 8);
        for (int r = 0; r < REP; ++r)
          acc[r] = _mm256_fmadd_ps(load8(&qf[r * dim + c * 8]), kv, acc[r]);
      }
      for (int r = 0; r < REP; ++r) {
        float s = hsum(acc[r]);
        scores[r * padded + t0 + i] = s;
        best[r] = std::max(best[r], s);
      }
    }
  }
  float inv[REP];
  for (int r = 0; r < REP; ++r) {
    float* s = &scores[r * padded];
    for (int64_t t = length; t < padded; ++t) s[t] = -INFINITY;
    __m256 m = _mm256_set1_ps(best[r]), sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
      __m256 e = exp8(_mm256_sub_ps(load8(s + t), m));
      // exp8's clamp makes exp(-inf) tiny, not 0: the padding must weigh nothing.
      if (t + 8 > length) {
        alignas(32) float keep[8];
        for (int j = 0; j < 8; ++j) keep[j] = (t + j < length) ? 1.0f : 0.0f;
        e = _mm256_mul_ps(e, _mm256_load_ps(keep));
      }
      _mm256_storeu_ps(s + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[r] = 1.0f / hsum(sum);
  }
  // The values in groups of 4 vectors (32 dims): REP x 4 accumulators stay in registers.
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t nc = std::min<int64_t>(4, chunks - c0);
    __m256 acc[REP][4];
    for (int r = 0; r < REP; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t t0 = 0, b = 0; t0 < length; t0 += block_size, ++b) {
      const int64_t n = std::min(block_size, length - t0);
      const K* v = vpool + blocks[b] * block_size * token_stride + c0 * 8;
      for (int64_t i = 0; i < n; ++i, v += token_stride) {
        __m256 p[REP];
        for (int r = 0; r < REP; ++r) p[r] = _mm256_set1_ps(scores[r * padded + t0 + i]);
        for (int c = 0; c < nc; ++c) {
          __m256 vv = load8(v + c * 8);
          for (int r = 0; r < REP; ++r) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < REP; ++r) {
      alignas(32) float tmp[8];
      for (int c = 0; c < nc; ++c) {
        _mm256_store_ps(tmp, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r])));
        T* o = out + r * out_head_stride + (c0 + c) * 8;
        for (int j = 0; j < 8; ++j) store_out(o + j, tmp[j]);
      }
    }
  }
}

// attend's twin for bfloat16 queries over a bfloat16 cache on AVX512-BF16 CPUs (the ones dtype
// `auto` serves in bfloat16): a score is 32 products at a time straight from the stored bits
// (_mm512_dpbf16_ps; no widening, and each product of two bfloat16s is exact in float32), the
// scale applied to the sum; the weighted sum of the values at 16 lanes. DIM a multiple of 32,
// at most 128 (checked by the caller). At 64 rows of ~70 tokens the AVX2 path took ~11 ms of a
// ~80 ms step (the largest part after the linears), as much as float32's over its float16 cache.
namespace wide {

using BF16 = at::BFloat16;
using llmq::wide::exp16;
using llmq::wide::load16;

LLMQ_WIDE inline __m512bh load32(const BF16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// 8 keys' float32 partial sums (16 lanes each) -> their 8 scores.
LLMQ_WIDE inline __m256 sums8(const __m512* v) {
  __m256 h[8];
  for (int j = 0; j < 8; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(v[j]), _mm512_extractf32x8_ps(v[j], 1));
  return hsum8(h);
}

template <int REP>
LLMQ_WIDE void attend(const BF16* q, int64_t q_head_stride, const BF16* kpool, const BF16* vpool,
                      int64_t token_stride, const int64_t* blocks, int64_t length,
                      int64_t block_size, int64_t dim, float scale, BF16* out,
                      int64_t out_head_stride, std::vector<float>& scores) {
  const int64_t pairs = dim / 32;                      // 1-4 vectors of 32 bfloat16s
  __m512bh qv[REP][4];
  for (int r = 0; r < REP; ++r)
    for (int64_t c = 0; c < pairs; ++c) qv[r][c] = load32(q + r * q_head_stride + c * 32);
  // Scores laid [REP][padded]: 8 keys' scores are stored at once, the last of a block's groups
  // with fewer keys reaching up to 7 past them (the next block's scores overwrite those), so a
  // row has room for 7 more than its length.
  const int64_t padded = (length + 7 + 15) / 16 * 16;
  scores.resize(REP * padded);
  const __m256 scale8 = _mm256_set1_ps(scale);
  __m256 best[REP];
  for (int r = 0; r < REP; ++r) best[r] = _mm256_set1_ps(-INFINITY);
  for (int64_t t0 = 0, b = 0; t0 < length; t0 += block_size, ++b) {
    const int64_t n = std::min(block_size, length - t0);
    const BF16* k = kpool + blocks[b] * block_size * token_stride;
    prefetch_ahead(kpool, vpool, blocks, b, t0, length, block_size, token_stride);
    for (int64_t i = 0; i < n; i += 8, k += 8 * token_stride) {   // 8 keys (the last few: fewer)
      const int m = static_cast<int>(std::min<int64_t>(8, n - i));
      __m512 acc[REP][8];
      for (int j = 0; j < 8; ++j) {
        for (int r = 0; r < REP; ++r) acc[r][j] = _mm512_setzero_ps();
        if (j >= m) continue;
        for (int64_t c = 0; c < pairs; ++c) {
          __m512bh kv = load32(k + j * token_stride + c * 32);
          for (int r = 0; r < REP; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv[r][c], kv);
        }
      }
      for (int r = 0; r < REP; ++r) {
        __m256 s8 = _mm256_mul_ps(sums8(acc[r]), scale8);
        if (m < 8) {        // the missing keys' zeros must not win the max
          alignas(32) float keep[8];
          for (int j = 0; j < 8; ++j) keep[j] = j < m ? 0.0f : -INFINITY;
          s8 = _mm256_add_ps(s8, _mm256_load_ps(keep));
        }
        _mm256_storeu_ps(&scores[r * padded + t0 + i], s8);
        best[r] = _mm256_max_ps(best[r], s8);
      }
    }
  }
  float inv[REP];
  for (int r = 0; r < REP; ++r) {
    alignas(32) float m8[8];
    _mm256_store_ps(m8, best[r]);
    float mx = m8[0];
    for (int j = 1; j < 8; ++j) mx = std::max(mx, m8[j]);
    float* s = &scores[r * padded];
    const __m512 m = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 16) {
      // exp16's clamp makes exp(-inf) tiny, not 0: past the length, the weights are zeroed.
      const __mmask16 live = t + 16 <= length ? 0xffff : (1u << (length - t)) - 1;
      __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), m)));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // The values 64 dims at a time (4 vectors): REP x 4 accumulators stay in registers.
  const int64_t chunks = dim / 16;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t nc = std::min<int64_t>(4, chunks - c0);
    __m512 acc[REP][4];
    for (int r = 0; r < REP; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0, b = 0; t0 < length; t0 += block_size, ++b) {
      const int64_t n = std::min(block_size, length - t0);
      const BF16* v = vpool + blocks[b] * block_size * token_stride + c0 * 16;
      for (int64_t i = 0; i < n; ++i, v += token_stride) {
        __m512 p[REP];
        for (int r = 0; r < REP; ++r) p[r] = _mm512_set1_ps(scores[r * padded + t0 + i]);
        for (int c = 0; c < nc; ++c) {
          __m512 vv = load16(v + c * 16);
          for (int r = 0; r < REP; ++r) acc[r][c] = _mm512_fmadd_ps(p[r], vv, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < REP; ++r)
      for (int c = 0; c < nc; ++c)
        llmq::wide::store16(out + r * out_head_stride + (c0 + c) * 16,
                            _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
  }
}

}  // namespace wide

template <typename T, typename K, int REP>
void run(const torch::Tensor& q, const torch::Tensor& kpool, const torch::Tensor& vpool,
         const torch::Tensor& tables, const torch::Tensor& lengths, int64_t block_size,
         double scale, torch::Tensor& out) {
  const int64_t rows = tables.size(0), width = tables.size(1);
  const int64_t kv_heads = kpool.size(1), dim = kpool.size(2);
  const T* qp = q.data_ptr<T>();
  const K* kp = kpool.data_ptr<K>();
  const K* vp = vpool.data_ptr<K>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t token_stride = kv_heads * dim;
  bool wide_path = false;
  if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<K, at::BFloat16>)
    wide_path = dim % 32 == 0 && dim <= 128 && llmq::wide::on();
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, h = task % kv_heads;
      if constexpr (std::is_same_v<T, at::BFloat16> && std::is_same_v<K, at::BFloat16>) {
        if (wide_path) {
          wide::attend<REP>(qp + row * qs0 + h * REP * qs1, qs1, kp + h * dim, vp + h * dim,
                            token_stride, tp + row * width, lp[row], block_size, dim,
                            static_cast<float>(scale), op + row * os0 + h * REP * os1, os1,
                            scores);
          continue;
        }
      }
      attend<T, K, REP>(qp + row * qs0 + h * REP * qs1, qs1, kp + h * dim, vp + h * dim,
                     token_stride, tp + row * width, lp[row], block_size, dim,
                     static_cast<float>(scale), op + row * os0 + h * REP * os1, os1,
                     scores, qf);
    }
  });
}

template <typename T, typename K>
void dispatch_rep(int64_t rep, const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v, const torch::Tensor& t, const torch::Tensor& l,
                  int64_t bs, double scale, torch::Tensor& out) {
  switch (rep) {
    case 1: return run<T, K, 1>(q, k, v, t, l, bs, scale, out);
    case 2: return run<T, K, 2>(q, k, v, t, l, bs, scale, out);
    case 3: return run<T, K, 3>(q, k, v, t, l, bs, scale, out);
    case 4: return run<T, K, 4>(q, k, v, t, l, bs, scale, out);
    case 5: return run<T, K, 5>(q, k, v, t, l, bs, scale, out);
    case 6: return run<T, K, 6>(q, k, v, t, l, bs, scale, out);
    case 7: return run<T, K, 7>(q, k, v, t, l, bs, scale, out);
    case 8: return run<T, K, 8>(q, k, v, t, l, bs, scale, out);
    default: TORCH_CHECK(false, "decode_attention: unsupported query heads per kv head ", rep);
  }
}

}  // namespace

// q [rows, heads, dim] (last dim contiguous), pools [slots, kv heads, dim] contiguous, tables
// [rows, blocks] int64 (entries past a row's length unread), lengths [rows] int64; writes
// out [rows, heads, dim] (last dim contiguous), same dtype as q. The pools are q's dtype, or
// float16 / bfloat16 under a float32 q.
void decode_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                      torch::Tensor tables, torch::Tensor lengths, int64_t block_size,
                      double scale, torch::Tensor out) {
  TORCH_CHECK(q.device().is_cpu() && kpool.is_contiguous() && vpool.is_contiguous());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && tables.is_contiguous() &&
              lengths.is_contiguous());
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong);
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && vpool.scalar_type() == kpool.scalar_type());
  const int64_t heads = q.size(1), kv_heads = kpool.size(1), dim = kpool.size(2);
  TORCH_CHECK(dim % 8 == 0 && heads % kv_heads == 0 && q.size(2) == dim);
  const int64_t rep = heads / kv_heads;
  const auto qt = q.scalar_type(), kt = kpool.scalar_type();
#define LLMQ_RUN(T, K) return dispatch_rep<T, K>(rep, q, kpool, vpool, tables, lengths, block_size, scale, out)
  if (qt == at::kFloat && kt == at::kFloat) LLMQ_RUN(float, float);
  if (qt == at::kFloat && kt == at::kHalf) LLMQ_RUN(float, at::Half);
  if (qt == at::kFloat && kt == at::kBFloat16) LLMQ_RUN(float, at::BFloat16);
  if (qt == at::kBFloat16 && kt == at::kBFloat16) LLMQ_RUN(at::BFloat16, at::BFloat16);
  if (qt == at::kHalf && kt == at::kHalf) LLMQ_RUN(at::Half, at::Half);
#undef LLMQ_RUN
  TORCH_CHECK(false, "decode_attention: unsupported dtypes: queries ", qt, ", cache ", kt);
}
