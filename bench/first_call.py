#!/usr/bin/env python3
"""First calls of the library on a GPU, in fresh processes: what a user waits for the builds.

Usage (from anywhere; the repository root is found from this file's location):

    python bench/first_call.py OUT.json

Every case runs `python -c CHILD` with its own TORCH_EXTENSIONS_DIR and reports, from the child:
`first_call_s`, the first call itself (torch imported, CUDA context up, inputs on the GPU, to the
synchronized end of the call: the builds it needs, the loads and the launch), `process_s`, the
child from its first line, the plan the call took, and the libraries built in its directory.

- cold, one case per kernel library (family, input dtype, head_dim width), at a shape that takes it;
  the harness shape (2, 80, 8, 2, 32) fp32 is the first, and runs again (--repeats, default 3, each
  in a new directory: the record gives every time and the median); then warm, as often: the harness
  shape in a new process on a built directory;
- four processes at once, cold, at the harness shape: all must succeed, with one entry build;
- a killed build: a process killed while it builds, then a new one on the same directory;
- TORCH_CUDA_ARCH_LIST=Hopper: the harness shape cold, and the plans of the fp32 and bf16 scale
  shapes (the wgmma and x3 libraries must still be taken).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HARNESS = ((2, 80, 8, 2, 32), "float32")
# (shape, dtype, the plan's unit): one per kernel library a call can build (the short and fp32
# row-wise units live in the entry library). Head dims 60 and 116 in 16-bit give rows that are not
# 16-byte multiples, which the tiled family takes at widths 64 and 128.
LIBRARY_CASES = (
    (HARNESS[0], HARNESS[1], "short/fp32/d32"),
    ((2, 100, 8, 2, 64), "float32", "rowwise/fp32"),
    ((2, 100, 8, 2, 64), "float16", "rowwise/fp16"),
    ((2, 100, 8, 2, 64), "bfloat16", "rowwise/bf16"),
    *(((1, 300, 4, 1, d), "float32", "tiled/fp32/d%d" % w) for d, w in ((32, 32), (64, 64), (128, 128), (256, 256))),
    *(((1, 300, 4, 1, d), dt, "tiled/%s/d%d" % (name, w))
      for dt, name in (("float16", "fp16"), ("bfloat16", "bf16")) for d, w in ((32, 32), (60, 64), (116, 128), (256, 256))),
    *(((1, 1024, 8, 2, d), dt, "wgmma/%s/d%d" % (name, d))
      for dt, name in (("float16", "fp16"), ("bfloat16", "bf16")) for d in (64, 128)),
    *(((4, 1024, 32, 8, d), "float32", "x3/fp32/d%d" % d) for d in (64, 128)),
)
SCALE_SHAPES = ((4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64))

CHILD = r"""
import json, os, sys, time
started = time.perf_counter()
sys.path.insert(0, sys.argv[1])
import torch
import gqa_module
shape, dtype = json.loads(sys.argv[2]), getattr(torch, sys.argv[3])
B, T, Hq, Hkv, D = shape
q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype) for H in (Hq, Hkv, Hkv))
torch.cuda.synchronize()
ready = time.perf_counter()
out = gqa_module.causal_gqa_attention(q, k, v)
torch.cuda.synchronize()
done = time.perf_counter()
plans = {}
for extra in json.loads(sys.argv[4]):
    xq, xk, xv = (torch.empty(extra[0], extra[1], H, extra[4], device="cuda", dtype=getattr(torch, extra[5]))
                  for H in (extra[2], extra[3], extra[3]))
    plans[json.dumps(extra)] = gqa_module.plan(xq, xk, xv)
root = os.environ["TORCH_EXTENSIONS_DIR"]
print("RESULT " + json.dumps({
    "first_call_s": done - ready, "process_s": done - started, "plan": gqa_module.plan(q, k, v),
    "finite": bool(torch.isfinite(out).all()), "plans": plans,
    "libraries": sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))}))
"""


def child(cache_dir, shape, dtype, env=None, extra_plans=()):
    """A started child process for one first call (see CHILD)."""
    full_env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache_dir), **(env or {}))
    args = [sys.executable, "-c", CHILD, str(REPO_ROOT), json.dumps(list(shape)), dtype, json.dumps(list(extra_plans))]
    return subprocess.Popen(args, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    """The child's RESULT record, with its return code and, on failure, the end of its stderr."""
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    record = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    record["returncode"] = proc.returncode
    record["entry_builds"] = err.count("compiling the entry library")
    record["units_built_beside_entry"] = err.count("beside the entry library")
    if proc.returncode != 0 or not lines:
        record["stderr_tail"] = err[-2000:]
    return record


def run_cases(tmp, units=None, repeats=3, checkpoint=lambda results: None):
    """Every case in order, the harness shape cold and warm `repeats` times each; `checkpoint(results)`
    after each, so a run cut short still leaves its record."""
    results = {"library_cold": [], "harness_cold_repeats": [], "warm": [], "four_at_once": None,
               "killed_build": None, "arch_hopper": None}
    cases = [case for i, case in enumerate(LIBRARY_CASES) if i == 0 or units is None or case[2] in units]
    for i, (shape, dtype, family) in enumerate(cases):
        record = finish(child(tmp / ("cold%d" % i), shape, dtype))
        record.update(shape=list(shape), dtype=dtype, library=family,
                      took_it=record.get("plan", "").startswith(family))
        results["library_cold"].append(record)
        print("cold %-18s %-26s %6.2f s (plan %s)" % (family, shape, record.get("first_call_s", float("nan")),
                                                       record.get("plan")), flush=True)
        checkpoint(results)
    for i in range(1, repeats):   # the harness shape cold again, each in a new directory
        record = finish(child(tmp / ("harness%d" % i), *HARNESS))
        results["harness_cold_repeats"].append(record)
        print("cold harness again %.2f s" % record.get("first_call_s", float("nan")), flush=True)
        checkpoint(results)
    for _ in range(repeats):   # warm: the harness shape in a new process on a built directory
        results["warm"].append(finish(child(tmp / "cold0", *HARNESS)))
        print("warm harness %.2f s" % results["warm"][-1].get("first_call_s", float("nan")), flush=True)
        checkpoint(results)

    procs = [child(tmp / "four", *HARNESS) for _ in range(4)]
    records = [finish(p) for p in procs]
    results["four_at_once"] = {"all_ok": all(r["returncode"] == 0 and r.get("finite") for r in records),
                               "entry_builds": sum(r["entry_builds"] for r in records),
                               "first_call_s": [r.get("first_call_s") for r in records]}
    print("four at once: %s" % results["four_at_once"], flush=True)
    checkpoint(results)

    victim = child(tmp / "killed", *HARNESS)
    deadline = time.time() + 120
    # the entry library's build (the one built through ninja)
    while time.time() < deadline and not list((tmp / "killed").glob("*/build.ninja")):
        time.sleep(0.05)
    time.sleep(0.5)   # inside nvcc
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    after = finish(child(tmp / "killed", *HARNESS))
    results["killed_build"] = {"next_ok": after["returncode"] == 0 and bool(after.get("finite")),
                               "next_first_call_s": after.get("first_call_s"), "stderr_tail": after.get("stderr_tail")}
    print("killed build, next: %s" % results["killed_build"], flush=True)
    checkpoint(results)

    extra = [list(s) + [dt] for s in SCALE_SHAPES for dt in ("float32", "bfloat16")]
    hopper = finish(child(tmp / "hopper", *HARNESS, env={"TORCH_CUDA_ARCH_LIST": "Hopper"}, extra_plans=extra))
    results["arch_hopper"] = hopper
    print("TORCH_CUDA_ARCH_LIST=Hopper: %.2f s, plans %s" % (hopper.get("first_call_s", float("nan")),
                                                             hopper.get("plans")), flush=True)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="where the JSON record goes")
    parser.add_argument("--units", help="comma-separated units to run cold (the harness shape always runs); default: all")
    parser.add_argument("--repeats", type=int, default=3,
                        help="cold and warm first calls at the harness shape, each reported with their median (default 3)")
    args = parser.parse_args(argv)
    units = set(args.units.split(",")) if args.units else None
    if units and units - {case[2] for case in LIBRARY_CASES}:
        parser.error("unknown units: %s" % ", ".join(sorted(units - {case[2] for case in LIBRARY_CASES})))
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import gqa_module

    def record(results, complete):
        cold = [r.get("first_call_s") or float("inf") for r in results["library_cold"]]
        harness = [r.get("first_call_s") or float("inf") for r in results["library_cold"][:1] + results["harness_cold_repeats"]]
        warm = [r.get("first_call_s") or float("inf") for r in results["warm"]]
        return {
            "source_sha256": gqa_module.kernel_source_sha256(), "complete": complete,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "units": sorted(units) if units else "all",
            "harness_cold_s": statistics.median(harness) if harness else None, "harness_cold_all_s": harness,
            "slowest_cold_s": max(cold) if cold else None,
            "warm_s": statistics.median(warm) if warm else None, "warm_all_s": warm,
            **results,
        }

    def write(data):
        with open(args.out, "w") as fh:
            json.dump(data, fh, indent=1)

    with tempfile.TemporaryDirectory(prefix="gqa_first_call_") as tmp:
        results = run_cases(Path(tmp), units, max(1, args.repeats), checkpoint=lambda partial: write(record(partial, False)))
    data = record(results, True)
    write(data)
    print("harness cold %.2f s, slowest cold %.2f s, warm %.2f s; wrote %s"
          % (data["harness_cold_s"], data["slowest_cold_s"], data["warm_s"] or float("nan"), args.out))


if __name__ == "__main__":
    main()
