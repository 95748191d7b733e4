// Weight-only quantized linear layers for the few rows of a small decode step (built by
// worker/model/transformers/cpu_kernels.py, used by worker/model/transformers/quantized_linear.py).
//
// At one row a linear layer is a matrix-vector product: every weight is read once and used
// once, so its time is the weight's bytes over the memory bandwidth. int8 weights (a float16
// scale per group of 32 along the input, llama.cpp's Q8_0) read 17/64 of float32's bytes, int4
// (a float32 scale and minimum per group of 32) an eighth plus the groups' 8 bytes. A scale per
// group, not per output row, keeps one large weight from coarsening its whole row's rounding.
// The activations stay float32 (a bfloat16 input is widened first); each weight is widened to
// float32 and multiplied in with an FMA, so the only error is the weight's rounding.
//
// torch's own CPU kernels for these (aten::_weight_int8pack_mm, _weight_int4pack_mm_for_cpu)
// are vectorised for bfloat16 inputs only, and on the AVX2 build machine took about as long as
// the float32 matmul at one row (its lm_head: 7.1 ms int8, 4.9 ms int4, 8.5 ms float32, one
// thread): they convert each weight with more instructions than this loop spends on it.
//
// Four output rows (a tile) are computed together so that four FMA chains are in flight (one
// chain waits on its FMA's latency); a task is a run of tiles, so threads split the weight.
// int8's weights are stored tile by tile (int8_tile) so that a thread streams one run of
// memory, which the prefetches ahead of it keep filled.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <optional>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using llmq::hsum;

constexpr int64_t TILE = 4;      // output rows per tile
constexpr int64_t GROUP = 32;    // inputs per group: int8's scale, int4's (scale, minimum)
// How far ahead (bytes) the int8 kernel asks for its weights: 32 groups of a tile. With the
// weights in tile order (below) a thread reads one stream; with 2-8 KB requested ahead the whole
// model's layers read at ~25 GB/s where the hardware prefetcher alone reached ~20, and four
// rows read side by side (each its own stream) ~18 (2 threads, the build machine).
constexpr int64_t PREFETCH_BYTES = 32 * TILE * GROUP;

// Output rows per task: ~64K weights each, so that a small layer does not pay the threads'
// fork and join for a few microseconds of work.
int64_t grain(int64_t k) { return std::max<int64_t>(TILE, (65536 / k) / TILE * TILE); }

// x as contiguous float32 [rows, k] (a copy only when it is not that already).
torch::Tensor as_float(const torch::Tensor& x) {
  return x.to(torch::kFloat).contiguous();
}

inline __m256 widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 widen_u8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// out[n0 .. n0+cnt) of one input row: per group of 32, the sum of q * x, scaled by the
// group's float16 scale. The weights are in tile order (quantized_linear.py's to_tiles): a tile
// of cnt output rows holds, group by group, the cnt rows' 32 weights one after the other, and
// its scales likewise, so that the tile is one run of memory (every earlier tile is full: it
// starts at row n0's offset).
void int8_tile(const int8_t* w, const uint16_t* scales, const float* x, int64_t k, int64_t n0,
               int64_t cnt, float* out) {
  const int64_t groups = k / GROUP;
  const int8_t* tile = w + n0 * k;
  const uint16_t* sc = scales + n0 * groups;
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  int64_t at[TILE];   // each chain's row in the tile (a short tile repeats its last row)
  for (int t = 0; t < TILE; ++t) at[t] = std::min<int64_t>(t, cnt - 1);
  // (past the weight's end only where the last tiles are: a prefetch never faults)
  _mm_prefetch(reinterpret_cast<const char*>(sc + TILE * groups), _MM_HINT_T0);
  for (int64_t g = 0; g < groups; ++g, tile += cnt * GROUP, sc += cnt) {
    const char* ahead = reinterpret_cast<const char*>(tile) + PREFETCH_BYTES;
    for (int64_t b = 0; b < TILE * GROUP; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    if ((g & 7) == 0) _mm_prefetch(reinterpret_cast<const char*>(sc) + 256, _MM_HINT_T0);
    const float* xg = x + g * GROUP;
    const __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
    const __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* p = tile + at[t] * GROUP;
      __m256 s = _mm256_mul_ps(widen_i8(p), x0);
      s = _mm256_fmadd_ps(widen_i8(p + 8), x1, s);
      s = _mm256_fmadd_ps(widen_i8(p + 16), x2, s);
      s = _mm256_fmadd_ps(widen_i8(p + 24), x3, s);
      acc[t] = _mm256_fmadd_ps(s, _mm256_set1_ps(_cvtsh_ss(sc[at[t]])), acc[t]);
    }
  }
  for (int64_t t = 0; t < cnt; ++t) out[t] = hsum(acc[t]);
}

// The same at several input rows (x [R, k], R <= ROWS), two of the tile's output rows (a, b)
// at a time: each weight is widened and scaled once and multiplied into every row, where
// int8_tile would widen it again per row. (So the weights are the dequantized ones, rounded
// to float32 as dequantize() rounds them, and a row's sum runs over k in one chain of 8 lanes:
// another order than int8_tile's, to float noise.) 2 x 4 accumulators, the two weights and x
// fit AVX2's 16 registers.
constexpr int64_t ROWS = 4;

template <int R>
void int8_rows(const int8_t* tile, const uint16_t* sc, int64_t cnt, int64_t a, int64_t b,
               const float* x, int64_t k, float* out, int64_t n) {
  const int64_t groups = k / GROUP;
  __m256 acc[2][R];
  for (int i = 0; i < R; ++i) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, tile += cnt * GROUP, sc += cnt) {
    const __m256 sa = _mm256_set1_ps(_cvtsh_ss(sc[a])), sb = _mm256_set1_ps(_cvtsh_ss(sc[b]));
    for (int c = 0; c < GROUP; c += 8) {
      const __m256 wa = _mm256_mul_ps(widen_i8(tile + a * GROUP + c), sa);
      const __m256 wb = _mm256_mul_ps(widen_i8(tile + b * GROUP + c), sb);
      for (int i = 0; i < R; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * k + g * GROUP + c);
        acc[0][i] = _mm256_fmadd_ps(wa, xv, acc[0][i]);
        acc[1][i] = _mm256_fmadd_ps(wb, xv, acc[1][i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    out[i * n + a] = hsum(acc[0][i]);
    out[i * n + b] = hsum(acc[1][i]);
  }
}

// Every input row of one tile (output rows n0 .. n0+cnt), ROWS rows at a time.
void int8_tile_rows(const int8_t* w, const uint16_t* scales, const float* x, int64_t rows,
                    int64_t k, int64_t n0, int64_t cnt, float* out, int64_t n) {
  const int8_t* tile = w + n0 * k;
  const uint16_t* sc = scales + n0 * (k / GROUP);
  for (int64_t r = 0; r < rows; r += ROWS)
    for (int64_t a = 0; a < cnt; a += 2) {
      const int64_t b = std::min(a + 1, cnt - 1);   // (an odd tile's last row twice)
      const float* xr = x + r * k;
      float* o = out + r * n;
      switch (std::min(ROWS, rows - r)) {
        case 4: int8_rows<4>(tile, sc, cnt, a, b, xr, k, o, n); break;
        case 3: int8_rows<3>(tile, sc, cnt, a, b, xr, k, o, n); break;
        case 2: int8_rows<2>(tile, sc, cnt, a, b, xr, k, o, n); break;
        default: int8_rows<1>(tile, sc, cnt, a, b, xr, k, o, n); break;
      }
    }
}

// The same for int4: per group, the sum of q * x is scaled, and the minimum times the group's
// sum of x added (w = q * scale + min).
void int4_tile(const uint8_t* w, const float* scale_min, const float* x, const float* xsum,
               int64_t k, int64_t n0, int64_t cnt, float* out) {
  const int64_t groups = k / GROUP;
  __m256 acc[TILE];
  float mins[TILE] = {0, 0, 0, 0};
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0f);
  for (int t = 0; t < TILE; ++t) {
    const int64_t n = n0 + std::min<int64_t>(t, cnt - 1);
    const uint8_t* row = w + n * (k / 2);
    const float* sm = scale_min + n * groups * 2;
    for (int64_t g = 0; g < groups; ++g) {
      // 16 bytes hold a group: the low nibbles its first 16 weights, the high ones the rest.
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * GROUP / 2));
      const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      const float* xg = x + g * GROUP;
      __m256 s = _mm256_mul_ps(widen_u8(lo), _mm256_loadu_ps(xg));
      s = _mm256_fmadd_ps(widen_u8(_mm_unpackhi_epi64(lo, lo)), _mm256_loadu_ps(xg + 8), s);
      s = _mm256_fmadd_ps(widen_u8(hi), _mm256_loadu_ps(xg + 16), s);
      s = _mm256_fmadd_ps(widen_u8(_mm_unpackhi_epi64(hi, hi)), _mm256_loadu_ps(xg + 24), s);
      acc[t] = _mm256_fmadd_ps(s, _mm256_set1_ps(sm[2 * g]), acc[t]);
      mins[t] += sm[2 * g + 1] * xsum[g];
    }
  }
  for (int64_t t = 0; t < cnt; ++t) out[t] = hsum(acc[t]) + mins[t];
}

// Runs tile(n0, cnt, out) over every tile of output rows (it computes out[r * n + n0 + j] for
// every input row r and j < cnt), then adds the bias and casts to x's dtype.
template <typename Tile>
torch::Tensor run(const torch::Tensor& x, int64_t n, int64_t k,
                  const std::optional<torch::Tensor>& bias, Tile tile) {
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, n}, x.options().dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  // Tiles outer, rows inner: a thread's share of a large weight is megabytes, and a second
  // row would read it from memory again; a tile is a few KB, still in L1 for the next row.
  at::parallel_for(0, (n + TILE - 1) / TILE, grain(k) / TILE, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) tile(i * TILE, std::min(TILE, n - i * TILE), op);
  });
  if (bias) out.add_(*bias);
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k, "x must be [rows, ", k, "]");
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
}

}  // namespace

// x [rows, k] float32 or bfloat16; weight int8 [n, k] (k a multiple of 32); scales float16
// [n, k / 32]; both in tile order (int8_tile). Returns [rows, n] in x's dtype:
// x @ (weight * its group's scale).T + bias.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scales,
                          std::optional<torch::Tensor> bias) {
  const int64_t n = weight.size(0), k = weight.size(1);
  check(x, weight, k);
  TORCH_CHECK(weight.scalar_type() == at::kChar && k % GROUP == 0, "int8 weight, k % 32 == 0");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.numel() == n * (k / GROUP), "float16 scales [n, k / 32]");
  const auto xf = as_float(x);
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const int64_t rows = x.size(0);
  return run(x, n, k, bias, [&](int64_t n0, int64_t cnt, float* out) {
    if (rows == 1)   // memory-bound: int8_tile streams the weights
      int8_tile(wp, sp, xp, k, n0, cnt, out + n0);
    else             // more rows: int8_tile_rows widens each weight once
      int8_tile_rows(wp, sp, xp, rows, k, n0, cnt, out + n0, n);
  });
}

// x [rows, k] float32 or bfloat16; weight uint8 [n, k / 2] (two int4 a byte, each group of 32
// as its 16 bytes: low nibbles inputs 0-15, high nibbles 16-31); scale_min float32
// [n, k / 32, 2] (scale, minimum). Returns [rows, n] in x's dtype.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor scale_min,
                          std::optional<torch::Tensor> bias) {
  const int64_t n = weight.size(0), k = weight.size(1) * 2;
  check(x, weight, k);
  TORCH_CHECK(weight.scalar_type() == at::kByte && k % GROUP == 0, "uint8 weight, k % 32 == 0");
  TORCH_CHECK(scale_min.scalar_type() == at::kFloat && scale_min.is_contiguous() &&
              scale_min.numel() == n * (k / GROUP) * 2);
  const auto xf = as_float(x);
  const auto xsum = xf.view({x.size(0), k / GROUP, GROUP}).sum(-1).contiguous();
  const float* xp = xf.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  const float* sp = scale_min.data_ptr<float>();
  return run(x, n, k, bias, [&](int64_t n0, int64_t cnt, float* out) {
    for (int64_t r = 0; r < x.size(0); ++r)
      int4_tile(wp, sp, xp + r * k, xs + r * (k / GROUP), k, n0, cnt, out + r * n + n0);
  });
}
