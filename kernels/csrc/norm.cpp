/* Row-wise ops: the residual add with the RMS norm after it (add_rms_norm, add_rms_norm_mt)
 * and the MLP's gate (silu_mul). PyTorch reference: kernels/norm.py rms_norm, and
 * F.silu(gate) * up (engine/model/layers.py MLP).
 */
#include "common.h"
#include "kernels.h"

namespace pdserve {

/* Residual add and RMS norm of rows b0 <= b < b1:  xo[b] = rnd(x[b] + h[b]) (when h is not
 * nullptr, else x is normed as it is), y[b] = rnd(xo[b] * rsqrt(mean(xo[b]^2) + eps) * w), with
 * w [H] float32 (the 1 + w of a zero-centred norm). x, h, xo, y [B, H] model dtype.
 * A row at a time, eight lanes along it: the sum of squares in lanes i % 8 (hsum8's order, then
 * the last H % 8 elements in order), so every caller (prefill rows, decode steps, the one-call
 * step) gets the same bits for a row whatever rows run beside it. */
static inline __attribute__((always_inline)) void add_rms_norm_rows(int64_t b0, int64_t b1, int64_t H,
                                                                    const void *x, const void *h, void *xo,
                                                                    const float *w, float eps, void *y, const int bf16) {
    const void *src = h ? xo : x; /* the rows' values after the add */
    const int64_t H8 = H - H % 8;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t e0 = b * H;
        v8f acc = {};
        for (int64_t i = 0; i < H8; i += 8) {
            v8f v = ld8(x, e0 + i, bf16);
            if (h) {
                v = rnd8_if(v + ld8(h, e0 + i, bf16), bf16);
                st8(xo, e0 + i, v, bf16);
            }
            acc += v * v;
        }
        float ss = hsum8(acc);
        for (int64_t i = H8; i < H; i++) {
            float v = load(x, e0 + i, bf16);
            if (h) {
                v = rnd(v + load(h, e0 + i, bf16), bf16);
                store(xo, e0 + i, v, bf16);
            }
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        const v8f iv = bcast(inv);
        for (int64_t i = 0; i < H8; i += 8) {
            v8f wv;
            memcpy(&wv, w + i, 32);
            st8(y, e0 + i, ld8(src, e0 + i, bf16) * iv * wv, bf16);
        }
        for (int64_t i = H8; i < H; i++) store(y, e0 + i, load(src, e0 + i, bf16) * inv * w[i], bf16);
    }
}

void add_rms_norm(int64_t b0, int64_t b1, int64_t H, const void *x, const void *h, void *xo, const float *w,
                  float eps, void *y, int bf16) {
    if (bf16) add_rms_norm_rows(b0, b1, H, x, h, xo, w, eps, y, 1);
    else add_rms_norm_rows(b0, b1, H, x, h, xo, w, eps, y, 0);
}

/* ======================================================================================
 * The MLP's gate: out [M, I] = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2I] (rows ld apart),
 * silu(x) = x / (1 + exp(-x)) with exp8; rows shared by up to nthreads threads in blocks of 64.
 * float32 throughout, or bfloat16 in and out with the silu rounded to bfloat16 before the
 * product and the product rounded (where F.silu(gate).mul_(up) rounds). PyTorch reference:
 * F.silu(gate) * up (engine/model/layers.py MLP).
 * ====================================================================================== */

void silu_mul_chunk(const SiluMulJob &job, int64_t chunk) {
    const SiluMulJob *j = &job;
    const int64_t m1 = (chunk + 1) * 64 < j->M ? (chunk + 1) * 64 : j->M;
    for (int64_t m = chunk * 64; m < m1; m++) {
        int64_t i = 0;
        if (j->bf16) {
            const bf16_t *g = (const bf16_t *)j->gu + m * j->ld, *u = g + j->I;
            bf16_t *o = (bf16_t *)j->out + m * j->I;
            for (; i + 8 <= j->I; i += 8) {
                v8f x = ld_bf8(g + i);
                const v8f y = ld_bf8(u + i);
                st8(o, i, rnd8(x / (1.0f + exp8(-x))) * y, 1);
            }
            for (; i < j->I; i++) o[i] = f2bf(rnd(silu(bf2f(g[i])), 1) * bf2f(u[i]));
            continue;
        }
        const float *g = (const float *)j->gu + m * j->ld, *u = g + j->I;
        float *o = (float *)j->out + m * j->I;
        for (; i + 8 <= j->I; i += 8) {
            v8f x, y;
            memcpy(&x, g + i, 32);
            memcpy(&y, u + i, 32);
            x = x / (1.0f + exp8(-x)) * y;
            memcpy(o + i, &x, 32);
        }
        for (; i < j->I; i++) o[i] = silu(g[i]) * u[i];
    }
}

void silu_mul(int64_t M, int64_t I, const void *gu, int64_t ld, void *out, int bf16, int64_t nthreads) {
    const SiluMulJob job = {M, I, ld, gu, out, bf16};
    parallel_chunks(job.chunks(), nthreads, [&](int64_t c, int64_t) { silu_mul_chunk(job, c); });
}

/* ======================================================================================
 * add_rms_norm over many rows (a prefill's tokens): blocks of 64 rows shared by up to nthreads
 * threads; each row's result is add_rms_norm's, whatever the split.
 * ====================================================================================== */

struct norm_job {
    int64_t T, H;
    const void *x, *h;
    void *xo, *y;
    const float *w;
    float eps;
    int bf16;
};

static void norm_run(const norm_job *j, int64_t chunk) {
    const int64_t b1 = (chunk + 1) * 64 < j->T ? (chunk + 1) * 64 : j->T;
    add_rms_norm(chunk * 64, b1, j->H, j->x, j->h, j->xo, j->w, j->eps, j->y, j->bf16);
}

void add_rms_norm_mt(int64_t T, int64_t H, const void *x, const void *h, void *xo, const float *w, float eps,
                     void *y, int bf16, int64_t nthreads) {
    const norm_job job = {T, H, x, h, xo, y, w, eps, bf16};
    parallel_chunks((T + 63) / 64, nthreads, [&](int64_t c, int64_t) { norm_run(&job, c); });
}

}  // namespace pdserve
