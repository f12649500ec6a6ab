"""The 16-bit backward under sustained load (GPU only): back-to-back backward calls for a few
seconds, each timed by events, while nvidia-smi samples the SM clock and the power every 100 ms.
Prints the median of the first 10 calls and of the second half, with the clock and power
medians. The benchmark's backward (do_bench, about 100 ms of calls) measures near the sustained
state (bench/NOTES.md v99).

    python3 bench/sustained_backward.py [--seconds 4] ours:16,2048,32,8,64 cudnn:16,2048,32,8,64 ...

Each run is IMPL:B,T,Hq,Hkv,D with IMPL `ours` or `cudnn` (SDPA's cuDNN backend); bf16 inputs
from seed 0.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_module  # noqa: E402

SYNC_EVERY = 20   # calls between synchronizations: the host stays a few calls ahead, as in do_bench


def sdpa_cudnn(q, k, v):
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, enable_gqa=True).transpose(1, 2)


IMPLS = {"ours": gqa_module.causal_gqa_attention, "cudnn": sdpa_cudnn}


def parse_run(text):
    """'ours:16,2048,32,8,64' -> ('ours', (16, 2048, 32, 8, 64))."""
    impl, _, shape = text.partition(":")
    if impl not in IMPLS:
        raise argparse.ArgumentTypeError("implementation must be one of %s, got %r" % (sorted(IMPLS), impl))
    dims = tuple(int(x) for x in shape.split(","))
    if len(dims) != 5:
        raise argparse.ArgumentTypeError("shape must be B,T,Hq,Hkv,D, got %r" % shape)
    return impl, dims


def run(impl, shape, seconds):
    """One sustained loop; returns (call times in ms, [(SM MHz, W)] samples)."""
    B, T, Hq, Hkv, D = shape
    torch.manual_seed(0)
    leaves = [torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for H in (Hq, Hkv, Hkv)]
    grad = torch.randn_like(leaves[0])
    out = IMPLS[impl](*leaves)
    torch.autograd.grad(out, leaves, grad, retain_graph=True)
    torch.cuda.synchronize()
    time.sleep(2.0)   # the card cools between loops
    log = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    events = []
    start = time.time()
    while time.time() - start < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.autograd.grad(out, leaves, grad, retain_graph=True)
        b.record()
        events.append((a, b))
        if len(events) % SYNC_EVERY == 0:
            b.synchronize()
    torch.cuda.synchronize()
    log.terminate()
    text = log.communicate()[0]
    samples = [tuple(float(x) for x in line.split(",")) for line in text.strip().splitlines() if "," in line]
    return [a.elapsed_time(b) for a, b in events], samples[3:]   # the first samples predate the loop


def main():
    parser = argparse.ArgumentParser(description="The 16-bit backward under sustained load, with clock and power.")
    parser.add_argument("runs", nargs="+", type=parse_run, help="IMPL:B,T,Hq,Hkv,D")
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    for impl, shape in args.runs:
        times, samples = run(impl, shape, args.seconds)
        clocks, watts = [c for c, _ in samples], [w for _, w in samples]
        n = len(times)
        print("%-5s %s calls %d: first 10 median %.3f ms, last half median %.3f ms | SM clock median %.0f MHz (min %.0f), "
              "power median %.0f W (max %.0f)" % (impl, shape, n, statistics.median(times[:10]), statistics.median(times[n // 2:]),
                                                  statistics.median(clocks), min(clocks), statistics.median(watts), max(watts)),
              flush=True)


if __name__ == "__main__":
    main()
