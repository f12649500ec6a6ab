#!/usr/bin/env python3
"""KernelBench's own checks on the single-file bundle, on a GPU machine.

Usage (from anywhere; the repository root is found from this file's location):

    python bench/kernelbench_eval.py OUT.json              # on a GPU: static checks, then six evaluations
    python bench/kernelbench_eval.py OUT.json --dry-run    # anywhere: every step that needs no GPU

KERNELBENCH_SRC (or --kernelbench-src) names a KernelBench checkout's src/ directory (default: .kb/src
in the repository, e.g. from `git archive HEAD src/kernelbench | tar -x -C .kb` in a KernelBench clone).

Steps:
1. `python gqa_module.py --bundle` writes a fresh bundle.
2. `validate_kernel_static(bundle, backend="cuda", precision=p)` for p = fp32, fp16, bf16, printed.
3. `eval_kernel_against_ref(reference, bundle, ...)` with num_correct_trials=5, measure_performance=True,
   num_perf_trials=200, timing_method="cuda_event" and a fresh build_dir for every call, each in a fresh
   process: fp32 with init args (reference.py as it is), fp32 without init args (a variant of
   reference.py whose get_init_inputs returns []), fp16 and bf16. Then two evaluations in one process
   (fp32, then bf16), where KernelBench execs the bundle a second time with another build directory.
4. Compiled / correctness / runtime stats of each printed, and everything written to OUT.json.

kernelbench's package __init__ imports kernelbench.utils, which imports API clients (openai, litellm,
python-dotenv) and tqdm, and kernelbench.eval imports pydantic for its result type; an evaluation calls
none of the clients. Where one of these packages is missing (a GPU machine without network may lack
them), a minimal stand-in module is registered under its name before the import; the JSON lists which.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SRC = REPO_ROOT / ".kb" / "src"
PRECISIONS = ("fp32", "fp16", "bf16")

NUM_CORRECT_TRIALS = 5
NUM_PERF_TRIALS = 200
TIMING_METHOD = "cuda_event"
SEED = 42

# name -> (precision, reference variant)
CASES = {
    "fp32": ("fp32", "init"),
    "fp32-no-init": ("fp32", "no-init"),
    "fp16": ("fp16", "init"),
    "bf16": ("bf16", "init"),
}
DESCRIPTIONS = {
    "fp32": "fp32, Model(*get_init_inputs()) with init args",
    "fp32-no-init": "fp32, reference variant without init args",
    "fp16": "fp16",
    "bf16": "bf16",
}
# Each run is one fresh process; the last one holds two evaluations.
RUNS = [["fp32"], ["fp32-no-init"], ["fp16"], ["bf16"], ["fp32", "bf16"]]


# ------------------------------------------------------------------------------------------------
# The reference, with and without init args
def reference_source(variant):
    with open(REPO_ROOT / "reference.py") as fh:
        text = fh.read()
    if variant == "init":
        return text
    old = "def get_init_inputs():\n    return [num_q_heads, num_kv_heads, head_dim]\n"
    if text.count(old) != 1:
        raise SystemExit("reference.py: cannot find get_init_inputs to make the variant without init args")
    # Model's constructor has defaults for every argument, so Model() builds the same problem.
    return text.replace(old, "def get_init_inputs():\n    return []\n")


# ------------------------------------------------------------------------------------------------
# Importing kernelbench where some of its imports are missing
class _StandInModel:
    """Just enough of pydantic.BaseModel for kernelbench.eval.KernelExecResult: keyword construction
    over annotated fields with per-instance copies of the defaults, attribute access, model_dump()."""

    def __init__(self, **values):
        fields = {}
        for klass in reversed(type(self).__mro__):
            for name in getattr(klass, "__annotations__", {}):
                fields[name] = getattr(klass, name, None)
        unknown = set(values) - set(fields)
        if unknown:
            raise TypeError("%s got unknown fields %s" % (type(self).__name__, sorted(unknown)))
        for name, default in fields.items():
            setattr(self, name, values[name] if name in values else copy.deepcopy(default))
        self._fields = list(fields)

    def model_dump(self):
        return {name: getattr(self, name) for name in self._fields}

    dict = model_dump

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__, ", ".join("%s=%r" % kv for kv in self.model_dump().items()))


class _StandInProgress:
    """tqdm's interface as kernelbench.utils uses it, without drawing anything."""

    def __init__(self, iterable=None, *args, **kwargs):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable if self.iterable is not None else ())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, *args, **kwargs):
        return None

    def close(self):
        return None

    def set_description(self, *args, **kwargs):
        return None


def _no_api_client(*args, **kwargs):
    raise RuntimeError("kernelbench_eval.py: API clients are stand-ins here; an evaluation does not use them")


def _stand_in_modules():
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__kernelbench_eval_stand_in__ = True
        return m

    return {
        "pydantic": lambda: module("pydantic", BaseModel=_StandInModel),
        "dotenv": lambda: module("dotenv", load_dotenv=lambda *a, **k: False),
        "openai": lambda: module("openai", OpenAI=_no_api_client),
        "litellm": lambda: module("litellm", completion=_no_api_client),
        "tqdm": lambda: module("tqdm", tqdm=_StandInProgress),
    }


def load_checker(src):
    """kernelbench/kernel_static_checker.py alone (it needs only the standard library)."""
    path = Path(src) / "kernelbench" / "kernel_static_checker.py"
    if not path.is_file():
        raise SystemExit("no KernelBench checker at %s: set KERNELBENCH_SRC to a KernelBench checkout's src/" % path)
    spec = importlib.util.spec_from_file_location("kernelbench_static_checker", path)
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    return checker


def import_kernelbench_eval(src):
    """kernelbench.eval from `src`, with stand-ins for the missing packages named above."""
    if not (Path(src) / "kernelbench" / "eval.py").is_file():
        raise SystemExit("no kernelbench/eval.py under %s: set KERNELBENCH_SRC to a KernelBench checkout's src/" % src)
    stand_ins = []
    for name, make in _stand_in_modules().items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = make()
            stand_ins.append(name)
    sys.path.insert(0, str(src))
    import kernelbench.eval as kb_eval

    return kb_eval, stand_ins


def json_safe(value):
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value) if isinstance(value, BaseException) else str(value)


# ------------------------------------------------------------------------------------------------
# One process: one or more evaluations
def libraries_under(directory):
    return sorted(str(p.relative_to(directory)) for p in Path(directory).rglob("*.so"))


def child(args):
    """Run the evaluations named in args.child (comma-separated) in this process; write their results."""
    kb_eval, stand_ins = import_kernelbench_eval(args.kernelbench_src)
    import torch

    with open(args.bundle) as fh:
        bundle = fh.read()
    results = []
    for index, name in enumerate(args.child.split(",")):
        precision, variant = CASES[name]
        build_dir = Path(args.work) / ("build-%s-%d" % (name, index))
        build_dir.mkdir(parents=True)
        entry = {"case": name, "description": DESCRIPTIONS[name], "precision": precision,
                 "init_args": variant == "init", "position_in_process": index, "build_dir": str(build_dir),
                 "stand_ins": stand_ins}
        if args.dry_run:
            # What eval_kernel_against_ref does before its first CUDA call: exec the reference and
            # then the bundle into one namespace (the bundle after setting TORCH_EXTENSIONS_DIR).
            context = {}
            model_cls, get_init_inputs, _ = kb_eval.load_original_model_and_inputs(reference_source(variant), context)
            init_inputs = get_init_inputs()
            model_new_cls = kb_eval.load_custom_model(bundle, context, str(build_dir))
            model_cls(*init_inputs), model_new_cls(*init_inputs)
            entry["dry_run"] = {"init_inputs": init_inputs, "ModelNew": model_new_cls.__name__,
                                "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR")}
            entry["skipped"] = "dry run: eval_kernel_against_ref needs a CUDA GPU"
            results.append(entry)
            continue
        started = time.perf_counter()
        result = kb_eval.eval_kernel_against_ref(
            original_model_src=reference_source(variant),
            custom_model_src=bundle,
            seed_num=SEED,
            num_correct_trials=NUM_CORRECT_TRIALS,
            num_perf_trials=NUM_PERF_TRIALS,
            measure_performance=True,
            timing_method=TIMING_METHOD,
            verbose=args.verbose,
            build_dir=str(build_dir),
            device=0,
            backend="cuda",
            precision=kb_eval.get_torch_dtype_from_string(precision),
            check_for_excessive_speedup=not args.no_speedup_check,
        )
        entry["wall_s"] = round(time.perf_counter() - started, 2)
        if result is None:   # KernelBench's answer to a lock-file error: retry
            entry["result"] = None
        else:
            dump = result.model_dump() if hasattr(result, "model_dump") else result.dict()
            entry["result"] = json_safe(dump)
        entry["build_dir_libraries"] = libraries_under(build_dir)
        entry["loaded_libraries"] = sorted(p for p in torch.ops.loaded_libraries if "gqa_attn" in os.path.basename(p))
        entry["loaded_kernel_sha256"] = getattr(torch.ops.gqa_attn, "_gqa_source_sha256", None)
        results.append(entry)
    with open(args.result, "w") as fh:
        json.dump(results, fh, indent=1)


# ------------------------------------------------------------------------------------------------
# The driver
def sha256_of(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def describe(entry):
    head = "%-48s" % ("%s (process %s, evaluation %d)" % (entry["description"], entry["process"],
                                                          entry["position_in_process"] + 1))
    if "skipped" in entry:
        return head + " skipped: " + entry["skipped"]
    if "error" in entry:
        return head + " ERROR: " + entry["error"]
    result = entry.get("result")
    if result is None:
        return head + " no result (KernelBench asks for a retry after a lock-file error)"
    meta = result.get("metadata", {})
    line = head + " compiled=%s correctness=%s %s" % (result["compiled"], result["correctness"],
                                                      meta.get("correctness_trials", ""))
    stats = result.get("runtime_stats") or {}
    if stats:
        line += " | runtime mean %.4g ms (std %.3g, min %.4g, max %.4g, %d trials)" % (
            stats["mean"], stats["std"], stats["min"], stats["max"], stats["num_trials"])
    ref = result.get("ref_runtime_stats") or {}
    if ref:
        line += " | reference mean %.4g ms" % ref["mean"]
        if result.get("runtime", -1) > 0:
            line += " (%.0fx)" % (ref["mean"] / result["runtime"])
    for key in ("compilation_error", "runtime_error", "correctness_issue", "max_difference", "excessive_speedup"):
        if key in meta:
            line += " | %s: %s" % (key, meta[key])
    return line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="where to write the JSON summary")
    parser.add_argument("--kernelbench-src", default=os.environ.get("KERNELBENCH_SRC") or str(DEFAULT_SRC),
                        help="a KernelBench checkout's src/ directory (default: $KERNELBENCH_SRC, else .kb/src)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run everything that needs no GPU: bundle, static checks, imports, reference variants, "
                             "the child processes up to the evaluation call")
    parser.add_argument("--no-speedup-check", action="store_true",
                        help="pass check_for_excessive_speedup=False (skips timing the reference loops, ~20 s a call)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for each evaluation process (default 900)")
    parser.add_argument("--verbose", action="store_true", help="KernelBench's verbose output")
    parser.add_argument("--work", help="folder for the bundle and the build directories (default: a new temporary one)")
    # Internal: one evaluation process.
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bundle", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.kernelbench_src = str(Path(args.kernelbench_src).resolve())
    if args.child:
        child(args)
        return 0
    if not args.out:
        parser.error("the path of the JSON summary is required")

    work = Path(args.work or tempfile.mkdtemp(prefix="kernelbench_eval_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    bundle = work / "gqa_bundle.py"
    run = subprocess.run([sys.executable, str(REPO_ROOT / "gqa_module.py"), "--bundle", str(bundle)],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit("writing the bundle failed:\n" + run.stderr[-3000:])
    sys.path.insert(0, str(REPO_ROOT))
    import gqa_module
    import torch

    summary = {
        "kernelbench_src": args.kernelbench_src, "bundle": str(bundle), "bundle_sha256": sha256_of(bundle),
        "kernel_source_sha256": gqa_module.kernel_source_sha256(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "dry_run": args.dry_run,
        "settings": {"num_correct_trials": NUM_CORRECT_TRIALS, "num_perf_trials": NUM_PERF_TRIALS,
                     "timing_method": TIMING_METHOD, "seed_num": SEED, "measure_performance": True,
                     "check_for_excessive_speedup": not args.no_speedup_check},
    }
    print("bundle %s (sha256 %s; kernel sources sha256 %s)" % (bundle, summary["bundle_sha256"],
                                                                summary["kernel_source_sha256"]))

    checker = load_checker(args.kernelbench_src)
    source = bundle.read_text()
    summary["static"] = {}
    for precision in PRECISIONS:
        valid, errors, warnings = checker.validate_kernel_static(source, backend="cuda", precision=precision)
        summary["static"][precision] = {"valid": valid, "errors": errors, "warnings": warnings}
        print("validate_kernel_static(backend='cuda', precision=%r) -> %r" % (precision, (valid, errors, warnings)))

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("eval_kernel_against_ref needs a CUDA GPU; use --dry-run here")

    summary["evaluations"] = []
    for number, cases in enumerate(RUNS, 1):
        result_path = work / ("result-%d.json" % number)
        command = [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(cases), "--bundle", str(bundle),
                   "--result", str(result_path), "--work", str(work / ("process-%d" % number)),
                   "--kernelbench-src", args.kernelbench_src]
        command += ["--dry-run"] * args.dry_run + ["--no-speedup-check"] * args.no_speedup_check
        command += ["--verbose"] * args.verbose
        print("\n[process %d] %s" % (number, " + ".join(DESCRIPTIONS[c] for c in cases)), flush=True)
        started = time.perf_counter()
        try:
            returncode = subprocess.run(command, cwd=REPO_ROOT, timeout=args.timeout).returncode
            failure = "process exited with %d" % returncode
        except subprocess.TimeoutExpired:
            returncode, failure = None, "process killed after %d s (--timeout)" % args.timeout
        wall = round(time.perf_counter() - started, 2)
        if returncode == 0 and result_path.is_file():
            with open(result_path) as fh:
                entries = json.load(fh)
        else:
            entries = [{"case": c, "description": DESCRIPTIONS[c], "position_in_process": i, "error": failure}
                       for i, c in enumerate(cases)]
        for entry in entries:
            entry.update(process=number, process_returncode=returncode, process_wall_s=wall)
            summary["evaluations"].append(entry)

    print("\nSummary")
    for precision in PRECISIONS:
        s = summary["static"][precision]
        print("  static %s: valid=%s errors=%s warnings=%s" % (precision, s["valid"], s["errors"], s["warnings"]))
    for entry in summary["evaluations"]:
        print("  " + describe(entry))
    second = [e for e in summary["evaluations"] if e.get("position_in_process", 0) > 0 and "result" in e]
    for entry in second:
        print("  second evaluation in process %d: libraries built in its own build dir: %s; loaded: %s"
              % (entry["process"], entry["build_dir_libraries"] or "none (the loaded library was reused)",
                 entry["loaded_libraries"]))
    with open(args.out, "w") as fh:
        json.dump(summary, fh, indent=1)
    print("\nwrote %s" % args.out)
    failed = [e for e in summary["evaluations"] if "error" in e or (not args.dry_run and not (
        e.get("result") and e["result"]["compiled"] and e["result"]["correctness"]))]
    static_failed = [p for p in PRECISIONS if not summary["static"][p]["valid"]]
    return 1 if failed or static_failed else 0


if __name__ == "__main__":
    sys.exit(main())
