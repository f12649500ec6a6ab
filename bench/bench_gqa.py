#!/usr/bin/env python3
"""Benchmark the project's causal grouped-query attention against PyTorch peers.

Usage (from anywhere; the repository root is found from this file's location):

    python bench/bench_gqa.py                 # full run (~6 min on an H200)
    python bench/bench_gqa.py --quick         # harness shape + one large shape
    python bench/bench_gqa.py --only project,sdpa_flash --no-compile-time

Writes <out>/<gpu>.json, <out>/<gpu>.md and <out>/<gpu>.png, where <gpu> is the
device name lowercased with every non-alphanumeric character replaced by '-'.
The work is in the gqa_bench package beside this file.

Importing this module is cheap and does no GPU work: torch is imported lazily,
so `validate_results_schema` can be used on a machine without CUDA.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from gqa_bench.compile_time import compile_figures  # noqa: E402
from gqa_bench.config import DEFAULT_OUT, DTYPE_NAMES  # noqa: E402
from gqa_bench.impls import IMPL_NAMES  # noqa: E402
from gqa_bench.report import render_md, write_reports  # noqa: E402
from gqa_bench.runner import Bench, cuda_torch  # noqa: E402
from gqa_bench.schema import validate_results_schema, write_results  # noqa: E402
from gqa_bench.shapes import build_plan  # noqa: E402

__all__ = ["main", "parse_args", "validate_results_schema"]


def output_paths(out: Path, gpu: str):
    """(json, md, png) paths in out, named after the GPU with every non-alphanumeric character as '-'."""
    slug = re.sub(r"[^a-z0-9]", "-", gpu.lower())
    return tuple(Path(out) / f"{slug}.{ext}" for ext in ("json", "md", "png"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark the causal GQA kernel against PyTorch peers.")
    p.add_argument("--quick", action="store_true", help="harness shape (all modes) + (4,1024,32,8,128) fp32/bf16 back_to_back")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: bench/results)")
    p.add_argument("--no-compile-time", action="store_true", help="skip the cold/warm build measurement")
    p.add_argument("--only", type=str, default=None, help="comma-separated implementation names to run")
    p.add_argument("--sweep-fp16", action="store_true", help="also run the T sweep in float16 (adds ~1-2 min)")
    p.add_argument("--no-sweep", action="store_true", help="the harness and scale shapes only, no T sweep (about half the time)")
    p.add_argument("--dtypes", type=str, default=None,
                   help="comma-separated dtypes to run (float32, bfloat16, float16); default all")
    p.add_argument("--backward", action="store_true",
                   help="also time the backward at the scale shapes (project and the SDPA backends that train)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the back_to_back and backward rows in this many rounds over a shape's implementations "
                        "in turn; a row's ms is the median of its rounds (default 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.dtypes:
        dtypes = [s.strip() for s in args.dtypes.split(",") if s.strip()]
        bad = [d for d in dtypes if d not in DTYPE_NAMES]
        if bad or not dtypes:
            p.error(f"--dtypes takes a comma-separated list from {', '.join(DTYPE_NAMES)}, got {args.dtypes!r}")
        args.dtypes = tuple(dtypes)
    if args.only:
        names = [s.strip() for s in args.only.split(",") if s.strip()]
        bad = [n for n in names if n not in IMPL_NAMES]
        if bad:
            p.error(f"unknown implementation(s) {bad}; choose from {', '.join(IMPL_NAMES)}")
        args.only = [n for n in IMPL_NAMES if n in names]
    return args


def main(argv=None) -> int:
    """Parse the arguments, build the run plan, run it, write the results."""
    args = parse_args(argv)
    plan, sweep_shapes = build_plan(args)
    torch = cuda_torch()
    if torch is None:
        return 0
    bench = Bench(torch, rounds=args.rounds)
    paths = output_paths(args.out, bench.gpu)
    json_path = paths[0]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    bench.log(f"GPU {bench.gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}; writing {json_path.with_suffix('.*')}")
    # Compile time first: the children build into a fresh extensions dir, which this process reuses.
    compile_fig, compile_notes = compile_figures(not args.no_compile_time, json_path, bench.log)
    bench.setup()

    def save():
        return write_results(bench.result(compile_fig), json_path, bench.log)

    bench.run(plan, list(args.only or IMPL_NAMES), save)
    result = save()
    partial = [f"partial run: --only {','.join(args.only)}"] if args.only else []
    wall = f"total benchmark wall time {time.perf_counter() - bench.t0:.0f} s"
    info = {"compile_notes": compile_notes, "extra_notes": partial + bench.impls.notes + [wall], "rounds": args.rounds,
            "do_bench_note": bench.timer.do_bench_note, "sweep_shapes": sweep_shapes}
    write_reports(result, bench.means, info, paths, bench.log)
    print()
    print(render_md(result, bench.means, info, brief=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
