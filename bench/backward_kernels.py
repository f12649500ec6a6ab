"""Each kernel's share of one backward call: CUDA time per kernel over a few calls, from torch's
profiler, at the benchmark's backward shapes or one given shape (GPU only). The benchmark times
the backward as a whole; this says which kernel a change should aim at.

    python3 bench/backward_kernels.py [B T Hq Hkv D] [--dtype bf16|fp16|fp32] [--calls N] [--call]

--call also times the backward as the benchmark does (forward + backward minus forward, do_bench
medians after an L2 flush) in the same process, so that time outside the kernels shows.
"""
import argparse
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_module  # noqa: E402
from gqa_bench.timing import Timer  # noqa: E402 (the script's folder, bench/, is on the path)

SHAPES = [(4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64), (2, 4096, 16, 4, 256)]


def inputs_of(shape, dtype):
    """Standard normal q, k and v of `shape` (B, T, Hq, Hkv, D) in `dtype`, from seed 0."""
    B, T, Hq, Hkv, D = shape
    torch.manual_seed(0)
    return [torch.randn(B, T, H, D, device="cuda").to(dtype) for H in (Hq, Hkv, Hkv)]


def kernel_times(shape, dtype, calls):
    """{kernel name: (microseconds a call, launches a call)} of the backward at `shape`."""
    q, k, v = (x.requires_grad_(True) for x in inputs_of(shape, dtype))
    grad_out = torch.randn_like(q)
    out = gqa_module.causal_gqa_attention(q, k, v)
    torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)   # builds and warms every unit
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
        torch.cuda.synchronize()
    total, count = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    return {name: (total[name] / calls, count[name] / calls) for name in total}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", nargs="*", type=int)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--call", action="store_true", help="also the benchmark's time of the backward call")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timer = Timer(torch) if args.call else None
    for shape in [tuple(args.shape)] if args.shape else SHAPES:
        times = kernel_times(shape, dtype, args.calls)
        whole = sum(us for us, _ in times.values())
        print("%s %s backward plan %s: %.1f us of kernels a call" % (shape, args.dtype, gqa_module.backward_plan(
            *(torch.empty(shape[0], shape[1], h, shape[4], device="cuda", dtype=dtype) for h in (shape[2], shape[3], shape[3]))), whole))
        for name, (us, launches) in sorted(times.items(), key=lambda item: -item[1][0]):
            print("  %9.1f us %5.1f%%  x%-3g %s" % (us, 100 * us / whole, launches, name[:110]))
        if timer is not None:
            call_us = 1e3 * timer.time_backward(gqa_module.causal_gqa_attention, inputs_of(shape, dtype))
            print("  call (the benchmark's method): %.1f us, %.1f us over the kernels" % (call_us, call_us - whole))


if __name__ == "__main__":
    main()
