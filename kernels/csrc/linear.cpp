/* Linear layers for the decode step's few rows: a bfloat16 weight read as it is (gemv_bf16)
 * and float32 over a weight packed in panels of 16 output columns (pack_f32, gemm_f32; the
 * bfloat16 GEMM of --batch-invariant is gemm_bf16.cpp).
 * PyTorch reference: F.linear (engine/model/linear.py picks these).
 */
#include "common.h"
#include "kernels.h"

namespace pdserve {

/* y [M, N] = x [M, K] @ w [N, K]^T for a bfloat16 weight, in float32 arithmetic, y rounded to
 * the model dtype. For few rows: each weight row is read from memory once for all M rows of x
 * (a decode step is bound by reading the weights: half the bytes of a float32 copy).
 * x is float32 [M, K]; nthreads > 1 splits N over that many threads. */
struct gemv_job {
    int64_t chunks, M, N, K;
    const float *x;
    const bf16_t *w;
    void *y;
    int bf16;
};

static void gemv_run(const gemv_job *j, int64_t chunk) {
    const int64_t M = j->M, N = j->N, K = j->K, K8 = K & ~(int64_t)7;
    const int64_t n0 = N * chunk / j->chunks, n1 = N * (chunk + 1) / j->chunks;
    for (int64_t n = n0; n < n1; n++) {
        const bf16_t *wr = j->w + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mb = M - m0 < 4 ? M - m0 : 4;
            v8f acc[4] = {};
            for (int64_t k = 0; k < K8; k += 8) {
                const v8f wv = ld_bf8(wr + k);
                for (int64_t i = 0; i < mb; i++) {
                    v8f xv;
                    memcpy(&xv, j->x + (m0 + i) * K + k, 32);
                    acc[i] += wv * xv;
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                float s = 0.0f;
                for (int t = 0; t < 8; t++) s += acc[i][t];
                for (int64_t k = K8; k < K; k++) s += bf2f(wr[k]) * j->x[(m0 + i) * K + k];
                store(j->y, (m0 + i) * N + n, s, j->bf16);
            }
        }
    }
}

void gemv_bf16(int64_t M, int64_t N, int64_t K, const float *x, const bf16_t *w, void *y, int bf16,
               int64_t nthreads) {
    /* chunks of >= 64 weight rows, about four per thread */
    int64_t chunks = nthreads > 1 ? 4 * nthreads : 1;
    if (chunks > N / 64) chunks = N / 64 > 0 ? N / 64 : 1;
    const gemv_job job = {chunks, M, N, K, x, w, y, bf16};
    parallel_chunks(chunks, nthreads, [&](int64_t c, int64_t) { gemv_run(&job, c); });
}

/* ======================================================================================
 * Float32 GEMM for few rows over a packed weight: y [M, N] = x [M, K] @ w^T.
 *
 * pack_f32 stores w [N, K] as panels of 16 output columns, each K x 16 contiguous (the last
 * panel zero-padded): wp [ceil(N/16), K, 16]. gemm_f32 walks the panels (split over threads),
 * and for each panel runs tiles of up to 6 rows of x against it: 12 ymm accumulators, a panel
 * row of 2 vectors and one broadcast, all in registers, while the panel stays in L1 (with
 * AVX-512, tiles of up to 12 rows: 12 zmm accumulators, a panel row of one).
 * ====================================================================================== */

void pack_f32(int64_t N, int64_t K, const float *w, float *wp) {
    for (int64_t p = 0; p < (N + 15) / 16; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = p * 16 + c;
                wp[(p * K + k) * 16 + c] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* A panel row of 16 weights */
static inline void ld_panel8(const float *p, v8f &w0, v8f &w1) {
    memcpy(&w0, p, 32);
    memcpy(&w1, p + 8, 32);
}

template <typename W>
static inline __attribute__((always_inline)) void gemm_tile(int64_t K, const float *x, int64_t ldx, const W *panel,
                                                            float *y, int64_t ldy, int64_t nc, const int mr) {
    v8f acc0[6] = {}, acc1[6] = {};
    for (int64_t k = 0; k < K; k++) {
        v8f w0, w1;
        ld_panel8(panel + k * 16, w0, w1);
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            const v8f xb = bcast(xv);
            acc0[r] += xb * w0;
            acc1[r] += xb * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        if (nc == 16) {
            memcpy(y + r * ldy, &acc0[r], 32);
            memcpy(y + r * ldy + 8, &acc1[r], 32);
        } else {
            float tmp[16];
            memcpy(tmp, &acc0[r], 32);
            memcpy(tmp + 8, &acc1[r], 32);
            memcpy(y + r * ldy, tmp, nc * 4);
        }
    }
}

#if defined(__AVX512F__)
/* With 512-bit vectors a panel row is one register: tiles of up to 12 rows (12 accumulators),
 * twice the rows and the same loads per k as the 256-bit tile above. */
typedef float v16f __attribute__((vector_size(64)));
constexpr int64_t MR = 12;

static inline v16f ld_panel16(const float *p) {
    v16f w;
    memcpy(&w, p, 64);
    return w;
}
template <int mr, typename W>
static inline __attribute__((always_inline)) void gemm_tile16(int64_t K, const float *x, int64_t ldx, const W *panel,
                                                              float *y, int64_t ldy, int64_t nc) {
    v16f acc[mr] = {};
    for (int64_t k = 0; k < K; k++) {
        const v16f w = ld_panel16(panel + k * 16);
        for (int r = 0; r < mr; r++) acc[r] += x[r * ldx + k] * w;
    }
    for (int r = 0; r < mr; r++) {
        if (nc == 16) {
            memcpy(y + r * ldy, &acc[r], 64);
        } else {
            float tmp[16];
            memcpy(tmp, &acc[r], 64);
            memcpy(y + r * ldy, tmp, nc * 4);
        }
    }
}

template <typename W>
static void run_tile(int64_t rows, int64_t K, const float *x, const W *panel, float *y, int64_t N, int64_t nc) {
    switch (rows) {
#define PDSERVE_TILE(R) \
    case R: gemm_tile16<R>(K, x, K, panel, y, N, nc); break;
        PDSERVE_TILE(1) PDSERVE_TILE(2) PDSERVE_TILE(3) PDSERVE_TILE(4) PDSERVE_TILE(5) PDSERVE_TILE(6)
        PDSERVE_TILE(7) PDSERVE_TILE(8) PDSERVE_TILE(9) PDSERVE_TILE(10) PDSERVE_TILE(11)
#undef PDSERVE_TILE
    default: gemm_tile16<12>(K, x, K, panel, y, N, nc); break;
    }
}
#else
constexpr int64_t MR = 6;

template <typename W>
static void run_tile(int64_t rows, int64_t K, const float *x, const W *panel, float *y, int64_t N, int64_t nc) {
    switch (rows) {
    case 1: gemm_tile(K, x, K, panel, y, N, nc, 1); break;
    case 2: gemm_tile(K, x, K, panel, y, N, nc, 2); break;
    case 3: gemm_tile(K, x, K, panel, y, N, nc, 3); break;
    case 4: gemm_tile(K, x, K, panel, y, N, nc, 4); break;
    case 5: gemm_tile(K, x, K, panel, y, N, nc, 5); break;
    default: gemm_tile(K, x, K, panel, y, N, nc, 6); break;
    }
}
#endif

/* chunk = (block of mb rows, group of panels) */
void gemm_chunk(const GemmJob &job, int64_t chunk) {
    const GemmJob *j = &job;
    const int64_t M = j->M, N = j->N, K = j->K, mb = j->mb, g = chunk % j->groups;
    const int64_t m1 = chunk / j->groups * mb, p0 = j->P * g / j->groups, p1 = j->P * (g + 1) / j->groups;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t n0 = p * 16, nc = N - n0 < 16 ? N - n0 : 16, m2 = m1 + mb < M ? m1 + mb : M;
        for (int64_t m0 = m1; m0 < m2; m0 += MR) {
            const int64_t rows = m2 - m0 < MR ? m2 - m0 : MR;
            run_tile(rows, K, j->x + m0 * K, j->wp + p * K * 16, j->y + m0 * N + n0, N, nc);
        }
    }
}

/* y [M, N] = x [M, K] @ w^T for wp = pack_f32(w); x, y float32 contiguous; shared by up to
 * nthreads threads in chunks of a row block (small enough to stay in L2 while every
 * panel passes over it) and a group of panels: many row blocks go whole, few are cut into
 * about four panel groups per thread of at least 64K multiply-adds each. */
GemmJob gemm_job(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, float *y, int64_t nthreads) {
    const int64_t P = (N + 15) / 16, mb = K > 0 ? MR * (1 + (96 * 1024 / (K * 4)) / MR) : M;
    const int64_t blocks = M > 0 ? (M + mb - 1) / mb : 0, rows = M < mb ? M : mb;
    int64_t groups = 1;
    if (nthreads > 1 && blocks > 0 && blocks < 4 * nthreads) { /* no rows: no chunk to cut */
        groups = (4 * nthreads + blocks - 1) / blocks;
        const int64_t most = rows * K * 16 * P / (64 * 1024);
        if (groups > most) groups = most;
        if (groups > P) groups = P;
        if (groups < 1) groups = 1;
    }
    return GemmJob{M, N, K, mb, groups, P, x, wp, y};
}

void gemm_f32(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, float *y, int64_t nthreads) {
    if (M <= 0 || N <= 0) return; /* an empty y (a prompt chunk without logits, under MTP) */
    const GemmJob job = gemm_job(M, N, K, x, wp, y, nthreads);
    parallel_chunks(job.chunks(), nthreads, [&](int64_t c, int64_t) { gemm_chunk(job, c); });
}

}  // namespace pdserve
