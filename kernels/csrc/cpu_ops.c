/* Fused CPU ops of the decode step (kernels/cpu_ops.py builds and loads this file).
 *
 * Tensors are float32 or bfloat16 ("model dtype", flag bf16); arithmetic is float32, and
 * values are rounded to the model dtype where transformers' eager model rounds them, so a
 * bfloat16 run follows transformers' bfloat16 run and a float32 run computes in float32.
 * Shapes are documented at each function; every tensor is contiguous unless a stride is given.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf2f(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f2bf(float f) { /* round to nearest even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

static inline float rnd(float x, int bf16) { return bf16 ? bf2f(f2bf(x)) : x; }

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf2f(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((bf16_t *)p)[i] = f2bf(x);
    else ((float *)p)[i] = x;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One decode token per row through a GDN layer, from its input projection to the gated norm.
 *   proj       [B, ld_proj]  rows [qkv (D) | z (Hv*dv) | b (Hv) | a (Hv)], model dtype
 *   conv_w     [D, Kc]       model dtype;  conv_pool [S, D, Kc-1] model dtype (slot rows)
 *   rec_pool   [S, Hv, dk, dv] float32;   slots [B] int64 slot of each row
 *   neg_A, dt_bias [Hv] float32;  norm_w [dv] model dtype
 *   out        [B, Hv*dv]    model dtype
 *   work       float32 scratch of D + 2*Hv floats
 * D = 2*Hk*dk + Hv*dv; value head h reads key head h / (Hv/Hk).  Rows b0 <= b < b1 only, so
 * callers may split a batch over threads.
 */
void gdn_decode(int64_t b0, int64_t b1, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w,
                float eps, void *out, float *work, int bf16) {
    const int64_t key_dim = Hk * dk, D = 2 * key_dim + Hv * dv, K1 = Kc - 1, grp = Hv / Hk;
    const float q_scale = 1.0f / sqrtf((float)dk);
    float *y = work;           /* [D] conv output, rounded, then q/k normalised in place */
    float *gate = work + D;    /* [Hv] log-decay */
    float *beta = gate + Hv;   /* [Hv] */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = slots[b];
        /* causal conv over the slot's Kc-1 saved inputs and this token, then silu */
        for (int64_t c = 0; c < D; c++) {
            const int64_t st = (s * D + c) * K1;
            float acc = 0.0f;
            for (int64_t j = 0; j < K1; j++) acc += load(conv_w, c * Kc + j, bf16) * load(conv_pool, st + j, bf16);
            const float x = load(proj, b * ld_proj + c, bf16);
            acc += load(conv_w, c * Kc + K1, bf16) * x;
            for (int64_t j = 0; j + 1 < K1; j++) store(conv_pool, st + j, load(conv_pool, st + j + 1, bf16), bf16);
            if (K1 > 0) store(conv_pool, st + K1 - 1, x, bf16);
            y[c] = rnd(silu(rnd(acc, bf16)), bf16);
        }
        /* q, k: L2 norm per head (eps 1e-6), q also scaled by dk^-1/2 */
        for (int64_t h = 0; h < 2 * Hk; h++) {
            float *v = y + h * dk, ss = 0.0f;
            for (int64_t i = 0; i < dk; i++) ss += v[i] * v[i];
            const float inv = 1.0f / sqrtf(ss + 1e-6f), sc = h < Hk ? q_scale : 1.0f;
            for (int64_t i = 0; i < dk; i++) v[i] = v[i] * inv * sc;
        }
        const int64_t zo = b * ld_proj + D, bo = zo + Hv * dv, ao = bo + Hv;
        for (int64_t h = 0; h < Hv; h++) {
            beta[h] = rnd(1.0f / (1.0f + expf(-load(proj, bo + h, bf16))), bf16);
            gate[h] = expf(neg_A[h] * softplus(load(proj, ao + h, bf16) + dt_bias[h]));
        }
        for (int64_t h = 0; h < Hv; h++) {
            const float *q = y + (h / grp) * dk, *k = y + key_dim + (h / grp) * dk, *v = y + 2 * key_dim + h * dv;
            float *S = rec_pool + (s * Hv + h) * dk * dv;
            float kv[dv], o[dv];
            const float a = gate[h];
            for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {
                float *Si = S + i * dv;
                for (int64_t j = 0; j < dv; j++) { Si[j] *= a; kv[j] += Si[j] * k[i]; }
            }
            for (int64_t j = 0; j < dv; j++) { kv[j] = (v[j] - kv[j]) * beta[h]; o[j] = 0.0f; }
            for (int64_t i = 0; i < dk; i++) {
                float *Si = S + i * dv;
                const float ki = k[i], qi = q[i];
                for (int64_t j = 0; j < dv; j++) { Si[j] += ki * kv[j]; o[j] += Si[j] * qi; }
            }
            /* gated RMS norm: rnd(rnd(rnd(o) * rsqrt(mean + eps)) * w) * silu(z) */
            float ss = 0.0f;
            for (int64_t j = 0; j < dv; j++) { o[j] = rnd(o[j], bf16); ss += o[j] * o[j]; }
            const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
            for (int64_t j = 0; j < dv; j++) {
                const float n = rnd(rnd(o[j] * inv, bf16) * load(norm_w, j, bf16), bf16);
                store(out, b * Hv * dv + h * dv + j, n * silu(load(proj, zo + h * dv + j, bf16)), bf16);
            }
        }
    }
}

/* Residual add and RMS norm of rows b0 <= b < b1:  xo[b] = rnd(x[b] + h[b]) (when h is not
 * NULL, else x is normed as it is), y[b] = rnd(xo[b] * rsqrt(mean(xo[b]^2) + eps) * w), with
 * w [H] float32 (the 1 + w of a zero-centred norm). x, h, xo, y [B, H] model dtype. */
void add_rms_norm(int64_t b0, int64_t b1, int64_t H, const void *x, const void *h, void *xo, const float *w,
                  float eps, void *y, float *work, int bf16) {
    for (int64_t b = b0; b < b1; b++) {
        float ss = 0.0f;
        for (int64_t i = 0; i < H; i++) {
            float v = load(x, b * H + i, bf16);
            if (h) {
                v = rnd(v + load(h, b * H + i, bf16), bf16);
                store(xo, b * H + i, v, bf16);
            }
            work[i] = v;
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (int64_t i = 0; i < H; i++) store(y, b * H + i, work[i] * inv * w[i], bf16);
    }
}

/* y [M, N] = x [M, K] @ w [N, K]^T for a bfloat16 weight, in float32 arithmetic, y rounded to
 * the model dtype. For few rows: each weight row is read from memory once for all M rows of x
 * (a decode step is bound by reading the weights: half the bytes of a float32 copy).
 * x is float32 [M, K]; nthreads > 1 splits N over that many threads. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f ld_bf8(const bf16_t *p) {
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    return (v8f)u;
}

struct gemv_job {
    int64_t n0, n1, M, N, K;
    const float *x;
    const bf16_t *w;
    void *y;
    int bf16;
};

static void *gemv_run(void *arg) {
    const struct gemv_job *j = arg;
    const int64_t M = j->M, N = j->N, K = j->K, K8 = K & ~(int64_t)7;
    for (int64_t n = j->n0; n < j->n1; n++) {
        const bf16_t *wr = j->w + n * K;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mb = M - m0 < 4 ? M - m0 : 4;
            v8f acc[4] = {{0}};
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
    return NULL;
}

void gemv_bf16(int64_t M, int64_t N, int64_t K, const float *x, const bf16_t *w, void *y, int bf16,
               int64_t nthreads) {
    if (nthreads > 8) nthreads = 8;
    if (nthreads < 1) nthreads = 1;
    struct gemv_job jobs[8];
    pthread_t tids[8];
    int started[8] = {0};
    for (int64_t t = 0; t < nthreads; t++) {
        jobs[t] = (struct gemv_job){N * t / nthreads, N * (t + 1) / nthreads, M, N, K, x, w, y, bf16};
        if (t > 0) started[t] = pthread_create(&tids[t], NULL, gemv_run, &jobs[t]) == 0;
    }
    gemv_run(&jobs[0]);
    for (int64_t t = 1; t < nthreads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else gemv_run(&jobs[t]);
    }
}

/* ---- Speculative verification: decode rows of several tokens through a GDN layer ----------
 *
 * Row b holds tokens cu[b] <= t < cu[b+1] (the pending token and its drafts; a plain decode
 * row has one). Each token runs through `gdn_decode` in order on the row's slot, which updates
 * the slot's conv and recurrent state in place, so the slot ends in the state after the row's
 * last token. For rollback, the state after every token but the last is copied to the row's
 * scratch entries (the state after the last token is the slot itself):
 *   conv_scratch [B', n1, D, Kc-1] model dtype, rec_scratch [B', n1, Hv, dk, dv] float32,
 *   entry (b, t - cu[b]); n1 >= the longest row. Other arguments as for `gdn_decode`, with
 *   proj and out [T, ...] over the packed tokens and slots [B] one per row.
 */
void gdn_verify(int64_t B, const int64_t *cu, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w, float eps,
                void *out, float *work, int bf16, void *conv_scratch, float *rec_scratch, int64_t n1) {
    const int64_t esz = bf16 ? 2 : 4, D = 2 * Hk * dk + Hv * dv;
    const int64_t conv_n = D * (Kc - 1), rec_n = Hv * dk * dv;
    for (int64_t b = 0; b < B; b++) {
        const int64_t s = slots[b];
        for (int64_t t = cu[b]; t < cu[b + 1]; t++) {
            gdn_decode(0, 1, Hk, Hv, dk, dv, Kc, (const char *)proj + t * ld_proj * esz, ld_proj, conv_w,
                       conv_pool, rec_pool, &s, neg_A, dt_bias, norm_w, eps, (char *)out + t * Hv * dv * esz,
                       work, bf16);
            if (t + 1 < cu[b + 1]) {
                const int64_t e = b * n1 + (t - cu[b]);
                memcpy((char *)conv_scratch + e * conv_n * esz, (const char *)conv_pool + s * conv_n * esz,
                       conv_n * esz);
                memcpy(rec_scratch + e * rec_n, rec_pool + s * rec_n, rec_n * 4);
            }
        }
    }
}
