"""The project extension's first-call time, cold and warm, each in a fresh process."""
import atexit
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config import REPO_ROOT
from .schema import COMPILE_KEYS, is_number

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


def _run_child(ext_dir: str) -> dict:
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
    cold = _run_child(ext_dir)
    log(f"compile timing: cold {cold}")
    built = any(Path(ext_dir).iterdir())
    warm = _run_child(ext_dir)
    log(f"compile timing: warm {warm}")
    return {"cold": cold, "warm": warm, "dir": ext_dir, "built_in_dir": built}


def _previous_figures(json_path: Path, notes: list) -> dict:
    """The figures of the results file at json_path, for a run that does not measure them."""
    previous = None
    if json_path.exists():
        with contextlib.suppress(Exception):
            previous = json.loads(json_path.read_text()).get("compile")
    if isinstance(previous, dict) and all(is_number(previous.get(k)) for k in COMPILE_KEYS):
        notes.append("not measured in this run (--no-compile-time); figures reused from the previous results file")
        return {k: float(previous[k]) for k in COMPILE_KEYS}
    notes.append("not measured (--no-compile-time) and no previous figures: 0.0 means unknown")
    return {"cold_s": 0.0, "warm_s": 0.0}


def compile_figures(measure: bool, json_path: Path, log):
    """Return ({"cold_s", "warm_s"}, notes for the report).

    A measured warm build is left in TORCH_EXTENSIONS_DIR for this process, so that the extension is
    not built a second time; without measuring, the figures come from the previous results file.
    """
    notes: list[str] = []
    if not measure:
        return _previous_figures(json_path, notes), notes
    figures = {"cold_s": 0.0, "warm_s": 0.0}
    comp = measure_compile(log)
    for label, key in (("cold", "cold_s"), ("warm", "warm_s")):
        child = comp[label]
        if child["seconds"] is not None:
            figures[key] = round(child["seconds"], 3)
            notes.append(
                f"{label}: {child['seconds']:.2f} s for the first call itself (from a ready process: torch imported, "
                f"CUDA context up, inputs on the device, to the synchronized end of the call); the whole process "
                f"from its first line took {child['process'] or 0:.2f} s; parent-side subprocess wall {child['wall']:.2f} s"
            )
        else:
            notes.append(f"{label}: failed ({child['error']}); recorded as 0.0")
    notes.append(
        "fresh processes (sys.executable -c), harness shape float32 inputs, cold = empty TORCH_EXTENSIONS_DIR, "
        "warm = second process on the same dir"
    )
    if not comp["built_in_dir"]:
        notes.append(
            "warning: nothing was written to TORCH_EXTENSIONS_DIR by the cold process, so the build may not have "
            "been cold"
        )
    if comp["warm"]["seconds"] is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = comp["dir"]
    return figures, notes
