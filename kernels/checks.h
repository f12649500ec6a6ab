// The input rules of every entry point, in one copy: the CUDA entry library (binding.cpp) and the
// CPU library (cpu_checks.cpp, which builds without CUDA, for the PyTorch path) both include this
// file. Only ATen's core headers: nothing here needs a CUDA toolkit or a CUDA build of torch.
#ifndef GQA_CHECKS_H
#define GQA_CHECKS_H


#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "gqa_params.h"

#define GQA_CHECK_ARG(cond, ...) TORCH_CHECK_VALUE(cond, "causal_gqa_attention: ", __VA_ARGS__)
// A rule of gqa_check_inputs, in the name of its `entry`.
#define GQA_RULE(cond, ...) TORCH_CHECK_VALUE(cond, entry, ": ", __VA_ARGS__)

// Numbers in messages are formatted with std::to_string, never with an ostream: on the H200 test
// machine, formatting an integer through a std::ostringstream in this library crashed the process
// (segmentation fault) instead of raising, while string and dtype pieces were fine.
inline std::string gqa_num(int64_t x) { return std::to_string(x); }
inline std::string gqa_dims(at::IntArrayRef sizes) {
    std::string s = "[";
    for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
    return s + "]";
}

// The kernels' dtype code (gqa_params.h), or -1 for a dtype they do not take.
inline int gqa_dtype_code(c10::ScalarType t) {
    switch (t) {
        case c10::ScalarType::Float: return kGqaFloat32;
        case c10::ScalarType::Half: return kGqaFloat16;
        case c10::ScalarType::BFloat16: return kGqaBFloat16;
        default: return -1;
    }
}

// The rules, in the order a user would want to hear about them. Each message names the argument.
// CUDA inputs take float32, float16 and bfloat16; CPU inputs (the PyTorch path) float64 too, so
// that torch.autograd.gradcheck can run. `entry` names the function in the messages; `same_length`:
// k and v have q's T (causal_gqa_attention), or any number of keys (attention, on the CPU).
inline void gqa_check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const char* entry = "causal_gqa_attention", bool same_length = true) {
    GQA_RULE(q.dim() == 4, "q must be 4-D [B, T, Hq, D], got a ", gqa_num(q.dim()), "-D tensor");
    GQA_RULE(k.dim() == 4, "k must be 4-D [B, T, Hkv, D], got a ", gqa_num(k.dim()), "-D tensor");
    GQA_RULE(v.dim() == 4, "v must be 4-D [B, T, Hkv, D], got a ", gqa_num(v.dim()), "-D tensor");
    GQA_RULE(k.sizes() == v.sizes(), "k and v must have the same shape, got k ", gqa_dims(k.sizes()), " and v ",
             gqa_dims(v.sizes()));
    GQA_RULE(k.size(0) == q.size(0), "k must have q's batch size B (dim 0): q has ", gqa_num(q.size(0)),
             ", k has ", gqa_num(k.size(0)));
    GQA_RULE(!same_length || k.size(1) == q.size(1), "k must have q's sequence length T (dim 1): q has ",
             gqa_num(q.size(1)), ", k has ", gqa_num(k.size(1)));
    GQA_RULE(k.size(3) == q.size(3), "k must have q's head_dim D (dim 3): q has ", gqa_num(q.size(3)),
             ", k has ", gqa_num(k.size(3)));
    GQA_RULE(k.size(2) >= 1, "k must have at least one kv head (dim 2), got ", gqa_num(k.size(2)));
    GQA_RULE(q.size(2) % k.size(2) == 0, "q's head count Hq (dim 2, ", gqa_num(q.size(2)),
             ") must be a multiple of k's head count Hkv (dim 2, ", gqa_num(k.size(2)), ")");
    GQA_RULE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
             "q, k and v must share one dtype, got q ", c10::toString(q.scalar_type()), ", k ",
             c10::toString(k.scalar_type()), ", v ", c10::toString(v.scalar_type()));
    const bool on_cpu = q.device().is_cpu();
    GQA_RULE(gqa_dtype_code(q.scalar_type()) >= 0 || (on_cpu && q.scalar_type() == c10::ScalarType::Double),
             "q has unsupported dtype ", c10::toString(q.scalar_type()),
             on_cpu ? ": expected float32, float16, bfloat16 or (on the CPU) float64"
                         : ": expected float32, float16 or bfloat16 (float64 runs on the CPU only)");
    GQA_RULE(q.device() == k.device() && q.device() == v.device(),
             "q, k and v must be on the same device, got q ", q.device().str(), ", k ", k.device().str(),
             ", v ", v.device().str());
    GQA_RULE(q.size(3) >= 1 && q.size(3) <= kGqaMaxHeadDim, "head_dim D (q.shape[3]) must be in 1..",
             gqa_num(kGqaMaxHeadDim), ", got ", gqa_num(q.size(3)));
    GQA_RULE(q.size(2) == 0 || (q.size(1) <= INT32_MAX / q.size(2) && q.size(0) <= INT32_MAX),
             "q is too large: B and T * Hq must each fit in 32 bits");
}

#endif  // GQA_CHECKS_H
