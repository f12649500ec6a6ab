// The wgmma family (sm_90a): fp16 and bf16 inputs at head_dim widths 64 and 128, one warpgroup
// per CTA, both products on wgmma in a software pipeline (tiled/kernel.cuh). Its own library.

#include "tiled/kernel.cuh"

namespace {

template <int kDtype>
cudaError_t launch_wgmma(const GqaParams& p, const GqaPlan& plan, cudaStream_t stream, int dev) {
    return plan.width == 64 ? launch_tiles<kDtype, 64, 1, true>(p, stream, dev)
                            : launch_tiles<kDtype, 128, 1, true>(p, stream, dev);
}

// The library's launch, behind its entry point (GQA_FAMILY_ENTRY).
cudaError_t family_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
    return plan.dtype == kGqaBFloat16 ? launch_wgmma<kGqaBFloat16>(p, plan, s, dev)
                                        : launch_wgmma<kGqaFloat16>(p, plan, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(wgmma)
