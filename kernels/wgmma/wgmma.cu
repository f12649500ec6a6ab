// The wgmma family (sm_90a): fp16 and bf16 inputs at head_dim widths 64 and 128, one warpgroup
// per CTA, both products on wgmma in a software pipeline (tiled/kernel.cuh). A unit per input
// dtype and width (GQA_DTYPE, GQA_WIDTH).

#include "tiled/kernel.cuh"

namespace {


// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): one dtype and width.
cudaError_t wgmma_launch(const GqaParams& p, const GqaPlan&, cudaStream_t s, int dev) {
    return launch_tiles<GQA_DTYPE, GQA_WIDTH, 1, true>(p, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(wgmma)
