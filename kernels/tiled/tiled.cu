// The tiled mma.sync family: fp32 inputs (3xTF32, or one TF32 product when the caller allows
// TF32), fp16 and bf16; a unit per input dtype and head_dim width (GQA_DTYPE, GQA_WIDTH).

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

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): one dtype and width, either split.
cudaError_t tiled_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
    return launch_tiled<GQA_DTYPE, GQA_WIDTH>(p, plan.split, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(tiled)
