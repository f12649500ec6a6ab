// The wgmma family (sm_90a): fp16 and bf16 inputs at head_dim widths 64 and 128 on the
// warp-specialised kernel (ws/kernel.cuh: TMA loads by a producer warp, two consumer
// warpgroups). A unit per input dtype and width (GQA_DTYPE, GQA_WIDTH).

#include "ws/kernel.cuh"

namespace {

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): one dtype and width.
cudaError_t wgmma_launch(const GqaParams& p, const GqaPlan&, cudaStream_t s, int dev) {
    return launch_ws<GQA_DTYPE, GQA_WIDTH>(p, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(wgmma)
