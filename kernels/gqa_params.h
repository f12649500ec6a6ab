// The one contract between the PyTorch-facing binding (binding.cpp), the entry point
// (attention.cu: plan and dispatch) and the kernel family libraries. Plain data only, so no CUDA
// translation unit includes a torch header.
#ifndef GQA_PARAMS_H
#define GQA_PARAMS_H
#include <cstdint>

#include "common/geometry.cuh"

enum GqaDtype : int { kGqaFloat32 = 0, kGqaFloat16 = 1, kGqaBFloat16 = 2 };

struct GqaParams {
    const void* q;  // (B, T, Hq, D), last dim contiguous
    const void* k;  // (B, T, Hkv, D), last dim contiguous
    const void* v;  // (B, T, Hkv, D), last dim contiguous
    void* o;        // (B, T, Hq, D), contiguous, written by the kernel

    // Element strides of the three leading dims; the last dim has stride 1.
    int64_t q_stride_b, q_stride_t, q_stride_h;
    int64_t k_stride_b, k_stride_t, k_stride_h;
    int64_t v_stride_b, v_stride_t, v_stride_h;
    int64_t o_stride_b, o_stride_t, o_stride_h;

    int B, T, Hq, Hkv, D;
    int group;          // Hq / Hkv: query heads that share one kv head
    float scale_log2;   // log2(e) / sqrt(D): softmax scale folded into exp2
    int dtype;          // GqaDtype of q, k, v and o
    bool tf32_single;   // one TF32 product instead of three (allow_tf32 was set)
    bool vec16;         // every row start is 16-byte aligned: copy 16 bytes at a time

    // Scratch for the fp32 path on sm_90a: gqa_workspace_bytes(params, plan) bytes, 256-byte aligned,
    // allocated by the caller on the launch stream when that is not 0, else null.
    void* workspace;
    // Set by the dispatcher only: CTAs of the fp32 tiled kernel to run (1) or skip (0); null = all.
    const uint8_t* redo;
    // Null, or (B, T, Hq) floats for each row's log2 of the sum of 2^(s * log2(e) / sqrt(D)), for a
    // backward: the 16-bit warp-specialised kernel and the fp32 x3 kernel write them; where they do
    // not run, the wgmma unit and the caller fill them with NaN (meaning "not kept").
    float* lse2;
};

// The device facts a plan depends on.
// The 16-bit wgmma backward's fused kernel (dK, dV and dQ in one, dQ summed in the scratch of
// gqa_backward_workspace_floats) runs instead of its two kernels at width 128 from this many query
// rows (gqa_backward_fused): it does five tile products a tile pair where they do seven, and
// measured 1.07x of them at T = 8192, 1.19x at 32768, 0.69x at 1024 (bench/NOTES.md v92).
constexpr int kGqaFusedBackwardMinT = 8192;
// The same at width 64, from this many query rows, where the group has at least
// kGqaFusedBackwardMinGroup64 query heads and the kernel's longest CTAs take at most 1 /
// kGqaFusedBackwardBalance64 of an SM's share of its grid's steps (gqa_fused_grid_balanced).
// Measured faster than the two kernels at (16, 2048, 32, 8, 64) and (32, 1024, 32, 8, 64) and
// slower at (4, 4096, 32, 8, 64), (1, 8192, 32, 8, 64), (2, 4096, 32, 4, 64) (long CTAs a quarter
// or more of an SM's share) and (8, 2048, 16, 16, 64) (one head a group) (bench/NOTES.md v107).
constexpr int kGqaFusedBackwardMinT64 = 1024;
constexpr int kGqaFusedBackwardMinGroup64 = 4;
constexpr int kGqaFusedBackwardBalance64 = 8;
// For measurement: the fused kernel at widths 64 and 128 for every T.
constexpr bool kGqaFusedBackward = false;
// The fused kernel without a scan of the inputs before it: the statistics pass flags Inf or NaN in
// q, o and dout (bit 0 of GqaBwdParams::nonfinite), the fused kernel in its own K and V tiles (bit
// 1), and it returns early on bit 0 alone, which every one of its CTAs sees alike (bench/NOTES.md
// v95).
constexpr bool kGqaFusedScanFree = true;

// The backward's inputs and outputs: every tensor contiguous, q, o, dout and dq (B, T, Hq, D), k, v,
// dk and dv (B, T, Hkv, D), in one dtype; lse2 and delta are scratch of gqa_bwd_stat_floats each.
struct GqaBwdParams {
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    void* dq;
    void* dk;
    void* dv;
    float* lse2;        // per query row: log2 of the softmax's sum of 2^(s * log2(e))
    float* delta;       // per query row: dout . o
    // Zero before the tensor-core kernels, which set it (not zero) when they find Inf or NaN in q,
    // k, v, o or dout. For the fused kernel the statistics pass sets bit 0 for q, o and dout and the
    // fused kernel bit 1 for its K and V tiles (a scan of the inputs before it sets it instead when
    // kGqaFusedScanFree is false). The row-wise kernels, told to by rows_if_nonfinite, then redo the
    // call. A tile product multiplies masked zeros by the values of keys and queries the row does not
    // attend, and 0 * Inf is NaN.
    int* nonfinite;
    // Scratch of the wgmma unit's fused kernel (gqa_fused_dq_floats; null elsewhere, 16-byte
    // aligned): dQ summed in fp32 over the key tiles in blocks of 64 query rows (bwdwg/fused.cuh),
    // and per block how many shares have been added to it.
    float* dq_accum;
    int* dq_order;
    // Scratch of the x3 unit (gqa_x3_bwd_floats; null elsewhere, 16-byte aligned): its statistics,
    // then q, dO, k and v scaled and split into fp16 hi and lo rows (bwdx3/bwdx3.cu).
    void* work;
    // Null, or the forward's lse2 (GqaParams::lse2): rows holding a number need no first pass.
    const float* lse2_in;
    // lse2_in is set and comes from a forward whose plan keeps every row (the wgmma family's; the
    // others leave it NaN): the fused kernel's statistics then take it as it is (FusedTraits::kRowStats).
    bool lse2_kept;
    bool rows_if_nonfinite;   // the row-wise kernels run only when *nonfinite is set
    // Row-wise kernel 1 forms delta_i = sum_j p_ij dp_ij from the p it recomputes (two more passes
    // over the row's keys) instead of dO_i . o_i: attention()'s 16-bit calls, whose o is rounded to
    // 16 bits, which would show in dQ and dK magnified (sum_j dS_ij not zero; bwdmma/kernels.cuh,
    // Pol::kDeltaFix).
    bool delta_from_p;
    bool fused;               // gqa_backward_fused: the wgmma unit runs its fused kernel
    // The fused kernel's CTAs in chunks of this many (batch, kv head) pairs, key tile by key tile
    // within a chunk; 0: key tile by key tile over the whole grid (set by its launch).
    int fused_chunk;
    int B, T, Hq, Hkv, D;
    int group;          // Hq / Hkv
    float scale;        // 1 / sqrt(D), or attention()'s softmax_scale (row-wise kernels)
    float scale_log2;   // log2(e) times scale
    int dtype;          // GqaDtype
    // Which keys each query row sees (geo.Tq is T; k, v, dk and dv have geo.Tk rows). The row-wise
    // kernels take any geometry; the tensor-core families causal attention with Tq = Tk alone.
    GqaGeometry geo;
};

// The row-wise forward for any sequence geometry (gqa_rows_forward): contiguous q, o (B, Tq, Hq, D)
// and k, v (B, Tk, Hkv, D); lse, natural log, (B, Hq, Tq) as FlashAttention lays it out.
struct GqaRowsParams {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    int B, Hq, Hkv, D, group;
    float scale_log2;   // log2(e) times the softmax scale
    int dtype;          // GqaDtype
    GqaGeometry geo;
};

struct GqaDevice {
    int sm_count;
    int cc_major;
};

// Kernel families (attention.cu describes when each is taken).
enum GqaFamily : int { kGqaRowwise = 0, kGqaShort = 1, kGqaTiled = 2, kGqaWgmma = 3, kGqaX3 = 4, kGqaFamilies = 5 };

// Which kernel a call runs, decided once per call by gqa_make_plan and read by the workspace
// sizing, the launch and plan().
struct GqaPlan {
    int family;    // GqaFamily
    int dtype;     // GqaDtype
    int width;     // compiled head_dim width (row-wise: 0, any head_dim)
    int warps;     // warps per CTA (wgmma: 4 a warpgroup, the producer's and the consumers')
    int split;     // row-wise: rows per warp; tiled: warps that split each K/V tile; else 1
    bool planned;  // row-wise: every copy addressed before the wait for the previous grid
};

// The warp-specialised forward's consumer warpgroups at a head_dim width, 64 packed rows each:
// three at width 64, two elsewhere. A wgmma plan at width 64 takes two ("-rows128" in its name)
// where three would leave its busiest CTA more rows to walk (ws/rules.cuh: ws_consumers_for).
constexpr int gqa_ws_consumers(int width) { return width == 64 ? 3 : 2; }

// A family library's entry, `gqa_launch_<family name>`: runs the plan on `stream`, returns a
// cudaError_t value (0 on success).
typedef int (*GqaLauncher)(const GqaParams* params, const GqaPlan* plan, void* stream);
// Builds (first time) and loads the library of one unit of a family, named "family/dtype" or
// "family/dtype/dWIDTH" (kernels/<family>/<family>.cu with GQA_DTYPE = dtype, a GqaDtype, and
// GQA_WIDTH = width), for sm_90a where `sm90a` is 1; returns its GqaLauncher, or null on failure.
typedef void* (*GqaModuleLoader)(const char* unit, int dtype, int width, int sm90a);
typedef int (*GqaBwdLauncher)(const GqaBwdParams* params, void* stream);
// gqa_forward's result when the plan's library could not be built or loaded.
constexpr int kGqaModuleUnavailable = -1;

// The ints below are cudaError_t values (0 on success); `stream` is a cudaStream_t.
int gqa_device_facts(GqaDevice* out);   // of the current device
GqaPlan gqa_make_plan(const GqaParams& params, const GqaDevice& device);
// The parameters the plan reads for a shape with no tensors (plan.cuh's shape_params).
GqaParams gqa_shape_params(int B, int T, int Hq, int Hkv, int D, int dtype, bool aligned, bool allow_tf32);
// Every plan gqa_make_plan can return on this build, numbered 0..gqa_plan_count() - 1.
int gqa_plan_count();
GqaPlan gqa_plan_at(int index);
// Bytes of scratch the plan needs (0: none).
int64_t gqa_workspace_bytes(const GqaParams& params, const GqaPlan& plan);
int gqa_forward(const GqaParams& params, const GqaPlan& plan, void* stream);
void gqa_set_module_loader(GqaModuleLoader loader);
const char* gqa_family_name(int family);   // "rowwise", "short", "tiled", "wgmma" or "x3"
const char* gqa_dtype_name(int dtype);     // "fp32", "fp16" or "bf16"
// Finds (building where needed) the launcher of every plan; returns how many could not be loaded.
int gqa_load_every_plan();
int gqa_empty_launch(void* out, void* stream);
int gqa_backward(const GqaBwdParams& params, void* stream);   // dq, dk and dv; 0 or a cudaError_t
// Any geometry, row-wise (fp32 arithmetic, every dtype and head_dim): the forward, and the backward
// of params.geo (the tensor-core families are not asked); 0 or a cudaError_t.
int gqa_rows_forward(const GqaRowsParams& params, void* stream);
int gqa_rows_backward(const GqaBwdParams& params, void* stream);
// Which backward a call runs: "bwdmma/<dtype>/d<width>" (tensor cores) or "backward/<dtype>" (row-wise).
const char* gqa_backward_plan(const GqaBwdParams& params);
// Whether the call runs the wgmma unit's fused kernel (GqaBwdParams::fused, set from this with the
// sizes, before the scratch is sized): width 128 from kGqaFusedBackwardMinT query rows and width 64
// by kGqaFusedBackwardMinT64's rule, or at either width from the value of the environment variable
// GQA_FUSED_BACKWARD_MIN_T where it is set (the tests and the sanitizer take the kernel at small T
// with it).
bool gqa_backward_fused(const GqaBwdParams& params);
// Whether the fused kernel's longest CTAs (key tile 0, n_q G steps of 64 rows) take at most 1 /
// `part` of an SM's share of its grid's steps on a device of sm_count SMs: key tile kt of a (batch,
// kv head) pair walks (n_q - 2 kt) G steps, n_k (n_q - n_k + 1) G over its n_k key tiles.
inline bool gqa_fused_grid_balanced(const GqaBwdParams& p, int sm_count, int part) {
    const int64_t n_q = (int64_t(p.T) + 63) / 64, n_k = (int64_t(p.T) + 127) / 128;
    const int64_t steps = int64_t(p.B) * p.Hkv * p.group * n_k * (n_q - n_k + 1);
    return part * n_q * p.group * sm_count <= steps;
}
// Floats of lse2 (and of delta) in the backward's scratch. The tensor-core kernels keep them as
// [B, Hq, T64], T rounded up to 64 steps and the rows past T zero, so that a query tile's 64 values
// are one 16-byte-aligned run of 256 bytes; the row-wise kernels use the first B * T * Hq of them
// as [B, T, Hq].
inline int64_t gqa_bwd_stat_floats(int B, int T, int Hq) { return int64_t(B) * Hq * ((int64_t(T) + 63) / 64 * 64); }
// Floats of scratch the backward needs beyond lse2, delta and the flag (0: none).
int64_t gqa_backward_workspace_floats(const GqaBwdParams& params);
// The fused kernel's part of it: dQ summed in fp32 in blocks of 64 query rows x D per (batch,
// head, query tile), then a counter per block.
inline int64_t gqa_fused_dq_floats(const GqaBwdParams& p) {
    const int64_t blocks = int64_t(p.B) * p.Hq * ((p.T + 63) / 64);
    return blocks * 64 * p.D + blocks;
}
// The x3 unit's part of it: the statistics' bytes (the rows after them stay 16-byte aligned), then
// q, dO, k and v as fp16 hi and lo rows of 2 D values, then fp32 rows of q's shape (the dQ kernel's
// sum_j P_ij K_j), then the largest |x| of each (head, channel) of q, k and dO.
constexpr int64_t kGqaX3BwdStatsBytes = 256;
#ifdef __CUDACC__
__host__ __device__
#endif
inline int64_t gqa_x3_bwd_channel_words(const GqaBwdParams& p) { return int64_t(2 * p.Hq + p.Hkv) * p.D; }
inline int64_t gqa_x3_bwd_floats(const GqaBwdParams& p) {
    const int64_t halves = 2 * (int64_t(p.B) * p.T * (p.Hq + p.Hkv)) * 2 * p.D;
    return kGqaX3BwdStatsBytes / 4 + halves / 2 + int64_t(p.B) * p.T * p.Hq * p.D + gqa_x3_bwd_channel_words(p);
}
// Reads q, k and v once and writes o = q: the memory floor of a call, for benchmarks.
int gqa_read_floor(const GqaParams& params, void* stream);

// Largest supported head_dim.
constexpr int kGqaMaxHeadDim = 256;

#endif  // GQA_PARAMS_H
