/* Argument checks at the boundary of the pdserve CPU ops (ops.cpp): device, dtype, layout,
 * shape and index range, each failure a c10::Error (RuntimeError in Python) that names the
 * op, the argument and what it got.
 */
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace pdserve {

struct Args {
    const char *op;

    void cpu(const at::Tensor &t, const char *name) const {
        TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ", t.device());
    }

    /* float32 or bfloat16; returns the bf16 flag the kernels take */
    int model_dtype(const at::Tensor &t, const char *name) const {
        cpu(t, name);
        TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, op, ": ", name,
                    " must be float32 or bfloat16, got ", t.scalar_type());
        return t.scalar_type() == at::kBFloat16;
    }

    void dtype(const at::Tensor &t, const char *name, at::ScalarType want) const {
        cpu(t, name);
        TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
    }

    void same_dtype(const at::Tensor &t, const char *name, const at::Tensor &ref, const char *ref_name) const {
        cpu(t, name);
        TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
                    ref.scalar_type(), ", got ", t.scalar_type());
    }

    void contiguous(const at::Tensor &t, const char *name) const {
        TORCH_CHECK(t.is_contiguous(), op, ": ", name, " ", t.sizes(), " must be contiguous, got strides ",
                    t.strides());
    }

    void unit_last_stride(const at::Tensor &t, const char *name) const {
        TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, op, ": ", name, " ", t.sizes(),
                    " must have unit stride on its last axis, got strides ", t.strides());
    }

    /* t's shape is `want`, where -1 matches any size */
    void shape(const at::Tensor &t, const char *name, std::vector<int64_t> want) const {
        bool ok = t.dim() == (int64_t)want.size();
        for (size_t i = 0; ok && i < want.size(); i++) ok = want[i] < 0 || t.size(i) == want[i];
        TORCH_CHECK(ok, op, ": ", name, " must be ", shape_str(want), ", got ", t.sizes());
    }

    /* a contiguous int64 tensor of `n` values (n < 0: any number), each in [lo, hi) */
    void index(const at::Tensor &t, const char *name, int64_t n, int64_t lo, int64_t hi) const {
        dtype(t, name, at::kLong);
        contiguous(t, name);
        TORCH_CHECK(t.dim() == 1 && (n < 0 || t.size(0) == n), op, ": ", name, " must be [", n, "], got ",
                    t.sizes());
        range(t, name, lo, hi);
    }

    void range(const at::Tensor &t, const char *name, int64_t lo, int64_t hi) const {
        const int64_t *p = t.data_ptr<int64_t>();
        for (int64_t i = 0, n = t.numel(); i < n; i++)
            TORCH_CHECK(p[i] >= lo && p[i] < hi, op, ": ", name, "[", i, "] = ", p[i], " is outside [", lo, ", ",
                        hi, ")");
    }

    static std::string shape_str(const std::vector<int64_t> &want) {
        std::string s = "[";
        for (size_t i = 0; i < want.size(); i++)
            s += (i ? ", " : "") + (want[i] < 0 ? std::string("*") : std::to_string(want[i]));
        return s + "]";
    }
};

}  // namespace pdserve
