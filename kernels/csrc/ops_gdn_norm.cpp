/* The CPU implementations of the GDN, norm and MLP-gate operators (schemas in library.cpp):
 * each checks its tensor arguments (checks.h), allocates its outputs and scratch, and calls
 * the kernel (kernels.h) with torch's intra-op thread count.
 */
#include <ATen/ATen.h>
#include <torch/library.h>

#include "checks.h"
#include "common.h"
#include "kernels.h"

namespace pdserve {
namespace {

/* The checks the three GDN ops share: proj [T, D + Hv*dv + 2*Hv] rows [qkv | z | b | a],
 * conv_w [D, Kc], conv_pool [S, D, Kc-1] (proj's dtype), rec_pool [S, Hv, dk, dv] float32,
 * neg_A / dt_bias [Hv] float32, norm_w [dv] (proj's dtype). Returns the bf16 flag. */
int check_gdn(const Args &a, const at::Tensor &proj, const at::Tensor &conv_w, const at::Tensor &conv_pool,
              const at::Tensor &rec_pool, const at::Tensor &neg_A, const at::Tensor &dt_bias,
              const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk, int64_t dv) {
    TORCH_CHECK(hk > 0 && hv > 0 && dk > 0 && dv > 0 && hv % hk == 0, a.op, ": heads hk=", hk, " hv=", hv,
                " and dims dk=", dk, " dv=", dv, " must be positive with hv a multiple of hk");
    const int bf16 = a.model_dtype(proj, "proj");
    const int64_t D = 2 * hk * dk + hv * dv;
    a.shape(proj, "proj", {-1, D + hv * dv + 2 * hv});
    a.unit_last_stride(proj, "proj");
    a.same_dtype(conv_w, "conv_w", proj, "proj");
    a.shape(conv_w, "conv_w", {D, -1});
    a.contiguous(conv_w, "conv_w");
    TORCH_CHECK(conv_w.size(1) >= 1, a.op, ": conv_w ", conv_w.sizes(), " has no taps");
    a.same_dtype(conv_pool, "conv_pool", proj, "proj");
    a.shape(conv_pool, "conv_pool", {-1, D, conv_w.size(1) - 1});
    a.contiguous(conv_pool, "conv_pool");
    a.dtype(rec_pool, "rec_pool", at::kFloat);
    a.shape(rec_pool, "rec_pool", {conv_pool.size(0), hv, dk, dv});
    a.contiguous(rec_pool, "rec_pool");
    for (const auto &[t, name] : {std::pair{&neg_A, "neg_A"}, std::pair{&dt_bias, "dt_bias"}}) {
        a.dtype(*t, name, at::kFloat);
        a.shape(*t, name, {hv});
        a.contiguous(*t, name);
    }
    a.same_dtype(norm_w, "norm_w", proj, "proj");
    a.shape(norm_w, "norm_w", {dv});
    a.contiguous(norm_w, "norm_w");
    return bf16;
}

float *floats(const at::Tensor &t) { return t.data_ptr<float>(); }

at::Tensor scratch(int64_t n) { return at::empty({n > 0 ? n : 1}, at::kFloat); }

at::Tensor gdn_decode_op(const at::Tensor &proj, const at::Tensor &conv_w, at::Tensor &conv_pool,
                         at::Tensor &rec_pool, const at::Tensor &slots, const at::Tensor &neg_A,
                         const at::Tensor &dt_bias, const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk,
                         int64_t dv, double eps) {
    const Args a{"pdserve.gdn_decode"};
    const int bf16 = check_gdn(a, proj, conv_w, conv_pool, rec_pool, neg_A, dt_bias, norm_w, hk, hv, dk, dv);
    const int64_t B = proj.size(0), D = conv_w.size(0);
    a.index(slots, "slots", B, 0, conv_pool.size(0));
    auto out = at::empty({B, hv * dv}, proj.options());
    const int64_t nt = row_threads(B, B * hv * dk * dv * 4), stride = D + 2 * hv; /* the delta rule's */
    auto work = scratch(nt * stride);
    gdn_decode_mt(B, hk, hv, dk, dv, conv_w.size(1), proj.data_ptr(), proj.stride(0), conv_w.data_ptr(),
                  conv_pool.data_ptr(), floats(rec_pool), slots.data_ptr<int64_t>(), floats(neg_A), floats(dt_bias),
                  norm_w.data_ptr(), (float)eps, out.data_ptr(), floats(work), stride, bf16, nt);
    return out;
}

struct RowPoints { /* gdn_rows_points' state points, checked (gdn_rows: none) */
    const int64_t *ptr = nullptr, *off = nullptr, *dest = nullptr;
    void *snap_conv = nullptr;
    float *snap_rec = nullptr;
};

static at::Tensor gdn_rows_impl(const at::Tensor &proj, const at::Tensor &row_cu,
                                const at::Tensor &row_slots, const at::Tensor &row_init, const at::Tensor &tok_slots,
                                const at::Tensor &conv_w, at::Tensor &conv_pool, at::Tensor &rec_pool,
                                const at::Tensor &neg_A, const at::Tensor &dt_bias, const at::Tensor &norm_w,
                                int64_t hk, int64_t hv, int64_t dk, int64_t dv, double eps, const int bf16,
                                const RowPoints &pts) {
    const int64_t T = proj.size(0), D = conv_w.size(0), kc = conv_w.size(1);
    const int64_t R = row_slots.size(0), *cu = row_cu.data_ptr<int64_t>();
    auto out = at::empty({T, hv * dv}, proj.options());
    const int64_t nt = row_threads(R * hk);
    const int64_t stride = gdn_rows_in_units(hk, hv, dk, dv) ? gdn_rows_unit_work(hk, hv, dk, dv, kc) /* per thread */
                                                             : D + 2 * hv + (kc - 1) * D; /* a row at a time */
    auto work = scratch(nt * stride + kc * D); /* and the conv weight transposed */
    gdn_rows_mt(R, cu, row_slots.data_ptr<int64_t>(), (const uint8_t *)row_init.data_ptr<bool>(),
                tok_slots.data_ptr<int64_t>(), hk, hv, dk, dv, kc, proj.data_ptr(), proj.stride(0),
                conv_w.data_ptr(), conv_pool.data_ptr(), floats(rec_pool), floats(neg_A), floats(dt_bias),
                norm_w.data_ptr(), (float)eps, out.data_ptr(), floats(work), stride, bf16, nt, pts.ptr, pts.off,
                pts.dest, pts.snap_conv, pts.snap_rec);
    return out;
}

/* gdn_rows' checks of its rows; returns bf16 */
static int check_rows(const Args &a, const at::Tensor &proj, const at::Tensor &row_cu, const at::Tensor &row_slots,
                      const at::Tensor &row_init, const at::Tensor &tok_slots, const at::Tensor &conv_w,
                      const at::Tensor &conv_pool, const at::Tensor &rec_pool, const at::Tensor &neg_A,
                      const at::Tensor &dt_bias, const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk,
                      int64_t dv) {
    const int bf16 = check_gdn(a, proj, conv_w, conv_pool, rec_pool, neg_A, dt_bias, norm_w, hk, hv, dk, dv);
    const int64_t T = proj.size(0), S = conv_pool.size(0);
    a.index(row_slots, "row_slots", -1, 0, S);
    const int64_t R = row_slots.size(0);
    a.index(row_cu, "row_cu", R + 1, 0, T + 1);
    const int64_t *cu = row_cu.data_ptr<int64_t>();
    TORCH_CHECK(cu[0] == 0 && cu[R] == T, a.op, ": row_cu must run from 0 to proj's ", T, " rows, got ", cu[0],
                " .. ", cu[R]);
    for (int64_t r = 0; r < R; r++)
        TORCH_CHECK(cu[r] <= cu[r + 1], a.op, ": row_cu must not decrease (row ", r, ": ", cu[r], " > ", cu[r + 1],
                    ")");
    a.dtype(row_init, "row_init", at::kBool);
    a.contiguous(row_init, "row_init");
    a.shape(row_init, "row_init", {R});
    a.index(tok_slots, "tok_slots", T, 0, S);
    return bf16;
}

at::Tensor gdn_rows_op(const at::Tensor &proj, const at::Tensor &row_cu, const at::Tensor &row_slots,
                       const at::Tensor &row_init, const at::Tensor &tok_slots, const at::Tensor &conv_w,
                       at::Tensor &conv_pool, at::Tensor &rec_pool, const at::Tensor &neg_A, const at::Tensor &dt_bias,
                       const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk, int64_t dv, double eps) {
    const Args a{"pdserve.gdn_rows"};
    const int bf16 = check_rows(a, proj, row_cu, row_slots, row_init, tok_slots, conv_w, conv_pool, rec_pool, neg_A,
                                dt_bias, norm_w, hk, hv, dk, dv);
    return gdn_rows_impl(proj, row_cu, row_slots, row_init, tok_slots, conv_w, conv_pool, rec_pool, neg_A, dt_bias,
                         norm_w, hk, hv, dk, dv, eps, bf16, RowPoints{});
}

at::Tensor gdn_rows_points_op(const at::Tensor &proj, const at::Tensor &row_cu, const at::Tensor &row_slots,
                              const at::Tensor &row_init, const at::Tensor &tok_slots, const at::Tensor &conv_w,
                              at::Tensor &conv_pool, at::Tensor &rec_pool, const at::Tensor &neg_A,
                              const at::Tensor &dt_bias, const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk,
                              int64_t dv, double eps, const at::Tensor &pt_ptr, const at::Tensor &pt_off,
                              const at::Tensor &pt_dest, at::Tensor &snap_conv, at::Tensor &snap_rec) {
    const Args a{"pdserve.gdn_rows_points"};
    const int bf16 = check_rows(a, proj, row_cu, row_slots, row_init, tok_slots, conv_w, conv_pool, rec_pool, neg_A,
                                dt_bias, norm_w, hk, hv, dk, dv);
    TORCH_CHECK(gdn_rows_in_units(hk, hv, dk, dv), a.op, ": state points need dk and dv multiples of 8, got ", dk,
                " and ", dv);
    const int64_t R = row_slots.size(0), kc = conv_w.size(1), *cu = row_cu.data_ptr<int64_t>();
    a.same_dtype(snap_conv, "snap_conv", conv_pool, "conv_pool");
    a.shape(snap_conv, "snap_conv", {-1, conv_w.size(0), kc - 1});
    a.contiguous(snap_conv, "snap_conv");
    a.dtype(snap_rec, "snap_rec", at::kFloat);
    a.shape(snap_rec, "snap_rec", {snap_conv.size(0), hv, dk, dv});
    a.contiguous(snap_rec, "snap_rec");
    const int64_t M = pt_off.numel();
    a.index(pt_ptr, "pt_ptr", R + 1, 0, M + 1);
    a.index(pt_off, "pt_off", M, 0, proj.size(0) + 1);
    a.index(pt_dest, "pt_dest", M, 0, snap_conv.size(0));
    const int64_t *ptr = pt_ptr.data_ptr<int64_t>(), *off = pt_off.data_ptr<int64_t>();
    TORCH_CHECK(ptr[0] == 0 && ptr[R] == M, a.op, ": pt_ptr must run from 0 to ", M, ", got ", ptr[0], " .. ", ptr[R]);
    for (int64_t r = 0; r < R; r++) {
        TORCH_CHECK(ptr[r] <= ptr[r + 1], a.op, ": pt_ptr must not decrease (row ", r, ")");
        for (int64_t m = ptr[r]; m < ptr[r + 1]; m++)
            TORCH_CHECK(off[m] <= cu[r + 1] - cu[r] && (m == ptr[r] || off[m - 1] <= off[m]), a.op, ": pt_off[", m,
                        "] = ", off[m], " must ascend within row ", r, " and not pass its ", cu[r + 1] - cu[r],
                        " tokens");
    }
    const RowPoints pts{ptr, off, pt_dest.data_ptr<int64_t>(), snap_conv.data_ptr(), floats(snap_rec)};
    return gdn_rows_impl(proj, row_cu, row_slots, row_init, tok_slots, conv_w, conv_pool, rec_pool, neg_A, dt_bias,
                         norm_w, hk, hv, dk, dv, eps, bf16, pts);
}

at::Tensor gdn_verify_op(const at::Tensor &proj, const at::Tensor &conv_w, at::Tensor &conv_pool,
                         at::Tensor &rec_pool, const at::Tensor &slots, const at::Tensor &cu_seqlens,
                         at::Tensor &conv_scratch, at::Tensor &rec_scratch, const at::Tensor &neg_A,
                         const at::Tensor &dt_bias, const at::Tensor &norm_w, int64_t hk, int64_t hv, int64_t dk,
                         int64_t dv, double eps) {
    const Args a{"pdserve.gdn_verify"};
    const int bf16 = check_gdn(a, proj, conv_w, conv_pool, rec_pool, neg_A, dt_bias, norm_w, hk, hv, dk, dv);
    const int64_t T = proj.size(0), D = conv_w.size(0), kc = conv_w.size(1);
    a.index(slots, "slots", -1, 0, conv_pool.size(0));
    const int64_t B = slots.size(0);
    a.index(cu_seqlens, "cu_seqlens", B + 1, 0, T + 1);
    a.same_dtype(conv_scratch, "conv_scratch", proj, "proj");
    a.contiguous(conv_scratch, "conv_scratch");
    a.shape(conv_scratch, "conv_scratch", {-1, -1, D, kc - 1});
    const int64_t n1 = conv_scratch.size(1);
    a.dtype(rec_scratch, "rec_scratch", at::kFloat);
    a.contiguous(rec_scratch, "rec_scratch");
    a.shape(rec_scratch, "rec_scratch", {-1, n1, hv, dk, dv});
    TORCH_CHECK(conv_scratch.size(0) >= B && rec_scratch.size(0) >= B, a.op, ": scratch ", conv_scratch.sizes(),
                " / ", rec_scratch.sizes(), " has fewer than the ", B, " rows");
    const int64_t *cu = cu_seqlens.data_ptr<int64_t>();
    TORCH_CHECK(cu[0] == 0 && cu[B] == T, a.op, ": cu_seqlens must run from 0 to proj's ", T, " rows");
    for (int64_t b = 0; b < B; b++)
        TORCH_CHECK(cu[b] <= cu[b + 1] && cu[b + 1] - cu[b] <= n1 + 1, a.op, ": row ", b, " has ", cu[b + 1] - cu[b],
                    " tokens; the scratch [", n1, "] holds rows of at most ", n1 + 1);
    auto out = at::empty({T, hv * dv}, proj.options());
    auto work = scratch(D + 2 * hv);
    gdn_verify(B, cu, hk, hv, dk, dv, kc, proj.data_ptr(), proj.stride(0), conv_w.data_ptr(), conv_pool.data_ptr(),
               floats(rec_pool), slots.data_ptr<int64_t>(), floats(neg_A), floats(dt_bias), norm_w.data_ptr(),
               (float)eps, out.data_ptr(), floats(work), bf16, conv_scratch.data_ptr(), floats(rec_scratch), n1);
    return out;
}

/* x [T, H] (and h), w [H] float32: the checks of add_rms_norm and rms_norm */
int check_norm(const Args &a, const at::Tensor &x, const at::Tensor &w) {
    const int bf16 = a.model_dtype(x, "x");
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [T, H], got ", x.sizes());
    a.contiguous(x, "x");
    a.dtype(w, "w", at::kFloat);
    a.shape(w, "w", {x.size(1)});
    a.contiguous(w, "w");
    return bf16;
}

void norm_rows(const at::Tensor &x, const at::Tensor *h, at::Tensor &xo, const at::Tensor &w, double eps,
               at::Tensor &y, int bf16) {
    const int64_t T = x.size(0), H = x.size(1);
    const void *hp = h ? h->data_ptr() : nullptr;
    if (T * H >= 1 << 16) /* a prefill's rows: blocks of 64 rows over torch's threads */
        add_rms_norm_mt(T, H, x.data_ptr(), hp, xo.data_ptr(), floats(w), (float)eps, y.data_ptr(), bf16,
                        at::get_num_threads());
    else
        add_rms_norm(0, T, H, x.data_ptr(), hp, xo.data_ptr(), floats(w), (float)eps, y.data_ptr(), bf16);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor &x, const at::Tensor &h, const at::Tensor &w,
                                                   double eps) {
    const Args a{"pdserve.add_rms_norm"};
    const int bf16 = check_norm(a, x, w);
    a.same_dtype(h, "h", x, "x");
    a.shape(h, "h", {x.size(0), x.size(1)});
    a.contiguous(h, "h");
    auto xo = at::empty_like(x), y = at::empty_like(x);
    norm_rows(x, &h, xo, w, eps, y, bf16);
    return {xo, y};
}

at::Tensor rms_norm_op(const at::Tensor &x, const at::Tensor &w, double eps) {
    const Args a{"pdserve.rms_norm"};
    const int bf16 = check_norm(a, x, w);
    auto y = at::empty_like(x);
    at::Tensor xo = x; /* read only: without h the kernel does not write xo */
    norm_rows(x, nullptr, xo, w, eps, y, bf16);
    return y;
}

at::Tensor silu_mul_op(const at::Tensor &gu) {
    const Args a{"pdserve.silu_mul"};
    const int bf16 = a.model_dtype(gu, "gu");
    TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, a.op, ": gu must be [M, 2I], got ", gu.sizes());
    a.unit_last_stride(gu, "gu");
    const int64_t M = gu.size(0), I = gu.size(1) / 2;
    auto out = at::empty({M, I}, gu.options());
    silu_mul(M, I, gu.data_ptr(), gu.stride(0), out.data_ptr(), bf16, M * 2 * I >= 1 << 16 ? at::get_num_threads() : 1);
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
    m.impl("gdn_decode", &gdn_decode_op);
    m.impl("gdn_rows", &gdn_rows_op);
    m.impl("gdn_rows_points", &gdn_rows_points_op);
    m.impl("gdn_verify", &gdn_verify_op);
    m.impl("add_rms_norm", &add_rms_norm_op);
    m.impl("rms_norm", &rms_norm_op);
    m.impl("silu_mul", &silu_mul_op);
}

}  // namespace pdserve
