// The plan: which kernel unit a call runs, from the shapes, dtype, row alignment and device.
// The entry library (attention.cu) dispatches on it; the plan library (plan_library.cu) computes
// it alone, so that a first call can start building the unit's library while the entry library
// is still compiling. Host code only.
#ifndef GQA_PLAN_CUH
#define GQA_PLAN_CUH

#include <cstdio>
#include <vector>

#include "common/base.cuh"
#include "rowwise/rules.cuh"
#include "short/rules.cuh"
#include "ws/rules.cuh"

namespace {

// The wgmma and x3 families exist when their libraries can be built for sm_90a (the build then
// defines GQA_SM90A); a plan takes them on a device of compute capability 9.0 only.
#ifdef GQA_SM90A
constexpr bool kHaveWgmma = true;
#else
constexpr bool kHaveWgmma = false;
#endif

// CTAs of 64 packed rows: the grid of every tiled variant but the 16-bit mma.sync one, of the x3
// kernel and of its redo flags.
constexpr int kTileRows = 64;

// Short sequences, and head dims too small to feed a tensor-core tile, take the row-wise kernel.
constexpr int kRowwiseMaxT = 128;
constexpr int kRowwiseMaxD = 8;

// ---------------------------------------------------------------------------------------------
// The plan: one decision per call, from the shapes, dtype, row alignment and device. The
// workspace size, the launch and plan() all read the same GqaPlan.
//  - row-wise: T <= kRowwiseMaxT or head_dim <= kRowwiseMaxD. Small grids (one-row-per-warp CTAs
//    at most two per SM) are latency-bound: 8 warps x 1 row; larger grids 4 warps x 4 rows, which
//    share every key read. fp32 in 16-byte rows that fit one chunk addresses every copy before
//    the wait for the previous grid ("planned").
//  - short: fp32, 16-byte rows, head_dim 9..32, where the row-wise grid would be 8 x 1.
//  - x3: fp32 on an sm_90a build, head_dim 33..128, 16-byte rows, allow_tf32 off, a grid of 64-row
//    CTAs that fills the GPU.
//  - wgmma: fp16 and bf16 on an sm_90a build, head_dim 33..256 (widths 64, 128, 256), 16-byte rows;
//    the warp-specialised kernel's consumer warpgroups from ws_consumers_for (warps: 4 each, and
//    4 for the producer).
//  - tiled (mma.sync): everything else; fp32 at widths up to 128 splits each K/V tile over 8
//    warps when 64-row CTAs would not give every SM one.
GqaPlan make_plan(const GqaParams& p, const GqaDevice& dev) {
    GqaPlan plan{};
    plan.dtype = p.dtype;
    plan.warps = 4;
    plan.split = 1;
    const bool fp32 = p.dtype == kGqaFloat32;
    const int64_t sms = dev.sm_count > 0 ? dev.sm_count : 1;
    if (p.T <= kRowwiseMaxT || p.D <= kRowwiseMaxD) {
        const bool small_grid = packed_row_ctas(p, 8) <= 2 * sms;
        if (fp32 && p.vec16 && p.T <= kShortMaxT && p.D > kRowwiseMaxD && p.D <= 32 && small_grid) {
            plan.family = kGqaShort;
            plan.width = 32;
            plan.warps = kShortWarps;
            return plan;
        }
        plan.family = kGqaRowwise;
        plan.warps = small_grid ? 8 : 4;
        plan.split = small_grid ? 1 : 4;
        const int copies = rowwise_planned_copies(plan.split);
        plan.planned = fp32 && p.vec16 && p.T <= rowwise_chunk_keys(p, plan.warps, plan.split) &&
                       int64_t(plan.warps * plan.split + 2 * p.T) * (p.D / 4) <= int64_t(copies) * 32 * plan.warps;
        return plan;
    }
    plan.width = p.D <= 32 ? 32 : p.D <= 64 ? 64 : p.D <= 128 ? 128 : 256;
    if (kHaveWgmma && dev.cc_major == 9 && p.vec16 && p.D > 32) {
        if (!fp32) {
            plan.family = kGqaWgmma;
            plan.warps = 4 * (1 + ws_consumers_for(p, plan.width, sms));
            return plan;
        }
        if (p.D <= 128 && !p.tf32_single && int64_t(p.B) * p.Hkv <= 65535 && packed_row_ctas(p, kTileRows) >= sms) {
            plan.family = kGqaX3;
            return plan;
        }
    }
    plan.family = kGqaTiled;
    if (fp32 && plan.width <= 128 && packed_row_ctas(p, kTileRows) < sms) {
        plan.warps = 8;
        plan.split = 8;
    }
    return plan;
}

// Every plan make_plan can return on this build, for coverage checks.
std::vector<GqaPlan> every_plan() {
    std::vector<GqaPlan> plans;
    auto add = [&](int family, int dtype, int width, int warps, int split, bool planned) {
        GqaPlan plan{};
        plan.family = family, plan.dtype = dtype, plan.width = width, plan.warps = warps, plan.split = split;
        plan.planned = planned;
        plans.push_back(plan);
    };
    for (int dtype : {kGqaFloat32, kGqaFloat16, kGqaBFloat16}) {
        const bool fp32 = dtype == kGqaFloat32;
        add(kGqaRowwise, dtype, 0, 8, 1, false);
        if (fp32) add(kGqaRowwise, dtype, 0, 8, 1, true);
        add(kGqaRowwise, dtype, 0, 4, 4, false);
        if (fp32) add(kGqaShort, dtype, 32, kShortWarps, 1, false);
        for (int width : {32, 64, 128, 256}) {
            add(kGqaTiled, dtype, width, 4, 1, false);
            if (fp32 && width <= 128) add(kGqaTiled, dtype, width, 8, 8, false);
        }
        if (kHaveWgmma) {
            for (int width : {64, 128, 256}) {
                if (fp32) {
                    if (width <= 128) add(kGqaX3, dtype, width, 4, 1, false);
                    continue;
                }
                add(kGqaWgmma, dtype, width, 4 * (1 + ws_consumers(width)), 1, false);
                if (ws_consumers(width) != 2) add(kGqaWgmma, dtype, width, 4 * 3, 1, false);
            }
        }
    }
    return plans;
}

const char* const kFamilyNames[kGqaFamilies] = {"rowwise", "short", "tiled", "wgmma", "x3"};
const char* const kDtypeNames[3] = {"fp32", "fp16", "bf16"};

// The parameters the plan reads, for a shape with no tensors: `aligned` says every row of q, k
// and v starts on 16 bytes; allow_tf32 asks for one TF32 product in fp32.
GqaParams shape_params(int B, int T, int Hq, int Hkv, int D, int dtype, bool aligned, bool allow_tf32) {
    GqaParams p{};
    p.B = B, p.T = T, p.Hq = Hq, p.Hkv = Hkv, p.D = D, p.group = Hq / Hkv, p.dtype = dtype;
    p.tf32_single = dtype == kGqaFloat32 && allow_tf32;
    p.vec16 = aligned && D * (dtype == kGqaFloat32 ? 4 : 2) % 16 == 0;
    return p;
}

// The unit a plan runs ("family/dtype/dWIDTH", or "family/dtype" for the row-wise family, which
// takes any head_dim): written to `out`; returns whether the unit is a library of its own (the
// short and fp32 row-wise units are compiled into the entry library).
bool unit_name(const GqaPlan& plan, char* out, int size) {
    if (plan.width > 0) {
        std::snprintf(out, size_t(size), "%s/%s/d%d", kFamilyNames[plan.family], kDtypeNames[plan.dtype], plan.width);
    } else {
        std::snprintf(out, size_t(size), "%s/%s", kFamilyNames[plan.family], kDtypeNames[plan.dtype]);
    }
    return !(plan.family == kGqaShort || (plan.family == kGqaRowwise && plan.dtype == kGqaFloat32));
}

// The wgmma and x3 units are built for sm_90a only.
bool unit_needs_sm90a(const GqaPlan& plan) { return plan.family == kGqaWgmma || plan.family == kGqaX3; }

}  // namespace
#endif  // GQA_PLAN_CUH
