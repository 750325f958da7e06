/* The batch-invariant bfloat16 GEMM (engine/model/linear.py `row_invariant`): y [M, N] = x [M, K]
 * @ w^T, x, w and y in bfloat16, each output row the same float32 sum in the same order whatever
 * M is, whatever rows share the call and however the work is split over threads.
 * PyTorch reference: F.linear(x.float(), w.float()).bfloat16() within float32 summation error;
 * the exact bits: the float32 loop in tests/kernels/test_gemm_bf16.py.
 *
 * pack_bf16 stores w [N, K] as panels of 16 output columns in pairs of k: wp [P, K2, 16, 2] with
 * P = ceil(N/16), K2 = ceil(K/2), element (p, j, c, h) = w[16p + c, 2j + h] (zero past N or K):
 * one panel row of a k pair is 64 bytes, the operand of AVX512-BF16's VDPBF16PS.
 *
 * The sum, per output element: acc = 0; for each pair j in order,
 *     acc = fma(x[2j+1], w[2j+1], acc); acc = fma(x[2j], w[2j], acc)
 * each step rounded to float32 (nearest even), denormal inputs and results taken as zero, then
 * acc rounded to bfloat16 (nearest even). That is VDPBF16PS as Intel's SDM defines it (the odd
 * element first, each product exact, one rounding per addition, DAZ and FTZ whatever MXCSR
 * says); on a CPU without the instruction the same steps run as float32 multiply-adds with
 * MXCSR's DAZ and FTZ set, which give the same bits (tests/kernels/test_gemm_bf16.py checks both
 * against the same float32 loop). The instruction is picked at run time (`bf16_dot_supported`).
 *
 * The tiles: up to 12 rows of x against two to eight panels (12 to 24 accumulators), no split of
 * K, so a row's result is the same in every tile shape and every block of rows. Threads take chunks of (a block of rows, a
 * group of panels), as gemm_f32 does.
 */
#include <immintrin.h>

#include <vector>

#include "common.h"
#include "kernels.h"

namespace pdserve {

void pack_bf16(int64_t N, int64_t K, const bf16_t *w, bf16_t *wp) {
    const int64_t K2 = (K + 1) / 2;
    for (int64_t p = 0; p < (N + 15) / 16; p++)
        for (int64_t j = 0; j < K2; j++)
            for (int64_t c = 0; c < 16; c++)
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t n = p * 16 + c, k = 2 * j + h;
                    wp[((p * K2 + j) * 16 + c) * 2 + h] = n < N && k < K ? w[n * K + k] : (bf16_t)0;
                }
}

bool bf16_dot_supported() {
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512bf16");
    return ok;
}

namespace {

constexpr int MR = 12;

using Job = Bf16GemmJob;

/* x's pair j of row r as one 32-bit word: (x[2j], x[2j+1]), the second zero past K */
static inline uint32_t x_pair(const bf16_t *xr, int64_t j, int64_t K) {
    if (2 * j + 1 < K) {
        uint32_t v;
        memcpy(&v, xr + 2 * j, 4);
        return v;
    }
    return xr[2 * j];
}

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* 16 float32 sums to bfloat16 (f2bf's rounding, 16 lanes at once), the first nc stored */
static inline void store16(bf16_t *y, v16f s, int64_t nc) {
    const v16u u = (v16u)s, nan = (u & 0x7fffffffu) > 0x7f800000u;
    const v16u r = (nan & ((u >> 16) | 0x40u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16));
    const v16h h = __builtin_convertvector(r, v16h);
    if (nc == 16) memcpy(y, &h, 32); /* a fixed size: one store, not a call */
    else memcpy(y, &h, nc * 2);
}

/* ---- with VDPBF16PS */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

/* xt [K2][mr]: the tile's rows as pairs of k, row by row for each pair, so that one pointer and
 * constant offsets reach every broadcast (twelve row pointers would spill) */
template <int mr, int np>
static inline __attribute__((always_inline)) void dot_tile(const Job &j, const uint32_t *xt, int64_t p, bf16_t *y) {
    const int64_t K2 = j.K2;
    const bf16_t *pan = j.wp + p * K2 * 32;
    __m512 acc[mr][np];
    for (int r = 0; r < mr; r++)
        for (int q = 0; q < np; q++) acc[r][q] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; k++) {
        __m512bh w[np];
        for (int q = 0; q < np; q++) w[q] = (__m512bh)_mm512_loadu_si512(pan + (q * K2 + k) * 32);
        for (int r = 0; r < mr; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xt[k * mr + r]);
            for (int q = 0; q < np; q++) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xb, w[q]);
        }
    }
    for (int q = 0; q < np; q++) {
        const int64_t n0 = (p + q) * 16, nc = j.N - n0 < 16 ? j.N - n0 : 16;
        for (int r = 0; r < mr; r++) store16(y + r * j.N + n0, (v16f)acc[r][q], nc);
    }
}

/* np panels for a tile of mr rows: at least 12 accumulators where the registers allow (the
 * instruction's latency), at most 24; each divides PSTEP */
static constexpr int panels_for(int mr) { return mr <= 2 ? 8 : mr <= 6 ? 4 : 2; }

template <int mr>
static void dot_tile_panels(const Job &j, const uint32_t *xt, int64_t p0, int64_t p1, bf16_t *y) {
    constexpr int np = panels_for(mr);
    int64_t p = p0;
    for (; p + np <= p1; p += np) dot_tile<mr, np>(j, xt, p, y);
    for (; p < p1; p++) dot_tile<mr, 1>(j, xt, p, y);
}

/* rows a .. a+n of x as pairs of k into xt [K2][n] */
static void pack_rows(const Job &j, int64_t a, int64_t n, uint32_t *xt) {
    for (int64_t r = 0; r < n; r++) {
        const bf16_t *xr = j.x + (a + r) * j.K;
        for (int64_t k = 0; k < j.K / 2; k++) memcpy(xt + k * n + r, xr + 2 * k, 4);
        if (j.K & 1) xt[(j.K2 - 1) * n + r] = xr[j.K - 1]; /* the last pair's second element is zero */
    }
}

/* rows [m0, m1) against panels [p0, p1): the rows in tiles of near-equal size, at most MR each
 * (16 rows: two of 8, not 12 and 4), each packed as pairs (xt); every tile goes through all the
 * panels when they fit in L2 (j.pstep), else the block's tiles are packed first and go through
 * j.pstep panels at a time, so a panel is read from memory once per block of rows */
static void dot_chunk(const Job &j, int64_t m0, int64_t m1, int64_t p0, int64_t p1, uint32_t *xt) {
    const int64_t tiles = (m1 - m0 + MR - 1) / MR, K2 = j.K2;
    const bool one_pass = p1 - p0 <= j.pstep;
    auto first = [&](int64_t t) { return m0 + (m1 - m0) * t / tiles; };
    if (!one_pass)
        for (int64_t t = 0; t < tiles; t++) pack_rows(j, first(t), first(t + 1) - first(t), xt + (first(t) - m0) * K2);
    for (int64_t p = p0; p < p1; p += j.pstep) {
        const int64_t pe = p + j.pstep < p1 ? p + j.pstep : p1;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t a = first(t), n = first(t + 1) - a;
            uint32_t *xt_t = one_pass ? xt : xt + (a - m0) * K2;
            if (one_pass) pack_rows(j, a, n, xt_t);
            bf16_t *y = j.y + a * j.N;
            switch (n) {
#define PDSERVE_TILE(R) \
    case R: dot_tile_panels<R>(j, xt_t, p, pe, y); break;
                PDSERVE_TILE(1) PDSERVE_TILE(2) PDSERVE_TILE(3) PDSERVE_TILE(4) PDSERVE_TILE(5) PDSERVE_TILE(6)
                PDSERVE_TILE(7) PDSERVE_TILE(8) PDSERVE_TILE(9) PDSERVE_TILE(10) PDSERVE_TILE(11)
#undef PDSERVE_TILE
            default: dot_tile_panels<MR>(j, xt_t, p, pe, y); break;
            }
        }
    }
}

#pragma GCC pop_options

/* ---- the same steps as float32 multiply-adds (MXCSR's DAZ and FTZ set by the caller) */

#if defined(__AVX512F__)
constexpr int FR = 6; /* rows per tile: 6 accumulators of 16 lanes */
constexpr int64_t FMA_X_BYTES = 2;
template <int mr>
static inline __attribute__((always_inline)) void fma_tile(const Job &j, const bf16_t *x, int64_t p, bf16_t *y) {
    const int64_t K = j.K, K2 = j.K2;
    const bf16_t *pan = j.wp + p * K2 * 32;
    v16f acc[mr] = {};
    for (int64_t k = 0; k < K2; k++) {
        v16u pr;
        memcpy(&pr, pan + k * 32, 64);
        const v16f lo = (v16f)(pr << 16), hi = (v16f)(pr & 0xffff0000u);
        for (int r = 0; r < mr; r++) {
            const uint32_t v = x_pair(x + r * K, k, K);
            const float xl = bf2f((bf16_t)v), xh = bf2f((bf16_t)(v >> 16));
            acc[r] = acc[r] + xh * hi; /* contracted to one multiply-add (-ffp-contract=fast); the */
            acc[r] = acc[r] + xl * lo; /* product of two bfloat16 is exact, so unfused is the same */
        }
    }
    const int64_t n0 = p * 16, nc = j.N - n0 < 16 ? j.N - n0 : 16;
    for (int r = 0; r < mr; r++) store16(y + r * j.N + n0, acc[r], nc);
}

static void fma_chunk(const Job &j, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
        for (int64_t m = m0; m < m1; m += FR) {
            const bf16_t *x = j.x + m * j.K;
            bf16_t *y = j.y + m * j.N;
            switch (m1 - m < FR ? m1 - m : FR) {
            case 1: fma_tile<1>(j, x, p, y); break;
            case 2: fma_tile<2>(j, x, p, y); break;
            case 3: fma_tile<3>(j, x, p, y); break;
            case 4: fma_tile<4>(j, x, p, y); break;
            case 5: fma_tile<5>(j, x, p, y); break;
            default: fma_tile<FR>(j, x, p, y); break;
            }
        }
}
#else
/* 8-lane registers (AVX2: 16 of them): a panel's 16 columns as two halves, 4 rows a tile, so the
 * 8 accumulators, the panel row's 4 halves and a broadcast stay in registers (16-lane vectors are
 * split by the compiler through the stack). The tile's x comes widened to float32 (xf [K2][mr][2]:
 * each pair's low and high element), so a broadcast is one load. The same steps per element as above. */
constexpr int FR = 4;
constexpr int64_t FMA_X_BYTES = 4;
template <int mr>
static inline __attribute__((always_inline)) void fma_tile(const Job &j, const float *xf, int64_t p, bf16_t *y) {
    const int64_t K2 = j.K2;
    const bf16_t *pan = j.wp + p * K2 * 32;
    v8f acc[mr][2] = {};
    for (int64_t k = 0; k < K2; k++) {
        v8u p0, p1;
        memcpy(&p0, pan + k * 32, 32);
        memcpy(&p1, pan + k * 32 + 16, 32);
        const v8f lo0 = (v8f)(p0 << 16), hi0 = (v8f)(p0 & 0xffff0000u);
        const v8f lo1 = (v8f)(p1 << 16), hi1 = (v8f)(p1 & 0xffff0000u);
        const float *xk = xf + k * mr * 2;
        for (int r = 0; r < mr; r++) {
            const v8f xh = bcast(xk[2 * r + 1]);
            acc[r][0] = acc[r][0] + xh * hi0;
            acc[r][1] = acc[r][1] + xh * hi1;
            const v8f xl = bcast(xk[2 * r]);
            acc[r][0] = acc[r][0] + xl * lo0;
            acc[r][1] = acc[r][1] + xl * lo1;
        }
    }
    const int64_t n0 = p * 16, nc = j.N - n0 < 16 ? j.N - n0 : 16;
    for (int r = 0; r < mr; r++) {
        v16f s;
        memcpy(&s, &acc[r][0], 32);
        memcpy((char *)&s + 32, &acc[r][1], 32);
        store16(y + r * j.N + n0, s, nc);
    }
}

/* rows m .. m + mr of x as xf [K2][mr][2] float32 (fma_tile's layout) */
static inline void widen_rows(const Job &j, const bf16_t *x, int mr, float *xf) {
    for (int64_t k = 0; k < j.K2; k++)
        for (int r = 0; r < mr; r++) {
            const uint32_t v = x_pair(x + r * j.K, k, j.K);
            xf[(k * mr + r) * 2] = bf2f((bf16_t)v), xf[(k * mr + r) * 2 + 1] = bf2f((bf16_t)(v >> 16));
        }
}

static void fma_chunk(const Job &j, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    /* the chunk's rows widened once (tile by tile, fma_tile's layout; gemm_bf16_job sizes the
     * blocks so that they stay in L2), then each panel against every tile while it is in L1 */
    thread_local std::vector<float> xf;
    const int64_t tiles = (m1 - m0 + FR - 1) / FR, tsz = j.K2 * FR * 2;
    if ((int64_t)xf.size() < tiles * tsz) xf.resize(tiles * tsz);
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t m = m0 + t * FR;
        widen_rows(j, j.x + m * j.K, m1 - m < FR ? (int)(m1 - m) : FR, xf.data() + t * tsz);
    }
    for (int64_t p = p0; p < p1; p++)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t m = m0 + t * FR;
            bf16_t *y = j.y + m * j.N;
            const float *xt = xf.data() + t * tsz;
            switch (m1 - m < FR ? m1 - m : FR) {
            case 1: fma_tile<1>(j, xt, p, y); break;
            case 2: fma_tile<2>(j, xt, p, y); break;
            case 3: fma_tile<3>(j, xt, p, y); break;
            default: fma_tile<FR>(j, xt, p, y); break;
            }
        }
}

#endif

/* MXCSR with DAZ (bit 6) and FTZ (bit 15) for the float32 steps, restored after */
struct FlushDenormals {
#if defined(__x86_64__) || defined(__i386__)
    unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040u); }
    ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

}  // namespace

Bf16GemmJob gemm_bf16_job(int64_t M, int64_t N, int64_t K, const bf16_t *x, const bf16_t *wp, bf16_t *y,
                          int64_t nthreads, bool dot) {
    /* blocks of rows whose x stays in L2 (about 384 KiB) while the panels pass, at least four per
     * thread where M allows; fewer blocks are cut into about four panel groups per thread of at
     * least 64K multiply-adds each */
    const int64_t P = (N + 15) / 16, K2 = (K + 1) / 2;
    const int64_t xbytes = dot ? 2 : FMA_X_BYTES; /* the float32 path without 16-lane registers widens x first */
    int64_t mb = K > 0 ? MR * (1 + (384 * 1024 / (K * xbytes)) / MR) : M;
    if (nthreads > 1 && M > 4 * nthreads * MR) { /* enough blocks for the threads: no panel groups, */
        const int64_t even = MR * ((M + 4 * nthreads * MR - 1) / (4 * nthreads * MR)); /* whose x is packed twice */
        mb = even < mb ? even : mb;
    }
    const int64_t blocks = M > 0 ? (M + mb - 1) / mb : 0, rows = M < mb ? M : mb;
    int64_t groups = 1;
    if (nthreads > 1 && blocks > 0 && blocks < 4 * nthreads) { /* no rows: no chunk to cut */
        groups = (4 * nthreads + blocks - 1) / blocks;
        const int64_t most = rows * K * 16 * P / (64 * 1024);
        groups = groups > most ? most : groups;
        groups = groups > (P + 1) / 2 ? (P + 1) / 2 : groups;
        groups = groups < 1 ? 1 : groups;
    }
    const int64_t pstep = 8 * (1 + (256 * 1024 / (K2 * 64 + 1)) / 8); /* about 256 KiB of panels, 8 at least */
    const int64_t per_thread = dot ? (M < mb ? M : mb) * K2 : 0;       /* a block's x as pairs */
    return Bf16GemmJob{M, N, K, K2, mb, groups, P, pstep, per_thread, x, wp, y, dot};
}

void gemm_bf16_chunk(const Bf16GemmJob &j, int64_t c, uint32_t *scratch) {
    const int64_t g = c % j.groups, m0 = c / j.groups * j.mb, m1 = m0 + j.mb < j.M ? m0 + j.mb : j.M;
    /* panel groups start at even panels, so a tile of two panels never straddles groups */
    const int64_t pairs = (j.P + 1) / 2, p0 = 2 * (pairs * g / j.groups), p1 = 2 * (pairs * (g + 1) / j.groups);
    if (j.dot) {
        dot_chunk(j, m0, m1, p0, p1 < j.P ? p1 : j.P, scratch);
    } else {
        FlushDenormals flush;
        fma_chunk(j, m0, m1, p0, p1 < j.P ? p1 : j.P);
    }
}

void gemm_bf16(int64_t M, int64_t N, int64_t K, const bf16_t *x, const bf16_t *wp, bf16_t *y, int64_t nthreads,
               bool dot) {
    if (M <= 0 || N <= 0) return; /* an empty y (a prompt chunk without logits, under MTP) */
    const Bf16GemmJob j = gemm_bf16_job(M, N, K, x, wp, y, nthreads, dot);
    std::vector<uint32_t> scratch((nthreads > 1 ? nthreads : 1) * j.per_thread);
    parallel_chunks(j.chunks(), nthreads,
                    [&](int64_t c, int64_t tid) { gemm_bf16_chunk(j, c, scratch.data() + tid * j.per_thread); });
}

}  // namespace pdserve
