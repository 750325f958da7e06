/* The top-p / min-p draw over a whole vocabulary on the CPU, without a sort (kernels/cpu_ops.py
 * top_p_draw):
 * - pdserve.top_p_draw: from each row's probabilities (a float32 softmax), the kept set as
 *   engine/sampling/cut.py `kept` finds it, and the token the inverse CDF of the kept
 *   probabilities in id order draws at the row's uniform, as engine/sampling/filters.py
 *   `inverse_cdf` draws it. Rows split over torch's threads; a row costs a pass for its histogram,
 *   one for the members of the bucket where top-p's mass is reached, about half a pass for the
 *   draw (a whole one more where the kept set's sums are not exact in float64), and one for
 *   min-p's largest where a row has min-p. PyTorch reference: cut.kept, then inverse_cdf.
 *
 * The buckets are the high 16 bits of a probability's float32 bits (sign, exponent, 7 bits of
 * mantissa), so a bucket's members share their exponent and its mass, the members' sum, is exact
 * in float64 whatever the order: here a count and the sum of the members' low 16 bits in one
 * int64 (cut.py's scatter_add in float64 gives the same value).
 */
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "checks.h"

namespace pdserve {
namespace {

constexpr int32_t TOP = (0x3F800000 >> 16) + 1;  // buckets: probabilities are at most 1
constexpr int32_t EXACT = 0x31000000;            // 2^-29: float64 sums of probabilities this large are exact
constexpr int64_t ONE = int64_t(1) << 40;        // a member's count in a bucket's int64 (low 40 bits: low 16s)
constexpr int64_t BLOCK = 64;                    // the draw's span between exact running sums

inline int32_t bits_of(float v) {
    int32_t b;
    std::memcpy(&b, &v, 4);
    return b;
}

inline float float_of(int32_t b) {
    float v;
    std::memcpy(&v, &b, 4);
    return v;
}

/* bucket k's mass from its int64 (count << 40 | the sum of its members' low 16 bits) */
inline double bucket_mass(int32_t k, int64_t h) {
    const int32_t e = k >> 7;  // the members' exponent
    const int64_t base = (int64_t(k & 0x7F) << 16) | (e ? 0x800000 : 0);
    return std::ldexp(double((h >> 40) * base + (h & (ONE - 1))), std::max(e, 1) - 150);
}

/* The kept set: p's bits above `bits`, or equal to them and id below `id`. */
struct Cut {
    int32_t bits;
    int64_t id;
    bool kept(int32_t b, int64_t i) const { return b > bits || (b == bits && i < id); }
};

struct Scratch {
    std::vector<int64_t> hist = std::vector<int64_t>(TOP);
    std::vector<uint64_t> members;
};

/* The bits above which ids [i, i + n) are kept (b > thr), or NONE where the cut's id falls
 * inside the span (then each id decides). */
constexpr int32_t NONE = INT32_MIN;
inline int32_t span_threshold(const Cut &cut, int64_t i, int64_t n) {
    return i + n <= cut.id ? cut.bits - 1 : i >= cut.id ? cut.bits : NONE;
}

/* Appends to `out` the keys (low 16 bits descending, then id) of p [V]'s members of bucket b at
 * or above floor. */
void bucket_members(const float *p, int64_t V, int32_t b, int32_t floor, std::vector<uint64_t> &out) {
    auto add = [&](int64_t i) {
        const int32_t bi = bits_of(p[i]);
        if (bi >= floor) out.push_back((uint64_t(0xFFFF - (bi & 0xFFFF)) << 32) | uint64_t(i));
    };
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i want = _mm256_set1_epi32(b);
    for (; i + 8 <= V; i += 8) {
        const __m256i hi = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i)), 16);
        for (int hit = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(hi, want))); hit; hit &= hit - 1)
            add(i + __builtin_ctz(hit));
    }
#endif
    for (; i < V; i++)
        if ((bits_of(p[i]) >> 16) == b) add(i);
}

/* The sum of p [BLOCK]'s values whose bits are above thr (exact where they are all at least EXACT). */
inline double block_sum(const float *p, int32_t thr) {
#if defined(__AVX2__)
    const __m256i t = _mm256_set1_epi32(thr);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (int64_t j = 0; j < BLOCK; j += 8) {
        __m256 v = _mm256_loadu_ps(p + j);
        v = _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_castps_si256(v), t)));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#else
    double s = 0;
    for (int64_t j = 0; j < BLOCK; j++) s += bits_of(p[j]) > thr ? double(p[j]) : 0.0;
    return s;
#endif
}

/* The kept set of row p [V] and its largest probability; total: the kept probabilities' sum,
 * exact where the cut is at least EXACT (else NAN: not known). Returns false for a row with a
 * NaN or a value outside [0, 1]. */
bool row_cut(const float *p, int64_t V, float top_p, float min_p, Scratch &s, Cut &cut, double &total,
             float &largest) {
    int32_t floor = 0;  // min-p: the bits of min_p times the largest; a token under them leaves
    if (min_p > 0) {
        float m = 0;
        for (int64_t i = 0; i < V; i++) m = p[i] > m ? p[i] : m;
        floor = bits_of(min_p * m);
    }
    int64_t *hist = s.hist.data();
    std::fill(hist, hist + TOP, 0);
    uint32_t most = 0;  // the largest bits: a valid row's largest probability (non-negative floats order as their bits)
    for (int64_t i = 0; i < V; i++) {
        const uint32_t b = static_cast<uint32_t>(bits_of(p[i]));
        most = b > most ? b : most;
        // clamped: a NaN, negative or above 1 marks the row as invalid below, after its pass
        hist[std::min<uint32_t>(b >> 16, TOP - 1)] += int32_t(b) >= floor ? ONE | (b & 0xFFFF) : 0;
    }
    if (most > 0x3F800000u) return false;
    largest = float_of(int32_t(most));
    double share = 1.0;  // top-p's share of what min-p keeps: the buckets' total, from the top
    if (min_p > 0) {
        share = 0;
        for (int32_t k = TOP - 1; k >= 0; k--)
            if (hist[k]) share += bucket_mass(k, hist[k]);
    }
    const double tp = top_p < 1.0f ? double(top_p) * share : INFINITY;
    int32_t b = -1;  // the bucket where the mass from the top reaches tp (-1: none, all stay)
    double acc = 0, above = 0;
    for (int32_t k = TOP - 1; k >= 0; k--) {
        if (!hist[k]) continue;
        const double m = bucket_mass(k, hist[k]);
        acc += m;
        if (acc >= tp) {
            b = k;
            above = acc - m;  // cut.py's reach minus the bucket's mass: the same rounding
            break;
        }
    }
    cut = {-1, 0};
    total = acc;
    if (b >= 0) {  // b's members by (probability descending, id); the first whose mass above reaches tp leaves
        s.members.clear();
        bucket_members(p, V, b, floor, s.members);
        std::sort(s.members.begin(), s.members.end());
        cut = {(b << 16) - 1, 0};  // none leaves: all of b stays
        double local = 0;          // exact: b's members share their exponent
        for (const uint64_t key : s.members) {
            const int32_t bi = (b << 16) | int32_t(0xFFFF - (key >> 32));
            if (above + local >= tp) {
                cut = {bi, int64_t(key & 0xFFFFFFFFu)};
                break;
            }
            local += double(float_of(bi));
        }
        total = above + local;
    }
    if (cut.bits < floor) cut = {floor - 1, 0};  // min-p's floor: kept bits at least floor
    if (!(cut.bits >= EXACT && total < 2.0)) total = NAN;
    return true;
}

/* inverse_cdf over the kept probabilities in id order: the first id whose running sum (float64,
 * rounded to float32) exceeds u times the total; V for a row that keeps no mass. */
int64_t row_draw(const float *p, int64_t V, const Cut &cut, double total, float u) {
    const bool exact = total == total;
    if (!exact) {  // the sum in id order, as torch's cumsum accumulates it
        double acc = 0;
        for (int64_t i = 0; i < V; i++)
            if (cut.kept(bits_of(p[i]), i)) acc += p[i];
        total = acc;
    }
    const float tot = static_cast<float>(total);
    if (!(tot > 0)) return V;
    const float target = std::min(u * tot, std::nextafter(tot, 0.0f));
    double acc = 0;
    for (int64_t i = 0; i < V;) {
        const int64_t n = std::min(BLOCK, V - i);
        const int32_t thr = exact && n == BLOCK ? span_threshold(cut, i, n) : NONE;
        if (thr != NONE) {  // a whole block whose running sum stays at or under the target: any order is exact
            const double sum = block_sum(p + i, thr);
            if (static_cast<float>(acc + sum) <= target) {
                acc += sum;
                i += n;
                continue;
            }
        }
        for (const int64_t end = i + n; i < end; i++) {  // id by id
            if (!cut.kept(bits_of(p[i]), i)) continue;
            acc += p[i];
            if (static_cast<float>(acc) > target) return i;
        }
    }
    return V;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_p_draw_op(const at::Tensor &p, const at::Tensor &top_p,
                                                 const at::Tensor &min_p, const at::Tensor &u) {
    const Args a{"pdserve.top_p_draw"};
    a.dtype(p, "p", at::kFloat);
    TORCH_CHECK(p.dim() == 2 && p.size(1) >= 1 && p.size(1) < (int64_t(1) << 23), a.op,
                ": p must be [N, V] with 1 <= V < 2^23, got ", p.sizes());
    a.unit_last_stride(p, "p");
    const int64_t N = p.size(0), V = p.size(1), ld = p.stride(0);
    for (const auto &[t, name] : {std::pair{&top_p, "top_p"}, {&min_p, "min_p"}, {&u, "u"}}) {
        a.dtype(*t, name, at::kFloat);
        a.contiguous(*t, name);
        a.shape(*t, name, {N});
    }
    auto tokens = at::empty({N}, p.options().dtype(at::kLong));
    auto cuts = at::empty({N, 2}, p.options().dtype(at::kLong));
    auto most = at::empty({N}, p.options());
    const float *pp = p.data_ptr<float>(), *tp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>(),
                *up = u.data_ptr<float>();
    int64_t *out = tokens.data_ptr<int64_t>(), *cp = cuts.data_ptr<int64_t>();
    float *lp = most.data_ptr<float>();
    at::parallel_for(0, N, 1, [&](int64_t lo, int64_t hi) {
        Scratch s;
        for (int64_t r = lo; r < hi; r++) {
            const float *row = pp + r * ld;
            Cut cut{0x7FFFFFFF, 0};  // a row with a NaN keeps nothing
            double total = NAN;
            float largest = NAN;
            const bool ok = row_cut(row, V, tp[r], mp[r], s, cut, total, largest);
            lp[r] = ok ? largest : NAN;
            out[r] = ok ? row_draw(row, V, cut, total, up[r]) : V;
            cp[2 * r] = ok ? cut.bits : 0x7FFFFFFF;
            cp[2 * r + 1] = ok ? cut.id : 0;
        }
    });
    return {tokens, cuts, most};
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("top_p_draw", &top_p_draw_op); }

}  // namespace pdserve
