// The wgmma family (sm_90a): fp16 and bf16 inputs at head_dim widths 64, 128 and 256 on the
// warp-specialised kernel (ws/kernel.cuh: TMA loads by a producer warp, two or three consumer
// warpgroups, as the plan says). A unit per input dtype and width (GQA_DTYPE, GQA_WIDTH).

#include "tiled/kernel.cuh"
#include "ws/kernel.cuh"

namespace {

// The unit's launch, behind its entry point (GQA_FAMILY_ENTRY): one dtype and width. K and V
// whose strides no tensor map takes (a zero stride: heads broadcast by expand) run the tiled
// kernel's software pipeline instead (mma.sync at width 256), which reads any strides and keeps
// no log-sum-exp (the rows asked for read NaN: "not kept").
cudaError_t wgmma_launch(const GqaParams& p, const GqaPlan& plan, cudaStream_t s, int dev) {
    const cudaError_t err = launch_ws<GQA_DTYPE, GQA_WIDTH>(p, plan, s, dev);
    if (err != cudaErrorNotSupported) return err;
    if (p.lse2 != nullptr) {
        const cudaError_t fill = cudaMemsetAsync(p.lse2, 0xff, size_t(p.B) * p.T * p.Hq * sizeof(float), s);
        if (fill != cudaSuccess) return fill;
    }
    return launch_tiles<GQA_DTYPE, GQA_WIDTH, 1, GQA_WIDTH <= 128>(p, s, dev);
}

}  // namespace

GQA_FAMILY_ENTRY(wgmma)
