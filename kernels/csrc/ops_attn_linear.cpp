/* The CPU implementations of the attention and linear operators (schemas in library.cpp): each
 * checks its tensor arguments (checks.h), allocates its outputs and scratch, and calls the
 * kernel (kernels.h).
 */
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "common.h"
#include "kernels.h"

namespace pdserve {
namespace {

at::Tensor attn_decode_op(const at::Tensor &qkv, const at::Tensor &qk_norm, double eps, const at::Tensor &cos,
                          const at::Tensor &sin, at::Tensor &kv_pool, const at::Tensor &slot_mapping,
                          const at::Tensor &block_tables, const at::Tensor &seq_lens, int64_t h, int64_t kvh,
                          double scale, const std::optional<at::Tensor> &seq_starts) {
    const Args a{"pdserve.attn_decode"};
    TORCH_CHECK(h > 0 && kvh > 0 && h % kvh == 0, a.op, ": h=", h, " must be a positive multiple of kvh=", kvh);
    const int bf16 = a.model_dtype(qkv, "qkv");
    a.same_dtype(kv_pool, "kv_pool", qkv, "qkv");
    a.shape(kv_pool, "kv_pool", {-1, 2, kvh, -1, -1});
    a.unit_last_stride(kv_pool, "kv_pool");
    const int64_t nb = kv_pool.size(0), bs = kv_pool.size(3), hd = kv_pool.size(4);
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= 2 * (h + kvh) * hd, a.op, ": qkv must be [B, >= ",
                2 * (h + kvh) * hd, "] (q | k | gate | v), got ", qkv.sizes());
    a.unit_last_stride(qkv, "qkv");
    const int64_t B = qkv.size(0);
    a.dtype(qk_norm, "qk_norm", at::kFloat);
    a.shape(qk_norm, "qk_norm", {h + kvh, hd});
    a.contiguous(qk_norm, "qk_norm");
    for (const auto &[t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
        a.same_dtype(*t, name, qkv, "qkv");
        a.shape(*t, name, {B, -1});
        a.contiguous(*t, name);
    }
    const int64_t rd = cos.size(1);
    TORCH_CHECK(rd % 2 == 0 && rd <= hd && sin.size(1) == rd, a.op, ": cos ", cos.sizes(), " and sin ", sin.sizes(),
                " must be [B, rd] with rd even and at most hd=", hd);
    a.dtype(block_tables, "block_tables", at::kLong);
    a.shape(block_tables, "block_tables", {B, -1});
    a.contiguous(block_tables, "block_tables");
    a.range(block_tables, "block_tables", 0, nb);
    const int64_t width = block_tables.size(1);
    a.index(slot_mapping, "slot_mapping", B, 0, nb * bs);
    a.index(seq_lens, "seq_lens", B, 1, width * bs + 1);
    const int64_t *starts = nullptr;
    int64_t nseq = B;
    if (seq_starts.has_value()) {
        a.index(*seq_starts, "seq_starts", -1, 0, B + 1);
        nseq = seq_starts->size(0) - 1;
        starts = seq_starts->data_ptr<int64_t>();
        TORCH_CHECK(nseq >= 0 && starts[0] == 0 && starts[nseq] == B, a.op, ": seq_starts must run from 0 to B=", B);
        for (int64_t i = 0; i < nseq; i++)
            TORCH_CHECK(starts[i] <= starts[i + 1], a.op, ": seq_starts must not decrease (at ", i, ")");
    }
    auto out = at::empty({B, h * hd}, qkv.options());
    int64_t positions = 0; /* the scores and the weighted values: 4 flops per position and dim */
    for (int64_t b = 0; b < B; b++) positions += seq_lens.data_ptr<int64_t>()[b];
    /* threads: one per sequence at most, or per row where rows in sequences run in two passes */
    const int64_t nt = row_threads(attn_two_passes(B, nseq, at::get_num_threads(), starts) ? B : nseq,
                                   positions * h * hd * 4);
    const int64_t stride = attn_work_stride(h, kvh, hd, width * bs);
    auto work = at::empty({nt * stride}, at::kFloat);
    attn_decode(B, h, kvh, hd, rd, qkv.data_ptr(), qkv.stride(0), qk_norm.data_ptr<float>(), (float)eps,
                cos.data_ptr(), sin.data_ptr(), kv_pool.data_ptr(), kv_pool.stride(0), kv_pool.stride(1),
                kv_pool.stride(2), kv_pool.stride(3), bs, slot_mapping.data_ptr<int64_t>(),
                block_tables.data_ptr<int64_t>(), width, seq_lens.data_ptr<int64_t>(), (float)scale, out.data_ptr(),
                work.data_ptr<float>(), stride, bf16, nt, starts, nseq);
    return out;
}

at::Tensor gemv_bf16_op(const at::Tensor &x, const at::Tensor &w, at::ScalarType out_dtype, int64_t threads) {
    const Args a{"pdserve.gemv_bf16"};
    a.dtype(x, "x", at::kFloat);
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [M, K], got ", x.sizes());
    a.contiguous(x, "x");
    a.dtype(w, "w", at::kBFloat16);
    a.shape(w, "w", {-1, x.size(1)});
    a.contiguous(w, "w");
    TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, a.op,
                ": out_dtype must be float32 or bfloat16, got ", out_dtype);
    const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
    auto y = at::empty({M, N}, x.options().dtype(out_dtype));
    gemv_bf16(M, N, K, x.data_ptr<float>(), (const uint16_t *)w.data_ptr(), y.data_ptr(), out_dtype == at::kBFloat16,
              threads);
    return y;
}

/* pack_f32 / pack_bf16: w [N, K] of dtype dt checked, its panels [ceil(N/16), K, 16] allocated */
at::Tensor panels_for(const Args &a, const at::Tensor &w, at::ScalarType dt) {
    a.dtype(w, "w", dt);
    TORCH_CHECK(w.dim() == 2, a.op, ": w must be [N, K], got ", w.sizes());
    a.contiguous(w, "w");
    return at::empty({(w.size(0) + 15) / 16, w.size(1), 16}, w.options());
}

/* gemm_f32 / gemm_bf16w: x [M, K] float32 and panels wp of dtype dt for n outputs checked, y allocated */
at::Tensor gemm_out(const Args &a, const at::Tensor &x, const at::Tensor &wp, int64_t n, at::ScalarType dt) {
    a.dtype(x, "x", at::kFloat);
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [M, K], got ", x.sizes());
    a.contiguous(x, "x");
    a.dtype(wp, "wp", dt);
    a.shape(wp, "wp (packed for n)", {(n + 15) / 16, x.size(1), 16});
    a.contiguous(wp, "wp");
    return at::empty({x.size(0), n}, x.options());
}

at::Tensor pack_f32_op(const at::Tensor &w) {
    auto wp = panels_for(Args{"pdserve.pack_f32"}, w, at::kFloat);
    pack_f32(w.size(0), w.size(1), w.data_ptr<float>(), wp.data_ptr<float>());
    return wp;
}

at::Tensor gemm_f32_op(const at::Tensor &x, const at::Tensor &wp, int64_t n, int64_t threads) {
    auto y = gemm_out(Args{"pdserve.gemm_f32"}, x, wp, n, at::kFloat);
    gemm_f32(x.size(0), n, x.size(1), x.data_ptr<float>(), wp.data_ptr<float>(), y.data_ptr<float>(), threads);
    return y;
}

at::Tensor pack_bf16_op(const at::Tensor &w) {
    const Args a{"pdserve.pack_bf16"};
    a.dtype(w, "w", at::kBFloat16);
    TORCH_CHECK(w.dim() == 2, a.op, ": w must be [N, K], got ", w.sizes());
    a.contiguous(w, "w");
    auto wp = at::empty({(w.size(0) + 15) / 16, (w.size(1) + 1) / 2, 16, 2}, w.options());
    pack_bf16(w.size(0), w.size(1), (const uint16_t *)w.data_ptr(), (uint16_t *)wp.data_ptr());
    return wp;
}

at::Tensor gemm_bf16_op(const at::Tensor &x, const at::Tensor &wp, int64_t n, int64_t threads, bool dot) {
    const Args a{"pdserve.gemm_bf16"};
    a.dtype(x, "x", at::kBFloat16);
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [M, K], got ", x.sizes());
    a.contiguous(x, "x");
    a.dtype(wp, "wp", at::kBFloat16);
    a.shape(wp, "wp (packed for n)", {(n + 15) / 16, (x.size(1) + 1) / 2, 16, 2});
    a.contiguous(wp, "wp");
    TORCH_CHECK(!dot || bf16_dot_supported(), a.op, ": dot=True needs AVX512-BF16, which this CPU lacks");
    auto y = at::empty({x.size(0), n}, x.options());
    gemm_bf16(x.size(0), n, x.size(1), (const uint16_t *)x.data_ptr(), (const uint16_t *)wp.data_ptr(),
              (uint16_t *)y.data_ptr(), threads, dot);
    return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
    m.impl("attn_decode", &attn_decode_op);
    m.impl("gemv_bf16", &gemv_bf16_op);
    m.impl("pack_f32", &pack_f32_op);
    m.impl("gemm_f32", &gemm_f32_op);
    m.impl("pack_bf16", &pack_bf16_op);
    m.impl("gemm_bf16", &gemm_bf16_op);
}

}  // namespace pdserve
