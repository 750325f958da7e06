/* torch.classes.pdserve.DecodeLayers: a whole float32 or bfloat16 decode step through the decoder layers,
 * one token per row, in one call. Per layer it runs the kernels of the per-op path in the
 * order engine/model/qwen3_5.py run_layer calls them one by one from Python
 *     h = norm(x);  mix = gdn_decode / attn_decode(h @ w_in^T);  x = x + mix @ w_out^T;
 *     h = norm(x);  x = x + silu_mul(h @ w_gu^T) @ w_down^T
 * with the same arithmetic, so its result is the same to the bit; it only saves the Python
 * between them and the threads' wake-ups (about a third of a step at one row, a fifth of its
 * wall time at 16). The per-op path (engine/model/layers.py) is the reference. Dense MLPs, one
 * tensor-parallel rank; float32 packed weights (pack_f32), or bfloat16 ones (pack_bf16, the
 * batch-invariant mode's) with the activations in bfloat16 where the per-op path keeps them.
 * kernels/cpu_decode.py builds it from a model's layers (add_gdn / add_attn) and steps it through
 * the decode_layers_run operator.
 */
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "checks.h"
#include "common.h"
#include "kernels.h"

namespace pdserve {
namespace {

struct Layer {
    bool attn;
    at::Tensor in_norm, post_norm, w_in, w_out, w_gu, w_down; /* norms [H] (1 + w); packed weights */
    int64_t n_in, k_out, n_gu; /* w_in's outputs; w_out's inputs; w_gu's outputs (2I) */
    double eps;                /* the mixer's norms */
    /* GDN */
    int64_t hk = 0, hv = 0, dk = 0, dv = 0;
    at::Tensor conv_w, conv_pool, rec_pool, neg_A, dt_bias, norm_w;
    /* attention */
    int64_t h = 0, kvh = 0;
    at::Tensor qk_norm, kv_pool;
    double scale = 0;
};

const Args A{"pdserve.DecodeLayers"};


at::Tensor f32(const at::Tensor &t, const char *name, std::vector<int64_t> shape) {
    A.dtype(t, name, at::kFloat);
    A.shape(t, name, std::move(shape));
    A.contiguous(t, name);
    return t;
}

/* a tensor in the model's dtype (float32, or bfloat16 when bf16) */
at::Tensor md(const at::Tensor &t, const char *name, std::vector<int64_t> shape, bool bf16) {
    A.dtype(t, name, bf16 ? at::kBFloat16 : at::kFloat);
    A.shape(t, name, std::move(shape));
    A.contiguous(t, name);
    return t;
}

/* a weight packed for gemm_f32 ([P, K, 16]) or gemm_bf16 ([P, K2, 16, 2]) */
at::Tensor packed(const at::Tensor &t, const char *name, int64_t n, int64_t k, bool bf16) {
    if (bf16) return md(t, name, {(n + 15) / 16, (k + 1) / 2, 16, 2}, true);
    return f32(t, name, {(n + 15) / 16, k, 16});
}

/* One step's kernels as phases of independent chunks, run in order in one parallel region. */
struct Phase {
    int64_t n;                                /* chunks */
    std::function<void(int64_t, int64_t)> fn; /* fn(chunk, tid) */
};

struct alignas(64) Progress {
    std::atomic<int64_t> taken{0}, done{0};
};

/* Every thread of one parallel region (on_threads) walks the phases in order: it takes the
 * current phase's next chunk while there is one, then waits (spinning) until the chunks others
 * took are done before it goes on. A thread that starts late finds the early phases done and
 * joins where the others are; one that never starts leaves its share to them; none waits for a
 * thread that took nothing. So a step pays one wake-up of torch's threads, where a region per
 * kernel paid one per kernel, about 60 a step (under OMP_WAIT_POLICY=PASSIVE a sleeping thread
 * takes 15-35 us to wake). tid < nthreads indexes per-thread scratch. A wait over LATE_NS for a
 * chunk another thread took (descheduled mid-chunk) counts as a late region (Crowding). */
void run_phases(const std::vector<Phase> &phases, int64_t nthreads) {
    int64_t most = 0;
    for (const Phase &p : phases) most = std::max(most, p.n);
    if (most <= 1) nthreads = 1;
    std::vector<Progress> progress(phases.size());
    on_threads(nthreads, [&](int64_t tid) {
        for (size_t i = 0; i < phases.size(); i++) {
            const Phase &p = phases[i];
            Progress &g = progress[i];
            for (int64_t c = g.taken.fetch_add(1, std::memory_order_relaxed); c < p.n;
                 c = g.taken.fetch_add(1, std::memory_order_relaxed)) {
                p.fn(c, tid);
                g.done.fetch_add(1, std::memory_order_release);
            }
            if (g.done.load(std::memory_order_acquire) >= p.n) continue;
            const int64_t start = Crowding::now_ns();
            for (int64_t spins = 0; g.done.load(std::memory_order_acquire) < p.n; spins++) {
                if (spins < 4096) spin_pause();
                else std::this_thread::yield();
            }
            crowding.report(Crowding::now_ns() - start);
        }
    });
}

}  // namespace

struct DecodeLayers : torch::CustomClassHolder {
    int64_t hidden;
    double eps; /* the layer norms' */
    bool bf16;  /* the model's dtype: bfloat16 (else float32) */
    std::vector<Layer> layers;

    DecodeLayers(int64_t hidden, double eps, bool bf16) : hidden(hidden), eps(eps), bf16(bf16) {}

    Layer common(const at::Tensor &in_norm, const at::Tensor &post_norm, const at::Tensor &w_in,
                 const at::Tensor &w_out, const at::Tensor &w_gu, const at::Tensor &w_down, int64_t n_in,
                 int64_t n_gu, double layer_eps, bool attn) const {
        const int64_t H = hidden;
        TORCH_CHECK(n_gu % 2 == 0, A.op, ": n_gu=", n_gu, " must be even (gate | up)");
        TORCH_CHECK(w_out.dim() == (bf16 ? 4 : 3), A.op, ": w_out must be packed ",
                    bf16 ? "[P, K2, 16, 2]" : "[P, K, 16]", ", got ", w_out.sizes());
        /* the packed w_out's inputs: K, or K2 pairs (an odd K is not told from K + 1: the
         * mixer's own check below catches a w_out for another width either way) */
        const int64_t k_out = bf16 ? 2 * w_out.size(1) : w_out.size(1);
        return Layer{attn, f32(in_norm, "in_norm", {H}), f32(post_norm, "post_norm", {H}),
                     packed(w_in, "w_in", n_in, H, bf16), packed(w_out, "w_out", H, k_out, bf16),
                     packed(w_gu, "w_gu", n_gu, H, bf16), packed(w_down, "w_down", H, n_gu / 2, bf16), n_in, k_out,
                     n_gu, layer_eps};
    }

    void add_gdn(const at::Tensor &in_norm, const at::Tensor &post_norm, const at::Tensor &w_in,
                 const at::Tensor &w_out, const at::Tensor &w_gu, const at::Tensor &w_down, int64_t n_gu,
                 const at::Tensor &conv_w, const at::Tensor &conv_pool, const at::Tensor &rec_pool,
                 const at::Tensor &neg_A, const at::Tensor &dt_bias, const at::Tensor &norm_w, int64_t hk, int64_t hv,
                 int64_t dk, int64_t dv, double layer_eps) {
        TORCH_CHECK(hk > 0 && hv > 0 && dk > 0 && dv > 0 && hv % hk == 0, A.op, ": GDN heads hk=", hk, " hv=", hv,
                    " dk=", dk, " dv=", dv);
        const int64_t D = 2 * hk * dk + hv * dv;
        Layer l = common(in_norm, post_norm, w_in, w_out, w_gu, w_down, D + hv * dv + 2 * hv, n_gu, layer_eps, false);
        TORCH_CHECK(l.k_out == hv * dv, A.op, ": w_out takes ", l.k_out, " inputs, the GDN gives ", hv * dv);
        TORCH_CHECK(conv_w.dim() == 2 && conv_w.size(1) >= 1, A.op, ": conv_w must be [D, Kc], got ", conv_w.sizes());
        l.conv_w = md(conv_w, "conv_w", {D, conv_w.size(1)}, bf16);
        l.conv_pool = md(conv_pool, "conv_pool", {-1, D, conv_w.size(1) - 1}, bf16);
        l.rec_pool = f32(rec_pool, "rec_pool", {conv_pool.size(0), hv, dk, dv});
        l.neg_A = f32(neg_A, "neg_A", {hv});
        l.dt_bias = f32(dt_bias, "dt_bias", {hv});
        l.norm_w = md(norm_w, "norm_w", {dv}, bf16);
        l.hk = hk, l.hv = hv, l.dk = dk, l.dv = dv;
        layers.push_back(std::move(l));
    }

    void add_attn(const at::Tensor &in_norm, const at::Tensor &post_norm, const at::Tensor &w_in,
                  const at::Tensor &w_out, const at::Tensor &w_gu, const at::Tensor &w_down, int64_t n_in,
                  int64_t n_gu, const at::Tensor &qk_norm, const at::Tensor &kv_pool, int64_t h, int64_t kvh,
                  double scale, double layer_eps) {
        TORCH_CHECK(h > 0 && kvh > 0 && h % kvh == 0, A.op, ": h=", h, " must be a positive multiple of kvh=", kvh);
        A.dtype(kv_pool, "kv_pool", bf16 ? at::kBFloat16 : at::kFloat);
        A.shape(kv_pool, "kv_pool", {-1, 2, kvh, -1, -1});
        A.unit_last_stride(kv_pool, "kv_pool");
        const int64_t hd = kv_pool.size(4);
        TORCH_CHECK(n_in >= 2 * (h + kvh) * hd, A.op, ": w_in gives ", n_in, " outputs, attention needs ",
                    2 * (h + kvh) * hd);
        Layer l = common(in_norm, post_norm, w_in, w_out, w_gu, w_down, n_in, n_gu, layer_eps, true);
        TORCH_CHECK(l.k_out == h * hd, A.op, ": w_out takes ", l.k_out, " inputs, attention gives ", h * hd);
        l.qk_norm = f32(qk_norm, "qk_norm", {h + kvh, hd});
        l.kv_pool = kv_pool;
        l.h = h, l.kvh = kvh, l.scale = scale;
        layers.push_back(std::move(l));
    }

    /* x [B, hidden] in the model's dtype (the embeddings) -> the residual stream after every
     * layer, in place. gdn_slots / slot_mapping / seq_lens [B] int64, block_tables [B, W] int64,
     * cos / sin [B, rd] in the model's dtype; the rows' GDN slots and KV pages are updated as the
     * per-op path updates them. */
    void run(at::Tensor x, const at::Tensor &gdn_slots, const at::Tensor &slot_mapping,
             const at::Tensor &block_tables, const at::Tensor &seq_lens, const at::Tensor &cos,
             const at::Tensor &sin) const {
        TORCH_CHECK(!layers.empty(), A.op, ": no layers");
        const int64_t H = hidden;
        md(x, "x", {-1, H}, bf16);
        const int64_t B = x.size(0), rd = cos.size(-1);
        md(cos, "cos", {B, rd}, bf16);
        md(sin, "sin", {B, rd}, bf16);
        A.dtype(block_tables, "block_tables", at::kLong);
        A.shape(block_tables, "block_tables", {B, -1});
        A.contiguous(block_tables, "block_tables");
        const int64_t W = block_tables.size(1);
        int64_t max_in = 0, max_out = 0, max_gu = 0, stride = H, slots = INT64_MAX, blocks = INT64_MAX, bs = 0;
        for (const Layer &l : layers) {
            max_in = std::max(max_in, l.n_in), max_out = std::max(max_out, l.k_out), max_gu = std::max(max_gu, l.n_gu);
            if (l.attn) {
                const int64_t hd = l.kv_pool.size(4);
                bs = l.kv_pool.size(3), blocks = std::min(blocks, l.kv_pool.size(0));
                stride = std::max(stride, attn_work_stride(l.h, l.kvh, hd, W * bs));
                TORCH_CHECK(rd % 2 == 0 && rd <= hd, A.op, ": cos / sin [B, ", rd, "] do not fit hd=", hd);
            } else {
                slots = std::min(slots, l.conv_pool.size(0));
                stride = std::max(stride, l.conv_w.size(0) + 2 * l.hv);
            }
        }
        if (slots != INT64_MAX) A.index(gdn_slots, "gdn_slots", B, 0, slots);
        if (blocks != INT64_MAX) {
            A.range(block_tables, "block_tables", 0, blocks);
            A.index(slot_mapping, "slot_mapping", B, 0, blocks * bs);
            A.index(seq_lens, "seq_lens", B, 1, W * bs + 1);
        }
        const int64_t nt = std::min<int64_t>(at::get_num_threads(), 8), esz = bf16 ? 2 : 4;
        /* a bfloat16 GEMM splits over every thread, however small: the step's threads are awake
         * already (one region for the step), so a split costs a phase's spin, not the wake-up that
         * makes engine/model/linear.py keep small GEMMs on one thread; its bits do not depend on
         * the split (gemm_bf16.cpp). At 16 rows of a 256-wide model this took a decode step from
         * 5.7 to 4.7 ms on two threads (docs/benchmarks.md, CPU path). */
        const int b16 = bf16 ? 1 : 0;
        auto buf = at::empty({B * (2 * H + max_in + max_out + max_gu + max_gu / 2) * esz}, at::kByte);
        auto work = at::empty({nt * stride}, at::kFloat);
        char *xp = (char *)x.data_ptr(), *h = (char *)buf.data_ptr(), *o = h + B * H * esz, *proj = o + B * H * esz;
        char *mix = proj + B * max_in * esz, *gu = mix + B * max_out * esz, *act = gu + B * max_gu * esz;
        float *wk = work.data_ptr<float>();
        /* gemm_bf16's packed x pairs, per thread: a block of at most B rows of the widest K */
        const int64_t kmax = std::max({H, max_out, max_gu / 2}), xt_stride = bf16 ? B * ((kmax + 1) / 2) : 0;
        auto xt = at::empty({std::max<int64_t>(1, nt * xt_stride)}, at::kInt);
        uint32_t *xtp = (uint32_t *)xt.data_ptr<int32_t>();
        const bool dot = bf16 && bf16_dot_supported();
        std::vector<Phase> step;
        auto gemm = [&](const char *in, const at::Tensor &wp, char *out, int64_t N, int64_t K) {
            if (bf16) { /* the same bits whatever the split (gemm_bf16.cpp) */
                const Bf16GemmJob j = gemm_bf16_job(B, N, K, (const uint16_t *)in, (const uint16_t *)wp.data_ptr(),
                                                    (uint16_t *)out, nt, dot);
                TORCH_CHECK(j.per_thread <= xt_stride, A.op, ": gemm scratch too small");
                step.push_back({j.chunks(), [j, xtp, xt_stride](int64_t c, int64_t t) {
                                    gemm_bf16_chunk(j, c, xtp + t * xt_stride);
                                }});
                return;
            }
            /* the thread split of engine/model/linear.py */
            const GemmJob j = gemm_job(B, N, K, (const float *)in, wp.data_ptr<float>(), (float *)out,
                                       B * N * K >= (1 << 18) ? nt : 1);
            step.push_back({j.chunks(), [j](int64_t c, int64_t) { gemm_chunk(j, c); }});
        };
        auto residual = [=](int64_t, int64_t) { /* x + mlp(h), rounded to the model's dtype */
            if (!bf16) {
                float *xf = (float *)xp;
                const float *of = (const float *)o;
                for (int64_t i = 0; i < B * H; i++) xf[i] += of[i];
                return;
            }
            bf16_t *xb = (bf16_t *)xp;
            const bf16_t *ob = (const bf16_t *)o;
            for (int64_t i = 0; i < B * H; i++) xb[i] = f2bf(bf2f(xb[i]) + bf2f(ob[i]));
        };
        for (size_t li = 0; li < layers.size(); li++) {
            const Layer &l = layers[li];
            const float *in_norm = l.in_norm.data_ptr<float>(), *post_norm = l.post_norm.data_ptr<float>();
            const float e = (float)eps;
            step.push_back({1, [=](int64_t c, int64_t t) {
                                if (li > 0) residual(c, t); /* the previous layer's MLP output */
                                add_rms_norm(0, B, H, xp, nullptr, xp, in_norm, e, h, b16);
                            }});
            gemm(h, l.w_in, proj, l.n_in, H);
            if (l.attn) {
                const at::Tensor &kv = l.kv_pool;
                const AttnJob j = {0,           B,        l.h,          l.kvh,        kv.size(4),
                                   rd,          l.n_in,   kv.size(3),   kv.stride(0), kv.stride(1),
                                   kv.stride(2), kv.stride(3), W,       stride,       proj,
                                   cos.data_ptr(), sin.data_ptr(), l.qk_norm.data_ptr<float>(),
                                   kv.data_ptr(), mix, slot_mapping.data_ptr<int64_t>(),
                                   block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), (float)l.eps,
                                   (float)l.scale, wk, b16, nullptr};
                step.push_back({B, [j](int64_t c, int64_t t) { attn_chunk(j, c, t); }});
            } else {
                const int64_t *sl = gdn_slots.data_ptr<int64_t>();
                step.push_back({B, [=, &l](int64_t b, int64_t t) {
                                    gdn_decode(b, b + 1, l.hk, l.hv, l.dk, l.dv, l.conv_w.size(1), proj, l.n_in,
                                               l.conv_w.data_ptr(), l.conv_pool.data_ptr(),
                                               l.rec_pool.data_ptr<float>(), sl, l.neg_A.data_ptr<float>(),
                                               l.dt_bias.data_ptr<float>(), l.norm_w.data_ptr(), (float)l.eps,
                                               mix, wk + t * stride, b16);
                                }});
            }
            gemm(mix, l.w_out, o, H, l.k_out);
            step.push_back({1, [=](int64_t, int64_t) { add_rms_norm(0, B, H, xp, o, xp, post_norm, e, h, b16); }});
            gemm(h, l.w_gu, gu, l.n_gu, H);
            const SiluMulJob sj = {B, l.n_gu / 2, l.n_gu, gu, act, b16};
            step.push_back({sj.chunks(), [sj](int64_t c, int64_t) { silu_mul_chunk(sj, c); }});
            gemm(act, l.w_down, o, H, l.n_gu / 2);
        }
        step.push_back({1, residual});
        run_phases(step, nt);
    }
};

/* run only as an operator: a call through torch.ops lets go of Python's GIL while the step runs
 * (a custom class's own method keeps it, and the node's request threads waited for every step) */
void decode_layers_run(const c10::intrusive_ptr<DecodeLayers> &layers, at::Tensor x, const at::Tensor &gdn_slots,
                       const at::Tensor &slot_mapping, const at::Tensor &block_tables, const at::Tensor &seq_lens,
                       const at::Tensor &cos, const at::Tensor &sin) {
    layers->run(x, gdn_slots, slot_mapping, block_tables, seq_lens, cos, sin);
}

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
    m.class_<DecodeLayers>("DecodeLayers")
        .def(torch::init<int64_t, double, bool>())
        .def("add_gdn", &DecodeLayers::add_gdn)
        .def("add_attn", &DecodeLayers::add_attn);
    m.def("decode_layers_run(__torch__.torch.classes.pdserve.DecodeLayers layers, Tensor(a!) x, Tensor gdn_slots, "
          "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor cos, Tensor sin) -> ()",
          &decode_layers_run);
}

}  // namespace pdserve
