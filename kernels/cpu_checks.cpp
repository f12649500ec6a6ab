// The CPU library: the input rules (checks.h) as ops for the PyTorch path, built without CUDA, so
// that a CPU-only torch runs the library's CPU path. Its own op namespace, gqa_attn_cpu, so that
// it loads beside the CUDA entry library (gqa_attn) in one process.

#include <torch/library.h>

#include "checks.h"

namespace {

void check_inputs_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::string_view entry,
                     bool same_length) {
    gqa_check_inputs(q, k, v, std::string(entry).c_str(), same_length);
}

}  // namespace

TORCH_LIBRARY(gqa_attn_cpu, m) {
    m.def("check_inputs(Tensor q, Tensor k, Tensor v, str entry=\"causal_gqa_attention\", bool same_length=True) -> ()",
          &check_inputs_op);
}
