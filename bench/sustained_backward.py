"""The 16-bit backward under sustained load (GPU only): back-to-back backward calls for a few
seconds, each timed by events, while nvidia-smi samples the SM clock and the power every 100 ms.
Prints the median of the first 10 calls and of the second half, with the clock and power
medians. The benchmark's backward (do_bench, about 100 ms of calls) measures near the sustained
state (bench/NOTES.md v99).

    python3 bench/sustained_backward.py [--seconds 4] [--dtype fp16] project:16,2048,32,8,64 sdpa_cudnn:16,2048,32,8,64 ...

Each run is IMPL:B,T,Hq,Hkv,D, IMPL one of the benchmark's implementations (bench_gqa.py's names,
built by its gqa_bench.impls); bf16 (or --dtype fp16) inputs from seed 0.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_module  # noqa: E402
from gqa_bench.impls import IMPL_NAMES, Implementations  # noqa: E402 (the script's folder, bench/, is on the path)

SYNC_EVERY = 20   # calls between synchronizations: the host stays a few calls ahead, as in do_bench


def parse_run(text):
    """'project:16,2048,32,8,64' -> ('project', (16, 2048, 32, 8, 64))."""
    impl, _, shape = text.partition(":")
    if impl not in IMPL_NAMES:
        raise argparse.ArgumentTypeError("implementation must be one of %s, got %r" % (list(IMPL_NAMES), impl))
    dims = tuple(int(x) for x in shape.split(","))
    if len(dims) != 5:
        raise argparse.ArgumentTypeError("shape must be B,T,Hq,Hkv,D, got %r" % shape)
    return impl, dims


def parse_seconds(text):
    """--seconds: at least 1, so that nvidia-smi's 100 ms samples cover the loop after the 3 dropped."""
    seconds = float(text)
    if not seconds >= 1.0:
        raise argparse.ArgumentTypeError("--seconds must be at least 1 (nvidia-smi samples every 100 ms), got %r" % text)
    return seconds


DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def run(impls, impl, shape, seconds, dtype):
    """One sustained loop; returns (call times in ms, [(SM MHz, W)] samples)."""
    B, T, Hq, Hkv, D = shape
    torch.manual_seed(0)
    leaves = [torch.randn(B, T, H, D, device="cuda", dtype=getattr(torch, dtype)).requires_grad_(True) for H in (Hq, Hkv, Hkv)]
    grad = torch.randn_like(leaves[0])
    fn, make_ctx = impls.build(impl, shape, dtype, leaves)
    with make_ctx():   # (an SDPA backend's choice; the backward follows the forward's)
        out = fn(*leaves)
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
    parser.add_argument("--seconds", type=parse_seconds, default=4.0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    impls = Implementations(torch, {"gqa_module": gqa_module}, {})
    for impl, shape in args.runs:
        times, samples = run(impls, impl, shape, args.seconds, DTYPES[args.dtype])
        clocks, watts = [c for c, _ in samples], [w for _, w in samples]
        n = len(times)
        print("%-5s %s calls %d: first 10 median %.3f ms, last half median %.3f ms | SM clock median %.0f MHz (min %.0f), "
              "power median %.0f W (max %.0f)" % (impl, shape, n, statistics.median(times[:10]), statistics.median(times[n // 2:]),
                                                  statistics.median(clocks), min(clocks), statistics.median(watts), max(watts)),
              flush=True)


if __name__ == "__main__":
    main()
