/* The CPU ops on raw pointers, as ops.cpp calls them after checking the tensors.
 *
 * Shapes are documented at each definition (gdn.cpp, attention.cpp, linear.cpp, norm.cpp);
 * every array is contiguous unless a stride is given, "model dtype" arrays are float32 or
 * bfloat16 by the flag bf16, and nthreads caps the intra-op threads a call uses.
 */
#pragma once

#include <cstdint>

namespace pdserve {

void gdn_decode_mt(int64_t B, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc, const void *proj,
                   int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool, const int64_t *slots,
                   const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                   int64_t work_stride, int bf16, int64_t nthreads);

int64_t gdn_rows_unit_work(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc);
void gdn_rows_mt(int64_t R, const int64_t *row_cu, const int64_t *row_slots, const uint8_t *row_init,
                 const int64_t *tok_slots, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                 const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                 const float *neg_A, const float *dt_bias, const void *norm_w, float eps, void *out, float *work,
                 int64_t work_stride, int bf16, int64_t nthreads, const int64_t *pt_ptr = nullptr,
                 const int64_t *pt_off = nullptr, const int64_t *pt_dest = nullptr, void *snap_conv = nullptr,
                 float *snap_rec = nullptr);
bool gdn_rows_in_units(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv);

void gdn_verify(int64_t B, const int64_t *cu, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w, float eps,
                void *out, float *work, int bf16, void *conv_scratch, float *rec_scratch, int64_t n1);

void attn_decode(int64_t B, int64_t H, int64_t KVH, int64_t hd, int64_t rd, const void *qkv, int64_t ld,
                 const float *qk_norm, float eps, const void *cos, const void *sin, void *kv, int64_t s_blk,
                 int64_t s_kv, int64_t s_head, int64_t s_tok, int64_t bs, const int64_t *slot_mapping,
                 const int64_t *block_tables, int64_t bt_width, const int64_t *seq_lens, float scale, void *out,
                 float *work, int64_t work_stride, int bf16, int64_t nthreads, const int64_t *seq_starts,
                 int64_t nseq);

void add_rms_norm(int64_t b0, int64_t b1, int64_t H, const void *x, const void *h, void *xo, const float *w,
                  float eps, void *y, int bf16);
void add_rms_norm_mt(int64_t T, int64_t H, const void *x, const void *h, void *xo, const float *w, float eps,
                     void *y, int bf16, int64_t nthreads);
void silu_mul(int64_t M, int64_t I, const void *gu, int64_t ld, void *out, int bf16, int64_t nthreads);

void gemv_bf16(int64_t M, int64_t N, int64_t K, const float *x, const uint16_t *w, void *y, int bf16,
               int64_t nthreads);
void pack_f32(int64_t N, int64_t K, const float *w, float *wp);
void gemm_f32(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, float *y, int64_t nthreads);
void pack_bf16(int64_t N, int64_t K, const uint16_t *w, uint16_t *wp);
bool bf16_dot_supported();
void gemm_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *wp, uint16_t *y, int64_t nthreads,
               bool dot);
/* gemm_bf16 planned for nthreads: chunks of (a block of mb rows, a group of panels); a chunk with
 * the instruction packs its rows' x pairs into `scratch` (per_thread uint32 of the thread's own) */
struct Bf16GemmJob {
    int64_t M, N, K, K2, mb, groups, P, pstep, per_thread;
    const uint16_t *x, *wp;
    uint16_t *y;
    bool dot;
    int64_t chunks() const { return (M > 0 ? (M + mb - 1) / mb : 0) * groups; }
};
Bf16GemmJob gemm_bf16_job(int64_t M, int64_t N, int64_t K, const uint16_t *x, const uint16_t *wp, uint16_t *y,
                          int64_t nthreads, bool dot);
void gemm_bf16_chunk(const Bf16GemmJob &job, int64_t chunk, uint32_t *scratch);

/* ---- The same kernels as independent chunks, for a caller that runs several of them in one
 * parallel region (decode_layers.cpp); the functions above run these over parallel_chunks. */

/* gdn_decode_mt's rows b0 <= b < b1 on one thread, scratch work of D + 2*Hv floats */
void gdn_decode(int64_t b0, int64_t b1, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t Kc,
                const void *proj, int64_t ld_proj, const void *conv_w, void *conv_pool, float *rec_pool,
                const int64_t *slots, const float *neg_A, const float *dt_bias, const void *norm_w, float eps,
                void *out, float *work, int bf16);

struct AttnJob { /* attn_decode's arguments; a chunk is one row, or one sequence's rows */
    int64_t b0, b1, H, KVH, hd, rd, ld, bs, s_blk, s_kv, s_head, s_tok, bt_width, work_stride;
    const void *qkv, *cos, *sin;
    const float *qk_norm;
    void *kv, *out;
    const int64_t *slot_mapping, *block_tables, *seq_lens;
    float eps, scale;
    float *work; /* work_stride floats per tid */
    int bf16;
    const int64_t *seq_starts; /* nullptr, or [nseq+1]: a chunk is one sequence of consecutive rows */
    int pass;                  /* 0: all of a row; 1: its k and v stored, no more; 2: all but storing them */
};
void attn_chunk(const AttnJob &job, int64_t chunk, int64_t tid);
/* A thread attends up to ATTN_TILE_Q query vectors together (the query heads of one KV head in
 * up to attn_tile_rows rows that share their first pages), so that each key and value it loads
 * serves all of them; every row's sums keep the order a row alone has (the same bits). */
constexpr int64_t ATTN_TILE_Q = 4;
inline int64_t attn_tile_rows(int64_t grp) { return grp >= ATTN_TILE_Q ? 1 : ATTN_TILE_Q / grp; }
/* rows a chunk of a two-pass call takes (attn_two_passes) */
constexpr int64_t ATTN_PASS_ROWS = 16;
/* The floats of scratch attn_chunk needs per thread, for sequences up to max_len positions:
 * per tile row its q and k heads, and per query vector its values' sum and its scores. */
inline int64_t attn_work_stride(int64_t h, int64_t kvh, int64_t hd, int64_t max_len) {
    return attn_tile_rows(h / kvh) * ((h + kvh) * hd + h / kvh * (hd + max_len));
}
/* attn_decode's rows in sequences run in two passes (k and v first) when they are many (64 or
 * more) in fewer sequences than four per thread: one thread a sequence would leave threads idle */
inline bool attn_two_passes(int64_t B, int64_t nseq, int64_t nthreads, const int64_t *seq_starts) {
    return seq_starts && nthreads > 1 && B >= 64 && nseq < 4 * nthreads;
}

struct GemmJob { /* gemm_f32 planned for nthreads: chunks of (a block of mb rows, a group of panels) */
    int64_t M, N, K, mb, groups, P;
    const float *x, *wp;
    float *y;
    int64_t chunks() const { return (M > 0 ? (M + mb - 1) / mb : 0) * groups; }
};
GemmJob gemm_job(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, float *y, int64_t nthreads);
void gemm_chunk(const GemmJob &job, int64_t chunk);

struct SiluMulJob { /* silu_mul's arguments; a chunk is 64 rows */
    int64_t M, I, ld;
    const void *gu;
    void *out;
    int bf16;
    int64_t chunks() const { return (M + 63) / 64; }
};
void silu_mul_chunk(const SiluMulJob &job, int64_t chunk);

}  // namespace pdserve
