#!/usr/bin/env python3
"""Benchmark the project's causal grouped-query attention against PyTorch peers.

Usage (from anywhere; the repository root is found from this file's location):

    python bench/bench_gqa.py                 # full run (~6 min on an H200)
    python bench/bench_gqa.py --quick         # harness shape + one large shape
    python bench/bench_gqa.py --only project,sdpa_flash --no-compile-time

Writes <out>/<gpu>.json, <out>/<gpu>.md and <out>/<gpu>.png, where <gpu> is the
device name lowercased with every non-alphanumeric character replaced by '-'.

Importing this module is cheap and does no GPU work: torch is imported lazily,
so `validate_results_schema` can be used on a machine without CUDA.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results"

IMPL_NAMES = (
    "project",
    "reference_loops",
    "eager_expand",
    "compiled_expand",
    "sdpa_gqa",
    "sdpa_expand_efficient",
    "sdpa_flash",
    "sdpa_cudnn",
    "flex",
    "empty_call",
    "read_floor",
)
# The floors, not attention and not checked: empty_call allocates o and launches an empty kernel;
# read_floor reads q, k and v once and writes o (no arithmetic), the memory floor of any implementation.
FLOORS = ("read_floor", "empty_call")
# Implementations that are not peers when picking the best competitor.
NON_PEERS = ("project",) + FLOORS + ("reference_loops",)
# Implementations run at the harness shape only.
HARNESS_ONLY = ("reference_loops", "read_floor")
MODES = ("harness", "back_to_back", "graph")
DTYPE_NAMES = ("float32", "bfloat16", "float16")

HARNESS_SHAPE = (2, 80, 8, 2, 32)
SCALE_CONFIGS = (
    ((4, 1024, 32, 8, 128), ("float32", "bfloat16", "float16")),
    ((1, 8192, 32, 8, 128), ("float32", "bfloat16", "float16")),
    ((16, 2048, 32, 8, 64), ("float32", "bfloat16", "float16")),
    ((1, 32768, 32, 8, 128), ("bfloat16", "float32")),
)
QUICK_CONFIGS = (((4, 1024, 32, 8, 128), ("float32", "bfloat16")),)
SWEEP_TS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_TOKENS = 32768  # B * T for every sweep point
SWEEP_HEADS = (32, 8, 128)  # Hq, Hkv, D
SWEEP_DTYPES = ("float32", "bfloat16")

TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
FULL_REFERENCE_LIMIT = 4 * 2**30  # bytes of float64 T x T scores
SLICE_ROWS = 128  # first and last query rows used when the reference is sliced
MEMORY_FRACTION = 0.6  # an impl may use at most this share of free memory
FLUSH_BYTES = 256 * 2**20

HARNESS_WARMUP, HARNESS_TRIALS = 3, 100
LOOPS_WARMUP, LOOPS_TRIALS = 1, 5  # reference_loops takes ~100 ms a call
GRAPH_CALLS, GRAPH_REPLAYS = 20, 10
LOOPS_GRAPH_CALLS, LOOPS_GRAPH_REPLAYS = 2, 3

_TOP_KEYS = ("gpu", "torch", "cuda", "date", "source_sha256", "compile", "rows")
_COMPILE_KEYS = ("cold_s", "warm_s")
_ROW_KEYS = ("shape", "dtype", "impl", "mode", "ms", "tflops", "rel_err", "error", "plan")


# --------------------------------------------------------------------------
# Schema check (pure Python, importable without torch)
# --------------------------------------------------------------------------
def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_keys(obj: dict, expected, where: str, problems: list) -> None:
    missing = [k for k in expected if k not in obj]
    extra = sorted(str(k) for k in obj if k not in expected)
    if missing:
        problems.append(f"{where}: missing keys {missing}")
    if extra:
        problems.append(f"{where}: unexpected keys {extra}")


def validate_results_schema(obj) -> list[str]:
    """Return a list of problems with a results object; empty when it is valid."""
    problems: list[str] = []
    if not isinstance(obj, dict):
        return [f"top level: expected an object, got {type(obj).__name__}"]
    _check_keys(obj, _TOP_KEYS, "top level", problems)

    for key in ("gpu", "torch", "cuda"):
        if key in obj and not isinstance(obj[key], str):
            problems.append(f"{key}: expected a string, got {type(obj[key]).__name__}")

    if "date" in obj:
        date = obj["date"]
        if not isinstance(date, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            problems.append(f"date: expected 'YYYY-MM-DD', got {date!r}")
        else:
            try:
                datetime.date.fromisoformat(date)
            except ValueError:
                problems.append(f"date: not a calendar date: {date!r}")

    if "source_sha256" in obj:
        sha = obj["source_sha256"]
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            problems.append("source_sha256: expected 64 lowercase hex characters")

    if "compile" in obj:
        comp = obj["compile"]
        if not isinstance(comp, dict):
            problems.append("compile: expected an object")
        else:
            _check_keys(comp, _COMPILE_KEYS, "compile", problems)
            for key in _COMPILE_KEYS:
                if key in comp and not (_is_number(comp[key]) and comp[key] >= 0):
                    problems.append(f"compile.{key}: expected a non-negative number, got {comp[key]!r}")

    rows = obj.get("rows")
    if "rows" in obj and not isinstance(rows, list):
        problems.append("rows: expected a list")
    elif isinstance(rows, list):
        for i, row in enumerate(rows):
            where = f"rows[{i}]"
            if not isinstance(row, dict):
                problems.append(f"{where}: expected an object")
                continue
            _check_keys(row, _ROW_KEYS, where, problems)
            shape = row.get("shape")
            if "shape" in row and not (
                isinstance(shape, (list, tuple))
                and len(shape) == 5
                and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)
            ):
                problems.append(f"{where}.shape: expected 5 positive integers, got {shape!r}")
            if "dtype" in row and row["dtype"] not in DTYPE_NAMES:
                problems.append(f"{where}.dtype: {row['dtype']!r} not in {list(DTYPE_NAMES)}")
            if "impl" in row and row["impl"] not in IMPL_NAMES:
                problems.append(f"{where}.impl: {row['impl']!r} not in {list(IMPL_NAMES)}")
            if "mode" in row and row["mode"] not in MODES:
                problems.append(f"{where}.mode: {row['mode']!r} not in {list(MODES)}")
            for key in ("ms", "tflops", "rel_err"):
                if key in row and row[key] is not None and not (_is_number(row[key]) and row[key] >= 0):
                    problems.append(f"{where}.{key}: expected null or a non-negative number, got {row[key]!r}")
            for key in ("error", "plan"):
                if key in row and row[key] is not None and not isinstance(row[key], str):
                    problems.append(f"{where}.{key}: expected null or a string")
    return problems


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "-", name.lower())


def flops_of(shape) -> float:
    B, T, Hq, _, D = shape
    return 4.0 * B * Hq * T * T * D / 2.0


def format_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _log(ctx, msg: str) -> None:
    print(f"[{time.perf_counter() - ctx.t0:7.1f}s] {msg}", flush=True)


def _warning_hints(caught) -> str:
    """The reasons SDPA gives (as warnings) for refusing a backend, compacted."""
    hints = []
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally at[^)]*\)\.?", "", " ".join(str(w.message).split())).strip()
        if not text or text.endswith("because:") or text in hints:
            continue
        if any(s in text for s in ("support", "require", "Expected", "expected", "must", "only")):
            hints.append(text[:110])
    return (" [" + " | ".join(hints[:2]) + "]") if hints else ""


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def own_kernel_sha256(root: Path = REPO_ROOT) -> str:
    """sha256 of every file under kernels/, concatenated in sorted path order."""
    h = hashlib.sha256()
    kdir = root / "kernels"
    if kdir.is_dir():
        files = sorted((p for p in kdir.rglob("*") if p.is_file()), key=lambda p: p.relative_to(kdir).as_posix())
        for p in files:
            h.update(p.read_bytes())
    return h.hexdigest()


# --------------------------------------------------------------------------
# Peer implementations
# --------------------------------------------------------------------------
def _make_eager_expand():
    import torch

    def eager_expand(q, k, v):
        T, Hq, D = q.shape[1], q.shape[2], q.shape[3]
        group = Hq // k.shape[2]
        k_full = k.repeat_interleave(group, dim=2)
        v_full = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k_full) * (1.0 / math.sqrt(D))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v_full)

    return eager_expand


def sliced_reference(q, k, v, rows):
    """float64 causal GQA output for the given query rows only: [B, len(rows), Hq, D]."""
    import torch

    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    idx = torch.as_tensor(list(rows), device=q.device, dtype=torch.long)
    n_keys = int(max(rows)) + 1
    future = torch.arange(n_keys, device=q.device)[None, :] > idx[:, None]  # [R, K]
    out = torch.empty(B, len(rows), Hq, D, dtype=torch.float64, device=q.device)
    scale = 1.0 / math.sqrt(D)
    for j in range(Hkv):
        heads = slice(j * group, (j + 1) * group)
        qj = q[:, idx, heads, :].to(torch.float64).permute(0, 2, 1, 3)  # [B, g, R, D]
        kj = k[:, :n_keys, j, :].to(torch.float64)  # [B, K, D]
        vj = v[:, :n_keys, j, :].to(torch.float64)
        scores = torch.matmul(qj, kj.transpose(1, 2).unsqueeze(1)) * scale  # [B, g, R, K]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, heads, :] = torch.matmul(probs, vj.unsqueeze(1)).permute(0, 2, 1, 3)
    return out


def materialises_scores(name: str, dtype_name: str) -> bool:
    if name in ("eager_expand", "compiled_expand"):
        return True
    # With enable_gqa, fp32 SDPA has no fused kernel and falls back to the math backend.
    return name == "sdpa_gqa" and dtype_name == "float32"


def estimate_bytes(name: str, shape, dtype_name: str) -> int:
    """Rough extra device memory an implementation needs beyond its inputs."""
    B, T, Hq, Hkv, D = shape
    esize = 4 if dtype_name == "float32" else 2
    act = B * T * Hq * D * esize  # one [B, T, Hq, D] tensor
    scores = B * Hq * T * T * esize
    if name == "eager_expand":
        return 3 * scores + T * T + 3 * act
    if name == "compiled_expand":
        return 2 * scores + 3 * act
    if name == "sdpa_gqa" and dtype_name == "float32":
        return 3 * scores + T * T + 3 * act
    if name == "reference_loops":
        return 2 * scores + 3 * act
    if name == "sdpa_expand_efficient":
        return 3 * act + B * Hq * T * 4
    if name == "flex":
        return 2 * act + 2 * T * T
    return 2 * act + B * Hq * T * 4


class Bench:
    """Holds state shared by all measurements of one run."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.row_index: dict = {}
        self.means: dict = {}  # harness-mode means, md only
        self.ref_notes: dict = {}
        self.notes: list[str] = []
        self.current_inputs = None
        self.flush = None
        self.gqa_module = None
        self.reference = None
        self.import_errors: dict = {}
        self.project_model = None
        self.loops_model = None
        self.eager_expand = _make_eager_expand()
        self.compiled_expand = None
        self.flex_compiled = None
        self.do_bench = None
        self.do_bench_note = "triton.testing.do_bench"

    # -- imports -----------------------------------------------------------
    def import_project(self):
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        try:
            import gqa_module

            self.gqa_module = gqa_module
        except Exception as e:  # recorded on the project's rows
            self.import_errors["gqa_module"] = format_error(e)
        try:
            import reference

            self.reference = reference
        except Exception as e:
            self.import_errors["reference"] = format_error(e)
        try:
            from triton.testing import do_bench

            self.do_bench = do_bench
        except Exception:
            self.do_bench = self._fallback_do_bench
            self.do_bench_note = "in-file copy of do_bench's method (triton not importable)"

    def _fallback_do_bench(self, fn, warmup=25, rep=100, return_mode="median"):
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            self.flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-4)
        for _ in range(max(1, int(warmup / est))):
            fn()
        n = max(1, int(rep / est))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    # -- implementations -----------------------------------------------------
    def build(self, name: str, shape, dtype_name: str):
        """Return (fn, context factory); fn(q, k, v) -> [B, T, Hq, D]."""
        torch = self.torch
        F = torch.nn.functional
        null = contextlib.nullcontext
        if name == "project" or name in FLOORS:
            if self.gqa_module is None:
                raise RuntimeError(f"gqa_module not importable ({self.import_errors.get('gqa_module')})")
            if name != "project":
                return getattr(self.gqa_module, name), null
            if self.project_model is None:
                self.project_model = self.gqa_module.ModelNew().to("cuda").eval()
            return self.project_model, null
        if name == "reference_loops":
            if self.reference is None:
                raise RuntimeError(f"reference not importable ({self.import_errors.get('reference')})")
            if self.loops_model is None:
                self.loops_model = self.reference.Model().to("cuda").eval()
            return self.loops_model, null
        if name == "eager_expand":
            return self.eager_expand, null
        if name == "compiled_expand":
            if self.compiled_expand is None:
                self.compiled_expand = torch.compile(self.eager_expand, dynamic=False)
            return self.compiled_expand, null

        from torch.nn.attention import SDPBackend, sdpa_kernel

        if name == "sdpa_gqa":
            def sdpa_gqa(q, k, v):
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                )
                return o.transpose(1, 2)

            return sdpa_gqa, null
        if name == "sdpa_expand_efficient":
            def sdpa_expand_efficient(q, k, v):
                group = q.shape[2] // k.shape[2]
                k_full = k.repeat_interleave(group, dim=2)
                v_full = v.repeat_interleave(group, dim=2)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k_full.transpose(1, 2), v_full.transpose(1, 2), is_causal=True
                )
                return o.transpose(1, 2)

            return sdpa_expand_efficient, lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
        if name in ("sdpa_flash", "sdpa_cudnn"):
            backend = SDPBackend.FLASH_ATTENTION if name == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION

            def sdpa_backend(q, k, v):
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
                )
                return o.transpose(1, 2)

            return sdpa_backend, lambda: sdpa_kernel(backend)
        if name == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            if self.flex_compiled is None:
                self.flex_compiled = torch.compile(flex_attention, dynamic=False)
            flex_c = self.flex_compiled
            T = shape[1]

            def causal(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            block_mask = create_block_mask(causal, None, None, T, T, device="cuda")

            def make_flex(options):
                def flex(q, k, v):
                    o = flex_c(
                        q.transpose(1, 2),
                        k.transpose(1, 2),
                        v.transpose(1, 2),
                        block_mask=block_mask,
                        enable_gqa=True,
                        kernel_options=options,
                    )
                    return o.transpose(1, 2)

                return flex

            # Default kernel selection first. For short sequences flex picks its decoding
            # kernel, which can have no valid config (seen at T=80); then ask for the
            # regular flex kernel, spelled as newer and older torch versions accept it.
            first_error = None
            for options in (None, {"BACKEND": "TRITON"}, {"FORCE_USE_FLEX_ATTENTION": True}):
                candidate = make_flex(options)
                try:
                    candidate(*self.current_inputs)
                    torch.cuda.synchronize()
                except Exception as e:
                    first_error = first_error or e
                    continue
                if options is not None:
                    self.notes.append(
                        f"flex at {_shape_str(shape)} {dtype_name}: default kernel selection failed "
                        f"({format_error(first_error)[:120]}); used kernel_options={options}"
                    )
                return candidate, null
            raise first_error
        raise ValueError(f"unknown implementation {name!r}")

    # -- memory ----------------------------------------------------------------
    def cleanup(self):
        gc.collect()
        with contextlib.suppress(Exception):
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def memory_guard(self, name: str, shape, dtype_name: str):
        free, _ = self.torch.cuda.mem_get_info()
        need = estimate_bytes(name, shape, dtype_name)
        if need <= MEMORY_FRACTION * free:
            return None
        budget = _gib(MEMORY_FRACTION * free)
        if materialises_scores(name, dtype_name):
            B, T, Hq, _, _ = shape
            esize = 4 if dtype_name == "float32" else 2
            scores = _gib(B * Hq * T * T * esize)
            return (
                f"skipped: materialises T×T scores ({scores:.1f} GiB); "
                f"~{_gib(need):.0f} GiB needed > 60% of free memory ({budget:.0f} GiB)"
            )
        return f"skipped: needs ~{_gib(need):.1f} GiB > 60% of free memory ({budget:.0f} GiB)"

    # -- timing ----------------------------------------------------------------
    def time_harness(self, fn, args, name):
        torch = self.torch
        warm, trials = (LOOPS_WARMUP, LOOPS_TRIALS) if name == "reference_loops" else (HARNESS_WARMUP, HARNESS_TRIALS)
        for _ in range(warm):
            fn(*args)
        torch.cuda.synchronize()
        times = []
        for _ in range(trials):
            torch.cuda.synchronize()
            self.flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), statistics.fmean(times)

    def time_back_to_back(self, fn, args):
        return float(self.do_bench(lambda: fn(*args), return_mode="median"))

    def time_graph(self, fn, args, name):
        torch = self.torch
        calls, replays = (LOOPS_GRAPH_CALLS, LOOPS_GRAPH_REPLAYS) if name == "reference_loops" else (GRAPH_CALLS, GRAPH_REPLAYS)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    last = fn(*args)
            graph.replay()
            torch.cuda.synchronize()
            per_call = []
            for _ in range(replays):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                per_call.append(start.elapsed_time(end) / calls)
            del last
            return statistics.median(per_call)
        finally:
            del graph

    # -- rows ------------------------------------------------------------------
    def plan_of(self, impl):
        """The project's kernel plan for the inputs in hand ("x3/fp32/d128"), else None."""
        if impl != "project" or self.gqa_module is None or self.current_inputs is None:
            return None
        try:
            return self.gqa_module.plan(*self.current_inputs)
        except Exception as e:
            return f"unknown ({format_error(e)[:80]})"

    def add_row(self, shape, dtype_name, impl, mode, ms=None, rel_err=None, error=None, mean=None):
        tflops = None
        if ms is not None and ms > 0:
            tflops = round(flops_of(shape) / (ms * 1e9), 4)
            ms = round(float(ms), 6)
        row = {
            "shape": [int(s) for s in shape],
            "dtype": dtype_name,
            "impl": impl,
            "mode": mode,
            "ms": ms,
            "tflops": tflops,
            "rel_err": float(rel_err) if rel_err is not None and math.isfinite(rel_err) else None,
            "error": error,
            "plan": self.plan_of(impl),
        }
        key = (tuple(shape), dtype_name, impl, mode)
        if key in self.row_index:
            self.rows[self.row_index[key]] = row
        else:
            self.row_index[key] = len(self.rows)
            self.rows.append(row)
        if mean is not None:
            self.means[key] = mean
        shape_s = "x".join(str(s) for s in shape)
        if error:
            _log(self, f"{shape_s:>20} {dtype_name:8} {mode:12} {impl:22} error: {error[:110]}")
        else:
            extra = f" mean={mean:.4f}" if mean is not None else ""
            err_s = f" rel_err={rel_err:.2e}" if rel_err is not None else ""
            _log(self, f"{shape_s:>20} {dtype_name:8} {mode:12} {impl:22} ms={ms:.4f}{extra} tflops={tflops}{err_s}")

    # -- one shape / dtype ---------------------------------------------------------
    def reference_for(self, q, k, v, shape):
        """Return (reference tensor, query rows or None for all rows, note)."""
        torch = self.torch
        B, T, Hq, _, _ = shape
        if B * Hq * T * T * 8 <= FULL_REFERENCE_LIMIT:
            if self.reference is not None:
                try:
                    ref = self.reference.causal_gqa_reference(q, k, v)
                    return ref.to(torch.float64), None, "reference.causal_gqa_reference (all rows)"
                except Exception as e:
                    _log(self, f"reference.causal_gqa_reference failed ({format_error(e)}); using the in-file float64 reference")
            return sliced_reference(q, k, v, range(T)), None, "in-file float64 reference (all rows)"
        rows = sorted(set(range(min(SLICE_ROWS, T))) | set(range(max(0, T - SLICE_ROWS), T)))
        return sliced_reference(q, k, v, rows), rows, f"in-file float64 reference on query rows 0-{SLICE_ROWS - 1} and {T - SLICE_ROWS}-{T - 1}"

    def run_config(self, shape, dtype_name, modes, impls):
        torch = self.torch
        B, T, Hq, Hkv, D = shape
        dtype = getattr(torch, dtype_name)
        _log(self, f"== shape (B,T,Hq,Hkv,D)={shape} dtype={dtype_name} modes={','.join(modes)}")
        torch.manual_seed(0)
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        try:
            ref, ref_rows, note = self.reference_for(q, k, v, shape)
        except Exception as e:
            msg = f"reference failed: {format_error(e)}"
            for name in impls:
                for mode in modes:
                    self.add_row(shape, dtype_name, name, mode, error=msg)
            self.cleanup()
            return
        self.ref_notes[(tuple(shape), dtype_name)] = note
        self.current_inputs = (q, k, v)
        for name in impls:
            self.run_impl(name, shape, dtype_name, modes, (q, k, v), ref, ref_rows)
        self.current_inputs = None
        del q, k, v, ref
        self.cleanup()

    def run_impl(self, name, shape, dtype_name, modes, args, ref, ref_rows):
        torch = self.torch
        try:
            skip = self.memory_guard(name, shape, dtype_name)
        except Exception as e:
            skip = format_error(e)
        if skip:
            for mode in modes:
                self.add_row(shape, dtype_name, name, mode, error=skip)
            return
        fn = None
        try:
            fn, make_ctx = self.build(name, shape, dtype_name)
        except Exception as e:
            err = format_error(e)
            for mode in modes:
                self.add_row(shape, dtype_name, name, mode, error=err)
            self.cleanup()
            return
        try:
            with make_ctx():
                rel_err, err = self.check(fn, name, dtype_name, args, ref, ref_rows)
                for mode in modes:
                    if err is not None:
                        self.add_row(shape, dtype_name, name, mode, rel_err=rel_err, error=err)
                        continue
                    try:
                        if mode == "harness":
                            ms, mean = self.time_harness(fn, args, name)
                            self.add_row(shape, dtype_name, name, mode, ms, rel_err, mean=mean)
                        elif mode == "back_to_back":
                            self.add_row(shape, dtype_name, name, mode, self.time_back_to_back(fn, args), rel_err)
                        else:
                            self.add_row(shape, dtype_name, name, mode, self.time_graph(fn, args, name), rel_err)
                    except Exception as e:
                        self.add_row(shape, dtype_name, name, mode, rel_err=rel_err, error=format_error(e))
                        self.cleanup()
        except Exception as e:  # e.g. the backend context itself failed
            err = format_error(e)
            for mode in modes:
                if (tuple(shape), dtype_name, name, mode) not in self.row_index:
                    self.add_row(shape, dtype_name, name, mode, error=err)
        finally:
            del fn
            self.cleanup()

    def check(self, fn, name, dtype_name, args, ref, ref_rows):
        """Run once (also the first warm-up/compile); return (rel_err, error)."""
        torch = self.torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = fn(*args)
                torch.cuda.synchronize()
            except Exception as e:
                return None, format_error(e) + _warning_hints(caught)
        if name in FLOORS:  # their outputs are not attention
            del out
            return None, None
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(args[0].shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return None, f"wrong: output shape {got}, expected {tuple(args[0].shape)}"
        got = out if ref_rows is None else out[:, ref_rows]
        got = got.to(torch.float64)
        rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
        del out, got
        if not math.isfinite(rel) or rel > TOLERANCE[dtype_name]:
            return (rel if math.isfinite(rel) else None), f"wrong: rel_err={rel:.3e} (tolerance {TOLERANCE[dtype_name]:g})"
        return rel, None


# --------------------------------------------------------------------------
# Compile time
# --------------------------------------------------------------------------
# The child times its first call from a ready process: torch imported, CUDA context up, inputs on
# the device. That is what the extension costs a user; the interpreter and `import torch` (about
# 2 s, the same for every implementation) are reported beside it as PROCESS_SECONDS.
_CHILD_CODE = """\
import time
_t0 = time.perf_counter()
import sys
import torch
sys.path.insert(0, '.')
import gqa_module
B, T, Hq, Hkv, D = 2, 80, 8, 2, 32
q = torch.randn(B, T, Hq, D, device='cuda')
k = torch.randn(B, T, Hkv, D, device='cuda')
v = torch.randn(B, T, Hkv, D, device='cuda')
torch.cuda.synchronize()
_t1 = time.perf_counter()
out = gqa_module.causal_gqa_attention(q, k, v)
torch.cuda.synchronize()
_t2 = time.perf_counter()
print('CHILD_SECONDS=%.6f' % (_t2 - _t1), flush=True)
print('PROCESS_SECONDS=%.6f' % (_t2 - _t0), flush=True)
"""


def _run_child(ext_dir: str, log) -> dict:
    env = dict(os.environ)
    env["TORCH_EXTENSIONS_DIR"] = ext_dir
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD_CODE],
            cwd=str(REPO_ROOT),
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return {"seconds": None, "wall": time.perf_counter() - t, "error": "timed out after 1800 s"}
    wall = time.perf_counter() - t
    match = re.search(r"CHILD_SECONDS=([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or not match:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[:300]
        return {"seconds": None, "wall": wall, "error": f"exit {proc.returncode}: {tail}"}
    total = re.search(r"PROCESS_SECONDS=([0-9.]+)", proc.stdout)
    return {"seconds": float(match.group(1)), "wall": wall, "error": None,
            "process": float(total.group(1)) if total else None}


def measure_compile(log) -> dict:
    """Cold and warm first-call times in fresh processes sharing one new extensions dir."""
    ext_dir = tempfile.mkdtemp(prefix="gqa_ext_")
    atexit.register(shutil.rmtree, ext_dir, True)
    log(f"compile timing: cold child (TORCH_EXTENSIONS_DIR={ext_dir})")
    cold = _run_child(ext_dir, log)
    log(f"compile timing: cold {cold}")
    built = any(Path(ext_dir).iterdir())
    warm = _run_child(ext_dir, log)
    log(f"compile timing: warm {warm}")
    return {"cold": cold, "warm": warm, "dir": ext_dir, "built_in_dir": built}


# --------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------
def _fmt_ms(x):
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 100 else f"{x:.1f}"


def _fmt_tf(x):
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _fmt_rel(x):
    return "—" if x is None else f"{x:.2e}"


def _md_cell(s):
    return "" if s is None else str(s).replace("|", "\\|").replace("\n", " ")


def _groups(rows):
    groups: dict = {}
    for r in rows:
        groups.setdefault((tuple(r["shape"]), r["dtype"], r["mode"]), []).append(r)
    return groups


def best_peer(group_rows):
    peers = [r for r in group_rows if r["impl"] not in NON_PEERS and r["error"] is None and r["ms"] is not None]
    return min(peers, key=lambda r: r["ms"]) if peers else None


def _ratio_line(group_rows) -> str:
    proj = next((r for r in group_rows if r["impl"] == "project"), None)
    peer = best_peer(group_rows)
    if peer is None:
        return "best peer: none ran"
    head = f"best peer: `{peer['impl']}` {_fmt_ms(peer['ms'])} ms"
    if proj is None or proj["ms"] is None:
        return head + "; project: no timing"
    ratio = peer["ms"] / proj["ms"]
    verdict = "project faster" if ratio > 1 else "peer faster"
    return head + f"; project {_fmt_ms(proj['ms'])} ms; best-peer/project = **{ratio:.2f}×** ({verdict})"


def _shape_str(shape):
    return "(" + ", ".join(str(s) for s in shape) + ")"


def render_md(result: dict, means: dict, info: dict, brief: bool = False) -> str:
    rows = result["rows"]
    groups = _groups(rows)
    out = []
    out.append(f"# Causal GQA benchmark: {result['gpu']}")
    out.append("")
    out.append(
        f"torch {result['torch']}, CUDA {result['cuda']}, {result['date']}, "
        f"kernels sha256 `{result['source_sha256'][:16]}…`"
    )
    out.append("")
    out.append("## Compile time (project extension, first call)")
    out.append("")
    comp = result["compile"]
    out.append(f"- cold: **{comp['cold_s']:.2f} s**, warm: **{comp['warm_s']:.2f} s**")
    for line in info.get("compile_notes", []):
        out.append(f"- {line}")
    out.append("")

    # project against the two floors at the harness shape
    lines = []
    for mode in MODES:
        g = groups.get((HARNESS_SHAPE, "float32", mode))
        if not g:
            continue
        ms = {r["impl"]: r["ms"] for r in g if (r["impl"] == "project" or r["impl"] in FLOORS) and r["ms"]}
        if "project" not in ms:
            lines.append(f"- {mode}: n/a (the project has no timing)")
            continue
        parts = [f"project {_fmt_ms(ms['project'])} ms"]
        for floor in FLOORS:
            if floor in ms:
                parts.append(f"{floor} {_fmt_ms(ms[floor])} ms (project = **{ms['project'] / ms[floor]:.2f}×**)")
        lines.append(f"- {mode}: " + ", ".join(parts))
    if lines:
        out.append(f"## project against the floors at the harness shape {_shape_str(HARNESS_SHAPE)} float32")
        out.append("")
        out.append("read_floor reads q, k and v once and writes o; empty_call allocates o and launches an empty "
                   "kernel. harness mode times like KernelBench (256 MB L2 flush, events around one call).")
        out.append("")
        out.extend(lines)
        out.append("")

    # sweep summary
    sweep = info.get("sweep_shapes", {})
    if sweep:
        out.append(f"## Sweep: TFLOP/s (back_to_back), B·T={SWEEP_TOKENS}, Hq={SWEEP_HEADS[0]}, Hkv={SWEEP_HEADS[1]}, D={SWEEP_HEADS[2]}")
        out.append("")
        for dtype_name, shapes in sweep.items():
            present = [s for s in shapes if (tuple(s), dtype_name, "back_to_back") in groups]
            if not present:
                continue
            out.append(f"**{dtype_name}**")
            out.append("")
            out.append("| impl | " + " | ".join(f"T={s[1]}" for s in present) + " |")
            out.append("|---|" + "---:|" * len(present))
            impls_here = []
            for s in present:
                for r in groups[(tuple(s), dtype_name, "back_to_back")]:
                    if r["impl"] not in impls_here and r["impl"] not in FLOORS:
                        impls_here.append(r["impl"])
            for impl in impls_here:
                cells = []
                for s in present:
                    r = next((x for x in groups[(tuple(s), dtype_name, "back_to_back")] if x["impl"] == impl), None)
                    cells.append(_fmt_tf(r["tflops"]) if r and r["error"] is None else "—")
                out.append(f"| {impl} | " + " | ".join(cells) + " |")
            out.append("")

    out.append("## Results")
    out.append("")
    out.append(
        "Ratio = best peer ms / project ms (>1 means the project is faster); best peer = fastest "
        "error-free impl other than project, empty_call, read_floor and reference_loops."
    )
    out.append("")
    for (shape, dtype_name, mode), g in groups.items():
        is_harness_shape = tuple(shape) == HARNESS_SHAPE
        out.append(f"### {_shape_str(shape)} {dtype_name} {mode}")
        out.append("")
        out.append(_ratio_line(g))
        project_plan = next((r.get("plan") for r in g if r["impl"] == "project" and r.get("plan")), None)
        if project_plan:
            out.append(f"project plan: `{project_plan}`")
        out.append("")
        if brief and not is_harness_shape:
            continue
        harness = mode == "harness"
        if harness:
            out.append("| impl | ms (median) | ms (mean) | TFLOP/s | rel_err | error |")
            out.append("|---|---:|---:|---:|---:|---|")
        else:
            out.append("| impl | ms (median) | TFLOP/s | rel_err | error |")
            out.append("|---|---:|---:|---:|---|")
        for r in g:
            cells = [r["impl"], _fmt_ms(r["ms"])]
            if harness:
                cells.append(_fmt_ms(means.get((tuple(shape), dtype_name, r["impl"], mode))))
            cells += [_fmt_tf(r["tflops"]), _fmt_rel(r["rel_err"]), _md_cell(r["error"])]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")

    out.append("## Method")
    out.append("")
    out.extend(
        [
            f"- FLOPs = 4·B·Hq·T²·D/2 (causal). Inputs are fresh `torch.randn` in the row's dtype; "
            "q is [B,T,Hq,D], k/v are [B,T,Hkv,D].",
            "- Correctness is checked once before timing: rel_err = ‖out−ref‖/‖ref‖ in float64 against a float64 "
            f"reference; tolerance {TOLERANCE['float32']:g} (float32) and {TOLERANCE['bfloat16']:g} (bfloat16/float16). "
            "A wrong or NaN result is reported as an error and not timed. empty_call and read_floor are not checked (they are floors).",
            f"- Where B·Hq·T²·8 bytes exceed {FULL_REFERENCE_LIMIT // 2**30} GiB, the reference covers only query rows "
            f"0–{SLICE_ROWS - 1} and the last {SLICE_ROWS} (all heads).",
            f"- harness: KernelBench's cuda_event method: {HARNESS_WARMUP} warm-ups, then {HARNESS_TRIALS} trials of "
            "synchronize, 256 MB L2 flush, event, call, event, synchronize; median is the row's ms, mean is shown too. "
            f"reference_loops (≈100 ms a call) uses {LOOPS_WARMUP} warm-up and {LOOPS_TRIALS} trials.",
            f"- back_to_back: median of {info.get('do_bench_note', 'triton.testing.do_bench')} (return_mode='median').",
            f"- graph: {GRAPH_CALLS} calls captured in one CUDA graph after side-stream warm-up; median of "
            f"{GRAPH_REPLAYS} timed replays divided by {GRAPH_CALLS} (reference_loops: {LOOPS_GRAPH_CALLS} calls, "
            f"{LOOPS_GRAPH_REPLAYS} replays). No L2 flush between calls.",
            "- SDPA and flex get [B,H,T,D] transposed views of the inputs (part of the timed call), the output is "
            "transposed back; sdpa_expand_efficient's repeat_interleave is part of the timed call; flex's block mask "
            "is built once per shape outside the timing; torch.compile uses dynamic=False.",
            f"- An impl whose estimated memory exceeds {int(MEMORY_FRACTION * 100)}% of free GPU memory is skipped "
            "with an error; out-of-memory is an error too.",
        ]
    )
    for line in info.get("extra_notes", []):
        out.append(f"- {line}")
    out.append("")
    return "\n".join(out)


def render_plot(result: dict, sweep_shapes: dict, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(result["rows"])
    dtypes = [d for d, shapes in sweep_shapes.items() if any((tuple(s), d, "back_to_back") in groups for s in shapes)]
    if not dtypes:
        return False
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    markers = "os^vD<>px*h"
    for ax, dtype_name in zip(axes[0], dtypes):
        shapes = sweep_shapes[dtype_name]
        impls = [i for i in IMPL_NAMES if i not in NON_PEERS or i == "project"]
        for n, impl in enumerate(impls):
            xs, ys = [], []
            for s in shapes:
                for r in groups.get((tuple(s), dtype_name, "back_to_back"), []):
                    if r["impl"] == impl and r["error"] is None and r["tflops"] is not None:
                        xs.append(s[1])
                        ys.append(r["tflops"])
            if xs:
                width = 2.6 if impl == "project" else 1.3
                ax.plot(xs, ys, marker=markers[n % len(markers)], color=f"C{n % 10}", linewidth=width, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(SWEEP_TS))
        ax.set_xticklabels([str(t) for t in SWEEP_TS])
        ax.set_xlabel("T (sequence length), B·T = %d" % SWEEP_TOKENS)
        ax.set_ylabel("TFLOP/s (causal FLOPs)")
        ax.set_title(f"{dtype_name}, Hq={SWEEP_HEADS[0]}, Hkv={SWEEP_HEADS[1]}, D={SWEEP_HEADS[2]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Causal GQA forward, back_to_back median: {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark the causal GQA kernel against PyTorch peers.")
    p.add_argument("--quick", action="store_true", help="harness shape (all modes) + (4,1024,32,8,128) fp32/bf16 back_to_back")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: bench/results)")
    p.add_argument("--no-compile-time", action="store_true", help="skip the cold/warm build measurement")
    p.add_argument("--only", type=str, default=None, help="comma-separated implementation names to run")
    p.add_argument("--sweep-fp16", action="store_true", help="also run the T sweep in float16 (adds ~1-2 min)")
    p.add_argument("--no-sweep", action="store_true", help="the harness and scale shapes only, no T sweep (about half the time)")
    args = p.parse_args(argv)
    if args.only:
        names = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [n for n in names if n not in IMPL_NAMES]
        if bad:
            p.error(f"unknown implementation(s) {bad}; choose from {', '.join(IMPL_NAMES)}")
        args.only = [n for n in IMPL_NAMES if n in names]
    return args


def build_plan(args):
    """Return [(shape, dtype, modes)], and the sweep shapes per dtype."""
    plan = [(HARNESS_SHAPE, "float32", MODES)]
    seen = {(HARNESS_SHAPE, "float32")}
    sweep_shapes: dict = {}

    def add(shape, dtype_name):
        if (shape, dtype_name) not in seen:
            seen.add((shape, dtype_name))
            plan.append((shape, dtype_name, ("back_to_back",)))

    for shape, dtypes in QUICK_CONFIGS if args.quick else SCALE_CONFIGS:
        for d in dtypes:
            add(shape, d)
    if not args.quick and not args.no_sweep:
        dtypes = SWEEP_DTYPES + (("float16",) if args.sweep_fp16 else ())
        for d in dtypes:
            shapes = []
            for T in SWEEP_TS:
                shape = (SWEEP_TOKENS // T, T) + SWEEP_HEADS[:2] + (SWEEP_HEADS[2],)
                shapes.append(shape)
                add(shape, d)
            sweep_shapes[d] = shapes
    return plan, sweep_shapes


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except Exception as e:
        print(f"bench_gqa: torch is not importable ({format_error(e)}); a CUDA GPU with PyTorch is needed. Exiting.")
        return 0
    if not torch.cuda.is_available():
        print(f"bench_gqa: no CUDA GPU available (torch {torch.__version__}); this benchmark needs a GPU. Exiting.")
        return 0

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    ctx = Bench(args)
    log = lambda m: _log(ctx, m)  # noqa: E731
    gpu = torch.cuda.get_device_name()
    slug = gpu_slug(gpu)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path, png_path = (out_dir / f"{slug}.{ext}" for ext in ("json", "md", "png"))
    log(f"GPU {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}; writing {json_path.with_suffix('.*')}")

    # Compile time first: the children build into a fresh extensions dir, which the
    # parent then reuses so the extension is not built a second time.
    compile_fig = {"cold_s": 0.0, "warm_s": 0.0}
    info: dict = {"compile_notes": [], "extra_notes": []}
    if args.no_compile_time:
        previous = None
        if json_path.exists():
            with contextlib.suppress(Exception):
                previous = json.loads(json_path.read_text()).get("compile")
        if isinstance(previous, dict) and all(_is_number(previous.get(k)) for k in _COMPILE_KEYS):
            compile_fig = {k: float(previous[k]) for k in _COMPILE_KEYS}
            info["compile_notes"].append("not measured in this run (--no-compile-time); figures reused from the previous results file")
        else:
            info["compile_notes"].append("not measured (--no-compile-time) and no previous figures: 0.0 means unknown")
    else:
        comp = measure_compile(log)
        for label, key in (("cold", "cold_s"), ("warm", "warm_s")):
            child = comp[label]
            if child["seconds"] is not None:
                compile_fig[key] = round(child["seconds"], 3)
                info["compile_notes"].append(
                    f"{label}: {child['seconds']:.2f} s for the first call itself (from a ready process: torch imported, "
                    f"CUDA context up, inputs on the device, to the synchronized end of the call); the whole process "
                    f"from its first line took {child['process'] or 0:.2f} s; parent-side subprocess wall {child['wall']:.2f} s"
                )
            else:
                info["compile_notes"].append(f"{label}: failed ({child['error']}); recorded as 0.0")
        info["compile_notes"].append(
            "fresh processes (sys.executable -c), harness shape float32 inputs, cold = empty TORCH_EXTENSIONS_DIR, "
            "warm = second process on the same dir"
        )
        if not comp["built_in_dir"]:
            info["compile_notes"].append(
                "warning: nothing was written to TORCH_EXTENSIONS_DIR by the cold process, so the build may not have "
                "been cold"
            )
        if comp["warm"]["seconds"] is not None:
            os.environ["TORCH_EXTENSIONS_DIR"] = comp["dir"]

    import torch._dynamo

    for attr, value in (
        ("cache_size_limit", 64),
        ("recompile_limit", 64),
        ("accumulated_cache_size_limit", 1024),
        ("accumulated_recompile_limit", 1024),
    ):
        with contextlib.suppress(Exception):
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, value)

    ctx.import_project()
    for mod, err in ctx.import_errors.items():
        log(f"import {mod} failed: {err}")
    info["do_bench_note"] = ctx.do_bench_note
    if ctx.gqa_module is not None:
        try:
            sha = str(ctx.gqa_module.kernel_source_sha256())
        except Exception as e:
            log(f"kernel_source_sha256 failed ({format_error(e)}); computing it here")
            sha = own_kernel_sha256()
    else:
        sha = own_kernel_sha256()

    ctx.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    plan, sweep_shapes = build_plan(args)
    info["sweep_shapes"] = sweep_shapes
    impls_all = list(args.only) if args.only else list(IMPL_NAMES)
    if args.only:
        info["extra_notes"].append(f"partial run: --only {','.join(args.only)}")

    def result_obj():
        return {
            "gpu": gpu,
            "torch": str(torch.__version__),
            "cuda": str(torch.version.cuda or ""),
            "date": datetime.date.today().isoformat(),
            "source_sha256": sha,
            "compile": {"cold_s": float(compile_fig["cold_s"]), "warm_s": float(compile_fig["warm_s"])},
            "rows": list(ctx.rows),
        }

    def save():
        obj = result_obj()
        problems = validate_results_schema(obj)
        if problems:
            log(f"schema problems (written anyway): {problems[:5]}")
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        os.replace(tmp, json_path)
        return obj

    with torch.no_grad():
        for shape, dtype_name, modes in plan:
            impls = [i for i in impls_all if not (i in HARNESS_ONLY and shape != HARNESS_SHAPE)]
            if not impls:
                continue
            try:
                ctx.run_config(shape, dtype_name, modes, impls)
            except Exception as e:  # keep going whatever happens in one configuration
                log(f"configuration {shape} {dtype_name} failed: {format_error(e)}")
                ctx.cleanup()
            save()

    obj = save()
    info["extra_notes"].extend(ctx.notes)
    info["extra_notes"].append(f"total benchmark wall time {time.perf_counter() - ctx.t0:.0f} s")
    md_path.write_text(render_md(obj, ctx.means, info))
    plotted = False
    try:
        plotted = render_plot(obj, sweep_shapes, png_path)
    except Exception as e:
        log(f"plot failed: {format_error(e)}")
    log(f"wrote {json_path}, {md_path}" + (f", {png_path}" if plotted else " (no sweep data, no plot)"))
    print()
    print(render_md(obj, ctx.means, info, brief=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
