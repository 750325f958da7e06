/* A gated attention layer's decode rows after the qkv projection, in one call (attn_decode):
 * per-head RMS norm of q and k times (1 + w), partial rotary (rotate-half), the new k and v
 * written to their KV page, attention of q over the row's pages, and the sigmoid gate.
 * PyTorch reference: kernels/attention.py with engine/model/layers.py Attention.
 */
#include "common.h"
#include "kernels.h"

namespace pdserve {

/* sum_j a[j] * b[j] with eight partial sums (a plain loop is one serial chain of adds). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    v8f acc = {};
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
    v8f acc = {};
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
    v8f A[8] = {};
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


/* Asks for the `bytes` from p into the caches ahead of their use: a sequence's pages lie apart in
 * the pool, so the hardware's stream prefetch starts cold at each page (the loads stall on memory
 * unless the next page is already on its way). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

/* acc[0 .. 8*nv) = sum over positions t < n of p[t] * V[t][0 .. 8*nv): the V rows of a sequence's
 * pages (block table bt) from element offset vp of each page, in position order. */
static inline __attribute__((always_inline)) void attn_pv(const AttnJob *a, const int64_t *bt, int64_t n,
                                                          int64_t vp, const float *p, float *acc, const int nv,
                                                          const int bf16) {
    v8f R[8] = {};
    for (int64_t t0 = 0; t0 < n; t0 += a->bs) {
        const int64_t m = n - t0 < a->bs ? n - t0 : a->bs;
        const int64_t o0 = bt[t0 / a->bs] * a->s_blk + vp;
        if (t0 + a->bs < n) { /* the next page's rows of this V slice */
            const int64_t on = bt[t0 / a->bs + 1] * a->s_blk + vp, esz = bf16 ? 2 : 4;
            for (int64_t t = 0; t < a->bs; t++) prefetch_span((const char *)a->kv + (on + t * a->s_tok) * esz, nv * 8 * esz);
        }
        for (int64_t t = 0; t < m; t++) {
            const float pt = p[t0 + t];
            const v8f pb = bcast(pt);
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

static inline __attribute__((always_inline)) void attn_rows(const AttnJob *a, const int bf16) {
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
        /* the new k and v into the row's page slot (not in a second pass: the first stored them) */
        const int64_t slot = a->slot_mapping[b], blk = slot / a->bs, off = slot % a->bs;
        const int64_t v_col = row + nqk * hd + H * hd;
        for (int64_t g = 0; g < KVH && a->pass != 2; g++) {
            const int64_t kp = blk * a->s_blk + g * a->s_head + off * a->s_tok;
            for (int64_t j = 0; j < hd; j++) {
                store(a->kv, kp + j, qk[(H + g) * hd + j], bf16);
                store(a->kv, kp + a->s_kv + j, load(a->qkv, v_col + g * hd + j, bf16), bf16);
            }
        }
        if (a->pass == 1) continue; /* a first pass stores every row's k and v, nothing more */
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
                if (t0 + a->bs < n) { /* the next page's K rows of this head */
                    const int64_t kn = bt[t0 / a->bs + 1] * a->s_blk + g * a->s_head, esz = bf16 ? 2 : 4;
                    for (int64_t t = 0; t < a->bs; t++) prefetch_span((const char *)a->kv + (kn + t * a->s_tok) * esz, hd * esz);
                }
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

void attn_chunk(const AttnJob &job, int64_t chunk, int64_t tid) { /* one row, or one sequence's rows */
    AttnJob a = job;
    const bool seq = a.seq_starts && a.pass == 0;
    a.b0 = seq ? a.seq_starts[chunk] : chunk, a.b1 = seq ? a.seq_starts[chunk + 1] : chunk + 1;
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
 *              stored first and the rows' attention then runs in blocks of 16 rows on all the
 *              threads (the same bits).
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
            parallel_chunks((B + 15) / 16, nthreads, [&](int64_t c, int64_t tid) {
                for (int64_t b = 16 * c; b < B && b < 16 * (c + 1); b++) attn_chunk(p, b, tid);
            });
        }
        return;
    }
    parallel_chunks(seq_starts ? nseq : B, nthreads, [&](int64_t c, int64_t tid) { attn_chunk(job, c, tid); });
}

}  // namespace pdserve
