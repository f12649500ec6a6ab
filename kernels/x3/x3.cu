// The x3 family (sm_90a): fp32 inputs as three fp16 wgmma products (rules.cuh describes the
// scheme): the K/V scan and split, the attention kernel, and the 3xTF32 redo of CTAs that met
// Inf or NaN. A unit per width (GQA_WIDTH).

#include "x3/rules.cuh"
#include "tiled/kernel.cuh"

namespace {

// x3, before the attention kernel: the largest finite |x| of each head's K and of each channel of
// its V, and whether the head holds Inf or NaN (all start at zero). Grid: (ceil(T / kX3Rows),
// B * Hkv, 2 for K and V); rows of D fp32 values, 16-byte aligned.
__device__ __forceinline__ const float* x3_head_rows(const GqaParams& p, int z, int bh, int64_t& stride_t) {
    const HeadRows<float> head(p, bh / p.Hkv, bh % p.Hkv);
    stride_t = z ? p.v_stride_t : p.k_stride_t;
    return z ? head.v : head.k;
}
template <int DP>
__global__ void __launch_bounds__(kX3Threads) x3_absmax_kernel(const GqaParams p) {
    const X3Work w = x3_work(p, DP);
    const int z = int(blockIdx.z), bh = int(blockIdx.y), t0 = int(blockIdx.x) * kX3Rows;
    int64_t stride_t = 0;
    const float* rows = x3_head_rows(p, z, bh, stride_t);
    // Thread i reads float4 chunk i % chunks of rows t0 + i / chunks, stepping `per` rows.
    const int chunks = p.D / 4, per = kX3Threads / chunks;
    const int c = (int(threadIdx.x) % chunks) * 4, r0 = int(threadIdx.x) / chunks;
    const int t_end = min(t0 + kX3Rows, p.T);
    float4 mx = make_float4(0.f, 0.f, 0.f, 0.f);
    bool bad = false;
    if (r0 < per) {
        for (int t = t0 + r0; t < t_end; t += per) {
            const float4 x = *reinterpret_cast<const float4*>(rows + t * stride_t + c);
            abs_max_finite(x.x, mx.x, bad);
            abs_max_finite(x.y, mx.y, bad);
            abs_max_finite(x.z, mx.z, bad);
            abs_max_finite(x.w, mx.w, bad);
        }
    }
    if (__any_sync(0xffffffffu, bad) && threadIdx.x % 32 == 0) atomicOr(&w.bad[bh], 1u);
    if (z == 0) {   // K: one maximum for the head
        const float m = fmaxf(fmaxf(mx.x, mx.y), fmaxf(mx.z, mx.w));
        const uint32_t warp_max = __reduce_max_sync(0xffffffffu, __float_as_uint(m));
        if (threadIdx.x % 32 == 0) atomicMax(&w.absmax_k[bh], warp_max);
    } else {        // V: one maximum per channel, gathered in shared memory first
        __shared__ uint32_t col_max[DP];
        for (int i = threadIdx.x; i < DP; i += kX3Threads) col_max[i] = 0u;
        __syncthreads();
        if (r0 < per) {
            atomicMax(&col_max[c], __float_as_uint(mx.x));
            atomicMax(&col_max[c + 1], __float_as_uint(mx.y));
            atomicMax(&col_max[c + 2], __float_as_uint(mx.z));
            atomicMax(&col_max[c + 3], __float_as_uint(mx.w));
        }
        __syncthreads();
        for (int i = threadIdx.x; i < p.D; i += kX3Threads) {
            if (col_max[i] != 0u) atomicMax(&w.absmax_v[int64_t(bh) * DP + i], col_max[i]);
        }
    }
}
// x3: K and V rows times 2^e of their group (K: the head; V: the channel), as fp16 hi and lo rows
// in the workspace, zero past D.
template <int DP>
__global__ void __launch_bounds__(kX3Threads) x3_split_kernel(const GqaParams p) {
    const X3Work w = x3_work(p, DP);
    const int z = int(blockIdx.z), bh = int(blockIdx.y), t0 = int(blockIdx.x) * kX3Rows;
    const int bh_count = p.B * p.Hkv;
    int64_t stride_t = 0;
    const float* rows = x3_head_rows(p, z, bh, stride_t);
    Half16* dst = w.kv + (int64_t(z) * bh_count + bh) * p.T * 2 * DP;
    constexpr int kChunks = DP / 4;
    static_assert(kX3Threads % kChunks == 0, "each thread keeps one float4 column chunk");
    // This thread's four columns and their exponents, the same on every row it splits.
    const int c = (int(threadIdx.x) % kChunks) * 4;
    float f1[4], f2[4];   // 2^e as two exact factors
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int e = x3_exponent(z == 0 ? w.absmax_k[bh] : w.absmax_v[int64_t(bh) * DP + c + j]);
        f1[j] = pow2_exact(e / 2);
        f2[j] = pow2_exact(e - e / 2);
    }
    for (int t = t0 + int(threadIdx.x) / kChunks; t < min(t0 + kX3Rows, p.T); t += kX3Threads / kChunks) {
        const float4 x = c < p.D ? *reinterpret_cast<const float4*>(rows + t * stride_t + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        uint2 h, l;
        x3_split2(x.x * f1[0] * f2[0], x.y * f1[1] * f2[1], h.x, l.x);
        x3_split2(x.z * f1[2] * f2[2], x.w * f1[3] * f2[3], h.y, l.y);
        Half16* row = dst + int64_t(t) * 2 * DP;
        *reinterpret_cast<uint2*>(row + c) = h;
        *reinterpret_cast<uint2*>(row + DP + c) = l;
    }
}

// Scan and split K and V, run the x3 attention kernel, then the 3xTF32 kernel for the CTAs that
// met Inf or NaN (the others return at once).
template <int DP>
cudaError_t launch_x3(const GqaParams& p, cudaStream_t stream, int dev) {
    const X3Work w = x3_work(p, DP);
    cudaError_t err = cudaMemsetAsync(w.absmax_k, 0, x3_stats_bytes(p, DP), stream);
    if (err != cudaSuccess) return err;
    const dim3 grid(unsigned((p.T + kX3Rows - 1) / kX3Rows), unsigned(p.B * p.Hkv), 2);
    x3_absmax_kernel<DP><<<grid, kX3Threads, 0, stream>>>(p);
    x3_split_kernel<DP><<<grid, kX3Threads, 0, stream>>>(p);
    err = launch_tiles<kGqaFloat32, DP, 1, true>(p, stream, dev);
    if (err != cudaSuccess) return err;
    GqaParams redo = p;
    redo.redo = w.redo;
    return launch_tiles<kGqaFloat32, DP, 1>(redo, stream, dev);
}

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): one width (GQA_WIDTH).
cudaError_t x3_launch(const GqaParams& p, const GqaPlan&, cudaStream_t s, int dev) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    return launch_x3<GQA_WIDTH>(p, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(x3)
