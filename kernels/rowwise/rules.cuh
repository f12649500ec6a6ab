// The row-wise family's shared-memory layout and grid, read by the plan and by the kernel.
#ifndef GQA_ROWWISE_RULES_CUH
#define GQA_ROWWISE_RULES_CUH

#include "common/base.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Row-wise kernel for short sequences (and tiny head dims): plain fp32 FMA, no tensor cores.
// There the tiled kernel is bound by latency, not arithmetic: its splits, barriers and merges
// cost more than the few products a short row needs, so what counts is the number of dependent
// instructions on the longest warp. One warp owns RW consecutive packed (time step, head) rows,
// which share every key: at G = RW they are the G heads of one time step, so each key row read
// from shared memory feeds RW dot products. The CTA loads the keys its rows need into shared
// memory in one phase (in chunks of kc keys when they do not fit), every load in flight at once.
// Each warp then works a chunk in passes of up to 128 keys:
//   1. scores, lane j taking keys j, j + 32, j + 64, j + 96 of the pass for all RW rows, kept in
//      registers; one max per row, then exponentials, stored as RW-wide vectors per key;
//   2. P V with each lane owning a float4 of head-dim columns and every ks-th key (ks = 4 at
//      head_dim 32), RW rows at a time; keys that only some rows attend take a guarded tail
//      loop, so a row never multiplies a value row it does not attend (Inf and NaN follow the
//      reference); the lanes that share columns are summed at the end.
// Index arithmetic divides by divisors prepared on the host (FastDiv).
// Two shapes of CTA (warps NW x rows per warp RW), picked by the size of the grid: see
// launch_rowwise_best.
constexpr int kRowKeysPerPass = 128;          // keys scored per pass: four per lane
constexpr int kRowSmemBudget = 96 * 1024;     // bytes of shared memory per CTA, at most

struct RowwiseDivs {
    FastDiv bh;      // B * Hkv: CTA index -> (row tile, batch and kv head)
    FastDiv hkv;     // Hkv
    FastDiv group;   // G: packed row -> time step
    FastDiv width;   // copy items per row (D / 4 for 16-byte fp32 copies, else D4)
    int planned;     // 1: fp32, 16-byte rows, one chunk, at most rowwise_planned_copies(RW) copies per thread
};
// Copies per thread that the planned path addresses before the wait for the previous grid: the
// one-row-per-warp layout (small, latency-bound grids) only; 0 turns the path off.
__host__ __device__ constexpr int rowwise_planned_copies(int rw) { return rw == 1 ? 16 : 0; }

// Shared-memory layout, in floats. D4 is D rounded up to 4 (rows are read as float4; columns
// D..D4-1 hold zeros). The q/K pitch is 4 (mod 8), so each 8-lane phase of a float4 read of 8
// different keys covers all 32 banks once.
__host__ __device__ constexpr int rowwise_d4(int D) { return (D + 3) & ~3; }
__host__ __device__ constexpr int rowwise_k_pitch(int D) { return ((D + 7) & ~7) + 4; }
// Fixed part: the CTA's q rows and each warp's probabilities for one pass; then per key: K and V.
__host__ __device__ constexpr int rowwise_fixed_floats(int D, int nw, int rw) {
    return nw * rw * rowwise_k_pitch(D) + nw * kRowKeysPerPass * rw;
}
__host__ __device__ constexpr int rowwise_key_floats(int D) { return rowwise_k_pitch(D) + rowwise_d4(D); }

// Keys per shared-memory chunk of the row-wise kernel: the whole sequence when it fits the
// budget, else the most whole warps of keys that do (below 32: none fits).
inline int rowwise_chunk_keys(const GqaParams& p, int nw, int rw) {
    const int fixed = rowwise_fixed_floats(p.D, nw, rw), per_key = rowwise_key_floats(p.D);
    const int cap = (kRowSmemBudget / int(sizeof(float)) - fixed) / per_key / 32 * 32;
    return std::min((p.T + 31) / 32 * 32, cap);
}

}  // namespace
#endif  // GQA_ROWWISE_RULES_CUH
