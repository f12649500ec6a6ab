"""Tests for gqa_module: the build, the PyTorch path and the errors on any machine; the kernel on a GPU.

Every numeric check compares against reference.causal_gqa_reference, a float64 computation.
"""

import importlib.util
import itertools
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

import gqa_module
import reference

HERE = os.path.dirname(os.path.abspath(__file__))
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def rel_err(out, exact):
    return ((out.double() - exact).norm() / exact.norm()).item()


def make_qkv(B, T, Hq, Hkv, D, device="cpu", dtype=torch.float32, seed=None):
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else random.randrange(1 << 30))
    return [torch.randn(B, T, H, D, generator=gen).to(device=device, dtype=dtype) for H in (Hq, Hkv, Hkv)]


def check_fp32(out, q, k, v, what=""):
    """allclose(1e-4, 1e-4) everywhere and a norm-relative error of at most 1e-5 against float64."""
    exact = reference.causal_gqa_reference(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = (out.double() - exact).abs()
    print("%s max abs err %.3g, mean abs err %.3g, rel %.3g" % (what, err.max().item(), err.mean().item(),
                                                              rel_err(out, exact)))
    assert torch.isfinite(out).all(), "non-finite output (unwritten elements?) %s" % what
    assert torch.allclose(out.double(), exact, atol=1e-4, rtol=1e-4), what
    assert rel_err(out, exact) <= 1e-5, what


def bad_inputs(device):
    """(name, q, k, v, words the message must contain) for every rule the entry point enforces."""
    def t(*shape, dtype=torch.float32, dev=device):
        return torch.randn(*shape).to(device=dev, dtype=dtype)

    cases = [
        ("q rank", t(2, 8, 4, 16, 1), t(2, 8, 2, 16), t(2, 8, 2, 16), ["q must be 4-D"]),
        ("q rank", t(8, 4, 16), t(2, 8, 2, 16), t(2, 8, 2, 16), ["q must be 4-D"]),
        ("k rank", t(2, 8, 4, 16), t(2, 8, 32), t(2, 8, 2, 16), ["k must be 4-D"]),
        ("v rank", t(2, 8, 4, 16), t(2, 8, 2, 16), t(1, 2, 8, 2, 16), ["v must be 4-D"]),
        ("k/v shapes", t(2, 8, 4, 16), t(2, 8, 2, 16), t(2, 8, 1, 16), ["k and v must have the same shape"]),
        ("batch", t(2, 8, 4, 16), t(3, 8, 2, 16), t(3, 8, 2, 16), ["batch size B"]),
        ("seq len", t(2, 8, 4, 16), t(2, 9, 2, 16), t(2, 9, 2, 16), ["sequence length T"]),
        ("head dim", t(2, 8, 4, 16), t(2, 8, 2, 8), t(2, 8, 2, 8), ["head_dim D"]),
        ("heads", t(2, 8, 4, 16), t(2, 8, 3, 16), t(2, 8, 3, 16), ["multiple of", "Hkv"]),
        ("no kv heads", t(2, 8, 4, 16), t(2, 8, 0, 16), t(2, 8, 0, 16), ["at least one kv head"]),
        ("mixed dtype", t(2, 8, 4, 16), t(2, 8, 2, 16, dtype=torch.float16), t(2, 8, 2, 16), ["share one dtype"]),
        ("float64", t(2, 8, 4, 16, dtype=torch.float64), t(2, 8, 2, 16, dtype=torch.float64),
         t(2, 8, 2, 16, dtype=torch.float64), ["unsupported dtype"]),
        ("int", t(2, 8, 4, 16).int(), t(2, 8, 2, 16).int(), t(2, 8, 2, 16).int(), ["unsupported dtype"]),
        ("head_dim too big", t(1, 4, 2, 257), t(1, 4, 1, 257), t(1, 4, 1, 257), ["head_dim", "1..256"]),
        ("head_dim zero", t(1, 4, 2, 0), t(1, 4, 1, 0), t(1, 4, 1, 0), ["head_dim", "1..256"]),
    ]
    if device != "cpu":
        cases.append(("devices", t(2, 8, 4, 16), t(2, 8, 2, 16, dev="cpu"), t(2, 8, 2, 16), ["same device"]))
    return cases


# ------------------------------------------------------------------------------------------------
# Any machine
def test_extension_builds_and_registers_ops():
    """The real load_inline build of kernels/ compiles and loads; no GPU is needed for that."""
    ops = gqa_module.load_extension()
    assert "causal_attention" in str(ops.causal_attention.default._schema)
    assert ops.empty_call.default is not None
    assert gqa_module.load_extension() is ops   # cached: a second call does not rebuild


def test_first_calls_from_two_threads_compile_once(tmp_path):
    """A fresh process with an empty extension cache: two threads call first, one build happens."""
    code = (
        "import threading, gqa_module\n"
        "ts = [threading.Thread(target=gqa_module.load_extension) for _ in range(2)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "assert gqa_module._OPS is not None\n"
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("compiling the CUDA kernel") == 1, run.stderr[-3000:]


def test_missing_toolkit_error_names_nvcc_and_cuda_home(monkeypatch):
    """With no toolkit anywhere, the build fails fast and tells the user what to set."""
    real_isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: False if p.endswith(("nvcc", "cuda_runtime.h")) else real_isfile(p))
    with pytest.raises(RuntimeError) as info:
        gqa_module._cuda_home()
    assert "nvcc" in str(info.value) and "CUDA_HOME" in str(info.value)


def test_arch_flags_pick_sm90a_only_when_wgmma_can_run(monkeypatch):
    """The wgmma path (GQA_SM90A) is compiled only into a build for sm_90a alone: an sm_90 GPU or
    no GPU by default, or TORCH_CUDA_ARCH_LIST exactly 9.0a. Any other list keeps mma.sync."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert gqa_module._arch_flags() == (["-DGQA_SM90A"], "90a")
    for wanted, tag in (("9.0", "90"), ("8.0;9.0a", "80_90a"), ("8.6 9.0", "86_90")):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", wanted)
        assert gqa_module._arch_flags() == ([], tag)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    flags, tag = gqa_module._arch_flags()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() == (9, 0):
        assert (flags, tag) == (["-gencode=arch=compute_90a,code=sm_90a", "-DGQA_SM90A"], "90a")
    else:
        assert "-DGQA_SM90A" not in flags and not tag.endswith("a")


CPU_GRID = [(1, 1, 1, 1, 1), (2, 2, 8, 2, 32), (1, 63, 6, 3, 40), (3, 65, 7, 1, 17), (1, 80, 8, 8, 64),
            (2, 127, 4, 2, 3), (1, 200, 32, 8, 16)]


@pytest.mark.parametrize("B,T,Hq,Hkv,D", CPU_GRID)
def test_cpu_path_matches_float64(B, T, Hq, Hkv, D):
    q, k, v = make_qkv(B, T, Hq, Hkv, D)
    out = gqa_module.causal_gqa_attention(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    print("B=%d T=%d Hq=%d Hkv=%d D=%d rel %.3g" % (B, T, Hq, Hkv, D, rel_err(out, exact)))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), exact, atol=1e-4, rtol=1e-4)
    assert rel_err(out, exact) <= 1e-5


def test_model_new_accepts_harness_arguments():
    q, k, v = reference.get_inputs()
    exact = reference.causal_gqa_reference(q, k, v)
    for model in (gqa_module.ModelNew(), gqa_module.ModelNew(*reference.get_init_inputs()),
                  gqa_module.ModelNew(num_q_heads=8, num_kv_heads=2, head_dim=32)):
        assert list(model.parameters()) == []
        assert torch.allclose(model(q, k, v).double(), exact, atol=1e-4, rtol=1e-4)


def test_reference_model_matches_float64():
    torch.manual_seed(1)
    q, k, v = reference.get_inputs()
    out = reference.Model(*reference.get_init_inputs())(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    assert torch.allclose(out.double(), exact, atol=1e-5, rtol=1e-5)


def test_reference_float64_matches_explicit_softmax():
    """The float64 reference itself, against a direct evaluation of the definition at a few points."""
    q, k, v = make_qkv(2, 9, 6, 2, 5, dtype=torch.float64, seed=3)
    exact = reference.causal_gqa_reference(q, k, v)
    for b, t, h in [(0, 0, 0), (1, 8, 5), (0, 4, 3), (1, 3, 1)]:
        kv = h // 3
        s = torch.stack([q[b, t, h] @ k[b, j, kv] for j in range(t + 1)]) / math.sqrt(5)
        w = torch.exp(s - s.max())
        expect = sum(w[j] * v[b, j, kv] for j in range(t + 1)) / w.sum()
        assert torch.allclose(exact[b, t, h], expect, atol=1e-12)


def test_reference_float64_nonfinite_values_follow_the_loops():
    """NaN and Inf reach exactly the rows that attend to them, as in reference.Model."""
    q, k, v = make_qkv(1, 12, 4, 2, 8, seed=5)
    q[0, 3, 1, 2] = float("nan")
    k[0, 7, 0, 1] = float("nan")
    v[0, 9, 1, 0] = float("inf")
    v[0, 5, 0, 4] = float("nan")
    loops = reference.Model(4, 2, 8)(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    assert torch.equal(torch.isnan(loops), torch.isnan(exact))
    assert torch.equal(torch.isinf(loops), torch.isinf(exact))
    finite = torch.isfinite(exact)
    assert torch.allclose(loops.double()[finite], exact[finite], atol=1e-5, rtol=1e-5)


N_BAD_CPU = len(bad_inputs("cpu"))


def assert_rejected(device, case):
    """Bad case `case` raises a ValueError whose message names the argument and the rule."""
    name, q, k, v, words = bad_inputs(device)[case]
    with pytest.raises(ValueError) as info:
        gqa_module.causal_gqa_attention(q, k, v)
    for word in words:
        assert word in str(info.value), (name, str(info.value))


@pytest.mark.parametrize("case", range(N_BAD_CPU))
def test_cpu_bad_inputs_raise(case):
    assert_rejected("cpu", case)


def test_cpu_empty_inputs():
    for B, T in ((0, 5), (2, 0)):
        q, k, v = make_qkv(B, T, 4, 2, 8)
        out = gqa_module.causal_gqa_attention(q, k, v)
        assert out.shape == (B, T, 4, 8)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_gqa", os.path.join(HERE, "bench", "bench_gqa.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_committed_results_match_schema_and_current_kernel():
    """bench/results/*.json follow the schema, and one of them was measured on the kernel as it is now."""
    results_dir = os.path.join(HERE, "bench", "results")
    paths = sorted(os.path.join(results_dir, f) for f in os.listdir(results_dir) if f.endswith(".json"))
    assert paths, "no committed benchmark results"
    bench = _load_bench()
    hashes = set()
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        assert bench.validate_results_schema(data) == [], path
        hashes.add(data["source_sha256"])
    assert gqa_module.kernel_source_sha256() in hashes, "kernels/ changed since the last committed GPU results"


# ------------------------------------------------------------------------------------------------
# GPU
GRID_B = (1, 3)
GRID_T = (1, 2, 63, 64, 65, 80, 127, 1000, 4097)
GRID_D = (1, 16, 32, 40, 64, 80, 128, 200, 256)
GRID_HEADS = ((1, 1), (8, 8), (8, 2), (6, 3), (32, 8), (7, 1))


def gpu_grid():
    """A fixed-seed sample of the product, plus every value of every axis at least once."""
    rng = random.Random(20261129)
    product = list(itertools.product(GRID_B, GRID_T, GRID_D, GRID_HEADS))
    cases = rng.sample(product, 64)
    for T in GRID_T:
        cases.append((1, T, 64, (8, 2)))
    for D in GRID_D:
        cases.append((3, 65, D, (6, 3)))
    for heads in GRID_HEADS:
        cases.append((1, 127, 80, heads))
    return sorted(set(cases))


def call_poisoned(q, k, v):
    """Fill the block the output will most likely reuse with NaN first, so unwritten elements show."""
    poison = torch.full(q.shape, float("nan"), device=q.device, dtype=q.dtype)
    del poison
    return gqa_module.causal_gqa_attention(q, k, v)


@needs_gpu
@pytest.mark.parametrize("B,T,D,heads", gpu_grid())
def test_gpu_grid_fp32(B, T, D, heads):
    Hq, Hkv = heads
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda")
    out = call_poisoned(q, k, v)
    check_fp32(out, q, k, v, "B=%d T=%d Hq=%d Hkv=%d D=%d" % (B, T, Hq, Hkv, D))


@needs_gpu
def test_gpu_harness_shape_matches_reference_model():
    q, k, v = [t.cuda() for t in reference.get_inputs()]
    expected = reference.Model(*reference.get_init_inputs())(q, k, v)
    out = gqa_module.ModelNew(*reference.get_init_inputs())(q, k, v)
    assert torch.allclose(out, expected, atol=1e-4, rtol=1e-4)
    assert rel_err(out, reference.causal_gqa_reference(q, k, v)) <= 1e-6


@needs_gpu
@pytest.mark.parametrize("D", [32, 64, 37])
def test_gpu_strided_views(D):
    B, T, Hq, Hkv = 2, 130, 8, 2
    # Views of one packed qkv tensor, split along heads.
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda")
    q, k, v = qkv.split([Hq, Hkv, Hkv], dim=2)
    assert not q.is_contiguous()
    check_fp32(call_poisoned(q, k, v), q, k, v, "packed qkv D=%d" % D)
    # [B, H, T, D] storage seen as [B, T, H, D].
    q, k, v = [torch.randn(B, H, T, D, device="cuda").transpose(1, 2) for H in (Hq, Hkv, Hkv)]
    check_fp32(call_poisoned(q, k, v), q, k, v, "transposed D=%d" % D)
    # A start that is not 16-byte aligned.
    base = torch.randn(B * T * Hq * D + 1, device="cuda")
    q = base[1:].view(B, T, Hq, D)
    k, v = make_qkv(B, T, Hkv, Hkv, D, device="cuda")[1:]
    check_fp32(call_poisoned(q, k, v), q, k, v, "offset D=%d" % D)
    # A last dim that is not contiguous is copied once, still correct.
    q = torch.randn(B, T, Hq, D, 2, device="cuda")[..., 0]
    check_fp32(call_poisoned(q, k, v), q, k, v, "strided last dim D=%d" % D)


@needs_gpu
def test_gpu_side_stream():
    q, k, v = make_qkv(2, 300, 8, 2, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q2, k2, v2 = q * 2, k * 1.0, v + 1
        out = gqa_module.causal_gqa_attention(q2, k2, v2)
    side.synchronize()
    check_fp32(out, q2, k2, v2, "side stream")


@needs_gpu
def test_gpu_cuda_graph_capture_and_replay():
    static = make_qkv(2, 80, 8, 2, 32, device="cuda")
    gqa_module.causal_gqa_attention(*static)   # build and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gqa_module.causal_gqa_attention(*static)
    for _ in range(3):
        fresh = make_qkv(2, 80, 8, 2, 32, device="cuda")
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_fp32(out, *fresh, "graph replay")


@needs_gpu
def test_gpu_repeated_calls_are_bitwise_equal():
    q, k, v = make_qkv(3, 1000, 32, 8, 128, device="cuda")
    first = gqa_module.causal_gqa_attention(q, k, v)
    for _ in range(9):
        assert torch.equal(gqa_module.causal_gqa_attention(q, k, v), first)


@needs_gpu
@pytest.mark.parametrize("case", range(N_BAD_CPU + 1))
def test_gpu_bad_inputs_raise_and_module_keeps_working(case):
    assert_rejected("cuda", case)
    good = make_qkv(1, 33, 4, 2, 16, device="cuda")
    check_fp32(gqa_module.causal_gqa_attention(*good), *good, "after error")


@needs_gpu
def test_gpu_requires_grad_is_refused_not_detached():
    q, k, v = make_qkv(1, 16, 4, 2, 16, device="cuda")
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="backward is not supported"):
        gqa_module.causal_gqa_attention(q, k, v)
    with torch.no_grad():
        check_fp32(gqa_module.causal_gqa_attention(q, k, v), q.detach(), k, v, "no_grad")


@needs_gpu
def test_gpu_empty_inputs():
    for B, T in ((0, 5), (2, 0)):
        q, k, v = make_qkv(B, T, 4, 2, 8, device="cuda")
        out = gqa_module.causal_gqa_attention(q, k, v)
        assert out.shape == (B, T, 4, 8) and out.is_cuda


# (B, Hq, Hkv): (1, 4, 2) by default; (24, 3, 1) gives short sequences a grid large enough for the
# row-wise kernel's four-rows-per-warp CTAs, whose warps then hold rows of two time steps.
NONFINITE_CASES = ([(torch.float32, T, D, (1, 4, 2)) for T, D in ((70, 32), (300, 128), (90, 20), (4300, 64))]
                   + [(dt, T, D, (1, 4, 2)) for dt in (torch.float16, torch.bfloat16)
                      for T, D in ((70, 32), (300, 128), (4300, 64))]
                   + [(dt, 100, 32, (24, 3, 1)) for dt in (torch.float32, torch.bfloat16)])


@needs_gpu
@pytest.mark.parametrize("dtype,T,D,b_hq_hkv", NONFINITE_CASES)
def test_gpu_nan_and_inf_propagate_like_reference(dtype, T, D, b_hq_hkv):
    """A non-finite value reaches exactly the rows that attend to it, as in reference.Model, in
    every dtype; the finite values keep the dtype's tolerance (fp32 1e-4, half 1e-2)."""
    B, Hq, Hkv = b_hq_hkv
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
    q[0, 10, 1, 3] = float("nan")
    k[0, 30, 0, 1] = float("nan")
    v[0, 20, Hkv - 1, 0] = float("nan")
    v[0, 21, 0, 1] = float("inf")
    v[0, 45, Hkv - 1, 2] = float("inf")
    v[0, T - 1, 0, 0] = float("-inf")
    out = call_poisoned(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(exact))
    assert torch.equal(torch.isinf(out), torch.isinf(exact))
    finite = torch.isfinite(exact)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert torch.allclose(out.double()[finite], exact[finite], atol=tol, rtol=tol)


@needs_gpu
def test_gpu_large_scores_stay_stable():
    """Scores in the thousands: a naive exp overflows. fp32 itself cannot resolve such scores to
    1e-4, so the bar is the error of the same formula evaluated in fp32 (expanded k/v, softmax).
    3xTF32 scores carry about 2^-22 relative error against fp32's 2^-24: over seeds 0-19 the max
    error measured 0.50x to 2.29x the fp32 formula's (median 1.46x), hence 3x there, on a fixed seed."""
    q, k, v = make_qkv(1, 500, 4, 1, 64, device="cuda", seed=0)
    q, k = q * 30, k * 30
    out = call_poisoned(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    scores = torch.einsum("bthd,bshd->bhts", q, k.expand(-1, -1, 4, -1)) / 8.0
    scores = scores.masked_fill(torch.ones(500, 500, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    fp32 = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), v.expand(-1, -1, 4, -1))
    ours_err, fp32_err = (out.double() - exact).abs().max().item(), (fp32.double() - exact).abs().max().item()
    print("large scores: max abs err ours %.3g, fp32 formula %.3g; rel ours %.3g, fp32 %.3g"
          % (ours_err, fp32_err, rel_err(out, exact), rel_err(fp32, exact)))
    assert torch.isfinite(out).all()
    assert ours_err <= 3 * fp32_err + 1e-5
    assert rel_err(out, exact) <= 2 * rel_err(fp32, exact) + 1e-6


@needs_gpu
@pytest.mark.parametrize("D", [40, 128])
@pytest.mark.parametrize("scale_q,scale_k,scale_v", [(1e12, 1e-12, 1.0), (1.0, 1.0, 1e-25), (1e-3, 1e3, 1e30)])
def test_gpu_fp32_magnitudes_outside_half_range(D, scale_q, scale_k, scale_v):
    """fp32 inputs far outside fp16's range, at a size whose grid fills the GPU (on sm_90a the
    fp32 path that splits operands into scaled fp16 pairs): fp32 accuracy, relative to V's scale."""
    q, k, v = make_qkv(2, 1100, 8, 2, D, device="cuda")
    q, k, v = q * scale_q, k * scale_k, v * scale_v
    out = call_poisoned(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    print("scales %g %g %g: rel err %.3g" % (scale_q, scale_k, scale_v, rel_err(out, exact)))
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double() / scale_v, exact / scale_v, atol=1e-4, rtol=1e-4)
    assert rel_err(out, exact) <= 1e-5


@needs_gpu
def test_gpu_fp32_nan_in_one_query_row_stays_there():
    """One NaN in q at a size whose grid fills the GPU: only that row is NaN, every other row keeps
    fp32 accuracy (on sm_90a only the CTA holding the row leaves the fast fp32 path)."""
    q, k, v = make_qkv(1, 2200, 8, 2, 128, device="cuda")
    q[0, 1500, 5, 7] = float("nan")
    out = call_poisoned(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    assert torch.equal(torch.isnan(out), torch.isnan(exact))
    assert torch.isnan(out[0, 1500, 5]).all() and torch.isfinite(out[0, :1500]).all()
    finite = torch.isfinite(exact)
    assert torch.allclose(out.double()[finite], exact[finite], atol=1e-4, rtol=1e-4)
    assert rel_err(out[0, :1500], exact[0, :1500]) <= 1e-5


@needs_gpu
def test_gpu_allow_tf32_uses_single_tf32_and_default_is_fp32_accurate():
    q, k, v = make_qkv(2, 700, 8, 2, 128, device="cuda")
    exact = reference.causal_gqa_reference(q, k, v)
    accurate = rel_err(gqa_module.causal_gqa_attention(q, k, v), exact)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    fast = rel_err(gqa_module.causal_gqa_attention(q, k, v), exact)
    torch.backends.cuda.matmul.allow_tf32 = previous
    print("rel err: 3xTF32 %.3g, TF32 %.3g" % (accurate, fast))
    assert accurate <= 1e-5
    assert fast <= 5e-3 and fast > 2 * accurate   # really the single-product path, still sane


def check_half(out, q, k, v, what=""):
    """Error against float64 at most 2x SDPA's own error in that dtype, plus 1e-3 absolute."""
    assert out.shape == q.shape and out.dtype == q.dtype
    exact = reference.causal_gqa_reference(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    ours_err = (out.double() - exact).abs().max().item()
    sdpa_err = (sdpa.double() - exact).abs().max().item()
    print("%s %s ours max err %.3g, sdpa %.3g" % (what, q.dtype, ours_err, sdpa_err))
    assert torch.isfinite(out).all()
    assert ours_err <= 2 * sdpa_err + 1e-3


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 1, 1, 1, 16), (2, 65, 8, 2, 64), (1, 1000, 32, 8, 128),
                                          (1, 127, 6, 3, 200), (3, 80, 7, 1, 40), (2, 300, 8, 2, 64),
                                          (1, 257, 6, 3, 200), (1, 150, 4, 2, 20), (2, 333, 4, 4, 40),
                                          (1, 4097, 8, 2, 128), (2, 1000, 7, 1, 256), (1, 200, 2, 1, 32),
                                          (1, 300, 4, 2, 36), (2, 200, 4, 2, 120), (1, 300, 4, 2, 45),
                                          (40, 64, 7, 1, 45), (24, 100, 3, 1, 32)])
def test_gpu_half_precision(dtype, B, T, Hq, Hkv, D):
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
    check_half(call_poisoned(q, k, v), q, k, v)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_half_strided_views(dtype, D):
    """Packed and transposed views (16-byte-aligned rows) and an unaligned start (the path for
    other rows) in 16-bit."""
    B, T, Hq, Hkv = 2, 300, 8, 2
    q, k, v = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda", dtype=dtype).split([Hq, Hkv, Hkv], dim=2)
    check_half(call_poisoned(q, k, v), q, k, v, "packed qkv")
    q, k, v = [torch.randn(B, H, T, D, device="cuda", dtype=dtype).transpose(1, 2) for H in (Hq, Hkv, Hkv)]
    check_half(call_poisoned(q, k, v), q, k, v, "transposed")
    q = torch.randn(B * T * Hq * D + 1, device="cuda", dtype=dtype)[1:].view(B, T, Hq, D)
    check_half(call_poisoned(q, k, v), q, k, v, "offset")


# ------------------------------------------------------------------------------------------------
# The single-file bundle, the compile cache under concurrency, torch.compile
BUNDLE_FORBIDDEN = [r"\btry\s*:", r"\bexcept\b", r"\bpass\b", r"\bimport\s+threading\b", r"\bfrom\s+threading\b",
                    r"\bmultiprocessing\b", r"\bconcurrent\.futures\b", r"torch\.cuda\.Stream\(",
                    r"with\s+torch\.cuda\.stream", r"\.wait_stream\(", r"\.record_stream\("]


def strip_python_comments(source):
    """Drop # comments (the CUDA text inside strings keeps its // comments, which the rules ignore)."""
    import io
    import tokenize
    kept = [tok for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type != tokenize.COMMENT]
    return tokenize.untokenize(kept)


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "gqa_bundle.py"
    run = subprocess.run([sys.executable, "gqa_module.py", "--bundle", str(path)], cwd=HERE, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return path


def test_bundle_obeys_harness_static_rules(bundle_path):
    import re
    source = bundle_path.read_text()
    code = strip_python_comments(source)
    cuda_text = "\n".join(line.split("//")[0] for line in code.splitlines())
    for pattern in BUNDLE_FORBIDDEN:
        assert not re.search(pattern, cuda_text), pattern
    assert "__global__" in source and "load_inline" in source
    # The module itself follows the same rules.
    own = strip_python_comments(open(os.path.join(HERE, "gqa_module.py")).read())
    for pattern in BUNDLE_FORBIDDEN:
        assert not re.search(pattern, own), pattern


def exec_bundle(path):
    """Load the bundle the way the harness does: exec of its source in a fresh namespace."""
    namespace = {}
    exec(compile(path.read_text(), "<bundle>", "exec"), namespace)
    return namespace


def test_bundle_reads_no_files_and_matches_on_cpu(bundle_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # nothing of the checkout is reachable by relative path
    ns = exec_bundle(bundle_path)
    assert ns["kernel_source_sha256"]() == gqa_module.kernel_source_sha256()
    q, k, v = make_qkv(2, 80, 8, 2, 32)
    out = ns["ModelNew"](8, 2, 32)(q, k, v)
    assert torch.equal(out, gqa_module.ModelNew()(q, k, v))


def first_call_processes(n, cache_dir, extra_env=None):
    code = "import gqa_module; gqa_module.load_extension(); print('ok')"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache_dir), **(extra_env or {}))
    return [subprocess.Popen([sys.executable, "-c", code], cwd=HERE, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(n)]


def test_four_processes_first_call_together(tmp_path):
    procs = first_call_processes(4, tmp_path)
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and "ok" in out, err[-2000:]
    assert sum(err.count("compiling the CUDA kernel") for _, err in outputs) == 1


def test_killed_build_does_not_block_the_next(tmp_path):
    import signal
    import time
    victim = first_call_processes(1, tmp_path)[0]
    deadline = time.time() + 120
    # Wait until the build is under way (torch's lock file exists), then kill the builder.
    while time.time() < deadline and not any(name == "lock" for _, _, names in os.walk(tmp_path) for name in names):
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    # torch's stale lock is still there; the next process must recover, not wait forever.
    assert any(name == "lock" for _, _, names in os.walk(tmp_path) for name in names)
    nxt = first_call_processes(1, tmp_path)[0]
    out, err = nxt.communicate(timeout=900)
    assert nxt.returncode == 0 and "ok" in out, err[-2000:]


@needs_gpu
def test_gpu_bundle_matches_module(bundle_path):
    ns = exec_bundle(bundle_path)
    q, k, v = make_qkv(2, 300, 8, 2, 64, device="cuda")
    assert torch.equal(ns["ModelNew"]()(q, k, v), gqa_module.ModelNew()(q, k, v))


@needs_gpu
def test_gpu_torch_compile_fullgraph_matches_eager():
    model = gqa_module.ModelNew()
    compiled = torch.compile(model, fullgraph=True)
    for T in (80, 200):
        q, k, v = make_qkv(2, T, 8, 2, 32, device="cuda")
        assert torch.equal(compiled(q, k, v), model(q, k, v))


@needs_gpu
def test_gpu_opcheck():
    op = gqa_module.load_extension().causal_attention.default
    for shape in ((2, 80, 8, 2, 32), (1, 65, 6, 3, 40)):
        q, k, v = make_qkv(*shape, device="cuda")
        torch.library.opcheck(op, (q, k, v))
