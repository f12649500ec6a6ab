#!/usr/bin/env python3
"""Run every kernel plan of the library under NVIDIA's compute-sanitizer.

Three modes:

    python bench/sanitize.py --list          # no GPU: the case list with plan_for's plan for each
    python bench/sanitize.py --run-cases     # GPU: run every case once (normally under the sanitizer)
    python bench/sanitize.py [--out bench/results/sanitizer.json] [--tools memcheck,synccheck]
                                             # GPU: the driver (see below)

The case list (CASES) holds, for every plan of `gqa_module.all_plans()`, at least one small shape
that takes that plan on an H200 (132 SMs, an sm_90a build); BACKWARD_CASES run forward and backward
through autograd, for each dtype of the backward kernels. Every case runs twice: once on finite
random inputs, checked loosely against a float64 reference, and once with Inf and NaN injected
(NaN in v, +Inf in k, -Inf in q), which drives the kernels' non-finite paths, among them the x3
plan's second launch of the 3xTF32 kernel for the CTAs that met Inf or NaN. The sanitizer slows
kernels down 10-100x and adds a fixed cost per launch, so the shapes are as small as their plan
allows (the plan depends on the grid size against the 132 SMs; see the notes beside CASES).

`--run-cases` builds each case's inputs on the CPU from one seed (printed; `--seed` repeats a run)
and copies them to the GPU, so the only kernels the process launches are the library's own. Per
case it asserts that `gqa_module.plan(q, k, v)` is the declared plan, calls the op, synchronizes
and compares with `reference.causal_gqa_reference` on the CPU, then prints one `CASE` line. It
exits 1 when a case failed, after running all of them.

The driver builds the extension once outside the sanitizer (a plain `--run-cases`, which also
warms torch's extension cache and checks the plans), then runs `--run-cases` under
`compute-sanitizer --tool TOOL` for each tool (memcheck, racecheck, initcheck, synccheck by
default) with a timeout per tool, and writes a JSON summary: the kernel sources' sha256, device,
versions, date, seed, and per tool the sanitizer's error count, exit code, seconds, cases run and
plans covered (on failure, a digest of the reports and the output's tail). The sanitized runs
use no caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1), so every tensor is its own allocation.
A precise error ends only its kernel (--destroy-on-device-error kernel); when one still loses the
CUDA context, the tool runs again from the case after it (`--start`), so one bug hides no other.
`--dry-run` prints the commands only. Each run's full output goes to --log-dir.

`--resume` splits the tools over several runs (each run is bounded by its machine's time): the
tools that passed in the --out file of a run on the same kernel sources, seed (taken from that
file unless given), case selection and versions are kept, and the others run and are added to it; the JSON
then lists every run's start in `runs_started`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "sanitizer.json"
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")

# ------------------------------------------------------------------------------------------------
# The cases: (declared plan, B, T, Hq, Hkv, D, dtype, aligned, allow_tf32). `aligned` False places
# each of q, k and v one element past a 16-byte boundary (a storage offset of one element); odd
# head dims are unaligned rows by themselves. The plan is the one an H200 takes (132 SMs):
#  - rowwise 8x1 / 4x4: T <= 128 or D <= 8; 4x4 once ceil(T*G/8)*B*Hkv > 2*132 = 264 CTAs.
#    8x1-planned: fp32, 16-byte rows, one shared-memory chunk and few copies.
#  - short: fp32, 16-byte rows, D 9..32, T <= 128 and a grid of at most 264 CTAs of 8 rows.
#  - x3: fp32, T > 128, D 33..128 in 16-byte rows, allow_tf32 off, ceil(T*G/64)*B*Hkv >= 132.
#  - wgmma: fp16/bf16, T > 128, D 33..256 in 16-byte rows; at width 64 "-rows128" (two consumer
#    warpgroups) where CTAs of 192 rows would leave the busiest CTA more rows (ws/rules.cuh).
#  - tiled: the rest of T > 128; fp32 up to width 128 splits keys over 8 warps (split8) when
#    ceil(T*G/64)*B*Hkv < 132.
# Ragged on purpose: T never a multiple of 64 beyond 128, D odd where the plan allows, G = 3 where
# a CTA's rows straddle time steps, D = 256 in the row-wise kernel for several shared-memory
# chunks of keys.
CASES = (
    # fp32
    ("rowwise/fp32/8x1",          1,  45,  6,  2,   7, "fp32", True,  False),  # odd D
    ("rowwise/fp32/8x1",          1, 100,  2,  1, 256, "fp32", True,  False),  # 4 chunks of 32 keys
    ("rowwise/fp32/8x1-planned",  2,  33,  4,  2,  36, "fp32", True,  False),
    ("rowwise/fp32/4x4",          2,  17, 57, 19,  24, "fp32", True,  False),  # 266 CTAs
    ("short/fp32/d32",            1,  33,  6,  2,  20, "fp32", True,  False),
    ("tiled/fp32/d32",            8, 129,  8,  2,  20, "fp32", True,  False),  # 144 tiles
    ("tiled/fp32/d32-split8",     1, 150,  3,  1,  17, "fp32", True,  False),
    ("tiled/fp32/d64",            8, 130,  8,  2,  37, "fp32", True,  False),  # odd D: no x3
    ("tiled/fp32/d64-split8",     1, 129,  2,  1,  48, "fp32", True,  False),
    ("tiled/fp32/d128",           8, 129,  8,  2,  96, "fp32", True,  True),   # single TF32
    ("tiled/fp32/d128",           8, 129,  8,  2,  80, "fp32", False, False),  # offset rows
    ("tiled/fp32/d128-split8",    1, 150,  2,  1, 100, "fp32", True,  False),
    ("tiled/fp32/d256",           1, 129,  2,  1, 200, "fp32", True,  False),
    ("x3/fp32/d64",               8, 129,  8,  2,  40, "fp32", True,  False),  # 144 tiles
    ("x3/fp32/d128",              8, 129,  8,  2, 128, "fp32", True,  False),
    # fp16
    ("rowwise/fp16/8x1",          1, 200,  3,  1,   3, "fp16", True,  False),  # D <= 8, T > 128
    ("rowwise/fp16/4x4",          2,  17, 57, 19,  13, "fp16", True,  False),
    ("tiled/fp16/d32",            1, 129,  4,  2,  17, "fp16", True,  False),
    ("tiled/fp16/d64",            1, 150,  4,  2,  37, "fp16", True,  False),
    ("tiled/fp16/d128",           1, 129,  4,  2, 100, "fp16", True,  False),  # 200-byte rows
    ("tiled/fp16/d256",           1, 129,  2,  1, 129, "fp16", True,  False),
    ("wgmma/fp16/d64",           24, 129,  4,  2,  40, "fp16", True,  False),  # 3 consumers: 96 tiles of 192 rows
    ("wgmma/fp16/d64-rows128",    1, 129,  4,  2,  40, "fp16", True,  False),
    ("wgmma/fp16/d128",           1, 150,  4,  2,  72, "fp16", True,  False),
    ("wgmma/fp16/d256",           1, 200,  6,  2, 200, "fp16", True,  False),  # G = 3, 200-column rows
    # bf16
    ("rowwise/bf16/8x1",          1, 100,  4,  1, 256, "bf16", True,  False),
    ("rowwise/bf16/4x4",          2,  17, 57, 19,  24, "bf16", True,  False),
    ("tiled/bf16/d32",            2, 129,  4,  2,  32, "bf16", True,  False),
    ("tiled/bf16/d64",            1, 129,  4,  2,  64, "bf16", False, False),  # offset rows
    ("tiled/bf16/d128",           1, 129,  4,  2, 127, "bf16", True,  False),
    ("tiled/bf16/d256",           1, 129,  2,  1, 256, "bf16", False, False),  # offset rows
    ("wgmma/bf16/d64",           17, 129,  6,  2,  64, "bf16", True,  False),  # 3 consumers, G = 3: 102 tiles
    ("wgmma/bf16/d64-rows128",    2, 129,  4,  2,  64, "bf16", True,  False),
    ("wgmma/bf16/d128",           1, 129,  4,  2, 128, "bf16", True,  False),
    ("wgmma/bf16/d256",           2, 129,  4,  2, 256, "bf16", True,  False),
)
CASE_FIELDS = ("plan", "B", "T", "Hq", "Hkv", "D", "dtype", "aligned", "allow_tf32")

# The backward: forward and backward through autograd, each gradient checked against float64
# autograd of the reference. 16-bit at head_dim 64 and 128 takes the mma.sync unit up to 128 steps
# and the wgmma unit beyond, on an H200; fp32 at 64 and 128 takes the x3 unit beyond 128 steps.
BACKWARD_CASES = (
    ("backward/fp32",             1,  45,  6,  2,   7, "fp32", True,  False),  # odd D, G = 3
    ("backward/fp32",             1,  70,  2,  1, 256, "fp32", True,  False),  # 8 elements a lane
    ("backward/fp16",             1, 129,  4,  2,  40, "fp16", False, False),  # offset rows
    ("backward/bf16",             2,  65,  4,  1,  96, "bf16", True,  False),  # MQA
    ("bwdmma/fp16/d64",           1, 120,  6,  2,  64, "fp16", True,  False),  # 2 tiles, the last ragged
    ("bwdmma/fp16/d128",          2,  65,  4,  4, 128, "fp16", False, False),  # offset rows, MHA
    ("bwdmma/bf16/d64",           1,  70,  4,  1,  64, "bf16", True,  False),  # MQA
    ("bwdmma/bf16/d128",          1, 128,  8,  2, 128, "bf16", True,  False),
    ("bwdwg/fp16/d64",            1, 129,  6,  2,  64, "fp16", True,  False),  # 3 tiles, the last ragged
    ("bwdwg/fp16/d128",           2, 200,  4,  4, 128, "fp16", False, False),  # offset rows, MHA
    ("bwdwg/bf16/d64",            1, 300,  4,  1,  64, "bf16", True,  False),  # MQA
    ("bwdwg/bf16/d128",           1, 257,  8,  2, 128, "bf16", True,  False),
    # The fused kernel, which the library takes from 8192 query rows at width 128 and at width 64
    # from 1024 on large grids (kernels/gqa_params.h), here from FUSED_MIN_T rows
    # (GQA_FUSED_BACKWARD_MIN_T, set for these cases alone).
    ("bwdwg/fp16/d64/fused",      1, 300,  8,  2,  64, "fp16", True,  False),  # 3 key tiles, G = 4: 20 steps
    ("bwdwg/bf16/d64/fused",      2, 150,  3,  3,  64, "bf16", False, False),  # offset rows, MHA: 3 and 1 steps, a pair of one
    ("bwdwg/bf16/d64/fused",     20, 300, 16,  4,  64, "bf16", False, False),  # 80 pairs of 320 KB of sums: chunks of 76 and 4
    ("bwdwg/fp16/d128/fused",     2, 200,  4,  4, 128, "fp16", False, False),  # offset rows, MHA
    ("bwdwg/bf16/d128/fused",     1, 257,  8,  2, 128, "bf16", True,  False),  # 3 key tiles, the last of 1 row, G = 4
    ("bwdwg/fp16/d256",           1, 130,  4,  2, 256, "fp16", True,  False),  # 3 tiles, the last of 2 rows
    ("bwdwg/bf16/d256",           2, 193,  2,  2, 256, "bf16", False, False),  # offset rows, MHA
    ("bwdx3/fp32/d64",            1, 129,  6,  2,  64, "fp32", True,  False),  # 3 tiles, the last ragged, G = 3
    ("bwdx3/fp32/d128",           2, 200,  4,  4, 128, "fp32", False, False),  # offset rows, MHA
)


BACKWARD_PLANS = tuple(sorted({case[0] for case in BACKWARD_CASES}))

# attention() beyond causal attention with Tq = Tk: the row-wise kernels of any geometry, forward
# and backward (plan, B, Tq, Tk, Hq, Hkv, D, dtype, causal, window, softmax_scale), each against
# float64 autograd of the CPU path. Rows that see no key, windows on both sides, Tq > Tk and < Tk.
GEOMETRY_CASES = (
    ("rows/any/fp32",  1,  70,  45,  6,  2,   7, "fp32", True,  (-1, -1), None),   # 25 rows see no key
    ("rows/any/fp32",  2,  33, 100,  4,  1, 256, "fp32", False, (9, 4),   0.3),
    ("rows/any/fp16",  1, 129, 200,  4,  2,  40, "fp16", False, (-1, -1), None),
    ("rows/any/bf16",  2,  65,  65,  6,  3,  96, "bf16", True,  (16, -1), None),
)
GEOMETRY_PLANS = tuple(sorted({case[0] for case in GEOMETRY_CASES}))
FUSED_MIN_T = 129   # the fused cases' GQA_FUSED_BACKWARD_MIN_T


def every_plan():
    """The forward plans of the library (all_plans) and the backward's, one per dtype."""
    import gqa_module

    return sorted(gqa_module.all_plans()) + list(BACKWARD_PLANS) + list(GEOMETRY_PLANS)


def runs():
    """Every run of --run-cases, in order: each case on finite inputs, then with Inf and NaN; the
    forward plans, the backward, then the geometries."""
    return [(case, nonfinite) for case in CASES + BACKWARD_CASES + GEOMETRY_CASES for nonfinite in (False, True)]


def _torch_dtype(name):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def case_label(case, nonfinite):
    if case[0] in GEOMETRY_PLANS:
        plan, B, Tq, Tk, Hq, Hkv, D, dtype, causal, window, scale = case
        return "B=%d Tq=%d Tk=%d Hq=%d Hkv=%d D=%d %s causal=%s window=%s scale=%s%s" % (
            B, Tq, Tk, Hq, Hkv, D, dtype, causal, window, scale, " nonfinite" if nonfinite else "")
    plan, B, T, Hq, Hkv, D, dtype, aligned, allow_tf32 = case
    return "B=%d T=%d Hq=%d Hkv=%d D=%d %s%s%s%s" % (
        B, T, Hq, Hkv, D, dtype, "" if aligned else " offset", " tf32" if allow_tf32 else "",
        " nonfinite" if nonfinite else "")


def planned_for(case, sm_count=132, cc_major=9):
    """The plan gqa_module.plan_for gives the case on a described GPU (no GPU needed)."""
    import gqa_module

    plan, B, T, Hq, Hkv, D, dtype, aligned, allow_tf32 = case
    return gqa_module.plan_for(B, T, Hq, Hkv, D, dtype=_torch_dtype(dtype), aligned=aligned,
                               allow_tf32=allow_tf32, sm_count=sm_count, cc_major=cc_major)


# ------------------------------------------------------------------------------------------------
# --run-cases
def _upload(host, aligned):
    """A CUDA copy of a contiguous CPU tensor made without launching a kernel: a fresh allocation
    and a host-to-device copy. Unaligned: the copy starts one element into its allocation."""
    import torch

    offset = 0 if aligned else 1
    flat = torch.empty(host.numel() + offset, dtype=host.dtype, device="cuda")
    view = flat[offset:].view(host.shape)
    view.copy_(host)
    return view


def _nonfinite_positions(B, T, Hq, Hkv, D):
    """(tensor, index, value): NaN in v, +Inf in k, -Inf in q, two of each, away from t = 0 and in
    the first and last (batch, head), so other heads and early rows stay finite and an x3 call has
    CTAs with and without Inf/NaN."""
    nan, inf = float("nan"), float("inf")
    return [("v", (B - 1, T // 2, Hkv - 1, D // 2), nan), ("v", (0, T - 1, 0, 0), nan),
            ("k", (0, (2 * T) // 3, 0, D - 1), inf), ("k", (B - 1, T - 2, Hkv - 1, 0), inf),
            ("q", (0, T // 3, 0, 0), -inf), ("q", (B - 1, T - 1, Hq - 1, D - 1), -inf)]


# Loose bounds on |out - exact| (elementwise, atol = rtol) against float64: the point is a
# meaningful run (every element written, right rows and heads), not the accuracy tests' bounds.
LOOSE_TOL = {"fp32": 1e-3, "fp32-tf32": 1e-2, "fp16": 2e-2, "bf16": 6e-2}


def check_output(out, exact, dtype, allow_tf32, nonfinite):
    """(ok, detail) for an output against the float64 reference, both on the CPU."""
    import torch

    tol = LOOSE_TOL["fp32-tf32" if dtype == "fp32" and allow_tf32 else dtype]
    out64 = out.double()
    if tuple(out.shape) != tuple(exact.shape):
        return False, "shape %s, expected %s" % (list(out.shape), list(exact.shape))
    nan_diff = int((torch.isnan(out64) != torch.isnan(exact)).sum())
    inf_diff = int((torch.isinf(out64) != torch.isinf(exact)).sum())
    finite = torch.isfinite(exact) & torch.isfinite(out64)
    err = (out64[finite] - exact[finite]).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    close = bool(torch.allclose(out64[finite], exact[finite], atol=tol, rtol=tol))
    n_nan = int(torch.isnan(exact).sum())
    detail = "max_err=%.2e" % max_err + (" nan_expected=%d" % n_nan if nonfinite else "")
    if nan_diff or inf_diff:
        return False, detail + " NaN/Inf pattern differs from the reference at %d/%d elements" % (nan_diff, inf_diff)
    if not nonfinite and n_nan:
        return False, detail + " reference has NaN on finite inputs?"
    if nonfinite and n_nan == 0:
        return False, detail + " injected values reached no output row"
    if not close:
        return False, detail + " exceeds tolerance %.0e" % tol
    return True, detail


# Norm-relative bounds on each gradient against float64 (again a meaningful run, not the tests' bounds).
LOOSE_GRAD_TOL = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 5e-2}


def check_grads(grads, exact, dtype, nonfinite):
    """(ok, detail) for dq, dk, dv against float64 autograd's, all on the CPU: NaN exactly where
    the reference has NaN; on finite inputs, each within LOOSE_GRAD_TOL."""
    import torch

    details = []
    for name, got, ref in zip(("dq", "dk", "dv"), grads, exact):
        got = got.double()
        if tuple(got.shape) != tuple(ref.shape):
            return False, "%s shape %s, expected %s" % (name, list(got.shape), list(ref.shape))
        nan_diff = int((torch.isnan(got) != torch.isnan(ref)).sum())
        if nan_diff:
            return False, "%s NaN pattern differs from the reference at %d elements" % (name, nan_diff)
        if not nonfinite:
            err = float((got - ref).norm() / ref.norm().clamp_min(1e-300))
            details.append("%s_rel=%.2e" % (name, err))
            if not err <= LOOSE_GRAD_TOL[dtype]:
                return False, " ".join(details) + " exceeds %.0e" % LOOSE_GRAD_TOL[dtype]
        else:
            details.append("%s_nan=%d" % (name, int(torch.isnan(ref).sum())))
    return True, " ".join(details)


def _run_backward(host, q, k, v, grad_host, reference):
    """The gradients of q, k and v (on the CPU) from autograd through the library, and float64
    autograd's through the reference."""
    import torch

    import gqa_module

    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = gqa_module.causal_gqa_attention(*leaves)
    grads = torch.autograd.grad(out, leaves, _upload(grad_host, True))
    torch.cuda.synchronize()
    grads = [g.cpu() for g in grads]
    exact_leaves = [host[name].double().requires_grad_(True) for name in ("q", "k", "v")]
    exact = torch.autograd.grad(reference.causal_gqa_reference(*exact_leaves), exact_leaves, grad_host.double())
    return grads, exact


def _run_geometry(case, nonfinite, gen):
    """One GEOMETRY_CASES run: attention() forward and backward on CUDA tensors against float64
    autograd of the CPU path; (ok, detail)."""
    import torch

    import gqa_geometry
    import gqa_module

    plan, B, Tq, Tk, Hq, Hkv, D, dtype, causal, window, scale = case
    host = {name: torch.randn(B, T, H, D, generator=gen).to(_torch_dtype(dtype))
            for name, T, H in (("q", Tq, Hq), ("k", Tk, Hkv), ("v", Tk, Hkv))}
    if nonfinite:
        for name, where, value in _nonfinite_positions(B, min(Tq, Tk), Hq, Hkv, D):
            host[name][where] = value
    grad_host = torch.randn(B, Tq, Hq, D, generator=gen).to(_torch_dtype(dtype))
    leaves = [_upload(host[name], True).requires_grad_(True) for name in ("q", "k", "v")]
    out, lse = gqa_module.attention(*leaves, causal=causal, window_size=window, softmax_scale=scale, return_lse=True)
    grads = torch.autograd.grad(out, leaves, _upload(grad_host, True))
    torch.cuda.synchronize()
    got = [out.detach().cpu(), lse.cpu()] + [g.cpu() for g in grads]
    exact_leaves = [host[name].double().requires_grad_(True) for name in ("q", "k", "v")]
    geo = gqa_geometry.arguments(exact_leaves[0], exact_leaves[1], causal, scale, window, 0.0, True)
    ref_out, ref_lse = gqa_geometry.attention_torch(*exact_leaves, geo)
    exact = [ref_out.detach(), ref_lse.detach()] + list(torch.autograd.grad(ref_out, exact_leaves, grad_host.double()))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, exact):
        a = a.double()
        same_kind = all(torch.equal(f(a), f(b)) for f in (torch.isnan, torch.isposinf, torch.isneginf))
        finite = torch.isfinite(b)
        err = float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0
        bound = LOOSE_TOL[dtype] * (1 + float(b[finite].abs().max()) if finite.any() else 1)
        if not same_kind or err > bound:
            return False, "%s: max_err=%.2e (bound %.2e), non-finite %s" % (name, err, bound, "as float64" if same_kind else "differ")
    return True, "max_err within %.0e" % LOOSE_TOL[dtype]


def run_cases(seed, only=None, start=0):
    """Run every case (or those whose plan matches `only`) from number `start` + 1 on; returns the
    process exit code. A case's inputs depend only on the seed and its number."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    import gqa_module
    import reference

    if not torch.cuda.is_available():
        print("--run-cases needs a CUDA GPU", file=sys.stderr)
        return 2
    gqa_module.load_extension()
    props = torch.cuda.get_device_properties(0)
    print("DEVICE %s | sm_count %d | cc %d.%d | torch %s | cuda %s" % (
        props.name, props.multi_processor_count, props.major, props.minor, torch.__version__, torch.version.cuda))
    print("SEED %d" % seed, flush=True)
    selected = [(c, nf) for c, nf in runs() if not only or re.search(only, c[0])]
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    failed, covered = 0, set()
    started = time.perf_counter()
    for index, (case, nonfinite) in list(enumerate(selected))[start:]:
        plan = case[0]
        case_seed = seed + index
        t0 = time.perf_counter()
        try:
            gen = torch.Generator().manual_seed(case_seed)
            if plan in GEOMETRY_PLANS:
                ok, detail = _run_geometry(case, nonfinite, gen)
            else:
                plan, B, T, Hq, Hkv, D, dtype, aligned, allow_tf32 = case
                host = {name: torch.randn(B, T, H, D, generator=gen).to(_torch_dtype(dtype))
                        for name, H in (("q", Hq), ("k", Hkv), ("v", Hkv))}
                if nonfinite:
                    for name, where, value in _nonfinite_positions(B, T, Hq, Hkv, D):
                        host[name][where] = value
                q, k, v = (_upload(host[name], aligned) for name in ("q", "k", "v"))
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
                if plan in BACKWARD_PLANS:
                    if plan.endswith("/fused"):
                        os.environ["GQA_FUSED_BACKWARD_MIN_T"] = str(FUSED_MIN_T)
                    got_plan = gqa_module.backward_plan(q, k, v)
                    if got_plan != plan:
                        raise AssertionError("backward plan %s, expected %s" % (got_plan, plan))
                    grad_host = torch.randn(B, T, Hq, D, generator=gen).to(_torch_dtype(dtype))
                    grads, exact = _run_backward(host, q, k, v, grad_host, reference)
                    del q, k, v
                    ok, detail = check_grads(grads, exact, dtype, nonfinite)
                else:
                    got_plan = gqa_module.plan(q, k, v)
                    if got_plan != plan:
                        raise AssertionError("plan %s, expected %s" % (got_plan, plan))
                    out = gqa_module.causal_gqa_attention(q, k, v)
                    torch.cuda.synchronize()
                    out_host = out.cpu()
                    del q, k, v, out
                    exact = reference.causal_gqa_reference(host["q"], host["k"], host["v"])
                    ok, detail = check_output(out_host, exact, dtype, allow_tf32, nonfinite)
        except Exception as exc:   # report and go on: the sanitizer still checks the other cases
            ok, detail = False, "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved_tf32
            os.environ.pop("GQA_FUSED_BACKWARD_MIN_T", None)
        failed += not ok
        if ok:
            covered.add(plan)
        print("CASE %d/%d %s %s seed=%d: %s %s (%.0f ms)" % (
            index + 1, len(selected), plan, case_label(case, nonfinite), case_seed, "ok" if ok else "FAIL",
            detail, 1e3 * (time.perf_counter() - t0)), flush=True)
    ran = len(selected[start:])
    print("CASES %d run, %d ok, %d failed; plans covered %d/%d; %.1f s" % (
        ran, ran - failed, failed, len(covered), len(every_plan()),
        time.perf_counter() - started), flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------
# The driver
def find_sanitizer(explicit=None):
    """The compute-sanitizer executable: --sanitizer, PATH, the CUDA toolkit, the pip package."""
    if explicit:
        return explicit
    candidates = [shutil.which("compute-sanitizer")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates += [os.path.join(home, "bin", "compute-sanitizer"),
                           os.path.join(home, "compute-sanitizer", "compute-sanitizer")]
    try:
        import nvidia   # the nvidia-cuda-sanitizer-api wheel puts it under nvidia/cu13/bin
        for root in getattr(nvidia, "__path__", []):
            candidates += [os.path.join(root, sub, "bin", "compute-sanitizer") for sub in ("cu13", "cu12")]
            candidates.append(os.path.join(root, "cuda_sanitizer_api", "compute-sanitizer", "compute-sanitizer"))
    except ImportError:
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


# Only the library's kernels are checked (substring of the mangled name): gqa_* and the x3 scan
# and split kernels. --run-cases launches no other kernels, so this only keeps the tools' work
# and reports to our code. initcheck runs unfiltered: it records the writes of the kernels it
# instruments, so a filter could turn memory written by an unchecked kernel into false reports.
KERNEL_FILTER = ["--kernel-name", "kns=gqa_", "--kernel-name", "kns=x3_"]
TOOL_FLAGS = {
    # --padding: a guard band after every allocation, so an overrun is an error even where the
    # next allocation would have been.
    "memcheck": ["--padding", "64"] + KERNEL_FILTER,
    "racecheck": KERNEL_FILTER,
    # --check-api-memory-access (on by default) also flags copying out unwritten output elements.
    "initcheck": [],
    "synccheck": KERNEL_FILTER,
}
# The environment of every sanitized run. Without torch's caching allocator every tensor is its
# own cudaMalloc, so memcheck sees the tensor's true bounds and initcheck sees fresh, unwritten
# memory rather than a block that an earlier case wrote.
SANITIZER_ENV = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}


def sanitizer_command(sanitizer, tool, seed, only=None, start=0):
    # --destroy-on-device-error kernel: a precise error ends that kernel only, so the cases after
    # it still run and are checked. --check-exit-code no: a failed case is read from its CASE line,
    # not counted among the sanitizer's errors.
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", "--target-processes", "application-only",
           "--launch-timeout", "120", "--ignore-getprocaddress-notfound", "--check-exit-code", "no",
           "--destroy-on-device-error", "kernel", "--print-limit", "1000"] + TOOL_FLAGS[tool]
    return cmd + cases_command(seed, only, start)


def cases_command(seed, only=None, start=0):
    return [sys.executable, str(Path(__file__).resolve()), "--run-cases", "--seed", str(seed)] + (
        ["--only", only] if only else []) + (["--start", str(start)] if start else [])


_CASE_RE = re.compile(r"^CASE (\d+)/(\d+) (\S+) .*? seed=\d+: (ok|FAIL)\b(.*)$", re.M)


def parse_output(text):
    """What a run's combined output says: the sanitizer's error count (None if it printed no
    summary), racecheck's warning count, and the CASE lines."""
    errors = warnings = None
    # (memcheck adds "ERROR SUMMARY: N errors were not printed ..." past --print-limit)
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors?\s*$", text, re.M)
    if summary:
        errors = int(summary[-1])
    race = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    if race:
        errors = max(errors or 0, int(race[-1][1]))
        warnings = int(race[-1][2])
    cases = [(int(n), int(total), plan, status, detail.strip())
             for n, total, plan, status, detail in _CASE_RE.findall(text)]
    device = re.search(r"^DEVICE (.*)$", text, re.M)
    finished = re.search(r"^CASES (\d+) run, (\d+) ok, (\d+) failed", text, re.M)
    return {
        "errors": errors,
        "warnings": warnings,
        "cases": cases,
        "cases_run": len(cases),
        "cases_expected": cases[0][1] if cases else None,
        "cases_failed": [c[2] + " #%d" % c[0] for c in cases if c[3] != "ok"],
        "plans_covered": sorted({c[2] for c in cases if c[3] == "ok"}),
        "finished": bool(finished),
        "device_line": device.group(1).strip() if device else None,
        "dead_after": _dead_after(cases),
    }


def _dead_after(cases):
    """The number of the case after which every case failed on a CUDA error (the context was
    lost, so nothing after it was checked), or None."""
    dead = None
    for number, _, _, status, detail in reversed(cases):
        if status == "ok" or "CUDA error" not in detail:
            break
        dead = number
    return dead if dead is not None and dead < cases[-1][1] else None


def _run_logged(cmd, env, timeout, log_path):
    """Run cmd in its own process group with output to log_path; kill the group on timeout, and
    when the driver itself stops before the group ends (an exception, or SIGTERM from `timeout`
    through stop_on_sigterm): a tool left running would hold the GPU and the extension's build
    directory, and the next driver's plain run of the cases would wait on it."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO_ROOT),
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:   # timed out, or the driver is stopping
                os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    with open(log_path, errors="replace") as log:
        text = log.read()
    return rc, timed_out, time.perf_counter() - t0, text


def _sanitizer_version(sanitizer):
    try:
        out = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"Version (\S+)", out)
    return match.group(1) if match else out.strip()[-80:] or None


def error_digest(text, limit=40):
    """The sanitizer's report lines, host frames left out, with addresses, offsets and thread and
    block indices masked, each distinct line once with its count: which kernels, which kinds."""
    counts = {}
    for line in text.splitlines():
        if not line.startswith("=========") or "Host Frame" in line or "COMPUTE-SANITIZER" in line:
            continue
        body = line.lstrip("= ").rstrip()
        if not body or body.startswith("Saved host backtrace"):
            continue
        body = re.sub(r"0x[0-9a-fA-F]+", "0x#", body)
        body = re.sub(r"\((\d+),(\d+),(\d+)\)", "(#)", body)
        body = re.sub(r"\b\d+ bytes (after|before|inside)", r"# bytes \1", body)
        counts[body] = counts.get(body, 0) + 1
    return ["%dx %s" % (n, body) for body, n in list(counts.items())[:limit]]


def drive(args):
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown:
        print("unknown tool(s) %s; choose from %s" % (unknown, ",".join(TOOLS)), file=sys.stderr)
        return 2
    previous = _load_previous(args.out) if args.resume else None
    seed = args.seed if args.seed is not None else (
        previous["seed"] if previous else int.from_bytes(os.urandom(3), "little"))
    sanitizer = find_sanitizer(args.sanitizer)
    env = dict(os.environ, **SANITIZER_ENV)
    if args.dry_run:
        print(" ".join(cases_command(seed, args.only)))
        for tool in tools:
            print("%s %s" % (" ".join("%s=%s" % kv for kv in SANITIZER_ENV.items()),
                             " ".join(sanitizer_command(sanitizer or "compute-sanitizer", tool, seed, args.only))))
        return 0
    if sanitizer is None:
        print("compute-sanitizer not found (looked on PATH, in CUDA_HOME, /usr/local/cuda and the "
              "nvidia-cuda-sanitizer-api package); pass --sanitizer PATH", file=sys.stderr)
        return 2

    sys.path.insert(0, str(REPO_ROOT))
    import torch
    import gqa_module

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "source_sha256": gqa_module.kernel_source_sha256(),
        "device": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "sanitizer": _sanitizer_version(sanitizer),
        "date": datetime.date.today().isoformat(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seed": seed,
        "only": args.only,
        "cases": len(runs()) if not args.only else None,
        "plans": every_plan(),
        "environment": SANITIZER_ENV,
        "plain": None,
        "tools": {},
    }

    kept = kept_tools(previous, result) if previous else {}
    if previous and not kept:
        print("--resume: %s holds no passed tool of a run on these kernels, seed %d and cases; "
              "starting afresh" % (args.out, seed), flush=True)
    if kept:
        result["started"] = previous["started"]
        result["runs_started"] = previous.get("runs_started", [previous["started"]]) + [
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")]
        result["tools"].update(kept)
        print("--resume: keeping %s from %s" % (", ".join(kept), args.out), flush=True)

    # 1. Build (or load from torch's cache) and run every case once without the sanitizer.
    print("building the extension and running the cases without the sanitizer ...", flush=True)
    cmd = cases_command(seed, args.only)
    rc, timed_out, seconds, text = _run_logged(cmd, env, args.build_timeout, log_dir / "plain.log")
    parsed = parse_output(text)
    result["device"] = parsed["device_line"].split(" | ")[0] if parsed["device_line"] else None
    result["device_details"] = parsed["device_line"]
    result["plain"] = {"command": cmd, "exit_code": rc, "timed_out": timed_out, "seconds": round(seconds, 1),
                       "cases_run": parsed["cases_run"], "cases_failed": parsed["cases_failed"],
                       "plans_covered": parsed["plans_covered"]}
    if rc != 0:
        result["plain"]["output_tail"] = text[-args.tail_chars:]
    print("  plain: exit %d, %d cases, %d failed, %.1f s" % (rc, parsed["cases_run"], len(parsed["cases_failed"]),
                                                             seconds), flush=True)
    if parsed["cases_run"] == 0:
        print(text[-4000:], file=sys.stderr)
        print("the cases did not run outside the sanitizer (build or device problem); stopping", file=sys.stderr)
        _write(result, args.out)
        return 1

    # 2. Each tool on the same cases, same seed.
    for tool in [t for t in tools if t not in kept]:
        print("%s ..." % tool, flush=True)
        entry = run_tool(sanitizer, tool, seed, args, env, log_dir)
        result["tools"][tool] = entry
        print("  %s: %s errors, exit %d, %d cases, %.1f s%s%s" % (
            tool, entry["errors"], entry["exit_code"], entry["cases_run"], entry["seconds"],
            " (timed out)" if entry["timed_out"] else "",
            " (%d runs: resumed after lost contexts)" % len(entry["runs"]) if len(entry["runs"]) > 1 else ""),
            flush=True)
        _write(result, args.out)

    result["seconds_total"] = round(sum(t["seconds"] for t in result["tools"].values()) + result["plain"]["seconds"], 1)
    _write(result, args.out)
    print_table(result)
    return 0 if all(t["ok"] for t in result["tools"].values()) else 1


MAX_RESUMES = 5


def run_tool(sanitizer, tool, seed, args, env, log_dir):
    """One tool over every case. When an error loses the CUDA context (every later case then
    fails on a CUDA error and nothing after it is checked), the tool runs again from the next
    case, at most MAX_RESUMES times; the JSON entry adds the runs up."""
    runs_done, start, texts = [], 0, []
    while True:
        cmd = sanitizer_command(sanitizer, tool, seed, args.only, start)
        log = log_dir / ("%s.log" % tool if not runs_done else "%s.from%d.log" % (tool, start + 1))
        rc, timed_out, seconds, text = _run_logged(cmd, env, args.timeout, log)
        parsed = parse_output(text)
        texts.append(text)
        runs_done.append({"command": cmd, "first_case": start + 1, "errors": parsed["errors"],
                          "warnings": parsed["warnings"], "exit_code": rc, "timed_out": timed_out,
                          "seconds": round(seconds, 1), "parsed": parsed, "log": str(log)})
        if timed_out or parsed["dead_after"] is None or len(runs_done) > MAX_RESUMES:
            break
        start = parsed["dead_after"]
    # A resumed run's cases after the lost context are those of the next run, not its own.
    cases = []
    for i, r in enumerate(runs_done):
        last_own = r["parsed"]["dead_after"] if i + 1 < len(runs_done) else None
        cases += [c for c in r["parsed"]["cases"] if last_own is None or c[0] <= last_own]
    errors = [r["errors"] for r in runs_done]
    warnings = [r["warnings"] for r in runs_done if r["warnings"] is not None]
    entry = {
        "command": runs_done[0]["command"],
        "errors": None if None in errors else sum(errors),
        "exit_code": max(r["exit_code"] for r in runs_done),
        "timed_out": any(r["timed_out"] for r in runs_done),
        "seconds": round(sum(r["seconds"] for r in runs_done), 1),
        "cases_run": len(cases),
        "cases_failed": ["%s #%d" % (c[2], c[0]) for c in cases if c[3] != "ok"],
        "finished": runs_done[-1]["parsed"]["finished"],
        "plans_covered": sorted({c[2] for c in cases if c[3] == "ok"}),
        "runs": [{k: v for k, v in r.items() if k not in ("parsed", "command")} for r in runs_done],
    }
    failed = entry["cases_failed"]
    if warnings:
        entry["warnings"] = sum(warnings)
    entry["ok"] = (entry["errors"] == 0 and entry["exit_code"] == 0 and not entry["timed_out"]
                   and entry["finished"] and not failed and not entry.get("warnings"))
    if not entry["ok"]:
        text = "\n".join(texts)
        entry["error_digest"] = error_digest(text)
        entry["output_tail"] = texts[-1][-args.tail_chars:]
    return entry


def _load_previous(path):
    """The JSON of an earlier driver run at path, or None when there is none."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def kept_tools(previous, result):
    """The tool entries of a previous run that --resume keeps: those that passed, when that run
    had the same kernel sources, seed, case selection and sanitizer, torch and CUDA versions."""
    keys = ("source_sha256", "seed", "only", "cases", "sanitizer", "torch", "cuda")
    same = all(previous.get(k) == result[k] for k in keys)
    if not same:
        return {}
    return {tool: entry for tool, entry in previous.get("tools", {}).items() if entry.get("ok")}


def _write(result, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


def print_table(result):
    n_plans = len(result["plans"])
    print()
    print("compute-sanitizer %s on %s, seed %d, kernels %s" % (result["sanitizer"], result["device"], result["seed"],
                                                                 result["source_sha256"][:12]))
    print("%-10s %7s %5s %8s %9s %7s  %s" % ("tool", "errors", "exit", "seconds", "cases", "plans", "result"))
    rows = [("(plain)", result["plain"])] + list(result["tools"].items())
    for name, t in rows:
        failed = len(t["cases_failed"])
        errors = "-" if name == "(plain)" else ("?" if t["errors"] is None else str(t["errors"]))
        ok = t.get("ok", t["exit_code"] == 0 and not failed)
        print("%-10s %7s %5d %8.1f %9s %7s  %s" % (
            name, errors, t["exit_code"], t["seconds"], "%d/%d" % (t["cases_run"] - failed, t["cases_run"]),
            "%d/%d" % (len(t["plans_covered"]), n_plans),
            "ok" if ok else "FAILED" + (" (timed out)" if t["timed_out"] else "")))


# ------------------------------------------------------------------------------------------------
def list_cases():
    """Print the case list with plan_for's plan for each on an H200; returns 1 on a mismatch."""
    sys.path.insert(0, str(REPO_ROOT))
    import gqa_module

    bad = 0
    for case in CASES:
        got = planned_for(case)
        bad += got != case[0]
        print("%-26s %-36s %s" % (case[0], case_label(case, False), "" if got == case[0] else "plan_for: " + got))
    missing = set(gqa_module.all_plans()) - {c[0] for c in CASES}
    print("%d cases and %d backward cases (%d runs with the non-finite ones); forward plans covered %d/%d%s" % (
        len(CASES), len(BACKWARD_CASES), len(runs()), len(gqa_module.all_plans()) - len(missing), len(gqa_module.all_plans()),
        "; missing: " + ", ".join(sorted(missing)) if missing else ""))
    return 1 if bad or missing else 0


def stop_on_sigterm():
    """SIGTERM ends the driver by SystemExit, so that _run_logged's cleanup runs (Python's default
    for SIGTERM ends the process at once, leaving the tool's process group running)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-cases", action="store_true", help="run every case once (the sanitized program)")
    p.add_argument("--list", action="store_true", help="print the cases and check their plans with plan_for (no GPU)")
    p.add_argument("--dry-run", action="store_true", help="print the driver's commands and exit")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the driver's JSON (default: %(default)s)")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of %(default)s")
    p.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    p.add_argument("--resume", action="store_true",
                   help="keep the passed tools of --out's run on the same kernels, seed and cases; run the rest")
    p.add_argument("--only", default=None, help="run only the cases whose plan matches this regex")
    p.add_argument("--start", type=int, default=0, help="--run-cases: skip the first START cases")
    p.add_argument("--sanitizer", default=None, help="path of compute-sanitizer (default: searched)")
    p.add_argument("--timeout", type=float, default=180, help="seconds per tool (default: %(default)s)")
    p.add_argument("--build-timeout", type=float, default=900,
                   help="seconds for the first, unsanitized run that builds the extension (default: %(default)s)")
    p.add_argument("--log-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gqa-sanitizer-logs"),
                   help="where each run's full output goes (default: %(default)s)")
    p.add_argument("--tail-chars", type=int, default=6000, help="output kept in the JSON on failure")
    args = p.parse_args(argv)
    if args.run_cases:
        seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(3), "little")
        return run_cases(seed, args.only, args.start)
    if args.list:
        return list_cases()
    stop_on_sigterm()
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
