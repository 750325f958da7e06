/* The sampler's top-k on the CPU (kernels/cpu_ops.py topk):
 * - pdserve.topk: each row's k largest values of x [N, V], descending, ties to the lower id, NaN
 *   as -inf; one pass over the row. The k best so far are kept sorted; a run of 16 values whose
 *   largest does not beat the k-th best (a later id never wins a tie) is passed over after one
 *   max, so most of a row costs what reading it does. PyTorch reference:
 *   engine/sampling/filters.py topk_reference (a stable sort).
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "checks.h"

namespace pdserve {
namespace {

constexpr int64_t RUN = 16;

/* Insert (v, id) into the n best kept (best[0] largest), n < k or v beating best[k - 1]. */
inline void keep(float *best, int64_t *ids, int64_t &n, int64_t k, float v, int64_t id) {
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && best[j - 1] < v) {  // an equal value kept earlier has the lower id: it stays ahead
        best[j] = best[j - 1];
        ids[j] = ids[j - 1];
        j--;
    }
    best[j] = v;
    ids[j] = id;
}

template <typename T>
void topk_row(const T *x, int64_t V, int64_t k, float *best, int64_t *ids) {
    int64_t n = 0, i = 0;
    for (; i < V && n < k; i++) {  // the first k, whatever they are
        const float v = static_cast<float>(x[i]);
        keep(best, ids, n, k, v == v ? v : -INFINITY, i);
    }
    for (; i + RUN <= V; i += RUN) {
        float m = -INFINITY;
        for (int64_t j = 0; j < RUN; j++) {
            const float v = static_cast<float>(x[i + j]);
            m = v > m ? v : m;  // vectorizes; a NaN never wins
        }
        if (!(m > best[k - 1])) continue;
        for (int64_t j = 0; j < RUN; j++) {
            const float v = static_cast<float>(x[i + j]);
            if (v > best[k - 1]) keep(best, ids, n, k, v, i + j);
        }
    }
    for (; i < V; i++) {
        const float v = static_cast<float>(x[i]);
        if (v > best[k - 1]) keep(best, ids, n, k, v, i);
    }
}

template <typename T>
void topk_rows(const at::Tensor &x, int64_t k, at::Tensor &vals, at::Tensor &ids) {
    const T *xp = x.data_ptr<T>();
    float *vp = vals.data_ptr<float>();
    int64_t *ip = ids.data_ptr<int64_t>();
    const int64_t N = x.size(0), V = x.size(1), ld = x.stride(0);
    const int64_t grain = N * V >= (1 << 18) ? 1 : N;
    at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
        for (int64_t r = lo; r < hi; r++) topk_row(xp + r * ld, V, k, vp + r * k, ip + r * k);
    });
}

std::tuple<at::Tensor, at::Tensor> topk_op(const at::Tensor &x, int64_t k) {
    const Args a{"pdserve.topk"};
    const int bf16 = a.model_dtype(x, "x");
    TORCH_CHECK(x.dim() == 2, a.op, ": x must be [N, V], got ", x.sizes());
    a.unit_last_stride(x, "x");
    TORCH_CHECK(k >= 1 && k <= x.size(1), a.op, ": k must be in 1..", x.size(1), ", got ", k);
    auto vals = at::empty({x.size(0), k}, x.options().dtype(at::kFloat));
    auto ids = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
    if (bf16)
        topk_rows<c10::BFloat16>(x, k, vals, ids);
    else
        topk_rows<float>(x, k, vals, ids);
    return {vals, ids};
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("topk", &topk_op); }

}  // namespace pdserve
