"""Same-run timings of kernel variants that differ by a compile-time constant (a WsTraits flag, a
stage count): each variant is a copy of this checkout with text replaced in kernels/, built and
timed in its own process, so every variant builds its own units (all variants' builds run at
once first, then the timings one at a time).

    python3 bench/variants.py --out variants.json [--only NAME,...] [--timeout 300] [--dtype fp16|fp32] [--backward-only]

A variant whose replacement text is not found fails before anything runs. Times are CUDA-event
timings of back-to-back calls (bf16, or with --dtype fp16/fp32 that backward alone; the best of 3
repeats), with a max-abs error against SDPA in fp32 on the small shapes, so a broken variant
shows; the backward rows time a forward and backward and subtract the forward, and give the
gradients' error against float64 on a slice of the shape (T = 333; 4097 with --dtype fp32). The
benchmark (bench_gqa.py) and the GPU tests remain the measure of a variant that lands.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WS = "kernels/ws/kernel.cuh"
FUSED = ("kernels/gqa_params.h", "kGqaFusedBackward = false;", "kGqaFusedBackward = true;")   # at every T, widths 64, 128
DQ_ADD = ("kernels/bwdwg/fused.cuh", "kDqAdd = DqAdd::kTurn;")   # the fused kernel's dQ add (FusedTraits)
SERIAL = (DQ_ADD[0], "kPipelined = true;", "kPipelined = false;")   # the fused kernel's serial step (v53-v54, v89)
SCANNED = ("kernels/gqa_params.h", "kGqaFusedScanFree = true;", "kGqaFusedScanFree = false;")   # the inputs' scan first (v95)
TWO_KERNELS = ("kernels/gqa_params.h", "kGqaFusedBackwardMinT = 8192;", "kGqaFusedBackwardMinT = 1 << 30;")
X3 = "kernels/bwdx3/bwdx3.cu"
BWD = "kernels/bwdmma/kernels.cuh"   # the two wgmma/mma.sync backward kernels: their shared traits
BWD_Q, BWD_K = "kernels/bwdmma/query_tiles.cuh", "kernels/bwdmma/key_tiles.cuh"   # kernel 1, kernel 2
BWD_CP_ASYNC = ("kernels/bwdwg/bwdwg.cu", "static constexpr bool kTma = true;", "static constexpr bool kTma = false;")
BWD_KEYS_128 = ("kernels/bwdwg/bwdwg.cu", "kKeyGroups = 1;", "kKeyGroups = DP == 256 ? 1 : 2;")
BWD_ROWS_128 = ("kernels/bwdwg/bwdwg.cu", "kRowGroups = 1;", "kRowGroups = DP == 256 ? 1 : 2;")

# name -> [(file, old text, new text)]; "base" is the checkout as it is. Timed in this order.
VARIANTS = {
    "base": [],
    "fused_backward": [FUSED],
    "two_kernel_backward": [TWO_KERNELS],
    "serial_fused_turn": [FUSED, SERIAL, SCANNED],
    "atomic_dq_add": [FUSED, SERIAL, SCANNED, (DQ_ADD[0], DQ_ADD[1], "kDqAdd = DqAdd::kRed;")],
    "writer_dq_add": [FUSED, SERIAL, SCANNED, (DQ_ADD[0], DQ_ADD[1], "kDqAdd = DqAdd::kWriter;")],
    "fused_no_turns": [FUSED, (DQ_ADD[0], "kWriterTurns = true,", "kWriterTurns = false,")],
    "fused_no_dq_adds": [FUSED, (DQ_ADD[0], "kHandOverDq = true;", "kHandOverDq = false;")],
    "writer_frees_on_read": [(DQ_ADD[0], "kFreeLate = DP == 128;", "kFreeLate = false;")],
    "writer_frees_late_at_64": [(DQ_ADD[0], "kFreeLate = DP == 128;", "kFreeLate = true;")],   # before v112
    "no_chunks_at_128": [(DQ_ADD[0], "kChunkBalance128 = 6;", "kChunkBalance128 = 1 << 20;")],
    "chunks_at_128_always": [(DQ_ADD[0], "kChunkBalance128 = 6;", "kChunkBalance128 = 0;")],
    "dk_before_dq": [(DQ_ADD[0], "kDqFirst = true;", "kDqFirst = false;")],
    "dq_first_at_128_only": [(DQ_ADD[0], "kDqFirst = true;", "kDqFirst = DP == 128;")],
    "first_stores": [(DQ_ADD[0], "kFirstStores = false;", "kFirstStores = true;")],
    "stats_by_dq_kernel": [(DQ_ADD[0], "kRowStats = true;", "kRowStats = false;")],
    "dq_store_kernel": [(DQ_ADD[0], "kLastWrites = kPipelined;", "kLastWrites = false;")],
    "inputs_scan": [SCANNED],
    "rowwise_backward_at_256": [("kernels/attention.cu", "kWgAt256 = true;", "kWgAt256 = false;")],
    "not_persistent": [(WS, "kPersistent = true;", "kPersistent = false;")],
    "round_robin_walk": [(WS, "((k & 1) ? G - 1 - c : c)", "c")],
    "two_consumers_at_64": [("kernels/gqa_params.h", "{ return width == 64 ? 3 : 2; }", "{ return 2; }")],
    "three_consumers_at_64_no_overlap": [(WS, "kOverlap = DP <= 128;", "kOverlap = DP == 128;")],
    "overlap_at_256": [(WS, "kOverlap = DP <= 128;", "kOverlap = true;")],
    "two_stages_at_128": [(WS, "kStages = DP == 64 ? 4 : DP == 128 ? 3 : 2;", "kStages = DP == 64 ? 4 : 2;")],
    "no_turns": [(WS, "kTurnsUpToRounds = 1;", "kTurnsUpToRounds = 0;")],
    "producer_sleeps": [(WS, "kProducerSleepNs = 0, kScanSleepNs = 0;", "kProducerSleepNs = 1000, kScanSleepNs = 0;")],
    "producer_and_scan_sleep": [(WS, "kProducerSleepNs = 0, kScanSleepNs = 0;", "kProducerSleepNs = 1000, kScanSleepNs = 1000;")],
    "fma_exp_quarter_at_64": [(WS, "kFmaExpTiles = 0;", "kFmaExpTiles = DP == 64 ? 4 : 0;")],
    "fma_exp_eighth_at_64": [(WS, "kFmaExpTiles = 0;", "kFmaExpTiles = DP == 64 ? 2 : 0;")],
    "rescale_slack_8": [(WS, "kRescaleSlack = 0;", "kRescaleSlack = 8;")],
    "ws_wg_from_tid": [(WS, "wg = __shfl_sync(0xffffffffu, ct / 128, 0);", "wg = ct / 128;")],
    "turns_always": [(WS, "kTurnsUpToRounds = 1;", "kTurnsUpToRounds = 1 << 30;")],
    "narrow_stores": [(WS, "kWideStores = true;", "kWideStores = false;")],
    "chain_sums": [(WS, "kTreeSums = true;", "kTreeSums = false;")],
    "unrolled_nonfinite": [(WS, "kCompactNonfinite = true;", "kCompactNonfinite = false;")],
    "bwd_cp_async": [BWD_CP_ASYNC],
    "bwd_keys_128": [BWD_KEYS_128],
    "bwd_rows_128": [BWD_ROWS_128],
    "bwd_keys_and_rows_128": [BWD_KEYS_128, BWD_ROWS_128],
    "bwd_keys_128_cp_async": [BWD_KEYS_128, BWD_CP_ASYNC],
    "bwd_late_issue": [(BWD, "kBwdEarlyIssue = true;", "kBwdEarlyIssue = false;")],
    "x3_flush_8": [(X3, "kFlushSteps = 4, kDqFlushSteps = 2;", "kFlushSteps = 8, kDqFlushSteps = 8;")],
    "x3_no_flush": [(X3, "kFlushSteps = 4, kDqFlushSteps = 2;", "kFlushSteps = 0, kDqFlushSteps = 0;")],
    "x3_early_issue": [(X3, "kEarlyIssue = false;", "kEarlyIssue = true;")],
    "x3_no_delta_fix": [(X3, "kDeltaFix = true;", "kDeltaFix = false;")],
    "x3_pk_flush_2": [(X3, "kPkFlushSteps = 8;", "kPkFlushSteps = 2;")],
    "bwd_fence_every_step": [(BWD, "kBwdFenceEveryStep = false;", "kBwdFenceEveryStep = true;")],
    "bwd_stats_scalar": [(BWD, "kPairedStats = true;", "kPairedStats = false;")],
    "bwd_group_from_tid": [(BWD_Q, "wg = RG == 1 ? 0 : int(threadIdx.x)", "wg = int(threadIdx.x)"),
                           (BWD_K, "wg = KG == 1 ? 0 : int(threadIdx.x)", "wg = int(threadIdx.x)")],
    "bwd_stats_from_shared": [(BWD, "kBwdStatsInRegs = true;", "kBwdStatsInRegs = false;")],
    "no_l2_sections": [(WS, "kL2SectionBytes = int64_t(24) << 20;", "kL2SectionBytes = 0;")],
    "l2_sections_12mb": [(WS, "kL2SectionBytes = int64_t(24) << 20;", "kL2SectionBytes = int64_t(12) << 20;")],
    "l2_sections_40mb": [(WS, "kL2SectionBytes = int64_t(24) << 20;", "kL2SectionBytes = int64_t(40) << 20;")],
    "l2_sections_always": [(WS, "pairs * pair_bytes > 2 * Tr::kL2SectionBytes;", "true;")],
}
BACKWARD_SHAPES = [(4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64), (1, 16384, 32, 8, 128),
                   (1, 32768, 32, 8, 128), (1, 2048, 16, 4, 256)]
# --dtype fp32: the fp32 backward alone, at the shapes of its bar, its error on a long slice.
FP32_BACKWARD_SHAPES = [(4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64)]

SHAPES = [(1, 1000, 6, 2, 64), (1, 1024, 8, 2, 128), (1, 777, 4, 1, 256),
          (4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64),
          (1, 32768, 32, 8, 128), (2, 4096, 16, 4, 256)]

TIMER = r"""
import json, sys, torch
import gqa_module as g
torch.manual_seed(0)
out = []
def best_ms(fn, calls=30):
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return min(times)
dtype, slice_t = getattr(torch, sys.argv[3]), int(sys.argv[4])
for B, T, Hq, Hkv, D in json.loads(sys.argv[2]):
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=dtype).requires_grad_(True) for H in (Hq, Hkv, Hkv))
    grad = torch.randn_like(q)
    def both():
        torch.autograd.grad(g.causal_gqa_attention(q, k, v), (q, k, v), grad)
    with torch.no_grad():
        fwd = best_ms(lambda: g.causal_gqa_attention(q, k, v), 10)
    ms = best_ms(both, 10) - fwd
    # The gradients of a ragged slice of the shape against float64 autograd of SDPA on expanded k, v
    # (the largest norm-relative error of dq, dk, dv), so a broken backward variant shows.
    # (T = 333 in 16-bit; 4097 in fp32, where the sums' length matters.)
    G, hk = Hq // Hkv, min(Hkv, 2)
    small = [x.detach()[:1, :slice_t, :heads].contiguous() for x, heads in ((q, hk * G), (k, hk), (v, hk))]
    leaves = [x.clone().requires_grad_(True) for x in small]
    exact = [x.double().requires_grad_(True) for x in small]
    gs = torch.randn_like(small[0])
    got = torch.autograd.grad(g.causal_gqa_attention(*leaves), leaves, gs)
    ref_out = torch.nn.functional.scaled_dot_product_attention(
        exact[0].transpose(1, 2), exact[1].repeat_interleave(G, 2).transpose(1, 2),
        exact[2].repeat_interleave(G, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    ref = torch.autograd.grad(ref_out, exact, gs.double())
    bwd_err = max(((a.double() - r).norm() / r.norm()).item() for a, r in zip(got, ref))
    out.append({"shape": [B, T, Hq, Hkv, D], "plan": g.backward_plan(q, k, v), "backward_ms": ms,
                "tflops": 2.5 * 4 * B * Hq * T * T * D / 2 / (ms * 1e-3) / 1e12, "grad_rel_err": bwd_err})
    print(json.dumps(out[-1]), flush=True)
for B, T, Hq, Hkv, D in json.loads(sys.argv[1]):
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    o = g.causal_gqa_attention(q, k, v)
    err = None
    if B * T * Hq <= 32768:
        G = Hq // Hkv
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(1, 2), k.float().repeat_interleave(G, 2).transpose(1, 2),
            v.float().repeat_interleave(G, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
        err = (o.float() - ref).abs().max().item()
    ms = best_ms(lambda: g.causal_gqa_attention(q, k, v))
    out.append({"shape": [B, T, Hq, Hkv, D], "plan": g.plan(q, k, v), "ms": ms,
                "tflops": 4 * B * Hq * T * T * D / 2 / (ms * 1e-3) / 1e12, "max_abs_err": err})
    print(json.dumps(out[-1]), flush=True)
print("RESULT " + json.dumps(out))
"""


# One call of every timed shape, forward and backward, so that a copy builds every unit it times;
# the copies run this at once (each its own units, on the machine's cores) before any timing.
WARM = r"""
import json, sys, torch
import gqa_module as g
for B, T, Hq, Hkv, D in json.loads(sys.argv[1]):
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g.causal_gqa_attention(q, k, v)
for B, T, Hq, Hkv, D in json.loads(sys.argv[2]):
    q, k, v = (torch.randn(1, 256, H, D, device="cuda", dtype=getattr(torch, sys.argv[3])).requires_grad_(True) for H in (Hq, Hkv, Hkv))
    torch.autograd.grad(g.causal_gqa_attention(q, k, v), (q, k, v), torch.randn_like(q))
torch.cuda.synchronize()
"""


def make_copy(name, edits, root):
    """A copy of the checkout (no .git, no results) with the variant's replacements applied."""
    dst = os.path.join(root, name)
    shutil.copytree(HERE, dst, ignore=shutil.ignore_patterns(".git", "results", "__pycache__", ".kb"))
    for path, old, new in edits:
        full = os.path.join(dst, path)
        with open(full) as fh:
            text = fh.read()
        if text.count(old) != 1:
            raise SystemExit("variant %s: %r found %d times in %s (want once)" % (name, old, text.count(old), path))
        with open(full, "w") as fh:
            fh.write(text.replace(old, new))
    return dst


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="fp16: the fp16 backward rows alone; fp32: the fp32 backward alone (FP32_BACKWARD_SHAPES); "
                             "both without forward rows")
    parser.add_argument("--backward-only", action="store_true", help="bf16: the backward rows alone, no forward rows")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds for the builds (all variants at once), then for each variant's timing")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit("unknown variants: %s (known: %s)" % (unknown, list(VARIANTS)))
    root = tempfile.mkdtemp(prefix="gqa-variants-")
    copies = {name: make_copy(name, VARIANTS[name], root) for name in names}   # every edit checked first
    results = {}
    shapes, bwd_shapes, dtype, slice_t = {"bf16": (SHAPES, BACKWARD_SHAPES, "bfloat16", "333"),
                                          "fp16": ([], BACKWARD_SHAPES, "float16", "333"),
                                          "fp32": ([], FP32_BACKWARD_SHAPES, "float32", "4097")}[args.dtype]
    if args.backward_only:
        shapes = []
    warm = {name: subprocess.Popen([sys.executable, "-c", WARM, json.dumps(shapes), json.dumps(bwd_shapes), dtype],
                                   cwd=copies[name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name in names}
    for name, proc in warm.items():
        try:
            output = proc.communicate(timeout=args.timeout)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = "timed out after %d s: %s" % (args.timeout, proc.communicate()[0])
        if proc.returncode != 0:
            results[name] = {"error": "build or first call: exit %d: %s" % (proc.returncode, output[-3000:])}
    print("built: %s" % sorted(set(names) - set(results)), flush=True)
    for name in [n for n in names if n not in results]:
        print("== %s" % name, flush=True)
        try:
            run = subprocess.run([sys.executable, "-c", TIMER, json.dumps(shapes), json.dumps(bwd_shapes), dtype, slice_t],
                                 cwd=copies[name],
                                 capture_output=True, text=True, timeout=args.timeout)
            lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
            results[name] = json.loads(lines[-1][7:]) if run.returncode == 0 and lines else {
                "error": "exit %d: %s" % (run.returncode, (run.stdout + run.stderr)[-3000:])}
        except subprocess.TimeoutExpired as exc:
            results[name] = {"error": "timed out after %d s: %s" % (args.timeout, str(exc.stdout)[-2000:])}
        print(json.dumps(results[name])[:2000], flush=True)
        write(args.out, names, results)   # after every variant, so a run cut short keeps what it timed
    write(args.out, names, results)
    shutil.rmtree(root, ignore_errors=True)


def write(path, names, results):
    with open(path, "w") as fh:
        json.dump({"variants": {n: VARIANTS[n] for n in names}, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
