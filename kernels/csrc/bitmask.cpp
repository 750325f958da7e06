/* A grammar's token bitmask (bit b of word w: token 32 w + b allowed) on the CPU, without an
 * unpacked [N, V] mask:
 * - pdserve.mask_logits: -inf in place where a bit is 0. A word of all ones is skipped, a word
 *   of zeros stored as 32 -inf, so a row costs what it forbids. PyTorch reference:
 *   engine/structured/bitmask.py `forbidden` + masked_fill_.
 * - pdserve.masked_argmax: each row's first largest logit among its allowed tokens, for an
 *   all-greedy step: words of zeros are skipped, so a row the grammar narrows costs what it
 *   allows, and nothing is written. PyTorch reference: mask_logits then max(-1).indices.
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "checks.h"

namespace pdserve {
namespace {

template <typename T>
void mask_row(T *x, const int32_t *words, int64_t V) {
    const T ninf = T(-INFINITY);
    const int64_t W = (V + 31) / 32;
    for (int64_t j = 0; j < W; j++) {
        const uint32_t b = static_cast<uint32_t>(words[j]);
        if (b == 0xFFFFFFFFu) continue;
        const int64_t base = 32 * j, n = std::min<int64_t>(32, V - base);
        if (b == 0) {
            std::fill(x + base, x + base + n, ninf);
            continue;
        }
        for (uint32_t z = ~b; z; z &= z - 1) {
            const int k = __builtin_ctz(z);
            if (k < n) x[base + k] = ninf;
        }
    }
}

template <typename T>
void mask_rows(at::Tensor &x, const at::Tensor &bitmask, const at::Tensor &rows) {
    T *xp = x.data_ptr<T>();
    const int32_t *bp = bitmask.data_ptr<int32_t>();
    const int64_t *rp = rows.data_ptr<int64_t>();
    const int64_t R = rows.size(0), V = x.size(1), W = bitmask.size(1), ld = x.stride(0);
    const int64_t grain = R * V >= (1 << 18) ? 1 : R;  // small: one thread, no fork
    at::parallel_for(0, R, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; r++) mask_row(xp + rp[r] * ld, bp + r * W, V);
    });
}

template <typename T>
int64_t argmax_row(const T *x, const int32_t *words, int64_t V) {
    const int64_t W = (V + 31) / 32;
    float best = -INFINITY;
    int64_t at = -1;
    for (int64_t j = 0; j < W; j++) {
        const uint32_t b = static_cast<uint32_t>(words[j]);
        if (b == 0) continue;
        const int64_t base = 32 * j, n = std::min<int64_t>(32, V - base);
        if (b == 0xFFFFFFFFu && n == 32) {
            float m = static_cast<float>(x[base]);
            for (int k = 1; k < 32; k++) m = std::max(m, static_cast<float>(x[base + k]));  // vectorizes
            if (!(m > best) && at >= 0) continue;
            for (int k = 0; k < 32; k++) {
                const float v = static_cast<float>(x[base + k]);
                if (v > best || at < 0) best = v, at = base + k;
            }
            continue;
        }
        for (uint32_t z = b; z; z &= z - 1) {
            const int k = __builtin_ctz(z);
            if (k >= n) break;
            const float v = static_cast<float>(x[base + k]);
            if (v > best || at < 0) best = v, at = base + k;
        }
    }
    return at < 0 ? 0 : at;
}

template <typename T>
void argmax_rows(const at::Tensor &x, const at::Tensor &bitmask, at::Tensor &out) {
    const T *xp = x.data_ptr<T>();
    const int32_t *bp = bitmask.data_ptr<int32_t>();
    int64_t *op = out.data_ptr<int64_t>();
    const int64_t N = x.size(0), V = x.size(1), W = bitmask.size(1), ld = x.stride(0);
    const int64_t grain = N * V >= (1 << 18) ? 1 : N;
    at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; r++) op[r] = argmax_row(xp + r * ld, bp + r * W, V);
    });
}

/* x [N, V] float32 or bfloat16 with unit stride on its last axis, bitmask [rows, ceil(V / 32)]
 * int32 contiguous (rows -1: any number). Returns the bf16 flag. */
int check_masked(const Args &a, const at::Tensor &x, const at::Tensor &bitmask, int64_t rows) {
    const int bf16 = a.model_dtype(x, "x");
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [N, V], got ", x.sizes());
    a.unit_last_stride(x, "x");
    a.dtype(bitmask, "bitmask", at::kInt);
    a.contiguous(bitmask, "bitmask");
    a.shape(bitmask, "bitmask", {rows, (x.size(1) + 31) / 32});
    return bf16;
}

at::Tensor masked_argmax_op(const at::Tensor &x, const at::Tensor &bitmask) {
    const int bf16 = check_masked({"pdserve.masked_argmax"}, x, bitmask, x.size(0));
    auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
    if (bf16)
        argmax_rows<c10::BFloat16>(x, bitmask, out);
    else
        argmax_rows<float>(x, bitmask, out);
    return out;
}

void mask_logits_op(at::Tensor x, const at::Tensor &bitmask, const at::Tensor &rows) {
    const Args a{"pdserve.mask_logits"};
    const int bf16 = check_masked(a, x, bitmask, -1);
    a.index(rows, "rows", bitmask.size(0), 0, x.size(0));
    if (bf16)
        mask_rows<c10::BFloat16>(x, bitmask, rows);
    else
        mask_rows<float>(x, bitmask, rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
    m.impl("mask_logits", &mask_logits_op);
    m.impl("masked_argmax", &masked_argmax_op);
}

}  // namespace pdserve
