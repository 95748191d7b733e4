// A Llama decoder layer's elementwise ops, fused: each is one pass over a row where torch ran
// 3-9 ops, each a pass and a dispatch (at a 64-row decode step they were ~8 % of the step).
//
// Each rounds to the tensor's dtype where the torch ops it replaces did (worker/model/transformers/llama_forward.py
// has them), and the build keeps multiplies and adds apart (-ffp-contract=off), so the residual
// add and the rotary embedding are torch's to the bit; the norm's sum of squares and SiLU's exp
// differ in their last bits (another summation order, Cephes' exp). Rows are independent, so a
// row's result does not depend on the batch around it. Built by worker/model/transformers/cpu_kernels.py.
//
// bfloat16 has a second path at 16 lanes for CPUs with AVX512-BF16 (the ones dtype `auto` runs
// in bfloat16): its native conversion rounds in one instruction where AVX2 takes eight, and
// the AVX2 path's rounding was why these ops saved ~17 ms of a 64-row step in float32 but only
// ~3 ms in bfloat16. It rounds at the same places, so it gives the AVX2 path's bits but for
// the norm's sum of squares (16 partial sums, not 8).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using llmq::load8;
using llmq::round8;
using llmq::store8;

// Rows per task: ~16K elements each (fewer cost more in the threads' fork and join than they
// saved), so a one-row decode step runs on the calling thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / width); }

// The bfloat16 ops at 16 lanes (AVX512-BF16; see the top of the file). Each is its template's
// twin, step for step.
namespace wide {

using llmq::wide::exp16;
using llmq::wide::hsum16;
using llmq::wide::load16;
using llmq::wide::round16;
using llmq::wide::store16;
using BF16 = at::BFloat16;

LLMQ_WIDE void add_rms_norm_row(BF16* xr, const BF16* delta, const BF16* weight, BF16* o,
                                int64_t n, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    __m512 v = load16(xr + j);
    if (delta) {
      v = round16(_mm512_add_ps(v, load16(delta + j)));
      store16(xr + j, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(hsum16(acc) / n + eps));
  for (int64_t j = 0; j < n; j += 16) {
    __m512 h = round16(_mm512_mul_ps(load16(xr + j), inv));
    store16(o + j, _mm512_mul_ps(load16(weight + j), h));
  }
}

LLMQ_WIDE void silu_mul_row(const BF16* g, const BF16* u, BF16* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t j = 0; j < n; j += 16) {
    __m512 gv = load16(g + j);
    __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign));
    __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(neg)));
    store16(o + j, _mm512_mul_ps(round16(s), load16(u + j)));
  }
}

LLMQ_WIDE void rotary_head(const BF16* x, const BF16* c, const BF16* s, BF16* o, int64_t half) {
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t j = 0; j < half; j += 16) {
    __m512 x1 = load16(x + j), x2 = load16(x + half + j);
    __m512 nx2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign));
    __m512 a = round16(_mm512_mul_ps(x1, load16(c + j)));
    __m512 b = round16(_mm512_mul_ps(nx2, load16(s + j)));
    store16(o + j, _mm512_add_ps(a, b));
    a = round16(_mm512_mul_ps(x2, load16(c + half + j)));
    b = round16(_mm512_mul_ps(x1, load16(s + half + j)));
    store16(o + half + j, _mm512_add_ps(a, b));
  }
}

}  // namespace wide

bool use_wide(int64_t width_multiple) { return width_multiple % 16 == 0 && llmq::wide::on(); }

// x += delta (when given), then out = weight * (x * rsqrt(mean(x^2) + eps)): LlamaRMSNorm in
// float32, rounded to T before the weight.
template <typename T>
void add_rms_norm_rows(T* x, const T* delta, const T* weight, T* out, int64_t rows, int64_t n,
                       float eps) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (use_wide(n)) {
      at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          wide::add_rms_norm_row(x + r * n, delta ? delta + r * n : nullptr, weight, out + r * n,
                                 n, eps);
      });
      return;
    }
  }
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      T* o = out + r * n;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; j += 8) {
        __m256 v = load8(xr + j);
        if (delta) {
          v = round8(_mm256_add_ps(v, load8(delta + r * n + j)), xr);
          store8(xr + j, v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(llmq::hsum(acc) / n + eps));
      for (int64_t j = 0; j < n; j += 8) {
        __m256 h = round8(_mm256_mul_ps(load8(xr + j), inv), xr);
        store8(o + j, _mm256_mul_ps(load8(weight + j), h));
      }
    }
  });
}

// out = silu(gate) * up over [rows, 2n] = [gate | up] (the fused gate_up projection's output).
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (use_wide(n)) {
      at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          wide::silu_mul_row(gate_up + r * 2 * n, gate_up + r * 2 * n + n, out + r * n, n);
      });
      return;
    }
  }
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      for (int64_t j = 0; j < n; j += 8) {
        __m256 gv = load8(g + j);
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, llmq::exp8(_mm256_xor_ps(gv, sign))));
        store8(o + j, _mm256_mul_ps(round8(s, o), load8(u + j)));
      }
    }
  });
}

// q, k of a row's [heads | kv heads | kv heads] x dim (the fused qkv projection's output)
// rotated: x * cos + rotate_half(x) * sin, each product rounded as torch's ops round it.
template <typename T>
void rotary_rows(const T* qkv, const T* cos, const T* sin, T* q, T* k, int64_t rows,
                 int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  bool wide_path = false;
  if constexpr (std::is_same_v<T, at::BFloat16>) wide_path = use_wide(half);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * dim;
      const T* s = sin + r * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = qkv + r * width + h * dim;
        T* o = h < heads ? q + (r * heads + h) * dim : k + (r * kv_heads + h - heads) * dim;
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          if (wide_path) {
            wide::rotary_head(x, c, s, o, half);
            continue;
          }
        }
        for (int64_t j = 0; j < half; j += 8) {
          __m256 x1 = load8(x + j), x2 = load8(x + half + j);
          __m256 a = round8(_mm256_mul_ps(x1, load8(c + j)), o);
          __m256 b = round8(_mm256_mul_ps(_mm256_xor_ps(x2, sign), load8(s + j)), o);
          store8(o + j, _mm256_add_ps(a, b));
          a = round8(_mm256_mul_ps(x2, load8(c + half + j)), o);
          b = round8(_mm256_mul_ps(x1, load8(s + half + j)), o);
          store8(o + half + j, _mm256_add_ps(a, b));
        }
      }
    }
  });
}

void check(const torch::Tensor& t, at::ScalarType dtype, int64_t width_multiple) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "layer ops: contiguous CPU tensors");
  TORCH_CHECK(t.scalar_type() == dtype, "layer ops: one dtype, got ", t.scalar_type(),
              " beside ", dtype);
  TORCH_CHECK(t.size(-1) % width_multiple == 0, "layer ops: width ", t.size(-1),
              " not a multiple of ", width_multiple);
}

#define LLMQ_DISPATCH(dtype, NAME, ...)                                              \
  [&] {                                                                              \
    if (dtype == at::kFloat) { using scalar_t = float; return __VA_ARGS__(); }       \
    if (dtype == at::kBFloat16) { using scalar_t = at::BFloat16; return __VA_ARGS__(); } \
    TORCH_CHECK(false, NAME ": float32 or bfloat16, not ", dtype);                   \
  }()

}  // namespace

// x [rows, n] (updated in place when delta is given), delta [rows, n] or None, weight [n];
// returns the normed rows.
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta,
                           torch::Tensor weight, double eps) {
  const auto dtype = x.scalar_type();
  check(x, dtype, 8);
  check(weight, dtype, 8);
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1));
  if (delta) {
    check(*delta, dtype, 8);
    TORCH_CHECK(delta->sizes() == x.sizes());
  }
  auto out = torch::empty_like(x);
  LLMQ_DISPATCH(dtype, "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(),
                                delta ? delta->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// gate_up [rows, 2n] -> silu(gate) * up [rows, n]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, gate_up.scalar_type(), 16);
  TORCH_CHECK(gate_up.dim() == 2);
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  LLMQ_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            gate_up.size(0), n);
  });
  return out;
}

// qkv [rows, (heads + 2 kv heads) x dim], cos and sin [rows, dim] -> q [rows, heads, dim],
// k [rows, kv heads, dim], rotated (v is qkv's last part, left where it is).
std::vector<torch::Tensor> rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                  int64_t heads, int64_t kv_heads) {
  const auto dtype = qkv.scalar_type();
  check(qkv, dtype, 1);
  check(cos, dtype, 16);
  check(sin, dtype, 16);
  const int64_t rows = qkv.size(0), dim = cos.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim &&
              cos.numel() == rows * dim && sin.numel() == rows * dim);
  auto q = torch::empty({rows, heads, dim}, qkv.options());
  auto k = torch::empty({rows, kv_heads, dim}, qkv.options());
  LLMQ_DISPATCH(dtype, "rotary", [&] {
    rotary_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                          sin.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                          k.data_ptr<scalar_t>(), rows, heads, kv_heads, dim);
  });
  return {q, k};
}

// Turns the bfloat16 kernels' wide paths (these ops, decode attention) off or back on (when
// `on` is given; for tests and measurements); returns whether they are taken now (false on a
// CPU without AVX512-BF16).
bool wide_ops(std::optional<bool> on) {
  if (on) llmq::wide::wanted().store(*on);
  return llmq::wide::on();
}
