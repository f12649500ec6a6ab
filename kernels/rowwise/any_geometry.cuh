// The row-wise forward for any sequence geometry (attention() with Tq != Tk, no mask, a window or
// another scale): one warp per query row (b, t, h), lanes over the head dim, an online softmax over
// the keys the row sees (common/geometry.cuh), fp32 arithmetic for every dtype. The output, and
// each row's log-sum-exp in natural log; a row that sees no key gives 0 and -inf. Inf and NaN
// reach the rows that see them, as in the float64 reference (a row never reads a key it does not
// see). Uses backward/backward.cu's row helpers: attention.cu includes it after that file.
// Correct first: its time is a row-wise kernel's; the tensor-core families take causal attention
// with Tq = Tk.

namespace {

template <typename Elem>
__global__ void __launch_bounds__(32 * kBwdWarps, 4) gqa_rows_forward_kernel(const GqaRowsParams p) {
    const WarpRow w = warp_row(p.B, p.geo.Tq, p.Hq, blockIdx.x);
    if (!w.valid) return;
    const bool bf16 = p.dtype == kGqaBFloat16;
    const int lane = w.lane, t = w.t;
    const int64_t kv_head = w.head / p.group, rd = w.row * p.D;
    float q[kBwdLaneElems], x[kBwdLaneElems], acc[kBwdLaneElems];
    load_row(q, static_cast<const Elem*>(p.q) + rd, p.D, lane, bf16);
#pragma unroll
    for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = 0.f;
    const GqaRange keys = p.geo.keys_any(t, t);
    float m = -INFINITY, l = 0.f;   // running maximum of the scores (log2 units), sum of 2^(s2 - m)
    bool nan_score = false;
    for (int j = keys.first; j <= keys.last; ++j) {
        const int64_t kd = ((w.b * p.geo.Tk + j) * p.Hkv + kv_head) * p.D;
        load_row(x, static_cast<const Elem*>(p.k) + kd, p.D, lane, bf16);
        const float s2 = dot(q, x) * p.scale_log2;
        nan_score |= isnan(s2);
        if (s2 > m) {
            const float r = exp2f(m - s2);
            l *= r;
#pragma unroll
            for (int e = 0; e < kBwdLaneElems; ++e) acc[e] *= r;
            m = s2;
        }
        const float wgt = s2 == -INFINITY ? 0.f : exp2f(s2 - m);
        l += wgt;
        load_row(x, static_cast<const Elem*>(p.v) + kd, p.D, lane, bf16);
#pragma unroll
        for (int e = 0; e < kBwdLaneElems; ++e) acc[e] = fmaf(wgt, x[e], acc[e]);
    }
    // No key: 0 and -inf. Keys whose scores are all -inf (Inf in q or k): l = 0, so 0 / 0 = NaN, as
    // the reference's softmax over them; a score of +inf: the output NaN, the log-sum-exp +inf (as
    // torch.logsumexp's; l is NaN there: inf - inf) unless a score is NaN.
    store_row(static_cast<Elem*>(p.o) + rd, acc, keys.empty() ? 0.f : 1.f / l, p.D, lane, bf16);
    if (lane == 0)
        p.lse[(w.b * p.Hq + w.head) * p.geo.Tq + t] = keys.empty() ? -INFINITY : (m == INFINITY && !nan_score ? INFINITY : m + log2f(l)) * 0.6931471805599453f;
}

}  // namespace
