"""One benchmark run: for each planned (shape, dtype), check then time every implementation."""
import contextlib
import datetime
import gc
import importlib
import math
import statistics
import sys
import time
import warnings

from .check import check, reference_for
from .config import BACKWARD_FLOP_FACTOR, BACKWARD_IMPLS, BACKWARD_MODE, MEMORY_FRACTION, REPO_ROOT, ROUND_MODES
from .errors import format_error
from .impls import HARNESS_ONLY, OPTIONAL, SIXTEEN_BIT, SIXTEEN_BIT_ONLY, Implementations, estimate_bytes, materialises_scores
from .schema import COMPILE_KEYS
from .shapes import HARNESS_SHAPE, flops_of
from .timing import Timer


def cuda_torch():
    """torch, where it imports and sees a CUDA GPU; else None, after saying why."""
    try:
        import torch
    except Exception as e:
        print(f"bench_gqa: torch is not importable ({format_error(e)}); a CUDA GPU with PyTorch is needed. Exiting.")
        return None
    if not torch.cuda.is_available():
        print(f"bench_gqa: no CUDA GPU available (torch {torch.__version__}); this benchmark needs a GPU. Exiting.")
        return None
    return torch


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


def _raise_dynamo_limits() -> None:
    """Room for one compiled graph per shape and dtype (the names differ across torch versions)."""
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


def _import_project():
    """Return ({name: module}, {name: error}) for gqa_module and reference, from the repository root."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    modules, errors = {}, {}
    for name in ("gqa_module", "reference"):
        try:
            modules[name] = importlib.import_module(name)
        except Exception as e:  # recorded on the rows that need the module
            errors[name] = format_error(e)
    return modules, errors


class Bench:
    """The rows of one run, and what measuring them needs."""

    def __init__(self, torch, rounds=1):
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        self.torch = torch
        self.t0 = time.perf_counter()
        self.gpu = torch.cuda.get_device_name()
        self.rows: list[dict] = []
        self.row_index: dict = {}
        self.means: dict = {}  # harness-mode means, md only
        self.rounds = rounds  # rounds of the ROUND_MODES rows (run_config)
        self.round_ms: dict = {}  # each round's ms by row key
        self.current_inputs = None
        self.gqa_module = None
        self.reference = None
        self.impls = None
        self.timer = None
        self.sha = ""

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    def setup(self) -> None:
        """Raise torch.compile's limits, import the project, hash its kernels, start the timer."""
        _raise_dynamo_limits()
        modules, errors = _import_project()
        for mod, err in errors.items():
            self.log(f"import {mod} failed: {err}")
        self.gqa_module = modules.get("gqa_module")
        self.reference = modules.get("reference")
        self.impls = Implementations(self.torch, modules, errors)
        try:
            self.sha = str(self.impls.module("gqa_module").kernel_source_sha256())
        except Exception as e:  # the results file then fails its schema check, as it should
            self.log(f"kernel_source_sha256 unavailable ({format_error(e)}); source_sha256 left empty")
        self.timer = Timer(self.torch)

    def result(self, compile_fig: dict) -> dict:
        """The results object (see schema.py) with the rows measured so far."""
        torch = self.torch
        return {
            "gpu": self.gpu,
            "torch": str(torch.__version__),
            "cuda": str(torch.version.cuda or ""),
            "date": datetime.date.today().isoformat(),
            "source_sha256": self.sha,
            "compile": {k: float(compile_fig[k]) for k in COMPILE_KEYS},
            "rows": list(self.rows),
        }

    def run(self, plan, impls_all, save) -> None:
        """Measure every configuration of the plan, calling save() after each."""
        impls_all = self.present(impls_all)
        with self.torch.no_grad():
            for shape, dtype_name, modes in plan:
                impls = [i for i in impls_all if not (i in HARNESS_ONLY and shape != HARNESS_SHAPE)
                         and not (i in SIXTEEN_BIT_ONLY and dtype_name not in SIXTEEN_BIT)]
                if not impls:
                    continue
                try:
                    self.run_config(shape, dtype_name, modes, impls)
                except Exception as e:  # keep going whatever happens in one configuration
                    self.log(f"configuration {shape} {dtype_name} failed: {format_error(e)}")
                    self.cleanup()
                save()

    def present(self, names):
        """names without the optional implementations whose package does not import; each one
        dropped is said once in the report's notes."""
        kept = []
        for name in names:
            missing = OPTIONAL[name]() if name in OPTIONAL else None
            if missing:
                self.impls.notes.append(f"no {name} rows: {missing}")
                self.log(f"no {name} rows: {missing}")
            else:
                kept.append(name)
        return kept

    # -- memory ----------------------------------------------------------------
    def cleanup(self):
        gc.collect()
        with contextlib.suppress(Exception):
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def memory_guard(self, name: str, shape, dtype_name: str):
        """None where the estimate fits in MEMORY_FRACTION of free memory, else the skip message."""
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

    # -- rows ------------------------------------------------------------------
    def plan_of(self, impl, mode=None):
        """The project's kernel plan for the inputs in hand ("x3/fp32/d128"; for a backward row the
        backward's, "bwdmma/bf16/d128"), else None."""
        if impl != "project" or self.gqa_module is None or self.current_inputs is None:
            return None
        try:
            if mode == BACKWARD_MODE:
                return self.gqa_module.backward_plan(*self.current_inputs)
            return self.gqa_module.plan(*self.current_inputs)
        except Exception as e:
            return f"unknown ({format_error(e)[:80]})"

    def add_row(self, shape, dtype_name, impl, mode, ms=None, rel_err=None, error=None, mean=None):
        key = (tuple(shape), dtype_name, impl, mode)
        rounds = None
        if ms is not None:
            rounds = self.round_ms.setdefault(key, [])
            rounds.append(round(float(ms), 6))
            ms = statistics.median(rounds)
        tflops = None
        if ms is not None and ms > 0:
            factor = BACKWARD_FLOP_FACTOR if mode == BACKWARD_MODE else 1.0
            tflops = round(factor * flops_of(shape) / (ms * 1e9), 4)
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
            "plan": self.plan_of(impl, mode),
        }
        if rounds is not None and len(rounds) > 1:
            row["rounds"] = list(rounds)
        if key in self.row_index:
            self.rows[self.row_index[key]] = row
        else:
            self.row_index[key] = len(self.rows)
            self.rows.append(row)
        if mean is not None:
            self.means[key] = mean
        shape_s = "x".join(str(s) for s in shape)
        if error:
            self.log(f"{shape_s:>20} {dtype_name:8} {mode:12} {impl:22} error: {error[:110]}")
        else:
            extra = f" mean={mean:.4f}" if mean is not None else ""
            err_s = f" rel_err={rel_err:.2e}" if rel_err is not None else ""
            self.log(f"{shape_s:>20} {dtype_name:8} {mode:12} {impl:22} ms={ms:.4f}{extra} tflops={tflops}{err_s}")

    def _error_rows(self, shape, dtype_name, name, modes, error):
        for mode in modes:
            self.add_row(shape, dtype_name, name, mode, error=error)

    # -- one shape / dtype -----------------------------------------------------
    def run_config(self, shape, dtype_name, modes, impls):
        torch = self.torch
        B, T, Hq, Hkv, D = shape
        dtype = getattr(torch, dtype_name)
        self.log(f"== shape (B,T,Hq,Hkv,D)={shape} dtype={dtype_name} modes={','.join(modes)}")
        torch.manual_seed(0)
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        try:
            ref, ref_rows = reference_for(self.reference, q, k, v, shape, self.log)
        except Exception as e:
            msg = f"reference failed: {format_error(e)}"
            for name in impls:
                self._error_rows(shape, dtype_name, name, modes, msg)
            self.cleanup()
            return
        self.current_inputs = (q, k, v)
        for name in impls:
            self.run_impl(name, shape, dtype_name, modes, (q, k, v), ref, ref_rows)
        # Later rounds: the ROUND_MODES rows again, every implementation in turn, those that timed.
        again = [m for m in modes if m in ROUND_MODES]
        for _ in range(1, self.rounds if again else 1):
            for name in impls:
                timed = [m for m in again if self._has_time((tuple(shape), dtype_name, name, m))]
                if timed:
                    self.run_impl(name, shape, dtype_name, timed, (q, k, v), ref, ref_rows)
        self.current_inputs = None
        del q, k, v, ref
        self.cleanup()

    def _has_time(self, key) -> bool:
        return key in self.row_index and self.rows[self.row_index[key]]["ms"] is not None

    def run_impl(self, name, shape, dtype_name, modes, args, ref, ref_rows):
        modes = [m for m in modes if m != BACKWARD_MODE or name in BACKWARD_IMPLS]
        if not modes:
            return
        try:
            skip = self.memory_guard(name, shape, dtype_name)
        except Exception as e:
            skip = format_error(e)
        if skip:
            self._error_rows(shape, dtype_name, name, modes, skip)
            return
        fn = None
        try:
            fn, make_ctx = self.impls.build(name, shape, dtype_name, args)
        except Exception as e:
            self._error_rows(shape, dtype_name, name, modes, format_error(e))
            self.cleanup()
            return
        try:
            with make_ctx():
                rel_err, err = check(fn, name, dtype_name, args, ref, ref_rows)
                for mode in modes:
                    if err is not None:
                        self.add_row(shape, dtype_name, name, mode, rel_err=rel_err, error=err)
                        continue
                    try:
                        ms, mean = self.timer.time(mode, fn, args, name)
                        # the forward's error; gradients are checked by the tests, not here
                        row_err = None if mode == BACKWARD_MODE else rel_err
                        self.add_row(shape, dtype_name, name, mode, ms, row_err, mean=mean)
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
