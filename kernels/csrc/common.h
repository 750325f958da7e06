/* What every CPU op of the decode step shares (kernels/cpu_ops.py builds and loads them).
 *
 * Tensors are float32 or bfloat16 ("model dtype", flag bf16); arithmetic is float32, and
 * values are rounded to the model dtype where transformers' eager model rounds them, so a
 * bfloat16 run follows transformers' bfloat16 run and a float32 run computes in float32.
 * This header holds the bfloat16 conversions, a vectorisable exp, eight-lane helpers (GCC vector
 * extensions: plain AVX2 code with -march=native) and `parallel_chunks`, the one way the ops
 * split work over torch's intra-op threads.
 */
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pdserve {

typedef uint16_t bf16_t;
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline float bf2f(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f2bf(float f) { /* round to nearest even, NaN kept quiet; branch-free, so loops vectorise */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t quiet = (u >> 16) | 0x40, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float rnd(float x, int bf16) { return bf16 ? bf2f(f2bf(x)) : x; }

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf2f(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((bf16_t *)p)[i] = f2bf(x);
    else ((float *)p)[i] = x;
}

static inline v8f bcast(float x) { return v8f{x, x, x, x, x, x, x, x}; }

/* eight bfloat16 from p as float32 (exact). With AVX2 one widening load and a shift: GCC's
 * generic vector conversion split it into two 128-bit halves (six instructions, a third of the
 * prefill attention's score loop). */
static inline v8f ld_bf8(const bf16_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    return (v8f)u;
#endif
}

/* eight values of a model-dtype tensor p from element i, as float32 */
static inline __attribute__((always_inline)) v8f ld8(const void *p, int64_t i, const int bf16) {
    if (bf16) return ld_bf8((const bf16_t *)p + i);
    v8f y;
    memcpy(&y, (const float *)p + i, 32);
    return y;
}

/* The sum of an eight-lane vector's lanes, ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)): the one order
 * every eight-lane reduction here takes. */
static inline float hsum8(v8f A) { return ((A[0] + A[4]) + (A[1] + A[5])) + ((A[2] + A[6]) + (A[3] + A[7])); }

/* sum_j a[j] * b[j] with eight partial sums (a plain loop is one serial chain of adds), then the
 * last n % 8 in order. */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    v8f acc = {};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f x, y;
        memcpy(&x, a + j, 32);
        memcpy(&y, b + j, 32);
        acc += x * y;
    }
    float s = hsum8(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* f2bf on eight lanes: the bfloat16 bits of each (nearest even, NaN kept quiet) */
static inline v8u bf_bits8(v8f x) {
    v8u u;
    memcpy(&u, &x, 32);
    const v8u quiet = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    return (quiet & nan) | (rounded & ~nan);
}

/* rnd(x, 1) on eight lanes */
static inline v8f rnd8(v8f x) {
    const v8u b = bf_bits8(x) << 16;
    v8f y;
    memcpy(&y, &b, 32);
    return y;
}

/* x rounded to bfloat16 when bf16 (rnd on eight lanes), else x */
static inline __attribute__((always_inline)) v8f rnd8_if(v8f x, const int bf16) { return bf16 ? rnd8(x) : x; }

/* store on eight lanes: p[i .. i+8) = x, rounded to bfloat16 (f2bf's rounding) when bf16 */
static inline __attribute__((always_inline)) void st8(void *p, int64_t i, v8f x, const int bf16) {
    if (bf16) {
        const v8h h = __builtin_convertvector(bf_bits8(x), v8h);
        memcpy((bf16_t *)p + i, &h, 16);
    } else {
        memcpy((float *)p + i, &x, 32);
    }
}

/* exp(x), relative error ~2e-7 (libm's expf: 0.5 ulp): Cody-Waite range reduction and a
 * degree-6 polynomial, branch-free so that loops over it vectorise (a libm call does not). */
static inline float exp_fast(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

static inline float silu(float x) { return x / (1.0f + exp_fast(-x)); }

static inline v8f sel8(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }

/* exp_fast on eight lanes */
static inline v8f exp8(v8f x) {
    const v8f lo = bcast(-87.0f), hi = 1.0f - lo;
    x = sel8(x < lo, lo, x);
    x = sel8(x > hi, hi, x);
    const v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v8f p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

/* y[i] = silu(y[i]) for i < n */
static inline void silu_rows(float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, y + i, 32);
        v = v / (1.0f + exp8(-v));
        memcpy(y + i, &v, 32);
    }
    for (; i < n; i++) y[i] = silu(y[i]);
}

/* x[i] = exp(x[i] - shift) for i < n */
static inline void exp_rows(float *x, int64_t n, float shift) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, 32);
        v = exp8(v - shift);
        memcpy(x + i, &v, 32);
    }
    for (; i < n; i++) x[i] = exp_fast(x[i] - shift);
}

static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The threads a row-parallel op splits `rows` over: torch's intra-op threads, one per row at
 * most, eight at most; one when the op's arithmetic (`flops`, about) is under SPLIT_FLOPS, about
 * 250 us on one core, which a split would not win back once a sleeping thread's wake-up
 * (OMP_WAIT_POLICY=PASSIVE: 15-35 us, more on a crowded machine) and the barrier are paid. */
constexpr int64_t SPLIT_FLOPS = 1 << 21;

static inline int64_t row_threads(int64_t rows, int64_t flops = SPLIT_FLOPS) {
    if (flops < SPLIT_FLOPS) return 1;
    int64_t nt = at::get_num_threads();
    nt = nt < rows ? nt : rows;
    nt = nt < 8 ? nt : 8;
    return nt > 1 ? nt : 1;
}

/* Cores taken by other processes. A thread that another process keeps off its core holds up
 * a parallel region: a chunk it took is not done until it runs again, and OpenMP's barrier at the
 * region's end waits for every thread of the team, even one that took nothing, to be scheduled
 * and arrive. When the caller of a region waited over LATE_NS after its own share was done in
 * two regions of the last 256, the ops run alone on the caller for the next SOLO_NS. */
struct Crowding {
    static constexpr int64_t LATE_NS = 1000000, SOLO_NS = 50000000;
    std::atomic<int64_t> strikes{0}, good{0}, solo_until{0};

    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(
                   std::chrono::steady_clock::now().time_since_epoch())
            .count();
    }
    bool solo() const { return solo_until.load(std::memory_order_relaxed) > now_ns(); }
    void report(int64_t waited_ns) {
        if (waited_ns > LATE_NS) {
            good = 0;
            if (++strikes >= 2) strikes = 0, solo_until = now_ns() + SOLO_NS;
        } else if (strikes > 0 && ++good >= 256) {
            strikes = 0, good = 0;
        }
    }
};
inline Crowding crowding; /* one per process */

static inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* body(tid) on up to nthreads of torch's intra-op threads (at::parallel_for over the threads;
 * tid < nthreads), or once on the caller (tid 0) when nthreads <= 1 or the cores are crowded.
 * The caller reports how long it waited for the others once its own body returned. */
template <typename F>
inline void on_threads(int64_t nthreads, const F &body) {
    const int64_t most = at::get_num_threads();
    if (nthreads > most) nthreads = most;
    if (nthreads <= 1 || crowding.solo()) {
        body(0);
        return;
    }
    const auto caller = std::this_thread::get_id();
    std::atomic<int64_t> caller_done{0};
    at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t tid = t0; tid < t1; tid++) body(tid);
        if (std::this_thread::get_id() == caller) caller_done.store(Crowding::now_ns(), std::memory_order_relaxed);
    });
    const int64_t done = caller_done.load(std::memory_order_relaxed);
    if (done > 0) crowding.report(Crowding::now_ns() - done);
}

/* fn(chunk, tid) once for every chunk 0 <= chunk < n, on up to nthreads of torch's intra-op
 * threads (on_threads), each taking the next chunk as it finishes one: chunks of unequal cost (a
 * prefill row beside decode rows) balance themselves, and a thread that starts late takes fewer.
 * tid < nthreads is the thread's index, for per-thread scratch. */
template <typename F>
inline void parallel_chunks(int64_t n, int64_t nthreads, const F &fn) {
    if (nthreads > n) nthreads = n;
    std::atomic<int64_t> next{0};
    on_threads(nthreads, [&](int64_t tid) {
        for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
             i = next.fetch_add(1, std::memory_order_relaxed))
            fn(i, tid);
    });
}

}  // namespace pdserve
