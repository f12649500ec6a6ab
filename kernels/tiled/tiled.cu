// The tiled mma.sync family, built as its own library: fp32 inputs (3xTF32, or one TF32 product
// when the caller allows TF32), or fp16 and bf16 with GQA_16BIT=1. Every head_dim width.

#include "tiled/kernel.cuh"

namespace {

// The tiled mma.sync kernel, whole CTAs (split 1) or key-split (split 8, fp32 up to width 128).
template <int kDtype, int DP>
cudaError_t launch_tiled(const GqaParams& p, int split, cudaStream_t stream, int dev) {
    if constexpr (DP <= 128 && kDtype == kGqaFloat32) {
        if (split == 8) return launch_tiles<kDtype, DP, 8>(p, stream, dev);
    }
    return launch_tiles<kDtype, DP, 1>(p, stream, dev);
}

template <int kDtype>
cudaError_t launch_width(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    switch (plan.width) {
        case 32: return launch_tiled<kDtype, 32>(p, plan.split, stream, dev);
        case 64: return launch_tiled<kDtype, 64>(p, plan.split, stream, dev);
        case 128: return launch_tiled<kDtype, 128>(p, plan.split, stream, dev);
        case 256: return launch_tiled<kDtype, 256>(p, plan.split, stream, dev);
        default: return cudaErrorInvalidValue;
    }
}

// The library's launch, behind its entry point (GQA_FAMILY_ENTRY).
cudaError_t family_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
#if GQA_16BIT
    return plan.dtype == kGqaBFloat16 ? launch_width<kGqaBFloat16>(p, plan, s, dev)
                                        : launch_width<kGqaFloat16>(p, plan, s, dev);
#else
    return launch_width<kGqaFloat32>(p, plan, s, dev);
#endif
}

}  // namespace

GQA_FAMILY_ENTRY(tiled)
