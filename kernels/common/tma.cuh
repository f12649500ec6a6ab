// mbarrier and TMA primitives (sm_90), and the host's tensor maps, for the warp-specialised forward
// (ws/kernel.cuh) and the wgmma backward's loads (bwdwg/bwdwg.cu).
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

}  // namespace
#endif  // GQA_COMMON_TMA_CUH
