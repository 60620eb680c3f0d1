// y[M, N] = x[M, K] @ dequant(W[N, K]).T on CPU, W in ggml's block formats, fp32 activations and accumulation.
// Built by quant_linear.py with torch's cpp_extension; runs on torch's own thread pool (at::parallel_for).
//
// Every block type is read 32 values at a time (a "chunk": one Q4_0..Q8_0 block, one K-quant sub-block, 32 F16
// values), dequantized as gguf.quants.dequantize does it. Few rows (decode) stream each chunk once from memory and
// multiply it into every row of x while it sits in registers; many rows (prefill) dequantize a panel of W rows to an
// fp32 tile and hand it to torch's GEMM. Compiled with AVX2/FMA/F16C, and AVX-512 (F, BW, VL), where the CPU has
// them; every path the build has can be asked for by its instruction set (`isa`), the portable scalar one always,
// so tests cover each.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NEBULA_QUANT_SIMD 1
#else
#define NEBULA_QUANT_SIMD 0
#endif
#if NEBULA_QUANT_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NEBULA_QUANT_AVX512 1
#else
#define NEBULA_QUANT_AVX512 0
#endif

namespace {

constexpr int64_t kChunk = 32;

// ggml's type ids (gguf.GGMLQuantizationType)
enum QType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

struct Layout {
  int64_t block_values, block_bytes;
};

template <int64_t QT>
constexpr bool kKQuant = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K;

template <int64_t QT>
constexpr int64_t kKQuantBlockBytes = QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : 210;

Layout layout_of(int64_t qtype) {
  switch (qtype) {
    case kF32: return {1, 4};
    case kF16: case kBF16: return {1, 2};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, kKQuantBlockBytes<kQ4_K>};
    case kQ5_K: return {256, kKQuantBlockBytes<kQ5_K>};
    case kQ6_K: return {256, kKQuantBlockBytes<kQ6_K>};
  }
  TORCH_CHECK(false, "quant_linear: ggml type ", qtype, " is not supported");
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);  // ggml's files are little-endian, as is every CPU this builds for
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE half -> float, exact for every value (subnormals, infinities, NaNs) without F16C
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  exponent = 113u;  // a subnormal: shift its leading one up to the implicit bit
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --exponent;
  }
  return bits_to_float(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
}

inline float half_at(const uint8_t* p) { return half_to_float(load_u16(p)); }

// Q4_K / Q5_K: sub-block s's 6-bit scale and min, unpacked from the block's 12 scale bytes
inline void kquant_scale_min(const uint8_t* scales, int64_t s, int& scale, int& min) {
  if (s < 4) {
    scale = scales[s] & 63;
    min = scales[s + 4] & 63;
  } else {
    scale = (scales[s + 4] & 0x0f) | ((scales[s - 4] >> 6) << 4);
    min = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
  }
}

// ---- the portable path: chunk `c` of a row into out[32] ----

template <int64_t QT>
void dequant_chunk_scalar(const uint8_t* row, int64_t c, float* out) {
  if constexpr (QT == kF32) {
    std::memcpy(out, row + c * kChunk * 4, kChunk * 4);
  } else if constexpr (QT == kF16 || QT == kBF16) {
    const uint8_t* p = row + c * kChunk * 2;
    for (int j = 0; j < kChunk; ++j)
      out[j] = QT == kF16 ? half_at(p + 2 * j) : bits_to_float(static_cast<uint32_t>(load_u16(p + 2 * j)) << 16);
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    const uint8_t* b = row + c * (QT == kQ4_0 ? 18 : 20);
    const float d = half_at(b), m = QT == kQ4_1 ? half_at(b + 2) : 0.f;
    const uint8_t* qs = b + (QT == kQ4_0 ? 2 : 4);
    for (int j = 0; j < 16; ++j) {
      if constexpr (QT == kQ4_0) {
        out[j] = d * static_cast<float>((qs[j] & 15) - 8);
        out[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      } else {
        out[j] = d * static_cast<float>(qs[j] & 15) + m;
        out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    }
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const uint8_t* b = row + c * (QT == kQ5_0 ? 22 : 24);
    const float d = half_at(b), m = QT == kQ5_1 ? half_at(b + 2) : 0.f;
    const uint32_t qh = load_u32(b + (QT == kQ5_0 ? 2 : 4));
    const uint8_t* qs = b + (QT == kQ5_0 ? 6 : 8);
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      if constexpr (QT == kQ5_0) {
        out[j] = d * static_cast<float>(lo - 16);
        out[j + 16] = d * static_cast<float>(hi - 16);
      } else {
        out[j] = d * static_cast<float>(lo) + m;
        out[j + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (QT == kQ8_0) {
    const uint8_t* b = row + c * 34;
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < kChunk; ++j) out[j] = d * static_cast<float>(qs[j]);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const int64_t s = c & 7;
    const uint8_t* b = row + (c >> 3) * kKQuantBlockBytes<QT>;
    int scale, min;
    kquant_scale_min(b + 4, s, scale, min);
    const float ds = half_at(b) * static_cast<float>(scale), dm = half_at(b + 2) * static_cast<float>(min);
    const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + (s >> 1) * 32;
    const int shift = (s & 1) * 4;
    for (int j = 0; j < kChunk; ++j) {
      int q = (qs[j] >> shift) & 15;
      if constexpr (QT == kQ5_K) q |= ((b[16 + j] >> s) & 1) << 4;
      out[j] = ds * static_cast<float>(q) - dm;
    }
  } else if constexpr (QT == kQ6_K) {
    const int64_t s = c & 7;
    const uint8_t* b = row + (c >> 3) * kKQuantBlockBytes<QT>;
    const float d = half_at(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const uint8_t* ql = b + (s >> 2) * 64 + (s & 1) * 32;
    const uint8_t* qh = b + 128 + (s >> 2) * 32;
    const int ql_shift = ((s >> 1) & 1) * 4, qh_shift = (s & 3) * 2;
    for (int j = 0; j < kChunk; ++j) {
      const int q = (((ql[j] >> ql_shift) & 15) | (((qh[j] >> qh_shift) & 3) << 4)) - 32;
      out[j] = (d * static_cast<float>(scales[2 * s + (j >> 4)])) * static_cast<float>(q);
    }
  }
}

// Rows [begin, end) of one part, each x row (ldx apart) against each W row: out[m * ldy + n] (+ bias[n]).
template <int64_t QT>
void gemv_scalar(const uint8_t* data, int64_t row_bytes, int64_t chunks, const float* x, int64_t rows_x, int64_t ldx,
                 const float* bias, float* out, int64_t ldy, int64_t begin, int64_t end) {
  std::vector<float> w(chunks * kChunk), sums(rows_x);
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = data + n * row_bytes;
    for (int64_t c = 0; c < chunks; ++c) dequant_chunk_scalar<QT>(row, c, w.data() + c * kChunk);
    for (int64_t m = 0; m < rows_x; ++m) {
      const float* xm = x + m * ldx;
      float total = 0.f;
      for (int64_t k = 0; k < chunks * kChunk; ++k) total += xm[k] * w[k];
      out[m * ldy + n] = total + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

template <int64_t QT>
void dequant_rows_scalar(const uint8_t* data, int64_t row_bytes, int64_t chunks, float* out, int64_t begin,
                         int64_t end) {
  for (int64_t n = begin; n < end; ++n)
    for (int64_t c = 0; c < chunks; ++c)
      dequant_chunk_scalar<QT>(data + n * row_bytes, c, out + (n - begin) * chunks * kChunk + c * kChunk);
}

#if NEBULA_QUANT_SIMD
// ---- AVX2: chunk `c` of a row into w[0..3] (values 0-7, 8-15, 16-23, 24-31) ----

inline float half_f16c(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }  // F16C: one instruction

// 32 signed bytes -> four vectors of 8 floats
inline void bytes_to_floats(__m256i q, __m256* w) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// 16 bytes of packed nibbles -> 32 bytes: low nibbles (values 0-15) then high nibbles (values 16-31)
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

// 32 bits -> 32 bytes, byte j = 0x10 where bit j is set (Q5's fifth bit, in place)
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(0x10));
}

inline void scale_and_shift(__m256* w, float d, float m) {  // d * q + m, the K-quants' "- dmin * min" as m
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  for (int v = 0; v < 4; ++v) w[v] = _mm256_fmadd_ps(dv, w[v], mv);
}

inline void scale(__m256* w, float d) {
  const __m256 dv = _mm256_set1_ps(d);
  for (int v = 0; v < 4; ++v) w[v] = _mm256_mul_ps(dv, w[v]);
}

// Sub-block s of the Q6_K block at b: its 32 6-bit quants as signed bytes, less 32
inline __m256i q6k_bytes(const uint8_t* b, int64_t s) {
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (s >> 2) * 64 + (s & 1) * 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + (s >> 2) * 32));
  const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(static_cast<int>(((s >> 1) & 1) * 4))),
                                       _mm256_set1_epi8(15));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>((s & 3) * 2))),
                                        _mm256_set1_epi8(3));
  return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
}

template <int64_t QT>
inline void dequant_chunk_simd(const uint8_t* row, int64_t c, __m256* w) {
  if constexpr (QT == kF32) {
    const float* p = reinterpret_cast<const float*>(row) + c * kChunk;
    for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(p + 8 * v);
  } else if constexpr (QT == kF16) {
    const uint8_t* p = row + c * kChunk * 2;
    for (int v = 0; v < 4; ++v) w[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
  } else if constexpr (QT == kBF16) {
    const uint8_t* p = row + c * kChunk * 2;
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))), 16));
  } else if constexpr (QT == kQ4_0) {
    const uint8_t* b = row + c * 18;
    bytes_to_floats(_mm256_sub_epi8(unpack_nibbles(b + 2), _mm256_set1_epi8(8)), w);
    scale(w, half_f16c(b));
  } else if constexpr (QT == kQ4_1) {
    const uint8_t* b = row + c * 20;
    bytes_to_floats(unpack_nibbles(b + 4), w);
    scale_and_shift(w, half_f16c(b), half_f16c(b + 2));
  } else if constexpr (QT == kQ5_0) {
    const uint8_t* b = row + c * 22;
    const __m256i q = _mm256_or_si256(unpack_nibbles(b + 6), fifth_bits(load_u32(b + 2)));
    bytes_to_floats(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w);
    scale(w, half_f16c(b));
  } else if constexpr (QT == kQ5_1) {
    const uint8_t* b = row + c * 24;
    bytes_to_floats(_mm256_or_si256(unpack_nibbles(b + 8), fifth_bits(load_u32(b + 4))), w);
    scale_and_shift(w, half_f16c(b), half_f16c(b + 2));
  } else if constexpr (QT == kQ8_0) {
    const uint8_t* b = row + c * 34;
    bytes_to_floats(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), w);
    scale(w, half_f16c(b));
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const int64_t s = c & 7;
    const uint8_t* b = row + (c >> 3) * kKQuantBlockBytes<QT>;
    int sc, mn;
    kquant_scale_min(b + 4, s, sc, mn);
    const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + (s >> 1) * 32;
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    __m256i q = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(static_cast<int>((s & 1) * 4))),
                                 _mm256_set1_epi8(15));
    if constexpr (QT == kQ5_K) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(static_cast<int>(s))),
                                           _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    bytes_to_floats(q, w);
    scale_and_shift(w, half_f16c(b) * static_cast<float>(sc), -(half_f16c(b + 2) * static_cast<float>(mn)));
  } else if constexpr (QT == kQ6_K) {
    const int64_t s = c & 7;
    const uint8_t* b = row + (c >> 3) * kKQuantBlockBytes<QT>;
    bytes_to_floats(q6k_bytes(b, s), w);
    const float d = half_f16c(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const __m256 first = _mm256_set1_ps(d * static_cast<float>(scales[2 * s]));
    const __m256 second = _mm256_set1_ps(d * static_cast<float>(scales[2 * s + 1]));
    w[0] = _mm256_mul_ps(first, w[0]);
    w[1] = _mm256_mul_ps(first, w[1]);
    w[2] = _mm256_mul_ps(second, w[2]);
    w[3] = _mm256_mul_ps(second, w[3]);
  }
}

inline float horizontal_sum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// The GEMV reads W once, front to back, and asks for the bytes this far ahead of the chunk it multiplies: without
// it the hardware prefetcher kept a decode GEMV at 1.7-4 GB/s against 13-15 GB/s for an fp32 F.linear (random
// blocks walking 256 MiB of copies, one thread). 1, 2 and 4 KiB all gave 2.5-3x; 4 KiB was best on Q4_1 and
// Q6_K, within 2% of 2 KiB on Q8_0.
constexpr int64_t kPrefetchBytes = 4096;

// One W row against MT rows of x: each chunk dequantized once into registers, then multiplied into every row.
// Few rows get more accumulators each, so the FMAs of one row do not wait on each other.
template <int64_t QT, int MT>
inline void row_times_tile(const uint8_t* row, int64_t chunks, const float* x, int64_t ldx, float* sums,
                           int64_t ahead, int64_t stride) {
  constexpr int kAcc = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  __m256 acc[MT][kAcc];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(row + c * stride + ahead), _MM_HINT_T0);
    __m256 w[4];
    dequant_chunk_simd<QT>(row, c, w);
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * ldx + c * kChunk;
      for (int v = 0; v < 4; ++v)
        acc[m][v % kAcc] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xm + 8 * v), acc[m][v % kAcc]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 total = acc[m][0];
    for (int a = 1; a < kAcc; ++a) total = _mm256_add_ps(total, acc[m][a]);
    sums[m] = horizontal_sum(total);
  }
}

template <int64_t QT>
void gemv_simd(const uint8_t* data, int64_t row_bytes, int64_t chunks, const float* x, int64_t rows_x, int64_t ldx,
               const float* bias, float* out, int64_t ldy, int64_t begin, int64_t end) {
  float sums[8];
  const int64_t stride = row_bytes / chunks;  // bytes a chunk, on average (a K-quant's scales spread over its 8)
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = data + n * row_bytes;
    const float b = bias != nullptr ? bias[n] : 0.f;
    // x rows in tiles of 8, 4, 2, 1: the W row is read from memory once and from L1 for the later tiles
    for (int64_t m0 = 0; m0 < rows_x;) {
      const int64_t left = rows_x - m0, tile = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const float* xm = x + m0 * ldx;
      const int64_t ahead = m0 == 0 ? kPrefetchBytes : 0;  // later tiles find the row in L1
      if (tile == 8) row_times_tile<QT, 8>(row, chunks, xm, ldx, sums, ahead, stride);
      else if (tile == 4) row_times_tile<QT, 4>(row, chunks, xm, ldx, sums, ahead, stride);
      else if (tile == 2) row_times_tile<QT, 2>(row, chunks, xm, ldx, sums, ahead, stride);
      else row_times_tile<QT, 1>(row, chunks, xm, ldx, sums, ahead, stride);
      for (int64_t m = 0; m < tile; ++m) out[(m0 + m) * ldy + n] = sums[m] + b;
      m0 += tile;
    }
  }
}

template <int64_t QT>
void dequant_rows_simd(const uint8_t* data, int64_t row_bytes, int64_t chunks, float* out, int64_t begin,
                       int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    float* dest = out + (n - begin) * chunks * kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      __m256 w[4];
      dequant_chunk_simd<QT>(data + n * row_bytes, c, w);
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(dest + c * kChunk + 8 * v, w[v]);
    }
  }
}
#endif

#if NEBULA_QUANT_AVX512
// ---- AVX-512: chunk `c` of a row into w[0..1] (values 0-15, 16-31) ----
// The same arithmetic as the AVX2 path, 16 lanes wide: each byte is widened straight to its int32 lane, so Q4's
// two nibbles of a byte land in their own halves with one AND and one shift, and Q5's fifth bits are a mask.

inline __m512 ints_to_floats(__m512i q) { return _mm512_cvtepi32_ps(q); }

inline __m512i widen_u8(const uint8_t* p) {  // 16 unsigned bytes -> 16 int32 lanes
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 16 bytes of packed nibbles -> the low nibbles (values 0-15) and the high ones (values 16-31)
inline void nibbles_512(const uint8_t* qs, __m512i* q) {
  const __m512i bytes = widen_u8(qs);
  q[0] = _mm512_and_si512(bytes, _mm512_set1_epi32(15));
  q[1] = _mm512_srli_epi32(bytes, 4);
}

// The float of each lane's low 4 bits (less 8 when `kOffset`): one permute looks it up in a 16-float table, where a
// mask and an int -> float conversion took two ops, and the conversion shared its port with the FMAs.
template <bool kOffset>
inline __m512 nibble_floats_512(__m512i lanes) {
  const __m512 table = kOffset ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                               : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(lanes, table);
}

inline void fifth_bits_512(uint32_t bits, __m512i* q) {
  const __m512i sixteen = _mm512_set1_epi32(16);
  q[0] = _mm512_mask_or_epi32(q[0], static_cast<__mmask16>(bits & 0xffffu), q[0], sixteen);
  q[1] = _mm512_mask_or_epi32(q[1], static_cast<__mmask16>(bits >> 16), q[1], sixteen);
}

// Sub-block s of the K-quant block at b: its 32 quants as floats (Q5_K's fifth bit included), before scale and min.
// Q4_K's nibbles are looked up (nibble_floats_512); Q5_K's 5-bit values are masked and converted.
template <int64_t QT>
inline void kquant_floats_512(const uint8_t* b, int64_t s, __m512* q) {
  const uint8_t* qs = b + (QT == kQ4_K ? 16 : 48) + (s >> 1) * 32;
  const __m128i shift = _mm_cvtsi32_si128(static_cast<int>((s & 1) * 4));
  if constexpr (QT == kQ4_K) {
    for (int v = 0; v < 2; ++v) q[v] = nibble_floats_512<false>(_mm512_srl_epi32(widen_u8(qs + 16 * v), shift));
  } else {
    __m512i qi[2];
    for (int v = 0; v < 2; ++v)
      qi[v] = _mm512_and_si512(_mm512_srl_epi32(widen_u8(qs + 16 * v), shift), _mm512_set1_epi32(15));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    fifth_bits_512(static_cast<uint32_t>(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << s)))),
                   qi);
    for (int v = 0; v < 2; ++v) q[v] = ints_to_floats(qi[v]);
  }
}

inline void scale_512(__m512* w, float d) {
  const __m512 dv = _mm512_set1_ps(d);
  w[0] = _mm512_mul_ps(dv, w[0]);
  w[1] = _mm512_mul_ps(dv, w[1]);
}

inline void scale_and_shift_512(__m512* w, float d, float m) {
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  w[0] = _mm512_fmadd_ps(dv, w[0], mv);
  w[1] = _mm512_fmadd_ps(dv, w[1], mv);
}

inline void signed_bytes_to_floats_512(__m256i q, __m512* w) {  // 32 signed bytes
  w[0] = ints_to_floats(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  w[1] = ints_to_floats(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}

// Sub-block s of the Q6_K block at b: its 32 quants as floats, less 32, before the scales. Bytes first, 32 at a
// time as the AVX2 path does, then widened.
inline void q6k_floats_512(const uint8_t* b, int64_t s, __m512* q) { signed_bytes_to_floats_512(q6k_bytes(b, s), q); }

// Q4_K / Q5_K: the 8 6-bit scales and the 8 mins held in a block's 12 scale bytes, byte s of each for sub-block s
inline void kquant_scales_mins(const uint8_t* packed, uint64_t& scales, uint64_t& mins) {
  const uint32_t low = load_u32(packed), middle = load_u32(packed + 4), high = load_u32(packed + 8);
  // sub-blocks 0-3 are the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 are a nibble of bytes
  // 8-11 with, as bits 4-5, the top two bits of bytes 0-3 (scales) or 4-7 (mins): kquant_scale_min, 4 lanes at once
  const uint32_t upper_scales = (high & 0x0f0f0f0fu) | ((low >> 2) & 0x30303030u);
  const uint32_t upper_mins = ((high >> 4) & 0x0f0f0f0fu) | ((middle >> 2) & 0x30303030u);
  scales = (low & 0x3f3f3f3fu) | (static_cast<uint64_t>(upper_scales) << 32);
  mins = (middle & 0x3f3f3f3fu) | (static_cast<uint64_t>(upper_mins) << 32);
}

inline __m256 bytes8_to_floats(uint64_t bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
}

// Half h of a Q6_K block (sub-blocks 4h..4h+3) as 128 signed bytes, less 32, sub-block by sub-block. Its 64 low-bit
// bytes hold sub-blocks 4h and 4h+1 in their low nibbles, 4h+2 and 4h+3 in their high ones; its 32 high-bit bytes
// hold bits 4-5 of all four, two bits each. Done 64 bytes at a time: 11 byte ops for four sub-blocks, where
// q6k_floats_512 takes 7 of 32 bytes for each.
inline void q6k_half_bytes_512(const uint8_t* b, int64_t h, int8_t* out) {
  const __m512i low = _mm512_loadu_si512(b + h * 64);
  const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + h * 32)));
  const __m512i nibble = _mm512_set1_epi8(15), bits45 = _mm512_set1_epi8(0x30), offset = _mm512_set1_epi8(32);
  // bits 0-1 (first 32 bytes) and 2-3 (last 32) of each high byte to bits 4-5; then bits 4-5 and 6-7 there
  const __m512i first_shift = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
  const __m512i second_shift = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
  const __m512i first = _mm512_or_si512(_mm512_and_si512(low, nibble),
                                        _mm512_and_si512(_mm512_sllv_epi64(high, first_shift), bits45));
  const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), nibble),
                                         _mm512_and_si512(_mm512_srlv_epi64(high, second_shift), bits45));
  _mm512_store_si512(out, _mm512_sub_epi8(first, offset));
  _mm512_store_si512(out + 64, _mm512_sub_epi8(second, offset));
}

// A K-quant block's sub-block scales as floats (d * scale: 8 for Q4_K / Q5_K, 16 for Q6_K) and, for Q4_K / Q5_K,
// its mins (dmin * min, to subtract), unpacked once for the block's 8 chunks
struct KQuantScales {
  alignas(64) float scale[16];
  alignas(32) float min[8];
};

template <int64_t QT>
inline void load_kquant_scales(const uint8_t* b, KQuantScales& out) {
  if constexpr (QT == kQ6_K) {
    const __m512i raw = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    _mm512_store_ps(out.scale, _mm512_mul_ps(_mm512_set1_ps(half_f16c(b + 208)), _mm512_cvtepi32_ps(raw)));
  } else {
    uint64_t packed_scales, packed_mins;
    kquant_scales_mins(b + 4, packed_scales, packed_mins);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b))));  // d, dmin
    _mm256_store_ps(out.scale, _mm256_mul_ps(_mm256_broadcastss_ps(dm), bytes8_to_floats(packed_scales)));
    _mm256_store_ps(out.min, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), bytes8_to_floats(packed_mins)));
  }
}

// `block`: for a K-quant, the scales of chunk c's block (load_kquant_scales); other types ignore it
template <int64_t QT>
inline void dequant_chunk_512(const uint8_t* row, int64_t c, __m512* w, const KQuantScales& block) {
  if constexpr (QT == kF32) {
    const float* p = reinterpret_cast<const float*>(row) + c * kChunk;
    w[0] = _mm512_loadu_ps(p);
    w[1] = _mm512_loadu_ps(p + 16);
  } else if constexpr (QT == kF16) {
    const uint8_t* p = row + c * kChunk * 2;
    w[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    w[1] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  } else if constexpr (QT == kBF16) {
    const uint8_t* p = row + c * kChunk * 2;
    for (int v = 0; v < 2; ++v)
      w[v] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v))), 16));
  } else if constexpr (QT == kQ4_0 || QT == kQ4_1) {
    const uint8_t* b = row + c * (QT == kQ4_0 ? 18 : 20);
    const __m512i bytes = widen_u8(b + (QT == kQ4_0 ? 2 : 4));
    w[0] = nibble_floats_512<QT == kQ4_0>(bytes);
    w[1] = nibble_floats_512<QT == kQ4_0>(_mm512_srli_epi32(bytes, 4));
    if constexpr (QT == kQ4_0) scale_512(w, half_f16c(b));
    else scale_and_shift_512(w, half_f16c(b), half_f16c(b + 2));
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const uint8_t* b = row + c * (QT == kQ5_0 ? 22 : 24);
    __m512i q[2];
    nibbles_512(b + (QT == kQ5_0 ? 6 : 8), q);
    fifth_bits_512(load_u32(b + (QT == kQ5_0 ? 2 : 4)), q);
    if constexpr (QT == kQ5_0) {
      for (int v = 0; v < 2; ++v) w[v] = ints_to_floats(_mm512_sub_epi32(q[v], _mm512_set1_epi32(16)));
      scale_512(w, half_f16c(b));
    } else {
      for (int v = 0; v < 2; ++v) w[v] = ints_to_floats(q[v]);
      scale_and_shift_512(w, half_f16c(b), half_f16c(b + 2));
    }
  } else if constexpr (QT == kQ8_0) {
    const uint8_t* b = row + c * 34;
    signed_bytes_to_floats_512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), w);
    scale_512(w, half_f16c(b));
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const int64_t s = c & 7;
    kquant_floats_512<QT>(row + (c >> 3) * kKQuantBlockBytes<QT>, s, w);
    scale_and_shift_512(w, block.scale[s], -block.min[s]);
  } else if constexpr (QT == kQ6_K) {
    const int64_t s = c & 7;
    q6k_floats_512(row + (c >> 3) * kKQuantBlockBytes<QT>, s, w);
    w[0] = _mm512_mul_ps(_mm512_set1_ps(block.scale[2 * s]), w[0]);
    w[1] = _mm512_mul_ps(_mm512_set1_ps(block.scale[2 * s + 1]), w[1]);
  }
}

// As row_times_tile: one W row against MT rows of x (indices known at compile time, so the accumulators stay in
// registers). Up to 8 rows, each has an accumulator per half of a chunk; 16 rows have one each, 16 of the 32
// registers, the 32 FMAs of a chunk enough to hide one chain's latency, and each chunk is unpacked half as often.
template <int64_t QT, int MT>
inline void row_times_tile_512(const uint8_t* row, int64_t chunks, const float* x, int64_t ldx, float* sums,
                               int64_t ahead, int64_t stride) {
  constexpr int kAcc = MT >= 16 ? 1 : 2;
  KQuantScales block;
  __m512 acc[MT][kAcc];
  for (int m = 0; m < MT; ++m)
    for (int a = 0; a < kAcc; ++a) acc[m][a] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(row + c * stride + ahead), _MM_HINT_T0);
    if constexpr (kKQuant<QT>)
      if ((c & 7) == 0) load_kquant_scales<QT>(row + (c >> 3) * kKQuantBlockBytes<QT>, block);
    __m512 w[2];
    dequant_chunk_512<QT>(row, c, w, block);
    for (int m = 0; m < MT; ++m) {
      const float* xm = x + m * ldx + c * kChunk;
      for (int v = 0; v < 2; ++v)
        acc[m][v % kAcc] = _mm512_fmadd_ps(w[v], _mm512_loadu_ps(xm + 16 * v), acc[m][v % kAcc]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m512 total = acc[m][0];
    for (int a = 1; a < kAcc; ++a) total = _mm512_add_ps(total, acc[m][a]);
    sums[m] = _mm512_reduce_add_ps(total);
  }
}

// Types whose one-row dot product factors out the chunk's scale (and min): sum_j (d q_j + m) x_j is computed as
// d * sum_j q_j x_j + m * sum_j x_j, the sums of x a chunk precomputed once per call. A chunk then costs 3 vector
// FMAs and one broadcast instead of 4 FMAs and two broadcasts; the 512-bit path runs on two ports, and these ops
// were most of a chunk's time (one row of Q4_1 at ~10 cycles a chunk, as with AVX2, before this).
template <int64_t QT>
constexpr bool kFactored = QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1 || QT == kQ8_0;

// The chunk's quants q (as floats, offsets such as Q4_0's -8 applied), its scale d in lane 0 and, for the types
// with one, its min m in lane 1 (other types leave lane 1 undefined)
template <int64_t QT>
constexpr bool kHasMin = QT == kQ4_1 || QT == kQ5_1;

template <int64_t QT>
inline void quants_512(const uint8_t* row, int64_t c, __m512* q, __m128& dm) {
  if constexpr (QT == kQ4_0 || QT == kQ4_1) {  // each nibble looked up as its float: no mask, no conversion
    const uint8_t* b = row + c * (QT == kQ4_0 ? 18 : 20);
    const __m512i bytes = widen_u8(b + (QT == kQ4_0 ? 2 : 4));
    q[0] = nibble_floats_512<QT == kQ4_0>(bytes);
    q[1] = nibble_floats_512<QT == kQ4_0>(_mm512_srli_epi32(bytes, 4));
    // d and m are the block's first two halves: one 32-bit load, one conversion (a lone d's second half ignored)
    dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b))));
  } else if constexpr (QT == kQ5_0 || QT == kQ5_1) {
    const uint8_t* b = row + c * (QT == kQ5_0 ? 22 : 24);
    __m512i qi[2];
    nibbles_512(b + (QT == kQ5_0 ? 6 : 8), qi);
    if constexpr (QT == kQ5_0) {  // nibble | bit << 4, less 16: the nibble, less 16 where the bit is clear
      const uint32_t clear = ~load_u32(b + 2);
      const __m512i sixteen = _mm512_set1_epi32(16);
      qi[0] = _mm512_mask_sub_epi32(qi[0], static_cast<__mmask16>(clear & 0xffffu), qi[0], sixteen);
      qi[1] = _mm512_mask_sub_epi32(qi[1], static_cast<__mmask16>(clear >> 16), qi[1], sixteen);
    } else {
      fifth_bits_512(load_u32(b + 4), qi);
    }
    for (int v = 0; v < 2; ++v) q[v] = ints_to_floats(qi[v]);
    dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b))));
  } else if constexpr (QT == kQ8_0) {
    const uint8_t* b = row + c * 34;
    signed_bytes_to_floats_512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), q);
    dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b))));
  }
}

// One W row of a factored type against one x row; x_sums[c] is the sum of the x row's chunk c
template <int64_t QT>
inline float row_dot_factored_512(const uint8_t* row, int64_t chunks, const float* x, const float* x_sums,
                                  int64_t ahead, int64_t stride) {
  // two chains of each sum, so consecutive chunks' FMAs overlap (one chain of mins bound a chunk to its latency)
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  __m128 even_mins = _mm_setzero_ps(), odd_mins = _mm_setzero_ps();
  const auto step = [&](int64_t c, __m512& acc, __m128& mins) {
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(row + c * stride + ahead), _MM_HINT_T0);
    __m512 q[2];
    __m128 dm;
    quants_512<QT>(row, c, q, dm);
    const float* xc = x + c * kChunk;
    const __m512 dot = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xc + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(xc)));
    acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), dot, acc);
    if constexpr (kHasMin<QT>) mins = _mm_fmadd_ps(_mm_movehdup_ps(dm), _mm_set_ss(x_sums[c]), mins);  // m sum(x)
  };
  int64_t c = 0;
  for (; c + 1 < chunks; c += 2) {
    step(c, even, even_mins);
    step(c + 1, odd, odd_mins);
  }
  if (c < chunks) step(c, even, even_mins);
  return _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) + _mm_cvtss_f32(_mm_add_ss(even_mins, odd_mins));
}

// The K-quants factor by sub-block the same way, a block at a time: its 8 (Q4_K, Q5_K) or 16 (Q6_K) sub-block
// scales, and the mins, are unpacked once as one vector, where a chunk at a time unpacked each chunk's own in scalar
// code (one row of Q4_K at 8.3 GB/s against Q5_0's 12.8, Qwen2.5-0.5B shapes, 2 threads, weights cold). The
// block-at-a-time dot prefetches each block's lines once, further ahead: Q6_K one row, Qwen2.5-0.5B down shape,
// 2 threads, weights cold: 13.3-14.0 GB/s at 4 KiB, 16.0-16.8 at 8 KiB, 15.8 at 16 KiB (Q4_K too noisy to tell).
constexpr int64_t kKQuantPrefetchBytes = 8192;

// One W row of a K-quant against one x row; x_sums[c] is the sum of the x row's chunk c (Q4_K and Q5_K use it)
template <int64_t QT>
inline float kquant_row_dot_512(const uint8_t* row, int64_t blocks, const float* x, const float* x_sums,
                                int64_t ahead) {
  constexpr int64_t kBlockBytes = kKQuantBlockBytes<QT>;
  KQuantScales scales;
  // four chains, so a sub-block's FMAs do not wait on the one before
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 mins = _mm256_setzero_ps();
  for (int64_t i = 0; i < blocks; ++i) {
    const uint8_t* b = row + i * kBlockBytes;
    const float* xb = x + i * 256;
    if (ahead > 0)
      for (int64_t offset = 0; offset < kBlockBytes + 64; offset += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + ahead + std::min(offset, kBlockBytes - 1)), _MM_HINT_T0);
    load_kquant_scales<QT>(b, scales);
    if constexpr (QT == kQ6_K) {
      for (int64_t h = 0; h < 2; ++h) {
        alignas(64) int8_t quants[128];
        q6k_half_bytes_512(b, h, quants);
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t s = h * 4 + j;
          const float* xc = xb + s * kChunk;
          const __m128i* qc = reinterpret_cast<const __m128i*>(quants + j * kChunk);
          const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(qc)));
          const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(qc + 1)));
          __m512& first = acc[(j & 1) * 2];
          __m512& second = acc[(j & 1) * 2 + 1];
          first = _mm512_fmadd_ps(_mm512_set1_ps(scales.scale[2 * s]), _mm512_mul_ps(q0, _mm512_loadu_ps(xc)), first);
          second = _mm512_fmadd_ps(_mm512_set1_ps(scales.scale[2 * s + 1]), _mm512_mul_ps(q1, _mm512_loadu_ps(xc + 16)),
                                   second);
        }
      }
    } else {
      // w = (d scale) q - (dmin min): the mins times each chunk's sum of x, 8 chunks in one FMA
      mins = _mm256_fnmadd_ps(_mm256_load_ps(scales.min), _mm256_loadu_ps(x_sums + i * 8), mins);
      // unrolled, so the accumulators' indices are constants and they stay in registers
#pragma GCC unroll 8
      for (int64_t s = 0; s < 8; ++s) {
        __m512 q[2];
        kquant_floats_512<QT>(b, s, q);
        const float* xc = xb + s * kChunk;
        const __m512 dot = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xc + 16), _mm512_mul_ps(q[0], _mm512_loadu_ps(xc)));
        acc[s & 3] = _mm512_fmadd_ps(_mm512_set1_ps(scales.scale[s]), dot, acc[s & 3]);
      }
    }
  }
  const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm512_reduce_add_ps(total) + _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

template <int64_t QT>
void gemv_512(const uint8_t* data, int64_t row_bytes, int64_t chunks, const float* x, int64_t rows_x, int64_t ldx,
              const float* bias, float* out, int64_t ldy, int64_t begin, int64_t end) {
  if constexpr (kFactored<QT> || kKQuant<QT>) {
    if (rows_x == 1) {
      // the chunks' sums of x, for the types with mins (the others never read them)
      constexpr bool kUsesSums = kHasMin<QT> || QT == kQ4_K || QT == kQ5_K;
      std::vector<float> x_sums(kUsesSums ? chunks : 0);
      for (int64_t c = 0; c < static_cast<int64_t>(x_sums.size()); ++c)
        x_sums[c] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + c * kChunk), _mm512_loadu_ps(x + c * kChunk + 16)));
      const int64_t stride = row_bytes / chunks;
      for (int64_t n = begin; n < end; ++n) {
        float dot;
        if constexpr (kKQuant<QT>) dot = kquant_row_dot_512<QT>(data + n * row_bytes, chunks / 8, x, x_sums.data(),
                                                                 kKQuantPrefetchBytes);
        else dot = row_dot_factored_512<QT>(data + n * row_bytes, chunks, x, x_sums.data(), kPrefetchBytes, stride);
        out[n] = dot + (bias != nullptr ? bias[n] : 0.f);
      }
      return;
    }
  }
  float sums[16];
  const int64_t stride = row_bytes / chunks;
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = data + n * row_bytes;
    const float b = bias != nullptr ? bias[n] : 0.f;
    for (int64_t m0 = 0; m0 < rows_x;) {
      const int64_t left = rows_x - m0;
      const int64_t tile = left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      const float* xm = x + m0 * ldx;
      const int64_t ahead = m0 == 0 ? kPrefetchBytes : 0;
      if (tile == 16) row_times_tile_512<QT, 16>(row, chunks, xm, ldx, sums, ahead, stride);
      else if (tile == 8) row_times_tile_512<QT, 8>(row, chunks, xm, ldx, sums, ahead, stride);
      else if (tile == 4) row_times_tile_512<QT, 4>(row, chunks, xm, ldx, sums, ahead, stride);
      else if (tile == 2) row_times_tile_512<QT, 2>(row, chunks, xm, ldx, sums, ahead, stride);
      else row_times_tile_512<QT, 1>(row, chunks, xm, ldx, sums, ahead, stride);
      for (int64_t m = 0; m < tile; ++m) out[(m0 + m) * ldy + n] = sums[m] + b;
      m0 += tile;
    }
  }
}

template <int64_t QT>
void dequant_rows_512(const uint8_t* data, int64_t row_bytes, int64_t chunks, float* out, int64_t begin,
                      int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    float* dest = out + (n - begin) * chunks * kChunk;
    const uint8_t* row = data + n * row_bytes;
    KQuantScales block;
    for (int64_t c = 0; c < chunks; ++c) {
      if constexpr (kKQuant<QT>)
        if ((c & 7) == 0) load_kquant_scales<QT>(row + (c >> 3) * kKQuantBlockBytes<QT>, block);
      __m512 w[2];
      dequant_chunk_512<QT>(row, c, w, block);
      _mm512_storeu_ps(dest + c * kChunk, w[0]);
      _mm512_storeu_ps(dest + c * kChunk + 16, w[1]);
    }
  }
}
#endif

using GemvFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, float*,
                        int64_t, int64_t, int64_t);
using DequantFn = void (*)(const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t);

struct Kernels {
  GemvFn gemv;
  DequantFn dequant;
};

// The instruction sets a build can run its kernels with: the portable C++ always, then what it was compiled for.
enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr int64_t kBestIsa = NEBULA_QUANT_AVX512 ? kAvx512 : NEBULA_QUANT_SIMD ? kAvx2 : kPortable;

template <int64_t QT>
Kernels kernels_for(int64_t isa) {
  TORCH_CHECK(isa >= kPortable && isa <= kBestIsa, "quant_linear: instruction set ", isa,
              " is not in this build (best: ", kBestIsa, ", see quant_isa())");
#if NEBULA_QUANT_AVX512
  if (isa == kAvx512) return {gemv_512<QT>, dequant_rows_512<QT>};
#endif
#if NEBULA_QUANT_SIMD
  if (isa == kAvx2) return {gemv_simd<QT>, dequant_rows_simd<QT>};
#endif
  return {gemv_scalar<QT>, dequant_rows_scalar<QT>};
}

Kernels kernels_of(int64_t qtype, int64_t isa) {
  switch (qtype) {
    case kF32: return kernels_for<kF32>(isa);
    case kF16: return kernels_for<kF16>(isa);
    case kBF16: return kernels_for<kBF16>(isa);
    case kQ4_0: return kernels_for<kQ4_0>(isa);
    case kQ4_1: return kernels_for<kQ4_1>(isa);
    case kQ5_0: return kernels_for<kQ5_0>(isa);
    case kQ5_1: return kernels_for<kQ5_1>(isa);
    case kQ8_0: return kernels_for<kQ8_0>(isa);
    case kQ4_K: return kernels_for<kQ4_K>(isa);
    case kQ5_K: return kernels_for<kQ5_K>(isa);
    case kQ6_K: return kernels_for<kQ6_K>(isa);
  }
  TORCH_CHECK(false, "quant_linear: ggml type ", qtype, " is not supported");
}

// A part's row bytes agree with K values a row, K a whole number of chunks.
void check_part(const at::Tensor& part, int64_t qtype, int64_t k) {
  const Layout layout = layout_of(qtype);
  TORCH_CHECK(part.scalar_type() == at::kByte && part.dim() == 2 && part.is_contiguous() && part.device().is_cpu(),
              "quant_linear: each weight part must be a contiguous uint8 CPU tensor [rows, row bytes]");
  TORCH_CHECK(k % kChunk == 0 && k % layout.block_values == 0, "quant_linear: K = ", k,
              " must be a multiple of 32 and of the type's block (", layout.block_values, ")");
  TORCH_CHECK(part.size(1) == k / layout.block_values * layout.block_bytes, "quant_linear: a part of type ", qtype,
              " has ", part.size(1), " bytes a row, K = ", k, " needs ", k / layout.block_values * layout.block_bytes);
}

// Each W row of a panel dequantized into tile [rows, K] (rows split over the threads).
void dequantize_panel(const Kernels& kernels, const uint8_t* data, int64_t row_bytes, int64_t chunks, int64_t first,
                      int64_t rows, float* tile) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    kernels.dequant(data + (first + begin) * row_bytes, row_bytes, chunks, tile + begin * chunks * kChunk, 0,
                    end - begin);
  });
}

// x [M, K] fp32, parts [N_i, row bytes] uint8 of ggml types qtypes[i] (their rows stacked make W [N, K]), bias [N]
// or undefined; writes out [M, N]. M >= gemm_min_rows: panels of panel_rows W rows through at::mm, else the GEMV.
void quant_linear(const at::Tensor& x, at::TensorList parts, at::IntArrayRef qtypes,
                  const c10::optional<at::Tensor>& bias, int64_t gemm_min_rows, int64_t panel_rows, int64_t isa,
                  at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(),
              "quant_linear: x must be a contiguous fp32 CPU tensor [M, K]");
  TORCH_CHECK(parts.size() == qtypes.size() && !parts.empty(), "quant_linear: one ggml type per weight part");
  const int64_t rows_x = x.size(0), k = x.size(1), chunks = k / kChunk;
  int64_t n_total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_part(parts[i], qtypes[i], k);
    n_total += parts[i].size(0);
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows_x &&
                  out.size(1) == n_total,
              "quant_linear: out must be a contiguous fp32 tensor [M, N]");
  const float* bias_data = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_total,
                "quant_linear: bias must be a contiguous fp32 tensor [N]");
    bias_data = bias->data_ptr<float>();
  }
  if (rows_x == 0 || n_total == 0) return;
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  if (rows_x >= gemm_min_rows) {
    TORCH_CHECK(panel_rows > 0, "quant_linear: panel_rows must be positive");
    at::Tensor tile = at::empty({std::min(panel_rows, n_total), k}, x.options());
    int64_t column = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const Kernels kernels = kernels_of(qtypes[i], isa);
      const int64_t rows = parts[i].size(0), row_bytes = parts[i].size(1);
      for (int64_t first = 0; first < rows; first += panel_rows) {
        const int64_t count = std::min(panel_rows, rows - first);
        at::Tensor panel = tile.narrow(0, 0, count);
        dequantize_panel(kernels, parts[i].data_ptr<uint8_t>(), row_bytes, chunks, first, count,
                         panel.data_ptr<float>());
        at::Tensor dest = out.narrow(1, column + first, count);
        at::mm_out(dest, x, panel.t());
      }
      column += rows;
    }
    if (bias_data != nullptr) out.add_(*bias);
    return;
  }
  // one task range over the stacked rows; each task walks the parts its rows fall in
  std::vector<int64_t> starts{0};
  std::vector<Kernels> kernels;
  for (size_t i = 0; i < parts.size(); ++i) {
    starts.push_back(starts.back() + parts[i].size(0));
    kernels.push_back(kernels_of(qtypes[i], isa));
  }
  at::parallel_for(0, n_total, 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t lo = std::max(begin, starts[i]), hi = std::min(end, starts[i + 1]);
      if (lo >= hi) continue;
      kernels[i].gemv(parts[i].data_ptr<uint8_t>(), parts[i].size(1), chunks, x_data, rows_x, k,
                      bias_data != nullptr ? bias_data + starts[i] : nullptr, out_data + starts[i], n_total,
                      lo - starts[i], hi - starts[i]);
    }
  });
}

// rows [N, row bytes] of ggml type qtype -> out [N, K] fp32
void quant_dequantize(const at::Tensor& rows, int64_t qtype, int64_t isa, at::Tensor& out) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous() && out.size(0) == rows.size(0),
              "quant_dequantize: out must be a contiguous fp32 tensor [N, K]");
  check_part(rows, qtype, out.size(1));
  dequantize_panel(kernels_of(qtype, isa), rows.data_ptr<uint8_t>(), rows.size(1), out.size(1) / kChunk, 0,
                   rows.size(0), out.data_ptr<float>());
}

int64_t quant_isa() { return kBestIsa; }

}  // namespace

TORCH_LIBRARY(nebula_quant, m) {
  m.def("linear(Tensor x, Tensor[] parts, int[] qtypes, Tensor? bias, int gemm_min_rows, int panel_rows, int isa, "
        "Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor rows, int qtype, int isa, Tensor(a!) out) -> ()");
  m.def("isa() -> int", quant_isa);
}

TORCH_LIBRARY_IMPL(nebula_quant, CPU, m) {
  m.impl("linear", quant_linear);
  m.impl("dequantize", quant_dequantize);
}
