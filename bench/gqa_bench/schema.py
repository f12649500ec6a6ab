"""The results JSON: its schema, the check of an object against it, and the writing of a file.

Pure Python; importable without torch.
"""
import datetime
import json
import math
import os
import re
import statistics

from .config import ALL_MODES, DTYPE_NAMES
from .impls import IMPL_NAMES

TOP_KEYS = ("gpu", "torch", "cuda", "date", "source_sha256", "compile", "rows")
COMPILE_KEYS = ("cold_s", "warm_s")
ROW_KEYS = ("shape", "dtype", "impl", "mode", "ms", "tflops", "rel_err", "error", "plan")
# Only on rows timed in more than one round (--rounds): each round's ms, in order; ms is their median.
OPTIONAL_ROW_KEYS = ("rounds",)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_keys(obj: dict, expected, where: str, problems: list, optional=()) -> None:
    missing = [k for k in expected if k not in obj]
    extra = sorted(str(k) for k in obj if k not in expected and k not in optional)
    if missing:
        problems.append(f"{where}: missing keys {missing}")
    if extra:
        problems.append(f"{where}: unexpected keys {extra}")


def _check_row(row: dict, where: str, problems: list) -> None:
    _check_keys(row, ROW_KEYS, where, problems, OPTIONAL_ROW_KEYS)
    if "rounds" in row:
        rounds = row["rounds"]
        if not (isinstance(rounds, list) and len(rounds) > 1 and all(is_number(x) and x >= 0 for x in rounds)):
            problems.append(f"{where}.rounds: expected a list of two or more non-negative numbers, got {rounds!r}")
        elif is_number(row.get("ms")) and not math.isclose(row["ms"], statistics.median(rounds), rel_tol=1e-6):
            problems.append(f"{where}.ms: {row['ms']!r} is not the median of its rounds {rounds!r}")
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
    if "mode" in row and row["mode"] not in ALL_MODES:
        problems.append(f"{where}.mode: {row['mode']!r} not in {list(ALL_MODES)}")
    for key in ("ms", "tflops", "rel_err"):
        if key in row and row[key] is not None and not (is_number(row[key]) and row[key] >= 0):
            problems.append(f"{where}.{key}: expected null or a non-negative number, got {row[key]!r}")
    for key in ("error", "plan"):
        if key in row and row[key] is not None and not isinstance(row[key], str):
            problems.append(f"{where}.{key}: expected null or a string")


def validate_results_schema(obj) -> list[str]:
    """Return a list of problems with a results object; empty when it is valid."""
    problems: list[str] = []
    if not isinstance(obj, dict):
        return [f"top level: expected an object, got {type(obj).__name__}"]
    _check_keys(obj, TOP_KEYS, "top level", problems)

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
            _check_keys(comp, COMPILE_KEYS, "compile", problems)
            for key in COMPILE_KEYS:
                if key in comp and not (is_number(comp[key]) and comp[key] >= 0):
                    problems.append(f"compile.{key}: expected a non-negative number, got {comp[key]!r}")

    rows = obj.get("rows")
    if "rows" in obj and not isinstance(rows, list):
        problems.append("rows: expected a list")
    elif isinstance(rows, list):
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(f"rows[{i}]: expected an object")
                continue
            _check_row(row, f"rows[{i}]", problems)
    return problems


def write_results(obj: dict, path, log) -> dict:
    """Write obj to path atomically, logging (not refusing) schema problems; return obj."""
    problems = validate_results_schema(obj)
    if problems:
        log(f"schema problems (written anyway): {problems[:5]}")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
    return obj
