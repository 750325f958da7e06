/* A gated attention layer's decode rows after the qkv projection, in one call (attn_decode):
 * per-head RMS norm of q and k times (1 + w), partial rotary (rotate-half), the new k and v
 * written to their KV page, attention of q over the row's pages, and the sigmoid gate.
 * PyTorch reference: kernels/attention.py with engine/model/layers.py Attention.
 */
#include <immintrin.h>

#include "common.h"
#include "kernels.h"

namespace pdserve {

/* out[p] = the sum of A[p]'s lanes, ((a0+a4)+(a1+a5)) +
 * ((a2+a6)+(a3+a7)), for p < 8, the 8 reductions done together by shuffles. */
static inline __attribute__((always_inline)) void reduce8(const v8f *A, float *out) {
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

/* c + a * b rounded once, lane by lane. Scores and weighted values use it rather than `c += a * b`,
 * which the compiler may fuse in one place and not in another (a sum it unrolls and vectorises
 * wider multiplies first): every path to a row's scores then gives the same bits. */
static inline __attribute__((always_inline)) v8f fma8(v8f a, v8f b, v8f c) {
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}

/* dot(q, k) for one key, summed as dots_tile sums each (lanes j % 8 in order of j, then
 * ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)), then the dims past the last multiple of 8 one by one). */
static inline __attribute__((always_inline)) float dot_one(const float *q, const void *k, int64_t hd,
                                                           const int bf16) {
    v8f A = {};
    const int64_t hd8 = hd - hd % 8;
    for (int64_t j = 0; j < hd8; j += 8) {
        v8f x;
        memcpy(&x, q + j, 32);
        A = fma8(x, ld8(k, j, bf16), A);
    }
    float v = hsum8(A);
    for (int64_t j = hd8; j < hd; j++) v = __builtin_fmaf(q[j], load(k, j, bf16), v);
    return v;
}

/* Scores of NQ query vectors q[i] with NK consecutive keys k (row stride ks), NQ * NK <= 16:
 * out[i][p] = dot(q[i], k_p), each summed exactly as dot_one sums one (lanes j % 8 in
 * order of j, reduce8, then the dims past the last multiple of 8 one by one), with NQ * NK
 * independent chains and each key's 8 dims loaded once for all the queries. */
template <int NQ, int NK>
static inline __attribute__((always_inline)) void dots_tile(const float *const *q, const void *k, int64_t ks,
                                                            int64_t hd, float *const *out, const int bf16) {
    static_assert(NQ * NK <= 16 && (NQ * NK) % 8 == 0, "a tile is one or two reductions of 8");
    v8f A[NQ * NK] = {};
    const int64_t hd8 = hd - hd % 8;
    for (int64_t j = 0; j < hd8; j += 8) {
        v8f y[NK];
        for (int p = 0; p < NK; p++) y[p] = ld8(k, p * ks + j, bf16);
        for (int i = 0; i < NQ; i++) {
            v8f x;
            memcpy(&x, q[i] + j, 32);
            for (int p = 0; p < NK; p++) A[i * NK + p] = fma8(x, y[p], A[i * NK + p]);
        }
    }
    float s[NQ * NK];
    for (int c = 0; c < NQ * NK; c += 8) reduce8(A + c, s + c);
    for (int i = 0; i < NQ; i++)
        for (int p = 0; p < NK; p++) {
            float v = s[i * NK + p];
            for (int64_t j = hd8; j < hd; j++) v = __builtin_fmaf(q[i][j], load(k, p * ks + j, bf16), v);
            out[i][p] = v;
        }
}

/* Asks for the `bytes` from p into the caches ahead of their use: a sequence's pages lie apart in
 * the pool, so the hardware's stream prefetch starts cold at each page (the loads stall on memory
 * unless the next page is already on its way). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

/* The pages KV_L2_AHEAD on from page pg of a row (the first call of a pass, first: pages 2 .. KV_L2_AHEAD)
 * into the L2 cache, `bytes` of each position from element `col` of its page. The next page alone
 * (prefetch_span, into L1) left the memory idle most of the time: a decode step's KV comes from
 * scattered 2 KB pages, and at 3 GB/s its attention waited on memory. Four pages ahead in L2 more than
 * halved a cold 16-row step's attention (docs/benchmarks.md, CPU path). Inlined by force: GCC
 * dropped the prefetches of an out-of-line copy. */
constexpr int64_t KV_L2_AHEAD = 4;

static inline __attribute__((always_inline)) void prefetch_l2(const AttnJob *a, const int64_t *bt, int64_t pg,
                                                              bool first, int64_t t1, int64_t col, int64_t bytes,
                                                              int64_t esz) {
    for (int64_t d = first ? 2 : KV_L2_AHEAD; d <= KV_L2_AHEAD && (pg + d) * a->bs < t1; d++) {
        const char *p = (const char *)a->kv + (bt[pg + d] * a->s_blk + col) * esz;
        for (int64_t i = 0; i < a->bs; i++)
            for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + i * a->s_tok * esz + o, 0, 1);
    }
}

/* One query tile's view of one KV head: nq query vectors q[i] whose scores go to s[i] (by position)
 * and whose weighted values add into acc[i] (hd floats). */
struct QTile {
    int nq;
    bool far; /* the first tile of its chunk: its pages come from memory (prefetch_l2); later tiles of a
               * sequence's rows find them in the cache */
    const float *q[ATTN_TILE_Q];
    float *s[ATTN_TILE_Q], *acc[ATTN_TILE_Q];
};

/* The tile of T's query i alone. */
static inline QTile single(const QTile &T, int i) {
    QTile U;
    U.nq = 1, U.far = T.far, U.q[0] = T.q[i], U.s[0] = T.s[i], U.acc[0] = T.acc[i];
    return U;
}

/* The scores of a tile's queries with positions [t0, t1) of head g's keys (page table bt). */
template <int NQ, int NK>
static inline __attribute__((always_inline)) void tile_scores(const AttnJob *a, const QTile &T, const int64_t *bt,
                                                              int64_t g, int64_t t0, int64_t t1, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, hd = a->hd;
    for (int64_t t = t0; t < t1;) {
        const int64_t pg = t / a->bs, end = (pg + 1) * a->bs < t1 ? (pg + 1) * a->bs : t1;
        const int64_t kp = bt[pg] * a->s_blk + g * a->s_head - pg * a->bs * a->s_tok; /* position t at kp + t * s_tok */
        if (end < t1) { /* the next page's K rows of this head */
            const int64_t kn = bt[pg + 1] * a->s_blk + g * a->s_head;
            for (int64_t i = 0; i < a->bs; i++) prefetch_span((const char *)a->kv + (kn + i * a->s_tok) * esz, hd * esz);
        }
        if (T.far) prefetch_l2(a, bt, pg, t == t0, t1, g * a->s_head, hd * esz, esz);
        for (; t + NK <= end; t += NK) {
            float *o[NQ];
            for (int i = 0; i < NQ; i++) o[i] = T.s[i] + t;
            dots_tile<NQ, NK>(T.q, (const char *)a->kv + (kp + t * a->s_tok) * esz, a->s_tok, hd, o, bf16);
        }
        for (; t < end; t++)
            for (int i = 0; i < NQ; i++)
                T.s[i][t] = dot_one(T.q[i], (const char *)a->kv + (kp + t * a->s_tok) * esz, hd, bf16);
    }
}

/* acc[i][j0 + ...] += sum over positions t in [t0, t1), in order, of s[i][t] * V[t][j0 + ...] for
 * nv (<= NV) vectors of 8 dims from dim j0, for NQ of a tile's queries (one chain per output). */
template <int NQ, int NV>
static inline __attribute__((always_inline)) void tile_values(const AttnJob *a, const QTile &T, const int64_t *bt,
                                                              int64_t g, int64_t j0, const int nv, int64_t t0,
                                                              int64_t t1, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, vp = a->s_kv + g * a->s_head + j0;
    v8f R[NQ * NV];
    for (int i = 0; i < NQ; i++)
        for (int r = 0; r < nv; r++) memcpy(&R[i * NV + r], T.acc[i] + j0 + 8 * r, 32);
    for (int64_t t = t0; t < t1;) {
        const int64_t pg = t / a->bs, end = (pg + 1) * a->bs < t1 ? (pg + 1) * a->bs : t1;
        const int64_t o0 = bt[pg] * a->s_blk + vp - pg * a->bs * a->s_tok;
        if (end < t1) { /* the next page's rows of this V slice */
            const int64_t on = bt[pg + 1] * a->s_blk + vp;
            for (int64_t i = 0; i < a->bs; i++) prefetch_span((const char *)a->kv + (on + i * a->s_tok) * esz, nv * 8 * esz);
        }
        if (T.far) prefetch_l2(a, bt, pg, t == t0, t1, vp, nv * 8 * esz, esz);
        for (; t < end; t++) {
            const int64_t o = o0 + t * a->s_tok;
            v8f y[NV];
            for (int r = 0; r < nv; r++) y[r] = ld8(a->kv, o + 8 * r, bf16);
            for (int i = 0; i < NQ; i++) {
                const v8f pb = bcast(T.s[i][t]);
                for (int r = 0; r < nv; r++) R[i * NV + r] = fma8(pb, y[r], R[i * NV + r]);
            }
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int r = 0; r < nv; r++) memcpy(T.acc[i] + j0 + 8 * r, &R[i * NV + r], 32);
}

/* acc[i][j] += the same sums for the dims past the last multiple of 8 (one scalar chain each). */
static void tile_values_tail(const AttnJob *a, const QTile &T, int nq, const int64_t *bt, int64_t g, int64_t t0,
                             int64_t t1, const int bf16) {
    for (int64_t t = t0; t < t1; t++) {
        const int64_t o = bt[t / a->bs] * a->s_blk + a->s_kv + g * a->s_head + (t % a->bs) * a->s_tok;
        for (int i = 0; i < nq; i++)
            for (int64_t j = a->hd - a->hd % 8; j < a->hd; j++)
                T.acc[i][j] = __builtin_fmaf(T.s[i][t], load(a->kv, o + j, bf16), T.acc[i][j]);
    }
}

/* The weighted values of the first NQ of a tile's queries over positions [t0, t1). */
template <int NQ>
static inline __attribute__((always_inline)) void tile_pv(const AttnJob *a, const QTile &T, const int64_t *bt,
                                                          int64_t g, int64_t t0, int64_t t1, const int bf16) {
    constexpr int NV = NQ >= 4 ? 4 : 8; /* NQ * NV accumulators, at most 16 */
    const int64_t hd8 = a->hd - a->hd % 8;
    int64_t j0 = 0;
    for (; j0 + 8 * NV <= hd8; j0 += 8 * NV) tile_values<NQ, NV>(a, T, bt, g, j0, NV, t0, t1, bf16);
    if (j0 < hd8) tile_values<NQ, NV>(a, T, bt, g, j0, (int)((hd8 - j0) / 8), t0, t1, bf16);
    if (hd8 < a->hd) tile_values_tail(a, T, NQ, bt, g, t0, t1, bf16);
}

/* Scores over [t0, t1) for a tile of 1, 2 or 4 queries (a tile of 3 runs as 2 and 1). */
static inline __attribute__((always_inline)) void scores_any(const AttnJob *a, const QTile &T, const int64_t *bt,
                                                             int64_t g, int64_t t0, int64_t t1, const int bf16) {
    if (T.nq == 4) tile_scores<4, 4>(a, T, bt, g, t0, t1, bf16);
    else if (T.nq == 2) tile_scores<2, 8>(a, T, bt, g, t0, t1, bf16);
    else if (T.nq == 1) tile_scores<1, 8>(a, T, bt, g, t0, t1, bf16);
    else {
        tile_scores<2, 8>(a, T, bt, g, t0, t1, bf16); /* its first two queries */
        tile_scores<1, 8>(a, single(T, 2), bt, g, t0, t1, bf16);
    }
}

static inline __attribute__((always_inline)) void pv_any(const AttnJob *a, const QTile &T, const int64_t *bt,
                                                         int64_t g, int64_t t0, int64_t t1, const int bf16) {
    if (T.nq == 4) tile_pv<4>(a, T, bt, g, t0, t1, bf16);
    else if (T.nq == 2) tile_pv<2>(a, T, bt, g, t0, t1, bf16);
    else if (T.nq == 1) tile_pv<1>(a, T, bt, g, t0, t1, bf16);
    else {
        tile_pv<2>(a, T, bt, g, t0, t1, bf16); /* its first two queries */
        tile_pv<1>(a, single(T, 2), bt, g, t0, t1, bf16);
    }
}

/* s[t] *= scale for t < n, and the largest of them (NaN passed over; exact in any order). */
static inline float scale_max(float *s, int64_t n, float scale) {
    v8f m8 = bcast(-INFINITY);
    const v8f sc = bcast(scale);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        v8f x;
        memcpy(&x, s + t, 32);
        x *= sc;
        memcpy(s + t, &x, 32);
        m8 = sel8(x > m8, x, m8);
    }
    float m = -INFINITY;
    for (int l = 0; l < 8; l++) m = m8[l] > m ? m8[l] : m;
    for (; t < n; t++) {
        s[t] *= scale;
        m = s[t] > m ? s[t] : m;
    }
    return m;
}

/* sum of s[t] for t < n: lanes t % 8 in order of t, ((a0+a4)+(a1+a5)) + ((a2+a6)+(a3+a7)), then
 * the last n % 8 in order. A function of the row's values alone, whichever rows run beside it. */
static inline float sum_lanes(const float *s, int64_t n) {
    v8f A = {};
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        v8f x;
        memcpy(&x, s + t, 32);
        A += x;
    }
    float v = hsum8(A);
    for (; t < n; t++) v += s[t];
    return v;
}

/* A query vector's output: out[oo + j] = rnd(acc[j] * inv) * rnd(sigmoid(qkv[gate + j])) for j < hd,
 * eight lanes at a time (exp8; exp_fast, its one-lane form, for the dims past the last multiple of
 * 8). Every row goes through it, so decode and prefill rows get the same bits. */
static inline __attribute__((always_inline)) void gate_out(const float *acc, float inv, const void *qkv, int64_t gate,
                                                           void *out, int64_t oo, int64_t hd, const int bf16) {
    const v8f iv = bcast(inv);
    int64_t j = 0;
    for (; j + 8 <= hd; j += 8) {
        v8f o;
        memcpy(&o, acc + j, 32);
        o = o * iv;
        const v8f sg = 1.0f / (1.0f + exp8(-ld8(qkv, gate + j, bf16)));
        st8(out, oo + j, rnd8_if(o, bf16) * rnd8_if(sg, bf16), bf16);
    }
    for (; j < hd; j++) {
        const float o = rnd(acc[j] * inv, bf16);
        const float sg = rnd(1.0f / (1.0f + exp_fast(-load(qkv, gate + j, bf16))), bf16);
        store(out, oo + j, o * sg, bf16);
    }
}

/* Rows b .. b+r-1 attend together when each reads, from the same pages, every position row b
 * reads (the rows of one sequence in a prefill): then the positions [0, seq_lens[b]) are shared. */
static int64_t tile_rows(const AttnJob *a, int64_t b, int64_t rmax) {
    const int64_t n = a->seq_lens[b], pages = (n + a->bs - 1) / a->bs;
    const int64_t *bt = a->block_tables + b * a->bt_width;
    int64_t r = 1;
    for (; r < rmax && b + r < a->b1; r++) {
        const int64_t c = b + r;
        if (a->seq_lens[c] < n || memcmp(bt, a->block_tables + c * a->bt_width, pages * sizeof(int64_t)) != 0) break;
    }
    return r;
}

static inline __attribute__((always_inline)) void attn_rows(const AttnJob *a, const int bf16) {
    const int64_t H = a->H, KVH = a->KVH, hd = a->hd, rd = a->rd, half = rd / 2, nqk = H + KVH, grp = H / KVH;
    const int64_t R = attn_tile_rows(grp), nmax = a->bt_width * a->bs;
    const int64_t hd8 = hd - hd % 8, h8 = half - half % 8; /* the eight-lane parts of a head and of its rotary half */
    /* per tile row its q and k heads [R][nqk, hd]; per query vector (row, head of a group) its
     * values' sum [R * grp][hd] and its scores [R * grp][nmax] */
    float *qk = a->work, *acc = qk + R * nqk * hd, *sc = acc + R * grp * hd;
    for (int64_t b = a->b0; b < a->b1;) {
        const int64_t r = a->pass == 1 ? 1 : tile_rows(a, b, R);
        for (int64_t w = 0; w < r; w++) {
            const int64_t rb = b + w, row = rb * a->ld;
            float *qkw = qk + w * nqk * hd;
            /* q and k heads: RMS norm times (1 + w), rounded, then rotary on the first rd dims (a
             * first pass stores k alone; a second attends with q alone) */
            for (int64_t i = a->pass == 1 ? H : 0; i < (a->pass == 2 ? H : nqk); i++) {
                float *x = qkw + i * hd;
                for (int64_t j = 0; j < hd8; j += 8) st8(x, j, ld8(a->qkv, row + i * hd + j, bf16), 0);
                for (int64_t j = hd8; j < hd; j++) x[j] = load(a->qkv, row + i * hd + j, bf16);
                const float ss = dot_f32(x, x, hd);
                const float inv = 1.0f / sqrtf(ss / (float)hd + a->eps);
                const float *nw = a->qk_norm + i * hd;
                for (int64_t j = 0; j < hd8; j += 8) st8(x, j, rnd8_if(ld8(x, j, 0) * bcast(inv) * ld8(nw, j, 0), bf16), 0);
                for (int64_t j = hd8; j < hd; j++) x[j] = rnd(x[j] * inv * nw[j], bf16);
                const int64_t cs = rb * rd;
                for (int64_t j = 0; j < h8; j += 8) {
                    const v8f x1 = ld8(x, j, 0), x2 = ld8(x, j + half, 0);
                    const v8f c1 = ld8(a->cos, cs + j, bf16), s1 = ld8(a->sin, cs + j, bf16);
                    const v8f c2 = ld8(a->cos, cs + j + half, bf16), s2 = ld8(a->sin, cs + j + half, bf16);
                    st8(x, j, rnd8_if(rnd8_if(x1 * c1, bf16) + rnd8_if(-x2 * s1, bf16), bf16), 0);
                    st8(x, j + half, rnd8_if(rnd8_if(x2 * c2, bf16) + rnd8_if(x1 * s2, bf16), bf16), 0);
                }
                for (int64_t j = h8; j < half; j++) {
                    const float x1 = x[j], x2 = x[j + half];
                    const float c1 = load(a->cos, cs + j, bf16), s1 = load(a->sin, cs + j, bf16);
                    const float c2 = load(a->cos, cs + j + half, bf16), s2 = load(a->sin, cs + j + half, bf16);
                    x[j] = rnd(rnd(x1 * c1, bf16) + rnd(-x2 * s1, bf16), bf16);
                    x[j + half] = rnd(rnd(x2 * c2, bf16) + rnd(x1 * s2, bf16), bf16);
                }
            }
            /* the new k and v into the row's page slot (not in a second pass: the first stored them) */
            const int64_t slot = a->slot_mapping[rb], blk = slot / a->bs, off = slot % a->bs;
            const int64_t v_col = row + nqk * hd + H * hd;
            for (int64_t g = 0; g < KVH && a->pass != 2; g++) {
                const int64_t kp = blk * a->s_blk + g * a->s_head + off * a->s_tok;
                const float *kx = qkw + (H + g) * hd;
                for (int64_t j = 0; j < hd8; j += 8) {
                    st8(a->kv, kp + j, ld8(kx, j, 0), bf16);
                    st8(a->kv, kp + a->s_kv + j, ld8(a->qkv, v_col + g * hd + j, bf16), bf16);
                }
                for (int64_t j = hd8; j < hd; j++) {
                    store(a->kv, kp + j, kx[j], bf16);
                    store(a->kv, kp + a->s_kv + j, load(a->qkv, v_col + g * hd + j, bf16), bf16);
                }
            }
        }
        if (a->pass == 1) { /* a first pass stores every row's k and v, nothing more */
            b += r;
            continue;
        }
        /* per KV head, the query heads of its group in the tile's rows together: positions every
         * row reads as one tile, then each row's own last ones (its sums continue in order) */
        const int64_t n0 = a->seq_lens[b], *bt0 = a->block_tables + b * a->bt_width, nq = r * grp;
        for (int64_t g = 0; g < KVH; g++) {
            for (int64_t i = 0; i < nq * hd; i++) acc[i] = 0.0f;
            for (int64_t q0 = 0; q0 < nq; q0 += ATTN_TILE_Q) {
                QTile T;
                T.nq = (int)(nq - q0 < ATTN_TILE_Q ? nq - q0 : ATTN_TILE_Q);
                T.far = b == a->b0;
                for (int i = 0; i < T.nq; i++) {
                    const int64_t qi = q0 + i, w = qi / grp;
                    T.q[i] = qk + w * nqk * hd + (g * grp + qi % grp) * hd;
                    T.s[i] = sc + qi * nmax, T.acc[i] = acc + qi * hd;
                }
                scores_any(a, T, bt0, g, 0, n0, bf16);
                for (int i = 0; i < T.nq; i++) { /* a row's positions past n0, from its own pages */
                    const int64_t w = (q0 + i) / grp, n = a->seq_lens[b + w];
                    if (n > n0) tile_scores<1, 8>(a, single(T, i), a->block_tables + (b + w) * a->bt_width, g, n0, n, bf16);
                }
                float sum[ATTN_TILE_Q];
                for (int i = 0; i < T.nq; i++) { /* softmax weights, unnormalised, and their sum */
                    const int64_t n = a->seq_lens[b + (q0 + i) / grp];
                    exp_rows(T.s[i], n, scale_max(T.s[i], n, a->scale));
                    sum[i] = sum_lanes(T.s[i], n);
                }
                pv_any(a, T, bt0, g, 0, n0, bf16);
                for (int i = 0; i < T.nq; i++) {
                    const int64_t w = (q0 + i) / grp, n = a->seq_lens[b + w];
                    if (n > n0) tile_pv<1>(a, single(T, i), a->block_tables + (b + w) * a->bt_width, g, n0, n, bf16);
                }
                for (int i = 0; i < T.nq; i++) { /* the gate, into the row's output */
                    const int64_t qi = q0 + i, w = qi / grp, h = g * grp + qi % grp, row = (b + w) * a->ld;
                    const float inv = 1.0f / sum[i];
                    gate_out(T.acc[i], inv, a->qkv, row + nqk * hd + h * hd, a->out, (b + w) * H * hd + h * hd, hd,
                             bf16);
                }
            }
        }
        b += r;
    }
}

void attn_chunk(const AttnJob &job, int64_t chunk, int64_t tid) {
    /* pass 0: one row, or one sequence's rows; a pass of two: ATTN_PASS_ROWS rows */
    AttnJob a = job;
    if (a.pass != 0) a.b0 = ATTN_PASS_ROWS * chunk, a.b1 = std::min(job.b1, a.b0 + ATTN_PASS_ROWS);
    else if (a.seq_starts) a.b0 = a.seq_starts[chunk], a.b1 = a.seq_starts[chunk + 1];
    else a.b0 = chunk, a.b1 = chunk + 1;
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
 *   seq_starts nullptr: every row is a sequence of its own. Else [nseq+1] row boundaries of
 *              sequences whose rows are consecutive positions (a row with drafts, an MTP chunk):
 *              each row has its own seq_len / block-table row / slot, and a sequence's rows run
 *              in order in one chunk, so a row's k and v are in their page before the next row
 *              of its sequence reads them (causal attention within the sequence); with many rows
 *              in fewer sequences than four per thread (attn_two_passes), every row's k and v are
 *              stored first and the rows' attention then runs in blocks of ATTN_PASS_ROWS rows on
 *              all the threads (the same bits).
 * Rows that read the same first pages (a sequence's rows) attend in tiles of up to ATTN_TILE_Q query
 * vectors (kernels.h), each row's sums in the order it has alone: a row's bits do not depend on
 * the rows beside it (tests/kernels/test_attn_rows_bits.py).
 * Rows (sequences) are shared by up to nthreads threads (parallel_chunks). */
void attn_decode(int64_t B, int64_t H, int64_t KVH, int64_t hd, int64_t rd, const void *qkv, int64_t ld,
                 const float *qk_norm, float eps, const void *cos, const void *sin, void *kv, int64_t s_blk,
                 int64_t s_kv, int64_t s_head, int64_t s_tok, int64_t bs, const int64_t *slot_mapping,
                 const int64_t *block_tables, int64_t bt_width, const int64_t *seq_lens, float scale, void *out,
                 float *work, int64_t work_stride, int bf16, int64_t nthreads, const int64_t *seq_starts,
                 int64_t nseq) {
    const AttnJob job = {0, B, H, KVH, hd, rd, ld, bs, s_blk, s_kv, s_head, s_tok, bt_width, work_stride, qkv, cos,
                           sin, qk_norm, kv, out, slot_mapping, block_tables, seq_lens, eps, scale, work, bf16,
                           seq_starts};
    if (attn_two_passes(B, nseq, nthreads, seq_starts)) {
        /* many rows in sequences (a prefill in batch-invariant mode): every row's k and v first,
         * then every row's attention on its own, in any order and on any thread; the same
         * arithmetic as one row after another, with the threads no longer one per sequence */
        for (const int pass : {1, 2}) {
            AttnJob p = job;
            p.pass = pass;
            parallel_chunks((B + ATTN_PASS_ROWS - 1) / ATTN_PASS_ROWS, nthreads,
                            [&](int64_t c, int64_t tid) { attn_chunk(p, c, tid); });
        }
        return;
    }
    parallel_chunks(seq_starts ? nseq : B, nthreads, [&](int64_t c, int64_t tid) { attn_chunk(job, c, tid); });
}

}  // namespace pdserve
