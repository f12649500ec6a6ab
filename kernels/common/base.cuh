// What every kernel family shares: the element types and their I/O, division by a launch-time
// divisor, programmatic dependent launch, and the host side of a launch (device facts, the
// shared-memory limit, the overlapped launch).
#ifndef GQA_COMMON_BASE_CUH
#define GQA_COMMON_BASE_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "gqa_params.h"

namespace {


// Input element type per dtype code: fp32, or raw 16-bit storage for fp16 and bf16.
using Half16 = uint16_t;
template <int kDtype> using ElemOf = typename std::conditional<kDtype == kGqaFloat32, float, Half16>::type;

// Element I/O. fp16 and bf16 travel as raw 16-bit storage; the row-wise kernel takes their kind as
// a run-time flag (uniform across the grid), the tiled kernel as its template parameter.
__device__ __forceinline__ float to_float(float x, bool) { return x; }
__device__ __forceinline__ float to_float(Half16 x, bool bf16) {
    return bf16 ? __uint_as_float(uint32_t(x) << 16) : __half2float(__ushort_as_half(x));
}

template <typename Elem> __device__ __forceinline__ Elem from_float(float x, bool bf16);
template <> __device__ __forceinline__ float from_float<float>(float x, bool) { return x; }
template <> __device__ __forceinline__ Half16 from_float<Half16>(float x, bool bf16) {
    return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
// Two adjacent 16-bit output values in one word, a in the low half.
__device__ __forceinline__ uint32_t pair_bits(float a, float b, bool bf16) {
    return uint32_t(from_float<Half16>(a, bf16)) | uint32_t(from_float<Half16>(b, bf16)) << 16;
}
// Two adjacent output values as one store; dst is aligned to twice the element size.
__device__ __forceinline__ void store_pair(float* dst, float a, float b, bool) { *reinterpret_cast<float2*>(dst) = make_float2(a, b); }
__device__ __forceinline__ void store_pair(Half16* dst, float a, float b, bool bf16) {
    *reinterpret_cast<uint32_t*>(dst) = pair_bits(a, b, bf16);
}
// A 4 x 4 transpose of words across the four lanes of a quad (tig = lane % 4): afterwards slot s
// of lane t holds what slot t of lane s held. Two exchanges, between lanes 2 apart and then 1
// apart, each moving the half of the slots whose index bit differs from the lane's.
__device__ __forceinline__ void quad_transpose(uint32_t (&x)[4], int tig) {
    const bool hi = tig & 2, odd = tig & 1;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? x[j] : x[2 + j], 2);
        if (hi) x[j] = got; else x[2 + j] = got;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? x[2 * j] : x[2 * j + 1], 1);
        if (odd) x[2 * j] = got; else x[2 * j + 1] = got;
    }
}


// CTAs of rows_per_cta packed (time step, group head) rows each, over every (batch, kv head).
inline int64_t packed_row_ctas(const GqaParams& p, int rows_per_cta) {
    return (int64_t(p.T) * p.group + rows_per_cta - 1) / rows_per_cta * p.B * p.Hkv;
}

// Division of a non-negative int below 2^31 by a divisor d fixed at launch: with l = ceil(log2 d)
// and m = ceil(2^(31+l) / d), floor(n / d) = floor(m n / 2^(31+l)), one multiply-high and a shift.
struct FastDiv {
    int d;
    uint32_t mul;
    int shift;
    FastDiv() = default;
    explicit FastDiv(int divisor) : d(divisor), mul(0), shift(0) {
        if (d > 1) {
            int l = 0;
            while ((int64_t(1) << l) < d) ++l;
            mul = uint32_t(((uint64_t(1) << (31 + l)) + uint64_t(d) - 1) / uint64_t(d));
            shift = l - 1;
        }
    }
    __device__ __forceinline__ int div(int n) const { return d == 1 ? n : int(__umulhi(uint32_t(n), mul) >> shift); }
};

// The rows of one (batch b, kv head kvh) are packed: row R = t * G + g is query head kvh * G + g
// at time step t, so the G query heads that read the same K/V rows share every load of them.
// HeadRows holds the head's base pointers (time step 0) and finds the q row of a packed row.
template <typename Elem>
struct HeadRows {
    const Elem* q;   // query head kvh * G
    const Elem* k;   // kv head kvh
    const Elem* v;
    __device__ __forceinline__ HeadRows(const GqaParams& p, int b, int kvh)
        : q(static_cast<const Elem*>(p.q) + b * p.q_stride_b + int64_t(kvh) * p.group * p.q_stride_h),
          k(static_cast<const Elem*>(p.k) + b * p.k_stride_b + kvh * p.k_stride_h),
          v(static_cast<const Elem*>(p.v) + b * p.v_stride_b + kvh * p.v_stride_h) {}
    // Query head kvh * G + g at time step t.
    __device__ __forceinline__ const Elem* q_at(const GqaParams& p, int t, int g) const {
        return q + int64_t(t) * p.q_stride_t + int64_t(g) * p.q_stride_h;
    }
    // The q row of packed row R, or null past the last one (rows_total = T * G).
    __device__ __forceinline__ const Elem* q_row(const GqaParams& p, const FastDiv& group, int R, int rows_total) const {
        if (R >= rows_total) return nullptr;
        const int t = group.div(R);
        return q_at(p, t, R - t * group.d);
    }
};

// The tiled kernel's divisors: CTA index -> (row tile, batch and kv head), packed row -> time step.
struct TileDivs {
    FastDiv bh;      // B * Hkv
    FastDiv hkv;     // Hkv
    FastDiv group;   // G
};

// The grid of a kernel over packed rows: one CTA per (tile of `rows` packed rows, batch, kv head),
// row tiles outermost; its divisors go to `dv`. Returns the CTA count, or -1 past 2^31 - 1.
inline int64_t packed_tile_grid(const GqaParams& p, int rows, TileDivs& dv) {
    const int64_t blocks = (int64_t(p.T) * p.group + rows - 1) / rows * p.B * p.Hkv;
    dv.bh = FastDiv(p.B * p.Hkv);
    dv.hkv = FastDiv(p.Hkv);
    dv.group = FastDiv(p.group);
    return blocks > 0x7fffffff ? -1 : blocks;
}

// Programmatic dependent launch (sm_90+): a kernel launched with it may start while the previous
// kernel on the stream finishes; it must not touch global memory before grid_dependency_wait().
// Elsewhere, or when launched without it, both are no-ops.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------------
// Per-device facts, read once.
constexpr int kMaxDevices = 64;

inline int sm_count(int dev) {
    static int count[kMaxDevices] = {};
    if (dev >= kMaxDevices) return 132;
    if (count[dev] == 0) cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev);
    return count[dev] > 0 ? count[dev] : 132;
}

// Raise a kernel's dynamic shared-memory limit to `bytes`, once per (kernel, device).
template <typename Kernel>
cudaError_t raise_smem_limit(Kernel kernel, size_t bytes, int dev, bool (&raised)[kMaxDevices]) {
    if (bytes <= 48 * 1024 || (dev < kMaxDevices && raised[dev])) return cudaSuccess;
    int optin = 0;
    cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (err != cudaSuccess) return err;
    if (bytes > size_t(optin)) return cudaErrorInvalidConfiguration;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess) return err;
    if (dev < kMaxDevices) raised[dev] = true;
    return cudaSuccess;
}

inline int cc_major(int dev) {
    static int major[kMaxDevices] = {};
    if (dev >= kMaxDevices) return 0;
    if (major[dev] == 0) cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev);
    return major[dev];
}


// A launch that on sm_90+ overlaps the tail of the previous kernel on the stream (programmatic
// dependent launch: the kernel waits for it before its first global read).
template <typename Kernel, typename... Args>
cudaError_t launch_overlapped(Kernel kernel, int64_t blocks, int threads, size_t smem, cudaStream_t stream, int dev,
                              const Args&... args) {
    if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
    cudaLaunchAttribute overlap[1];
    overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(blocks));
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = overlap;
    cfg.numAttrs = cc_major(dev) >= 9 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace

// A kernel library's entry point, gqa_launch_<family> (gqa_params.h: GqaLauncher): the current
// device, then <family>_launch(params, plan, stream, device), which the family's file defines.
// A library holds one unit of a family: its kernels for the input dtype GQA_DTYPE (a GqaDtype)
// and the head_dim width GQA_WIDTH, both set by the build.
#define GQA_FAMILY_ENTRY(family)                                                                       \
    extern "C" int gqa_launch_##family(const GqaParams* p, const GqaPlan* plan, void* stream) {          \
        int dev = 0;                                                                                    \
        const cudaError_t err = cudaGetDevice(&dev);                                                    \
        return int(err != cudaSuccess ? err : family##_launch(*p, *plan, static_cast<cudaStream_t>(stream), dev)); \
    }
#endif  // GQA_COMMON_BASE_CUH
