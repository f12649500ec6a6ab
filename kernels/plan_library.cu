// The plan library: the plan alone (plan.cuh) for a described shape, with no kernels and no torch.
// A first call that must build the entry library builds this one beside it, in a child process
// that then builds the unit the plan names, so the two compile at the same time (gqa_module.py).

#include "gqa_params.h"
#include "plan.cuh"

// The unit of the plan for this shape on a device with `sm_count` SMs of compute capability
// `cc_major`: its name goes to `unit` (`size` bytes), its head_dim width to `width`, and whether it
// is built for sm_90a to `sm90a`. Returns 1 when the unit is a library of its own, 0 when the entry
// library holds it, -1 for a shape outside what the kernels take (the call itself will refuse it).
extern "C" int gqa_unit_for(int B, int T, int Hq, int Hkv, int D, int dtype, int aligned, int allow_tf32,
                            int sm_count, int cc_major, char* unit, int size, int* width, int* sm90a) {
    if (B < 1 || T < 1 || Hq < 1 || Hkv < 1 || Hq % Hkv != 0 || D < 1 || D > kGqaMaxHeadDim || dtype < 0 ||
        dtype > 2 || sm_count < 1 || size < 1)
        return -1;
    GqaDevice dev{};
    dev.sm_count = sm_count, dev.cc_major = cc_major;
    const GqaPlan plan = make_plan(shape_params(B, T, Hq, Hkv, D, dtype, aligned != 0, allow_tf32 != 0), dev);
    *width = plan.width;
    *sm90a = unit_needs_sm90a(plan);
    return unit_name(plan, unit, size) ? 1 : 0;
}
