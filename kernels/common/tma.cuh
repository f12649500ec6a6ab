// mbarrier and TMA primitives (sm_90), and the host's tensor maps, for the warp-specialised forward
// (ws/kernel.cuh) and the wgmma backward's loads (bwdwg/bwdwg.cu, bwdx3/bwdx3.cu).
#ifndef GQA_COMMON_TMA_CUH
#define GQA_COMMON_TMA_CUH

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common/base.cuh"

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also tells the barrier to wait for `bytes` of TMA transactions.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Waits for the completion of the barrier's phase of this parity (phase k has parity k % 2).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile("{\n.reg .pred done;\nWS_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WS_WAIT;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// mbar_wait with a suspend-time hint of kNs nanoseconds a try (ptxas: NANOSLEEP.SYNCS between
// tries), for the producer warpgroup's waits, whose tries (three instructions each, about 20 cycles
// apart; 14% of the kernel's issued instructions at (1, 8192, 32, 8, 128)) take issue slots from
// the consumer warps on the same schedulers. kNs = 0: mbar_wait.
template <uint32_t kNs> __device__ __forceinline__ void mbar_wait_idle(uint64_t* bar, uint32_t parity) {
    if constexpr (kNs == 0) {
        mbar_wait(bar, parity);
    } else {
        asm volatile("{\n.reg .pred done;\nWS_WAIT_IDLE:\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
                     "@!done bra WS_WAIT_IDLE;\n}\n" ::"r"(smem_addr(bar)), "r"(parity), "n"(kNs) : "memory");
    }
}
// A box of the 4-D tensor map (coordinates innermost first) into shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 ::"r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory as one bulk
// copy; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// A 4-D tensor map over 16-bit data (dims innermost first, byte strides of the last three), boxes
// of `box` elements in the 128-byte swizzle, zeros past the edges. cuTensorMapEncodeTiled comes
// through the runtime's driver entry point, so the library links no libcuda.
inline cudaError_t tensor_map_16bit(CUtensorMap* map, const void* data, bool bf16, const cuuint64_t (&dims)[4],
                                    const cuuint64_t (&strides)[3], const cuuint32_t (&box)[4]) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (encode == nullptr) {
        cudaDriverEntryPointQueryResult found{};
        void* fn = nullptr;
        const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
        if (err != cudaSuccess) return err;
        if (found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
        encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
    const cuuint32_t steps[4] = {1, 1, 1, 1};
    const CUresult res = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                                const_cast<void*>(data), dims, strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

// The wgmma backward's copies by TMA (bwdwg/, bwdx3/), each issued by one thread: tiles of kRows
// rows of kCols 16-bit values (64-column blocks, 128-byte swizzle, zeros past T) from contiguous
// [B, T, heads, kCols] tensors, through four tensor maps (dims kCols, heads, T, B; boxes of 64
// columns x 1 head x kRows steps), and a step's lse2 and delta as two bulk copies.
template <int kRows, int kCols> struct BwdTmaLoads {
    static constexpr int kLoadHalves = kRows * kCols;
    struct Maps {
        CUtensorMap q, dout, k, v;
    };
    // The maps of q, dout, k and v at `data` (in that order).
    static cudaError_t make_maps_of(const GqaBwdParams& p, const void* const (&data)[4], bool bf16, Maps* m) {
        const cuuint32_t box[4] = {64, 1, kRows, 1};
        const auto rows = [&](CUtensorMap* map, const void* at, int heads) {
            return tensor_map_16bit(map, at, bf16, {cuuint64_t(kCols), cuuint64_t(heads), cuuint64_t(p.T), cuuint64_t(p.B)},
                                    {cuuint64_t(kCols) * 2, cuuint64_t(heads) * kCols * 2, cuuint64_t(p.T) * heads * kCols * 2}, box);
        };
        cudaError_t err = rows(&m->q, data[0], p.Hq);
        if (err == cudaSuccess) err = rows(&m->dout, data[1], p.Hq);
        if (err == cudaSuccess) err = rows(&m->k, data[2], p.Hkv);
        return err != cudaSuccess ? err : rows(&m->v, data[3], p.Hkv);
    }
    static __device__ __forceinline__ void init_landed(uint64_t (&bars)[2]) {
        mbar_init(&bars[0], 1);
        mbar_init(&bars[1], 1);
        mbar_init_fence();
    }
    // A step's Q and dO tiles and statistics into a stage, landing on `bar`.
    static __device__ __forceinline__ void load_step(const Maps& m, uint16_t* q_dst, uint16_t* do_dst, float* lse2_dst,
                                                     float* delta_dst, const float* lse2, const float* delta,
                                                     uint64_t* bar, int64_t b, int q0, int h) {
        mbar_arrive_expect(bar, uint32_t(2 * kLoadHalves * 2 + 2 * kRows * 4));
#pragma unroll
        for (int blk = 0; blk < kCols / 64; ++blk) {
            tma_load_4d(q_dst + blk * kRows * 64, &m.q, bar, blk * 64, h, q0, int(b));
            tma_load_4d(do_dst + blk * kRows * 64, &m.dout, bar, blk * 64, h, q0, int(b));
        }
        bulk_load(lse2_dst, lse2, kRows * 4, bar);
        bulk_load(delta_dst, delta, kRows * 4, bar);
    }
    // The K and V tiles of keys k0 .. k0 + kRows - 1 into a stage, landing on `bar`.
    static __device__ __forceinline__ void load_kv(const Maps& m, uint16_t* k_dst, uint16_t* v_dst, uint64_t* bar,
                                                   int64_t b, int k0, int kvh) {
        mbar_arrive_expect(bar, uint32_t(2 * kLoadHalves * 2));
#pragma unroll
        for (int blk = 0; blk < kCols / 64; ++blk) {
            tma_load_4d(k_dst + blk * kRows * 64, &m.k, bar, blk * 64, kvh, k0, int(b));
            tma_load_4d(v_dst + blk * kRows * 64, &m.v, bar, blk * 64, kvh, k0, int(b));
        }
    }
    static __device__ __forceinline__ void await_step(uint64_t* bar, uint32_t parity) { mbar_wait(bar, parity); }
};

}  // namespace
#endif  // GQA_COMMON_TMA_CUH
