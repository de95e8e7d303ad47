// Products with mixle's quantized weights straight from their stored codes and scales:
// y[b, o] = sum_k x[b, k] * w[o, k] (+ bias[o]) with w[o, k] = float(code[o, k]) * scale[block(o, k)].
//
// Storage (see mixle/core/packing.py and QuantizedLinear): int8 codes of shape (out, in), or int4
// codes flattened row-major and packed two per byte (byte i = c[2i] low nibble | c[2i+1] high nibble,
// two's-complement nibbles). The scale of element (o, k) is scale[o * scales_per_row + k / group]:
// tensor granularity (scales_per_row 0, group = in), channel (1, in) or groups of `group`
// consecutive inputs of a row (in / group, group).
//
// Every weight is rebuilt exactly as mixle.core.numerics.dequantize_array rebuilds it (one float32
// product code * scale), so the result differs from dequantize-then-F.linear only in the order
// (and fusing) of the float sums. No full-weight float copy is made: each row's codes are read once
// and decoded in registers (int4 through a 16-entry table code * scale per block of the row,
// against x reordered once per call to match the nibble order).
//
// Paths: AVX-512 (__AVX512F__), AVX2 (__AVX2__) or portable scalar; OpenMP over output rows.

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__)
#define MIXLE_INLINE inline __attribute__((always_inline))  // keep decoded vectors in registers
#define MIXLE_OUTLINED __attribute__((noinline))  // one register allocation per row kernel
#else
#define MIXLE_INLINE inline
#define MIXLE_OUTLINED
#endif

namespace {

struct Weights {
  const uint8_t* codes;
  int bits;
  const float* scale;
  int64_t group;           // consecutive inputs of a row that share a scale
  int64_t scales_per_row;  // 0: one scale for the whole tensor
  int64_t in;
};

inline int code_at(const Weights& w, int64_t o, int64_t k) {
  const int64_t n = o * w.in + k;
  if (w.bits == 8) return static_cast<int>(reinterpret_cast<const int8_t*>(w.codes)[n]);
  const int nibble = (w.codes[n >> 1] >> ((n & 1) * 4)) & 0xF;
  return (nibble ^ 8) - 8;
}

inline float weight_at(const Weights& w, int64_t o, int64_t k) {
  return static_cast<float>(code_at(w, o, k)) * w.scale[o * w.scales_per_row + k / w.group];
}

// ---------------------------------------------------------------- vector primitives
#if defined(__AVX512F__)
constexpr int64_t VL = 16;
typedef __m512 vec;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }

// The 16 weights of one block, indexed by nibble: code 0..7, then -8..-1.
struct Table { __m512 t; };
MIXLE_INLINE Table int4_table(float s) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  return {_mm512_mul_ps(codes, _mm512_set1_ps(s))};
}
// 2 x 16 int4 weights from 16 bytes: lane j of `even` is the weight of byte j's low nibble
// (element 2j), lane j of `odd` that of its high nibble (element 2j + 1). The permute reads
// only the low 4 bits of each index.
MIXLE_INLINE void int4_weights(const uint8_t* p, const Table& t, vec& even, vec& odd) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  even = _mm512_permutexvar_ps(idx, t.t);
  odd = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), t.t);
}
// Stores even/odd lanes back in element order: even[0], odd[0], even[1], odd[1], ...
inline void store_interleaved(float* dst, vec even, vec odd) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(dst, _mm512_permutex2var_ps(even, low, odd));
  _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(even, high, odd));
}
MIXLE_INLINE vec int8_weights(const int8_t* p, vec s) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
}
inline vec vset1(float s) { return _mm512_set1_ps(s); }
#define MIXLE_VECTOR 1
const char* const ISA = "avx512";

#elif defined(__AVX2__)
constexpr int64_t VL = 8;
typedef __m256 vec;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
#ifdef __FMA__
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
inline vec vfma(vec a, vec b, vec c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }
#endif
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Codes 0..7 and -8..-1 times the block's scale: two 8-entry permutes, picked by the nibble's bit 3.
struct Table { __m256 low, high; };
MIXLE_INLINE Table int4_table(float s) {
  const __m256 sv = _mm256_set1_ps(s);
  return {_mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), sv),
          _mm256_mul_ps(_mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), sv)};
}
MIXLE_INLINE vec int4_lookup(__m256i idx, const Table& t) {
  const __m256 low = _mm256_permutevar8x32_ps(t.low, idx);
  const __m256 high = _mm256_permutevar8x32_ps(t.high, idx);
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
// 2 x 8 int4 weights from 8 bytes: lane j of `even` is byte j's low nibble (element 2j), of `odd`
// its high nibble (element 2j + 1).
MIXLE_INLINE void int4_weights(const uint8_t* p, const Table& t, vec& even, vec& odd) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  even = int4_lookup(idx, t);
  odd = int4_lookup(_mm256_srli_epi32(idx, 4), t);
}
inline void store_interleaved(float* dst, vec even, vec odd) {
  const __m256 a = _mm256_unpacklo_ps(even, odd), b = _mm256_unpackhi_ps(even, odd);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(a, b, 0x31));
}
MIXLE_INLINE vec int8_weights(const int8_t* p, vec s) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s);
}
inline vec vset1(float s) { return _mm256_set1_ps(s); }
#define MIXLE_VECTOR 1
const char* const ISA = "avx2";

#else
const char* const ISA = "scalar";
#endif

#ifdef MIXLE_VECTOR
// A decoder hands out the weights of row o one step (VECS vectors, STEP elements) at a time,
// walking k = 0, STEP, 2 STEP, ... in order, and switches the block's scale at block boundaries.
// Int4Row's two vectors hold the even then the odd elements of its step (see int4_weights): it is
// paired with x reordered the same way (reorder_for_int4), so no lane shuffles are needed per row.
struct Int4Row {
  static constexpr int VECS = 2;
  const uint8_t* row;
  const float* scales;
  int64_t group, next = 0, block = -1;
  Table table;
  Int4Row() = default;
  Int4Row(const Weights& w, int64_t o)
      : row(w.codes + (o * w.in) / 2), scales(w.scale + o * w.scales_per_row), group(w.group) {}
  MIXLE_INLINE void at(int64_t k, vec* wv) {
    if (k >= next) {
      ++block;
      next += group;
      table = int4_table(scales[block]);
    }
    int4_weights(row + k / 2, table, wv[0], wv[1]);
  }
};

struct Int8Row {
  static constexpr int VECS = 1;
  const int8_t* row;
  const float* scales;
  int64_t group, next = 0, block = -1;
  vec s;
  Int8Row() = default;
  Int8Row(const Weights& w, int64_t o)
      : row(reinterpret_cast<const int8_t*>(w.codes) + o * w.in), scales(w.scale + o * w.scales_per_row),
        group(w.group) {}
  MIXLE_INLINE void at(int64_t k, vec* wv) {
    if (k >= next) {
      ++block;
      next += group;
      s = vset1(scales[block]);
    }
    wv[0] = int8_weights(row + k, s);
  }
};

// Rows the decoders above can't walk are first rebuilt into a per-thread buffer.
struct BufferRow {
  static constexpr int VECS = 1;
  const float* row;
  MIXLE_INLINE void at(int64_t k, vec* wv) const { wv[0] = vload(row + k); }
};

// Whether Int4Row/Int8Row can walk the rows: int4 rows start on a byte, and no step straddles
// two blocks.
inline bool decodable(const Weights& w) {
  if (w.bits == 4 && (w.in & 1)) return false;
  const int64_t step = w.bits == 4 ? 2 * VL : VL;
  return w.group == w.in || w.group % step == 0;
}

// x rows with every step of 2 VL elements reordered even elements first, then odd; the tail
// after the last whole step stays in order.
void reorder_for_int4(const float* x, int64_t batch, int64_t in, float* dst) {
  const int64_t whole = in / (2 * VL) * (2 * VL);
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x + b * in;
    float* db = dst + b * in;
    for (int64_t k = 0; k < whole; k += 2 * VL)
      for (int64_t j = 0; j < VL; ++j) {
        db[k + j] = xb[k + 2 * j];
        db[k + VL + j] = xb[k + 2 * j + 1];
      }
    for (int64_t k = whole; k < in; ++k) db[k] = xb[k];
  }
}

// NB batch rows times weight row o; U independent accumulators per batch row hide the FMA latency.
template <int NB, int U, class Row>
MIXLE_OUTLINED void dot_rows(Row row, const Weights& w, int64_t o, const float* x, float* y, int64_t out,
                     const float* bias) {
  constexpr int64_t STEP = Row::VECS * VL;
  vec acc[NB][U];
  for (int b = 0; b < NB; ++b)
    for (int u = 0; u < U; ++u) acc[b][u] = vzero();
  const int64_t in = w.in;
  const int64_t steps = in / STEP;
  vec wv[Row::VECS];
  int64_t c = 0;
  for (; c + U <= steps; c += U) {
    for (int u = 0; u < U; ++u) {
      const int64_t k = (c + u) * STEP;
      row.at(k, wv);
      for (int v = 0; v < Row::VECS; ++v)
        for (int b = 0; b < NB; ++b) acc[b][u] = vfma(wv[v], vload(x + b * in + k + v * VL), acc[b][u]);
    }
  }
  for (; c < steps; ++c) {
    const int64_t k = c * STEP;
    row.at(k, wv);
    for (int v = 0; v < Row::VECS; ++v)
      for (int b = 0; b < NB; ++b) acc[b][0] = vfma(wv[v], vload(x + b * in + k + v * VL), acc[b][0]);
  }
  float tail_w[2 * VL];
  const int64_t tail = steps * STEP;
  for (int64_t k = tail; k < in; ++k) tail_w[k - tail] = weight_at(w, o, k);
  for (int b = 0; b < NB; ++b) {
    vec a = acc[b][0];
    for (int u = 1; u < U; ++u) a = vadd(a, acc[b][u]);
    float sum = vsum(a);
    for (int64_t k = tail; k < in; ++k) sum += tail_w[k - tail] * x[b * in + k];
    y[b * out + o] = bias ? sum + bias[o] : sum;
  }
}

// R weight rows (o, o + 1, ...) times NB rows of x: each x vector loaded once feeds R products.
template <int R, int NB, class Row>
MIXLE_OUTLINED void dot_block(const Weights& w, int64_t o, const float* x, float* y, int64_t out,
                              const float* bias) {
  constexpr int64_t STEP = Row::VECS * VL;
  Row rows[R];
  for (int r = 0; r < R; ++r) rows[r] = Row(w, o + r);
  vec acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = vzero();
  const int64_t in = w.in;
  const int64_t steps = in / STEP;
  vec wv[R][Row::VECS];
  for (int64_t c = 0; c < steps; ++c) {
    const int64_t k = c * STEP;
    for (int r = 0; r < R; ++r) rows[r].at(k, wv[r]);
    for (int v = 0; v < Row::VECS; ++v)
      for (int b = 0; b < NB; ++b) {
        const vec xv = vload(x + b * in + k + v * VL);
        for (int r = 0; r < R; ++r) acc[r][b] = vfma(wv[r][v], xv, acc[r][b]);
      }
  }
  const int64_t tail = steps * STEP;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      float sum = vsum(acc[r][b]);
      for (int64_t k = tail; k < in; ++k) sum += weight_at(w, o + r, k) * x[b * in + k];
      y[b * out + o + r] = bias ? sum + bias[o + r] : sum;
    }
}

template <class Row>
inline void dot_batch(Row row, const Weights& w, int64_t o, const float* x, int64_t batch, float* y,
                      int64_t out, const float* bias) {
  int64_t b = 0;
  for (; b + 8 <= batch; b += 8) dot_rows<8, 1>(row, w, o, x + b * w.in, y + b * out, out, bias);
  const float* xb = x + b * w.in;
  float* yb = y + b * out;
  switch (batch - b) {
    case 1: dot_rows<1, 4>(row, w, o, xb, yb, out, bias); break;
    case 2: dot_rows<2, 2>(row, w, o, xb, yb, out, bias); break;
    case 3: dot_rows<3, 2>(row, w, o, xb, yb, out, bias); break;
    case 4: dot_rows<4, 1>(row, w, o, xb, yb, out, bias); break;
    case 5: dot_rows<5, 1>(row, w, o, xb, yb, out, bias); break;
    case 6: dot_rows<6, 1>(row, w, o, xb, yb, out, bias); break;
    case 7: dot_rows<7, 1>(row, w, o, xb, yb, out, bias); break;
    default: break;
  }
}

// ---------------------------------------------------------------- batches: decoded panels
// For batches the weight is decoded once per call (per BATCH_CHUNK rows of x), a few rows and
// KC inputs at a time into an L1-resident panel, and multiplied as an outer product: lanes run
// over rows of x (x transposed once per call, zero-padded to whole vectors), each decoded weight
// is broadcast against them. R weight rows x NBV vectors of x rows are accumulated in registers
// over a chunk of KC inputs, in input order; partial sums of later chunks go through yt (out, BATCH_CHUNK).
constexpr int NBV_MAX = 4;
constexpr int64_t BATCH_CHUNK = NBV_MAX * VL;
constexpr int64_t KC = 512;  // inputs per panel: R x KC decoded floats stay in L1, KC x BATCH_CHUNK of x in L2
constexpr int PANEL_R = VL == 16 ? 6 : 2;  // accumulators R x NBV + NBV x vectors fit the registers

inline void set_row_start(int64_t k0, int64_t group, int64_t& next, int64_t& block) {
  block = k0 / group - 1;
  next = k0 / group * group;
}

// Weights (o, k0 .. k0 + n) into dst: code * scale, as weight_at.
inline void decode_range(const Weights& w, int64_t o, int64_t k0, int64_t n, float* dst) {
  int64_t k = 0;
  if (decodable(w)) {
    vec wv[2];
    if (w.bits == 4) {
      Int4Row row(w, o);
      set_row_start(k0, row.group, row.next, row.block);
      for (; k + 2 * VL <= n; k += 2 * VL) {
        row.at(k0 + k, wv);
        store_interleaved(dst + k, wv[0], wv[1]);
      }
    } else {
      Int8Row row(w, o);
      set_row_start(k0, row.group, row.next, row.block);
      for (; k + VL <= n; k += VL) {
        row.at(k0 + k, wv);
        vstore(dst + k, wv[0]);
      }
    }
  }
  for (; k < n; ++k) dst[k] = weight_at(w, o, k0 + k);
}

// acc[r][v] (+)= sum over kk < n of panel[r][kk] * xt[kk][v]; then either kept in yt (partial) or
// written to y (last chunk, + bias).
template <int R, int NBV>
MIXLE_OUTLINED void panel_block(const float* panel, const float* xt, int64_t n, float* yt, bool first, bool last,
                                float* y, int64_t out, int64_t o, int64_t nb, const float* bias) {
  vec acc[R][NBV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NBV; ++v) acc[r][v] = first ? vzero() : vload(yt + (o + r) * BATCH_CHUNK + v * VL);
  for (int64_t kk = 0; kk < n; ++kk) {
    vec xv[NBV];
    for (int v = 0; v < NBV; ++v) xv[v] = vload(xt + kk * BATCH_CHUNK + v * VL);
    for (int r = 0; r < R; ++r) {
      const vec wb = vset1(panel[r * KC + kk]);
      for (int v = 0; v < NBV; ++v) acc[r][v] = vfma(wb, xv[v], acc[r][v]);
    }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NBV; ++v) vstore(yt + (o + r) * BATCH_CHUNK + v * VL, acc[r][v]);
    return;
  }
  float lanes[R][NBV * VL];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NBV; ++v) vstore(lanes[r] + v * VL, acc[r][v]);
  for (int64_t b = 0; b < nb; ++b)
    for (int r = 0; r < R; ++r) y[b * out + o + r] = bias ? lanes[r][b] + bias[o + r] : lanes[r][b];
}

template <int R>
inline void panel_rows(int nbv, const float* panel, const float* xt, int64_t n, float* yt, bool first, bool last,
                       float* y, int64_t out, int64_t o, int64_t nb, const float* bias) {
  switch (nbv) {
    case 1: panel_block<R, 1>(panel, xt, n, yt, first, last, y, out, o, nb, bias); break;
    case 2: panel_block<R, 2>(panel, xt, n, yt, first, last, y, out, o, nb, bias); break;
    case 3: panel_block<R, 3>(panel, xt, n, yt, first, last, y, out, o, nb, bias); break;
    default: panel_block<R, 4>(panel, xt, n, yt, first, last, y, out, o, nb, bias); break;
  }
}

template <int R>
inline void panel_dispatch(int rows, int nbv, const float* panel, const float* xt, int64_t n, float* yt, bool first,
                           bool last, float* y, int64_t out, int64_t o, int64_t nb, const float* bias) {
  if constexpr (R > 1) {
    if (rows < R) return panel_dispatch<R - 1>(rows, nbv, panel, xt, n, yt, first, last, y, out, o, nb, bias);
  }
  panel_rows<R>(nbv, panel, xt, n, yt, first, last, y, out, o, nb, bias);
}

// Output rows [o_begin, o_end) of a chunk of nb <= BATCH_CHUNK rows of x, given transposed (xt:
// in x BATCH_CHUNK, zero lanes past nb). y points at the chunk's first row.
void panel_linear_rows(const Weights& w, const float* xt, int64_t nb, int64_t out, const float* bias, float* y,
                       float* yt, int64_t o_begin, int64_t o_end) {
  alignas(64) float panel[PANEL_R * KC];
  const int nbv = static_cast<int>((nb + VL - 1) / VL);
  for (int64_t k0 = 0; k0 < w.in; k0 += KC) {
    const int64_t n = w.in - k0 < KC ? w.in - k0 : KC;
    const bool first = k0 == 0, last = k0 + n == w.in;
    for (int64_t o = o_begin; o < o_end; o += PANEL_R) {
      const int rows = static_cast<int>(o_end - o < PANEL_R ? o_end - o : PANEL_R);
      for (int r = 0; r < rows; ++r) decode_range(w, o + r, k0, n, panel + r * KC);
      panel_dispatch<PANEL_R>(rows, nbv, panel, xt + k0 * BATCH_CHUNK, n, yt, first, last, y, out, o, nb, bias);
    }
  }
}
#endif  // MIXLE_VECTOR

void decode_row_scalar(const Weights& w, int64_t o, float* dst) {
  for (int64_t k = 0; k < w.in; ++k) dst[k] = weight_at(w, o, k);
}

// Output rows [o_begin, o_end) of y; x_int4 is x reordered by reorder_for_int4 (int4 rows that
// Int4Row walks), else null.
void linear_rows(const Weights& w, const float* x, const float* x_int4, int64_t batch, int64_t out,
                 const float* bias, float* y, int64_t o_begin, int64_t o_end) {
  std::vector<float> buffer(w.in);
#ifdef MIXLE_VECTOR
  if (!decodable(w)) {
    for (int64_t o = o_begin; o < o_end; ++o) {
      decode_row_scalar(w, o, buffer.data());
      dot_batch(BufferRow{buffer.data()}, w, o, x, batch, y, out, bias);
    }
    return;
  }
  if (batch < 8) {  // one weight row at a time, every row of x at once
    for (int64_t o = o_begin; o < o_end; ++o) {
      if (w.bits == 4) {
        dot_batch(Int4Row(w, o), w, o, x_int4, batch, y, out, bias);
      } else {
        dot_batch(Int8Row(w, o), w, o, x, batch, y, out, bias);
      }
    }
    return;
  }
  // Blocks of BLOCK_ROWS weight rows times 4 rows of x at a time, both in cache: R x 4 products
  // per decoded step, and x read once per block.
  constexpr int64_t BLOCK_ROWS = 16;
  constexpr int R = VL == 16 ? 4 : 2;  // accumulators + weights fit the 32 zmm / 16 ymm registers
  const float* xs = w.bits == 4 ? x_int4 : x;
  for (int64_t o0 = o_begin; o0 < o_end; o0 += BLOCK_ROWS) {
    const int64_t o1 = o0 + BLOCK_ROWS < o_end ? o0 + BLOCK_ROWS : o_end;
    for (int64_t b0 = 0; b0 < batch; b0 += 4) {
      const int64_t nb = batch - b0 < 4 ? batch - b0 : 4;
      const float* xb = xs + b0 * w.in;
      float* yb = y + b0 * out;
      int64_t o = o0;
      if (nb == 4) {
        for (; o + R <= o1; o += R) {
          if (w.bits == 4) {
            dot_block<R, 4, Int4Row>(w, o, xb, yb, out, bias);
          } else {
            dot_block<R, 4, Int8Row>(w, o, xb, yb, out, bias);
          }
        }
      }
      for (; o < o1; ++o) {
        if (w.bits == 4) {
          dot_batch(Int4Row(w, o), w, o, xb, nb, yb, out, bias);
        } else {
          dot_batch(Int8Row(w, o), w, o, xb, nb, yb, out, bias);
        }
      }
    }
  }
#else
  (void)x_int4;
  for (int64_t o = o_begin; o < o_end; ++o) {
    decode_row_scalar(w, o, buffer.data());
    for (int64_t b = 0; b < batch; ++b) {
      const float* xb = x + b * w.in;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= w.in; k += 8)
        for (int j = 0; j < 8; ++j) acc[j] += buffer[k + j] * xb[k + j];
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; k < w.in; ++k) sum += buffer[k] * xb[k];
      y[b * out + o] = bias ? sum + bias[o] : sum;
    }
  }
#endif
}

// Splits [0, rows) over the threads in contiguous, nearly equal ranges and runs fn(begin, end).
template <class Fn>
void over_rows(int64_t rows, int threads, Fn fn) {
#ifdef _OPENMP
  if (threads > 1 && rows > 1) {
    if (threads > rows) threads = static_cast<int>(rows);
#pragma omp parallel num_threads(threads)
    {
      const int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
      fn(rows * t / n, rows * (t + 1) / n);
    }
    return;
  }
#endif
  (void)threads;
  fn(0, rows);
}

}  // namespace

extern "C" {

// Which vector path this build runs: "avx512", "avx2" or "scalar".
const char* mixle_packed_isa() { return ISA; }

// y (batch, out) = x (batch, in) @ w^T + bias (bias may be null). All float32, contiguous.
void mixle_packed_linear_f32(const float* x, int64_t batch, int64_t in, int64_t out, const void* codes,
                             int bits, const float* scale, int64_t group, int64_t scales_per_row,
                             const float* bias, float* y, int threads) {
  const Weights w{static_cast<const uint8_t*>(codes), bits, scale, group, scales_per_row, in};
  std::vector<float> x_int4;
#ifdef MIXLE_VECTOR
  if (bits == 4 && decodable(w)) {
    x_int4.resize(batch * in);
    reorder_for_int4(x, batch, in, x_int4.data());
  }
#endif
  const float* reordered = x_int4.empty() ? nullptr : x_int4.data();
  over_rows(out, threads, [&](int64_t begin, int64_t end) {
    linear_rows(w, x, reordered, batch, out, bias, y, begin, end);
  });
}

// Same product as mixle_packed_linear_f32 through decoded panels (outer products; see
// panel_linear_rows): faster from a few dozen rows of x. Falls back to it without vector code.
void mixle_packed_linear_panels_f32(const float* x, int64_t batch, int64_t in, int64_t out, const void* codes,
                                    int bits, const float* scale, int64_t group, int64_t scales_per_row,
                                    const float* bias, float* y, int threads) {
#ifdef MIXLE_VECTOR
  const Weights w{static_cast<const uint8_t*>(codes), bits, scale, group, scales_per_row, in};
  // Kept per calling thread: megabyte buffers allocated per call cost page faults every call.
  static thread_local std::vector<float> xt, yt;
  xt.assign(static_cast<size_t>(in * BATCH_CHUNK), 0.0f);
  yt.resize(static_cast<size_t>(out * BATCH_CHUNK));
  for (int64_t b0 = 0; b0 < batch; b0 += BATCH_CHUNK) {
    const int64_t nb = batch - b0 < BATCH_CHUNK ? batch - b0 : BATCH_CHUNK;
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + (b0 + b) * in;
      for (int64_t k = 0; k < in; ++k) xt[k * BATCH_CHUNK + b] = xb[k];
    }
    if (nb < BATCH_CHUNK && b0 > 0)
      for (int64_t k = 0; k < in; ++k)
        for (int64_t b = nb; b < BATCH_CHUNK; ++b) xt[k * BATCH_CHUNK + b] = 0.0f;
    float* xtp = xt.data();
    float* ytp = yt.data();
    over_rows(out, threads, [&](int64_t begin, int64_t end) {
      panel_linear_rows(w, xtp, nb, out, bias, y + b0 * out, ytp, begin, end);
    });
  }
#else
  mixle_packed_linear_f32(x, batch, in, out, codes, bits, scale, group, scales_per_row, bias, y, threads);
#endif
}

}  // extern "C"
