// AVX2 helpers shared by the CPU kernels (decode_attention.cpp, layer_ops.cpp): 8 floats at a
// time from and to float32, bfloat16 and float16, a horizontal sum and a vector exp; and their
// AVX-512 twins at 16 floats for bfloat16 (llmq::wide), compiled for AVX512-BF16 function by
// function and called only where the CPU has it (wide::available), as the build's flags stay
// portable.
// (worker/model/transformers/cpu_kernels.py hashes this header into the build flags: torch's build cache keys on
// the sources alone, and an edit here must rebuild them.)
#pragma once
#include <torch/extension.h>
#include <immintrin.h>
#include <atomic>

namespace llmq {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen to 32 bits and shift into place.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// fp32 -> bf16 bits in the low half of each lane, rounded to nearest even as c10::BFloat16
// rounds (a NaN stays a quiet NaN).
inline __m256i bf16_bits(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7fc0), nan);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
  __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(v), bf16_bits(v)), 0xd8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(w));
}
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to T's precision and back: torch rounds every op's result to the tensor's dtype,
// so a fused kernel rounds where the ops it replaces did.
inline __m256 round8(__m256 v, const float*) { return v; }
inline __m256 round8(__m256 v, const at::BFloat16*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}
inline __m256 round8(__m256 v, const at::Half*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp: Cephes' polynomial after range reduction, ~1 ulp; x clamped to [-87, 88] (exp(-inf) is
// then tiny, not 0). A scalar std::exp per element cost more than the work around it.
// (Its constants, shared with wide::exp16 so that both give the same bits.)
namespace exp_poly {
constexpr float lo = -87.0f, hi = 88.0f, log2e = 1.44269504088896341f;
constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;   // ln 2 = hi + lo
constexpr float p[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                        4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
}  // namespace exp_poly

inline __m256 exp8(__m256 x) {
  using namespace exp_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(log2e)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ln2_hi), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(ln2_lo), x);
  __m256 y = _mm256_set1_ps(p[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(p[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

namespace wide {

// Each function here is compiled for AVX512-BF16 alone (the rest of the file stays AVX2):
// call them only after available() said yes.
#define LLMQ_WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Whether this CPU runs the wide code (AVX512-BF16 implies F and BW; the OS must save the
// registers, which __builtin_cpu_supports checks).
inline bool available() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Whether the kernels take their wide paths: where the CPU has them, unless a test or a
// measurement turned them off (the module's wide_ops(false)). One flag for all the sources.
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> flag{true};
  return flag;
}

inline bool on() { return wanted().load(std::memory_order_relaxed) && available(); }

LLMQ_WIDE inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The native conversion: round to nearest even as c10::BFloat16 does, in one instruction
// where bf16_bits takes eight. (It differs from it only on NaNs' payloads and on float32
// denormals, which it flushes to zero: activations are never that small but for zeros.)
LLMQ_WIDE inline __m256i bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

LLMQ_WIDE inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v));
}

LLMQ_WIDE inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}

LLMQ_WIDE inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

// exp8's steps at 16 lanes, so both give the same bits for the same input.
LLMQ_WIDE inline __m512 exp16(__m512 x) {
  using namespace exp_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(log2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ln2_hi), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(ln2_lo), x);
  __m512 y = _mm512_set1_ps(p[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(p[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

}  // namespace wide

}  // namespace llmq
