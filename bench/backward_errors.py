"""Where the backward's gradients differ from float64 autograd: norm-relative error of dQ, dK and
dV per 64-row block of time steps, per head and per 64-column block of head_dim, for one shape, so
that a wrong tile, warpgroup or column half shows as its own row of numbers (GPU only).

    python3 bench/backward_errors.py [B T Hq Hkv D] [--dtype bf16|fp16|fp32]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_module  # noqa: E402
import reference  # noqa: E402


def blocks(err, ref, dim, size):
    """Norm-relative error of consecutive blocks of `size` along `dim` (sums over the other dims)."""
    out = []
    for start in range(0, ref.shape[dim], size):
        e, r = err.narrow(dim, start, min(size, ref.shape[dim] - start)), ref.narrow(dim, start, min(size, ref.shape[dim] - start))
        out.append(e.norm().item() / max(r.norm().item(), 1e-30))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", nargs="*", type=int, default=[1, 300, 4, 2, 128])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    args = parser.parse_args()
    B, T, Hq, Hkv, D = args.shape
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device="cuda").to(dtype) for H in (Hq, Hkv, Hkv))
    grad_out = torch.randn(B, T, Hq, D, device="cuda").to(dtype)
    print("backward plan", gqa_module.backward_plan(q, k, v))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    gqa_module.causal_gqa_attention(*leaves).backward(grad_out)
    exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    reference.causal_gqa_reference(*exact_leaves).backward(grad_out.double())
    for name, got, ref in zip(("dq", "dk", "dv"), (t.grad for t in leaves), (t.grad for t in exact_leaves)):
        err = got.double() - ref
        print("%s: whole %.3g, finite %s" % (name, err.norm().item() / ref.norm().item(), bool(torch.isfinite(got).all())))
        print("  per 64 steps  ", " ".join("%.2g" % x for x in blocks(err, ref, 1, 64)))
        print("  per head      ", " ".join("%.2g" % x for x in blocks(err, ref, 2, 1)))
        print("  per 64 columns", " ".join("%.2g" % x for x in blocks(err, ref, 3, 64)))


if __name__ == "__main__":
    main()
