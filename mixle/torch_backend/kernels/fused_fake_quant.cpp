// Fused CPU fake-quant passes for mixle's torch QAT (built by _fused_cpu.py, called via ctypes).
//
// The numerics are those of mixle/core/numerics.py, operation for operation and in the array's
// own dtype, so results are bit-identical (tests compare against numpy): per block of K
// contiguous elements, threshold = max|x| or the linear-interpolated percentile of |x|
// (lo + (hi - lo) * frac), scale = threshold / divisor (1 where that is 0),
// code = clamp(roundeven(x / scale), code_min, code_max), fake-quantized value = code * scale.
// Built with -ffp-contract=off so that no multiply-add is fused (numpy rounds each step).
//
// A bfloat16 weight (stored as its 16 bits) is read exactly as float32 and its numerics run in
// float32: scales, thresholds and codes are its float32 copy's, the scales and thresholds are
// written as float32. Its fake-quantized value is its float32 copy's, code * scale, rounded once
// to bfloat16 to nearest even as torch casts.
//
// A block whose scale times the grid's largest code overflows the weight's dtype (a bfloat16
// weight: rounds to infinity in bfloat16) is counted, from the scale alone, as numerics'
// check_dequantized_range refuses it; the caller raises.
//
// Why a kernel: with separate torch ops a weight is read and written about five times per
// step; here a block (one row or group, a few KB) is read from memory once and stays in L1
// while its maximum, its codes and its fake-quantized values are computed.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T, typename U>
T from_bits(U u) {
    T value;
    std::memcpy(&value, &u, sizeof(T));
    return value;
}

// float32 -> bfloat16 bits, round to nearest even (torch's cast), NaN -> 0x7fc0.
inline uint16_t to_bf16(float f) {
    const uint32_t u = from_bits<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// How an element type S is read and written: T, the type the numerics run in; U, T's bit
// pattern. mag(x, j): the bit pattern of |x[j]| as a T (sign bit cleared). Reductions over |x|
// run on these patterns: for non-negative IEEE values the integer order is the numeric order and
// every NaN pattern sorts above infinity, so a maximum is NaN if the block holds one (as torch's
// amax gives). Integer reductions vectorise; a float max reduction would not, without fast-math
// flags. limit(): the smallest magnitude (in T) that is infinite once stored as S.
template <typename S> struct Elem {  // float32, float64: their own dtype
    using T = S;
    using U = std::conditional_t<sizeof(S) == 4, uint32_t, uint64_t>;
    static U mag(const S* x, int64_t j) { return from_bits<U>(x[j]) & ~(U(1) << (8 * sizeof(U) - 1)); }
    static T load(const S* x, int64_t j) { return x[j]; }
    static void store(S* y, int64_t j, T v) { y[j] = v; }
    static T limit() { return std::numeric_limits<T>::infinity(); }
};
template <> struct Elem<uint16_t> {  // bfloat16: the upper half of its float32 value
    using T = float;
    using U = uint32_t;
    static U mag(const uint16_t* x, int64_t j) { return (U)(x[j] & 0x7fffu) << 16; }
    static T load(const uint16_t* x, int64_t j) { return from_bits<float>((U)x[j] << 16); }
    static void store(uint16_t* y, int64_t j, T v) { y[j] = to_bf16(v); }
    static T limit() { return from_bits<float>(0x7f7f8000u); }  // bfloat16's largest plus half a step
};

template <typename S>
struct Job {
    using T = typename Elem<S>::T;
    const S* x;            // nblocks * K values
    int64_t nblocks, K;
    int64_t lo, hi;        // percentile ranks (ascending, 0-based); lo < 0: threshold = max|x|
    T frac, divisor, code_min, code_max;
    T largest;             // the largest |code|: a block overflows where largest * scale >= Elem<S>::limit()
    const T* scale_in;     // given scales (rebuild), or null to compute them
    T* scale;              // out: per block (ignored when scale_in is given)
    T* threshold;          // out: per block, or null
    S* deq;                // out: fake-quantized values
    int8_t* codes;         // out: int8 codes, or null
    uint16_t* deq_bf16 = nullptr;  // float32 x only: the values written here in bfloat16 instead of deq
};

template <typename S, typename U>
U max_magnitude_below_serial(const S* __restrict x, int64_t begin, int64_t end, U below) {
    U m = 0;
    for (int64_t j = begin; j < end; ++j) {
        U u = Elem<S>::mag(x, j);
        u &= -U(u < below);  // branch-free, so that the loop vectorises
        m = u > m ? u : m;
    }
    return m;
}

template <typename S, typename U>
int64_t count_magnitude_serial(const S* __restrict x, int64_t begin, int64_t end, U v) {
    int64_t count = 0;
    for (int64_t j = begin; j < end; ++j) count += Elem<S>::mag(x, j) == v;
    return count;
}

// Large blocks (per-tensor scales) are reduced in chunks over all threads; inside the
// per-block parallel loop `threads` is 1 and no parallel region is opened.
constexpr int64_t kChunk = 1 << 14;

// The largest |x| bit pattern below `below` (0 if none).
template <typename S, typename U>
U max_magnitude_below(const S* x, int64_t n, U below, int threads) {
    if (threads <= 1) return max_magnitude_below_serial(x, 0, n, below);
    U m = 0;
#pragma omp parallel for num_threads(threads) reduction(max : m) schedule(static)
    for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c) {
        U part = max_magnitude_below_serial(x, c * kChunk, std::min(n, (c + 1) * kChunk), below);
        m = part > m ? part : m;
    }
    return m;
}

// How many elements have |x| bit pattern v.
template <typename S, typename U>
int64_t count_magnitude(const S* x, int64_t n, U v, int threads) {
    if (threads <= 1) return count_magnitude_serial(x, 0, n, v);
    int64_t count = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : count) schedule(static)
    for (int64_t c = 0; c < (n + kChunk - 1) / kChunk; ++c)
        count += count_magnitude_serial(x, c * kChunk, std::min(n, (c + 1) * kChunk), v);
    return count;
}

// max|x| of a block (NaN if it holds one).
template <typename S>
typename Elem<S>::T abs_max(const S* x, int64_t n, int threads) {
    using U = typename Elem<S>::U;
    return from_bits<typename Elem<S>::T>(max_magnitude_below(x, n, ~U(0), threads));
}

// Ranks lo <= hi of |x| (ascending) when few values lie at or above rank lo (the usual
// clipping percentiles): walk down the distinct values from the largest, `max_bits` (the
// block's maximum, already known), each step one vectorised max pass and, unless the value
// must hold rank lo, one count pass over the block (in L1 for a row or group).
template <typename S, typename T = typename Elem<S>::T>
void top_ranks(const S* x, int64_t n, int64_t lo, int64_t hi, T* v_lo, T* v_hi, int threads,
               typename Elem<S>::U max_bits) {
    using U = typename Elem<S>::U;
    U cur = max_bits;
    int64_t above = 0;  // values counted so far, all larger than cur
    bool have_hi = false;
    for (;;) {
        // cur holds ranks first .. n - above - 1, with first = n - above - count (count >= 1):
        // if lo >= n - above - 1, it holds rank lo (and hi) whatever its count.
        const bool last = lo >= n - above - 1;
        const int64_t count = last ? 1 : count_magnitude(x, n, cur, threads);
        const int64_t first = n - above - count;
        if (!have_hi && hi >= first) {
            *v_hi = from_bits<T>(cur);
            have_hi = true;
        }
        if (lo >= first) {
            *v_lo = from_bits<T>(cur);
            return;
        }
        above += count;
        cur = max_magnitude_below(x, n, cur, threads);
    }
}

// Appends every |x| of x[begin, end) whose bit pattern is at least `cut`; runs of 16 below it
// are skipped after one vectorised test (the usual case, for a cut near the top).
template <typename S, typename T = typename Elem<S>::T>
void collect_at_least(const S* x, int64_t begin, int64_t end, typename Elem<S>::U cut, std::vector<T>& out) {
    using E = Elem<S>;
    constexpr int kRun = 16;
    int64_t j = begin;
    for (; j + kRun <= end; j += kRun) {
        if (cut > 0 && max_magnitude_below_serial(x, j, j + kRun, ~typename E::U(0)) < cut) continue;
        for (int k = 0; k < kRun; ++k)
            if (E::mag(x, j + k) >= cut) out.push_back(std::fabs(E::load(x, j + k)));
    }
    for (; j < end; ++j)
        if (E::mag(x, j) >= cut) out.push_back(std::fabs(E::load(x, j)));
}

// The values of ranks lo and hi (ascending) of |x|, exact.
//
// Few values at or above rank lo: walk down the distinct maxima (top_ranks). Otherwise pick a
// cut from a strided sample so that about twice the needed count of values lie above it,
// collect those (one pass), and select in them; if the sample misjudged and too few pass, the
// cut drops to 0 and every value is a candidate.
template <typename S, typename T = typename Elem<S>::T>
void order_stats(const S* x, int64_t n, int64_t lo, int64_t hi, T* v_lo, T* v_hi, std::vector<T>& scratch,
                 int threads, T max_value) {
    using U = typename Elem<S>::U;
    const int64_t top = n - lo;  // values at or above rank lo
    if (top <= 8) {              // at most `top` distinct values to walk past
        U max_bits;
        std::memcpy(&max_bits, &max_value, sizeof(U));
        top_ranks(x, n, lo, hi, v_lo, v_hi, threads, max_bits);
        return;
    }
    U cut = 0;
    const int64_t stride = std::max<int64_t>(1, n / 8192);
    std::vector<U> sample;
    for (int64_t j = 0; j < n; j += stride) sample.push_back(Elem<S>::mag(x, j));
    const int64_t wanted = 2 * top * (int64_t)sample.size() / n + 16;  // sample values above the cut
    if (wanted < (int64_t)sample.size()) {
        std::nth_element(sample.begin(), sample.end() - wanted, sample.end());
        cut = *(sample.end() - wanted);
    }
    for (;;) {
        scratch.clear();
        if (threads <= 1) {
            collect_at_least(x, 0, n, cut, scratch);
        } else {
            std::vector<std::vector<T>> parts(threads);
            const int64_t share = (n + threads - 1) / threads;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int t = 0; t < threads; ++t)
                collect_at_least(x, std::min(n, t * share), std::min(n, (t + 1) * share), cut, parts[t]);
            for (auto& part : parts) scratch.insert(scratch.end(), part.begin(), part.end());
        }
        if ((int64_t)scratch.size() >= top || cut == 0) break;
        cut = 0;
    }
    // scratch holds every value of rank >= lo (and maybe some below): rank lo is its
    // (size - top)-th smallest.
    const auto first = scratch.begin() + ((int64_t)scratch.size() - top);
    std::nth_element(scratch.begin(), first, scratch.end());
    *v_lo = *first;
    *v_hi = hi == lo ? *v_lo : *std::min_element(first + 1, scratch.end());
}

// K: the block width, or 0 for job.K (a compile-time width lets small groups unroll).
template <typename S, int64_t K = 0, typename T = typename Elem<S>::T>
T block_scale(const Job<S>& job, int64_t b, std::vector<T>& scratch, int64_t& bad, int64_t& over, int threads) {
    const int64_t n = K ? K : job.K;
    const S* x = job.x + b * n;
    if (job.scale_in) return job.scale_in[b];
    T m = abs_max(x, n, threads), t = m;
    if (job.lo >= 0 && m == m) {  // a NaN block fails the caller's finiteness check instead
        T v_lo, v_hi;
        order_stats(x, n, job.lo, job.hi, &v_lo, &v_hi, scratch, threads, m);
        if (job.frac == 0 || job.hi == job.lo) {
            t = v_lo;
        } else {
            T d = v_hi - v_lo;
            T w = d * job.frac;
            t = v_lo + w;
        }
    }
    bad += !std::isfinite(m);
    if (job.threshold) job.threshold[b] = t;
    T s = t / job.divisor;
    s = s == 0 ? T(1) : s;
    T top = std::fabs(s) * job.largest;
    over += !(top < Elem<S>::limit());
    job.scale[b] = s;
    return s;
}

// K: the range's length when known at compile time (a whole block of the usual group sizes: the
// loops then unroll into the caller), or 0 for end - begin.
template <typename S, int64_t K = 0, typename T = typename Elem<S>::T>
__attribute__((always_inline)) inline void quantize_range(const Job<S>& job, int64_t begin, int64_t end, T s) {
    using E = Elem<S>;
    const S* __restrict x = job.x + begin;
    S* __restrict deq = job.deq + begin;
    int8_t* __restrict codes = job.codes ? job.codes + begin : nullptr;
    const int64_t n = K ? K : end - begin;
    const T lo = job.code_min, hi = job.code_max;
    const auto write = [&](auto* __restrict out) {  // out's element decides how a value is stored
        for (int64_t j = 0; j < n; ++j) {
            T q = std::nearbyint(E::load(x, j) / s);
            q = q < lo ? lo : q;
            Elem<std::decay_t<decltype(*out)>>::store(out, j, (q > hi ? hi : q) * s);
        }
    };
    if (job.deq_bf16)  // the float32 value rounded to nearest even, as autocast casts it
        write(job.deq_bf16 + begin);
    else
        write(deq);
    if (codes) {  // a second loop over the same (cached) block keeps both loops vectorised
        for (int64_t j = 0; j < n; ++j) {
            T q = std::nearbyint(E::load(x, j) / s);
            q = q < lo ? lo : q;
            codes[j] = (int8_t)(int32_t)(q > hi ? hi : q);
        }
    }
}

// Calls fn(block, begin, end) over all nblocks * K elements, in chunks split over the threads;
// a chunk may cross block boundaries, so each call covers one block's part of a chunk.
template <typename F>
void for_block_ranges(int64_t nblocks, int64_t K, int threads, F fn) {
    const int64_t total = nblocks * K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < (total + kChunk - 1) / kChunk; ++c) {
        int64_t begin = c * kChunk, end = std::min(total, begin + kChunk);
        while (begin < end) {
            int64_t b = begin / K, stop = std::min(end, (b + 1) * K);
            fn(b, begin, stop);
            begin = stop;
        }
    }
}

// Rows or groups: each thread takes whole blocks, read once while they sit in L1. K: the
// block width, or 0 for job.K.
template <typename S, int64_t K = 0>
int64_t run_blocks(const Job<S>& job, int threads, int64_t& over) {
    using T = typename Elem<S>::T;
    const int64_t n = K ? K : job.K;
    int64_t bad = 0, overflow = 0;
#pragma omp parallel num_threads(threads) reduction(+ : bad, overflow)
    {
        std::vector<T> scratch;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < job.nblocks; ++b) {
            T s = block_scale<S, K>(job, b, scratch, bad, overflow, 1);
            quantize_range<S, K>(job, b * n, b * n + n, s);
        }
    }
    over = overflow;
    return bad;
}

// Returns the number of blocks holding NaN or infinity, and in `over` that of blocks whose values
// would overflow (both 0 when the scales are given).
template <typename S>
int64_t run(const Job<S>& job, int threads, int64_t& over) {
    using T = typename Elem<S>::T;
    const int64_t nb = job.nblocks, K = job.K;
    over = 0;
    if (nb >= threads) {
        switch (K) {  // the usual group sizes, unrolled
            case 16: return run_blocks<S, 16>(job, threads, over);
            case 32: return run_blocks<S, 32>(job, threads, over);
            case 64: return run_blocks<S, 64>(job, threads, over);
            case 128: return run_blocks<S, 128>(job, threads, over);
            default: return run_blocks<S>(job, threads, over);
        }
    }
    int64_t bad = 0;
    // Few large blocks (per-tensor scales): the statistics of each over all threads, then the
    // elementwise pass over all threads.
    std::vector<T> scales(nb);
    std::vector<T> scratch;
    for (int64_t b = 0; b < nb; ++b) scales[b] = block_scale(job, b, scratch, bad, over, threads);
    for_block_ranges(nb, K, threads, [&](int64_t b, int64_t begin, int64_t end) {
        quantize_range(job, begin, end, scales[b]);
    });
    return bad;
}

// out = codes * scale per block (dequantize kept int8 codes, as quantize_range computes the values
// for a weight of S). O: out's element, S's own or, for a float32 weight, bfloat16 (the float32
// value rounded to nearest even: the rebuild of a deq_bf16).
template <typename S, typename O = S, typename T = typename Elem<S>::T>
void dequantize(const int8_t* __restrict codes, const T* scale, int64_t nblocks, int64_t K, O* __restrict out,
                int threads) {
    for_block_ranges(nblocks, K, threads, [&](int64_t b, int64_t begin, int64_t end) {
        const T s = scale[b];
        for (int64_t j = begin; j < end; ++j) Elem<O>::store(out, j, (T)codes[j] * s);
    });
}

// out = grad * (|x| <= threshold) per block: the clip_gradient straight-through estimator
// (out may be grad itself).
template <typename S, typename T = typename Elem<S>::T>
void clip_mask_grad(const S* grad, const S* x, const T* threshold, int64_t nblocks, int64_t K, S* out,
                    int threads) {
    using E = Elem<S>;
    for_block_ranges(nblocks, K, threads, [&](int64_t b, int64_t begin, int64_t end) {
        const T t = threshold[b];
        for (int64_t j = begin; j < end; ++j) E::store(out, j, E::load(grad, j) * (T)(std::fabs(E::load(x, j)) <= t));
    });
}

}  // namespace

// S: the element type of x, deq, grad and out (uint16_t: bfloat16 bits); T: that of the scales
// and thresholds (float32 for bfloat16). fake_quant returns the blocks holding NaN or infinity and
// writes to *overflow the blocks whose largest code times the scale overflows S.
#define MIXLE_EXPORTS(S, T, SUFFIX)                                                                   \
    extern "C" int64_t mixle_fake_quant_##SUFFIX(const S* x, int64_t nblocks, int64_t K, int64_t lo,  \
                                              int64_t hi, double frac, double divisor, double code_min, \
                                              double code_max, const T* scale_in, T* scale,            \
                                              T* threshold, S* deq, int8_t* codes, int64_t* overflow,  \
                                              int threads) {                                           \
        Job<S> job{x, nblocks, K, lo, hi, (T)frac, (T)divisor, (T)code_min, (T)code_max,                \
                   (T)std::max(-code_min, code_max), scale_in, scale, threshold, deq, codes};          \
        return run(job, threads, *overflow);                                                          \
    }                                                                                                 \
    extern "C" void mixle_dequantize_##SUFFIX(const int8_t* codes, const T* scale, int64_t nblocks,   \
                                              int64_t K, S* out, int threads) {                       \
        dequantize<S>(codes, scale, nblocks, K, out, threads);                                        \
    }                                                                                                 \
    extern "C" void mixle_clip_mask_grad_##SUFFIX(const S* grad, const S* x, const T* threshold,      \
                                                  int64_t nblocks, int64_t K, S* out, int threads) {  \
        clip_mask_grad(grad, x, threshold, nblocks, K, out, threads);                                 \
    }

MIXLE_EXPORTS(float, float, f32)
MIXLE_EXPORTS(double, double, f64)
MIXLE_EXPORTS(uint16_t, float, bf16)

// A float32 weight's fake-quantized values written in bfloat16 (the operand of a matmul under bfloat16
// autocast), and their rebuild from codes.
extern "C" int64_t mixle_fake_quant_f32_bf16(const float* x, int64_t nblocks, int64_t K, int64_t lo, int64_t hi,
                                             double frac, double divisor, double code_min, double code_max,
                                             const float* scale_in, float* scale, float* threshold, uint16_t* deq,
                                             int8_t* codes, int64_t* overflow, int threads) {
    Job<float> job{x, nblocks, K, lo, hi, (float)frac, (float)divisor, (float)code_min, (float)code_max,
                   (float)std::max(-code_min, code_max), scale_in, scale, threshold, nullptr, codes, deq};
    return run(job, threads, *overflow);
}
extern "C" void mixle_dequantize_f32_bf16(const int8_t* codes, const float* scale, int64_t nblocks, int64_t K,
                                          uint16_t* out, int threads) {
    dequantize<float>(codes, scale, nblocks, K, out, threads);
}
