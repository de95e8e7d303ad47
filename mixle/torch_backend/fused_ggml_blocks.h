// The block quantizers of fused_ggml_quant.cpp without an importance: q4_0, q8_0 (the numerics of
// mixle/core/numerics.py), q4_1, q5_0, q5_1, mxfp4 (mixle/gguf/ggml_quants.py), nf4 (mixle/core/nf4.py)
// and the K-quants' scale searches (mixle/gguf/ggml_kquants.py), with the float16 / bfloat16 / rounding
// helpers they share.
// Included once, by fused_ggml_quant.cpp (see its head for the numerics rules both follow).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Grid { Q4_0 = 0, Q8_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, MXFP4 = 8, NF4 = 9 };

inline uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

inline float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// float32 -> float16 -> float32, rounding to nearest even (numpy's astype(float16)).
inline float round_half(float f) {
    const uint32_t x = bits_of(f), sign = x & 0x80000000u, ax = x & 0x7fffffffu;
    uint32_t h;  // the float16 bits without the sign
    if (ax > 0x7f800000u) return f;  // NaN stays NaN
    if (ax >= 0x477ff000u) {
        h = 0x7c00;  // 65520 and above (and infinity) round to infinity
    } else if (ax < 0x38800000u) {  // below 2**-14: a subnormal float16, units of 2**-24
        h = (uint32_t)std::nearbyint(float_of(ax) * 16777216.0f);
    } else {
        h = (ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13;
    }
    const uint32_t e = h >> 10, m = h & 0x3ffu;
    float v;
    if (e == 0) v = (float)m * 5.9604644775390625e-08f;  // m * 2**-24, exact
    else if (e == 31) v = float_of(0x7f800000u);
    else v = float_of(((e + 112u) << 23) | (m << 13));
    return float_of(bits_of(v) | sign);
}

// float32 -> bfloat16 bits, round to nearest even (torch's cast), NaN -> 0x7fc0.
inline uint16_t to_bf16(float f) {
    const uint32_t u = bits_of(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// ggml's nearest_int: add 1.5 * 2**23 and read the mantissa.
inline int32_t nearest_int(float fval) {
    return (int32_t)(bits_of(fval + 12582912.0f) & 0x007fffffu) - 0x00400000;
}

// (int)v as x86-64 converts: truncation, INT_MIN for NaN or out of range.
inline int32_t c_int(float v) { return std::fabs(v) < 2147483648.0f ? (int32_t)v : INT32_MIN; }

struct Block {  // one block's outputs, all float32 / int8 here
    float* y;        // fake-quantized values
    int8_t* q;       // codes (as mixle's stored array holds them)
    float* a;        // per sub-block multiplier
    float* b;        // per sub-block offset (grids with a min), else unused
    int64_t overflow;
};

// ------------------------------------------------------------------ q4_0, q8_0 (mixle.core.numerics)

// The first index of the largest |x| of a block of 32 (numpy's argmax), branch-free.
inline int first_absmax_index(const float* __restrict x) {
    uint32_t u[32], top = 0;
    for (int j = 0; j < 32; ++j) {
        u[j] = bits_of(x[j]) & 0x7fffffffu;
        top = u[j] > top ? u[j] : top;
    }
    int at = 32;
    for (int j = 0; j < 32; ++j) at = std::min(at, u[j] == top ? j : 32);
    return at;
}

// round_half without branches, so that a loop over blocks vectorises (the same values). Where one
// scale is rounded at a time the branches are cheaper (a one-block q5_0 kernel ran 16% slower on it).
inline float round_half_select(float f) {
    const uint32_t x = bits_of(f), sign = x & 0x80000000u, ax = x & 0x7fffffffu;
    const uint32_t sub = (uint32_t)(int32_t)std::nearbyint(float_of(std::min(ax, 0x38800000u)) * 16777216.0f);
    const uint32_t normal = (ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13;
    const uint32_t h = ax >= 0x477ff000u ? 0x7c00u : (ax < 0x38800000u ? sub : normal);
    const uint32_t e = h >> 10, m = h & 0x3ffu;
    const uint32_t tiny = bits_of((float)m * 5.9604644775390625e-08f);
    const uint32_t v = e == 0 ? tiny : (e == 31 ? 0x7f800000u : ((e + 112u) << 23) | (m << 13));
    return ax > 0x7f800000u ? f : float_of(v | sign);
}

// q4_0 on `count` (<= 8) blocks of 32 at x: first every block's scale (the per-block scalar
// steps, two divisions and the float16 rounding, side by side over the blocks), then the codes.
void blocks_q4_0(const float* __restrict x, int count, Block& o) {
    float top[8], inverse[8], stored[8];
    for (int b = 0; b < 8; ++b) top[b] = x[32 * std::min(b, count - 1) + first_absmax_index(x + 32 * std::min(b, count - 1))];
    for (int b = 0; b < 8; ++b) {
        const float scale = top[b] / -8.0f;
        inverse[b] = scale == 0 ? 0.0f : 1.0f / scale;
        const float half = round_half_select(scale);
        stored[b] = half;
    }
    for (int b = 0; b < count; ++b) {
        o.overflow += !std::isfinite(stored[b]);
        const float* __restrict xb = x + 32 * b;
        float* __restrict y = o.y + 32 * b;
        int8_t* __restrict q = o.q + 32 * b;
        const float inv = inverse[b], held = stored[b];
        for (int j = 0; j < 32; ++j) {
            // |x * inverse| <= 8 (the scale comes from the block's own largest value), so the floor
            // converts exactly and is clipped as an integer (branch-free; the same code and zero).
            int32_t c = (int32_t)std::floor(xb[j] * inv + 8.5f);
            c = (c < 0 ? 0 : (c > 15 ? 15 : c)) - 8;
            y[j] = (float)c * held;
            q[j] = (int8_t)c;
        }
        o.a[b] = held;
    }
}

void block_q8_0(const float* __restrict x, Block& o) {
    uint32_t top = 0;
    for (int j = 0; j < 32; ++j) top = std::max(top, bits_of(x[j]) & 0x7fffffffu);
    const float scale = (float_of(top) + 0.0f) / 127.0f;
    const float inverse = scale == 0 ? 0.0f : 1.0f / scale;
    float stored = round_half(scale);
    o.overflow += !std::isfinite(stored);
    float y[32];
    int8_t q[32];
    for (int j = 0; j < 32; ++j) {  // round half away from zero, exactly as numerics' floor form
        const float v = x[j] * inverse, magnitude = std::fabs(v), whole = std::floor(magnitude);
        const float halves = std::floor((magnitude - whole) * 2.0f);
        int32_t c = (int32_t)(whole + halves);  // <= 128: |x * inverse| <= 127 up to rounding
        c = c > 127 ? 127 : c;
        const int32_t negative = (int32_t)(bits_of(v) >> 31);
        c = (c ^ -negative) + negative;  // the sign of v; a zero code is +0 (numerics adds 0.0)
        y[j] = (float)c * stored;
        q[j] = (int8_t)c;
    }
    std::memcpy(o.y, y, sizeof(y));
    std::memcpy(o.q, q, sizeof(q));
    o.a[0] = stored;
}

// --------------------------------------------------------- q4_1, q5_0, q5_1 (mixle.gguf.ggml_quants)

template <int BITS>
void block_affine(const float* x, Block& o) {
    float mn = 3.4028234663852886e38f, mx = -3.4028234663852886e38f;
    for (int j = 0; j < 32; ++j) {
        mn = x[j] < mn ? x[j] : mn;
        mx = x[j] > mx ? x[j] : mx;
    }
    const int top = (1 << BITS) - 1;
    const float d = (mx - mn) / (float)top;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const float d16 = round_half(d), m16 = round_half(mn);
    o.overflow += !std::isfinite(d16) || !std::isfinite(m16);
    for (int j = 0; j < 32; ++j) {
        int32_t q = c_int((x[j] - mn) * id + 0.5f);
        q = BITS == 4 ? (uint8_t)std::min<int32_t>(top, (int8_t)q) : (q & top);
        const int8_t code = (int8_t)q;
        o.q[j] = code;
        o.y[j] = (float)code * d16 + m16;
    }
    o.a[0] = d16;
    o.b[0] = m16;
}

// q5_0 on `count` (<= 8) blocks of 32, side by side as blocks_q4_0 (ggml keeps the first largest |x|).
void blocks_q5_0(const float* __restrict x, int count, Block& o) {
    float top[8], inverse[8], stored[8];
    for (int b = 0; b < 8; ++b) top[b] = x[32 * std::min(b, count - 1) + first_absmax_index(x + 32 * std::min(b, count - 1))];
    for (int b = 0; b < 8; ++b) {
        const float d = top[b] / -16.0f;
        inverse[b] = d != 0 ? 1.0f / d : 0.0f;
        stored[b] = round_half_select(d);
    }
    for (int b = 0; b < count; ++b) {
        o.overflow += !std::isfinite(stored[b]);
        const float* __restrict xb = x + 32 * b;
        float* __restrict y = o.y + 32 * b;
        int8_t* __restrict q = o.q + 32 * b;
        const float inv = inverse[b], held = stored[b];
        for (int j = 0; j < 32; ++j) {
            // x * inverse + 16.5 lies in [0, 33) (the scale comes from the block's largest |x|), so
            // the truncation and ggml's (int8_t) cast agree and only the top needs the clip.
            const int32_t c = (std::min<int32_t>(31, (int32_t)(xb[j] * inv + 16.5f)) & 0x1f) - 16;
            y[j] = (float)c * held;
            q[j] = (int8_t)c;
        }
        o.a[b] = held;
    }
}

// ggml's MXFP4 (mixle.gguf.ggml_quants.quantize_mxfp4): the E8M0 exponent from the first largest
// |x|, then per value the first kvalue (E2M1 doubled) of smallest |kvalue * d - x|; code = kvalue.
void block_mxfp4(const float* x, Block& o) {
    static const float kvalues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = amax < std::fabs(x[j]) ? std::fabs(x[j]) : amax;
    // log2f as the numpy port computes it: the float64 log2 rounded to float32
    const float lg = (float)std::log2((double)amax);
    const int32_t e = amax > 0 ? (c_int((std::floor(lg) - 2.0f) + 127.0f) & 0xff) : 0;
    const float d = float_of(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);  // 2**(e - 128)
    for (int j = 0; j < 32; ++j) {
        int best = 0;
        float best_err = std::fabs(kvalues[0] * d - x[j]);
        for (int i = 1; i < 16; ++i) {
            const float err = std::fabs(kvalues[i] * d - x[j]);
            if (err < best_err) best = i, best_err = err;
        }
        o.q[j] = (int8_t)kvalues[best];
        o.y[j] = kvalues[best] * d;
    }
    o.a[0] = d;
}

// QLoRA's NF4 (mixle.core.nf4.quantize_nf4) on a block of 64: the code of x * (1 / absmax)
// counts the decision tree's midpoints below it; value = kNf4Table[code] * absmax. Hex literals:
// the float32 values exactly as the numpy port holds them.
const float kNf4Table[16] = {
    -0x1.0000000000000p+0f, -0x1.6473620000000p-1f, -0x1.0cd6600000000p-1f, -0x1.9465400000000p-2f,
    -0x1.23449a0000000p-2f, -0x1.7a6a7e0000000p-3f, -0x1.74f0e20000000p-4f, 0x0.0p+0f, 0x1.45f5fe0000000p-4f,
    0x1.4995c60000000p-3f, 0x1.f809ba0000000p-3f, 0x1.5a06740000000p-2f, 0x1.c349700000000p-2f,
    0x1.200f560000000p-1f, 0x1.7227660000000p-1f, 0x1.0000000000000p+0f};
void block_nf4(const float* x, Block& o) {
    static const float midpoints[15] = {
        -0x1.b239b00000000p-1f, -0x1.38a4e00000000p-1f, -0x1.d709000000000p-2f, -0x1.5bd4ec0000000p-2f,
        -0x1.e079d80000000p-3f, -0x1.1a71780000000p-3f, -0x1.74f0e20000000p-5f, 0x1.45f5fe0000000p-5f,
        0x1.ec90c40000000p-4f, 0x1.a0cfc00000000p-3f, 0x1.2b05a80000000p-2f, 0x1.8ea7f20000000p-2f,
        0x1.00da080000000p-1f, 0x1.491b5e0000000p-1f, 0x1.b913b40000000p-1f};
    float amax = 0.0f;
    for (int j = 0; j < 64; ++j) amax = amax < std::fabs(x[j]) ? std::fabs(x[j]) : amax;
    const float inverse = amax != 0 ? 1.0f / amax : 0.0f;
    for (int j = 0; j < 64; ++j) {
        const float v = x[j] * inverse;
        int32_t code = 0;
        for (int t = 0; t < 15; ++t) code += v > midpoints[t];
        o.q[j] = (int8_t)code;
        o.y[j] = kNf4Table[code] * amax;
    }
    o.a[0] = amax;
}

// ------------------------------------------------------- K-quants (mixle.gguf.ggml_kquants)

constexpr int NL = 32;  // sub-blocks searched at once, one per lane (two vectors: their sums overlap)

// ggml's make_qkx2_quants (no MAD) on NL sub-blocks of N values, transposed: xt[i * NL + s] is
// value i of sub-block s. Writes the scales, the mins (as ggml returns them: -min) and codes L.
template <int N>
void make_qkx2(const float* xt, const float* wt, int nmax, float rmin, float rdelta, int nstep, float* scale,
               float* the_min, int32_t* L) {
    float mn[NL], mx[NL], sum_w[NL], sum_x[NL], span[NL], best[NL], flat_min[NL];
    bool flat[NL];
    for (int s = 0; s < NL; ++s) mn[s] = mx[s] = xt[s], sum_w[s] = wt[s], sum_x[s] = wt[s] * xt[s];
    for (int i = 1; i < N; ++i) {
        for (int s = 0; s < NL; ++s) {
            const float v = xt[i * NL + s], w = wt[i * NL + s];
            mn[s] = v < mn[s] ? v : mn[s];
            mx[s] = v > mx[s] ? v : mx[s];
            sum_w[s] = sum_w[s] + w;
            sum_x[s] = sum_x[s] + w * v;
        }
    }
    for (int s = 0; s < NL; ++s) {
        mn[s] = mn[s] > 0 ? 0.0f : mn[s];
        flat[s] = mx[s] == mn[s];
        flat_min[s] = mn[s];
        const float iscale = (float)nmax / (mx[s] - mn[s]);
        scale[s] = 1.0f / iscale;
        span[s] = iscale;
        best[s] = 0.0f;
    }
    float code_scale[NL], code_min[NL];  // what the best trial's codes were rounded with
    for (int s = 0; s < NL; ++s) code_scale[s] = span[s], code_min[s] = mn[s];
    for (int i = 0; i < N; ++i) {
        for (int s = 0; s < NL; ++s) {
            const float v = xt[i * NL + s];
            const int32_t l = std::min(nmax, std::max(0, nearest_int(span[s] * (v - mn[s]))));
            const float diff = (scale[s] * (float)l + mn[s]) - v;
            best[s] = best[s] + wt[i * NL + s] * (diff * diff);
        }
    }
    int32_t laux[N * NL];
    float sum_l[NL], sum_l2[NL], sum_xl[NL], iscale[NL], this_scale[NL], this_min[NL], err[NL];
    for (int is = 0; is <= nstep; ++is) {
        const float step = (rmin + rdelta * (float)is) + (float)nmax;
        for (int s = 0; s < NL; ++s) {
            iscale[s] = step / (mx[s] - mn[s]);
            sum_l[s] = sum_l2[s] = sum_xl[s] = 0.0f;
        }
        for (int i = 0; i < N; ++i) {
            for (int s = 0; s < NL; ++s) {
                const float v = xt[i * NL + s];
                const int32_t l = std::min(nmax, std::max(0, nearest_int(iscale[s] * (v - mn[s]))));
                laux[i * NL + s] = l;
                const float wl = wt[i * NL + s] * (float)l;
                sum_l[s] = sum_l[s] + wl;
                sum_l2[s] = sum_l2[s] + wl * (float)l;
                sum_xl[s] = sum_xl[s] + wl * v;
            }
        }
        for (int s = 0; s < NL; ++s) {
            const float D = sum_w[s] * sum_l2[s] - sum_l[s] * sum_l[s];
            float sc = (sum_w[s] * sum_xl[s] - sum_x[s] * sum_l[s]) / D;
            float m = (sum_l2[s] * sum_x[s] - sum_l[s] * sum_xl[s]) / D;
            const bool positive = m > 0;
            m = positive ? 0.0f : m;
            sc = positive ? sum_xl[s] / sum_l2[s] : sc;
            this_scale[s] = sc;
            this_min[s] = m;
            err[s] = D > 0 ? 0.0f : NAN;  // D <= 0: the trial is skipped (a NaN error never wins)
        }
        for (int i = 0; i < N; ++i) {
            for (int s = 0; s < NL; ++s) {
                const float diff = (this_scale[s] * (float)laux[i * NL + s] + this_min[s]) - xt[i * NL + s];
                err[s] = err[s] + wt[i * NL + s] * (diff * diff);
            }
        }
        for (int s = 0; s < NL; ++s) {
            const bool take = err[s] < best[s];
            best[s] = take ? err[s] : best[s];
            scale[s] = take ? this_scale[s] : scale[s];
            code_scale[s] = take ? iscale[s] : code_scale[s];
            code_min[s] = take ? mn[s] : code_min[s];
            mn[s] = take ? this_min[s] : mn[s];
        }
    }
    for (int i = 0; i < N; ++i)  // the best trial's codes, rounded again as that trial rounded them
        for (int s = 0; s < NL; ++s)
            L[i * NL + s] = std::min(nmax, std::max(0, nearest_int(code_scale[s] * (xt[i * NL + s] - code_min[s]))));
    for (int s = 0; s < NL; ++s) {
        the_min[s] = -(flat[s] ? flat_min[s] : mn[s]);
        scale[s] = flat[s] ? 0.0f : scale[s];
        if (flat[s])
            for (int i = 0; i < N; ++i) L[i * NL + s] = 0;
    }
}

// ggml's make_qx_quants, rmse_type 1, on NL sub-blocks of N values (transposed): weights x * x, or
// wt (transposed like xt) where given (the importance-weighted search). Writes the scales and codes
// L + nmax.
template <int N>
void make_qx_rmse1(const float* xt, int nmax, float* scale, int32_t* L, const float* wt = nullptr) {
    float amax[NL], vmax[NL], best[NL], sumlx[NL], suml2[NL], iscale[NL], code_scale[NL];
    for (int s = 0; s < NL; ++s) amax[s] = vmax[s] = 0.0f;
    for (int i = 0; i < N; ++i) {
        for (int s = 0; s < NL; ++s) {
            const float v = xt[i * NL + s];
            const bool larger = amax[s] < std::fabs(v);
            amax[s] = larger ? std::fabs(v) : amax[s];
            vmax[s] = larger ? v : vmax[s];
        }
    }
    const int32_t lo = -nmax, hi = nmax - 1;
    for (int t = 0; t < 19; ++t) {
        const int is = t == 0 ? 0 : (t <= 9 ? t - 10 : t - 9);  // 0, then -9..-1, 1..9
        const float offset = 0.1f * (float)is;
        for (int s = 0; s < NL; ++s) {
            iscale[s] = t == 0 ? (float)(-nmax) / vmax[s] : -((float)nmax + offset) / vmax[s];
            sumlx[s] = suml2[s] = 0.0f;
        }
        for (int i = 0; i < N; ++i) {
            for (int s = 0; s < NL; ++s) {
                const float v = xt[i * NL + s];
                int32_t l = nearest_int(iscale[s] * v);
                l = l < lo ? lo : (l > hi ? hi : l);
                const float w = wt ? wt[i * NL + s] : v * v, lf = (float)l;
                sumlx[s] = sumlx[s] + (w * v) * lf;
                suml2[s] = suml2[s] + (w * lf) * lf;
            }
        }
        if (t == 0) {
            for (int s = 0; s < NL; ++s) {
                scale[s] = suml2[s] != 0 ? sumlx[s] / suml2[s] : 0.0f;
                best[s] = scale[s] * sumlx[s];
                code_scale[s] = iscale[s];
            }
            continue;
        }
        for (int s = 0; s < NL; ++s) {
            const bool take = suml2[s] > 0 && sumlx[s] * sumlx[s] > best[s] * suml2[s];
            scale[s] = take ? sumlx[s] / suml2[s] : scale[s];
            best[s] = take ? scale[s] * sumlx[s] : best[s];
            code_scale[s] = take ? iscale[s] : code_scale[s];
        }
    }
    for (int s = 0; s < NL; ++s) {
        const bool zero = amax[s] < 1e-15f;
        scale[s] = zero ? 0.0f : scale[s];
        for (int i = 0; i < N; ++i) {  // the best trial's codes, rounded again as that trial rounded them
            int32_t l = nearest_int(code_scale[s] * xt[i * NL + s]);
            l = l < lo ? lo : (l > hi ? hi : l);
            L[i * NL + s] = (zero ? -nmax : l) + nmax;
        }
    }
}

// Lanes hold `lanes` sub-blocks of N values from x (the rest repeat the last one; discarded).
template <int N>
void transpose_in(const float* x, int lanes, float* xt) {
    for (int s = 0; s < NL; ++s) {
        const float* sub = x + std::min(s, lanes - 1) * N;
        for (int i = 0; i < N; ++i) xt[i * NL + s] = sub[i];
    }
}

// The K-quants' last step: super-block sb's codes requantized under d * ls and dmin * lm (a sub-block
// whose scale is zero keeps the search's codes L), its values, multipliers and offsets.
template <int NMAX>
void k_requantize(const float* x, int sb, float d, float dmin, const int32_t* ls, const int32_t* lm,
                  const int32_t* L, Block& o) {
    o.overflow += !std::isfinite(d) || !std::isfinite(dmin);
    for (int j = 0; j < 8; ++j) {
        const int s = 8 * sb + j;
        const float sub_d = d * (float)ls[j], sub_m = dmin * (float)lm[j];
        const float* __restrict xs = x + 32 * s;
        float* __restrict y = o.y + 32 * s;
        int8_t* __restrict q = o.q + 32 * s;
        for (int i = 0; i < 32; ++i) {
            int32_t l = L[i * NL + s];
            if (sub_d != 0) l = std::min(NMAX, std::max(0, nearest_int((xs[i] + sub_m) / sub_d)));
            q[i] = (int8_t)l;
            y[i] = sub_d * (float)l - sub_m;
        }
        o.a[s] = sub_d;
        o.b[s] = -sub_m;
    }
}

// q4_k / q5_k on `count` (1 to NL / 8) super-blocks of 256 at x: 8 sub-blocks of 32 each.
template <int NMAX>
void superblocks_qk(const float* x, int count, Block& o) {
    constexpr float rmin = NMAX == 15 ? -1.0f : -0.5f;
    constexpr int nstep = NMAX == 15 ? 20 : 15;
    float xt[32 * NL], wt[32 * NL], scales[NL], mins[NL];
    int32_t L[32 * NL];
    transpose_in<32>(x, count * 8, xt);
    float sum_x2[NL];
    for (int s = 0; s < NL; ++s) sum_x2[s] = 0.0f;
    for (int i = 0; i < 32; ++i)
        for (int s = 0; s < NL; ++s) sum_x2[s] = sum_x2[s] + xt[i * NL + s] * xt[i * NL + s];
    for (int s = 0; s < NL; ++s) sum_x2[s] = std::sqrt(sum_x2[s] / 32.0f);  // av_x
    for (int i = 0; i < 32; ++i)
        for (int s = 0; s < NL; ++s) wt[i * NL + s] = sum_x2[s] + std::fabs(xt[i * NL + s]);
    make_qkx2<32>(xt, wt, NMAX, rmin, 0.1f, nstep, scales, mins, L);
    for (int sb = 0; sb < count; ++sb) {
        float max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 8; ++j) {
            max_scale = scales[8 * sb + j] > max_scale ? scales[8 * sb + j] : max_scale;
            max_min = mins[8 * sb + j] > max_min ? mins[8 * sb + j] : max_min;
        }
        const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
        const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
        int32_t ls[8], lm[8];
        for (int j = 0; j < 8; ++j) {
            ls[j] = std::min(63, nearest_int(inv_scale * scales[8 * sb + j]) & 0xff);
            lm[j] = std::min(63, nearest_int(inv_min * mins[8 * sb + j]) & 0xff);
        }
        k_requantize<NMAX>(x, sb, round_half(max_scale / 63.0f), round_half(max_min / 63.0f), ls, lm, L, o);
    }
}

}  // namespace
