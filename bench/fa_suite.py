#!/usr/bin/env python3
"""FlashAttention's own test file against this library, through a stand-in flash_attn package.

    python bench/fa_suite.py --tests PATH/tests/test_flash_attn.py [--source REPO@COMMIT]
                             [--device cpu|cuda] [--sample N] [--seed S] [--out F.json] [-k EXPR]

bench/fa_shim/flash_attn maps FlashAttention 2's functions onto gqa_module's attention,
attention_varlen and attention_with_kvcache, and bench/fa_shim/flash_attn_interface.py FlashAttention
3's (hopper/test_flash_attn.py, with the padding.py and test_util.py beside it); what the
library does not compute (dropout, paged keys in a packed call, qv over a KV cache) skips with
"unsupported: <feature>". The test file runs as it is but for
one change with --device cpu: its "cuda" device strings become "cpu", and torch.cuda's device
queries answer as an 80 GB sm_90 GPU would (its skips for small GPUs and old architectures then
take the H100/H200's branch). A sample of N of its parametrised cases (a fixed seed) runs, with
FlashAttention's own tolerances. The report: cases collected and sampled, FlashAttention's own
skips, the library's unsupported features (counted by the first one a case meets), the served
cases (run to a verdict) and how many passed, and each failure's case and message.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import gqa_module  # noqa: E402

# The pytest plugin of the run (conftest.py beside the copied test file).
CONFTEST = r'''
import json, os, random, types
import pytest, torch

DEVICE, SAMPLE, SEED, OUT = (os.environ["FA_SUITE_" + n] for n in ("DEVICE", "SAMPLE", "SEED", "OUT"))
if DEVICE == "cpu":   # torch.cuda's device queries, as an 80 GB sm_90 GPU would answer them
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        total_memory=80 * 2 ** 30, name="cpu stand-in", major=9, minor=0, multi_processor_count=132)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
RESULTS = {"cases": {}, "collected": 0}
# What a CPU machine cannot run: counted apart ("cpu run: ..."), neither served nor unsupported
CPU_CANNOT = {"test_flash_attn_race_condition": "allocates 70 GB of device memory"}


def pytest_runtest_setup(item):
    if DEVICE == "cpu" and item.originalname in CPU_CANNOT:
        pytest.skip("cpu run: " + CPU_CANNOT[item.originalname])


@pytest.hookimpl(trylast=True)   # after -k has deselected
def pytest_collection_modifyitems(session, config, items):
    RESULTS["collected"] = len(items)
    keep = set(random.Random(int(SEED)).sample(range(len(items)), min(int(SAMPLE), len(items))))
    config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i not in keep])
    items[:] = [item for i, item in enumerate(items) if i in keep]
    RESULTS["params"] = {item.nodeid: {k: repr(v) for k, v in getattr(item, "callspec", types.SimpleNamespace(params={})).params.items()}
                         for item in items}


def pytest_runtest_logreport(report):
    case = RESULTS["cases"].setdefault(report.nodeid, {"outcome": "passed"})
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        case.update(outcome="skipped", reason=reason.replace("Skipped: ", "", 1))
    elif report.failed:
        case.update(outcome="failed", when=report.when, message=report.longreprtext.strip().splitlines()[-1][:300])


def pytest_sessionfinish(session, exitstatus):
    with open(OUT, "w") as fh:
        json.dump(RESULTS, fh)
'''


def summarise(raw, tests, source, device, sample, seed, seconds):
    """The report of a run: counts, unsupported features, failures."""
    cases = raw["cases"]
    unsupported, own_skips, cpu_cannot, failures = {}, {}, {}, []
    for nodeid, case in sorted(cases.items()):
        if case["outcome"] == "skipped":
            reason = case.get("reason", "")
            if reason.startswith("unsupported: "):
                feature = reason[len("unsupported: "):]
                unsupported[feature] = unsupported.get(feature, 0) + 1
            elif reason.startswith("cpu run: "):
                cpu_cannot[reason] = cpu_cannot.get(reason, 0) + 1
            else:
                own_skips[reason or "(no reason)"] = own_skips.get(reason or "(no reason)", 0) + 1
        elif case["outcome"] == "failed":
            failures.append({"case": nodeid, "params": raw.get("params", {}).get(nodeid), "when": case.get("when"),
                             "message": case.get("message")})
    passed = sum(case["outcome"] == "passed" for case in cases.values())
    applicable = len(cases) - sum(own_skips.values()) - sum(cpu_cannot.values())
    served = passed + len(failures)
    return {"tests": tests, "source": source, "device": device, "sample": sample, "seed": seed, "seconds": round(seconds, 1),
            "kernel_source_sha256": gqa_module.kernel_source_sha256(), "collected": raw["collected"],
            "sampled": len(cases), "flash_attention_skips": own_skips, "not_run_on_this_machine": cpu_cannot,
            "applicable": applicable,
            "unsupported": dict(sorted(unsupported.items(), key=lambda kv: -kv[1])), "served": served,
            "served_fraction": served / applicable if applicable else 0.0, "passed": passed,
            "failed": len(failures), "failures": failures}


def test_helpers(tests, text):
    """The modules beside the test file that it imports (hopper/'s padding.py and test_util.py),
    not the stand-ins' names (flash_attn, flash_attn_interface), which bench/fa_shim provides."""
    here = os.path.dirname(os.path.abspath(tests))
    names = set(re.findall(r"^\s*from (\w+) import", text, re.M)) | set(re.findall(r"^\s*import (\w+)", text, re.M))
    names -= {"flash_attn", "flash_attn_interface"}
    return sorted(os.path.join(here, name + ".py") for name in names if os.path.isfile(os.path.join(here, name + ".py")))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="FlashAttention's tests/test_flash_attn.py")
    parser.add_argument("--source", default="", help="where the test file comes from (repository and commit), for the report")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--sample", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("-k", dest="keyword", help="pytest's -k, applied before the sample")
    args = parser.parse_args(argv)
    with open(args.tests) as fh:
        text = fh.read()
    if args.device == "cpu":
        text = text.replace('"cuda"', '"cpu"')
    work = tempfile.mkdtemp(prefix="fa_suite_")
    try:
        with open(os.path.join(work, "test_flash_attn.py"), "w") as fh:
            fh.write(text)
        for helper in test_helpers(args.tests, text):   # hopper/'s padding.py and test_util.py
            with open(helper) as fh:
                helper_text = fh.read()
            with open(os.path.join(work, os.path.basename(helper)), "w") as fh:
                fh.write(helper_text.replace('"cuda"', '"cpu"') if args.device == "cpu" else helper_text)
        with open(os.path.join(work, "conftest.py"), "w") as fh:
            fh.write(CONFTEST)
        raw_path = os.path.join(work, "raw.json")
        env = dict(os.environ, FA_SUITE_DEVICE=args.device, FA_SUITE_SAMPLE=str(args.sample),
                   FA_SUITE_SEED=str(args.seed), FA_SUITE_OUT=raw_path,
                   PYTHONPATH=os.pathsep.join([os.path.join(HERE, "fa_shim"), ROOT, os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-rN",
                   "--rootdir", work, os.path.join(work, "test_flash_attn.py")]
        if args.keyword:
            command += ["-k", args.keyword]
        started = time.perf_counter()
        run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        if not os.path.exists(raw_path):
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            return 2
        with open(raw_path) as fh:
            raw = json.load(fh)
        report = summarise(raw, os.path.basename(args.tests), args.source, args.device, args.sample, args.seed,
                           time.perf_counter() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("%(collected)d cases, %(sampled)d sampled, %(applicable)d applicable (FlashAttention's own skips "
          "aside): %(served)d served (%(served_fraction).1f%%), %(passed)d passed, %(failed)d failed"
          % dict(report, served_fraction=100 * report["served_fraction"]))
    for reason, count in report["not_run_on_this_machine"].items():
        print("  not run here (%s) %d" % (reason, count))
    for feature, count in report["unsupported"].items():
        print("  unsupported %-40s %d" % (feature, count))
    for failure in report["failures"][:20]:
        print("  FAILED %s: %s" % (failure["case"], failure["message"]))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
