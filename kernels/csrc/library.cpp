/* The schemas of the pdserve CPU operators, called from Python as torch.ops.pdserve.NAME
 * (kernels/cpu_ops.py documents each one and names its PyTorch reference). `Tensor(a!)`
 * marks a cache pool or scratch the op updates in place; every other output is a new tensor.
 * The CPU implementations are registered beside their checks (ops_gdn_norm.cpp,
 * ops_attn_linear.cpp).
 */
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY(pdserve, m) {
    m.def(
        "gdn_decode(Tensor proj, Tensor conv_w, Tensor(a!) conv_pool, Tensor(b!) rec_pool, Tensor slots, "
        "Tensor neg_A, Tensor dt_bias, Tensor norm_w, int hk, int hv, int dk, int dv, float eps) -> Tensor");
    m.def(
        "gdn_rows(Tensor proj, Tensor row_cu, Tensor row_slots, Tensor row_init, Tensor tok_slots, Tensor conv_w, "
        "Tensor(a!) conv_pool, Tensor(b!) rec_pool, Tensor neg_A, Tensor dt_bias, Tensor norm_w, int hk, int hv, "
        "int dk, int dv, float eps) -> Tensor");
    m.def(
        "gdn_rows_points(Tensor proj, Tensor row_cu, Tensor row_slots, Tensor row_init, Tensor tok_slots, "
        "Tensor conv_w, Tensor(a!) conv_pool, Tensor(b!) rec_pool, Tensor neg_A, Tensor dt_bias, Tensor norm_w, "
        "int hk, int hv, int dk, int dv, float eps, Tensor pt_ptr, Tensor pt_off, Tensor pt_dest, "
        "Tensor(c!) snap_conv, Tensor(d!) snap_rec) -> Tensor");
    m.def(
        "gdn_verify(Tensor proj, Tensor conv_w, Tensor(a!) conv_pool, Tensor(b!) rec_pool, Tensor slots, "
        "Tensor cu_seqlens, Tensor(c!) conv_scratch, Tensor(d!) rec_scratch, Tensor neg_A, Tensor dt_bias, "
        "Tensor norm_w, int hk, int hv, int dk, int dv, float eps) -> Tensor");
    m.def(
        "attn_decode(Tensor qkv, Tensor qk_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) kv_pool, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int h, int kvh, float scale, "
        "Tensor? seq_starts=None) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor h, Tensor w, float eps) -> (Tensor, Tensor)");
    m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
    m.def("silu_mul(Tensor gu) -> Tensor");
    m.def("gemv_bf16(Tensor x, Tensor w, ScalarType out_dtype, int threads) -> Tensor");
    m.def("pack_f32(Tensor w) -> Tensor");
    m.def("gemm_f32(Tensor x, Tensor wp, int n, int threads) -> Tensor");
    m.def("pack_bf16(Tensor w) -> Tensor");
    m.def("gemm_bf16(Tensor x, Tensor wp, int n, int threads, bool dot) -> Tensor");
    m.def("bf16_dot_supported() -> bool", &pdserve::bf16_dot_supported); /* no tensor: one kernel for all */
    m.def("mask_logits(Tensor(a!) x, Tensor bitmask, Tensor rows) -> ()");
    m.def("masked_argmax(Tensor x, Tensor bitmask) -> Tensor");
    m.def("topk(Tensor x, int k) -> (Tensor, Tensor)");
    m.def("top_p_draw(Tensor p, Tensor top_p, Tensor min_p, Tensor u) -> (Tensor, Tensor, Tensor)");
}
