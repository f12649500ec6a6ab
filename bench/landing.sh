#!/usr/bin/env bash
# The landing cycle of a kernel change on a GPU machine, in three commands of under ten minutes each,
# writing everything under $OUT (default /tmp/landing):
#
#   bash bench/landing.sh tests   # every unit built at once; the sanitizer and (where .kb/src is
#                                 # carried) bench/kernelbench_eval.py started in the background
#                                 # (setsid, so they outlive this command); the GPU tests (`-m gpu`;
#                                 # pytest-xdist workers where it is installed) beside them
#   bash bench/landing.sh bench   # waits for both, copies their JSONs, then the benchmark alone
#   bash bench/landing.sh suites  # bench/uneven_backward.py and FlashAttention's test files on CUDA
#
# The second command runs on the same machine after the first (it waits for that sanitizer; $OUT
# may be emptied in between, so copy the first command's files away first). SANITIZER_FROM names a committed partial
# sanitizer JSON to resume from (bench/sanitize.py --resume: its passed tools are kept when the
# kernels, seed, cases and versions match); BENCH_ARGS replaces the benchmark's arguments
# (default --no-sweep --backward). The suites step runs bench/uneven_backward.py and, where
# .fa/test_flash_attn.py (and .fa/hopper/: FlashAttention 3's test file with its padding.py and
# test_util.py) are carried (FA_SOURCE names their repository and commit), bench/fa_suite.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/landing}
mkdir -p "$out"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/ext} PYTHONUNBUFFERED=1
# FlashAttention-4 where bench/fa4_install.sh put it (the benchmarks then time it beside the rest)
if [ -d /tmp/fa4 ]; then export PYTHONPATH=/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}; fi
san_json=/tmp/landing-sanitizer.json
san_log=/tmp/landing-sanitizer.log
kb_json=/tmp/landing-kernelbench_eval.json
kb_log=/tmp/landing-kernelbench.log

case "${1:-}" in
tests)
    nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
    python3 bench/build_units.py 2>&1 | tail -1
    python3 gqa_module.py 2>&1 | tail -1
    resume=()
    if [ -n "${SANITIZER_FROM:-}" ]; then cp "$SANITIZER_FROM" "$san_json" && resume=(--resume); fi
    setsid nohup python3 bench/sanitize.py --out "$san_json" --log-dir /tmp/landing-sanitizer-logs --timeout 420 \
        "${resume[@]}" >"$san_log" 2>&1 </dev/null &
    if [ -d .kb/src ]; then   # in the background too (setsid): the bench step waits for it
        KERNELBENCH_SRC=$PWD/.kb/src setsid nohup python3 bench/kernelbench_eval.py "$kb_json" >"$kb_log" 2>&1 </dev/null &
    fi
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-6}")
    # SIGINT at the limit, so that pytest still prints its summary (the failures' names)
    # The tests marked gpu alone (CI runs the rest, on a CPU machine): the CPU emulations took 270 s
    # a worker here beside the sanitizer
    timeout -s INT -k 20 "${PYTEST_LIMIT:-500}" python3 -m pytest -q -rfs -p no:cacheprovider --durations=30 \
        "${workers[@]}" -m gpu test_gqa.py >"$out/gpu_tests.log" 2>&1
    echo "pytest exit $?"
    grep -v -e PytestBenchmarkWarning -e 'warner(' "$out/gpu_tests.log" | tail -45
    tail -3 "$san_log"
    ;;
bench)
    for _ in $(seq 90); do pgrep -f "bench/(sanitize|kernelbench_eval).py" >/dev/null || break; sleep 5; done
    tail -8 "$san_log"
    grep -v -e "^\[Profiling\]" -e "compiling" "$kb_log" 2>/dev/null | tail -12
    cp "$san_json" "$out/sanitizer.json" 2>/dev/null || echo "no sanitizer JSON (see $san_log)"
    cp "$kb_json" "$out/kernelbench_eval.json" 2>/dev/null || echo "no KernelBench JSON (see $kb_log)"
    pgrep -f "bench/(sanitize|kernelbench_eval).py" >/dev/null && { echo "the sanitizer or KernelBench's evaluation is still running: no benchmark"; exit 1; }
    # shellcheck disable=SC2086
    timeout 420 python3 bench/bench_gqa.py ${BENCH_ARGS:---no-sweep --backward} --out "$out" >"$out/bench.log" 2>&1
    echo "bench exit $?"
    tail -40 "$out/bench.log"
    ;;
suites)
    # After the benchmark (they would disturb its timings): the fp32 backward on uneven inputs, and
    # FlashAttention's own test files on CUDA tensors where they were carried
    timeout 120 python3 bench/uneven_backward.py --out "$out/uneven_backward.json" 2>&1 | tail -3
    if [ -f .fa/test_flash_attn.py ]; then
        timeout 300 python3 bench/fa_suite.py --tests .fa/test_flash_attn.py --source "${FA_SOURCE:-}" \
            --device cuda --sample 300 --seed 53 --out "$out/fa_suite_cuda.json" 2>&1 | tail -12
    fi
    if [ -f .fa/hopper/test_flash_attn.py ]; then   # FlashAttention 3's, with its padding.py and test_util.py
        timeout 300 python3 bench/fa_suite.py --tests .fa/hopper/test_flash_attn.py --source "${FA_SOURCE:-}" \
            --device cuda --sample 300 --seed 53 --out "$out/fa_suite_hopper_cuda.json" 2>&1 | tail -12
    fi
    ;;
*)
    echo "usage: bash bench/landing.sh tests|bench|suites" >&2
    exit 2
    ;;
esac
