// The one contract between the PyTorch-facing binding (binding.cpp) and the CUDA kernels
// (attention.cu). Plain data only, so the CUDA translation unit never includes a torch header.
#ifndef GQA_PARAMS_H
#define GQA_PARAMS_H
#include <cstdint>

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

    // Scratch for the fp32 path on sm_90a: gqa_workspace_bytes(params) bytes, 256-byte aligned,
    // allocated by the caller on the launch stream when that is not 0, else null.
    void* workspace;
    // Set by the dispatcher only: CTAs of the fp32 tiled kernel to run (1) or skip (0); null = all.
    const uint8_t* redo;
};

// Both return a cudaError_t as int (0 on success); `stream` is a cudaStream_t.
int gqa_forward(const GqaParams& params, void* stream);
int gqa_empty_launch(void* out, void* stream);
// Bytes of scratch gqa_forward needs for these params on the current device (0: none).
int64_t gqa_workspace_bytes(const GqaParams& params);

// Largest supported head_dim.
constexpr int kGqaMaxHeadDim = 256;

#endif  // GQA_PARAMS_H
