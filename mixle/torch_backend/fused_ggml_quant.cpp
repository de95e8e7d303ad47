// Fused CPU fake-quant of llama.cpp's block grids for mixle's torch QAT (built by fused_ggml.py,
// called via ctypes): q4_0, q8_0 (the numerics of mixle/core/numerics.py), q4_1, q5_0, q5_1, mxfp4, nf4 and
// the K-quants q4_k, q5_k, q6_k (mixle/gguf/ggml_quants.py and ggml_kquants.py, themselves bit
// for bit ggml's reference quantizers, ggml/src/ggml-quants.c). Every value is computed with the
// same float32 operations in the same order as that numpy code (sums as sequential loops from 0,
// C's grouping of products and sums; built with -ffp-contract=off: no fused multiply-add), so the
// results are bit-identical; tests/test_fused_ggml.py compares them with numpy.
//
// One pass per block: a block (32 values, or a super-block of 256) is read once, quantized and
// written as its fake-quantized (dequantized) values, plus, when asked, its int8 codes and the
// per-sub-block multiplier a and offset b with value = code * a (+ b), from which a later rebuild
// is one cheap pass. The K-quants' scale searches run on 16 sub-blocks at once, one per SIMD
// lane (the sums stay sequential within each sub-block).
//
// With an importance (one value per column; mixle_ggml_fake_quant_weighted) the blocks are ggml's
// importance-weighted quantizers' (quantize_row_q4_0_impl ... quantize_row_q6_K_impl, as
// mixle/gguf/ggml_weighted.py): make_qx_quants / make_qkx3_quants weighted by
// imatrix * sqrt(sigma2 + x * x), make_qp_quants for the K-quants' 6-bit scales and mins.
//
// Input and output are float32 or bfloat16 (read exactly as float32; written rounded to nearest
// even, as torch casts), so a bfloat16 weight gets exactly the float32 path's values, then cast; a
// float32 weight may also be written in bfloat16 (the matmul's operand under bfloat16 autocast).

#include "fused_ggml_blocks.h"

namespace {

// ggml's make_qp_quants on the n (<= 8) non-negative values x with weights qw: the scale; codes in L.
float make_qp(const float* x, const float* qw, int n, int nmax, int32_t* L) {
    float mx = 0.0f;
    for (int i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
    if (mx < 1e-15f) {
        for (int i = 0; i < n; ++i) L[i] = 0;
        return 0.0f;
    }
    auto error = [&](float scale, float trial, bool clipped) {
        float sum = 0.0f;
        for (int i = 0; i < n; ++i) {
            int32_t l = nearest_int(trial * x[i]);
            l = clipped ? std::min(nmax, l) : (l & 0xff);
            const float diff = x[i] - scale * (float)l;
            sum = sum + (qw[i] * diff) * diff;
        }
        return sum;
    };
    float iscale = (float)nmax / mx;
    float best = error(1.0f / iscale, iscale, false);
    for (int step = -4; step <= 4; ++step) {
        if (step == 0) continue;
        const float trial = (0.1f * (float)step + (float)nmax) / mx;
        const float cur = error(1.0f / trial, trial, true);
        if (cur < best) best = cur, iscale = trial;
    }
    float sumlx = 0.0f, suml2 = 0.0f;
    for (int i = 0; i < n; ++i) {
        const int32_t l = std::min(nmax, nearest_int(iscale * x[i]));
        sumlx = sumlx + (qw[i] * x[i]) * (float)l;
        suml2 = suml2 + (qw[i] * (float)l) * (float)l;
        L[i] = l & 0xff;
    }
    for (int pass = 0; pass < 5; ++pass) {
        for (int i = 0; i < n; ++i) {
            const float w = qw[i], wx = w * x[i], old = (float)L[i];
            const float slx = sumlx - wx * old, sl2 = suml2 - (w * old) * old;
            const int32_t nl = std::min(nmax, nearest_int((x[i] * sl2) / slx));
            const float nf = (float)nl, slx_new = slx + wx * nf, sl2_new = sl2 + (w * nf) * nf;
            if (slx > 0 && sl2 > 0 && nl != L[i] && (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new) {
                L[i] = nl & 0xff;
                sumlx = slx_new;
                suml2 = sl2_new;
            }
        }
    }
    return suml2 > 0 ? sumlx / suml2 : 0.0f;
}

// Weights qw * sqrt(sigma2 + x * x) of NL transposed sub-blocks of N values: xt, the importance qt,
// and sigma2 per lane.
template <int N>
void search_weights(const float* xt, const float* qt, const float* sigma2, float* wt) {
    for (int i = 0; i < N; ++i)
        for (int s = 0; s < NL; ++s) {
            const float v = xt[i * NL + s];
            wt[i * NL + s] = qt[i * NL + s] * std::sqrt(sigma2[s] + v * v);
        }
}

// q4_k / q5_k with an importance qw (per value of x), quantize_row_q4_K_impl / _q5_K_impl, on
// `count` super-blocks of 256 at x.
template <int NMAX>
void superblocks_qk_weighted(const float* x, const float* qw, int count, Block& o) {
    float xt[32 * NL], qt[32 * NL], wt[32 * NL], scales[NL], mins[NL], sigma2[NL], sw[NL];
    int32_t L[32 * NL];
    transpose_in<32>(x, count * 8, xt);
    transpose_in<32>(qw, count * 8, qt);
    for (int s = 0; s < NL; ++s) {
        const float* sb = x + 256 * (std::min(s, count * 8 - 1) / 8);
        float sum = 0.0f;
        for (int i = 0; i < 256; ++i) sum = sum + sb[i] * sb[i];
        sigma2[s] = (2.0f * sum) / 256.0f;
    }
    search_weights<32>(xt, qt, sigma2, wt);
    for (int s = 0; s < NL; ++s) sw[s] = 0.0f;
    for (int i = 0; i < 32; ++i)
        for (int s = 0; s < NL; ++s) sw[s] = sw[s] + wt[i * NL + s];
    make_qkx2<32>(xt, wt, NMAX, -0.9f, 0.05f, 36, scales, mins, L);
    for (int sb = 0; sb < count; ++sb) {
        int32_t ls[8], lm[8];
        const float d_block = make_qp(scales + 8 * sb, sw + 8 * sb, 8, 63, ls);
        const float m_block = make_qp(mins + 8 * sb, sw + 8 * sb, 8, 63, lm);
        for (int j = 0; j < 8; ++j) ls[j] = std::min(63, std::max(0, ls[j])), lm[j] = std::min(63, std::max(0, lm[j]));
        k_requantize<NMAX>(x, sb, round_half(d_block), round_half(m_block), ls, lm, L, o);
    }
}

// q4_0 / q5_0 (make_qx_quants, codes - NMAX) or q4_1 / q5_1 (make_qkx3_quants: a scale and a min)
// with an importance, quantize_row_q4_0_impl ...: `lanes` (<= NL) blocks of 32 at x, whose rows'
// mean squares are sigma2 (one per block).
template <int NMAX, bool AFFINE>
void blocks_weighted(const float* x, const float* qw, const float* sigma2, int lanes, Block& o) {
    float xt[32 * NL], qt[32 * NL], wt[32 * NL], sig[NL], scale[NL], the_min[NL];
    int32_t L[32 * NL];
    transpose_in<32>(x, lanes, xt);
    transpose_in<32>(qw, lanes, qt);
    for (int s = 0; s < NL; ++s) sig[s] = sigma2[std::min(s, lanes - 1)];
    search_weights<32>(xt, qt, sig, wt);
    if (AFFINE) make_qkx2<32>(xt, wt, NMAX, -0.9f, 0.05f, 36, scale, the_min, L);
    else make_qx_rmse1<32>(xt, NMAX, scale, L, wt);
    for (int s = 0; s < lanes; ++s) {
        float d16 = round_half(scale[s]);
        const float m16 = AFFINE ? round_half(-the_min[s]) : 0.0f;
        o.overflow += !std::isfinite(d16) || !std::isfinite(m16);
        for (int i = 0; i < 32; ++i) {
            const int8_t code = (int8_t)(AFFINE ? L[i * NL + s] : L[i * NL + s] - NMAX);
            o.q[32 * s + i] = code;
            o.y[32 * s + i] = AFFINE ? (float)code * d16 + m16 : (float)code * d16;
        }
        o.a[s] = d16;
        if (AFFINE) o.b[s] = m16;
    }
}

// q6_k on `count` (1 or 2) super-blocks of 256 at x: 16 sub-blocks of 16 each.
// With an importance qw (per value of x; quantize_row_q6_K_impl) the search is weighted by it.
void superblocks_q6k(const float* x, int count, Block& o, const float* qw = nullptr) {
    float xt[16 * NL], qt[16 * NL], scales[NL];
    int32_t L[16 * NL];
    transpose_in<16>(x, count * 16, xt);
    if (qw) transpose_in<16>(qw, count * 16, qt);
    make_qx_rmse1<16>(xt, 32, scales, L, qw ? qt : nullptr);
    for (int sb = 0; sb < count; ++sb) {
        float max_abs = 0.0f, max_scale = 0.0f;
        for (int j = 0; j < 16; ++j) {
            const float v = scales[16 * sb + j];
            if (max_abs < std::fabs(v)) max_abs = std::fabs(v), max_scale = v;
        }
        const bool zero = max_abs < 1e-15f;
        const float iscale = -128.0f / max_scale;
        const float d = round_half(zero ? 0.0f : 1.0f / iscale);
        o.overflow += !std::isfinite(d);
        for (int j = 0; j < 16; ++j) {
            const int s = 16 * sb + j;
            const int32_t qs = zero ? 0 : (int8_t)std::min(127, nearest_int(iscale * scales[s]));
            const float sub_d = d * (float)qs;
            const float* __restrict xs = x + 16 * s;
            float* __restrict y = o.y + 16 * s;
            int8_t* __restrict q = o.q + 16 * s;
            for (int i = 0; i < 16; ++i) {
                int32_t l = L[i * NL + s];
                if (sub_d != 0) l = std::min(31, std::max(-32, nearest_int(xs[i] / sub_d))) + 32;
                if (zero) l = 0;
                const int8_t code = (int8_t)(l - 32);
                q[i] = code;
                y[i] = sub_d * (float)code;
            }
            o.a[s] = sub_d;
        }
    }
}

// ------------------------------------------------------------------------------- drivers

struct GridInfo {
    int block;      // values per unit processed at once (a block, or up to two super-blocks)
    int sub;        // values per sub-block (per a / b)
    bool offset;    // has b
};

GridInfo info(int grid) {
    switch (grid) {
        case Q4_0: case Q8_0: case Q5_0: case MXFP4: return {256, 32, false};  // units of up to 8 blocks of 32
        case Q4_1: case Q5_1: return {256, 32, true};
        case NF4: return {256, 64, false};  // units of up to 4 blocks of 64
        case Q4_K: case Q5_K: return {256 * NL / 8, 32, true};
        default: return {256 * NL / 16, 16, false};  // Q6_K
    }
}

// Blocks of N in turn over n values at x.
template <void (*F)(const float*, Block&), int N = 32>
void blocks_of(const float* x, int64_t n, Block& o) {
    for (int64_t k = 0; k < n; k += N) {
        Block one{o.y + k, o.q + k, o.a + k / N, o.b + k / N, 0};
        F(x + k, one);
        o.overflow += one.overflow;
    }
}

// One unit of `n` values (n <= info.block) at x; the outputs at the same offsets.
void quantize_unit(int grid, const float* x, int64_t n, Block& o) {
    switch (grid) {
        case Q4_0: return blocks_q4_0(x, (int)(n / 32), o);
        case Q8_0: return blocks_of<block_q8_0>(x, n, o);
        case Q4_1: return blocks_of<block_affine<4>>(x, n, o);
        case Q5_0: return blocks_q5_0(x, (int)(n / 32), o);
        case Q5_1: return blocks_of<block_affine<5>>(x, n, o);
        case MXFP4: return blocks_of<block_mxfp4>(x, n, o);
        case NF4: return blocks_of<block_nf4, 64>(x, n, o);
        case Q4_K: return superblocks_qk<15>(x, (int)(n / 256), o);
        case Q5_K: return superblocks_qk<31>(x, (int)(n / 256), o);
        default: return superblocks_q6k(x, (int)(n / 256), o);
    }
}

template <typename T> inline float load(const T* x, int64_t j);
template <> inline float load(const float* x, int64_t j) { return x[j]; }
template <> inline float load(const uint16_t* x, int64_t j) { return float_of((uint32_t)x[j] << 16); }

inline void store(float* y, int64_t j, float v) { y[j] = v; }
inline void store(uint16_t* y, int64_t j, float v) { y[j] = to_bf16(v); }

// A unit's outputs (len values from begin) into the caller's arrays; codes / a / b may be null.
template <typename U>
inline void write_unit(const GridInfo& g, int64_t begin, int64_t len, const float* yf, const int8_t* qf,
                       const float* af, const float* bf, U* deq, int8_t* codes, float* a, float* b) {
    for (int64_t j = 0; j < len; ++j) store(deq, begin + j, yf[j]);
    if (codes) std::memcpy(codes + begin, qf, len);
    const int64_t subs = len / g.sub, first = begin / g.sub;
    if (a) std::memcpy(a + first, af, subs * sizeof(float));
    if (b && g.offset) std::memcpy(b + first, bf, subs * sizeof(float));
}

// Returns the number of units holding NaN or infinity; *overflow: units whose stored float16
// scale (or min) is not finite. codes / a / b may be null (not kept).
template <typename T, typename U>
int64_t run(int grid, const T* x, int64_t n, U* deq, int8_t* codes, float* a, float* b, int64_t* overflow,
            int threads) {
    const GridInfo g = info(grid);
    const int64_t units = (n + g.block - 1) / g.block;
    int64_t bad = 0, over = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad, over) if (threads > 1 && units > 1)
    {
        float xf[256 * NL / 8], yf[256 * NL / 8], af[NL], bf[NL];
        int8_t qf[256 * NL / 8];
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t begin = u * g.block, len = std::min<int64_t>(g.block, n - begin);
            uint32_t top = 0;
            for (int64_t j = 0; j < len; ++j) {
                xf[j] = load(x, begin + j);
                top = std::max(top, bits_of(xf[j]) & 0x7fffffffu);
            }
            if (top >= 0x7f800000u) {  // NaN or infinity: the caller raises
                ++bad;
                continue;
            }
            Block o{yf, qf, af, bf, 0};
            quantize_unit(grid, xf, len, o);
            over += o.overflow;
            write_unit(g, begin, len, yf, qf, af, bf, deq, codes, a, b);
        }
    }
    *overflow = over;
    return bad;
}

// One unit of `n` values at x with the importance qw of each value; sigma2: the mean square of the
// row of each block of 32 (grids of blocks of 32).
void quantize_unit_weighted(int grid, const float* x, const float* qw, const float* sigma2, int64_t n, Block& o) {
    switch (grid) {
        case Q4_0: return blocks_weighted<8, false>(x, qw, sigma2, (int)(n / 32), o);
        case Q5_0: return blocks_weighted<16, false>(x, qw, sigma2, (int)(n / 32), o);
        case Q4_1: return blocks_weighted<15, true>(x, qw, sigma2, (int)(n / 32), o);
        case Q5_1: return blocks_weighted<31, true>(x, qw, sigma2, (int)(n / 32), o);
        case Q4_K: return superblocks_qk_weighted<15>(x, qw, (int)(n / 256), o);
        case Q5_K: return superblocks_qk_weighted<31>(x, qw, (int)(n / 256), o);
        default: return superblocks_q6k(x, (int)(n / 256), o, qw);
    }
}

// run() with an importance: qw holds one value per column of the rows of row_len values of x
// (llama-quantize --imatrix's quantizers). Not for q8_0 / mxfp4 (ggml ignores the importance there).
template <typename T, typename U>
int64_t run_weighted(int grid, const T* x, int64_t n, int64_t row_len, const float* qw, U* deq, int8_t* codes,
                     float* a, float* b, int64_t* overflow, int threads) {
    const GridInfo g = info(grid);
    const bool super = grid == Q4_K || grid == Q5_K || grid == Q6_K;
    const int64_t block = super ? g.block : 32 * NL, rows = n / row_len;
    std::vector<float> sigma2(super ? 0 : rows);  // sum of x * x over the row, in order, / row_len
    if (!super) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
        for (int64_t r = 0; r < rows; ++r) {
            float sum = 0.0f;
            for (int64_t j = 0; j < row_len; ++j) {
                const float v = load(x, r * row_len + j);
                sum = sum + v * v;
            }
            sigma2[r] = sum / (float)row_len;
        }
    }
    const int64_t units = (n + block - 1) / block;
    int64_t bad = 0, over = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad, over) if (threads > 1 && units > 1)
    {
        float xf[32 * NL], wf[32 * NL], yf[32 * NL], sf[NL], af[NL], bf[NL];
        int8_t qf[32 * NL];
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
            const int64_t begin = u * block, len = std::min<int64_t>(block, n - begin);
            uint32_t top = 0;
            int64_t col = begin % row_len;
            for (int64_t j = 0; j < len; ++j) {
                xf[j] = load(x, begin + j);
                top = std::max(top, bits_of(xf[j]) & 0x7fffffffu);
                wf[j] = qw[col];
                col = col + 1 == row_len ? 0 : col + 1;
            }
            if (top >= 0x7f800000u) {  // NaN or infinity: the caller raises
                ++bad;
                continue;
            }
            if (!super)
                for (int64_t k = 0; k < len / 32; ++k) sf[k] = sigma2[(begin + 32 * k) / row_len];
            Block o{yf, qf, af, bf, 0};
            quantize_unit_weighted(grid, xf, wf, sf, len, o);
            over += o.overflow;
            write_unit(g, begin, len, yf, qf, af, bf, deq, codes, a, b);
        }
    }
    *overflow = over;
    return bad;
}

// out = code * a (+ b) per sub-block of `sub` values (nf4: kNf4Table[code] * a): the rebuild from
// kept codes.
template <typename T>
void dequantize(const int8_t* codes, const float* a, const float* b, int64_t n, int64_t sub, T* out, int threads,
                bool nf4) {
    const int64_t subs = n / sub;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= 65536)
    for (int64_t s = 0; s < subs; ++s) {
        const float m = a[s];
        const int8_t* q = codes + s * sub;
        if (nf4) {
            for (int64_t i = 0; i < sub; ++i) store(out, s * sub + i, kNf4Table[q[i] & 15] * m);
        } else if (b) {
            const float c = b[s];
            for (int64_t i = 0; i < sub; ++i) store(out, s * sub + i, (float)q[i] * m + c);
        } else {
            for (int64_t i = 0; i < sub; ++i) store(out, s * sub + i, (float)q[i] * m);
        }
    }
}

}  // namespace

// dtype 0: float32 (x and deq), 1: bfloat16 (x and deq), 2: float32 x, bfloat16 deq (the float32 result
// rounded to nearest even: what autocast's cast of it gives). n must be a multiple of the grid's block (32 / 256).
extern "C" int64_t mixle_ggml_fake_quant(int grid, int dtype, const void* x, int64_t n, void* deq, int8_t* codes,
                                         float* a, float* b, int64_t* overflow, int threads) {
    if (dtype == 1) return run(grid, (const uint16_t*)x, n, (uint16_t*)deq, codes, a, b, overflow, threads);
    if (dtype == 2) return run(grid, (const float*)x, n, (uint16_t*)deq, codes, a, b, overflow, threads);
    return run(grid, (const float*)x, n, (float*)deq, codes, a, b, overflow, threads);
}

// The importance-weighted quantizers (not q8_0): qw, float32, one value per column of rows of row_len;
// dtype as for mixle_ggml_fake_quant.
extern "C" int64_t mixle_ggml_fake_quant_weighted(int grid, int dtype, const void* x, int64_t n, int64_t row_len,
                                                  const float* qw, void* deq, int8_t* codes, float* a, float* b,
                                                  int64_t* overflow, int threads) {
    if (dtype == 1)
        return run_weighted(grid, (const uint16_t*)x, n, row_len, qw, (uint16_t*)deq, codes, a, b, overflow, threads);
    if (dtype == 2)
        return run_weighted(grid, (const float*)x, n, row_len, qw, (uint16_t*)deq, codes, a, b, overflow, threads);
    return run_weighted(grid, (const float*)x, n, row_len, qw, (float*)deq, codes, a, b, overflow, threads);
}

extern "C" void mixle_ggml_dequantize(int dtype, const int8_t* codes, const float* a, const float* b, int64_t n,
                                      int64_t sub, void* out, int threads, int nf4) {
    if (dtype == 1) dequantize(codes, a, b, n, sub, (uint16_t*)out, threads, nf4 != 0);
    else dequantize(codes, a, b, n, sub, (float*)out, threads, nf4 != 0);
}
