// The PyTorch-facing side: the op schema, input validation (checks.h: the one copy of the rules,
// which the CPU library shares), the device guard and the launch on the current stream. The
// kernels see only GqaParams (gqa_params.h).
//
// Only light headers are included (no torch/extension.h, no pybind11): the library registers
// its ops with TORCH_LIBRARY and Python reaches them through torch.ops.gqa_attn.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"

namespace {

// A view whose last dim is contiguous is used as it is; anything else is copied once.
at::Tensor with_unit_last_stride(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

bool rows_16b_aligned(const at::Tensor& t) {
    const int64_t elem = int64_t(t.element_size());
    const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
    return addr % 16 == 0 && (t.size(3) * elem) % 16 == 0 && (t.stride(0) * elem) % 16 == 0 &&
           (t.stride(1) * elem) % 16 == 0 && (t.stride(2) * elem) % 16 == 0;
}

// The params of a call (out may be undefined: plan() runs nothing). The inputs' last dims are
// contiguous (with_unit_last_stride).
GqaParams params_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out) {
    GqaParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = out.defined() ? out.data_ptr() : nullptr;
    p.q_stride_b = q.stride(0), p.q_stride_t = q.stride(1), p.q_stride_h = q.stride(2);
    p.k_stride_b = k.stride(0), p.k_stride_t = k.stride(1), p.k_stride_h = k.stride(2);
    p.v_stride_b = v.stride(0), p.v_stride_t = v.stride(1), p.v_stride_h = v.stride(2);
    if (out.defined()) p.o_stride_b = out.stride(0), p.o_stride_t = out.stride(1), p.o_stride_h = out.stride(2);
    p.B = int(q.size(0)), p.T = int(q.size(1)), p.Hq = int(q.size(2)), p.Hkv = int(k.size(2)), p.D = int(q.size(3));
    p.group = p.Hkv > 0 ? p.Hq / p.Hkv : 1;
    p.scale_log2 = float(1.4426950408889634 / std::sqrt(double(p.D)));
    p.dtype = gqa_dtype_code(q.scalar_type());
    p.tf32_single = q.scalar_type() == c10::ScalarType::Float && at::globalContext().allowTF32CuBLAS();
    p.vec16 = rows_16b_aligned(q) && rows_16b_aligned(k) && rows_16b_aligned(v);
    return p;
}

GqaDevice current_device() {
    GqaDevice dev{};
    const int err = gqa_device_facts(&dev);
    TORCH_CHECK(err == 0, "causal_gqa_attention: cannot read the device: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return dev;
}

// "family/dtype/shape", e.g. "rowwise/fp32/8x1-planned", "tiled/fp32/d64-split8", "x3/fp32/d128",
// "wgmma/bf16/d64-rows128" (fewer consumer warpgroups than the width's own, gqa_ws_consumers).
std::string plan_name(const GqaPlan& plan) {
    std::string s = std::string(gqa_family_name(plan.family)) + "/" + gqa_dtype_name(plan.dtype) + "/";
    if (plan.family == kGqaRowwise) {
        s += gqa_num(plan.warps) + "x" + gqa_num(plan.split) + (plan.planned ? "-planned" : "");
    } else {
        s += "d" + gqa_num(plan.width) + (plan.split > 1 ? "-split" + gqa_num(plan.split) : "");
        if (plan.family == kGqaWgmma && plan.warps != 4 * (1 + gqa_ws_consumers(plan.width))) {
            s += "-rows" + gqa_num(16 * (plan.warps - 4));
        }
    }
    return s;
}

// The inputs as the kernels take them: checked, each last dim contiguous (copied once otherwise).
struct KernelInputs {
    at::Tensor q, k, v;
};
KernelInputs kernel_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    gqa_check_inputs(q, k, v);
    return {with_unit_last_stride(q), with_unit_last_stride(k), with_unit_last_stride(v)};
}

// The forward; with `lse2` defined ((B, T, Hq) floats), also each row's log-sum-exp for a backward,
// or NaN in it where the plan keeps none.
at::Tensor forward_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& lse2) {
    const KernelInputs in = kernel_inputs(q_in, k_in, v_in);
    const at::Tensor &q = in.q, &k = in.k, &v = in.v;
    const c10::cuda::CUDAGuard device_guard(q.device());
    at::Tensor out = at::empty(q.sizes(), q.options());
    if (out.numel() == 0) return out;

    GqaParams p = params_of(q, k, v, out);
    const GqaPlan plan = gqa_make_plan(p, current_device());
    if (lse2.defined()) {
        p.lse2 = lse2.data_ptr<float>();
        if (plan.family != kGqaWgmma) lse2.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    // Scratch lives until the end of this call; the caching allocator orders its reuse on the stream.
    const int64_t scratch_bytes = gqa_workspace_bytes(p, plan);
    at::Tensor scratch;
    if (scratch_bytes > 0) {
        scratch = at::empty({scratch_bytes}, q.options().dtype(c10::ScalarType::Byte));
        p.workspace = scratch.data_ptr();
    }
    const int err = gqa_forward(p, plan, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err != kGqaModuleUnavailable, "causal_gqa_attention: the kernels of plan ", plan_name(plan),
                " could not be built or loaded (the build's error is printed above; load the library through "
                "gqa_module, which builds them on first use)");
    TORCH_CHECK(err == 0, "causal_gqa_attention: kernel launch failed (", plan_name(plan), "): ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
    return out;
}

at::Tensor causal_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return forward_cuda(q, k, v, at::Tensor());
}

// The forward of a call that a backward will follow: the output and the rows' log-sum-exp (NaN
// where the plan keeps none; the backward then computes it).
std::tuple<at::Tensor, at::Tensor> causal_attention_trainable_cuda(const at::Tensor& q, const at::Tensor& k,
                                                                   const at::Tensor& v) {
    gqa_check_inputs(q, k, v);
    at::Tensor lse2 = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(c10::ScalarType::Float));
    return {forward_cuda(q, k, v, lse2), lse2};
}

// The plan a call with these inputs takes on their device, without running it.
std::string plan_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in) {
    const KernelInputs in = kernel_inputs(q_in, k_in, v_in);
    const c10::cuda::CUDAGuard device_guard(in.q.device());
    TORCH_CHECK_VALUE(in.q.numel() > 0, "causal_gqa_attention: empty inputs run no kernel, so they have no plan");
    return plan_name(gqa_make_plan(params_of(in.q, in.k, in.v, at::Tensor()), current_device()));
}

// The plan for a shape on a described device, with no tensors and no GPU (this build's kernels).
std::string plan_for(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, c10::ScalarType dtype,
                     bool aligned, bool allow_tf32, int64_t sm_count, int64_t cc_major) {
    GQA_CHECK_ARG(B >= 1 && T >= 1 && Hkv >= 1 && Hq >= 1, "plan_for needs B, T, Hq and Hkv of at least 1");
    GQA_CHECK_ARG(Hq % Hkv == 0, "q's head count Hq (", gqa_num(Hq), ") must be a multiple of Hkv (", gqa_num(Hkv), ")");
    GQA_CHECK_ARG(D >= 1 && D <= kGqaMaxHeadDim, "head_dim D must be in 1..", gqa_num(kGqaMaxHeadDim), ", got ", gqa_num(D));
    GQA_CHECK_ARG(gqa_dtype_code(dtype) >= 0, "unsupported dtype ", c10::toString(dtype), ": expected float32, float16 or bfloat16");
    GQA_CHECK_ARG(sm_count >= 1, "sm_count must be at least 1, got ", gqa_num(sm_count));
    const GqaParams p = gqa_shape_params(int(B), int(T), int(Hq), int(Hkv), int(D), gqa_dtype_code(dtype), aligned, allow_tf32);
    GqaDevice dev{};
    dev.sm_count = int(sm_count), dev.cc_major = int(cc_major);
    return plan_name(gqa_make_plan(p, dev));
}

// Where attention.cu asks for a family's library on its first use (a GqaModuleLoader's address).
void set_module_loader(int64_t address) { gqa_set_module_loader(reinterpret_cast<GqaModuleLoader>(address)); }

// Builds and loads the kernels of every plan and the backward's tensor-core units (what first calls
// build one at a time); returns how many could not be loaded.
int64_t load_every_plan() { return gqa_load_every_plan(); }

std::vector<std::string> all_plans() {
    std::vector<std::string> names;
    for (int i = 0; i < gqa_plan_count(); ++i) names.push_back(plan_name(gqa_plan_at(i)));
    return names;
}

// The read floor for benchmarks: allocate o, read q, k and v once, write o = q.
at::Tensor read_floor_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in) {
    gqa_check_inputs(q_in, k_in, v_in);
    const c10::cuda::CUDAGuard device_guard(q_in.device());
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    if (out.numel() == 0) return out;
    const int err = gqa_read_floor(params_of(q, k, v, out), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "read_floor: launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return out;
}

// The floor for benchmarks: the same allocation and one launch of an empty kernel.
at::Tensor empty_call_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const c10::cuda::CUDAGuard device_guard(q.device());
    at::Tensor out = at::empty(q.sizes(), q.options());
    const int err = gqa_empty_launch(out.data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "empty_call: launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return out;
}

// The backward's sizes, scales and dtype (no pointers).
GqaBwdParams backward_params_of(const at::Tensor& q, const at::Tensor& k) {
    GqaBwdParams p{};
    p.B = int(q.size(0)), p.T = int(q.size(1)), p.Hq = int(q.size(2)), p.Hkv = int(k.size(2)), p.D = int(q.size(3));
    p.group = p.Hq / p.Hkv;
    p.scale = float(1.0 / std::sqrt(double(p.D)));
    p.scale_log2 = float(1.4426950408889634 / std::sqrt(double(p.D)));
    p.dtype = gqa_dtype_code(q.scalar_type());
    p.geo = gqa_geometry(p.T, p.T, true, -1, 0);
    p.fused = gqa_backward_fused(p);
    return p;
}

// Whether the forward on these inputs kept every row's lse2 (forward_cuda): its plan is the wgmma
// family's and no stride of theirs is zero (a broadcast, which no tensor map takes, runs the tiled
// kernel, which keeps none: wgmma/wgmma.cu). The inputs were checked by the caller; one whose last
// stride is not 1 (the forward planned on a copy) answers no. A wrong no costs the statistics pass
// of the dQ kernel; a wrong yes costs time only too, never a wrong gradient: the fused kernel's
// statistics flag the rows left NaN and the row-wise kernels redo the call.
bool forward_keeps_lse2(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    for (const at::Tensor* t : {&q, &k, &v})
        for (int d = 0; d < 4; ++d)
            if (t->stride(d) == 0 || (d == 3 && t->stride(d) != 1)) return false;
    return gqa_make_plan(params_of(q, k, v, at::Tensor()), current_device()).family == kGqaWgmma;
}

// dq, dk and dv of causal_attention, from its inputs, its output and the output's gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
    const at::Tensor& grad_in, const at::Tensor& lse2_in) {
    gqa_check_inputs(q_in, k_in, v_in);
    GQA_CHECK_ARG(out_in.sizes() == q_in.sizes() && grad_in.sizes() == q_in.sizes(),
                  "backward: out and grad_out must have q's shape ", gqa_dims(q_in.sizes()), ", got out ",
                  gqa_dims(out_in.sizes()), " and grad_out ", gqa_dims(grad_in.sizes()));
    GQA_CHECK_ARG(out_in.scalar_type() == q_in.scalar_type() && grad_in.scalar_type() == q_in.scalar_type(),
                  "backward: out and grad_out must have q's dtype ", c10::toString(q_in.scalar_type()), ", got out ",
                  c10::toString(out_in.scalar_type()), " and grad_out ", c10::toString(grad_in.scalar_type()));
    GQA_CHECK_ARG(out_in.device() == q_in.device() && grad_in.device() == q_in.device(),
                  "backward: out and grad_out must be on q's device ", q_in.device().str());
    GQA_CHECK_ARG(lse2_in.numel() == 0 ||
                      (lse2_in.scalar_type() == c10::ScalarType::Float && lse2_in.device() == q_in.device() &&
                       lse2_in.dim() == 3 && lse2_in.size(0) == q_in.size(0) && lse2_in.size(1) == q_in.size(1) &&
                       lse2_in.size(2) == q_in.size(2)),
                  "backward: lse2 must be empty or float32 (B, T, Hq) ", gqa_dims(q_in.sizes().slice(0, 3)),
                  " on q's device, got ", c10::toString(lse2_in.scalar_type()), " ", gqa_dims(lse2_in.sizes()));
    const c10::cuda::CUDAGuard device_guard(q_in.device());
    // The tensor-core kernels read 16-byte vectors: a contiguous tensor that starts off 16 bytes
    // (a view at an odd offset) is copied once, O(T) against the backward's O(T^2).
    const auto packed = [](const at::Tensor& t) {
        const at::Tensor c = t.contiguous();
        return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
    };
    const at::Tensor q = packed(q_in), k = packed(k_in), v = packed(v_in), out = packed(out_in), grad = packed(grad_in);
    at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (q.numel() == 0) return {dq, dk.zero_(), dv.zero_()};
    GqaBwdParams p = backward_params_of(q, k);
    const int64_t rows = gqa_bwd_stat_floats(p.B, p.T, p.Hq);
    const int64_t extra = gqa_backward_workspace_floats(p);
    // lse2, delta, the flag, then (16-byte aligned: 2 rows + 4 floats in, rounded up to 4) the
    // unit's scratch, its counters last.
    const int64_t head = (2 * rows + 4 + 3) / 4 * 4;
    at::Tensor scratch = at::empty({head + extra}, q.options().dtype(c10::ScalarType::Float));
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr(), p.dout = grad.data_ptr();
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    p.lse2 = scratch.data_ptr<float>(), p.delta = p.lse2 + rows;
    p.nonfinite = reinterpret_cast<int*>(p.delta + rows);
    p.dq_accum = extra > 0 ? p.lse2 + head : nullptr;
    p.dq_order = extra > 0 ? reinterpret_cast<int*>(p.dq_accum + extra) - int64_t(p.B) * p.Hq * ((p.T + 63) / 64) : nullptr;
    p.work = extra > 0 ? p.lse2 + head : nullptr;
    const at::Tensor lse2 = lse2_in.numel() > 0 ? lse2_in.contiguous() : lse2_in;
    p.lse2_in = lse2.numel() > 0 ? lse2.data_ptr<float>() : nullptr;
    p.lse2_kept = p.lse2_in != nullptr && p.fused && forward_keeps_lse2(q_in, k_in, v_in);   // the fused path's alone
    const int err = gqa_backward(p, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err != kGqaModuleUnavailable, "causal_gqa_attention backward: the kernels of ", gqa_backward_plan(p),
                " could not be built or loaded (the build's error is printed above)");
    TORCH_CHECK(err == 0, "causal_gqa_attention backward: kernel launch failed (", gqa_backward_plan(p), "): ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
    return {dq, dk, dv};
}

// attention() beyond causal attention with Tq = Tk: the window (-1: unbounded on that side; causal
// is window_right = 0) and the softmax scale, checked; the geometry of q against k (the inputs'
// rules checked by the caller).
GqaGeometry checked_geometry(const at::Tensor& q, const at::Tensor& k, int64_t window_left, int64_t window_right,
                             double scale) {
    TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, "attention: window_size must be (left, right) with "
                      "each -1 (unbounded) or >= 0, got (", std::to_string(window_left), ", ", std::to_string(window_right), ")");
    TORCH_CHECK_VALUE(std::isfinite(scale), "attention: softmax_scale must be finite");
    const auto side = [](int64_t w) { return int(std::min<int64_t>(w, INT32_MAX)); };
    return gqa_geometry(int(q.size(1)), int(k.size(1)), false, side(window_left), side(window_right));
}

// The row-wise forward for any geometry: the output and each row's log-sum-exp ((B, Hq, Tq), natural
// log, -inf where a row sees no key).
std::tuple<at::Tensor, at::Tensor> attention_rows_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                       const at::Tensor& v_in, int64_t window_left,
                                                       int64_t window_right, double scale) {
    gqa_check_inputs(q_in, k_in, v_in, "attention", false);
    const GqaGeometry geo = checked_geometry(q_in, k_in, window_left, window_right, scale);
    const c10::cuda::CUDAGuard device_guard(q_in.device());
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(c10::ScalarType::Float));
    if (out.numel() == 0) return {out, lse};
    GqaRowsParams p{};
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr(), p.lse = lse.data_ptr<float>();
    p.B = int(q.size(0)), p.Hq = int(q.size(2)), p.Hkv = int(k.size(2)), p.D = int(q.size(3)), p.group = p.Hq / p.Hkv;
    p.scale_log2 = float(1.4426950408889634 * scale);
    p.dtype = gqa_dtype_code(q.scalar_type());
    p.geo = geo;
    const int err = gqa_rows_forward(p, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "attention: kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return {out, lse};
}

// Its backward: dq, dk and dv from the inputs, the output and the output's gradient (the row-wise
// kernels recompute each row's log-sum-exp).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_rows_backward_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& out_in,
    const at::Tensor& grad_in, int64_t window_left, int64_t window_right, double scale) {
    gqa_check_inputs(q_in, k_in, v_in, "attention", false);
    const GqaGeometry geo = checked_geometry(q_in, k_in, window_left, window_right, scale);
    GQA_CHECK_ARG(out_in.sizes() == q_in.sizes() && grad_in.sizes() == q_in.sizes() &&
                      out_in.scalar_type() == q_in.scalar_type() && grad_in.scalar_type() == q_in.scalar_type() &&
                      out_in.device() == q_in.device() && grad_in.device() == q_in.device(),
                  "attention backward: out and grad_out must have q's shape, dtype and device");
    const c10::cuda::CUDAGuard device_guard(q_in.device());
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const at::Tensor out = out_in.contiguous(), grad = grad_in.contiguous();
    // every key row is written (zeros where no query sees it)
    at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options());
    at::Tensor dv = at::empty(v.sizes(), v.options());
    if (q.numel() == 0) return {dq, dk.zero_(), dv.zero_()};
    GqaBwdParams p = backward_params_of(q, k);
    p.scale = float(scale), p.scale_log2 = float(1.4426950408889634 * scale);
    p.geo = geo;
    p.fused = false;
    p.delta_from_p = p.dtype != kGqaFloat32;   // o rounded to 16 bits
    const int64_t rows = gqa_bwd_stat_floats(p.B, p.T, p.Hq);
    at::Tensor scratch = at::empty({2 * rows + 4}, q.options().dtype(c10::ScalarType::Float));
    p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.o = out.data_ptr(), p.dout = grad.data_ptr();
    p.dq = dq.data_ptr(), p.dk = dk.data_ptr(), p.dv = dv.data_ptr();
    p.lse2 = scratch.data_ptr<float>(), p.delta = p.lse2 + rows;
    p.nonfinite = reinterpret_cast<int*>(p.delta + rows);
    const int err = gqa_rows_backward(p, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "attention backward: kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
    return {dq, dk, dv};
}

// Which backward kernels a call with these inputs runs.
std::string backward_plan_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    gqa_check_inputs(q, k, v);
    const c10::cuda::CUDAGuard device_guard(q.device());   // the plan reads the current device's facts
    return gqa_backward_plan(backward_params_of(q, k));
}

// With grad mode on and an input that requires grad, the call goes to causal_attention_trainable:
// the same kernels, whose autograd formula (gqa_module.py registers it) runs
// causal_attention_backward. Otherwise it skips autograd, so inference pays nothing for it.
at::Tensor causal_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);
    if (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
        using Trainable = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&);
        static const auto trainable = c10::Dispatcher::singleton()
                                          .findSchemaOrThrow("gqa_attn::causal_attention_trainable", "")
                                          .typed<Trainable>();
        return std::get<0>(trainable.call(q, k, v));
    }
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("gqa_attn::causal_attention", "").typed<Signature>();
    return op.call(q, k, v);
}

}  // namespace

TORCH_LIBRARY(gqa_attn, m) {
    m.def("causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor");
    m.def("causal_attention_trainable(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)");
    m.def("causal_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, Tensor lse2) -> "
          "(Tensor, Tensor, Tensor)");
    m.def("attention_rows(Tensor q, Tensor k, Tensor v, int window_left, int window_right, float scale) -> "
          "(Tensor, Tensor)");
    m.def("attention_rows_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor grad_out, int window_left, "
          "int window_right, float scale) -> (Tensor, Tensor, Tensor)");
    m.def("empty_call(Tensor q, Tensor k, Tensor v) -> Tensor");
    m.def("read_floor(Tensor q, Tensor k, Tensor v) -> Tensor");
    m.def("plan(Tensor q, Tensor k, Tensor v) -> str");
    m.def("backward_plan(Tensor q, Tensor k, Tensor v) -> str");
    m.def("plan_for(int B, int T, int Hq, int Hkv, int D, ScalarType dtype, bool aligned, bool allow_tf32, "
          "int sm_count, int cc_major) -> str", &plan_for);
    m.def("all_plans() -> str[]", &all_plans);
    m.def("_set_module_loader(int address) -> ()", &set_module_loader);
    m.def("_load_every_plan() -> int", &load_every_plan);
}

TORCH_LIBRARY_IMPL(gqa_attn, CUDA, m) {
    m.impl("causal_attention", &causal_attention_cuda);
    m.impl("causal_attention_trainable", &causal_attention_trainable_cuda);
    m.impl("causal_attention_backward", &causal_attention_backward_cuda);
    m.impl("attention_rows", &attention_rows_cuda);
    m.impl("attention_rows_backward", &attention_rows_backward_cuda);
    m.impl("empty_call", &empty_call_cuda);
    m.impl("read_floor", &read_floor_cuda);
    m.impl("plan", &plan_cuda);
    m.impl("backward_plan", &backward_plan_cuda);
}

TORCH_LIBRARY_IMPL(gqa_attn, Autograd, m) { m.impl("causal_attention", &causal_attention_autograd); }
