// The short family's shape, read by the plan and by the kernel.
#ifndef GQA_SHORT_RULES_CUH
#define GQA_SHORT_RULES_CUH

#include "common/base.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Short fp32 sequences on tensor cores: T <= kShortMaxT, head_dim <= 32 in 16-byte rows, grids
// too small to fill the GPU with the row-wise kernel's warps. A CTA owns 16 packed rows; warp w
// takes keys 16w..16w+15 of them, computes S and P V as 3xTF32 mma.sync (short_qk, short_pv) and
// parks its partial softmax state for a merge at the end. Each warp copies its own q rows (through
// L1: the CTA's warps ask for the same lines) and K/V slice, every copy addressed before the wait
// for the previous grid; q lands in a copy group of its own and is split while K and V land. No
// CTA barrier until the merge. The products run every k-step and column tile of DP (columns past
// D are zero-filled and add zeros) with three TF32 terms, all fixed at compile time: loops that
// depend on D or on allow_tf32 break the mma chains into branches (bench/NOTES.md v23), so allow_tf32 does
// not change this kernel. A warp whose S or P V comes out NaN (Inf or NaN among its inputs: the
// TF32 split of an infinity is NaN) redoes that product in plain fp32 over the keys each row
// attends, so a non-finite value reaches exactly the rows the reference gives it.
constexpr int kShortWarps = 8;
constexpr int kShortKeys = 16;                            // keys per warp
constexpr int kShortRows = 16;                            // packed rows per CTA: one mma m-tile
constexpr int kShortMaxT = kShortWarps * kShortKeys;      // every key a row attends has a warp
static_assert(kShortKeys == kShortRows, "the q, K and V slices of a warp have the same shape");
template <int DP> constexpr int short_smem_bytes() { return int(sizeof(float)) * kShortWarps * 3 * kShortRows * (DP + 4); }

}  // namespace
#endif  // GQA_SHORT_RULES_CUH
