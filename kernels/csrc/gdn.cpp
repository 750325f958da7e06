/* The GDN layer after its input projection, token by token in the recurrent form: decode rows
 * (gdn_decode_mt), rows of any length (gdn_rows_mt: prefill chunks beside decode rows) and
 * speculative rows whose states are kept for rollback (gdn_verify). PyTorch reference:
 * kernels/gdn.py, kernels/conv.py and kernels/norm.py as engine/model/layers.py calls them.
 */
#include "common.h"
#include "kernels.h"

namespace pdserve {

/* One value head's delta-rule step on NV * GDN_LANES columns of its state S [dk, dv] (rows ld floats
 * apart; gdn_head_out runs dv = 32, 64 or 128 in blocks of GDN_COLS, as many as the registers hold:
 * the columns are independent, so any block gives the same bits): the
 * loops of gdn_head_out's generic branch below with the [dv] accumulators in registers (in
 * memory, each state row's multiply-add waits for the previous row's store). Every element takes
 * the same operations in the same order as there, so the same result to the bit whatever the
 * vector width. o [the block's columns] receives S^T q.
 * The decay is applied to S^T k after the sum, (a S)^T k = a (S^T k), so the first pass only reads
 * S and the state is stored once, by the second pass; each pass sums the even and the odd rows of
 * S in two accumulator sets (added at the end) so that 2 * NV independent chains hide the
 * multiply-add's latency (one set of NV chains at dv = 64 waited on it). */
#if defined(__AVX512F__) /* 32 registers of 16 lanes: a whole head of up to 128 columns at once */
#define GDN_LANES 16
#define GDN_COLS 128
typedef float vgf __attribute__((vector_size(64)));
static inline vgf bcastg(float x) { return vgf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else /* AVX2's 16 registers of 8 lanes: 32 columns at a time */
#define GDN_LANES 8
#define GDN_COLS 32
typedef v8f vgf;
static inline vgf bcastg(float x) { return bcast(x); }
#endif

template <int NV>
static inline __attribute__((always_inline)) void gdn_head(float *S, int64_t ld, int64_t dk, const float *q,
                                                           const float *k, const float *v, float a, float beta,
                                                           float *o) {
    vgf e[NV] = {}, f[NV] = {}, d[NV]; /* even rows' sums, odd rows' sums */
    const vgf av = bcastg(a), bv = bcastg(beta);
    /* each pass runs rows in pairs, the even row into e and the odd one into f (a fixed array per
     * call, so the sums stay in registers), then an odd dk's last row into e */
    auto pairs = [&](auto row) {
        int64_t i = 0;
        for (; i + 2 <= dk; i += 2) row(i, e), row(i + 1, f);
        if (i < dk) row(i, e);
    };
    pairs([&](int64_t i, vgf *acc) __attribute__((always_inline)) { /* S^T k */
        const vgf kb = bcastg(k[i]);
        for (int r = 0; r < NV; r++) {
            vgf x;
            memcpy(&x, S + i * ld + GDN_LANES * r, sizeof(vgf));
            acc[r] += x * kb;
        }
    });
    for (int r = 0; r < NV; r++) { /* d = beta (v - a S^T k) */
        vgf x;
        memcpy(&x, v + GDN_LANES * r, sizeof(vgf));
        const vgf kv = av * (e[r] + f[r]);
        d[r] = (x - kv) * bv;
        e[r] = vgf{}, f[r] = vgf{};
    }
    pairs([&](int64_t i, vgf *acc) __attribute__((always_inline)) { /* S = a S + k d^T, and S^T q over the new S */
        float *Si = S + i * ld;
        const vgf kb = bcastg(k[i]), qb = bcastg(q[i]);
        for (int r = 0; r < NV; r++) {
            vgf x;
            memcpy(&x, Si + GDN_LANES * r, sizeof(vgf));
            const vgf w = kb * d[r];
            x = x * av + w;
            memcpy(Si + GDN_LANES * r, &x, sizeof(vgf));
            acc[r] += x * qb;
        }
    });
    for (int r = 0; r < NV; r++) e[r] += f[r];
    memcpy(o, e, NV * sizeof(vgf));
}

/* q or k of one head in place: L2 norm (eps 1e-6) times sc. Every GDN norm (q, k and the gated
 * output norm, in decode and in prefill rows) sums its squares with dot_f32 (eight lanes, not one
 * chain of n multiply-adds), so each path gets the same bits. */
static inline __attribute__((always_inline)) void l2_norm(float *v, int64_t n, float sc) {
    const float inv = 1.0f / sqrtf(dot_f32(v, v, n) + 1e-6f);
    for (int64_t i = 0; i < n; i++) v[i] = v[i] * inv * sc;
}

/* One value head of one token after its q, k, v, decay a and beta are known: the delta rule on
 * its state S [dk, dv], then the gated RMS norm of S^T q with z = proj[zo .. zo + dv), written to
 * out[oo .. oo + dv). Shared by every op below, so that a token's arithmetic is the same whichever
 * op computes it. */
static inline __attribute__((always_inline)) void gdn_head_out(float *S, int64_t dk, int64_t dv, const float *q,
                                                               const float *k, const float *v, float a, float beta,
                                                               const void *proj, int64_t zo, const void *norm_w,
                                                               float eps, void *out, int64_t oo, const int bf16) {
    float kv[dv], o[dv];
    if (dv == 32 || dv == 64 || dv == 128) {
        /* columns are independent in both passes: a block of them at a time gives the same bits */
        const int64_t bw = dv < GDN_COLS ? dv : GDN_COLS; /* 32, 64 or 128 */
        for (int64_t c = 0; c < dv; c += bw) {
            if (bw == 32) gdn_head<32 / GDN_LANES>(S + c, dv, dk, q, k, v + c, a, beta, o + c);
            else if (bw == 64) gdn_head<64 / GDN_LANES>(S + c, dv, dk, q, k, v + c, a, beta, o + c);
            else gdn_head<128 / GDN_LANES>(S + c, dv, dk, q, k, v + c, a, beta, o + c);
        }
    } else { /* gdn_head's arithmetic, element by element (its even / odd row sums included) */
        float od[dv];
        for (int64_t j = 0; j < dv; j++) kv[j] = 0.0f, od[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float *Si = S + i * dv;
            float *acc = (i & 1) ? od : kv;
            for (int64_t j = 0; j < dv; j++) acc[j] += Si[j] * k[i];
        }
        for (int64_t j = 0; j < dv; j++) {
            const float skv = a * (kv[j] + od[j]);
            kv[j] = (v[j] - skv) * beta, o[j] = 0.0f, od[j] = 0.0f;
        }
        for (int64_t i = 0; i < dk; i++) {
            float *Si = S + i * dv;
            float *acc = (i & 1) ? od : o;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < dv; j++) { Si[j] = Si[j] * a + ki * kv[j]; acc[j] += Si[j] * qi; }
        }
        for (int64_t j = 0; j < dv; j++) o[j] += od[j];
    }
    /* gated RMS norm: rnd(rnd(rnd(o) * rsqrt(mean + eps)) * w) * silu(z) */
    for (int64_t j = 0; j < dv; j++) o[j] = rnd(o[j], bf16);
    const float inv = 1.0f / sqrtf(dot_f32(o, o, dv) / (float)dv + eps);
    float zs[dv];
    for (int64_t j = 0; j < dv; j++) zs[j] = load(proj, zo + j, bf16);
    silu_rows(zs, dv);
    for (int64_t j = 0; j < dv; j++) {
        const float n = rnd(rnd(o[j] * inv, bf16) * load(norm_w, j, bf16), bf16);
        store(out, oo + j, n * zs[j], bf16);
    }
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
        for (int64_t h = 0; h < 2 * Hk; h++) l2_norm(y + h * dk, dk, h < Hk ? q_scale : 1.0f);
        const int64_t zo = b * ld_proj + D, bo = zo + Hv * dv, ao = bo + Hv;
        for (int64_t h = 0; h < Hv; h++) {
            beta[h] = rnd(1.0f / (1.0f + expf(-load(proj, bo + h, bf16))), bf16);
            gate[h] = expf(neg_A[h] * softplus(load(proj, ao + h, bf16) + dt_bias[h]));
        }
        for (int64_t h = 0; h < Hv; h++) {
            const float *q = y + (h / grp) * dk, *k = y + key_dim + (h / grp) * dk, *v = y + 2 * key_dim + h * dv;
            gdn_head_out(rec_pool + (s * Hv + h) * dk * dv, dk, dv, q, k, v, gate[h], beta[h], proj, zo + h * dv,
                         norm_w, eps, out, b * Hv * dv + h * dv, bf16);
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
        gdn_decode_rows(b, b + 1, Hk, Hv, dk, dv, 0, proj, ld_proj, nullptr, nullptr, rec_pool, slots, neg_A, dt_bias,
                        norm_w, eps, out, work, 1, 1, 1);
    else
        gdn_decode_rows(b, b + 1, Hk, Hv, dk, dv, 0, proj, ld_proj, nullptr, nullptr, rec_pool, slots, neg_A, dt_bias,
                        norm_w, eps, out, work, 0, 1, 1);
}

/* gdn_decode over rows 0 <= b < B shared by up to nthreads threads (parallel_chunks); work holds nthreads
 * scratch areas of work_stride >= D + 2*Hv floats. Rows must have distinct slots. */
void gdn_decode_mt(int64_t B, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc, const void *proj,
                   int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool, const int64_t *slots,
                   const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                   int64_t work_stride, int bf16, int64_t nthreads) {
    parallel_chunks(B, nthreads, [&](int64_t b, int64_t tid) {
        gdn_decode(b, b + 1, Hk, Hv, dk, dv, Kc, proj, ld_proj, conv_w, conv_pool, rec_pool, slots, neg_A, dt_bias,
                   norm_w, eps, out, work + tid * work_stride, bf16);
    });
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
    /* state points (prefix snapshots inside rows), or pt_ptr null: row r's points are
     * pt_off/pt_dest[pt_ptr[r] .. pt_ptr[r+1]), offsets ascending; the state after pt_off tokens
     * of the row goes to entry pt_dest of snap_conv [E, D, Kc-1] / snap_rec [E, Hv, dk, dv] */
    const int64_t *pt_ptr = nullptr, *pt_off = nullptr, *pt_dest = nullptr;
    void *snap_conv = nullptr;
    float *snap_rec = nullptr;
};

static void gdn_rows_run(const gdn_rows_job *j, int64_t r, int64_t tid) { /* one row */
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

/* Tokens per block of gdn_rows_unit: a block's conv outputs are made first, then each value head
 * runs the block's tokens on its state while that state stays in the L1 cache. */
constexpr int64_t GDN_ROWS_BLOCK = 32;
/* gdn_rows_unit asks for a token's inputs this many tokens ahead (each unit reads a few hundred
 * bytes of every token's projection row, a stride the hardware's prefetch follows late) */
constexpr int64_t GDN_PREFETCH = 8;

/* Whether gdn_rows runs in (row, key head) units (else a row at a time, without state points) */
bool gdn_rows_in_units(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv) { return dk % 8 == 0 && dv % 8 == 0 && Hv % Hk == 0; }

/* gdn_rows_unit's scratch per thread, in floats: a block's channels and gates, the saved inputs */
int64_t gdn_rows_unit_work(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc) {
    const int64_t grp = Hv / Hk, nch = 2 * dk + grp * dv;
    return GDN_ROWS_BLOCK * (nch + 2 * grp) + (Kc - 1) * nch;
}

/* One key head kh of row r, all of the row's tokens: the channels that head owns (its q and k, the
 * v of its Hv/Hk value heads), their conv state, and its value heads' recurrent states. Each
 * element takes gdn_decode's operations in gdn_decode's order (the silu's eight-lane groups
 * included: dk and dv are multiples of 8), so the same result to the bit; the order across
 * heads and tokens differs, which the results do not depend on. */
template <int BF16>
static void gdn_rows_unit(const gdn_rows_job *j, int64_t r, int64_t kh, int64_t tid) {
    const int64_t Hk = j->Hk, Hv = j->Hv, dk = j->dk, dv = j->dv, K1 = j->Kc - 1, ld = j->ld_proj;
    const int64_t key_dim = Hk * dk, D = 2 * key_dim + Hv * dv, grp = Hv / Hk, nch = 2 * dk + grp * dv;
    const int64_t s = j->row_slots[r], t0 = j->row_cu[r], n = j->row_cu[r + 1] - t0, TB = GDN_ROWS_BLOCK;
    /* the unit's channels as three spans (first global channel, first local channel, length) */
    const int64_t span[3][3] = {{kh * dk, 0, dk}, {key_dim + kh * dk, dk, dk}, {2 * key_dim + kh * grp * dv, 2 * dk, grp * dv}};
    float *work = j->work + tid * j->work_stride;
    float *Y = work, *gate = Y + TB * nch, *beta = gate + TB * grp, *hist = beta + TB * grp; /* hist [K1, nch] */
    float *rec = j->rec_pool + (s * Hv + kh * grp) * dk * dv;
    if (!j->row_init[r]) { /* a new sequence starts from zero state (the slot may hold anything) */
        for (const auto &sp : span)
            memset((char *)j->conv_pool + (s * D + sp[0]) * K1 * (BF16 ? 2 : 4), 0, sp[2] * K1 * (BF16 ? 2 : 4));
        memset(rec, 0, grp * dk * dv * sizeof(float));
    }
    for (const auto &sp : span) /* the slot's saved inputs, oldest first, channel-contiguous */
        for (int64_t i = 0; i < K1; i++)
            for (int64_t c = 0; c < sp[2]; c++)
                hist[i * nch + sp[1] + c] = load(j->conv_pool, (s * D + sp[0] + c) * K1 + i, BF16);
    const float q_scale = 1.0f / sqrtf((float)dk);
    int64_t pt = j->pt_ptr ? j->pt_ptr[r] : 0;
    const int64_t pt_end = j->pt_ptr ? j->pt_ptr[r + 1] : 0;
    auto input = [&](const int64_t *sp, int64_t c, int64_t m) { /* the row's input m (< 0: saved) */
        return m < 0 ? hist[(K1 + m) * nch + sp[1] + c] : load(j->proj, (t0 + m) * ld + sp[0] + c, BF16);
    };
    auto points_at = [&](int64_t o) { /* the state after o tokens into the snapshot entries of o */
        for (; pt < pt_end && j->pt_off[pt] == o; pt++) {
            const int64_t e = j->pt_dest[pt];
            memcpy(j->snap_rec + (e * Hv + kh * grp) * dk * dv, rec, grp * dk * dv * sizeof(float));
            for (const auto &sp : span)
                for (int64_t c = 0; c < sp[2]; c++)
                    for (int64_t i = 0; i < K1; i++)
                        store(j->snap_conv, (e * D + sp[0] + c) * K1 + i, input(sp, c, o - K1 + i), BF16);
        }
    };
    points_at(0);
    for (int64_t b0 = 0, nb = 0; b0 < n; b0 += nb) {
        nb = n - b0 < TB ? n - b0 : TB; /* a block ends at the next point */
        if (pt < pt_end && j->pt_off[pt] - b0 < nb) nb = j->pt_off[pt] - b0;
        for (int64_t t = b0; t < b0 + nb; t++) { /* the block's conv, silu, q/k norms and gates */
            float *y = Y + (t - b0) * nch;
            if (t + GDN_PREFETCH < n) { /* the unit's inputs of a later token: proj rows lie a row apart */
                const char *pr = (const char *)j->proj + (t0 + t + GDN_PREFETCH) * ld * (BF16 ? 2 : 4);
                for (const auto &sp : span)
                    for (int64_t c = 0; c < sp[2]; c += 64 / (BF16 ? 2 : 4))
                        __builtin_prefetch(pr + (sp[0] + c) * (BF16 ? 2 : 4), 0, 3);
                for (int64_t c = 0; c < grp * dv; c += 64 / (BF16 ? 2 : 4)) /* its z, read by the heads' norms */
                    __builtin_prefetch(pr + (D + kh * grp * dv + c) * (BF16 ? 2 : 4), 0, 3);
            }
            for (const auto &sp : span) {
                float *yl = y + sp[1];
                for (int64_t i = 0; i <= K1; i++) {
                    const int64_t m = t - K1 + i; /* input position in the row; < 0: saved */
                    const float *wt = j->conv_wt + i * D + sp[0];
                    if (m < 0) {
                        const float *x = hist + (K1 + m) * nch + sp[1];
                        for (int64_t c = 0; c < sp[2]; c++) yl[c] = (i ? yl[c] : 0.0f) + wt[c] * x[c];
                    } else if (!BF16) {
                        const float *x = (const float *)j->proj + (t0 + m) * ld + sp[0];
                        for (int64_t c = 0; c < sp[2]; c++) yl[c] = (i ? yl[c] : 0.0f) + wt[c] * x[c];
                    } else {
                        const int64_t xo = (t0 + m) * ld + sp[0];
                        for (int64_t c = 0; c < sp[2]; c++) yl[c] = (i ? yl[c] : 0.0f) + wt[c] * load(j->proj, xo + c, 1);
                    }
                }
                if (BF16)
                    for (int64_t c = 0; c < sp[2]; c++) yl[c] = rnd(yl[c], 1);
                silu_rows(yl, sp[2]);
                if (BF16)
                    for (int64_t c = 0; c < sp[2]; c++) yl[c] = rnd(yl[c], 1);
            }
            l2_norm(y, dk, q_scale); /* q, k: L2 norm (eps 1e-6), q also scaled by dk^-1/2 */
            l2_norm(y + dk, dk, 1.0f);
            const int64_t bo = (t0 + t) * ld + D + Hv * dv + kh * grp, ao = bo + Hv;
            for (int64_t h = 0; h < grp; h++) {
                const int64_t hg = kh * grp + h;
                beta[(t - b0) * grp + h] = rnd(1.0f / (1.0f + expf(-load(j->proj, bo + h, BF16))), BF16);
                gate[(t - b0) * grp + h] = expf(j->neg_A[hg] * softplus(load(j->proj, ao + h, BF16) + j->dt_bias[hg]));
            }
        }
        for (int64_t h = 0; h < grp; h++) { /* each value head through the block on its state */
            const int64_t hg = kh * grp + h;
            for (int64_t t = b0; t < b0 + nb; t++) {
                const float *y = Y + (t - b0) * nch;
                gdn_head_out(rec + h * dk * dv, dk, dv, y, y + dk, y + 2 * dk + h * dv, gate[(t - b0) * grp + h],
                             beta[(t - b0) * grp + h], j->proj, (t0 + t) * ld + D + hg * dv, j->norm_w, j->eps,
                             j->out, (t0 + t) * Hv * dv + hg * dv, BF16);
            }
        }
        points_at(b0 + nb);
    }
    for (const auto &sp : span) /* the row's last K1 inputs become the saved ones */
        for (int64_t i = 0; i < K1; i++)
            for (int64_t c = 0; c < sp[2]; c++) store(j->conv_pool, (s * D + sp[0] + c) * K1 + i, input(sp, c, n - K1 + i), BF16);
}

/* A GDN layer after its input projection for R rows of any length (decode rows of one token,
 * prefill chunks), token by token: the recurrent form, which on a CPU with small heads costs
 * less than the chunked one. Row r covers tokens row_cu[r] <= t < row_cu[r+1] at slot
 * row_slots[r]; tok_slots [T] is each token's slot; row_init[r] = 0 starts the row from zero
 * state. proj, out, pools and weights as gdn_decode / gdn_decode_mt; work holds nthreads
 * scratch areas of work_stride >= D + 2*Hv + (Kc-1)*D floats, then Kc*D floats (the conv
 * weight transposed). A row's conv runs over its own inputs, channels contiguous; rows
 * (distinct slots) are shared by up to nthreads threads (parallel_chunks), one row at a time. */
void gdn_rows_mt(int64_t R, const int64_t *row_cu, const int64_t *row_slots, const uint8_t *row_init,
                 const int64_t *tok_slots, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                 const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                 const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                 int64_t work_stride, int bf16, int64_t nthreads, const int64_t *pt_ptr, const int64_t *pt_off,
                 const int64_t *pt_dest, void *snap_conv, float *snap_rec) {
    const int64_t D = 2 * Hk * dk + Hv * dv;
    float *conv_wt = work + (nthreads > 1 ? nthreads : 1) * work_stride; /* after the threads' scratch */
    for (int64_t c = 0; c < D; c++)
        for (int64_t i = 0; i < Kc; i++) conv_wt[i * D + c] = load(conv_w, c * Kc + i, bf16);
    const gdn_rows_job job = {work_stride, Hk,       Hv,   dk,     dv,      Kc,     ld_proj, conv_wt,
                              row_cu,      row_slots, tok_slots, row_init, proj, conv_w, norm_w, conv_pool,
                              out,         rec_pool,  work, neg_A,  dt_bias, eps,    bf16,
                              pt_ptr,      pt_off,    pt_dest, snap_conv, snap_rec};
    if (!gdn_rows_in_units(Hk, Hv, dk, dv)) { /* a row at a time (silu's lanes would fall elsewhere) */
        TORCH_CHECK(pt_ptr == nullptr, "gdn_rows: state points need head dims that are multiples of 8");
        parallel_chunks(R, nthreads, [&](int64_t r, int64_t tid) { gdn_rows_run(&job, r, tid); });
        return;
    }
    /* (row, key head) units: a long row alone still uses every thread */
    parallel_chunks(R * Hk, nthreads, [&](int64_t u, int64_t tid) {
        if (bf16) gdn_rows_unit<1>(&job, u / Hk, u % Hk, tid);
        else gdn_rows_unit<0>(&job, u / Hk, u % Hk, tid);
    });
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

}  // namespace pdserve
