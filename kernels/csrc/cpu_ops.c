/* Fused CPU ops of the decode step (kernels/cpu_ops.py builds and loads this file).
 *
 * Tensors are float32 or bfloat16 ("model dtype", flag bf16); arithmetic is float32, and
 * values are rounded to the model dtype where transformers' eager model rounds them, so a
 * bfloat16 run follows transformers' bfloat16 run and a float32 run computes in float32.
 * Shapes are documented at each function; every tensor is contiguous unless a stride is given.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

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

/* exp_fast on eight lanes (GCC vector extensions; plain AVX2 code with -march=native) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f sel8(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }

static inline v8f exp8(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f}, hi = 1.0f - lo;
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

/* ======================================================================================
 * Thread pool: persistent workers that share one job's chunks.
 *
 * pool_run(fn, ctx, n, nthreads) calls fn(ctx, i, tid) once for every chunk 0 <= i < n, on
 * the calling thread (tid 0) and up to nthreads - 1 pool workers (tid 1..), each taking the
 * next chunk as it finishes one. The caller never waits for a worker to start: on a machine
 * whose cores are busy with other processes a worker that is not scheduled simply takes no
 * chunk and the caller does them all, where a static split (one slice per thread) would wait
 * for the slowest thread's time slice. Workers are created on first use and kept; after a job
 * they poll for the next one for a short while, then sleep on a condition variable. A call
 * while another thread's job is running (two engines in one process) runs its chunks alone.
 * tid < nthreads indexes per-thread scratch.
 * A worker descheduled in the middle of a chunk still makes the caller wait for that chunk;
 * when that happens twice (each wait over POOL_LATE_NS) within a few hundred calls, the cores
 * are taken by other processes, and the next POOL_SOLO calls run on the caller alone.
 * ====================================================================================== */

#define POOL_MAX 8
#define POOL_SPIN_NS 40000   /* a worker polls this long for the next job before sleeping */
#define POOL_LATE_NS 1000000 /* a wait for a worker's chunk this long counts as a strike */
#define POOL_SOLO 2048       /* calls run alone after two strikes */

typedef void (*chunk_fn)(void *ctx, int64_t chunk, int64_t tid);

static struct {
    pthread_mutex_t mu, run;
    pthread_cond_t work;
    chunk_fn fn;
    void *ctx;
    int64_t n, next, active, started;
    int64_t strikes, good, solo; /* caller thread only (under run) */
    int64_t done; /* chunks finished: written under mu, polled by the caller without it */
    volatile int64_t seq; /* bumped per job: what a polling worker watches */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .run = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER};
static int pool_atfork; /* the fork handler is registered (once per process image) */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_worker(void *arg) {
    const int64_t tid = (int64_t)(intptr_t)arg;
    int64_t seen = -1;
    for (;;) {
        /* poll for a new job a little while: the decode step calls ops back to back */
        const int64_t t0 = now_ns();
        while (__atomic_load_n(&P.seq, __ATOMIC_ACQUIRE) == seen && now_ns() - t0 < POOL_SPIN_NS)
            __builtin_ia32_pause();
        pthread_mutex_lock(&P.mu);
        while (!(P.next < P.n && tid < P.active) && P.seq == seen) pthread_cond_wait(&P.work, &P.mu);
        seen = P.seq;
        while (P.next < P.n && tid < P.active) {
            const int64_t i = P.next++;
            const chunk_fn fn = P.fn;
            void *ctx = P.ctx;
            pthread_mutex_unlock(&P.mu);
            fn(ctx, i, tid);
            pthread_mutex_lock(&P.mu);
            __atomic_store_n(&P.done, P.done + 1, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&P.mu);
    }
    return NULL;
}

static void pool_child(void) { /* after fork: the child has none of the parent's workers */
    pthread_mutex_init(&P.mu, NULL);
    pthread_mutex_init(&P.run, NULL);
    pthread_cond_init(&P.work, NULL);
    P.n = P.next = P.done = P.started = 0;
    P.strikes = P.good = P.solo = 0;
}

static void pool_run(chunk_fn fn, void *ctx, int64_t n, int64_t nthreads) {
    if (nthreads > POOL_MAX) nthreads = POOL_MAX;
    if (nthreads > n) nthreads = n;
    if (nthreads <= 1 || pthread_mutex_trylock(&P.run) != 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    if (P.solo > 0) {
        P.solo--;
        pthread_mutex_unlock(&P.run);
        for (int64_t i = 0; i < n; i++) fn(ctx, i, 0);
        return;
    }
    if (!pool_atfork) pool_atfork = pthread_atfork(NULL, NULL, pool_child) == 0;
    while (P.started < nthreads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&t, &attr, pool_worker, (void *)(intptr_t)(P.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        P.started++;
    }
    if (nthreads > P.started + 1) nthreads = P.started + 1;
    pthread_mutex_lock(&P.mu);
    P.fn = fn, P.ctx = ctx, P.n = n, P.next = 0, P.done = 0, P.active = nthreads;
    __atomic_store_n(&P.seq, P.seq + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&P.work);
    while (P.next < P.n) {
        const int64_t i = P.next++;
        pthread_mutex_unlock(&P.mu);
        fn(ctx, i, 0);
        pthread_mutex_lock(&P.mu);
        __atomic_store_n(&P.done, P.done + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&P.mu);
    const int64_t t_wait = now_ns();
    /* the chunks still running on workers are short: poll for them rather than sleep, which
     * would give the core away and wait to be scheduled again */
    for (int64_t spins = 0; __atomic_load_n(&P.done, __ATOMIC_ACQUIRE) < n; spins++) {
        if (spins < 4096) __builtin_ia32_pause();
        else sched_yield();
    }
    if (now_ns() - t_wait > POOL_LATE_NS) {
        P.good = 0;
        if (++P.strikes >= 2) P.strikes = 0, P.solo = POOL_SOLO;
    } else if (P.strikes > 0 && ++P.good >= 256) {
        P.strikes = 0, P.good = 0;
    }
    pthread_mutex_unlock(&P.run);
}

/* One decode token per row through a GDN layer, from its input projection to the gated norm.
 *   proj       [B, ld_proj]  rows [qkv (D) | z (Hv*dv) | b (Hv) | a (Hv)], model dtype
 *   conv_w     [D, Kc]       model dtype;  conv_pool [S, D, Kc-1] model dtype (slot rows)
 *   rec_pool   [S, Hv, dk, dv] float32;   slots [B] int64 slot of each row
 *   neg_A, dt_bias [Hv] float32;  norm_w [dv] model dtype
 *   out        [B, Hv*dv]    model dtype
 *   work       float32 scratch of D + 2*Hv floats
 * D = 2*Hk*dk + Hv*dv; value head h reads key head h / (Hv/Hk).  Rows b0 <= b < b1 only, so
 * callers may split a batch over threads. K1c > 0 is Kc - 1 as a constant (the conv's shift
 * unrolled); conv_done: the caller has put the conv output (before silu) in work[0..D) and
 * updated the conv state itself (gdn_rows, a whole row's conv at once).
 */
/* One value head's delta-rule step on its state S [dk, dv] for dv = 8 * nv (32 or 64), the
 * loops of gdn_decode_rows below with the [dv] accumulators in registers (in memory, each
 * state row's multiply-add waits for the previous row's store): the same operations in the
 * same order, so the same result to the bit. o [dv] receives S^T q. */
static inline __attribute__((always_inline)) void gdn_head(float *S, int64_t dk, const float *q, const float *k,
                                                           const float *v, float a, float beta, float *o,
                                                           const int nv) {
    v8f acc[8] = {{0}}, d[8];
    const v8f av = {a, a, a, a, a, a, a, a};
    for (int64_t i = 0; i < dk; i++) { /* decay, and S^T k */
        float *Si = S + i * 8 * nv;
        const float ki = k[i];
        const v8f kb = {ki, ki, ki, ki, ki, ki, ki, ki};
        for (int r = 0; r < nv; r++) {
            v8f x;
            memcpy(&x, Si + 8 * r, 32);
            x *= av;
            memcpy(Si + 8 * r, &x, 32);
            acc[r] += x * kb;
        }
    }
    const v8f bv = {beta, beta, beta, beta, beta, beta, beta, beta};
    for (int r = 0; r < nv; r++) {
        v8f x;
        memcpy(&x, v + 8 * r, 32);
        d[r] = (x - acc[r]) * bv;
        acc[r] = (v8f){0};
    }
    for (int64_t i = 0; i < dk; i++) { /* the rank-one write, and S^T q */
        float *Si = S + i * 8 * nv;
        const float ki = k[i], qi = q[i];
        const v8f kb = {ki, ki, ki, ki, ki, ki, ki, ki}, qb = {qi, qi, qi, qi, qi, qi, qi, qi};
        for (int r = 0; r < nv; r++) {
            v8f x;
            memcpy(&x, Si + 8 * r, 32);
            x += kb * d[r];
            memcpy(Si + 8 * r, &x, 32);
            acc[r] += x * qb;
        }
    }
    memcpy(o, acc, nv * 32);
}

static inline __attribute__((always_inline)) void
gdn_decode_rows(int64_t b0, int64_t b1, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w,
                float eps, void *out, float *work, const int bf16, const int64_t K1c, const int conv_done) {
    const int64_t key_dim = Hk * dk, D = 2 * key_dim + Hv * dv, K1 = K1c > 0 ? K1c : Kc - 1, grp = Hv / Hk;
    const float q_scale = 1.0f / sqrtf((float)dk);
    float *y = work;           /* [D] conv output, rounded, then q/k normalised in place */
    float *gate = work + D;    /* [Hv] log-decay */
    float *beta = gate + Hv;   /* [Hv] */
    for (int64_t b = b0; b < b1; b++) {
        const int64_t s = slots[b];
        /* causal conv over the slot's Kc-1 saved inputs and this token, then silu */
        for (int64_t c = 0; c < (conv_done ? 0 : D); c++) {
            const int64_t st = (s * D + c) * K1;
            float acc = 0.0f;
            for (int64_t j = 0; j < K1; j++) acc += load(conv_w, c * Kc + j, bf16) * load(conv_pool, st + j, bf16);
            const float x = load(proj, b * ld_proj + c, bf16);
            acc += load(conv_w, c * Kc + K1, bf16) * x;
            for (int64_t j = 0; j + 1 < K1; j++) store(conv_pool, st + j, load(conv_pool, st + j + 1, bf16), bf16);
            if (K1 > 0) store(conv_pool, st + K1 - 1, x, bf16);
            y[c] = rnd(acc, bf16);
        }
        silu_rows(y, D);
        if (bf16)
            for (int64_t c = 0; c < D; c++) y[c] = rnd(y[c], bf16);
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
            if (dv == 32) gdn_head(S, dk, q, k, v, a, beta[h], o, 4);
            else if (dv == 64) gdn_head(S, dk, q, k, v, a, beta[h], o, 8);
            else {
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
            }
            /* gated RMS norm: rnd(rnd(rnd(o) * rsqrt(mean + eps)) * w) * silu(z) */
            float ss = 0.0f;
            for (int64_t j = 0; j < dv; j++) { o[j] = rnd(o[j], bf16); ss += o[j] * o[j]; }
            const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
            float zs[dv];
            for (int64_t j = 0; j < dv; j++) zs[j] = load(proj, zo + h * dv + j, bf16);
            silu_rows(zs, dv);
            for (int64_t j = 0; j < dv; j++) {
                const float n = rnd(rnd(o[j] * inv, bf16) * load(norm_w, j, bf16), bf16);
                store(out, b * Hv * dv + h * dv + j, n * zs[j], bf16);
            }
        }
    }
}

/* The body above with the dtype a constant, so that each dtype's loops compile branch-free. */
void gdn_decode(int64_t b0, int64_t b1, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w,
                float eps, void *out, float *work, int bf16) {
#define GDN_ROWS_ARGS b0, b1, Hk, Hv, dk, dv, Kc, proj, ld_proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias, norm_w, eps, out, work
    if (bf16 && Kc == 4) gdn_decode_rows(GDN_ROWS_ARGS, 1, 3, 0);
    else if (bf16) gdn_decode_rows(GDN_ROWS_ARGS, 1, 0, 0);
    else if (Kc == 4) gdn_decode_rows(GDN_ROWS_ARGS, 0, 3, 0);
    else gdn_decode_rows(GDN_ROWS_ARGS, 0, 0, 0);
}

/* gdn_decode of token b after its conv (work[0..D) holds the conv output, the conv state is
 * the caller's): the rest of the layer. */
static void gdn_after_conv(int64_t b, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, const void *proj,
                           int64_t ld_proj, float *rec_pool, const int64_t *slots, const float *neg_A,
                           const float *dt_bias, const void *norm_w, float eps, void *out, float *work, int bf16) {
    if (bf16)
        gdn_decode_rows(b, b + 1, Hk, Hv, dk, dv, 0, proj, ld_proj, NULL, NULL, rec_pool, slots, neg_A, dt_bias,
                        norm_w, eps, out, work, 1, 1, 1);
    else
        gdn_decode_rows(b, b + 1, Hk, Hv, dk, dv, 0, proj, ld_proj, NULL, NULL, rec_pool, slots, neg_A, dt_bias,
                        norm_w, eps, out, work, 0, 1, 1);
}

/* Residual add and RMS norm of rows b0 <= b < b1:  xo[b] = rnd(x[b] + h[b]) (when h is not
 * NULL, else x is normed as it is), y[b] = rnd(xo[b] * rsqrt(mean(xo[b]^2) + eps) * w), with
 * w [H] float32 (the 1 + w of a zero-centred norm). x, h, xo, y [B, H] model dtype. */
static inline __attribute__((always_inline)) void add_rms_norm_rows(int64_t b0, int64_t b1, int64_t H,
                                                                    const void *x, const void *h, void *xo,
                                                                    const float *w, float eps, void *y, const int bf16) {
    /* eight rows at a time: each row's sum of squares is still one chain in element order (the
     * same rounding as a row alone), and the eight chains run side by side */
    for (int64_t r0 = b0; r0 < b1; r0 += 8) {
        const int64_t nr = b1 - r0 < 8 ? b1 - r0 : 8;
        const void *src = h ? xo : x; /* the rows' values after the add */
        float ss[8] = {0};
        for (int64_t i = 0; i < H; i++)
            for (int64_t r = 0; r < nr; r++) {
                const int64_t e = (r0 + r) * H + i;
                float v = load(x, e, bf16);
                if (h) {
                    v = rnd(v + load(h, e, bf16), bf16);
                    store(xo, e, v, bf16);
                }
                ss[r] += v * v;
            }
        for (int64_t r = 0; r < nr; r++) {
            const float inv = 1.0f / sqrtf(ss[r] / (float)H + eps);
            const int64_t e0 = (r0 + r) * H;
            for (int64_t i = 0; i < H; i++) store(y, e0 + i, load(src, e0 + i, bf16) * inv * w[i], bf16);
        }
    }
}

void add_rms_norm(int64_t b0, int64_t b1, int64_t H, const void *x, const void *h, void *xo, const float *w,
                  float eps, void *y, float *work, int bf16) {
    (void)work;
    if (bf16) add_rms_norm_rows(b0, b1, H, x, h, xo, w, eps, y, 1);
    else add_rms_norm_rows(b0, b1, H, x, h, xo, w, eps, y, 0);
}

/* y [M, N] = x [M, K] @ w [N, K]^T for a bfloat16 weight, in float32 arithmetic, y rounded to
 * the model dtype. For few rows: each weight row is read from memory once for all M rows of x
 * (a decode step is bound by reading the weights: half the bytes of a float32 copy).
 * x is float32 [M, K]; nthreads > 1 splits N over that many threads. */
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline v8f ld_bf8(const bf16_t *p) {
    v8h h;
    memcpy(&h, p, 16);
    v8u u = __builtin_convertvector(h, v8u) << 16;
    return (v8f)u;
}

struct gemv_job {
    int64_t chunks, M, N, K;
    const float *x;
    const bf16_t *w;
    void *y;
    int bf16;
};

static void gemv_run(void *ctx, int64_t chunk, int64_t tid) {
    (void)tid;
    const struct gemv_job *j = ctx;
    const int64_t M = j->M, N = j->N, K = j->K, K8 = K & ~(int64_t)7;
    const int64_t n0 = N * chunk / j->chunks, n1 = N * (chunk + 1) / j->chunks;
    for (int64_t n = n0; n < n1; n++) {
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
}

void gemv_bf16(int64_t M, int64_t N, int64_t K, const float *x, const bf16_t *w, void *y, int bf16,
               int64_t nthreads) {
    /* chunks of >= 64 weight rows, about four per thread */
    int64_t chunks = nthreads > 1 ? 4 * nthreads : 1;
    if (chunks > N / 64) chunks = N / 64 > 0 ? N / 64 : 1;
    struct gemv_job job = {chunks, M, N, K, x, w, y, bf16};
    pool_run(gemv_run, &job, chunks, nthreads);
}

/* ======================================================================================
 * Decode attention and the row-parallel GDN decode (one new token per row).
 *
 * attn_decode runs a gated full-attention layer of a decode-only batch after its qkv
 * projection, in one call: per-head RMS norm of q and k times (1 + w), partial rotary
 * (rotate-half), the new k and v written to their KV page, attention of q over the row's
 * pages, and the sigmoid gate. gdn_decode_mt splits gdn_decode's rows over threads. Both use
 * the helpers and the rounding convention of the top of this file.
 * ====================================================================================== */

/* sum_j a[j] * b[j] with eight partial sums (a plain loop is one serial chain of adds). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    v8f acc = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f x, y;
        memcpy(&x, a + j, 32);
        memcpy(&y, b + j, 32);
        acc += x * y;
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline float dot_bf16(const float *a, const bf16_t *b, int64_t n) {
    v8f acc = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f x;
        memcpy(&x, a + j, 32);
        acc += x * ld_bf8(b + j);
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; j < n; j++) s += a[j] * bf2f(b[j]);
    return s;
}

/* The dots of q with 8 rows of k (row stride ks): out[p] = dot(q, k_p) summed exactly as dot_f32
 * / dot_bf16 sum one (lanes j % 8, then ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7))), but with 8
 * independent chains of multiply-adds and the 8 reductions done together by shuffles. hd % 8 == 0. */
static inline __attribute__((always_inline)) void dot8_rows(const float *q, const void *k, int64_t ks, int64_t hd,
                                                            float *out, const int bf16) {
    v8f A[8] = {{0}};
    for (int64_t j = 0; j < hd; j += 8) {
        v8f x;
        memcpy(&x, q + j, 32);
        for (int p = 0; p < 8; p++) {
            v8f y;
            if (bf16) y = ld_bf8((const bf16_t *)k + p * ks + j);
            else memcpy(&y, (const float *)k + p * ks + j, 32);
            A[p] += x * y;
        }
    }
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8i ev = {0, 2, 4, 6, 8, 10, 12, 14}, od = {1, 3, 5, 7, 9, 11, 13, 15};
    v8f t[4], u[2];
    for (int p = 0; p < 4; p++) /* [a_l + a_(l+4) of row 2p | of row 2p+1] */
        t[p] = __builtin_shuffle(A[2 * p], A[2 * p + 1], lo) + __builtin_shuffle(A[2 * p], A[2 * p + 1], hi);
    for (int p = 0; p < 2; p++) /* [(t0+t1), (t2+t3)] of rows 4p .. 4p+3 */
        u[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], ev) + __builtin_shuffle(t[2 * p], t[2 * p + 1], od);
    const v8f r = __builtin_shuffle(u[0], u[1], ev) + __builtin_shuffle(u[0], u[1], od);
    memcpy(out, &r, 32);
}

struct attn_job {
    int64_t b0, b1, H, KVH, hd, rd, ld, bs, s_blk, s_kv, s_head, s_tok, bt_width, work_stride;
    const void *qkv, *cos, *sin;
    const float *qk_norm;
    void *kv, *out;
    const int64_t *slot_mapping, *block_tables, *seq_lens;
    float eps, scale;
    float *work;
    int bf16;
    const int64_t *seq_starts; /* NULL, or [nseq+1]: a chunk is one sequence of consecutive rows */
};

/* acc[0 .. 8*nv) = sum over positions t < n of p[t] * V[t][0 .. 8*nv): the V rows of a sequence's
 * pages (block table bt) from element offset vp of each page, in position order. */
static inline __attribute__((always_inline)) void attn_pv(const struct attn_job *a, const int64_t *bt, int64_t n,
                                                          int64_t vp, const float *p, float *acc, const int nv,
                                                          const int bf16) {
    v8f R[8] = {{0}};
    for (int64_t t0 = 0; t0 < n; t0 += a->bs) {
        const int64_t m = n - t0 < a->bs ? n - t0 : a->bs;
        const int64_t o0 = bt[t0 / a->bs] * a->s_blk + vp;
        for (int64_t t = 0; t < m; t++) {
            const float pt = p[t0 + t];
            const v8f pb = {pt, pt, pt, pt, pt, pt, pt, pt};
            const int64_t o = o0 + t * a->s_tok;
            for (int r = 0; r < nv; r++) {
                v8f y;
                if (bf16) y = ld_bf8((const bf16_t *)a->kv + o + 8 * r);
                else memcpy(&y, (const float *)a->kv + o + 8 * r, 32);
                R[r] += pb * y;
            }
        }
    }
    memcpy(acc, R, nv * 32);
}

static inline __attribute__((always_inline)) void attn_rows(const struct attn_job *a, const int bf16) {
    const int64_t H = a->H, KVH = a->KVH, hd = a->hd, rd = a->rd, half = rd / 2, nqk = H + KVH, grp = H / KVH;
    float *qk = a->work, *acc = qk + nqk * hd, *sc = acc + grp * hd; /* [nqk, hd], [grp, hd], [grp, seq_len] */
    for (int64_t b = a->b0; b < a->b1; b++) {
        const int64_t row = b * a->ld;
        /* q and k heads: RMS norm times (1 + w), rounded, then rotary on the first rd dims */
        for (int64_t i = 0; i < nqk; i++) {
            float *x = qk + i * hd;
            for (int64_t j = 0; j < hd; j++) x[j] = load(a->qkv, row + i * hd + j, bf16);
            const float ss = dot_f32(x, x, hd);
            const float inv = 1.0f / sqrtf(ss / (float)hd + a->eps);
            for (int64_t j = 0; j < hd; j++) x[j] = rnd(x[j] * inv * a->qk_norm[i * hd + j], bf16);
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                const float c1 = load(a->cos, b * rd + j, bf16), s1 = load(a->sin, b * rd + j, bf16);
                const float c2 = load(a->cos, b * rd + j + half, bf16), s2 = load(a->sin, b * rd + j + half, bf16);
                x[j] = rnd(rnd(x1 * c1, bf16) + rnd(-x2 * s1, bf16), bf16);
                x[j + half] = rnd(rnd(x2 * c2, bf16) + rnd(x1 * s2, bf16), bf16);
            }
        }
        /* the new k and v into the row's page slot */
        const int64_t slot = a->slot_mapping[b], blk = slot / a->bs, off = slot % a->bs;
        const int64_t v_col = row + nqk * hd + H * hd;
        for (int64_t g = 0; g < KVH; g++) {
            const int64_t kp = blk * a->s_blk + g * a->s_head + off * a->s_tok;
            for (int64_t j = 0; j < hd; j++) {
                store(a->kv, kp + j, qk[(H + g) * hd + j], bf16);
                store(a->kv, kp + a->s_kv + j, load(a->qkv, v_col + g * hd + j, bf16), bf16);
            }
        }
        /* per KV head, its query heads together over the row's pages (each K and V row read
         * once for all of them), then the gate */
        const int64_t n = a->seq_lens[b];
        const int64_t *bt = a->block_tables + b * a->bt_width;
        for (int64_t g = 0; g < KVH; g++) {
            float mx[grp], sum[grp];
            for (int64_t i = 0; i < grp; i++) mx[i] = -INFINITY;
            for (int64_t t0 = 0; t0 < n; t0 += a->bs) { /* page by page: no division per position */
                const int64_t m = n - t0 < a->bs ? n - t0 : a->bs;
                const int64_t kp = bt[t0 / a->bs] * a->s_blk + g * a->s_head;
                for (int64_t i = 0; i < grp; i++) {
                    const float *q = qk + (g * grp + i) * hd;
                    float *si = sc + i * n + t0;
                    int64_t t = 0;
                    if (hd % 8 == 0)
                        for (; t + 8 <= m; t += 8)
                            dot8_rows(q, bf16 ? (const void *)((const bf16_t *)a->kv + kp + t * a->s_tok)
                                              : (const void *)((const float *)a->kv + kp + t * a->s_tok),
                                      a->s_tok, hd, si + t, bf16);
                    for (; t < m; t++) {
                        const int64_t p = kp + t * a->s_tok;
                        si[t] = bf16 ? dot_bf16(q, (const bf16_t *)a->kv + p, hd)
                                     : dot_f32(q, (const float *)a->kv + p, hd);
                    }
                    for (t = 0; t < m; t++) {
                        si[t] *= a->scale;
                        mx[i] = si[t] > mx[i] ? si[t] : mx[i];
                    }
                }
            }
            for (int64_t i = 0; i < grp; i++) {
                exp_rows(sc + i * n, n, mx[i]);
                sum[i] = 0.0f;
                for (int64_t t = 0; t < n; t++) sum[i] += sc[i * n + t];
            }
            if (hd % 8 == 0) { /* per query head, up to 8 vectors of hd in registers over all positions */
                for (int64_t i = 0; i < grp; i++)
                    for (int64_t j0 = 0; j0 < hd; j0 += 64) {
                        const int64_t vp = a->s_kv + g * a->s_head + j0;
                        if (hd - j0 >= 64) attn_pv(a, bt, n, vp, sc + i * n, acc + i * hd + j0, 8, bf16);
                        else attn_pv(a, bt, n, vp, sc + i * n, acc + i * hd + j0, (hd - j0) / 8, bf16);
                    }
            } else {
            for (int64_t j = 0; j < grp * hd; j++) acc[j] = 0.0f;
            for (int64_t t0 = 0; t0 < n; t0 += a->bs) {
                const int64_t m = n - t0 < a->bs ? n - t0 : a->bs;
                const int64_t vp = bt[t0 / a->bs] * a->s_blk + a->s_kv + g * a->s_head;
                for (int64_t t = 0; t < m; t++) {
                    const int64_t o = vp + t * a->s_tok;
                    for (int64_t i = 0; i < grp; i++) {
                        const float p = sc[i * n + t0 + t];
                        float *ai = acc + i * hd;
                        if (bf16)
                            for (int64_t j = 0; j < hd; j++) ai[j] += p * bf2f(((const bf16_t *)a->kv)[o + j]);
                        else
                            for (int64_t j = 0; j < hd; j++) ai[j] += p * ((const float *)a->kv)[o + j];
                    }
                }
            }
            }
            for (int64_t i = 0; i < grp; i++) {
                const int64_t h = g * grp + i;
                const float inv = 1.0f / sum[i];
                const int64_t gate = row + nqk * hd + h * hd;
                for (int64_t j = 0; j < hd; j++) {
                    const float o = rnd(acc[i * hd + j] * inv, bf16);
                    const float sg = rnd(1.0f / (1.0f + expf(-load(a->qkv, gate + j, bf16))), bf16);
                    store(a->out, b * H * hd + h * hd + j, o * sg, bf16);
                }
            }
        }
    }
}

static void attn_run(void *ctx, int64_t chunk, int64_t tid) { /* chunk: one row, or one sequence's rows */
    struct attn_job a = *(const struct attn_job *)ctx;
    a.b0 = a.seq_starts ? a.seq_starts[chunk] : chunk, a.b1 = a.seq_starts ? a.seq_starts[chunk + 1] : chunk + 1;
    a.work += tid * a.work_stride;
    if (a.bf16) attn_rows(&a, 1);
    else attn_rows(&a, 0);
}

/* One decode token per row through a gated attention layer, after its qkv projection.
 *   qkv        [B, ld]   rows [q (H*hd) | k (KVH*hd) | gate (H*hd) | v (KVH*hd)], model dtype
 *   qk_norm    [H+KVH, hd] float32: (1 + q_norm) per query head, then (1 + k_norm) per KV head
 *   cos, sin   [B, rd]   model dtype, the rows' rotary tables at their positions
 *   kv         KV pool viewed [num_blocks, 2, KVH, bs, hd] with element strides
 *              (s_blk, s_kv, s_head, s_tok), unit stride on hd; model dtype
 *   slot_mapping [B] flat page slot of the new token; block_tables [B, bt_width]; seq_lens [B]
 *              (the new token included)
 *   out        [B, H*hd] model dtype: attention output times sigmoid(gate)
 *   work       float32 scratch of nthreads * work_stride floats, work_stride >=
 *              (H+KVH)*hd + (H/KVH) * (hd + max seq_len)
 *   seq_starts NULL: every row is a sequence of its own. Else [nseq+1] row boundaries of
 *              sequences whose rows are consecutive positions (a row with drafts, an MTP chunk):
 *              each row has its own seq_len / block-table row / slot, and a sequence's rows run
 *              in order in one chunk, so a row's k and v are in their page before the next row
 *              of its sequence reads them (causal attention within the sequence).
 * Rows (sequences) are shared by up to nthreads (<= 8) threads (pool_run). */
void attn_decode(int64_t B, int64_t H, int64_t KVH, int64_t hd, int64_t rd, const void *qkv, int64_t ld,
                 const float *qk_norm, float eps, const void *cos, const void *sin, void *kv, int64_t s_blk,
                 int64_t s_kv, int64_t s_head, int64_t s_tok, int64_t bs, const int64_t *slot_mapping,
                 const int64_t *block_tables, int64_t bt_width, const int64_t *seq_lens, float scale, void *out,
                 float *work, int64_t work_stride, int bf16, int64_t nthreads, const int64_t *seq_starts,
                 int64_t nseq) {
    struct attn_job job = {0, B, H, KVH, hd, rd, ld, bs, s_blk, s_kv, s_head, s_tok, bt_width, work_stride, qkv, cos,
                           sin, qk_norm, kv, out, slot_mapping, block_tables, seq_lens, eps, scale, work, bf16,
                           seq_starts};
    pool_run(attn_run, &job, seq_starts ? nseq : B, nthreads);
}

struct gdn_job {
    int64_t Hk, Hv, dk, dv, Kc, ld_proj, work_stride;
    const void *proj, *conv_w, *norm_w;
    void *conv_pool, *out;
    float *rec_pool, *work;
    const int64_t *slots;
    const float *neg_A, *dt_bias;
    float eps;
    int bf16;
};

static void gdn_run(void *ctx, int64_t chunk, int64_t tid) { /* chunk: one row */
    const struct gdn_job *j = ctx;
    gdn_decode(chunk, chunk + 1, j->Hk, j->Hv, j->dk, j->dv, j->Kc, j->proj, j->ld_proj, j->conv_w, j->conv_pool,
               j->rec_pool, j->slots, j->neg_A, j->dt_bias, j->norm_w, j->eps, j->out, j->work + tid * j->work_stride,
               j->bf16);
}

/* gdn_decode over rows 0 <= b < B shared by up to nthreads (<= 8) threads; work holds nthreads
 * scratch areas of work_stride >= D + 2*Hv floats. Rows must have distinct slots. */
void gdn_decode_mt(int64_t B, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc, const void *proj,
                   int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool, const int64_t *slots,
                   const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                   int64_t work_stride, int bf16, int64_t nthreads) {
    struct gdn_job job = {Hk,   Hv,       dk,  dv,        Kc,   ld_proj, work_stride, proj,   conv_w,
                          norm_w, conv_pool, out, rec_pool, work, slots,   neg_A,       dt_bias, eps,    bf16};
    pool_run(gdn_run, &job, B, nthreads);
}

/* ======================================================================================
 * Float32 GEMM for few rows over a packed weight: y [M, N] = x [M, K] @ w^T.
 *
 * pack_f32 stores w [N, K] as panels of 16 output columns, each K x 16 contiguous (the last
 * panel zero-padded): wp [ceil(N/16), K, 16]. gemm_f32 walks the panels (split over threads),
 * and for each panel runs tiles of up to 6 rows of x against it: 12 ymm accumulators, a panel
 * row of 2 vectors and one broadcast, all in registers, while the panel stays in L1.
 * ====================================================================================== */

void pack_f32(int64_t N, int64_t K, const float *w, float *wp) {
    for (int64_t p = 0; p < (N + 15) / 16; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t n = p * 16 + c;
                wp[(p * K + k) * 16 + c] = n < N ? w[n * K + k] : 0.0f;
            }
}

static inline __attribute__((always_inline)) void gemm_tile(int64_t K, const float *x, int64_t ldx,
                                                            const float *panel, float *y, int64_t ldy, int64_t nc,
                                                            const int mr) {
    v8f acc0[6] = {{0}}, acc1[6] = {{0}};
    for (int64_t k = 0; k < K; k++) {
        v8f w0, w1;
        memcpy(&w0, panel + k * 16, 32);
        memcpy(&w1, panel + k * 16 + 8, 32);
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            const v8f xb = {xv, xv, xv, xv, xv, xv, xv, xv};
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

struct gemm_job {
    int64_t M, N, K, mb, groups, P;
    const float *x, *wp;
    float *y;
};

/* chunk = (block of mb rows, group of panels) */
static void gemm_run(void *ctx, int64_t chunk, int64_t tid) {
    (void)tid;
    const struct gemm_job *j = ctx;
    const int64_t M = j->M, N = j->N, K = j->K, mb = j->mb, g = chunk % j->groups;
    const int64_t m1 = chunk / j->groups * mb, p0 = j->P * g / j->groups, p1 = j->P * (g + 1) / j->groups;
    for (int64_t p = p0; p < p1; p++) {
        const float *panel = j->wp + p * K * 16;
        const int64_t n0 = p * 16, nc = N - n0 < 16 ? N - n0 : 16, m2 = m1 + mb < M ? m1 + mb : M;
        for (int64_t m0 = m1; m0 < m2; m0 += 6) {
            const float *x = j->x + m0 * K;
            float *y = j->y + m0 * N + n0;
            switch (m2 - m0 < 6 ? m2 - m0 : 6) {
            case 1: gemm_tile(K, x, K, panel, y, N, nc, 1); break;
            case 2: gemm_tile(K, x, K, panel, y, N, nc, 2); break;
            case 3: gemm_tile(K, x, K, panel, y, N, nc, 3); break;
            case 4: gemm_tile(K, x, K, panel, y, N, nc, 4); break;
            case 5: gemm_tile(K, x, K, panel, y, N, nc, 5); break;
            default: gemm_tile(K, x, K, panel, y, N, nc, 6); break;
            }
        }
    }
}

/* y [M, N] = x [M, K] @ w^T for wp = pack_f32(w); x, y float32 contiguous; shared by up to
 * nthreads (<= 8) threads in chunks of a row block (small enough to stay in L2 while every
 * panel passes over it) and a group of panels: many row blocks go whole, few are cut into
 * about four panel groups per thread of at least 64K multiply-adds each. */
void gemm_f32(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, float *y, int64_t nthreads) {
    const int64_t P = (N + 15) / 16, mb = K > 0 ? 6 * (1 + (96 * 1024 / (K * 4)) / 6) : M;
    const int64_t blocks = M > 0 ? (M + mb - 1) / mb : 0, rows = M < mb ? M : mb;
    int64_t groups = 1;
    if (nthreads > 1 && blocks < 4 * nthreads) {
        groups = (4 * nthreads + blocks - 1) / blocks;
        const int64_t most = rows * K * 16 * P / (64 * 1024);
        if (groups > most) groups = most;
        if (groups > P) groups = P;
        if (groups < 1) groups = 1;
    }
    struct gemm_job job = {M, N, K, mb, groups, P, x, wp, y};
    pool_run(gemm_run, &job, blocks * groups, nthreads);
}

struct gdn_rows_job {
    int64_t work_stride, Hk, Hv, dk, dv, Kc, ld_proj;
    const float *conv_wt; /* [Kc, D]: conv_w transposed, float32 */
    const int64_t *row_cu, *row_slots, *tok_slots;
    const uint8_t *row_init;
    const void *proj, *conv_w, *norm_w;
    void *conv_pool, *out;
    float *rec_pool, *work;
    const float *neg_A, *dt_bias;
    float eps;
    int bf16;
};

static void gdn_rows_run(void *ctx, int64_t r, int64_t tid) { /* chunk: one row */
    const struct gdn_rows_job *j = ctx;
    const int64_t Hv = j->Hv, D = 2 * j->Hk * j->dk + Hv * j->dv, K1 = j->Kc - 1, esz = j->bf16 ? 2 : 4;
    const int64_t s = j->row_slots[r], t0 = j->row_cu[r], n = j->row_cu[r + 1] - t0, ld = j->ld_proj;
    float *work = j->work + tid * j->work_stride, *y = work, *hist = work + D + 2 * Hv; /* hist [K1, D] */
    if (!j->row_init[r]) { /* a new sequence starts from zero state (the slot may hold anything) */
        memset((char *)j->conv_pool + s * D * K1 * esz, 0, D * K1 * esz);
        memset(j->rec_pool + s * Hv * j->dk * j->dv, 0, Hv * j->dk * j->dv * sizeof(float));
    }
    for (int64_t i = 0; i < K1; i++) /* the slot's saved inputs, oldest first, channel-contiguous */
        for (int64_t c = 0; c < D; c++) hist[i * D + c] = load(j->conv_pool, (s * D + c) * K1 + i, j->bf16);
    /* the row's tokens in order: the conv over the row's own inputs (channels contiguous in proj,
     * the same sum in the same order as gdn_decode's), then the rest of gdn_decode */
    for (int64_t t = 0; t < n; t++) {
        for (int64_t i = 0; i <= K1; i++) {
            const int64_t m = t - K1 + i; /* input position in the row; < 0: saved */
            const float *wt = j->conv_wt + i * D;
            if (m < 0) {
                const float *x = hist + (K1 + m) * D;
                for (int64_t c = 0; c < D; c++) y[c] = (i ? y[c] : 0.0f) + wt[c] * x[c];
            } else if (!j->bf16) {
                const float *x = (const float *)j->proj + (t0 + m) * ld;
                for (int64_t c = 0; c < D; c++) y[c] = (i ? y[c] : 0.0f) + wt[c] * x[c];
            } else {
                for (int64_t c = 0; c < D; c++) y[c] = (i ? y[c] : 0.0f) + wt[c] * load(j->proj, (t0 + m) * ld + c, 1);
            }
        }
        if (j->bf16)
            for (int64_t c = 0; c < D; c++) y[c] = rnd(y[c], 1);
        gdn_after_conv(t0 + t, j->Hk, Hv, j->dk, j->dv, j->proj, ld, j->rec_pool, j->tok_slots, j->neg_A, j->dt_bias,
                       j->norm_w, j->eps, j->out, work, j->bf16);
    }
    for (int64_t i = 0; i < K1; i++) { /* the row's last K1 inputs become the saved ones */
        const int64_t m = n - K1 + i;
        for (int64_t c = 0; c < D; c++) {
            const float x = m < 0 ? hist[(K1 + m) * D + c] : load(j->proj, (t0 + m) * ld + c, j->bf16);
            store(j->conv_pool, (s * D + c) * K1 + i, x, j->bf16);
        }
    }
}

/* A GDN layer after its input projection for R rows of any length (decode rows of one token,
 * prefill chunks), token by token: the recurrent form, which on a CPU with small heads costs
 * less than the chunked one. Row r covers tokens row_cu[r] <= t < row_cu[r+1] at slot
 * row_slots[r]; tok_slots [T] is each token's slot; row_init[r] = 0 starts the row from zero
 * state. proj, out, pools and weights as gdn_decode / gdn_decode_mt; work holds nthreads
 * scratch areas of work_stride >= D + 2*Hv + (Kc-1)*D floats, then Kc*D floats (the conv
 * weight transposed). A row's conv runs over its own inputs, channels contiguous; rows
 * (distinct slots) are shared by up to nthreads (<= 8) threads, one row at a time. */
void gdn_rows_mt(int64_t R, const int64_t *row_cu, const int64_t *row_slots, const uint8_t *row_init,
                 const int64_t *tok_slots, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                 const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                 const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                 int64_t work_stride, int bf16, int64_t nthreads) {
    const int64_t D = 2 * Hk * dk + Hv * dv;
    float *conv_wt = work + (nthreads > 1 ? nthreads : 1) * work_stride; /* after the threads' scratch */
    for (int64_t c = 0; c < D; c++)
        for (int64_t i = 0; i < Kc; i++) conv_wt[i * D + c] = load(conv_w, c * Kc + i, bf16);
    struct gdn_rows_job job = {work_stride, Hk,       Hv,   dk,     dv,      Kc,     ld_proj, conv_wt,
                               row_cu,      row_slots, tok_slots, row_init, proj, conv_w, norm_w, conv_pool,
                               out,         rec_pool,  work, neg_A,  dt_bias, eps,    bf16};
    pool_run(gdn_rows_run, &job, R, nthreads);
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

/* ======================================================================================
 * The MLP's gate: out [M, I] = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2I] (rows ld apart),
 * float32, silu(x) = x / (1 + exp(-x)) with exp8; rows shared by up to nthreads threads in
 * blocks of 64. PyTorch reference: F.silu(gate) * up (engine/model/layers.py MLP).
 * ====================================================================================== */

struct silu_mul_job {
    int64_t M, I, ld;
    const float *gu;
    float *out;
};

static void silu_mul_run(void *ctx, int64_t chunk, int64_t tid) {
    (void)tid;
    const struct silu_mul_job *j = ctx;
    const int64_t m1 = (chunk + 1) * 64 < j->M ? (chunk + 1) * 64 : j->M;
    for (int64_t m = chunk * 64; m < m1; m++) {
        const float *g = j->gu + m * j->ld, *u = g + j->I;
        float *o = j->out + m * j->I;
        int64_t i = 0;
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

void silu_mul_f32(int64_t M, int64_t I, const float *gu, int64_t ld, float *out, int64_t nthreads) {
    struct silu_mul_job job = {M, I, ld, gu, out};
    pool_run(silu_mul_run, &job, (M + 63) / 64, nthreads);
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

static void norm_run(void *ctx, int64_t chunk, int64_t tid) {
    (void)tid;
    const struct norm_job *j = ctx;
    const int64_t b1 = (chunk + 1) * 64 < j->T ? (chunk + 1) * 64 : j->T;
    add_rms_norm(chunk * 64, b1, j->H, j->x, j->h, j->xo, j->w, j->eps, j->y, NULL, j->bf16);
}

void add_rms_norm_mt(int64_t T, int64_t H, const void *x, const void *h, void *xo, const float *w, float eps,
                     void *y, int bf16, int64_t nthreads) {
    struct norm_job job = {T, H, x, h, xo, y, w, eps, bf16};
    pool_run(norm_run, &job, (T + 63) / 64, nthreads);
}

/* ======================================================================================
 * A whole float32 decode step through the decoder layers, one token per row: per layer the
 * ops above in the order engine/model/qwen3_5.py run_layer calls them one by one from Python
 *     h = norm(x);  mix = gdn_decode / attn_decode(h @ w_in^T);  x = x + mix @ w_out^T;
 *     h = norm(x);  x = x + silu_mul(h @ w_gu^T) @ w_down^T
 * with the same thread splits, so its result is the same to the bit; it only saves the
 * Python between them. PyTorch reference: engine/model/layers.py (the per-op path).
 * Dense MLPs, one tensor-parallel rank, float32 packed weights (pack_f32) only.
 * ====================================================================================== */

struct dec_layer {
    int64_t attn; /* 0: GDN, 1: gated attention */
    const float *in_norm, *post_norm; /* [H] (1 + w) */
    const float *w_in, *w_out, *w_gu, *w_down; /* packed */
    int64_t n_in, k_out, n_gu; /* w_in's outputs; w_out's inputs; w_gu's outputs (2I) */
    float eps; /* the mixer's norms */
    /* GDN */
    int64_t hk, hv, dk, dv, kc;
    const float *conv_w, *neg_A, *dt_bias, *norm_w;
    float *conv_pool, *rec_pool;
    /* attention */
    int64_t h, kvh, hd, s_blk, s_kv, s_head, s_tok, bs;
    const float *qk_norm;
    float *kv;
    float scale;
};

struct dec_step {
    int64_t B, H, rd, nthreads, bt_width, work_stride;
    float eps; /* the layer norms */
    float *x; /* [B, H] residual stream, updated in place */
    const int64_t *gdn_slots, *slot_mapping, *block_tables, *seq_lens;
    const float *cos, *sin; /* [B, rd] */
    float *h, *proj, *mix, *gu, *act, *o; /* scratch: [B, H], [B, max n_in], [B, max k_out], [B, max n_gu],
                                             [B, max n_gu / 2], [B, H] */
    float *work; /* nthreads * work_stride floats */
};

static void dec_gemm(const struct dec_step *s, const float *x, const float *wp, float *y, int64_t N, int64_t K) {
    gemm_f32(s->B, N, K, x, wp, y, s->B * N * K >= (1 << 18) ? s->nthreads : 1); /* engine/model/linear.py */
}

void decode_layers_f32(int64_t L, const struct dec_layer *layers, const struct dec_step *s) {
    const int64_t B = s->B, H = s->H, rows_nt = B < s->nthreads ? B : s->nthreads; /* cpu_ops.threads(B) */
    for (int64_t l = 0; l < L; l++) {
        const struct dec_layer *y = layers + l;
        add_rms_norm(0, B, H, s->x, NULL, s->x, y->in_norm, s->eps, s->h, s->work, 0);
        dec_gemm(s, s->h, y->w_in, s->proj, y->n_in, H);
        if (y->attn)
            attn_decode(B, y->h, y->kvh, y->hd, s->rd, s->proj, y->n_in, y->qk_norm, y->eps, s->cos, s->sin, y->kv,
                        y->s_blk, y->s_kv, y->s_head, y->s_tok, y->bs, s->slot_mapping, s->block_tables,
                        s->bt_width, s->seq_lens, y->scale, s->mix, s->work, s->work_stride, 0, rows_nt, NULL, B);
        else
            gdn_decode_mt(B, y->hk, y->hv, y->dk, y->dv, y->kc, s->proj, y->n_in, y->conv_w, y->conv_pool,
                          y->rec_pool, s->gdn_slots, y->neg_A, y->dt_bias, y->norm_w, y->eps, s->mix, s->work,
                          s->work_stride, 0, rows_nt);
        dec_gemm(s, s->mix, y->w_out, s->o, H, y->k_out);
        add_rms_norm(0, B, H, s->x, s->o, s->x, y->post_norm, s->eps, s->h, s->work, 0);
        dec_gemm(s, s->h, y->w_gu, s->gu, y->n_gu, H);
        const int64_t I = y->n_gu / 2;
        silu_mul_f32(B, I, s->gu, y->n_gu, s->act, B * y->n_gu >= (1 << 16) ? s->nthreads : 1);
        dec_gemm(s, s->act, y->w_down, s->o, H, I);
        for (int64_t i = 0; i < B * H; i++) s->x[i] += s->o[i];
    }
}
