// The warp-specialised kernel's CTA shape, read by the plan and by the kernel.
#ifndef GQA_WS_RULES_CUH
#define GQA_WS_RULES_CUH

#include "common/base.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Consumer warpgroups of the warp-specialised kernel, 64 packed rows each (gqa_params.h:
// gqa_ws_consumers). Three at width 64: a third warp on each SM sub-partition to issue from while
// the others wait, 1.09x at (16, 2048, 32, 8, 64); two elsewhere (NOTES v86).
constexpr int ws_consumers(int width) { return gqa_ws_consumers(width); }

// The consumers a call runs with at its width. Where the width has three, two (CTAs of 128
// packed rows) where they leave the busiest CTA fewer rows to walk: shapes whose tiles fill one
// round or little more, where longer tiles only lengthen the last CTA (three measured 0.85x of two
// at (1, 1000, 6, 2, 64), one round either way). Ties go to three. The grid is one CTA an SM at
// most (the persistent walk).
inline int ws_consumers_for(const GqaParams& p, int width, int64_t sms) {
    const int most = ws_consumers(width);
    if (most == 2) return 2;
    auto busiest_rows = [&](int consumers) {
        const int64_t rows = 64 * consumers, ctas = packed_row_ctas(p, int(rows));
        const int64_t grid = ctas < sms ? ctas : sms;
        return grid > 0 ? (ctas + grid - 1) / grid * rows : 0;
    };
    return busiest_rows(most) <= busiest_rows(2) ? most : 2;
}

}  // namespace
#endif  // GQA_WS_RULES_CUH
