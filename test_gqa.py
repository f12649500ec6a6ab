"""Tests for gqa_module: the build, the PyTorch path and the errors on any machine; the kernel on a GPU.

Every numeric check compares against reference.causal_gqa_reference, a float64 computation.
"""

import contextlib
import importlib.util
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import types
import zlib

import pytest
import torch

import gqa_module
import reference

HERE = os.path.dirname(os.path.abspath(__file__))
_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none")


def needs_gpu(test):
    """A test that needs a CUDA GPU: skipped without one, and marked `gpu`, so that a GPU machine can
    run these alone (`pytest -m gpu`: bench/landing.sh) while CI runs the rest."""
    return pytest.mark.gpu(_NO_GPU(test))


needs_cuda_torch = pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch to build the CUDA "
                                      "library (this torch, %s, is CPU-only)" % torch.__version__)


def rel_err(out, exact):
    return ((out.double() - exact).norm() / exact.norm()).item()


# Every random draw replays: each test starts from global RNGs seeded from its own name (printed),
# and make_qkv derives a printed seed from the test's name and its call count when none is given.
_SEED_STATE = {"test": "", "make_qkv_calls": 0}


def seed_of(*parts):
    """A seed in 0..2**30-1 from `parts` (crc32 of their repr: the same in every process)."""
    return zlib.crc32(repr(parts).encode()) & ((1 << 30) - 1)


@pytest.fixture(autouse=True)
def seeded_rngs(request):
    """torch's and random's global generators (CPU and every GPU) seeded from the test's name, so
    the draws a test makes without make_qkv (torch.randn, reference.get_inputs) replay too."""
    _SEED_STATE["test"], _SEED_STATE["make_qkv_calls"] = request.node.name, 0
    seed = seed_of("test", request.node.name)
    torch.manual_seed(seed)
    random.seed(seed)
    print("%s: global seed %d (torch.manual_seed, random.seed)" % (request.node.name, seed))


def make_qkv(B, T, Hq, Hkv, D, device="cpu", dtype=torch.float32, seed=None):
    """Standard normal q, k, v drawn on the CPU (the same values on any device) from `seed`, or, when
    it is None, from a seed derived from the running test's name and how many times that test has
    called make_qkv. The seed is printed, so a failure replays with make_qkv(..., seed=SEED)."""
    if seed is None:
        _SEED_STATE["make_qkv_calls"] += 1
        seed = seed_of("make_qkv", _SEED_STATE["test"], _SEED_STATE["make_qkv_calls"])
    print("make_qkv(%d, %d, %d, %d, %d, dtype=%s, seed=%d)" % (B, T, Hq, Hkv, D, dtype, seed))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
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
        ("int", t(2, 8, 4, 16).int(), t(2, 8, 2, 16).int(), t(2, 8, 2, 16).int(), ["unsupported dtype"]),
        ("head_dim too big", t(1, 4, 2, 257), t(1, 4, 1, 257), t(1, 4, 1, 257), ["head_dim", "1..256"]),
        ("head_dim zero", t(1, 4, 2, 0), t(1, 4, 1, 0), t(1, 4, 1, 0), ["head_dim", "1..256"]),
    ]
    if device != "cpu":
        cases.append(("devices", t(2, 8, 4, 16), t(2, 8, 2, 16, dev="cpu"), t(2, 8, 2, 16), ["same device"]))
        cases.append(("float64", t(2, 8, 4, 16, dtype=torch.float64), t(2, 8, 2, 16, dtype=torch.float64),
                      t(2, 8, 2, 16, dtype=torch.float64), ["unsupported dtype", "float64 runs on the CPU only"]))
    return cases


# ------------------------------------------------------------------------------------------------
# Any machine
@needs_cuda_torch
def test_extension_builds_and_registers_ops():
    """The real load_inline build of kernels/ compiles and loads; no GPU is needed for that. Every op
    has its schema and its CUDA kernel registered, and the plan dispatch runs on the CPU."""
    ops = gqa_module.load_extension()
    schemas = {
        "causal_attention": "gqa_attn::causal_attention(Tensor q, Tensor k, Tensor v) -> Tensor",
        "empty_call": "gqa_attn::empty_call(Tensor q, Tensor k, Tensor v) -> Tensor",
        "read_floor": "gqa_attn::read_floor(Tensor q, Tensor k, Tensor v) -> Tensor",
        "plan": "gqa_attn::plan(Tensor q, Tensor k, Tensor v) -> str",
        "plan_for": "gqa_attn::plan_for(int B, int T, int Hq, int Hkv, int D, ScalarType dtype, bool aligned, "
                    "bool allow_tf32, int sm_count, int cc_major) -> str",
        "all_plans": "gqa_attn::all_plans() -> str[]",
        "_set_module_loader": "gqa_attn::_set_module_loader(int address) -> ()",
        "_load_every_plan": "gqa_attn::_load_every_plan() -> int",
    }
    for name, schema in schemas.items():
        assert str(getattr(ops, name).default._schema) == schema
    for name in ("causal_attention", "empty_call", "read_floor", "plan"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("gqa_attn::" + name, "CUDA"), name
    assert torch._C._dispatch_has_kernel_for_dispatch_key("gqa_attn::causal_attention", "Autograd")
    # The dispatch itself, with no GPU: every name is well formed and unique, and every answer of
    # plan_for over a sweep of shapes is one of them, in the dtype asked for.
    plans = gqa_module.all_plans()
    assert plans and len(set(plans)) == len(plans), plans
    for name in plans:
        assert re.fullmatch(r"(rowwise/(fp32|fp16|bf16)/(8x1|8x1-planned|4x4)"
                            r"|(short|tiled|wgmma|x3)/(fp32|fp16|bf16)/d(32|64|128|256)(-split8|-rows128)?)", name), name
    for dtype, tag in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        for B, T, Hq, Hkv, D, aligned in itertools.product((1, 16), (1, 128, 129, 2000), (8,), (2, 8), (4, 32, 64, 96, 256),
                                                          (True, False)):
            name = gqa_module.plan_for(B, T, Hq, Hkv, D, dtype, aligned)
            assert name in plans and name.split("/")[1] == tag, (B, T, Hq, Hkv, D, dtype, aligned, name)
    with pytest.raises(ValueError, match="multiple of"):
        gqa_module.plan_for(1, 8, 3, 2, 16)
    assert gqa_module.load_extension() is ops   # cached: a second call does not rebuild


@needs_cuda_torch
def test_every_kernel_unit_builds_and_loads():
    """Every plan's kernels and every backward tensor-core unit (built one unit at a time by first
    calls) compile, load and export their entry point: the count without a launcher is 0."""
    assert gqa_module.load_extension()._load_every_plan.default() == 0


@needs_cuda_torch
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
    assert run.stderr.count("compiling the entry library") == 1, run.stderr[-3000:]


def test_missing_toolkit_error_names_nvcc_and_cuda_home(monkeypatch):
    """With no toolkit anywhere, the build fails fast and tells the user what to set."""
    real_isfile = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: False if p.endswith(("nvcc", "cuda_runtime.h")) else real_isfile(p))
    with pytest.raises(RuntimeError) as info:
        gqa_module._cuda_home()
    assert "nvcc" in str(info.value) and "CUDA_HOME" in str(info.value)


@pytest.mark.gpu   # it checks more where a GPU is present
def test_targets_follow_torch_cuda_arch_list(monkeypatch, capsys):
    """Unset: the GPU present (sm_90 -> sm_90a), or sm_90a with no GPU. Set: the list's targets as
    torch builds them (family names expanded), plus the sm_90a libraries where the list gives an
    sm_90 GPU (or, with none, any) 9.0 code; an sm_90 GPU left to PTX is told so once."""
    gpu = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    flags, sm90a, tag = gqa_module._targets()
    if gpu in (None, (9, 0)):
        assert (flags, sm90a, tag) == (["-gencode=arch=compute_90a,code=sm_90a"], True, "90a")
    else:
        assert not sm90a and not tag.endswith("a")
    on_90 = gpu in (None, (9, 0))
    for wanted, expect_flags, expect_sm90a in (
            ("Hopper", ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"], on_90),
            ("9.0", ["-gencode=arch=compute_90,code=sm_90"], on_90),
            ("9.0;9.0a", ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90a,code=sm_90a"], on_90),
            ("8.0 8.6+PTX", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
                             "-gencode=arch=compute_86,code=compute_86"], False),
            ("Ada", ["-gencode=arch=compute_89,code=sm_89", "-gencode=arch=compute_89,code=compute_89"], False)):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", wanted)
        flags, sm90a, tag = gqa_module._targets()
        assert (flags, sm90a) == (expect_flags, expect_sm90a), wanted
        assert ("90a" in tag) == sm90a and "/" not in tag and "+" not in tag and ";" not in tag, tag
    said = capsys.readouterr().err
    if gpu == (9, 0):   # the two lists without 9.0 leave this GPU to PTX: one line each, once
        assert said.count("wgmma paths") == 2 and "'Ada'" in said, said
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Ada")
        gqa_module._targets()
        assert "wgmma paths" not in capsys.readouterr().err
    else:
        assert "wgmma paths" not in said, said
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopperr")
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        gqa_module._targets()



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


_COLD_COMPILE = r"""
import torch, gqa_module
torch.manual_seed(3)
q, k, v = (torch.randn(2, 65, h, 32, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
model = gqa_module.ModelNew()
out = torch.compile(model, fullgraph=True, backend="eager")(q, k, v)
grads = torch.autograd.grad(out.sum(), (q, k, v))
exact = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         is_causal=True, enable_gqa=True).transpose(1, 2)
assert torch.allclose(out, exact, atol=1e-12), (out - exact).abs().max()
exact_grads = torch.autograd.grad(exact.sum(), (q, k, v))
assert all(torch.allclose(g, e, atol=1e-12) for g, e in zip(grads, exact_grads))
print("cold fullgraph ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile ModelNew on CUDA tensors")
def test_model_new_compiles_fullgraph_in_a_fresh_process_without_a_gpu():
    """torch.compile(fullgraph=True) of a ModelNew made in a process that has called nothing yet:
    the CPU path's library loads when the model is made, so the trace finds the op, not a build
    (the trace failed on the build's file reads); float64 forward and gradients against SDPA."""
    run = subprocess.run([sys.executable, "-c", _COLD_COMPILE], cwd=HERE, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "cold fullgraph ok" in run.stdout, run.stderr[-3000:]


def test_reference_model_matches_float64():
    torch.manual_seed(1)
    q, k, v = reference.get_inputs()
    out = reference.Model(*reference.get_init_inputs())(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    assert torch.allclose(out.double(), exact, atol=1e-5, rtol=1e-5)


# The autograd wiring, on the CPU: the library's CUDA kernels stand in for PyTorch ones here
# (registered for the CPU in a child process only), so what runs is the op's C++ Autograd kernel,
# causal_attention_trainable's registered formula and the backward op's schema and fake.
AUTOGRAD_WIRING = r"""
import torch
import gqa_module as g
ops = g.load_extension()
lib = torch.library.Library("gqa_attn", "IMPL")

def forward(q, k, v):
    return g._attention_torch(q, k, v)

def forward_trainable(q, k, v):   # the rows' log-sum-exp left as "not kept" (NaN)
    return g._attention_torch(q, k, v), torch.full(q.shape[:3], float("nan"))

def backward(q, k, v, out, grad_out, lse2):
    assert lse2.shape == q.shape[:3] and lse2.dtype == torch.float32
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():   # contiguous, as the CUDA op's (and its fake's) gradients are
        return tuple(x.contiguous() for x in torch.autograd.grad(g._attention_torch(*leaves), leaves, grad_out))

lib.impl("causal_attention", forward, "CPU")
lib.impl("causal_attention_trainable", forward_trainable, "CPU")
lib.impl("causal_attention_backward", backward, "CPU")
q, k, v = (torch.randn(2, 20, H, 8, requires_grad=True) for H in (4, 2, 2))
grad = torch.randn(2, 20, 4, 8)
out = ops.causal_attention(q, k, v)
print("grad_fn", type(out.grad_fn).__name__)
out.backward(grad)
leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
exp = torch.autograd.grad(g._attention_torch(*leaves), leaves, grad)
print("grads equal", all(torch.equal(a.grad, b) for a, b in zip((q, k, v), exp)))
with torch.no_grad():
    print("no_grad grad_fn", ops.causal_attention(q, k, v).grad_fn)
torch.library.opcheck(ops.causal_attention.default, (q, k, v))
print("opcheck ok")
compiled = torch.compile(lambda a, b, c: ops.causal_attention(a, b, c) * 2, fullgraph=True)
leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
o = compiled(*leaves); o.backward(grad)
ref_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
(ops.causal_attention(*ref_leaves) * 2).backward(grad)
print("compile equal", torch.allclose(o, ops.causal_attention(q, k, v).detach() * 2),
      all(torch.allclose(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)))
leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
first = torch.autograd.grad((ops.causal_attention(*leaves) * grad).sum(), leaves, create_graph=True)
print("create_graph equal", all(torch.equal(a, b.grad) for a, b in zip(first, (q, k, v))),
      all(g.requires_grad for g in first))
try:
    sum(g.pow(2).sum() for g in first).backward()
    print("double backward ran")
except RuntimeError as error:
    print("double backward refused", "double backward is not supported" in str(error))
"""


@needs_cuda_torch
def test_autograd_wiring_with_cpu_stand_ins(tmp_path):
    """Inputs that require grad get a node whose backward runs causal_attention_backward; no_grad
    gets none; opcheck (autograd registration, fake, AOT dispatch) and torch.compile(fullgraph) of
    a forward and backward agree with eager; gradients taken with create_graph=True have the same
    values, and a second-order gradient through them raises instead of returning a number.
    Inductor gets an empty cache: its cached graphs are keyed by op name, not schema, so graphs of
    an earlier schema would be reused."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    run = subprocess.run([sys.executable, "-c", AUTOGRAD_WIRING], cwd=HERE, capture_output=True, text=True,
                         timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines == ["grad_fn GeneratedBackwardFor_gqa_attn_causal_attention_trainable_defaultBackward",
                     "grads equal True", "no_grad grad_fn None", "opcheck ok", "compile equal True True",
                     "create_graph equal True True", "double backward refused True"], lines


def test_reference_gradients_take_nothing_from_future_keys():
    """An infinite key reaches no gradient of the rows before it (they never attend to it): the
    float64 reference sums over attended keys only when an input is not finite."""
    q, k, v = make_qkv(1, 9, 4, 2, 5, dtype=torch.float64, seed=11)
    k[0, 5, 0, 1] = float("-inf")
    grads = reference_grads(q, k, v, torch.randn_like(q))
    assert torch.isfinite(grads[0][0, :5]).all()      # dq of the rows before it
    assert torch.isnan(grads[0][0, 5:, :2]).any()     # rows that attend to it do see it


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


def test_attention_ref_is_the_causal_reference_at_equal_lengths():
    """reference.attention_ref with its defaults (causal, Tq = Tk, 1/sqrt(D)) is
    causal_gqa_reference, with finite inputs and with NaN, +Inf and -Inf in q, k and v."""
    q, k, v = make_qkv(2, 13, 6, 2, 5, dtype=torch.float64)
    out, lse = reference.attention_ref(q, k, v)
    assert torch.allclose(out, reference.causal_gqa_reference(q, k, v), atol=1e-13) and lse.shape == (2, 6, 13)
    q[0, 4, 1, 2], k[1, 7, 0, 0], v[0, 9, 1, 3] = NAN, INF, -INF
    out, _ = reference.attention_ref(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(out), test(exact))
    finite = torch.isfinite(exact)
    assert torch.allclose(out[finite], exact[finite], atol=1e-13)


def test_attention_ref_follows_flash_attention_masks():
    """reference.attention_ref against the definition written out key by key, FlashAttention's
    semantics: query i aligned with key i + Tk - Tq, window (left, right) with -1 unbounded,
    causal as right = 0, any scale, tanh softcap; a row that sees no key gives 0 and lse -inf."""
    rng = random.Random(53)
    for Tq, Tk in ((5, 5), (3, 8), (8, 3), (1, 7), (6, 1)):
        for causal, window, scale, softcap in ((True, (-1, -1), None, 0.0), (False, (-1, -1), 0.3, 0.0),
                                               (True, (2, -1), None, 0.0), (False, (1, 1), None, 2.0),
                                               (False, (0, 0), 1.5, 0.0), (False, (-1, 2), None, 0.5)):
            q = torch.randn(2, Tq, 4, 3, dtype=torch.float64)
            k, v = (torch.randn(2, Tk, 2, 3, dtype=torch.float64) for _ in range(2))
            out, lse = reference.attention_ref(q, k, v, causal=causal, window=window, scale=scale, softcap=softcap)
            sc = 1 / math.sqrt(3) if scale is None else scale
            left, right = window[0], 0 if causal else window[1]
            b, h = rng.randrange(2), rng.randrange(4)
            for i in range(Tq):
                a = i + Tk - Tq
                keys = [j for j in range(Tk) if (right < 0 or j <= a + right) and (left < 0 or j >= a - left)]
                if not keys:
                    assert out[b, i, h].abs().max() == 0 and lse[b, h, i] == -math.inf, (Tq, Tk, causal, window, i)
                    continue
                s = [float(q[b, i, h] @ k[b, j, h // 2]) * sc for j in keys]
                s = [softcap * math.tanh(x / softcap) for x in s] if softcap > 0 else s
                m = max(s)
                w = [math.exp(x - m) for x in s]
                expect = sum(wj * v[b, j, h // 2] for wj, j in zip(w, keys)) / sum(w)
                assert torch.allclose(out[b, i, h], expect, atol=1e-12), (Tq, Tk, causal, window, i)
                assert abs(lse[b, h, i].item() - (m + math.log(sum(w)))) < 1e-12


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


def test_cpu_library_builds_without_cuda():
    """The PyTorch path's checks come from the CPU library (kernels/cpu_checks.cpp, built with no
    CUDA headers, its own op namespace), whose rules are checks.h's, the CUDA entry library's too."""
    ops = gqa_module.load_cpu_library()
    assert str(ops.check_inputs.default._schema) == ('gqa_attn_cpu::check_inputs(Tensor q, Tensor k, Tensor v, '
                                                     'str entry="causal_gqa_attention", bool same_length=True) -> ()')
    files = gqa_module._read_kernel_files()
    unit = gqa_module._translation_unit(files, "cpu_checks.cpp")
    assert "gqa_check_inputs(" in unit and not re.search(r"#include <(c10/cuda|cuda|ATen/cuda)", unit)
    assert '#include "checks.h"' in files["binding.cpp"].decode()
    assert gqa_module.load_cpu_library() is ops


def test_every_unit_translates_with_its_project_headers_pasted_in():
    """load_inline compiles one source text per library: every `#include "X"` of a file under
    kernels/ (a comment may follow it) is pasted in, none is left for the compiler to look for."""
    files = gqa_module._read_kernel_files()
    sources = [path for path in files if path.endswith((".cu", ".cpp"))]
    assert "bwdx3/bwdx3.cu" in sources and "attention.cu" in sources
    for path in sources:
        unit = gqa_module._translation_unit(files, path)
        assert not re.search(r'^\s*#\s*include\s*"', unit, re.M), path
    assert gqa_module._translation_unit({"a.cu": b'#include "b.cuh"   // why\nint a;\n', "b.cuh": b"int b;\n"},
                                        "a.cu") == "int b;\nint a;\n"


def test_cpu_float64_runs_and_gradcheck_passes():
    """float64 on the CPU: the float64 reference to rounding, and torch.autograd.gradcheck (and
    gradgradcheck: PyTorch's autograd runs the CPU path) on a small ragged shape."""
    q, k, v = make_qkv(2, 7, 4, 2, 5, dtype=torch.float64)
    out = gqa_module.causal_gqa_attention(q, k, v)
    assert out.dtype == torch.float64 and torch.allclose(out, reference.causal_gqa_reference(q, k, v), atol=1e-12)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(gqa_module.causal_gqa_attention, leaves)
    assert torch.autograd.gradgradcheck(gqa_module.causal_gqa_attention, leaves)


def test_cpu_non_tensor_inputs_raise_type_error():
    """None, a list or a NumPy array for q, k or v: a TypeError naming the argument, from every
    entry point, and no array printed."""
    q, k, v = make_qkv(1, 4, 2, 1, 8)
    for entry in (gqa_module.causal_gqa_attention, gqa_module.plan, gqa_module.backward_plan):
        for which, bad in (("q", None), ("k", [[1.0, 2.0]] * 50), ("v", k.numpy())):
            args = dict(dict(q=q, k=k, v=v), **{which: bad})
            with pytest.raises(TypeError) as info:
                entry(args["q"], args["k"], args["v"])
            message = str(info.value)
            assert message.startswith("causal_gqa_attention: %s must be a torch.Tensor, got " % which), message
            assert len(message) < 120, message


def test_cpu_plans_name_pytorch():
    q, k, v = make_qkv(1, 4, 2, 1, 8)
    assert gqa_module.plan(q, k, v) == gqa_module.backward_plan(q, k, v) == "pytorch/cpu"
    with pytest.raises(ValueError, match="multiple of"):
        gqa_module.backward_plan(q, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))


def test_cpu_call_prints_no_torch_warning():
    """A CPU call in a fresh process (the CPU library built already, by the tests above) writes
    nothing to stderr: no "No CUDA runtime is found" from torch's extension builder."""
    gqa_module.load_cpu_library()
    code = ("import torch, gqa_module\n"
            "q, k, v = (torch.randn(1, 5, h, 8) for h in (2, 1, 1))\n"
            "print(gqa_module.causal_gqa_attention(q, k, v).shape, gqa_module.backward_plan(q, k, v))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["torch.Size([1,", "5,", "2,", "8])", "pytorch/cpu"], run.stdout
    noise = [line for line in run.stderr.splitlines() if "numpy" not in line.lower()]
    assert not noise, run.stderr


# ------------------------------------------------------------------------------------------------
# attention(): FlashAttention's arguments (gqa_geometry.py), against reference.attention_ref
import gqa_geometry  # noqa: E402

# (causal, window_size, softmax_scale, softcap)
MASKS = [(True, (-1, -1), None, 0.0), (False, (-1, -1), None, 0.0), (False, (16, 0), 0.3, 0.0),
         (True, (7, -1), None, 5.0), (False, (5, 9), -0.4, 0.0), (False, (0, 0), None, 1.5),
         (False, (-1, 3), 2.0, 0.0), (True, (None, None), 0.05, 0.0)]
# (Tq, Tk); (65, 63) and (100, 1) hold rows that see no key under causal masks
LENGTHS = [(1, 1), (63, 63), (65, 65), (63, 65), (65, 63), (1, 100), (100, 1), (20, 0)]


def masked_qkv(B, Tq, Tk, Hq, Hkv, D, dtype):
    q = make_qkv(B, Tq, Hq, Hkv, D, dtype=dtype)[0]
    _, k, v = make_qkv(B, Tk, Hq, Hkv, D, dtype=dtype)
    return q, k, v


def geometry_of(q, k, causal, window, scale, softcap, return_lse=True):
    return gqa_geometry.arguments(q, k, causal, scale, window, softcap, return_lse)


def reference_of(q, k, v, geo):
    return reference.attention_ref(q, k, v, causal=geo.causal, window=(geo.left, geo.right), scale=geo.scale,
                                   softcap=geo.softcap)


def assert_rows_close(out, lse, ref_out, ref_lse, tol, what):
    """Row by row: every output row within tol of the float64 row (relative to that row's largest
    value, and at least tol), the log-sum-exp within tol; rows that see no key exactly 0 and -inf."""
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, what
    blind = torch.isneginf(ref_lse)                                   # [B, Hq, Tq]
    assert torch.equal(torch.isneginf(lse), blind), what
    assert torch.all(out.permute(0, 2, 1, 3)[blind] == 0), what
    err = (out.double() - ref_out).abs().amax(dim=-1)                 # [B, Tq, Hq]
    size = ref_out.abs().amax(dim=-1).clamp_min(1.0)
    assert torch.all(err <= tol * size), (what, float((err / size).max()))
    seen = ~blind
    assert torch.all((lse.double() - ref_lse)[seen].abs() <= tol * ref_lse[seen].abs().clamp_min(1.0)), what


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_attention_cpu_matches_float64_on_every_mask(dtype, tol):
    """CPU attention against reference.attention_ref for every mask of MASKS at every (Tq, Tk) of
    LENGTHS (odd head_dim, GQA 3:1): each output row and log-sum-exp; rows that see no key 0 and
    -inf. bf16 inputs are the reference's inputs too (it upcasts them), so the error is the
    output's rounding and fp32 arithmetic."""
    for Tq, Tk in LENGTHS:
        for causal, window, scale, softcap in MASKS:
            q, k, v = masked_qkv(2, Tq, Tk, 6, 2, 23, dtype)
            geo = geometry_of(q, k, causal, window, scale, softcap)
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, softmax_scale=scale,
                                            softcap=softcap, return_lse=True)
            assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            assert_rows_close(out, lse, *reference_of(q, k, v, geo), tol, (Tq, Tk, causal, window, scale, softcap))


# FlashAttention 3's attention_chunk over masks of MASKS (causal, window, scale, softcap, chunk):
# chunks of one key, of fewer keys than the window, of more keys than Tk, with Tq > Tk and < Tk
CHUNK_MASKS = [(True, (-1, -1), None, 0.0, 1), (True, (-1, -1), None, 0.0, 16), (False, (-1, -1), 0.3, 0.0, 7),
               (True, (20, -1), None, 5.0, 4), (False, (5, 9), None, 0.0, 10), (True, (-1, -1), None, 0.0, 70)]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_attention_chunk_cpu_matches_float64(dtype, tol):
    """attention_chunk (FlashAttention 3's chunked attention) on CPU against reference.attention_ref
    (its own statement of the chunk rule) at every (Tq, Tk) of LENGTHS: each output row and
    log-sum-exp, rows that see no key 0 and -inf; a chunk holding every key is no chunk; on CUDA
    tensors it is named as what no kernel runs (test_attention_cuda_routes_name_the_option)."""
    for Tq, Tk in LENGTHS:
        for causal, window, scale, softcap, chunk in CHUNK_MASKS:
            q, k, v = masked_qkv(2, Tq, Tk, 6, 2, 23, dtype)
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, softmax_scale=scale,
                                            softcap=softcap, attention_chunk=chunk, return_lse=True)
            ref = reference.attention_ref(q, k, v, causal=causal, window=tuple(-1 if w is None else w for w in window),
                                          scale=scale, softcap=softcap, chunk=chunk)
            assert_rows_close(out, lse, *ref, tol, (Tq, Tk, causal, window, scale, softcap, chunk))
    q, k, v = masked_qkv(1, 40, 60, 4, 2, 8, torch.float64)
    assert gqa_geometry.arguments(q, k, True, None, (-1, -1), 0.0, False, 60).chunk == 0
    assert gqa_geometry.arguments(k, q, True, None, (-1, -1), 0.0, False, 60).chunk == 60   # Tq > Tk: rows before
    with pytest.raises(ValueError, match="attention_chunk must be >= 0"):
        gqa_module.attention(q, k, v, attention_chunk=-1)
    with pytest.raises(TypeError, match="attention_chunk must be an int"):
        gqa_module.attention(q, k, v, attention_chunk=2.5)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_attention_alibi_cpu_matches_float64(dtype, tol):
    """alibi_slopes (FlashAttention 2's ALiBi: - slope * |i + Tk - Tq - j| after softcap), per query
    head and per batch row and query head, with causal masks, windows, softcap and chunks, at
    every (Tq, Tk) of LENGTHS: each output row and log-sum-exp against reference.attention_ref's
    own statement of it; float64 gradients by gradcheck; packed sequences and KV-cache rows take
    their own row of slopes; the slopes' rules named; CUDA tensors name it as what no kernel runs."""
    gen = torch.Generator().manual_seed(seed_of("alibi"))
    for Tq, Tk in LENGTHS:
        for causal, window, softcap, chunk, per_row in [(True, (-1, -1), 0.0, 0, False), (False, (-1, -1), 0.0, 0, True),
                                                        (False, (5, 9), 3.0, 0, True), (True, (-1, -1), 0.0, 8, False)]:
            q, k, v = masked_qkv(2, Tq, Tk, 6, 2, 23, dtype)
            slopes = torch.rand(2, 6, generator=gen) if per_row else torch.rand(6, generator=gen)
            slopes = slopes.to(torch.float64 if dtype == torch.float64 else torch.float32)
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                            attention_chunk=chunk, alibi_slopes=slopes, return_lse=True)
            ref = reference.attention_ref(q, k, v, causal=causal, window=window, softcap=softcap, chunk=chunk,
                                          alibi=slopes)
            assert_rows_close(out, lse, *ref, tol, (Tq, Tk, causal, window, softcap, chunk, per_row))
    q, k, v = (t.requires_grad_(True) for t in masked_qkv(2, 5, 7, 4, 2, 3, torch.float64))
    slopes = torch.rand(2, 4, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *x: gqa_module.attention(*x, causal=True, alibi_slopes=slopes,
                                                                    return_lse=True), (q, k, v))
    # packed sequences: sequence b takes row b of the slopes
    q, k, v = (t[0] for t in masked_qkv(1, 50, 50, 6, 2, 16, torch.float64))
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    slopes = torch.rand(2, 6, generator=gen, dtype=torch.float64)
    packed = gqa_module.attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, alibi_slopes=slopes)
    for b, (a, e) in enumerate(((0, 20), (20, 50))):
        alone = gqa_module.attention(q[None, a:e], k[None, a:e], v[None, a:e], causal=True, alibi_slopes=slopes[b])
        assert torch.equal(packed[a:e], alone[0]), b
    # a KV cache: batch row b takes row b of the slopes over its own keys
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(torch.float64)
    slopes = torch.rand(6, 6, generator=gen, dtype=torch.float64)
    out = gqa_module.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                            alibi_slopes=slopes)
    for b, n in enumerate(KVCACHE_SEQLENS):
        ref, _ = reference.attention_ref(q[b:b + 1], k_cache[b:b + 1, :n + 3], v_cache[b:b + 1, :n + 3], causal=True,
                                         alibi=slopes[b])
        assert torch.allclose(out[b:b + 1], ref, atol=1e-12), b
    q, k, v = masked_qkv(2, 9, 9, 6, 2, 8, torch.float32)
    for slopes, error, message in [([0.1] * 6, TypeError, "alibi_slopes must be a torch.Tensor"),
                                   (torch.rand(5), ValueError, r"alibi_slopes must be float32 of shape \(Hq,\) = \(6,\)"),
                                   (torch.rand(3, 6), ValueError, r"\(batch, Hq\) = \(2, 6\)"),
                                   (torch.rand(6).half(), ValueError, "alibi_slopes must be float32")]:
        with pytest.raises(error, match=message):
            gqa_module.attention(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"attention_varlen: alibi_slopes must be .* \(batch, Hq\) = \(2, 6\)"):
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        gqa_module.attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5, alibi_slopes=torch.rand(3, 6))


def test_attention_public_entry_on_cpu():
    """gqa_module.attention on CPU tensors: FlashAttention's defaults (causal=False), the
    log-sum-exp only when asked, causal=True as causal_gqa_attention, Tq != Tk against the float64
    reference, and the input rules (kernels/checks.h) in each entry's own name."""
    q, k, v = make_qkv(2, 65, 6, 2, 23)
    out = gqa_module.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    ref_out, _ = reference.attention_ref(q, k, v, causal=False)
    assert torch.allclose(out.double(), ref_out, atol=2e-6)
    out, lse = gqa_module.attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (2, 6, 65) and lse.dtype == torch.float32
    assert torch.allclose(out, gqa_module.causal_gqa_attention(q, k, v), atol=2e-6)
    q2 = make_qkv(2, 63, 6, 2, 23)[0]
    out, lse = gqa_module.attention(q2, k, v, causal=True, window_size=(9, -1), return_lse=True)
    assert_rows_close(out, lse, *reference.attention_ref(q2, k, v, causal=True, window=(9, -1)), 1e-5, "Tq != Tk")
    with pytest.raises(ValueError, match=r"^attention: k must have q's batch size B"):
        gqa_module.attention(q2, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"^causal_gqa_attention: k must have q's sequence length T"):
        gqa_module.causal_gqa_attention(q2, k, v)
    with pytest.raises(TypeError, match=r"^attention: k must be a torch.Tensor"):
        gqa_module.attention(q, None, v)


def test_attention_gradients_match_float64_autograd():
    """float64 gradcheck of the output and the log-sum-exp through every option at once (Tq !=
    Tk, window, scale, softcap); rows that see no key take zero gradients and no NaN."""
    q, k, v = masked_qkv(1, 4, 6, 4, 2, 5, torch.float64)
    geo = geometry_of(q, k, False, (1, 2), 0.8, 1.5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: gqa_geometry.attention_torch(*x, geo), leaves)
    q, k, v = (t.requires_grad_(True) for t in masked_qkv(1, 6, 3, 4, 2, 5, torch.float64))
    geo = geometry_of(q, k, True, (-1, -1), None, 0.0)                # rows 0..2 see no key
    out, lse = gqa_geometry.attention_torch(q, k, v, geo)
    (out.square().sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :3] == 0) and torch.any(q.grad[:, 3:] != 0)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_attention_nonfinite_reaches_the_rows_that_see_it(which):
    """NaN, +Inf and -Inf in one element of q, k or v at positions 0, 37 and 64 (T = 65), under a
    causal window, a two-sided window and no mask: the NaN, +Inf and -Inf entries of the output
    and the log-sum-exp are the float64 reference's, and the finite ones within fp32 rounding."""
    for causal, window in ((True, (8, -1)), (False, (4, 4)), (False, (-1, -1))):
        for pos, bad in ((0, NAN), (37, INF), (64, -INF)):
            q, k, v = make_qkv(1, 65, 4, 2, 16)
            dict(q=q, k=k, v=v)[which][0, pos, 1, 3] = bad
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
            ref_out, ref_lse = reference.attention_ref(q, k, v, causal=causal, window=window)
            for got, ref in ((out, ref_out), (lse, ref_lse)):
                for test in (torch.isnan, torch.isposinf, torch.isneginf):
                    assert torch.equal(test(got), test(ref)), (which, causal, window, pos, bad, test.__name__)
                finite = torch.isfinite(ref)
                assert torch.allclose(got.double()[finite], ref[finite], atol=1e-5), (which, causal, window, pos)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(return_lse="yes"), TypeError, "return_lse must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (dict(window_size=(4,)), ValueError, "window_size must be a pair"),
    (dict(window_size="ab"), ValueError, "window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, "window_size[0] (left) must be -1"),
    (dict(window_size=(0, 2.5)), TypeError, "window_size[1] (right) must be an int or None, got float"),
    (dict(window_size=(True, 0)), TypeError, "window_size[0] (left) must be an int or None, got bool"),
    (dict(causal=True, window_size=(0, -3)), ValueError, "window_size[1] (right) must be -1"),
])
def test_attention_bad_arguments_raise(kwargs, error, words):
    q, k, v = make_qkv(1, 5, 2, 1, 8)
    with pytest.raises(error) as info:
        gqa_module.attention(q, k, v, **kwargs)
    assert str(info.value).startswith("attention: ") and words in str(info.value), str(info.value)


def test_flash_attention_3_stand_in_maps_its_arguments():
    """bench/fa_shim/flash_attn_interface.py (for hopper/test_flash_attn.py): FlashAttention 3's
    functions on attention(), attention_varlen() and attention_with_kvcache(), the log-sum-exp
    where asked, speed knobs ignored, and each feature the library lacks a skip naming it."""
    sys.path.insert(0, os.path.join(HERE, "bench", "fa_shim"))
    try:
        import flash_attn_interface as fa3
    finally:
        sys.path.pop(0)
        sys.modules.pop("flash_attn_interface", None)
    q, k, v = make_qkv(2, 33, 6, 2, 16)
    kw = dict(causal=True, window_size=(5, -1), softcap=3.0, softmax_scale=0.4)
    out, lse = fa3.flash_attn_func(q, k, v, num_splits=3, pack_gqa=True, return_attn_probs=True, **kw)
    expect_out, expect_lse = gqa_module.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    cu = torch.tensor([0, 20, 33], dtype=torch.int32)
    used = torch.tensor([15, 13], dtype=torch.int32)
    assert torch.equal(fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 20, 20, seqused_k=used, **kw),
                       gqa_module.attention_varlen(q[0], k[0], v[0], cu, cu, 20, 20, seqused_k=used, **kw))
    seqlens = torch.tensor([30, 12], dtype=torch.int32)
    out, lse = fa3.flash_attn_with_kvcache(q[:, :3], k, v, cache_seqlens=seqlens, scheduler_metadata=None,
                                           return_softmax_lse=True, **kw)
    expect_out, expect_lse = gqa_module.attention_with_kvcache(q[:, :3], k, v, cache_seqlens=seqlens, return_lse=True, **kw)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    assert fa3.get_scheduler_metadata(2, 33, 33, 6, 2, 16) is None
    assert torch.equal(fa3.flash_attn_func(q, k, v, attention_chunk=8, **kw),
                       gqa_module.attention(q, k, v, attention_chunk=8, **kw))
    # rotary: FlashAttention 3's arguments passed on, rotary_seqlens among them
    rotary = dict(rotary_cos=torch.randn(40, 4), rotary_sin=torch.randn(40, 4), rotary_interleaved=False,
                  rotary_seqlens=torch.tensor([5, 2], dtype=torch.int32), cache_seqlens=seqlens)
    caches = [(k.clone(), v.clone()) for _ in range(2)]
    got = fa3.flash_attn_with_kvcache(q[:, :3], *caches[0], k[:, :3], v[:, :3], **rotary, **kw)
    expect = gqa_module.attention_with_kvcache(q[:, :3], *caches[1], k[:, :3], v[:, :3], **rotary, **kw)
    assert torch.equal(got, expect) and torch.equal(caches[0][0], caches[1][0])
    parts = [gqa_module.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 10), (10, 33))]
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts])
    combined, combined_lse = fa3.flash_attn_combine(outs, lses.transpose(-1, -2), out_dtype=torch.float64)
    expect_out, expect_lse = gqa_module.attention_combine(outs, lses, out_dtype=torch.float64)
    assert torch.equal(combined, expect_out) and torch.equal(combined_lse, expect_lse.transpose(-1, -2))
    # float8 with descales, and seqused_q, passed on
    f8 = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    descales = dict(zip(("q_descale", "k_descale", "v_descale"), torch.rand(3, 2, 2).unbind(0)))
    assert torch.equal(fa3.flash_attn_func(*f8, **descales, **kw), gqa_module.attention(*f8, **descales, **kw))
    assert torch.equal(fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 20, 20, seqused_q=used, **kw),
                       gqa_module.attention_varlen(q[0], k[0], v[0], cu, cu, 20, 20, seqused_q=used, **kw))
    assert torch.equal(fa3.flash_attn_func(q, k, v, qv=q, **kw), gqa_module.attention(q, k, v, qv=q, **kw))
    for call, feature in ((lambda: fa3.flash_attn_with_kvcache(q[:, :3], k, v, qv=q[:, :3], cache_seqlens=seqlens),
                           "qv over a KV cache"),
                          (lambda: fa3.flash_attn_combine(out[None], lse[None].transpose(-1, -2), out=out),
                           "combine into a given out")):
        with pytest.raises(pytest.skip.Exception, match="unsupported: " + feature):
            call()


def test_flash_attention_stand_in_maps_its_arguments():
    """bench/fa_shim/flash_attn (for bench/fa_suite.py): FlashAttention 2's functions on the library's
    attention(), packed layouts unpacked, the log-sum-exp where asked, and each feature the library
    lacks a skip naming it."""
    sys.path.insert(0, os.path.join(HERE, "bench", "fa_shim"))
    try:
        import flash_attn
        import flash_attn.layers.rotary as rotary_emb
    finally:
        sys.path.pop(0)
        for name in [name for name in sys.modules if name.split(".")[0] == "flash_attn"]:
            del sys.modules[name]   # the stand-in is no installed flash_attn for the other tests
    q, k, v = make_qkv(2, 33, 6, 2, 16)
    kw = dict(causal=True, window_size=(5, -1), softcap=3.0, softmax_scale=0.4)
    out, lse, s_dmask = flash_attn.flash_attn_func(q, k, v, 0.0, return_attn_probs=True, **kw)
    expect_out, expect_lse = gqa_module.attention(q, k, v, return_lse=True, **kw)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse) and s_dmask is None
    assert torch.equal(flash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), **kw), expect_out)
    qkv = torch.stack([q[:, :, :2], k, v], dim=2)
    assert torch.equal(flash_attn.flash_attn_qkvpacked_func(qkv, causal=True),
                       gqa_module.attention(q[:, :, :2], k, v, causal=True))
    cu = torch.tensor([0, 33], dtype=torch.int32)
    with pytest.raises(pytest.skip.Exception, match="unsupported: dropout"):
        flash_attn.flash_attn_func(q, k, v, 0.1)
    # paged keys in a packed call: attention_with_kvcache's packed rows over the pages
    pool_k, pool_v = (x[0].reshape(3, 11, 2, 16) for x in (k, v))
    table, lens = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32), torch.tensor([15, 9], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 6, 10], dtype=torch.int32), torch.tensor([0, 15, 24], dtype=torch.int32)
    paged = flash_attn.flash_attn_varlen_func(q[0, :10], pool_k, pool_v, cu_q, cu_k, 6, 15, block_table=table, **kw)
    for b, rows in enumerate((slice(0, 6), slice(6, 10))):
        keys = [pool_k[table[b]].reshape(-1, 2, 16)[:int(lens[b])], pool_v[table[b]].reshape(-1, 2, 16)[:int(lens[b])]]
        assert torch.equal(paged[rows], gqa_module.attention(q[0, rows][None], *(x[None] for x in keys), **kw)[0]), b
    cu = torch.tensor([0, 20, 33], dtype=torch.int32)
    out, lse, _ = flash_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 20, 20, return_attn_probs=True, **kw)
    expect_out, expect_lse = gqa_module.attention_varlen(q[0], k[0], v[0], cu, cu, 20, 20, return_lse=True, **kw)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    assert torch.equal(flash_attn.flash_attn_varlen_kvpacked_func(q[0], torch.stack([k[0], v[0]], dim=1), cu, cu,
                                                                  20, 20, **kw), expect_out)
    seqlens = torch.tensor([30, 12], dtype=torch.int32)
    slopes = torch.rand(2, 6)
    assert torch.equal(flash_attn.flash_attn_func(q, k, v, alibi_slopes=slopes, **kw),
                       gqa_module.attention(q, k, v, alibi_slopes=slopes, **kw))
    out, lse = flash_attn.flash_attn_with_kvcache(q[:, :3], k, v, cache_seqlens=seqlens, return_softmax_lse=True, **kw)
    expect_out, expect_lse = gqa_module.attention_with_kvcache(q[:, :3], k, v, cache_seqlens=seqlens, return_lse=True, **kw)
    assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)
    # rotary (FlashAttention 2's default pairs: interleaved) passed on; the stand-in's apply_rotary_emb,
    # which FlashAttention's tests build their references with, turns as the library does
    cos, sin = torch.randn(40, 4), torch.randn(40, 4)
    caches = [(k.clone(), v.clone()) for _ in range(2)]
    got = flash_attn.flash_attn_with_kvcache(q[:, :3], *caches[0], k[:, :3], v[:, :3], rotary_cos=cos, rotary_sin=sin,
                                             cache_seqlens=seqlens, **kw)
    expect = gqa_module.attention_with_kvcache(q[:, :3], *caches[1], k[:, :3], v[:, :3], rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=seqlens, **kw)
    assert torch.equal(got, expect) and torch.equal(caches[0][0], caches[1][0])
    for interleaved in (True, False):
        turned = rotary_emb.apply_rotary_emb(k[:, :3], cos, sin, interleaved=interleaved, seqlen_offsets=seqlens)
        positions = seqlens.long().view(-1, 1) + torch.arange(3)
        assert torch.allclose(turned, gqa_geometry._turn(k[:, :3], cos, sin, positions, interleaved), atol=1e-6)


# ------------------------------------------------------------------------------------------------
# attention_varlen: packed sequences
# (Tq, Tk) of one packed batch: one query, sequences of no query or no key, Tq > Tk (rows that see
# no key under causal masks), Tq < Tk
VARLEN_LENGTHS = [(1, 1), (63, 65), (0, 7), (65, 63), (5, 0), (100, 1), (17, 40)]


def packed_qkv(lengths, Hq, Hkv, D, dtype, extra_q=0, extra_k=0, device="cpu"):
    """q [total_q + extra_q, Hq, D], k and v [total_k + extra_k, Hkv, D] (random, the extra rows
    in no sequence) and int32 cu_seqlens_q, cu_seqlens_k of `lengths`."""
    cu_q = torch.tensor([0] + [sum(t for t, _ in lengths[:b + 1]) for b in range(len(lengths))], dtype=torch.int32)
    cu_k = torch.tensor([0] + [sum(t for _, t in lengths[:b + 1]) for b in range(len(lengths))], dtype=torch.int32)
    q = make_qkv(1, int(cu_q[-1]) + extra_q, Hq, Hkv, D, dtype=dtype)[0][0]
    _, k, v = make_qkv(1, int(cu_k[-1]) + extra_k, Hq, Hkv, D, dtype=dtype)
    return q.to(device), k[0].to(device), v[0].to(device), cu_q.to(device), cu_k.to(device)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_attention_varlen_cpu_matches_float64_per_sequence(dtype, tol):
    """attention_varlen on CPU tensors, every mask of MASKS over VARLEN_LENGTHS packed in one call
    (GQA 3:1, odd head_dim, two rows of q past the last sequence): each sequence's output rows and
    log-sum-exp against reference.attention_ref on that sequence alone; the rows past the end 0
    and -inf; the same again with seqused_k using part of each sequence's keys."""
    q, k, v, cu_q, cu_k = packed_qkv(VARLEN_LENGTHS, 6, 2, 23, dtype, extra_q=2, extra_k=3)
    lens_k = (cu_k[1:] - cu_k[:-1]).tolist()
    for seqused in (None, torch.tensor([(n + 1) // 2 for n in lens_k], dtype=torch.int32)):
        for causal, window, scale, softcap in MASKS:
            what = (dtype, causal, window, scale, softcap, seqused is not None)
            out, lse = gqa_module.attention_varlen(q, k, v, cu_q, cu_k, 100, 65, causal=causal, window_size=window,
                                                   softmax_scale=scale, softcap=softcap, seqused_k=seqused,
                                                   return_lse=True)
            assert out.shape == q.shape and out.dtype == dtype and lse.shape == (6, q.shape[0]), what
            for b in range(len(VARLEN_LENGTHS)):
                rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
                used = int(cu_k[b + 1] - cu_k[b]) if seqused is None else int(seqused[b])
                keys = slice(int(cu_k[b]), int(cu_k[b]) + used)
                q_b, k_b, v_b = q[rows][None], k[keys][None], v[keys][None]
                geo = geometry_of(q_b, k_b, causal, window, scale, softcap)
                assert_rows_close(out[rows][None], lse[:, rows][None], *reference_of(q_b, k_b, v_b, geo), tol,
                                  what + (b,))
            assert torch.all(out[-2:] == 0) and torch.all(torch.isneginf(lse[:, -2:])), what


def test_attention_varlen_cpu_gradients_equal_per_sequence_calls():
    """A packed batch's gradients are those of one attention() call per sequence, bitwise (the CPU
    path computes each sequence alone), every mask of MASKS; keys past a sequence's seqused_k and
    rows in no sequence get zero gradients."""
    q, k, v, cu_q, cu_k = packed_qkv(VARLEN_LENGTHS, 6, 2, 23, torch.float32, extra_q=2, extra_k=3)
    seqused = torch.tensor([max(0, int(cu_k[b + 1] - cu_k[b]) - 1) for b in range(len(VARLEN_LENGTHS))],
                           dtype=torch.int32)
    for causal, window, scale, softcap in MASKS:
        kw = dict(causal=causal, window_size=window, softmax_scale=scale, softcap=softcap)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = gqa_module.attention_varlen(*leaves, cu_q, cu_k, 100, 65, seqused_k=seqused, **kw)
        grad_out = torch.randn_like(out)
        packed = torch.autograd.grad(out, leaves, grad_out)
        expect = [torch.zeros_like(t) for t in (q, k, v)]
        for b in range(len(VARLEN_LENGTHS)):
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            keys = slice(int(cu_k[b]), int(cu_k[b]) + int(seqused[b]))
            if rows.stop == rows.start:
                continue
            parts = [t[span].clone().requires_grad_(True) for t, span in zip((q, k, v), (rows, keys, keys))]
            alone = gqa_module.attention(*(p[None] for p in parts), **kw)
            assert torch.equal(alone[0], out[rows].detach()), (kw, b)
            for e, g, span in zip(expect, torch.autograd.grad(alone, parts, grad_out[rows][None]), (rows, keys, keys)):
                e[span] = g
        for name, got, want in zip("qkv", packed, expect):
            assert torch.equal(got, want), (kw, name)


def test_attention_cpu_blocks_of_query_rows_match_one_block(monkeypatch):
    """The PyTorch path in blocks of query rows (gqa_geometry._BLOCK_SCORES made small: blocks of 1,
    7 and 40 rows, the backward recomputing each) against one block: float64 outputs, log-sum-exps
    and dq, dk, dv (from gradients of both outputs) within 1e-12, every mask of MASKS, with ALiBi
    and a chunk, at Tq, Tk = 65, 63 and 63, 65."""
    B, Hq, Hkv, D = 2, 6, 2, 23
    gen = torch.Generator().manual_seed(seed_of("blocks of rows"))
    slopes = torch.rand(Hq, generator=gen, dtype=torch.float64)
    for Tq, Tk in ((65, 63), (63, 65)):
        q, k, v = masked_qkv(B, Tq, Tk, Hq, Hkv, D, torch.float64)
        g_out, g_lse = torch.randn(B, Tq, Hq, D, generator=gen, dtype=torch.float64), \
            torch.randn(B, Hq, Tq, generator=gen, dtype=torch.float64)
        extras = [dict(), dict(alibi_slopes=slopes), dict(attention_chunk=16)]
        for (causal, window, scale, softcap), extra in itertools.product(MASKS, extras):
            kw = dict(causal=causal, window_size=window, softmax_scale=scale, softcap=softcap, **extra)
            def run():
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                out, lse = gqa_module.attention(*leaves, return_lse=True, **kw)
                seen = torch.isfinite(lse)
                loss = (out * g_out).sum() + (lse.masked_fill(~seen, 0) * g_lse).sum()
                return [out.detach(), lse.detach()] + list(torch.autograd.grad(loss, leaves))
            whole = run()
            for rows in (1, 7, 40):
                monkeypatch.setattr(gqa_geometry, "_BLOCK_SCORES", rows * B * (Hq // Hkv) * Tk)
                blocked = run()
                monkeypatch.undo()
                for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), blocked, whole):
                    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), (kw, rows, name)
                    fin = torch.isfinite(b)
                    assert torch.allclose(a[fin], b[fin], rtol=0, atol=1e-12), (kw, rows, name)


def test_value_head_dim_and_qv_match_float64():
    """v with a head_dim of its own (FlashAttention 3's head_dim_v: 7 and 40 beside D = 23), and qv
    (scores q . k + qv . v, default scale 1 / sqrt(D + Dv)): attention() against
    reference.attention_ref for every mask of MASKS at (Tq, Tk) = (65, 63) and (63, 65), outputs
    and log-sum-exps row by row; gradcheck of a small float64 call with qv; attention_varlen with
    both equal to attention() on each sequence alone."""
    gen = torch.Generator().manual_seed(seed_of("head_dim_v"))
    for (Tq, Tk), Dv, with_qv in itertools.product(((65, 63), (63, 65)), (7, 40), (False, True)):
        q, k, _ = masked_qkv(2, Tq, Tk, 6, 2, 23, torch.float64)
        v = torch.randn(2, Tk, 2, Dv, generator=gen, dtype=torch.float64)
        qv = torch.randn(2, Tq, 6, Dv, generator=gen, dtype=torch.float64) if with_qv else None
        for causal, window, scale, softcap in MASKS:
            what = (Tq, Tk, Dv, with_qv, causal, window, scale, softcap)
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, softmax_scale=scale,
                                            softcap=softcap, qv=qv, return_lse=True)
            assert out.shape == (2, Tq, 6, Dv), what
            geo = geometry_of(q, k, causal, window, scale, softcap)   # window sides as the reference takes them
            ref = reference.attention_ref(q, k, v, causal=causal, window=(geo.left, geo.right), scale=scale,
                                          softcap=softcap, qv=qv)
            assert_rows_close(out, lse, *ref, 1e-12, what)
    q, k, v, qv = (torch.randn(1, 9, h, d, generator=gen, dtype=torch.float64, requires_grad=True)
                   for h, d in ((4, 5), (2, 5), (2, 3), (4, 3)))
    assert torch.autograd.gradcheck(lambda *t: gqa_module.attention(*t[:3], qv=t[3], causal=True, softcap=2.0),
                                    (q, k, v, qv))
    cu = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    packed = [x[0].detach() for x in (q, k, v, qv)]
    got = gqa_module.attention_varlen(*packed[:3], cu, cu, 5, 5, causal=True, qv=packed[3])
    for b in range(3):
        span = slice(int(cu[b]), int(cu[b + 1]))
        alone = gqa_module.attention(*(x[span][None] for x in packed[:3]), causal=True, qv=packed[3][span][None])
        assert torch.equal(got[span], alone[0]), b


def test_learnable_sink_matches_float64():
    """learnable_sink (FlashAttention 4's, gpt-oss's attention sinks: a logit per query head that
    joins each row's softmax and weighs no value): attention() against reference.attention_ref for
    every mask of MASKS at every (Tq, Tk) of LENGTHS, rows that see no key 0 with the sink's logit
    as their log-sum-exp; Inf and NaN in v (the row-by-row path) where the reference puts them;
    gradcheck through q, k, v and the sink; a sink of shape other than (Hq,) named."""
    gen = torch.Generator().manual_seed(seed_of("learnable sink"))
    sink = torch.randn(6, generator=gen, dtype=torch.float64) * 3
    for Tq, Tk in LENGTHS:
        q, k, v = masked_qkv(2, Tq, Tk, 6, 2, 23, torch.float64)
        for causal, window, scale, softcap in MASKS:
            what = (Tq, Tk, causal, window, scale, softcap)
            out, lse = gqa_module.attention(q, k, v, causal=causal, window_size=window, softmax_scale=scale,
                                            softcap=softcap, learnable_sink=sink, return_lse=True)
            geo = geometry_of(q, k, causal, window, scale, softcap)
            ref_out, ref_lse = reference.attention_ref(q, k, v, causal=causal, window=(geo.left, geo.right),
                                                       scale=scale, softcap=softcap, sink=sink)
            assert torch.allclose(out, ref_out, rtol=0, atol=1e-12), what
            assert torch.allclose(lse, ref_lse, rtol=0, atol=1e-12), what
    q, k, v = masked_qkv(1, 30, 30, 6, 2, 16, torch.float64)
    v[0, 7, 1, 3], v[0, 20, 0, 5] = INF, NAN
    out = gqa_module.attention(q, k, v, causal=True, window_size=(9, 0), learnable_sink=sink)
    ref_out, _ = reference.attention_ref(q, k, v, causal=True, window=(9, 0), sink=sink)
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(test(out), test(ref_out)), test.__name__
    finite = torch.isfinite(ref_out)
    assert torch.allclose(out[finite], ref_out[finite], rtol=0, atol=1e-12)
    leaves = [torch.randn(1, 9, h, 5, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    logits = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, s: gqa_module.attention(q, k, v, causal=True, learnable_sink=s),
                                    (*leaves, logits))
    with pytest.raises(ValueError, match=r"learnable_sink must be a floating tensor of shape \(Hq,\) = \(6,\)"):
        gqa_module.attention(q, k, v, learnable_sink=sink[:4])
    with pytest.raises(TypeError, match="learnable_sink must be a torch.Tensor"):
        gqa_module.attention(q, k, v, learnable_sink=[0.0] * 6)


def test_value_head_dim_and_qv_rules_name_the_argument():
    """qv of the wrong shape, dtype or type, qv beside float8 inputs, and a v that differs from k
    in more than its head_dim: each a ValueError or TypeError naming it."""
    q, k, v = make_qkv(2, 9, 4, 2, 16)
    v8 = torch.randn(2, 9, 2, 8)
    f8 = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    cases = [(lambda: gqa_module.attention(q, k, v8, qv=torch.randn(2, 9, 4, 16)), ValueError,
              r"qv must have q's shape with v's head_dim, \[2, 9, 4, 8\]"),
             (lambda: gqa_module.attention(q, k, v8, qv=torch.randn(2, 9, 4, 8).double()), ValueError, "qv must have"),
             (lambda: gqa_module.attention(q, k, v8, qv=[1.0]), TypeError, "qv must be a torch.Tensor"),
             (lambda: gqa_module.attention(*f8, qv=f8[0]), ValueError, "qv does not take float8 inputs"),
             (lambda: gqa_module.attention(q, k, torch.randn(2, 8, 2, 8)), ValueError,
              "k and v must have the same shape"),
             (lambda: gqa_module.attention(q, k, v8.double()), ValueError, "q, k and v must share one dtype")]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_attention_varlen_seqused_q_shortens_each_sequence():
    """seqused_q (FlashAttention 3's) with seqused_k: sequence b is its first seqused_q[b] query
    rows against its first seqused_k[b] keys (causal aligned bottom-right on those), against
    reference.attention_ref on that sequence alone, every mask of MASKS; its other rows give 0 and
    -inf, and their gradients are zero."""
    q, k, v, cu_q, cu_k = packed_qkv(VARLEN_LENGTHS, 6, 2, 23, torch.float64, extra_q=2)
    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    used_q = torch.tensor([n - n // 3 for n in lens_q], dtype=torch.int32)
    used_k = torch.tensor([n - n // 4 for n in lens_k], dtype=torch.int32)
    for causal, window, scale, softcap in MASKS:
        what = (causal, window, scale, softcap)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = gqa_module.attention_varlen(*leaves, cu_q, cu_k, 100, 65, causal=causal, window_size=window,
                                               softmax_scale=scale, softcap=softcap, seqused_q=used_q,
                                               seqused_k=used_k, return_lse=True)
        unused = torch.ones(q.shape[0], dtype=torch.bool)
        for b in range(len(VARLEN_LENGTHS)):
            rows = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
            keys = slice(int(cu_k[b]), int(cu_k[b]) + int(used_k[b]))
            unused[rows] = False
            q_b, k_b, v_b = q[rows][None], k[keys][None], v[keys][None]
            geo = geometry_of(q_b, k_b, causal, window, scale, softcap)
            assert_rows_close(out[rows][None].detach(), lse[:, rows][None].detach(),
                              *reference_of(q_b, k_b, v_b, geo), 1e-12, what + (b,))
        assert int(unused.sum()) == 2 + sum(n // 3 for n in lens_q)
        assert torch.all(out[unused] == 0) and torch.all(torch.isneginf(lse[:, unused])), what
        dq = torch.autograd.grad(out, leaves[0], torch.randn_like(out))[0]
        assert torch.all(dq[unused] == 0), what


def test_float8_inputs_are_widened_by_their_descales():
    """float8_e4m3fn and float8_e5m2 inputs (FlashAttention 3's) with q_descale, k_descale and
    v_descale [B, Hkv]: each input times its descale (q head h taking kv head h // group's),
    rounded to bfloat16, is what attention() computes, every mask of MASKS against
    reference.attention_ref on those widened values (output bfloat16, rounding only); packed
    sequences take sequence b's descales, a KV cache batch row b's, each equal to attention() on
    that sequence or row alone."""
    B, T, Hq, Hkv, D = 2, 37, 6, 2, 23
    gen = torch.Generator().manual_seed(seed_of("float8"))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, k, v = (torch.randn(B, T, H, D, generator=gen).to(fp8) for H in (Hq, Hkv, Hkv))
        descales = [torch.rand(B, Hkv, generator=gen) * 2 for _ in range(3)]
        named = dict(zip(("q_descale", "k_descale", "v_descale"), descales))
        group = [Hq // Hkv, 1, 1]
        wide = [(x.double() * d.double().repeat_interleave(g, dim=1)[:, None, :, None]).to(torch.bfloat16).double()
                for x, d, g in zip((q, k, v), descales, group)]
        for causal, window, scale, softcap in MASKS:
            what = (fp8, causal, window, scale, softcap)
            kw = dict(causal=causal, window_size=window, softmax_scale=scale, softcap=softcap)
            out, lse = gqa_module.attention(q, k, v, return_lse=True, **named, **kw)
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32, what
            geo = geometry_of(wide[0], wide[1], causal, window, scale, softcap)
            assert_rows_close(out, lse, *reference_of(*wide, geo), 1e-2, what)
        without = gqa_module.attention(q, k, v, causal=True)   # no descales: each value as it is
        assert torch.equal(without, gqa_module.attention(*(x.to(torch.bfloat16) for x in (q, k, v)), causal=True))
        # packed sequences: sequence b takes row b of each descale
        cu = torch.tensor([0, 10, 10, 37], dtype=torch.int32)
        packed = [x[0] for x in (q, k, v)]
        d3 = [torch.rand(3, Hkv, generator=gen) for _ in range(3)]
        got = gqa_module.attention_varlen(*packed, cu, cu, 27, 27, causal=True, q_descale=d3[0], k_descale=d3[1],
                                          v_descale=d3[2])
        for b in (0, 2):
            span = slice(int(cu[b]), int(cu[b + 1]))
            alone = gqa_module.attention(*(x[span][None] for x in packed), causal=True, q_descale=d3[0][b:b + 1],
                                         k_descale=d3[1][b:b + 1], v_descale=d3[2][b:b + 1])
            assert torch.equal(got[span], alone[0]), (fp8, b)
        # a KV cache: batch row b takes row b of each descale
        lens = torch.tensor([5, 30], dtype=torch.int32)
        got = gqa_module.attention_with_kvcache(q[:, :2], k, v, cache_seqlens=lens, causal=True, **named)
        for b in range(B):
            alone = gqa_module.attention(q[b:b + 1, :2], k[b:b + 1, :int(lens[b])], v[b:b + 1, :int(lens[b])],
                                         causal=True, **{n: d[b:b + 1] for n, d in named.items()})
            assert torch.equal(got[b:b + 1], alone), (fp8, b)


def test_float8_rules_name_the_argument():
    """A descale beside inputs that are not float8, float8 inputs beside others, and a descale of
    the wrong dtype, shape or type: each a ValueError or TypeError naming it."""
    q, k, v = (x.to(torch.float8_e4m3fn) for x in make_qkv(2, 9, 4, 2, 16))
    d = torch.rand(2, 2)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cases = [(lambda: gqa_module.attention(q.float(), k.float(), v.float(), k_descale=d), ValueError,
              "k_descale applies to float8 inputs"),
             (lambda: gqa_module.attention(q, k.float(), v), ValueError, "q, k and v must share one dtype"),
             (lambda: gqa_module.attention(q, k, v, q_descale=d[:1]), ValueError,
              r"q_descale must be float32 of shape \(batch, Hkv\) = \(2, 2\)"),
             (lambda: gqa_module.attention(q, k, v, v_descale=d.double()), ValueError, "v_descale must be float32"),
             (lambda: gqa_module.attention(q, k, v, q_descale=[1.0, 2.0]), TypeError,
              "q_descale must be a torch.Tensor"),
             (lambda: gqa_module.attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5, k_descale=torch.rand(3, 2)),
              ValueError, r"attention_varlen: k_descale must be float32 of shape \(batch, Hkv\) = \(2, 2\)"),
             (lambda: gqa_module.attention_with_kvcache(q, k, v, cache_seqlens=3, q_descale=torch.rand(1, 2)),
              ValueError, "attention_with_kvcache: q_descale must be float32")]
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()


def test_attention_varlen_nonfinite_stays_in_its_sequence():
    """NaN or Inf in one sequence's q, k or v reaches that sequence's rows (as the float64
    reference puts it) and no other sequence's."""
    q, k, v, cu_q, cu_k = packed_qkv(VARLEN_LENGTHS, 4, 2, 16, torch.float32)
    clean = gqa_module.attention_varlen(q, k, v, cu_q, cu_k, 100, 65, causal=True)
    for which, bad in (("q", NAN), ("k", INF), ("v", -INF)):
        tensors = dict(q=q.clone(), k=k.clone(), v=v.clone())
        cu = cu_q if which == "q" else cu_k
        tensors[which][int(cu[1]) + 2, 1, 3] = bad   # in sequence 1
        out = gqa_module.attention_varlen(tensors["q"], tensors["k"], tensors["v"], cu_q, cu_k, 100, 65, causal=True)
        others = torch.ones(q.shape[0], dtype=torch.bool)
        others[int(cu_q[1]):int(cu_q[2])] = False
        assert torch.equal(out[others], clean[others]), which
        q_b, k_b, v_b = (tensors[n][span][None] for n, span in (("q", slice(int(cu_q[1]), int(cu_q[2]))),
                                                                 ("k", slice(int(cu_k[1]), int(cu_k[2]))),
                                                                 ("v", slice(int(cu_k[1]), int(cu_k[2])))))
        ref, _ = reference.attention_ref(q_b, k_b, v_b, causal=True)
        got = out[int(cu_q[1]):int(cu_q[2])][None]
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(got), test(ref)), (which, test.__name__)


def test_attention_varlen_rules_name_the_argument():
    """Offsets as FlashAttention takes them (1-D int32 on q's device, from 0, never decreasing,
    within the tensors), max_seqlen_q/k at least the longest sequence, seqused_q and seqused_k
    within each sequence's queries and keys, 3-D tensors: each broken rule a ValueError or
    TypeError naming the argument."""
    q, k, v, cu_q, cu_k = packed_qkv([(3, 4), (5, 2)], 4, 2, 8, torch.float32)
    call = lambda **over: gqa_module.attention_varlen(**{**dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                                  max_seqlen_q=5, max_seqlen_k=4), **over})
    assert call().shape == q.shape
    cases = [(dict(cu_seqlens_q=cu_q.long()), ValueError, "cu_seqlens_q must be a 1-D int32"),
             (dict(cu_seqlens_k=[0, 4, 6]), TypeError, "cu_seqlens_k must be a torch.Tensor"),
             (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "cu_seqlens_q must start with 0"),
             (dict(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "cu_seqlens_k must not decrease"),
             (dict(cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "past the 8 rows of q"),
             (dict(cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32)), ValueError, "the same length"),
             (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q \(4\) must be at least the longest sequence \(5\)"),
             (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an int"),
             (dict(seqused_k=torch.tensor([4, 3], dtype=torch.int32)), ValueError, r"seqused_k\[1\] must be in 0 .. 2"),
             (dict(seqused_k=torch.tensor([4], dtype=torch.int32)), ValueError, "seqused_k must have 2 values"),
             (dict(seqused_q=torch.tensor([3, 6], dtype=torch.int32)), ValueError, r"seqused_q\[1\] must be in 0 .. 5"),
             (dict(seqused_q=torch.tensor([1, 2, 3], dtype=torch.int32)), ValueError, "seqused_q must have 2 values"),
             (dict(q=q[None]), ValueError, "q must be 3-D"),
             (dict(q=q[:, :3]), ValueError, "attention_varlen"),
             (dict(window_size=(-2, 0)), ValueError, r"window_size\[0\]")]
    for over, error, message in cases:
        with pytest.raises(error, match=message):
            call(**over)


@needs_gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_gpu_attention_varlen_matches_float64_per_sequence(dtype, tol):
    """attention_varlen on CUDA tensors (attention()'s kernels per sequence) against float64 per
    sequence, every mask of MASKS but softcap, outputs and log-sum-exp row by row, and gradients
    row by row against float64 autograd of the CPU path."""
    q, k, v, cu_q, cu_k = packed_qkv(VARLEN_LENGTHS, 6, 2, 23, dtype, extra_q=2)
    for causal, window, scale, softcap in MASKS:
        if softcap:
            continue
        kw = dict(causal=causal, window_size=window, softmax_scale=scale)
        leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
        out, lse = gqa_module.attention_varlen(*leaves, cu_q.cuda(), cu_k.cuda(), 100, 65, return_lse=True, **kw)
        exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        exact_out, exact_lse = gqa_module.attention_varlen(*exact_leaves, cu_q, cu_k, 100, 65, return_lse=True, **kw)
        assert_rows_close(out.cpu()[None], lse.cpu()[None], exact_out.detach()[None], exact_lse.detach()[None], tol, kw)
        grad_out = torch.randn(out.shape, dtype=torch.float64).to(dtype)
        grads = torch.autograd.grad(out, leaves, grad_out.cuda())
        exact = torch.autograd.grad(exact_out, exact_leaves, grad_out.double())
        for name, got, ref in zip(("dq", "dk", "dv"), grads, exact):
            err = (got.cpu().double() - ref).abs().amax(dim=-1)
            size = ref.abs().amax(dim=-1).clamp_min(1.0)
            assert torch.all(err <= tol * (10 if dtype == torch.float32 else 1.5) * size), (kw, name)


# ------------------------------------------------------------------------------------------------
# attention_with_kvcache: a KV cache, contiguous or paged
KVCACHE_SEQLENS = (0, 1, 63, 64, 65, 100)   # with 3 new keys each; the cache holds 103 rows


def kvcache_case(dtype=torch.float32, Tq=3, t_new=3, device="cpu"):
    """q [6, Tq, 6, 23], caches [6, 103, 2, 23] (random), new keys and values [6, t_new, 2, 23],
    cache_seqlens KVCACHE_SEQLENS (int32)."""
    B, Tk_max = len(KVCACHE_SEQLENS), 103
    q = make_qkv(B, Tq, 6, 2, 23, dtype=dtype)[0]
    _, k_cache, v_cache = make_qkv(B, Tk_max, 6, 2, 23, dtype=dtype)
    _, k_new, v_new = make_qkv(B, t_new, 6, 2, 23, dtype=dtype)
    seqlens = torch.tensor(KVCACHE_SEQLENS, dtype=torch.int32)
    return [t.to(device) for t in (q, k_cache, v_cache, k_new, v_new, seqlens)]


def paged(cache, page_size, gen, table=None):
    """cache [B, Tk_max, H, D] as a pool of pages (random elsewhere) in a shuffled order (or
    `table`'s), and its int32 page table [B, pages], with 3 spare pages in the pool."""
    B, Tk_max = cache.shape[:2]
    per_row = -(-Tk_max // page_size)
    pool = torch.randn(B * per_row + 3, page_size, *cache.shape[2:], generator=gen).to(cache.dtype)
    if table is None:
        table = torch.randperm(B * per_row + 3, generator=gen)[:B * per_row].view(B, per_row).to(torch.int32)
    for b in range(B):
        for p in range(per_row):
            rows = cache[b, p * page_size:(p + 1) * page_size]
            pool[table[b, p], :rows.shape[0]] = rows
    return pool, table


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_attention_with_kvcache_cpu_matches_float64(dtype, tol):
    """Every mask of MASKS, with new keys appended at ragged cache_seqlens (0, 1, 63, 64, 65, 100)
    and without: the caches hold the new keys at their positions afterwards and are unchanged
    elsewhere; each batch row's output and log-sum-exp against reference.attention_ref over that
    row's keys (0 .. cache_seqlens + new - 1); cache_leftpad and cache_batch_idx move the keys."""
    for appended in (True, False):
        q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(dtype)
        before_k, before_v = k_cache.clone(), v_cache.clone()
        leftpad = torch.tensor([min(n, 5) for n in KVCACHE_SEQLENS], dtype=torch.int32)
        index = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int32)
        new = (k_new, v_new) if appended else (None, None)
        for causal, window, scale, softcap in MASKS:
            kw = dict(causal=causal, window_size=window, softmax_scale=scale, softcap=softcap)
            k_cache.copy_(before_k), v_cache.copy_(before_v)
            out, lse = gqa_module.attention_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=seqlens,
                                                         cache_leftpad=leftpad, cache_batch_idx=index,
                                                         return_lse=True, **kw)
            assert out.shape == q.shape and lse.shape == (6, 6, 3), kw
            for b, n in enumerate(KVCACHE_SEQLENS):
                row = int(index[b])
                end = n + (3 if appended else 0)
                if appended:
                    assert torch.equal(k_cache[row, n:end], k_new[b]) and torch.equal(v_cache[row, n:end], v_new[b])
                changed = torch.zeros(103, dtype=torch.bool)
                changed[n:end] = True
                assert torch.equal(k_cache[row][~changed], before_k[row][~changed]), (kw, b)
                keys = slice(min(n, 5), end)
                q_b, k_b, v_b = q[b:b + 1], k_cache[row, keys][None], v_cache[row, keys][None]
                geo = geometry_of(q_b, k_b, causal, window, scale, softcap)
                assert_rows_close(out[b:b + 1], lse[b:b + 1], *reference_of(q_b, k_b, v_b, geo), tol, (kw, b, appended))


def test_attention_with_kvcache_paged_equals_contiguous():
    """A paged cache (page sizes 16 and 7, pages shuffled in a pool with spare pages) gives the
    contiguous cache's outputs and log-sum-exp bitwise, with cache_batch_idx choosing page-table
    rows (FlashAttention 3's meaning) and cache_leftpad; the new keys land in the right pages."""
    gen = torch.Generator().manual_seed(seed_of("paged kv"))
    for page_size in (16, 7):
        q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case()
        pool_k, table = paged(k_cache, page_size, gen)
        pool_v, _ = paged(v_cache, page_size, gen, table)
        index = torch.tensor([2, 0, 1, 5, 4, 3], dtype=torch.int32)
        leftpad = torch.tensor([min(n, 9) for n in KVCACHE_SEQLENS], dtype=torch.int32)
        kw = dict(cache_seqlens=seqlens, cache_batch_idx=index, cache_leftpad=leftpad, causal=True,
                  window_size=(40, -1), return_lse=True)
        expect = gqa_module.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
        got = gqa_module.attention_with_kvcache(q, pool_k, pool_v, k_new, v_new, page_table=table, **kw)
        assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1]), page_size
        for b, n in enumerate(KVCACHE_SEQLENS):
            for t in range(3):
                position = n + t
                assert torch.equal(pool_k[table[index[b], position // page_size], position % page_size], k_new[b, t])


def test_attention_with_kvcache_packed_rows_equal_row_by_row_calls():
    """FlashAttention 3's packed rows (cu_seqlens_q with max_seqlen_q, cu_seqlens_k_new): each
    batch row's output, log-sum-exp and cache writes equal a call on that row alone (its own
    query count and new keys, rotary and ALiBi included); q rows past the last offset give 0 and
    -inf; the offsets' rules named before any cache is written."""
    gen = torch.Generator().manual_seed(seed_of("packed kvcache"))
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(torch.float64, Tq=4, t_new=4)
    lens_q, lens_new = [1, 4, 0, 2, 3, 4], [2, 4, 1, 0, 3, 1]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_new)), dtype=torch.int32)
    q_packed = torch.cat([q[b, :n] for b, n in enumerate(lens_q)] + [torch.randn(2, 6, 23, generator=gen).double()])
    k_packed, v_packed = (torch.cat([x[b, :n] for b, n in enumerate(lens_new)]) for x in (k_new, v_new))
    seqlens = torch.tensor([0, 1, 63, 64, 65, 99], dtype=torch.int32)
    extra = dict(rotary_cos=torch.rand(110, 4, generator=gen).double(), rotary_sin=torch.rand(110, 4, generator=gen).double(),
                 alibi_slopes=torch.rand(6, 6, generator=gen).double(), causal=True, window_size=(50, -1))
    caches = (k_cache.clone(), v_cache.clone())
    out, lse = gqa_module.attention_with_kvcache(q_packed, *caches, k_packed, v_packed, cache_seqlens=seqlens,
                                                 cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k, max_seqlen_q=4,
                                                 return_lse=True, **extra)
    assert out.shape == q_packed.shape and lse.shape == (6, q_packed.shape[0])
    assert torch.all(out[-2:] == 0) and torch.all(torch.isneginf(lse[:, -2:]))
    alone_caches = (k_cache.clone(), v_cache.clone())
    for b in range(6):
        a, e = int(cu_q[b]), int(cu_q[b + 1])
        row = dict(extra, alibi_slopes=extra["alibi_slopes"][b])
        got = gqa_module.attention_with_kvcache(q[b:b + 1, :lens_q[b]], *alone_caches, k_new[b:b + 1, :lens_new[b]],
                                                v_new[b:b + 1, :lens_new[b]], cache_seqlens=seqlens[b:b + 1],
                                                cache_batch_idx=torch.tensor([b], dtype=torch.int32), return_lse=True,
                                                **row)
        assert torch.equal(out[a:e], got[0][0]) and torch.equal(lse[:, a:e], got[1][0]), b
    assert torch.equal(caches[0], alone_caches[0]) and torch.equal(caches[1], alone_caches[1])
    before = k_cache.clone()
    call = lambda **over: gqa_module.attention_with_kvcache(**{**dict(
        q=q_packed, k_cache=k_cache, v_cache=v_cache, k=k_packed, v=v_packed, cache_seqlens=seqlens, cu_seqlens_q=cu_q,
        cu_seqlens_k_new=cu_k, max_seqlen_q=4), **over})
    for over, error, message in [(dict(max_seqlen_q=3), ValueError, r"max_seqlen_q \(3\) must be at least the longest"),
                                 (dict(max_seqlen_q=None), TypeError, "max_seqlen_q must be an int"),
                                 (dict(cu_seqlens_k_new=cu_k[:-1]), ValueError, "cu_seqlens_k_new must have batch \\+ 1 = 7"),
                                 (dict(cu_seqlens_q=cu_q.long()), ValueError, "cu_seqlens_q must be a 1-D int32"),
                                 (dict(q=q), ValueError, r"q must be 3-D \(with cu_seqlens_q\)"),
                                 (dict(k=k_new, v=v_new), ValueError, r"k must be \[total_new, Hkv \(2\)")]:
        with pytest.raises(error, match=message):
            call(**over)
        assert torch.equal(k_cache, before), over


@needs_gpu
def test_gpu_attention_with_kvcache_packed_rows_and_rotary_match_float64():
    """On CUDA tensors (fp32): packed rows over a KV cache with the rotary embedding, against the
    same call on float64 CPU tensors (outputs within 2e-5 of each row's largest value, caches
    written alike); attention_chunk and alibi_slopes (through PyTorch on the GPU) against float64 CPU
    calls likewise, and bf16 float8_e4m3fn inputs with descales against the same call on the CPU."""
    gen = torch.Generator().manual_seed(seed_of("gpu packed kvcache"))
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(torch.float32, Tq=4, t_new=4)
    lens_q, lens_new = [1, 4, 0, 2, 3, 4], [2, 4, 1, 0, 3, 1]
    cu_q = torch.tensor([0] + list(itertools.accumulate(lens_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(itertools.accumulate(lens_new)), dtype=torch.int32)
    q_packed = torch.cat([q[b, :n] for b, n in enumerate(lens_q)])
    k_packed, v_packed = (torch.cat([x[b, :n] for b, n in enumerate(lens_new)]) for x in (k_new, v_new))
    seqlens = torch.tensor([0, 1, 63, 64, 65, 99], dtype=torch.int32)
    cos, sin = torch.rand(110, 8, generator=gen), torch.rand(110, 8, generator=gen)
    def run(device, dtype):
        caches = [x.to(device, dtype) for x in (k_cache, v_cache)]
        out = gqa_module.attention_with_kvcache(
            q_packed.to(device, dtype), *caches, k_packed.to(device, dtype), v_packed.to(device, dtype),
            cache_seqlens=seqlens.to(device), cu_seqlens_q=cu_q.to(device), cu_seqlens_k_new=cu_k.to(device),
            max_seqlen_q=4, rotary_cos=cos.to(device, dtype), rotary_sin=sin.to(device, dtype), rotary_interleaved=False,
            causal=True, window_size=(40, -1))
        return out.cpu().double(), [x.cpu().double() for x in caches]
    (got, got_caches), (exact, exact_caches) = run("cuda", torch.float32), run("cpu", torch.float64)
    err = (got - exact).abs().amax(dim=-1)
    assert torch.all(err <= 2e-5 * exact.abs().amax(dim=-1).clamp_min(1.0)), float(err.max())
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got_caches, exact_caches))
    slopes = torch.rand(6, generator=gen)
    for kw in (dict(attention_chunk=16), dict(alibi_slopes=slopes), dict(softcap=2.0, window_size=(30, 4))):
        got = gqa_module.attention(*(x[:2].cuda() for x in (q, k_cache, v_cache)), causal=True,
                                   **{n: a.cuda() if isinstance(a, torch.Tensor) else a for n, a in kw.items()})
        exact = gqa_module.attention(*(x[:2].double() for x in (q, k_cache, v_cache)), causal=True,
                                     **{n: a.double() if isinstance(a, torch.Tensor) else a for n, a in kw.items()})
        err = (got.cpu().double() - exact).abs().amax(dim=-1)
        assert torch.all(err <= 2e-5 * exact.abs().amax(dim=-1).clamp_min(1.0)), (kw, float(err.max()))
    f8 = [x[:2].to(torch.float8_e4m3fn) for x in (q, k_cache, v_cache)]
    descales = [torch.rand(2, 2, generator=gen) for _ in range(3)]
    got = gqa_module.attention(*(x.cuda() for x in f8), causal=True, q_descale=descales[0].cuda(),
                               k_descale=descales[1].cuda(), v_descale=descales[2].cuda())
    expect = gqa_module.attention(*f8, causal=True, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    assert got.dtype == torch.bfloat16 and torch.allclose(got.cpu().float(), expect.float(), atol=2e-2, rtol=0)


def test_attention_with_kvcache_rules_name_the_argument():
    """cache_seqlens within the cache less the new keys, cache_leftpad within cache_seqlens,
    cache_batch_idx within the cache (or the page table's rows), page_table int32 [rows, pages]
    into the pool, k and v together and shaped like the cache's rows: each a ValueError or
    TypeError naming it, raised before any cache is written."""
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case()
    before = k_cache.clone()
    call = lambda **over: gqa_module.attention_with_kvcache(**{**dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new,
                                                                       v=v_new, cache_seqlens=seqlens), **over})
    table = torch.zeros(6, 7, dtype=torch.int32)
    cases = [(dict(cache_seqlens=torch.tensor([0, 1, 63, 64, 65, 101], dtype=torch.int32)), ValueError,
              r"cache_seqlens\[5\] must be in 0 .. 100"),
             (dict(cache_seqlens=seqlens.long()), ValueError, "cache_seqlens must be a 1-D int32"),
             (dict(cache_seqlens=[1] * 6), TypeError, "cache_seqlens must be a torch.Tensor"),
             (dict(cache_leftpad=torch.tensor([0, 2, 0, 0, 0, 0], dtype=torch.int32)), ValueError,
              r"cache_leftpad\[1\] must be in 0 .. cache_seqlens\[1\] \(1\)"),
             (dict(cache_batch_idx=torch.tensor([0, 1, 2, 3, 4, 6], dtype=torch.int32)), ValueError,
              r"cache_batch_idx\[5\] \(6\) must index the 6 rows"),
             (dict(page_table=table.long()), ValueError, "page_table must be a 2-D int32 tensor"),
             (dict(page_table=table + 103, cache_seqlens=0), ValueError, r"page_table\[0\] holds page 103"),
             (dict(page_table=table[:5]), ValueError, r"batch row 5 \(5\) must index the 5 rows of page_table"),
             (dict(v=None), ValueError, "k and v .* must be given together"),
             (dict(k=k_new[:, :, :1], v=v_new[:, :, :1]), ValueError, r"k must be \[batch \(6\), new keys, Hkv \(2\)"),
             (dict(k=k_new.double(), v=v_new.double()), ValueError, "k must have k_cache's dtype"),
             (dict(v_cache=v_cache[:, :50]), ValueError, "k_cache and v_cache must have one shape"),
             (dict(q=q[0]), ValueError, "q must be 4-D"),
             (dict(window_size=(0, -2)), ValueError, r"window_size\[1\]")]
    for over, error, message in cases:
        with pytest.raises(error, match=message):
            call(**over)
        assert torch.equal(k_cache, before), over


def turned_by_angles(x, angles, interleaved):
    """x [B, T, H, D] with channel pairs (2i, 2i + 1), or (i, i + half) where not interleaved,
    multiplied as complex numbers by e^(i angle) (angles [B, T, half], float64): the rotary
    embedding's definition, for checking gqa_geometry.rotary."""
    half = angles.shape[-1]
    x64 = x.double()
    if interleaved:
        pairs = torch.view_as_complex(x64[..., :2 * half].reshape(*x.shape[:3], half, 2).contiguous())
    else:
        pairs = torch.complex(x64[..., :half], x64[..., half:2 * half])
    turned = pairs * torch.polar(torch.ones_like(angles), angles).unsqueeze(2)
    parts = (torch.view_as_real(turned).flatten(-2) if interleaved else torch.cat((turned.real, turned.imag), dim=-1))
    return torch.cat((parts, x64[..., 2 * half:]), dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_attention_with_kvcache_rotary_is_attention_over_turned_inputs(dtype, tol):
    """rotary_cos and rotary_sin (FlashAttention's rotary embedding, interleaved and GPT-NeoX
    pairs, rotary_dim 8 and 22 of head_dim 23): the caches afterwards and the outputs equal a call
    without rotary on q and new keys turned by the definition (complex products by e^(i angle)):
    key s of row b at position start + s, query s too where the call is causal or local, else
    every query at start; start is cache_seqlens[b], or rotary_seqlens[b] where given. A window
    side of the cache's 103 rows or more is not local (FlashAttention's rule)."""
    gen = torch.Generator().manual_seed(seed_of("rotary"))
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(dtype)
    leftpad = torch.tensor([min(n, 5) for n in KVCACHE_SEQLENS], dtype=torch.int32)
    index = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int32)
    shifted = torch.tensor([7, 0, 30, 64, 2, 90], dtype=torch.int32)
    for half, interleaved, rotary_seqlens, causal, window, per_query in [
            (4, True, None, True, (-1, -1), True), (11, False, None, False, (5, 2), True),
            (11, True, shifted, False, (-1, -1), False), (4, False, shifted, True, (40, -1), True),
            (4, True, None, False, (103, -1), False), (11, False, None, False, (102, -1), True)]:
        angles = torch.rand(110, half, generator=gen, dtype=torch.float64) * 2 * math.pi
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
        start = (seqlens if rotary_seqlens is None else rotary_seqlens).long().view(-1, 1)
        q_rows = start + torch.arange(q.shape[1]) * per_query
        q_turned = turned_by_angles(q, angles[q_rows], interleaved)
        k_turned = turned_by_angles(k_new, angles[start + torch.arange(k_new.shape[1])], interleaved)
        what = (half, interleaved, rotary_seqlens is not None, causal, window)
        common = dict(cache_seqlens=seqlens, cache_leftpad=leftpad, cache_batch_idx=index, causal=causal,
                      window_size=window, return_lse=True)
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        got = gqa_module.attention_with_kvcache(q, *caches[0], k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                rotary_interleaved=interleaved, rotary_seqlens=rotary_seqlens, **common)
        expect = gqa_module.attention_with_kvcache(q_turned, *caches[1], k_turned, v_new, **common)
        assert torch.allclose(caches[0][0], caches[1][0], rtol=tol, atol=tol), what
        assert torch.equal(caches[0][1], caches[1][1]), what   # values are not turned
        assert torch.allclose(got[0], expect[0], rtol=tol, atol=tol) and torch.allclose(got[1], expect[1], rtol=tol), what
        assert not torch.allclose(got[0], gqa_module.attention_with_kvcache(
            q, k_cache.clone(), v_cache.clone(), k_new, v_new, **common)[0], rtol=tol, atol=tol), what


def test_attention_with_kvcache_rotary_rules_name_the_argument():
    """rotary_cos with rotary_sin, both 2-D float [rows, rotary_dim / 2] of one shape, rotary_dim
    within head_dim, enough rows for every position turned, the new keys given, rotary_interleaved
    a bool, rotary_seqlens int32 [B] (without rotary_cos it turns nothing, as in FlashAttention 3,
    but is checked): each a ValueError or TypeError naming it, raised before any cache is written."""
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case()
    before = k_cache.clone()
    cos = torch.ones(110, 4)
    call = lambda **over: gqa_module.attention_with_kvcache(**{**dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=seqlens, rotary_cos=cos,
        rotary_sin=cos, causal=True), **over})
    cases = [(dict(rotary_sin=None), ValueError, "rotary_cos and rotary_sin must be given together"),
             (dict(k=None, v=None), ValueError, "rotary_cos and rotary_sin need the new keys k and v"),
             (dict(rotary_cos=torch.ones(110, 12), rotary_sin=torch.ones(110, 12)), ValueError,
              r"rotary_dim \(twice rotary_cos.shape\[1\], 24\) must be in 2 .. head_dim \(23\)"),
             (dict(rotary_cos=torch.ones(102, 4), rotary_sin=torch.ones(102, 4)), ValueError,
              r"batch row 5 turns by rows 100 .. 102 of rotary_cos and rotary_sin, which have 102"),
             (dict(rotary_sin=torch.ones(110, 5)), ValueError, "rotary_sin must be a 2-D float tensor"),
             (dict(rotary_cos=torch.ones(110, 4, dtype=torch.int32)), ValueError, "rotary_cos must be a 2-D float"),
             (dict(rotary_cos=[[1.0]]), TypeError, "rotary_cos must be a torch.Tensor"),
             (dict(rotary_interleaved=1), TypeError, "rotary_interleaved must be a bool"),
             (dict(rotary_seqlens=seqlens.long()), ValueError, "rotary_seqlens must be a 1-D int32"),
             (dict(rotary_cos=None, rotary_sin=None, rotary_seqlens=seqlens[:5]), ValueError,
              "rotary_seqlens must have 6 values")]
    for over, error, message in cases:
        with pytest.raises(error, match=message):
            call(**over)
        assert torch.equal(k_cache, before), over


@needs_gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_gpu_attention_with_kvcache_matches_float64(dtype, tol):
    """attention_with_kvcache on CUDA tensors (attention()'s kernels per batch row), new keys
    appended at ragged cache_seqlens: the caches as on the CPU, each row's output and log-sum-exp
    against the float64 path, every mask of MASKS but softcap; a paged cache (page 16) bitwise
    the contiguous one's."""
    gen = torch.Generator().manual_seed(seed_of("paged kv gpu"))
    q, k_cache, v_cache, k_new, v_new, seqlens = kvcache_case(dtype)
    pool_k, table = paged(k_cache, 16, gen)
    pool_v, _ = paged(v_cache, 16, gen, table)
    for causal, window, scale, softcap in MASKS:
        if softcap:
            continue
        kw = dict(causal=causal, window_size=window, softmax_scale=scale, return_lse=True)
        exact_k, exact_v = k_cache.double(), v_cache.double()
        exact = gqa_module.attention_with_kvcache(q.double(), exact_k, exact_v, k_new.double(), v_new.double(),
                                                  cache_seqlens=seqlens, **kw)
        caches = [t.cuda() for t in (k_cache, v_cache)]
        got = gqa_module.attention_with_kvcache(q.cuda(), *caches, k_new.cuda(), v_new.cuda(),
                                                cache_seqlens=seqlens.cuda(), **kw)
        assert torch.equal(caches[0].cpu().double(), exact_k) and torch.equal(caches[1].cpu().double(), exact_v)
        assert_rows_close(got[0].cpu(), got[1].cpu(), *exact, tol, kw)
        pools = [t.cuda() for t in (pool_k, pool_v)]
        paged_got = gqa_module.attention_with_kvcache(q.cuda(), *pools, k_new.cuda(), v_new.cuda(),
                                                      cache_seqlens=seqlens.cuda(), page_table=table.cuda(), **kw)
        assert torch.equal(paged_got[0], got[0]) and torch.equal(paged_got[1], got[1]), kw   # the same keys


def test_attention_cuda_routes_name_the_option():
    """Which CUDA kernels a call takes (no GPU needed): causal_gqa_attention's for causal attention
    with Tq = Tk, the default scale (within float32 rounding) and no log-sum-exp, windows that equal
    the causal mask included; the row-wise kernels of any geometry otherwise; softcap is named as
    what no CUDA kernel runs."""
    q, k = torch.empty(1, 10, 4, 64), torch.empty(1, 10, 2, 64)
    def route(kv=k, **kw):
        args = dict(causal=True, softmax_scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False)
        args.update(kw)
        geo = gqa_geometry.arguments(q, kv, **args)
        gap = gqa_geometry.cuda_gap(geo, 64)
        return gap if gap else "causal" if gqa_geometry.takes_causal_kernels(geo, 64) else "rows"
    assert route() == route(window_size=(9, 5)) == route(causal=False, window_size=(-1, 0)) == "causal"
    assert route(softmax_scale=64 ** -0.5) == route(softmax_scale=float(torch.tensor(0.125))) == "causal"
    # window sides as FlashAttention takes them: anything with __index__ (torch.randint gives 0-d tensors)
    assert route(window_size=torch.tensor([9, 5])) == "causal" and route(window_size=(torch.tensor(3), None)) == "rows"
    assert route(return_lse=True) == route(causal=False) == route(window_size=(8, -1)) == "rows"
    assert route(softmax_scale=0.1) == route(kv=torch.empty(1, 12, 2, 64)) == "rows"
    assert route(softcap=30.0) == "softcap=30.0"
    assert route(attention_chunk=4) == "attention_chunk=4" and route(attention_chunk=10) == "causal"   # 10 keys
    assert route(alibi_slopes=torch.rand(4)) == "alibi_slopes"


@needs_gpu
@pytest.mark.parametrize("shape", [(1, 600, 8, 2, 128), (2, 300, 6, 3, 64), (1, 2048, 32, 8, 128)])
def test_gpu_fp32_backward_on_uneven_inputs_within_4x_of_sdpa(shape):
    """fp32 gradients on inputs of uneven magnitude (bench/uneven_backward.py's cases: rows of
    grad_out over 1e-4..1e4, channels of k or q over 1e-8..1, channels of grad_out over 1e-4..1e4,
    and two decades of grad_out rows, which x3 keeps): the worst row and the worst (head, channel)
    error of dq, dk and dv against float64 autograd within 4x of SDPA's memory-efficient backward
    on the same inputs. The x3 plans flag such calls for the row-wise fp32 kernels."""
    uneven = load_bench_script("uneven_backward")
    B, T, Hq, Hkv, D = shape
    for which, by, lo, hi in uneven.CASES + [("grad_out", "rows", -1, 1)]:
        gen = torch.Generator().manual_seed(seed_of("uneven", shape, which, by, lo))
        q, k, v = (torch.randn(B, T, H, D, generator=gen).cuda() for H in (Hq, Hkv, Hkv))
        grad_out = torch.randn(B, T, Hq, D, generator=gen).cuda()
        tensors = dict(q=q, k=k, v=v, grad_out=grad_out)
        tensors[which] = uneven.scaled(tensors[which], by, lo, hi, gen)
        q, k, v, grad_out = (tensors[n] for n in ("q", "k", "v", "grad_out"))
        assert gqa_module.backward_plan(q, k, v) == ("bwdx3/fp32/d%d" % D)
        exact = uneven.reference_grads(q, k, v, grad_out)
        ours, theirs = uneven.project_grads(q, k, v, grad_out), uneven.sdpa_efficient_grads(q, k, v, grad_out)
        for name, a, b, ref in zip(("dq", "dk", "dv"), ours, theirs, exact):
            (row_a, chan_a), (row_b, chan_b) = uneven.worst_errors(a, ref), uneven.worst_errors(b, ref)
            what = (shape, which, by, lo, hi, name, row_a, row_b, chan_a, chan_b)
            assert row_a <= 4 * max(row_b, 1e-7) and chan_a <= 4 * max(chan_b, 1e-7), what


@needs_gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_gpu_options_without_kernels_match_float64(dtype, tol):
    """The options no CUDA kernel computes (softcap, ALiBi, attention_chunk, learnable_sink,
    head_dim_v != head_dim, qv; PyTorch's ops on the GPU) on CUDA tensors: outputs and log-sum-exps row by row against
    reference.attention_ref, and dq, dk, dv against float64 autograd of the CPU path, row by row."""
    gen = torch.Generator().manual_seed(seed_of("gpu options", dtype))
    q, k, _ = masked_qkv(2, 65, 63, 6, 2, 23, dtype)
    v40 = torch.randn(2, 63, 2, 40, generator=gen).to(dtype)
    qv = torch.randn(2, 65, 6, 40, generator=gen).to(dtype)
    slopes = torch.rand(6, generator=gen)
    for v, extra in ((q[:, :63, :2], dict(softcap=3.0, window_size=(20, 5))), (q[:, :63, :2], dict(attention_chunk=16)),
                     (q[:, :63, :2], dict(alibi_slopes=slopes)), (q[:, :63, :2], dict(learnable_sink=slopes - 0.5)),
                     (v40, dict()), (v40, dict(qv=qv))):
        leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
        cuda_extra = {n: x.cuda() if isinstance(x, torch.Tensor) else x for n, x in extra.items()}
        out, lse = gqa_module.attention(*leaves, causal=True, return_lse=True, **cuda_extra)
        exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        wide_extra = {n: x.double() if isinstance(x, torch.Tensor) else x for n, x in extra.items()}
        exact_out, exact_lse = gqa_module.attention(*exact_leaves, causal=True, return_lse=True, **wide_extra)
        assert_rows_close(out.cpu(), lse.cpu(), exact_out.detach(), exact_lse.detach(), tol, list(extra))
        grad_out = torch.randn(out.shape, generator=gen).to(dtype)
        grads = torch.autograd.grad(out, leaves, grad_out.cuda())
        exact = torch.autograd.grad(exact_out, exact_leaves, grad_out.double())
        for name, got, ref in zip(("dq", "dk", "dv"), grads, exact):
            err = (got.cpu().double() - ref).abs().amax(dim=-1)
            assert torch.all(err <= 10 * tol * ref.abs().amax(dim=-1).clamp_min(1.0)), (list(extra), name)


@needs_gpu
def test_gpu_attention_routes_causal_and_runs_the_rest():
    """On CUDA tensors attention() with a causal geometry is causal_gqa_attention's result, bit for
    bit; other geometries run the row-wise kernels; softcap runs through PyTorch on the GPU, equal
    to the CPU path's result on the same values within float32 rounding."""
    q, k, v = make_qkv(2, 65, 6, 2, 64, device="cuda", dtype=torch.bfloat16)
    expect = gqa_module.causal_gqa_attention(q, k, v)
    for kw in (dict(causal=True), dict(window_size=(-1, 0)), dict(causal=True, window_size=(64, 3)),
               dict(causal=True, softmax_scale=0.125)):
        assert torch.equal(gqa_module.attention(q, k, v, **kw), expect), kw
    out, lse = gqa_module.attention(q, k, v, causal=True, return_lse=True)
    assert torch.allclose(out.float(), expect.float(), atol=2e-2) and lse.shape == (2, 6, 65)
    capped = gqa_module.attention(q, k, v, causal=True, softcap=5.0)
    on_cpu = gqa_module.attention(q.cpu(), k.cpu(), v.cpu(), causal=True, softcap=5.0)
    assert capped.is_cuda and capped.dtype == q.dtype
    assert torch.allclose(capped.cpu().float(), on_cpu.float(), atol=1e-2, rtol=0)


@needs_gpu
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_gpu_attention_every_mask_matches_float64(dtype, tol):
    """CUDA attention() on every mask of MASKS at every (Tq, Tk) of LENGTHS, odd head_dim and GQA
    3:1 (softcap through PyTorch on the GPU, the rest on the kernels): each output row and
    log-sum-exp against reference.attention_ref (rows that see no key exactly 0 and -inf), and dq,
    dk, dv row by row against float64 autograd of the CPU path."""
    for Tq, Tk in LENGTHS:
        for causal, window, scale, softcap in MASKS:
            q, k, v = masked_qkv(2, Tq, Tk, 6, 2, 23, dtype)
            geo = geometry_of(q, k, causal, window, scale, softcap)
            what = (dtype, Tq, Tk, causal, window, scale, softcap)
            leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
            out, lse = gqa_module.attention(*leaves, causal=causal, window_size=window, softmax_scale=scale,
                                            softcap=softcap, return_lse=True)
            assert_rows_close(out.cpu(), lse.cpu(), *reference_of(q, k, v, geo), tol, what)
            grad_out = torch.randn(out.shape, dtype=torch.float64)
            grads = torch.autograd.grad(out, leaves, grad_out.to(dtype).cuda())
            exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
            exact = torch.autograd.grad(gqa_geometry.attention_torch(*exact_leaves, geo)[0], exact_leaves,
                                        grad_out.to(dtype).double())
            for name, got, ref in zip(("dq", "dk", "dv"), grads, exact):
                err = (got.cpu().double() - ref).abs().amax(dim=-1)
                size = ref.abs().amax(dim=-1).clamp_min(1.0)
                assert torch.all(err <= tol * (10 if dtype == torch.float32 else 1.5) * size), (
                    what, name, float((err / size).max()))


@needs_gpu
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_gpu_attention_rows_nonfinite_like_reference(which):
    """NaN, +Inf and -Inf in one element of q, k or v, on the row-wise kernels of any geometry (Tq !=
    Tk, windows, no mask): NaN, +Inf and -Inf of the output, the log-sum-exp and dq, dk, dv where the
    float64 path (rows over the keys they see) puts them."""
    for causal, window, (Tq, Tk) in ((True, (8, -1), (40, 65)), (False, (4, 4), (65, 40)), (False, (-1, -1), (65, 65))):
        for pos, bad in ((0, NAN), (37, INF), (39, -INF)):
            q, k, v = masked_qkv(1, Tq, Tk, 4, 2, 16, torch.float32)
            dict(q=q, k=k, v=v)[which][0, pos, 1, 3] = bad
            geo = geometry_of(q, k, causal, window, None, 0.0)
            leaves = [t.cuda().requires_grad_(True) for t in (q, k, v)]
            out, lse = gqa_module.attention(*leaves, causal=causal, window_size=window, return_lse=True)
            grad_out = torch.randn(out.shape)
            grads = torch.autograd.grad(out, leaves, grad_out.cuda())
            exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
            ref_out, ref_lse = gqa_geometry.attention_torch(*exact_leaves, geo)
            exact = torch.autograd.grad(ref_out, exact_leaves, grad_out.double())
            for name, got, ref in (("out", out, ref_out), ("lse", lse, ref_lse), *zip(("dq", "dk", "dv"), grads, exact)):
                for test in (torch.isnan, torch.isposinf, torch.isneginf):
                    assert torch.equal(test(got.detach().cpu()), test(ref.detach())), (which, causal, window, pos,
                                                                                       bad, name, test.__name__)


# ------------------------------------------------------------------------------------------------
# kernels/common/geometry.cuh: every range and coverage against FlashAttention's definition
GEOMETRY_CHECK = r"""
// Every range and coverage of common/geometry.cuh against the definition, pair by pair, over all
// small geometries: prints "ok <cases>" or the first disagreement.
#include <cstdio>
#include "common/geometry.cuh"

static bool sees_def(int Tq, int Tk, int L, int R, int i, int j) {   // FlashAttention's definition
    if (i < 0 || i >= Tq || j < 0 || j >= Tk) return false;
    const int a = i + Tk - Tq;
    return (L < 0 || j >= a - L) && (R < 0 || j <= a + R);
}

static bool same(GqaRange r, int first, int last) {
    return r.empty() ? first > last : r.first == first && r.last == last;
}

int main() {
    long cases = 0;
    for (int Tq = 0; Tq <= 7; ++Tq)
    for (int Tk = 0; Tk <= 7; ++Tk)
    for (int causal = 0; causal <= 1; ++causal)
    for (int wl = -1; wl <= 8; ++wl)
    for (int wr = -1; wr <= 8; ++wr) {
        const GqaGeometry g = gqa_geometry(Tq, Tk, causal, wl, wr);
        const int L = wl, R = causal ? 0 : wr;   // the arguments as given, before normalising
        for (int i = -2; i < Tq + 2; ++i)
            for (int j = -2; j < Tk + 2; ++j)
                if (g.sees(i, j) != sees_def(Tq, Tk, L, R, i, j)) {
                    printf("sees Tq=%d Tk=%d causal=%d window=(%d,%d) i=%d j=%d\n", Tq, Tk, causal, wl, wr, i, j);
                    return 1;
                }
        for (int a0 = -2; a0 < 10; ++a0)
        for (int a1 = a0 - 1; a1 < 10; ++a1) {
            // rows [a0, a1]: keys seen by any, by all (rows outside the sequence see nothing)
            int any_f = 1 << 20, any_l = -1, all_f = 1 << 20, all_l = -1;
            bool rows_inside = a0 <= a1 && a0 >= 0 && a1 < Tq;
            for (int j = 0; j < Tk; ++j) {
                bool some = false, every = rows_inside;
                for (int i = a0; i <= a1; ++i) some |= sees_def(Tq, Tk, L, R, i, j), every &= sees_def(Tq, Tk, L, R, i, j);
                if (some) any_f = any_f < j ? any_f : j, any_l = j;
                if (every) all_f = all_f < j ? all_f : j, all_l = j;
            }
            if (!same(g.keys_any(a0, a1), any_f, any_l) || !same(g.keys_all(a0, a1), all_f, all_l)) {
                printf("keys Tq=%d Tk=%d causal=%d window=(%d,%d) rows=[%d,%d]\n", Tq, Tk, causal, wl, wr, a0, a1);
                return 1;
            }
            // keys [a0, a1]: queries that see any, that see all
            int qa_f = 1 << 20, qa_l = -1, ql_f = 1 << 20, ql_l = -1;
            bool keys_inside = a0 <= a1 && a0 >= 0 && a1 < Tk;
            for (int i = 0; i < Tq; ++i) {
                bool some = false, every = keys_inside;
                for (int j = a0; j <= a1; ++j) some |= sees_def(Tq, Tk, L, R, i, j), every &= sees_def(Tq, Tk, L, R, i, j);
                if (some) qa_f = qa_f < i ? qa_f : i, qa_l = i;
                if (every) ql_f = ql_f < i ? ql_f : i, ql_l = i;
            }
            if (!same(g.queries_any(a0, a1), qa_f, qa_l) || !same(g.queries_all(a0, a1), ql_f, ql_l)) {
                printf("queries Tq=%d Tk=%d causal=%d window=(%d,%d) keys=[%d,%d]\n", Tq, Tk, causal, wl, wr, a0, a1);
                return 1;
            }
            for (int tile = 1; tile <= 4; ++tile) {   // the tiles holding those keys and queries
                const GqaRange kt = g.key_tiles(a0, a1, tile), qt = g.query_tiles(a0, a1, tile);
                if (!same(kt, any_l < 0 ? 1 : any_f / tile, any_l < 0 ? 0 : any_l / tile) ||
                    !same(qt, qa_l < 0 ? 1 : qa_f / tile, qa_l < 0 ? 0 : qa_l / tile)) {
                    printf("tiles Tq=%d Tk=%d causal=%d window=(%d,%d) range=[%d,%d] tile=%d\n", Tq, Tk, causal, wl, wr,
                           a0, a1, tile);
                    return 1;
                }
            }
            for (int b0 = -1; b0 < 9; ++b0)   // blocks rows [a0, a1] x keys [b0, b0 + 2]
            for (int b1 = b0; b1 <= b0 + 2; ++b1) {
                int seen = 0, pairs = 0;
                for (int i = a0; i <= a1; ++i)
                    for (int j = b0; j <= b1; ++j) seen += sees_def(Tq, Tk, L, R, i, j), ++pairs;
                const GqaCoverage want = seen == 0 ? kGqaNone : seen == pairs ? kGqaFull : kGqaPartial;
                if (pairs > 0 && g.coverage(a0, a1, b0, b1) != want) {
                    printf("coverage Tq=%d Tk=%d causal=%d window=(%d,%d) rows=[%d,%d] keys=[%d,%d]\n", Tq, Tk, causal,
                           wl, wr, a0, a1, b0, b1);
                    return 1;
                }
                ++cases;
            }
        }
    }
    printf("ok %ld\n", cases);
    return 0;
}
"""


def test_geometry_ranges_match_the_definition(tmp_path):
    """The geometry layer's sees, key and query ranges (any and all), tile ranges and block
    coverage, compiled as host C++, against the definition pair by pair: every Tq and Tk in 0..7,
    causal or not, every window side in -1..8 (normalised by gqa_geometry), row and key ranges
    reaching past both ends, tiles of 1..4."""
    source = tmp_path / "geometry_check.cpp"
    source.write_text(GEOMETRY_CHECK)
    exe = tmp_path / "geometry_check"
    cxx = os.environ.get("CXX", "c++")
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-I", os.path.join(HERE, "kernels"),
                            str(source), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("ok "), run.stdout + run.stderr
    assert int(run.stdout.split()[1]) > 10 ** 7, run.stdout


# ------------------------------------------------------------------------------------------------
# transformers (gqa_transformers.py): tiny random-init models with GQA, the library against SDPA
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (pip install transformers)")


def tiny_causal_lm(family, attn, **overrides):
    """A random-init Llama, Qwen2, Mistral, Gemma 2 or gpt-oss (two experts, one a token) with GQA (4
    query heads, 2 kv heads, head_dim 16), the same weights for every `attn` (seeded), in eval mode
    (no dropout)."""
    import transformers
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig, "gemma2": transformers.Gemma2Config,
                    "gpt_oss": transformers.GptOssConfig}[family]
    config = config_class(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          **dict(dict(head_dim=16), **(dict(num_local_experts=2, num_experts_per_tok=1)
                                                      if family == "gpt_oss" else {}), **overrides))
    torch.manual_seed(seed_of("tiny model", family))
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad()
    loss = model(ids, labels=ids, use_cache=False, **kwargs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_transformers_training_step_matches_sdpa(family):
    """A training step (loss and every parameter's gradient) through the library's attention equals
    transformers' SDPA attention's on the same weights (CPU: the library's PyTorch path)."""
    import gqa_transformers
    name = gqa_transformers.register()
    ids = torch.randint(0, 128, (2, 40))
    ours, ref = tiny_causal_lm(family, name), tiny_causal_lm(family, "sdpa")
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(ours, ids), loss_and_grads(ref, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    for key, grad in grads.items():
        assert torch.allclose(grad, ref_grads[key], rtol=1e-4, atol=1e-6), key


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_transformers_generation_and_scaling_match_sdpa(family):
    """Served by the library (CPU: its PyTorch path; registered with no fallback, so a call it did
    not serve would raise): greedy generate() over a dynamic KV cache (prefill, then one query
    against the cache per step: causal aligned bottom-right) gives SDPA's tokens; a non-default
    scaling gives SDPA's logits."""
    import gqa_transformers
    name = gqa_transformers.register()
    ours, ref = tiny_causal_lm(family, name), tiny_causal_lm(family, "sdpa")
    ids = torch.randint(0, 128, (2, 12))
    kwargs = dict(attention_mask=torch.ones(2, 12, dtype=torch.long), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), ref.generate(ids, **kwargs))
        for model in (ours, ref):
            for layer in model.model.layers:
                layer.self_attn.scaling = 0.3
        assert torch.allclose(ours(ids).logits, ref(ids).logits, atol=1e-5)


@needs_transformers
@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", None), ("mistral", 8)])
def test_transformers_packed_sequences_match_sdpa(family, window):
    """Sequences packed into one row (position_ids restarting at 0, lengths 1, 20, 7 and 12) run
    attention_varlen once the mask is checked to be the packed causal one (Mistral: with a sliding
    window of 8 inside each sequence): logits, and a training step's loss and gradients, as SDPA's
    on the same mask; the same from the offsets a padding-free collator passes (cu_seq_lens_q/k),
    with and without that mask."""
    import gqa_transformers
    name = gqa_transformers.register()
    extra = {} if window is None else dict(sliding_window=window)
    ours, ref = tiny_causal_lm(family, name, **extra), tiny_causal_lm(family, "sdpa", **extra)
    ids = torch.randint(0, 128, (1, 40))
    positions = torch.cat([torch.arange(n) for n in (1, 20, 7, 12)]).view(1, 40)
    offsets = torch.tensor([0, 1, 21, 28, 40], dtype=torch.int32)
    flash_kwargs = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=20, max_length_k=20)
    with torch.no_grad():   # (with a cache transformers does not look for packed sequences)
        expect = ref(ids, position_ids=positions, use_cache=False).logits
        assert torch.allclose(ours(ids, position_ids=positions, use_cache=False).logits, expect, atol=1e-5)
        # the collator's offsets (return_flash_attn_kwargs), alone and beside the mask they agree with
        assert torch.allclose(ours(ids, position_ids=positions, use_cache=False, **flash_kwargs).logits, expect, atol=1e-5)
        if window is None:   # with a cache: no mask, the offsets alone
            assert torch.allclose(ours(ids, position_ids=positions, **flash_kwargs).logits, expect, atol=1e-5)
        else:                # the window's mask, built without the packing, disagrees with them: refused
            with pytest.raises(ValueError, match=re.escape("packed sequences (cu_seq_lens)")):
                ours(ids, position_ids=positions, **flash_kwargs)
        # the packing changes the logits (so the mask was not dropped)
        assert not torch.allclose(expect, ref(ids, position_ids=positions).logits, atol=1e-3)
    (loss, grads), (ref_loss, ref_grads) = (loss_and_grads(m, ids, position_ids=positions) for m in (ours, ref))
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    for key, grad in grads.items():
        assert torch.allclose(grad, ref_grads[key], rtol=1e-4, atol=1e-6), key


@needs_transformers
@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", None), ("mistral", 16)])
def test_transformers_padding_windows_and_caches_match_sdpa(family, window):
    """Served by the library once each row's mask is checked to be the causal one over its own keys
    (registered with no fallback, so an unserved call would raise): a left-padded batch's logits at
    its tokens, a training step on it (loss and gradients), and greedy generate() from left-padded
    prompts with a dynamic and a static cache, against SDPA; Mistral with a sliding window of 16
    over 40 tokens (which changes the logits, so the window was not dropped)."""
    import gqa_transformers
    name = gqa_transformers.register()
    extra = {} if window is None else dict(sliding_window=window)
    ours, ref = tiny_causal_lm(family, name, **extra), tiny_causal_lm(family, "sdpa", **extra)
    ids = torch.randint(0, 128, (2, 40))
    padded = torch.ones(2, 40, dtype=torch.long)
    padded[0, :5] = 0
    with torch.no_grad():
        got, expect = ours(ids, attention_mask=padded).logits, ref(ids, attention_mask=padded).logits
        assert torch.allclose(got[0, 5:], expect[0, 5:], atol=1e-5) and torch.allclose(got[1], expect[1], atol=1e-5)
        for cache in ("dynamic", "static"):
            kwargs = dict(attention_mask=padded[:, :30], max_new_tokens=8, do_sample=False, cache_implementation=cache)
            assert torch.equal(ours.generate(ids[:, :30], **kwargs), ref.generate(ids[:, :30], **kwargs)), cache
        if window is not None:
            assert not torch.allclose(tiny_causal_lm(family, "sdpa")(ids).logits, ref(ids).logits, atol=1e-3)
    labels = ids.masked_fill(padded == 0, -100)
    results = []
    for model in (ours, ref):
        model.zero_grad()
        loss = model(ids, attention_mask=padded, labels=labels, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {key: p.grad.clone() for key, p in model.named_parameters()}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    for key, grad in grads.items():
        assert torch.allclose(grad, ref_grads[key], rtol=1e-4, atol=1e-6), key


def matches_eager(family, device, dtype=torch.float32):
    """Gemma 2 (a soft cap of 50 on the scores) or gpt-oss (attention sinks), their layers
    alternating a sliding window of 8 and full attention, with eager attention as the peer (neither
    has SDPA in transformers): a training step's loss and gradients and greedy generate() over a
    dynamic cache against eager attention's."""
    import gqa_transformers
    name = gqa_transformers.register()
    ours, ref = (tiny_causal_lm(family, attn, sliding_window=8).to(device, dtype) for attn in (name, "eager"))
    assert "sliding_attention" in ours.config.layer_types
    ids = torch.randint(0, 128, (2, 40), device=device)
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(ours, ids), loss_and_grads(ref, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    for key, grad in grads.items():
        assert torch.allclose(grad, ref_grads[key], rtol=1e-4, atol=1e-5), key
    kwargs = dict(attention_mask=torch.ones(2, 12, dtype=torch.long, device=device), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids[:, :12], **kwargs), ref.generate(ids[:, :12], **kwargs))


@needs_transformers
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_transformers_softcap_and_sinks_match_eager(family):
    """Gemma 2's soft cap and gpt-oss's attention sinks on the CPU path: matches_eager."""
    matches_eager(family, "cpu")


@needs_gpu
@needs_transformers
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_gpu_transformers_softcap_and_sinks_match_eager(family):
    """Gemma 2 and gpt-oss on CUDA tensors in fp32 (softcap and sinks through PyTorch on the GPU):
    matches_eager."""
    matches_eager(family, "cuda")


def llama4_matches_sdpa(device, dtype=torch.float32):
    """Llama 4's text model (three chunked-attention layers of chunk 8, one full; GQA 4:2): a
    training step's loss and gradients, a left-padded batch's logits, and greedy generate() over a
    dynamic and a static cache, all served by the library (registered with no fallback: the chunked
    masks are checked element by element and run as attention_chunk) and equal to SDPA's."""
    import transformers
    import gqa_transformers
    name = gqa_transformers.register()
    def model(attn):   # a config each: from_config records the implementation in the config
        config = transformers.Llama4TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            attention_chunk_size=8, num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2)
        torch.manual_seed(seed_of("tiny model", "llama4"))
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).to(device, dtype).eval()
    ours, ref = model(name), model("sdpa")
    assert ours.config.layer_types.count("chunked_attention") == 3
    ids = torch.randint(0, 128, (2, 40), device=device)
    (loss, grads), (ref_loss, ref_grads) = loss_and_grads(ours, ids), loss_and_grads(ref, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (loss, ref_loss)
    for key, grad in grads.items():
        assert torch.allclose(grad, ref_grads[key], rtol=1e-4, atol=1e-5), key
    mask = torch.ones(2, 40, dtype=torch.long, device=device)
    mask[1, :5] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
        assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-5)
        kwargs = dict(attention_mask=mask[:, :20], max_new_tokens=12, do_sample=False)
        for cache in ("dynamic", "static"):
            assert torch.equal(ours.generate(ids[:, :20], cache_implementation=cache, **kwargs),
                               ref.generate(ids[:, :20], cache_implementation=cache, **kwargs)), cache


@needs_transformers
def test_transformers_llama4_chunked_attention_matches_sdpa():
    """Llama 4 on the CPU path: llama4_matches_sdpa."""
    llama4_matches_sdpa("cpu")


@needs_gpu
@needs_transformers
def test_gpu_transformers_llama4_chunked_attention_matches_sdpa():
    """Llama 4 on CUDA tensors in fp32 (attention_chunk through PyTorch on the GPU): llama4_matches_sdpa."""
    llama4_matches_sdpa("cuda")


@needs_transformers
def test_transformers_never_drops_a_mask():
    """What the library does not compute raises a ValueError naming it: packed sequences in two
    rows, a custom 4-D mask that is no row's causal span, attention dropout; an all-ones padding
    mask and a window longer than the keys run."""
    import gqa_transformers
    name = gqa_transformers.register()
    model = tiny_causal_lm("llama", name)
    ids = torch.randint(0, 128, (2, 40))
    packed = torch.cat([torch.arange(20), torch.arange(20)]).view(1, 40)
    custom = torch.ones(2, 1, 40, 40, dtype=torch.bool).tril()
    custom[:, :, 30:, 10:20] = False   # a hole in the middle of the keys
    cases = [("attention mask", lambda: model(ids, position_ids=torch.cat([packed, packed]), use_cache=False)),
             ("attention mask", lambda: model(ids, attention_mask=custom, use_cache=False)),
             ("attention dropout (0.5)", lambda: tiny_causal_lm("llama", name, attention_dropout=0.5).train()(ids))]
    for words, call in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()
    assert model(ids, attention_mask=torch.ones(2, 40, dtype=torch.long)).logits.shape == (2, 40, 128)
    assert tiny_causal_lm("mistral", name, sliding_window=64)(ids).logits.shape == (2, 40, 128)
    with pytest.raises(ValueError, match="fallback must be None or"):
        gqa_transformers.register(fallback="eager")


@needs_transformers
def test_transformers_fallback_runs_sdpa_and_says_so_once(capfd):
    """Registered with fallback="sdpa": packed sequences in two rows give SDPA's logits, attention
    dropout runs, each kind of call the library does not serve is named once on stderr, and calls
    it serves (a padded batch) stay with the library."""
    import gqa_transformers
    name = gqa_transformers.register("gqa_causal_or_sdpa", fallback="sdpa")
    ours, ref = tiny_causal_lm("qwen2", name), tiny_causal_lm("qwen2", "sdpa")
    ids = torch.randint(0, 128, (2, 24))
    packed = torch.cat([torch.arange(12), torch.arange(12)]).view(1, 24).repeat(2, 1)
    padded = torch.ones(2, 24, dtype=torch.long)
    padded[1, :3] = 0
    with torch.no_grad():
        for _ in range(2):
            assert torch.allclose(ours(ids, position_ids=packed, use_cache=False).logits,
                                  ref(ids, position_ids=packed, use_cache=False).logits, atol=1e-6)
        ours(ids, attention_mask=padded)
    assert torch.isfinite(tiny_causal_lm("qwen2", name, attention_dropout=0.5).train()(ids).logits).all()
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("gqa_transformers")]
    assert len(said) == len(set(said)) == 2 and all("runs transformers' SDPA attention" in line for line in said), said
    assert any("attention mask" in line for line in said) and any("attention dropout" in line for line in said), said


def assert_bf16_steps_within_peers(results, where=""):
    """bf16 training steps judged against the same weights in fp32 through SDPA: the library's loss
    and every gradient within twice the larger of SDPA's and eager attention's own bf16 errors (plus
    1e-3). The bf16 peers round P to bf16 before P·V and the library does not, so the library's
    distance from either peer is not a measure of its error."""
    exact_loss, exact_grads = results["fp32"]
    errors = {attn: (abs(float(results[attn][0]) - float(exact_loss)),
                     {key: rel_err(grad.double(), exact_grads[key].double()) for key, grad in results[attn][1].items()})
              for attn in results if attn != "fp32"}
    name = next(attn for attn in errors if attn not in ("sdpa", "eager"))
    loss_bound = 2 * max(errors["sdpa"][0], errors["eager"][0]) + 1e-3 * abs(float(exact_loss))
    assert errors[name][0] <= loss_bound, (where, errors[name][0], loss_bound)
    for key, err in errors[name][1].items():
        bound = 2 * max(errors["sdpa"][1][key], errors["eager"][1][key]) + 1e-3
        assert err <= bound, (where, key, err, bound)


def assert_bf16_step_within_peers_difference(results, name, where=""):
    """A bf16 training step against SDPA's: each gradient of the library within twice eager
    attention's own distance from SDPA's. Left-padded batches are judged so only with the first
    real token's label masked: the logits that predict it come from the last padding position, a
    query row that sees no key, to which the library (as FlashAttention through unpadding) gives
    an output of 0 and eager attention (and, on CUDA, SDPA's bf16 path) a uniform average over
    every key, future ones included. The loss, one scalar whose peers may agree by chance (about
    1e-6 apart), is judged against the fp32 model instead (assert_bf16_steps_within_peers;
    bench/NOTES.md: left-padded bf16)."""
    (_, grads), (_, ref_grads), (_, eager_grads) = (results[a] for a in (name, "sdpa", "eager"))
    for key, grad in grads.items():
        bound = 2 * rel_err(eager_grads[key].double(), ref_grads[key].double())
        assert rel_err(grad.double(), ref_grads[key].double()) <= bound, (where, key, bound)


@needs_gpu
@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_transformers_training_step_matches_sdpa(family, dtype):
    """On the GPU (the library's kernels): a training step's loss and gradients against SDPA's, in
    fp32 to 1e-4 of SDPA's; in bf16 judged against the fp32 model (assert_bf16_steps_within_peers)."""
    import gqa_transformers
    name = gqa_transformers.register()
    ids = torch.randint(0, 128, (2, 200), device="cuda")
    models = {attn: tiny_causal_lm(family, attn).to("cuda", dtype) for attn in (name, "sdpa", "eager")}
    models["fp32"] = tiny_causal_lm(family, "sdpa").to("cuda")
    results = {attn: loss_and_grads(model, ids) for attn, model in models.items()}
    if dtype == torch.float32:
        (loss, grads), (ref_loss, ref_grads) = results[name], results["sdpa"]
        assert torch.allclose(loss, ref_loss, rtol=1e-4), (loss, ref_loss)
        for key, grad in grads.items():
            assert rel_err(grad, ref_grads[key].double()) <= 1e-4, key
    else:
        assert_bf16_steps_within_peers(results)


@needs_gpu
@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_transformers_masked_training_steps_match_sdpa(family, dtype):
    """On the GPU, registered with no fallback: training steps on a left-padded batch and on
    sequences packed into one row (Mistral with a sliding window of 16), loss and gradients against
    SDPA's: fp32 to 1e-4 of SDPA's; in bf16 judged against the fp32 model
    (assert_bf16_steps_within_peers)."""
    import gqa_transformers
    name = gqa_transformers.register()
    extra = dict(sliding_window=16) if family == "mistral" else {}
    models = {attn: tiny_causal_lm(family, attn, **extra).to("cuda", dtype) for attn in (name, "sdpa", "eager")}
    models["fp32"] = tiny_causal_lm(family, "sdpa", **extra).to("cuda")
    ids = torch.randint(0, 128, (2, 160), device="cuda")
    padded = torch.ones(2, 160, dtype=torch.long, device="cuda")
    padded[0, :37] = 0
    positions = torch.cat([torch.arange(n) for n in (1, 90, 33, 36)]).view(1, 160).cuda()
    labels = ids.masked_fill(padded == 0, -100)
    first_label_masked = labels.clone()
    first_label_masked[0, 37] = -100
    batches = {"padded": dict(input_ids=ids, attention_mask=padded, labels=labels),
               "packed": dict(input_ids=ids[:1], position_ids=positions, labels=ids[:1]),
               "padded, first token's label masked": dict(input_ids=ids, attention_mask=padded, labels=first_label_masked)}
    for what, batch in batches.items():
        results = {}
        for attn, model in models.items():
            model.zero_grad()
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            results[attn] = (loss.detach(), {key: p.grad.clone() for key, p in model.named_parameters()})
        if dtype == torch.float32:
            (loss, grads), (ref_loss, ref_grads) = results[name], results["sdpa"]
            assert torch.allclose(loss, ref_loss, rtol=1e-4), (what, loss, ref_loss)
            for key, grad in grads.items():
                assert rel_err(grad, ref_grads[key].double()) <= 1e-4, (what, key)
        else:
            assert_bf16_steps_within_peers(results, what)
            if what.startswith("padded, first"):
                assert_bf16_step_within_peers_difference(results, name, what)


@needs_gpu
@needs_transformers
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_gpu_transformers_generation_and_packed_sequences_match_sdpa(family):
    """On the GPU in fp32, registered with no fallback (a call the library did not serve would
    raise): greedy generate() from left-padded prompts over a dynamic and a static cache gives
    SDPA's tokens (Mistral with a sliding window of 16), and sequences packed into one row give
    SDPA's logits within 1e-4."""
    import gqa_transformers
    name = gqa_transformers.register()
    extra = dict(sliding_window=16) if family == "mistral" else {}
    ours, ref = (tiny_causal_lm(family, attn, **extra).to("cuda") for attn in (name, "sdpa"))
    ids = torch.randint(0, 128, (2, 40), device="cuda")
    padded = torch.ones(2, 30, dtype=torch.long, device="cuda")
    padded[0, :4] = 0
    positions = torch.cat([torch.arange(n) for n in (1, 20, 7, 12)]).view(1, 40).cuda()
    with torch.no_grad():
        for cache in ("dynamic", "static"):
            kwargs = dict(attention_mask=padded, max_new_tokens=8, do_sample=False, cache_implementation=cache)
            assert torch.equal(ours.generate(ids[:, :30], **kwargs), ref.generate(ids[:, :30], **kwargs)), cache
        assert torch.allclose(ours(ids[:1], position_ids=positions, use_cache=False).logits,
                              ref(ids[:1], position_ids=positions, use_cache=False).logits, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# gqa_ring.py: context-parallel attention
def ring_case(dtype, T=24, device="cpu"):
    gen = torch.Generator().manual_seed(seed_of("ring", dtype, T))
    q, g = (torch.randn(2, T, 6, 16, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, T, 2, 16, generator=gen).to(dtype) for _ in range(2))
    return [t.to(device) for t in (q, k, v, g)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_blocks_match_one_call(dtype, causal):
    """The ring's blocks over 1, 2 and 3 ranks, merged by their log-sum-exp (gqa_ring.simulate),
    against one attention() call: output and gradients norm-relative within 1e-14 (float64) and
    1e-6 (fp32); bf16 within twice the distance of SDPA's bf16 result from float64, plus 1e-3."""
    import gqa_ring
    q, k, v, g = ring_case(dtype)
    def result(fn, *inputs):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, g))
    one = result(lambda *t: gqa_module.attention(*t, causal=causal), q, k, v)
    exact = result(lambda *t: gqa_module.attention(*t, causal=causal), *(t.double() for t in (q, k, v)))
    if dtype == torch.bfloat16:
        sdpa = result(lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
            q_.transpose(1, 2), k_.transpose(1, 2).repeat_interleave(3, dim=1), v_.transpose(1, 2).repeat_interleave(3, dim=1),
            is_causal=causal).transpose(1, 2), q, k, v)
    for world in (1, 2, 3):
        ring = result(lambda *t: gqa_ring.simulate(*t, world, causal=causal), q, k, v)
        for name, got, want, ref in zip(("out", "dq", "dk", "dv"), ring, one, exact):
            if dtype == torch.bfloat16:
                bound = 2 * rel_err(sdpa[("out", "dq", "dk", "dv").index(name)], ref) + 1e-3
                assert rel_err(got, ref) <= bound, (world, name)
            else:
                assert rel_err(got, want.double()) <= (1e-14 if dtype == torch.float64 else 1e-6), (world, name)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_ring_blocks_match_one_call(dtype, causal):
    """On one GPU (the library's kernels for the blocks, T = 384 over 1, 2 and 4 simulated ranks):
    the ring's output and gradients against one attention() call in fp32 within 1e-6
    norm-relative; bf16 against float64 within twice SDPA's bf16 distance, plus 1e-3."""
    import gqa_ring
    q, k, v, g = ring_case(dtype, T=384, device="cuda")
    def result(fn, *inputs):
        leaves = [t.clone().requires_grad_(True) for t in inputs]
        out = fn(*leaves)
        return [out.detach()] + list(torch.autograd.grad(out, leaves, g.to(out.device, out.dtype)))
    exact = result(lambda *t: gqa_module.attention(*t, causal=causal), *(t.double().cpu() for t in (q, k, v)))
    one = result(lambda *t: gqa_module.attention(*t, causal=causal), q, k, v)
    sdpa = result(lambda q_, k_, v_: torch.nn.functional.scaled_dot_product_attention(
        q_.transpose(1, 2), k_.transpose(1, 2).repeat_interleave(3, dim=1), v_.transpose(1, 2).repeat_interleave(3, dim=1),
        is_causal=causal).transpose(1, 2), q, k, v)
    for world in (1, 2, 4):
        ring = result(lambda *t: gqa_ring.simulate(*t, world, causal=causal), q, k, v)
        for index, name in enumerate(("out", "dq", "dk", "dv")):
            if dtype == torch.float32:
                assert rel_err(ring[index], one[index].double()) <= 1e-6, (world, name)
            else:
                bound = 2 * rel_err(sdpa[index].cpu(), exact[index]) + 1e-3
                assert rel_err(ring[index].cpu(), exact[index]) <= bound, (world, name)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_attention_combine_equals_one_call_over_all_keys(dtype, tol):
    """attention_combine of attention() over disjoint key sets (one of them empty) equals one call
    over all keys, output and log-sum-exp; a row that no part sees gives 0 and -inf; its rules
    name the argument."""
    q, k, v = masked_qkv(2, 40, 70, 6, 2, 23, dtype)
    cuts = (0, 0, 25, 26, 70)   # an empty part, then 25, 1 and 44 keys
    parts = [gqa_module.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in zip(cuts, cuts[1:])]
    out, lse = gqa_module.attention_combine(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    expect_out, expect_lse = gqa_module.attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and rel_err(out, expect_out.double()) <= tol and rel_err(lse, expect_lse.double()) <= tol
    # each half of the keys under a window (3, 3) of its own: some rows see no key in either half
    windows = [gqa_module.attention(q, k[:, a:b], v[:, a:b], window_size=(3, 3), return_lse=True)
               for a, b in ((0, 35), (35, 70))]
    out, lse = gqa_module.attention_combine(torch.stack([o for o, _ in windows]), torch.stack([l for _, l in windows]))
    blind = torch.isneginf(windows[0][1]) & torch.isneginf(windows[1][1])
    assert blind.any() and torch.isneginf(lse[blind]).all() and (out.permute(0, 2, 1, 3)[blind] == 0).all()
    with pytest.raises(ValueError, match=r"combine: outs must be \[S, B, T, H, D\] and lses \[S, B, H, T\]"):
        gqa_module.attention_combine(out[None], lse[None].transpose(-1, -2))


def _ring_worker(rank, world, init, out_dir, causal):
    import torch.distributed as dist
    import gqa_ring
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        q, k, v, g = (gqa_ring.shard(t, rank, world) for t in ring_case(torch.float32, T=8 * world))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = gqa_ring.ring_attention(*leaves, causal=causal)
        grads = torch.autograd.grad(out, leaves, g)
        torch.save([out.detach()] + list(grads), os.path.join(out_dir, "rank%d.pt" % rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_on_gloo_processes_equals_its_simulation(tmp_path, world, causal):
    """gqa_ring.ring_attention in `world` CPU processes over torch.distributed's gloo backend
    (K and V, then dK and dV, passed around the ring with isend/irecv): each rank's output and
    gradients bitwise those of gqa_ring.simulate for its part of the sequence."""
    import gqa_ring
    import torch.multiprocessing as mp
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("needs torch.distributed with the gloo backend")
    mp.spawn(_ring_worker, args=(world, "file://" + str(tmp_path / "init"), str(tmp_path), causal), nprocs=world)
    q, k, v, g = ring_case(torch.float32, T=8 * world)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = gqa_ring.simulate(*leaves, world, causal=causal)
    expect = [out.detach()] + list(torch.autograd.grad(out, leaves, g))
    for rank in range(world):
        got = torch.load(str(tmp_path / ("rank%d.pt" % rank)))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, expect):
            assert torch.equal(a, gqa_ring.shard(b, rank, world)), (rank, name)


def test_pip_install_puts_the_kernels_beside_the_module(tmp_path):
    """`pip install .` (from a copy of the checkout's installable files) installs gqa_module,
    gqa_geometry, gqa_transformers, gqa_ring and kernels/ as gqa_module_kernels/ beside them:
    imported from another folder, the module reads the same kernel sources (same sha256) and runs
    a CPU call of each entry."""
    import shutil
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "gqa_module.py", "gqa_geometry.py", "gqa_transformers.py",
                 "gqa_ring.py"):
        shutil.copy(os.path.join(HERE, name), source / name)
    shutil.copytree(os.path.join(HERE, "kernels"), source / "kernels")
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(target), str(source)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import torch, gqa_module, gqa_transformers, gqa_ring\n"
            "print(gqa_module.__file__)\n"
            "print(gqa_module.kernel_source_sha256())\n"
            "q, k, v = (torch.randn(1, 5, h, 8) for h in (2, 1, 1))\n"
            "print(tuple(gqa_module.causal_gqa_attention(q, k, v).shape))\n"
            "print(tuple(gqa_module.attention(q, k, v, window_size=(2, 1), return_lse=True)[1].shape))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, PYTHONPATH=str(target)))
    assert run.returncode == 0, run.stderr[-3000:]
    module_file, sha, shape, lse_shape = run.stdout.split("\n")[:4]
    assert module_file == str(target / "gqa_module.py") and shape == "(1, 5, 2, 8)", run.stdout
    assert lse_shape == "(1, 2, 5)", run.stdout
    assert (target / "gqa_geometry.py").exists() and (target / "gqa_ring.py").exists()
    assert sha == gqa_module.kernel_source_sha256()
    installed = sorted(os.path.relpath(os.path.join(root, f), target / "gqa_module_kernels")
                       for root, _, names in os.walk(target / "gqa_module_kernels") for f in names)
    assert installed == sorted(gqa_module._read_kernel_files())


def test_build_id_separates_environments(monkeypatch, tmp_path):
    """Library names carry the sources' sha and a key of the environment: another torch version,
    install location, Python ABI, compiler, ninja or toolkit gives another name; the same gives the
    same. A build for this environment names the builds of the same sources for others beside it."""
    sha = gqa_module.kernel_source_sha256()
    base = gqa_module._build_id(sha, "/usr/local/cuda")
    assert re.fullmatch(sha[:12] + r"_[0-9a-f]{8}", base) and gqa_module._build_id(sha, "/usr/local/cuda") == base
    assert gqa_module._build_id(sha, "/opt/cuda-12.8") != base
    monkeypatch.setenv("CXX", "clang++-99")
    assert gqa_module._build_id(sha, "/usr/local/cuda") != base
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert gqa_module._build_id(sha, "/usr/local/cuda") != base
    monkeypatch.undo()
    for name in ("gqa_attn_%s_sm90a" % base, "gqa_attn_%s_11111111_sm90a" % sha[:12],
                 "gqa_attn_%s_22222222_sm90a" % sha[:12], "gqa_attn_%s_33333333_sm80" % sha[:12]):
        (tmp_path / name).mkdir()
    note = gqa_module._other_builds(str(tmp_path / ("gqa_attn_%s_sm90a" % base)))
    assert "holds 2 builds of these sources for other environments" in note, note
    assert gqa_module._other_builds(str(tmp_path / ("gqa_attn_%s_sm80" % base))).count("1 build ") == 1
    assert gqa_module._other_builds(str(tmp_path / "unrelated")) == ""


def load_bench_script(name):
    """bench/<name>.py as a module (the bench folder is not a package)."""
    spec = importlib.util.spec_from_file_location("gqa_" + name, os.path.join(HERE, "bench", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_bench():
    return load_bench_script("bench_gqa")


def test_every_variant_edits_the_current_kernels():
    """bench/variants.py's replacements each find their text exactly once in this checkout, so a
    trait changed in kernels/ cannot leave a variant that fails only once it reaches the GPU."""
    variants = load_bench_script("variants")
    stale = []
    for name, edits in variants.VARIANTS.items():
        for path, old, _new in edits:
            with open(os.path.join(HERE, path)) as fh:
                found = fh.read().count(old)
            if found != 1:
                stale.append((name, path, old, found))
    assert not stale, stale


def test_bench_backward_rows_are_planned_and_valid():
    """--backward adds the backward mode at every scale shape (not the harness shape), and a row
    in that mode passes the results schema; an unknown mode does not."""
    bench = _load_bench()
    from gqa_bench.shapes import HARNESS_SHAPE, SCALE_CONFIGS, build_plan

    plan, _ = build_plan(bench.parse_args(["--backward", "--no-sweep"]))
    with_backward = {(shape, dtype) for shape, dtype, modes in plan if "backward" in modes}
    assert with_backward == {(shape, d) for shape, dtypes in SCALE_CONFIGS for d in dtypes}
    assert all("backward" not in modes for shape, _, modes in plan if shape == HARNESS_SHAPE)
    plan, _ = build_plan(bench.parse_args(["--no-sweep"]))
    assert all("backward" not in modes for _, _, modes in plan)
    row = {"shape": [4, 1024, 32, 8, 128], "dtype": "bfloat16", "impl": "project", "mode": "backward",
           "ms": 1.0, "tflops": 100.0, "rel_err": None, "error": None, "plan": "wgmma/bf16/d128"}
    result = {"gpu": "g", "torch": "t", "cuda": "c", "date": "2026-12-01", "source_sha256": "0" * 64,
              "compile": {"cold_s": 1.0, "warm_s": 0.1}, "rows": [row]}
    assert bench.validate_results_schema(result) == []
    result["rows"] = [dict(row, mode="sideways")]
    assert bench.validate_results_schema(result) != []


def test_bench_rounds_give_the_median_and_each_rounds_ratio():
    """--rounds: a row timed in several rounds keeps each round's ms and their median as its ms; the
    schema holds ms to that median; the ratio line gives the ratio of each round."""
    bench = _load_bench()
    from gqa_bench.report import _ratio_line
    from gqa_bench.runner import Bench

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_name=lambda: "g"))
    runs = Bench(fake_torch, rounds=3)
    shape = (1, 8192, 32, 8, 128)
    for impl, times in (("project", (1.0, 1.2, 0.9)), ("sdpa_cudnn", (1.1, 1.0, 1.08))):
        for ms in times:
            runs.add_row(shape, "bfloat16", impl, "back_to_back", ms, 1e-3)
    proj, peer = runs.rows
    assert len(runs.rows) == 2 and proj["rounds"] == [1.0, 1.2, 0.9] and proj["ms"] == 1.0
    assert peer["ms"] == 1.08 and peer["tflops"] == round(4 * 32 * 8192**2 * 128 / 2 / (1.08 * 1e9), 4)
    line = _ratio_line([proj, peer])
    assert "**1.08×**" in line and "round by round 0.83×–1.20× over 3 rounds" in line
    result = {"gpu": "g", "torch": "t", "cuda": "c", "date": "2026-12-02", "source_sha256": "0" * 64,
              "compile": {"cold_s": 1.0, "warm_s": 0.1}, "rows": [proj, peer]}
    assert bench.validate_results_schema(result) == []
    for bad in (dict(proj, ms=1.2), dict(proj, rounds=[1.0]), dict(proj, rounds=[1.0, "x"])):
        assert bench.validate_results_schema(dict(result, rows=[bad])) != [], bad
    single = Bench(fake_torch)
    single.add_row(shape, "bfloat16", "project", "back_to_back", 1.0, 1e-3)
    assert "rounds" not in single.rows[0] and "round by round" not in _ratio_line(single.rows + [peer])
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])


def test_bench_takes_fa4_only_where_it_imports_and_only_in_16_bit(monkeypatch):
    """fa4 (FlashAttention-4) is a peer of the forward and the backward where flash_attn.cute
    imports: absent, the run drops it with one note and writes no rows for it; present, it runs in
    fp16 and bf16 only and refuses fp32 by name."""
    _load_bench()
    from gqa_bench import impls as impls_mod
    from gqa_bench.config import BACKWARD_IMPLS
    from gqa_bench.runner import Bench

    assert "fa4" in impls_mod.IMPL_NAMES and "fa4" in BACKWARD_IMPLS and "fa4" not in impls_mod.NON_PEERS
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_name=lambda: "g"),
                                       no_grad=contextlib.nullcontext)
    seen = []
    absent = "FlashAttention-4 (flash_attn.cute) not importable: ModuleNotFoundError"
    for missing in (absent, None):
        runs = Bench(fake_torch)
        runs.impls = impls_mod.Implementations(fake_torch, {}, {})
        runs.run_config = lambda shape, dtype_name, modes, names: seen.append((missing, dtype_name, tuple(names)))
        monkeypatch.setitem(impls_mod.OPTIONAL, "fa4", lambda missing=missing: missing)
        plan = [((4, 1024, 32, 8, 128), "float32", ("back_to_back",)), ((4, 1024, 32, 8, 128), "bfloat16", ("back_to_back",))]
        runs.run(plan, ["project", "sdpa_cudnn", "fa4"], lambda: None)
        assert runs.rows == []
        assert [n for n in runs.impls.notes if "fa4" in n] == ([f"no fa4 rows: {missing}"] if missing else [])
    assert seen == [(absent, "float32", ("project", "sdpa_cudnn")), (absent, "bfloat16", ("project", "sdpa_cudnn")),
                    (None, "float32", ("project", "sdpa_cudnn")), (None, "bfloat16", ("project", "sdpa_cudnn", "fa4"))]
    for name in ("fa4", "fa4_deterministic"):
        assert name in BACKWARD_IMPLS and name in impls_mod.OPTIONAL and name in impls_mod.SIXTEEN_BIT_ONLY
        with pytest.raises(ValueError, match="fa4 takes float16 and bfloat16, not float32"):
            impls_mod.BUILDERS[name](None, (4, 1024, 32, 8, 128), "float32", ())


def test_bench_dtypes_keep_only_the_named_dtypes():
    """--dtypes bfloat16,float16 plans the scale shapes in those dtypes alone (so no harness
    shape, which is fp32); an unknown dtype is refused by name."""
    bench = _load_bench()
    from gqa_bench.shapes import build_plan

    full, _ = build_plan(bench.parse_args(["--no-sweep", "--backward"]))
    plan, _ = build_plan(bench.parse_args(["--no-sweep", "--backward", "--dtypes", "bfloat16,float16"]))
    assert plan == [step for step in full if step[1] in ("bfloat16", "float16")] and len(plan) == 10
    _, sweep = build_plan(bench.parse_args(["--dtypes", "float32"]))
    assert list(sweep) == ["float32"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "bf16"])


def test_committed_results_match_schema_and_current_kernel():
    """The benchmark's bench/results/*.json follow the schema (sanitizer.json has its own test;
    kernelbench_eval.json, first_calls.json, uneven_backward.json and fa_suite_*.json are the
    records of bench/kernelbench_eval.py, bench/first_call.py, bench/uneven_backward.py and
    bench/fa_suite.py), and one of them was measured on the kernel as it is now."""
    results_dir = os.path.join(HERE, "bench", "results")
    paths = sorted(os.path.join(results_dir, f) for f in os.listdir(results_dir)
                   if f.endswith(".json") and f not in ("sanitizer.json", "kernelbench_eval.json", "first_calls.json",
                                                              "uneven_backward.json") and not f.startswith("fa_suite_"))
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
    """The call, with its output known to land on memory filled with NaN first, so that any element
    the kernel leaves unwritten shows as NaN.

    In a private memory pool (empty: nothing else can be handed out of it), four blocks of the
    output's size (rounded up to the allocator's 512 bytes) are allocated, filled with NaN and freed;
    the call's allocations on this thread then come out of that memory: first the copies of inputs
    whose last dim is not contiguous (the output's size or smaller), then the output. The assertion
    checks that the whole output lies on the NaN-filled bytes, so the poison is known to have been
    there. The result is returned as a copy made outside the pool."""
    nbytes = q.numel() * q.element_size()
    elems = -(-nbytes // 512) * 512 // q.element_size()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        poison = [torch.full((elems,), float("nan"), device=q.device, dtype=q.dtype) for _ in range(4)]
        spans = sorted((p.data_ptr(), p.data_ptr() + elems * p.element_size()) for p in poison)
        del poison
        out = gqa_module.causal_gqa_attention(q, k, v)
    merged = []   # the NaN-filled byte ranges, adjacent blocks joined
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    start, end = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
    assert any(lo <= start and end <= hi for lo, hi in merged), (
        "the output %#x..%#x did not land on the NaN-filled memory %s" % (start, end, [(hex(a), hex(b)) for a, b in merged]))
    result = out.clone()
    del out
    return result


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
@pytest.mark.parametrize("case", range(N_BAD_CPU + 2))
def test_gpu_bad_inputs_raise_and_module_keeps_working(case):
    assert_rejected("cuda", case)
    good = make_qkv(1, 33, 4, 2, 16, device="cuda")
    check_fp32(gqa_module.causal_gqa_attention(*good), *good, "after error")


@needs_gpu
def test_gpu_requires_grad_trains_and_no_grad_skips_autograd():
    q, k, v = make_qkv(1, 16, 4, 2, 16, device="cuda")
    q.requires_grad_(True)
    out = gqa_module.causal_gqa_attention(q, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad is None
    with torch.no_grad():
        plain = gqa_module.causal_gqa_attention(q, k, v)
    assert plain.grad_fn is None
    assert torch.equal(plain, out.detach())
    check_fp32(plain, q.detach(), k, v, "no_grad")


def test_cpu_path_trains_like_float64():
    """CPU inputs take PyTorch's autograd through the same function: gradients against float64."""
    q, k, v = make_qkv(2, 33, 6, 2, 20)
    grad_out = torch.randn_like(q)
    exact = reference_grads(q, k, v, grad_out)
    for name, got, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), exact):
        assert rel_err(got, ref) <= 1e-5, name


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


def sdpa_max_err(q, k, v, exact=None):
    """Max abs error against float64 of PyTorch's SDPA (default backends, enable_gqa) on q, k, v."""
    exact = reference.causal_gqa_reference(q, k, v) if exact is None else exact
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    return (sdpa.double() - exact).abs().max().item()


def half_error_bound(q, k, v):
    """check_half's bound for 16-bit inputs: 2x SDPA's own max abs error on them, plus 1e-3. SDPA
    gets fresh contiguous copies: on views that start one element into their storage PyTorch's own
    kernels can fault (torch 2.11 on the H200: fp16, T = 1, k and v offset: misaligned address)."""
    q, k, v = [x.clone(memory_format=torch.contiguous_format) for x in (q, k, v)]
    return 2 * sdpa_max_err(q, k, v) + 1e-3


def check_half(out, q, k, v, what=""):
    """Error against float64 at most 2x SDPA's own error in that dtype, plus 1e-3 absolute."""
    assert out.shape == q.shape and out.dtype == q.dtype
    exact = reference.causal_gqa_reference(q, k, v)
    ours_err = (out.double() - exact).abs().max().item()
    sdpa_err = sdpa_max_err(q, k, v, exact)
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
# Every kernel path: one shape per plan, exact non-finite semantics on each; fp32 per-channel
# accuracy; property-based tests
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# One (B, T, Hq, Hkv, D, offset) per plan of an sm_90a build on an H200 (132 SMs); offset: q, k and
# v start one element into their storage, so no row is 16-byte aligned. B * Hkv independent (batch,
# kv head) slots take the non-finite cases below, up to 49 per call; the row-wise 8x1, short and
# split8 plans need grids too small for that and take 3 to 5 calls.
PLAN_CASES = {
    "rowwise/fp32/8x1": (10, 100, 2, 2, 80, False),
    "rowwise/fp32/8x1-planned": (10, 100, 2, 2, 36, False),
    "rowwise/fp32/4x4": (25, 100, 6, 2, 20, False),
    "short/fp32/d32": (5, 100, 4, 2, 20, False),
    "tiled/fp32/d32": (25, 200, 4, 2, 24, False),
    "tiled/fp32/d32-split8": (10, 200, 2, 2, 32, False),
    "tiled/fp32/d64": (25, 200, 4, 2, 50, False),
    "tiled/fp32/d64-split8": (10, 200, 2, 2, 64, False),
    "tiled/fp32/d128": (25, 200, 4, 2, 128, True),
    "tiled/fp32/d128-split8": (10, 200, 2, 2, 100, False),
    "tiled/fp32/d256": (25, 200, 4, 2, 160, False),
    "x3/fp32/d64": (25, 200, 4, 2, 64, False),
    "x3/fp32/d128": (25, 200, 4, 2, 96, False),
    "rowwise/fp16/8x1": (10, 100, 2, 2, 7, False),
    "rowwise/fp16/4x4": (25, 100, 6, 2, 48, False),
    "tiled/fp16/d32": (25, 200, 4, 2, 32, False),
    "tiled/fp16/d64": (25, 200, 4, 2, 64, True),
    "tiled/fp16/d128": (25, 200, 4, 2, 100, False),
    "tiled/fp16/d256": (25, 200, 4, 2, 256, True),
    "wgmma/fp16/d64": (25, 200, 8, 2, 40, False),
    "wgmma/fp16/d64-rows128": (25, 200, 4, 2, 40, False),
    "wgmma/fp16/d128": (25, 200, 4, 2, 128, False),
    "wgmma/fp16/d256": (25, 200, 4, 2, 136, False),
    "rowwise/bf16/8x1": (10, 100, 2, 2, 8, False),
    "rowwise/bf16/4x4": (25, 300, 4, 2, 5, False),
    "tiled/bf16/d32": (25, 200, 6, 2, 17, False),
    "tiled/bf16/d64": (25, 200, 4, 2, 56, True),
    "tiled/bf16/d128": (25, 200, 4, 2, 120, True),
    "tiled/bf16/d256": (25, 200, 4, 2, 129, False),
    "wgmma/bf16/d64": (25, 200, 8, 2, 64, False),
    "wgmma/bf16/d64-rows128": (25, 200, 4, 2, 64, False),
    "wgmma/bf16/d128": (25, 200, 4, 2, 80, False),
    "wgmma/bf16/d256": (25, 200, 4, 2, 256, False),
}


@needs_cuda_torch
def test_plan_cases_cover_every_plan():
    """PLAN_CASES names every plan of this build, and plan_for (the dispatch, run on the CPU for an
    H200) sends each case's shape to its plan. A new plan without a case fails here."""
    plans = gqa_module.all_plans()
    assert set(plans) <= set(PLAN_CASES), sorted(set(plans) - set(PLAN_CASES))
    if any(name.startswith(("x3/", "wgmma/")) for name in plans):   # an sm_90a build has them all
        assert set(plans) == set(PLAN_CASES), sorted(set(PLAN_CASES) - set(plans))
    for name in plans:
        B, T, Hq, Hkv, D, offset = PLAN_CASES[name]
        assert gqa_module.plan_for(B, T, Hq, Hkv, D, DTYPES[name.split("/")[1]], not offset) == name


@needs_cuda_torch
def test_readme_counts_the_plans():
    """docs/design.md's Plans section gives the number of plans an sm_90a build lists."""
    plans = gqa_module.all_plans()
    if not any(name.startswith("wgmma/") for name in plans):
        pytest.skip("this build has no wgmma family (no sm_90a); docs/design.md counts an sm_90a build's plans")
    with open(os.path.join(HERE, "docs", "design.md")) as fh:
        found = re.findall(r"`gqa_module.all_plans\(\)` lists the (\d+) plans of an sm_90a build", fh.read())
    assert found == [str(len(plans))], (found, len(plans))


def offset_by_one(x):
    """x's values in a view that starts one element into its storage (rows not 16-byte aligned)."""
    base = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = base[1:].view(x.shape)
    view.copy_(x)
    return view


NAN, INF = float("nan"), float("inf")


def nonfinite_cases(T):
    """(label, [(tensor, value, time)]): NaN, +Inf and -Inf alone in each of q, k and v at the tile
    edges 0, 63, 64, T - 1 and at 37 inside the first tile, then combined in q, k and v at once."""
    edges = (0, 37, 63, 64, T - 1)
    cases = [("%s=%s@%d" % (x, value, t), [(x, value, t)]) for x in "qkv" for value in (NAN, INF, -INF)
             for t in edges]
    cases += [
        ("q,k,v=nan", [("q", NAN, T - 1), ("k", NAN, 64), ("v", NAN, 63)]),
        ("q,k,v=inf", [("q", INF, 64), ("k", INF, T - 1), ("v", INF, 0)]),
        ("q,k,v=-inf", [("q", -INF, 63), ("k", -INF, 37), ("v", -INF, 64)]),
        # v's +Inf and -Inf share a channel: from row T - 1 on that channel is Inf - Inf = NaN.
        ("mixed", [("q", NAN, 37), ("k", INF, 63), ("k", -INF, 64), ("v", INF, 64), ("v", -INF, T - 1)]),
    ]
    return cases


def assert_like_reference(out, q, k, v, what="", half_bound=None):
    """out against the float64 reference: NaN, +Inf and -Inf at exactly the same elements, and on the
    finite ones allclose(1e-4, 1e-4) in fp32 or, in 16-bit, at most `half_bound` (check_half's bound,
    from half_error_bound on the same inputs before their non-finite values went in)."""
    assert out.shape == q.shape and out.dtype == q.dtype, what
    exact = reference.causal_gqa_reference(q, k, v)
    for kind, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        got, want = test(out), test(exact)
        if not torch.equal(got, want):
            where = [tuple(i) for i in (got != want).nonzero().tolist()]
            raise AssertionError("%s: %s at %d elements where the reference differs, first (b, t, h, d) %s: out %s, "
                                 "reference %s" % (what, kind, len(where), where[:4], [out[i].item() for i in where[:4]],
                                                   [exact[i].item() for i in where[:4]]))
    finite = torch.isfinite(exact)
    err = (out.double() - exact).abs()[finite]
    max_err = err.max().item() if err.numel() else 0.0
    print("%s: %d non-finite outputs, all where the reference has them; max abs err of the finite ones %.3g"
          % (what, out.numel() - int(finite.sum()), max_err))
    if q.dtype == torch.float32:
        assert torch.allclose(out.double()[finite], exact[finite], atol=1e-4, rtol=1e-4), what
    else:
        assert max_err <= half_bound, "%s: max abs err %.3g on finite outputs, above %.3g" % (what, max_err, half_bound)


@pytest.mark.parametrize("x", ["q", "k", "v"])
def test_reference_float64_each_row_sees_only_its_keys(x):
    """reference.causal_gqa_reference (its vectorised path for finite v, its per-row path otherwise)
    against reference.Model's loops, with NaN, +Inf or -Inf in x at the first, a middle and the last
    step: the same NaN and +-Inf elements, and no row before the step (nor another batch or kv head)
    touched, so a masked key never reaches an earlier row."""
    T = 12
    for value, t in itertools.product((NAN, INF, -INF), (0, 5, T - 1)):
        tensors = make_qkv(2, T, 4, 2, 8, dtype=torch.float64)
        tensors["qkv".index(x)][1, t, 1 if x == "q" else 0, 3] = value   # batch 1, kv head 0: query heads 0, 1
        q, k, v = tensors
        loops = reference.Model(4, 2, 8)(q, k, v)
        exact = reference.causal_gqa_reference(q, k, v)
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(test(loops), test(exact)), (x, value, t)
        finite = torch.isfinite(exact)
        assert torch.allclose(loops[finite], exact[finite], atol=1e-12, rtol=1e-12)
        assert finite[0].all() and finite[1, :, 2:].all() and finite[1, :t].all(), (x, value, t)
        if x != "k" or value != value:   # row t sees the value (an Inf in k may give a -Inf score: weight 0)
            assert not finite[1, t].all(), (x, value, t)


@needs_gpu
@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_gpu_every_plan_nonfinite_like_reference(name):
    """Each plan at a shape that takes it (asserted through plan()), with NaN, +Inf and -Inf in q, k
    and v, alone and together, at tile edges: the output's NaN, +Inf and -Inf elements are exactly
    the float64 reference's, and the finite ones keep the dtype's tolerance. Each case has its own
    (batch, kv head) slot; the channel and query head of each are drawn from a printed seed."""
    if name not in gqa_module.all_plans():
        pytest.skip("this build has no %s (the wgmma families need an sm_90a build)" % name)
    B, T, Hq, Hkv, D, offset = PLAN_CASES[name]
    dtype, G = DTYPES[name.split("/")[1]], Hq // Hkv
    props = torch.cuda.get_device_properties(0)
    if gqa_module.plan_for(B, T, Hq, Hkv, D, dtype, not offset, False, props.multi_processor_count, props.major) != name:
        pytest.skip("on this GPU (%d SMs) the shape of %s takes another plan" % (props.multi_processor_count, name))
    seed = seed_of("nonfinite", name)
    print("%s: channels and heads from random.Random(%d)" % (name, seed))
    rng = random.Random(seed)
    cases = nonfinite_cases(T)
    slots = B * Hkv
    for first in range(0, len(cases), slots):
        chunk = cases[first:first + slots]
        q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
        if offset:
            q, k, v = offset_by_one(q), offset_by_one(k), offset_by_one(v)
        bound = half_error_bound(q, k, v) if dtype != torch.float32 else None
        labels = []
        for slot, (label, injections) in enumerate(chunk):
            b, kv = divmod(slot, Hkv)
            h, d = kv * G + rng.randrange(G), rng.randrange(D)
            for x, value, t in injections:
                {"q": q, "k": k, "v": v}[x][b, t, h if x == "q" else kv, d] = value
            labels.append("b%d/kv%d/h%d/d%d: %s" % (b, kv, h, d, label))
        assert gqa_module.plan(q, k, v) == name
        out = call_poisoned(q, k, v)
        assert_like_reference(out, q, k, v, "%s [%s]" % (name, "; ".join(labels)), bound)


@needs_gpu
@pytest.mark.parametrize("dtype, D", [(torch.float16, 128), (torch.bfloat16, 64), (torch.bfloat16, 96),
                                      (torch.float16, 256)])
def test_gpu_wgmma_ring_of_stages_strided_kv_and_nonfinite(dtype, D):
    """The wgmma family's shared-memory ring wrapped many times (T = 1000: up to 16 tiles of 64
    keys per CTA), a group of 3 (CTAs of 128 packed rows start inside a time step), k and v as
    strided views of one packed tensor (what its tensor maps read), and Inf and NaN in late tiles:
    the float64 reference's non-finite elements exactly, the finite ones within check_half's bound."""
    B, T, Hq, Hkv = 2, 1000, 6, 2
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    q, _, _ = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
    kv = torch.randn(B, T, 2, Hkv, D, device="cuda").to(dtype)
    k, v = kv[:, :, 0], kv[:, :, 1]
    width = 64 if D <= 64 else 128 if D <= 128 else 256
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert not k.is_contiguous() and gqa_module.plan(q, k, v) == ws_plan(dtype, B, T, Hq, Hkv, width, sms)
    bound = half_error_bound(q, k, v)
    v[0, 700, 1, 5] = float("nan")      # batch 0, kv head 1: query heads 3..5 from step 700 on
    v[1, 999, 0, 0] = float("inf")      # the last key: only the last step sees it
    k[1, 640, 1, 7] = float("-inf")     # a tile's first key
    q[0, 900, 0, 2] = float("inf")
    out = call_poisoned(q, k, v)
    assert_like_reference(out, q, k, v, "wgmma ring, strided kv, non-finite", bound)


@needs_gpu
@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 128), (torch.float16, 256)])
def test_gpu_wgmma_kv_heads_broadcast_by_expand(dtype, D):
    """k and v whose kv heads are one head broadcast by expand (head stride 0, which no TMA tensor
    map takes): the wgmma plan still, run by the kernel that reads any strides, within check_half's
    bound of the float64 reference."""
    B, T, Hq, Hkv = 2, 300, 8, 4
    q, k1, v1 = make_qkv(B, T, Hq, 1, D, device="cuda", dtype=dtype)
    k, v = k1.expand(B, T, Hkv, D), v1.expand(B, T, Hkv, D)
    assert k.stride(2) == 0
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    assert gqa_module.plan(q, k, v) == "wgmma/%s/d%d" % (name, D)
    check_half(call_poisoned(q, k, v), q, k, v, "kv heads broadcast")


@needs_gpu
@pytest.mark.parametrize("dtype, D, group, packed, rows, divides", [(torch.bfloat16, 128, 4, True, 128, True),
                                                                    (torch.float16, 128, 3, False, 128, False),
                                                                    (torch.bfloat16, 64, 4, False, 128, True),
                                                                    (torch.float16, 64, 7, False, 128, False),
                                                                    (torch.bfloat16, 64, 3, True, 192, True),
                                                                    (torch.float16, 64, 5, True, 192, False),
                                                                    (torch.bfloat16, 256, 2, False, 128, True)])
def test_gpu_wgmma_many_tiles_per_cta(dtype, D, group, packed, rows, divides):
    """More CTA tiles than the GPU has SMs, so each CTA of the warp-specialised kernel walks several
    (its ring of stages running on across them, and its consumers' turns where
    kTurnsUpToRounds allows that many rounds), at width 64 with two consumer warpgroups and with
    three (`rows` a CTA, on 132 SMs), with groups that divide the tile's
    packed rows (Q loaded ahead through a tensor map) and groups that do not (Q copied by the
    consumers), q, k and v as views of one packed tensor or not: every element within check_half's
    bound of the float64 reference, none left unwritten."""
    B, T, Hkv = 2, 2100, 4
    Hq = Hkv * group
    if packed:
        qkv = torch.randn(B, T, Hq + 2 * Hkv, D, device="cuda").to(dtype)
        q, k, v = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hkv], qkv[:, :, Hq + Hkv:]
    else:
        q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gqa_module.plan(q, k, v) == ws_plan(dtype, B, T, Hq, Hkv, D, sms)
    if sms == 132:
        assert ws_rows_per_cta(B, T, Hq, Hkv, D, sms) == rows and (rows % group == 0) == divides
    tiles = B * Hkv * -(-T * group // ws_rows_per_cta(B, T, Hq, Hkv, D, sms))
    assert tiles > sms
    check_half(call_poisoned(q, k, v), q, k, v, "many tiles per CTA, group %d" % group)



def ws_l2_section_bytes():
    """WsTraits::kL2SectionBytes, read from the kernel's source."""
    with open(os.path.join(HERE, "kernels", "ws", "kernel.cuh")) as fh:
        found = re.findall(r"kL2SectionBytes = int64_t\((\d+)\) << 20;", fh.read())
    assert len(found) == 1, "kL2SectionBytes not found once in kernels/ws/kernel.cuh"
    return int(found[0]) << 20


def test_ws_l2_section_bytes_is_read_from_the_kernel():
    assert ws_l2_section_bytes() >= 1 << 20


@needs_gpu
@pytest.mark.parametrize("dtype, B, T, Hkv, group, D", [(torch.bfloat16, 8, 1000, 25, 2, 64),
                                                        (torch.float16, 2, 4097, 12, 3, 128)])
def test_gpu_wgmma_tiles_in_l2_sections(dtype, B, T, Hkv, group, D):
    """K and V of all (batch, kv head) pairs together past twice WsTraits::kL2SectionBytes, so the
    warp-specialised kernel walks its tiles in sections of pairs, the last section holding fewer
    pairs than the others: every element within check_half's bound of the float64 reference, none
    left unwritten."""
    budget, pairs, pair_bytes = ws_l2_section_bytes(), B * Hkv, T * D * 2 * 2
    assert pairs * pair_bytes > 2 * budget
    section = min(pairs, max(1, budget // pair_bytes))
    assert 1 < section < pairs and pairs % section != 0, "sections of %d pairs of %d" % (section, pairs)
    q, k, v = make_qkv(B, T, Hkv * group, Hkv, D, device="cuda", dtype=dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gqa_module.plan(q, k, v) == ws_plan(dtype, B, T, Hkv * group, Hkv, D, sms)
    check_half(call_poisoned(q, k, v), q, k, v, "L2 sections of %d pairs of %d" % (section, pairs))


def ws_turns_up_to_rounds():
    """WsTraits::kTurnsUpToRounds, read from the kernel's source."""
    with open(os.path.join(HERE, "kernels", "ws", "kernel.cuh")) as fh:
        found = re.findall(r"kTurnsUpToRounds = (\d+);", fh.read())
    assert len(found) == 1, "kTurnsUpToRounds not found once in kernels/ws/kernel.cuh"
    return int(found[0])


def test_ws_turns_up_to_rounds_is_read_from_the_kernel():
    assert ws_turns_up_to_rounds() >= 1


def ws_width_consumers(width):
    """gqa_ws_consumers (kernels/gqa_params.h), read from the source: the warp-specialised kernel's
    consumer warpgroups at a width (`width == W ? a : b`, or an int)."""
    with open(os.path.join(HERE, "kernels", "gqa_params.h")) as fh:
        found = re.findall(r"gqa_ws_consumers\(int width\) \{ return (?:width == (\d+) \? (\d+) : )?(\d+); \}", fh.read())
    assert len(found) == 1, "gqa_ws_consumers not found once in kernels/gqa_params.h"
    at, chosen, other = found[0]
    return int(chosen if at and int(at) == width else other)


def ws_rows_per_cta(B, T, Hq, Hkv, width, sms):
    """The packed rows of the warp-specialised kernel's CTAs for a shape, as ws_consumers_for
    (kernels/ws/rules.cuh) picks them: 64 a consumer warpgroup, the width's own count unless two
    leave the busiest CTA of a grid of min(tiles, sms) fewer rows."""
    def busiest(rows):
        tiles = B * Hkv * -(-T * (Hq // Hkv) // rows)
        return -(-tiles // min(tiles, sms)) * rows
    most = 64 * ws_width_consumers(width)
    return most if busiest(most) <= busiest(128) else 128


def ws_plan(dtype, B, T, Hq, Hkv, width, sms):
    """The wgmma plan's name for a shape: "wgmma/<dtype>/d<width>", "-rows128" where the width's
    own consumer count is not the one taken."""
    rows = ws_rows_per_cta(B, T, Hq, Hkv, width, sms)
    name = "wgmma/%s/d%d" % ({torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype], width)
    return name + ("-rows128" if rows != 64 * ws_width_consumers(width) else "")


def test_ws_width_consumers_is_read_from_the_source():
    assert [ws_width_consumers(w) for w in (64, 128, 256)] == [3, 2, 2]


@needs_cuda_torch
@pytest.mark.parametrize("sms", [132, 114, 20])
def test_ws_plan_rows_follow_the_rule(sms):
    """plan_for (the C++ dispatch, on the CPU) names the consumer count that ws_plan's model of
    ws_consumers_for gives, over shapes on both sides of the rule and at its ties, at every width;
    the two benchmark-side shapes take the forms measured for them (NOTES v86)."""
    plans = gqa_module.all_plans()
    if not any(name.startswith("wgmma/") for name in plans):
        pytest.skip("this build has no wgmma family (no sm_90a)")
    seen = set()
    for B, T, Hq, Hkv in [(1, 1000, 6, 2), (16, 2048, 32, 8), (2, 3000, 32, 8), (1, 777, 4, 1), (2, 2100, 16, 4),
                          (2, 2100, 20, 4), (24, 129, 4, 2), (2, 129, 4, 2), (25, 200, 8, 2), (25, 200, 4, 2),
                          (8, 1000, 50, 25), (4, 1024, 32, 8), (1, 32768, 32, 8), (3, 4097, 9, 3)]:
        for width, D in [(64, 64), (64, 40), (128, 128), (256, 200)]:
            for dtype in (torch.float16, torch.bfloat16):
                got = gqa_module.plan_for(B, T, Hq, Hkv, D, dtype, True, False, sms, 9)
                assert got == ws_plan(dtype, B, T, Hq, Hkv, width, sms), (B, T, Hq, Hkv, D, sms)
                seen.add(got.split("/")[2])
    assert {"d64", "d64-rows128", "d128", "d256"} <= seen
    if sms == 132:
        assert ws_plan(torch.bfloat16, 16, 2048, 32, 8, 64, sms) == "wgmma/bf16/d64"
        assert ws_plan(torch.bfloat16, 1, 1000, 6, 2, 64, sms) == "wgmma/bf16/d64-rows128"


@needs_gpu
@pytest.mark.parametrize("dtype, B, T, Hkv, D, turns", [(torch.bfloat16, 1, 1000, 2, 128, True),
                                                       (torch.float16, 1, 777, 1, 64, True),
                                                       (torch.float16, 1, 700, 1, 256, True),
                                                       (torch.bfloat16, 3, 2100, 8, 128, False),
                                                       (torch.float16, 2, 3000, 8, 64, False),
                                                       (torch.bfloat16, 2, 2049, 8, 256, False)])
def test_gpu_wgmma_with_and_without_turns(dtype, B, T, Hkv, D, turns):
    """The warp-specialised kernel is compiled with and without turns between its consumer
    warpgroups, and launch_ws takes the one with turns only while every CTA walks at most
    WsTraits::kTurnsUpToRounds tiles (a grid of min(tiles, SMs) CTAs of ws_rows_per_cta rows each):
    shapes on each side of that rule at every width, every element within check_half's bound of
    the float64 reference, none left unwritten."""
    group = 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = B * Hkv * -(-T * group // ws_rows_per_cta(B, T, Hkv * group, Hkv, D, sms))
    assert (tiles <= ws_turns_up_to_rounds() * min(tiles, sms)) == turns, (tiles, sms)
    q, k, v = make_qkv(B, T, Hkv * group, Hkv, D, device="cuda", dtype=dtype)
    assert gqa_module.plan(q, k, v) == ws_plan(dtype, B, T, Hkv * group, Hkv, D, sms)
    check_half(call_poisoned(q, k, v), q, k, v, "%d tiles on %d SMs" % (tiles, sms))


ACCURACY_SHAPES = [(2, 1024, 32, 8, 128), (1, 2048, 16, 4, 64), (2, 1536, 12, 4, 96)]


def worst_channel_rel_err(out, exact):
    """The largest over (query head, channel) of |error| / |reference|, each a norm over (B, T)."""
    err = (out.double() - exact).norm(dim=(0, 1))
    return (err / exact.norm(dim=(0, 1))).max().item()


def sdpa_efficient_expanded(q, k, v):
    """SDPA's memory-efficient backend on k and v expanded to every query head (repeat_interleave)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                               is_causal=True)
    return out.transpose(1, 2)


@needs_gpu
@pytest.mark.parametrize("scaled", ["v_channels", "qk_tokens"])
@pytest.mark.parametrize("B,T,Hq,Hkv,D", ACCURACY_SHAPES)
def test_gpu_fp32_per_channel_error_within_2x_sdpa(B, T, Hq, Hkv, D, scaled):
    """fp32 on the x3 plan, with V's channels scaled over 1e-4..1e4 (log-spaced, randomly permuted)
    or q's and k's tokens over 1e-3..1e3 (log-spaced, each permuted on its own): the worst
    per-(head, channel) relative error against float64 is at most 2x that of SDPA's
    memory-efficient backend on the same inputs."""
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda")
    seed = seed_of("scales", B, T, Hq, Hkv, D, scaled)
    print("scale permutations from torch.Generator seed %d" % seed)
    gen = torch.Generator().manual_seed(seed)
    if scaled == "v_channels":
        scale = torch.logspace(-4, 4, D, dtype=torch.float64)[torch.randperm(D, generator=gen)]
        v = v * scale.float().cuda()
    else:
        tokens = torch.logspace(-3, 3, T, dtype=torch.float64)
        q = q * tokens[torch.randperm(T, generator=gen)].float().cuda()[None, :, None, None]
        k = k * tokens[torch.randperm(T, generator=gen)].float().cuda()[None, :, None, None]
    assert gqa_module.plan(q, k, v) == "x3/fp32/d%d" % (64 if D <= 64 else 128)
    out = gqa_module.causal_gqa_attention(q, k, v)
    exact = reference.causal_gqa_reference(q, k, v)
    ours, sdpa = worst_channel_rel_err(out, exact), worst_channel_rel_err(sdpa_efficient_expanded(q, k, v), exact)
    print("%s (%d, %d, %d, %d, %d): worst per-channel relative error: ours %.3g, SDPA efficient %.3g (ratio %.2f)"
          % (scaled, B, T, Hq, Hkv, D, ours, sdpa, ours / sdpa))
    assert torch.isfinite(out).all()
    assert ours <= 2 * sdpa


# Property-based: shapes, strides, dtypes and a special value drawn by hypothesis, derandomized (the
# same examples on every run of one hypothesis version); each example also draws the seed of its
# values, so a failure report (no shrinking: each example is a GPU call) replays as it is.
HAVE_HYPOTHESIS = importlib.util.find_spec("hypothesis") is not None

if HAVE_HYPOTHESIS:
    from hypothesis import Phase, given, settings, strategies as st

    EDGE_T = (1, 2, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 300)
    EDGE_D = (1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256)

    @st.composite
    def attention_cases(draw, dtypes=tuple(DTYPES), specials=True):
        """A case: sizes (ragged T and odd D included), a layout per tensor, a dtype, maybe one NaN or
        +-Inf at a drawn (tensor, b, t, h, d), and the seed of the values."""
        B, Hkv, G = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
        T = draw(st.one_of(st.sampled_from(EDGE_T), st.integers(1, 300)))
        # Multiples of 8 as often as the rest: with 16-byte rows they reach the wgmma and x3 kernels.
        D = draw(st.one_of(st.sampled_from(EDGE_D), st.integers(1, 256), st.integers(1, 32).map(lambda n: 8 * n)))
        dtype = draw(st.sampled_from(dtypes))
        layout = st.sampled_from(("contiguous", "transposed", "offset"))
        if draw(st.booleans()):   # one layout for all three (all aligned more often), or one each
            layouts = (draw(layout),) * 3
        else:
            layouts = tuple(draw(layout) for _ in "qkv")
        special = None
        if specials and draw(st.booleans()):
            x = draw(st.sampled_from("qkv"))
            t = draw(st.one_of(st.sampled_from(sorted({0, 63, 64, T - 1} & set(range(T)))), st.integers(0, T - 1)))
            special = (x, draw(st.sampled_from(("nan", "inf", "-inf"))), draw(st.integers(0, B - 1)), t,
                       draw(st.integers(0, (Hkv * G if x == "q" else Hkv) - 1)), draw(st.integers(0, D - 1)))
        return dict(B=B, T=T, Hq=Hkv * G, Hkv=Hkv, D=D, dtype=dtype, layouts=layouts, special=special,
                    seed=draw(st.integers(0, (1 << 30) - 1)))

    def build_case(case, device):
        """q, k, v of a case in its layouts, the 16-bit bound (from the values before the special one
        goes in; None in fp32), and the special value written through the view."""
        tensors = make_qkv(case["B"], case["T"], case["Hq"], case["Hkv"], case["D"], device=device,
                           dtype=DTYPES[case["dtype"]], seed=case["seed"])
        laid = {"contiguous": lambda x: x, "transposed": lambda x: x.transpose(1, 2).contiguous().transpose(1, 2),
                "offset": offset_by_one}
        q, k, v = [laid[layout](x) for layout, x in zip(case["layouts"], tensors)]
        bound = half_error_bound(q, k, v) if case["dtype"] != "fp32" else None
        if case["special"] is not None:
            x, value, b, t, h, d = case["special"]
            {"q": q, "k": k, "v": v}[x][b, t, h, d] = float(value)
        return q, k, v, bound

    @needs_gpu
    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(case=attention_cases())
    def test_gpu_property_matches_float64(case):
        q, k, v, bound = build_case(case, "cuda")
        what = "%r plan %s" % (case, gqa_module.plan(q, k, v))
        out = call_poisoned(q, k, v)
        assert_like_reference(out, q, k, v, what, bound)
        if case["dtype"] == "fp32" and case["special"] is None:
            assert rel_err(out, reference.causal_gqa_reference(q, k, v)) <= 1e-5, what

    @settings(max_examples=30, deadline=None, derandomize=True, database=None,
              phases=(Phase.explicit, Phase.generate))
    @given(case=attention_cases(dtypes=("fp32",), specials=False))
    def test_cpu_property_matches_float64(case):
        """The PyTorch path (CPU tensors), fp32, finite values, every layout."""
        q, k, v, _ = build_case(case, "cpu")
        out = gqa_module.causal_gqa_attention(q, k, v)
        exact = reference.causal_gqa_reference(q, k, v)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert torch.allclose(out.double(), exact, atol=1e-4, rtol=1e-4), case
        assert rel_err(out, exact) <= 1e-5, case
else:
    @pytest.mark.skip(reason="the property-based tests need hypothesis: pip install -r requirements.txt")
    def test_property_based_tests_need_hypothesis():
        pass


# ------------------------------------------------------------------------------------------------
# The single-file bundle, the compile cache under concurrency, torch.compile
# KernelBench's static rules as its checker (src/kernelbench/kernel_static_checker.py) states them:
# every line is cut at its first '#' and then at its first '//', and patterns are searched in what
# is left. These are its errors (try/except, pass, threads and processes, patched timers, tensor
# subclasses); a CUDA submission must also keep `__global__` and `load_inline` (or cpp_extension).
KB_ERROR_RULES = {
    "try/except": [r"\btry\s*:", r"\bexcept\s*:", r"\bexcept\s+\w+"],
    "pass": [r"\bpass\b"],
    "threads and processes": [r"threading\.Thread\s*\(", r"import\s+threading", r"from\s+threading\s+import",
                              r"multiprocessing\.(Process|Pool|Manager|Queue|Pipe)", r"import\s+multiprocessing",
                              r"concurrent\.futures", r"ThreadPoolExecutor", r"ProcessPoolExecutor"],
    "patched timers": [r"torch\.cuda\.Event\.record\s*=", r"torch\.cuda\.Event\.elapsed_time\s*=",
                       r"torch\.cuda\.synchronize\s*=", r"torch\.cuda\.Event\s*=", r"time\.perf_counter\s*=",
                       r"time\.time\s*="],
    "tensor subclasses": [r"_make_subclass", r"class\s+\w+.*\(torch\.Tensor\)", r"class\s+\w+.*\(Tensor\)",
                          r"torch\.Tensor\.__new__"],
}
# Its warnings that the bundle avoids altogether: streams, torch.nn compute layers, torch.nn.functional.
KB_AVOIDED_WARNINGS = {
    "streams": [r"torch\.cuda\.Stream\s*\(", r"cuda\.Stream\s*\(", r"with\s+torch\.cuda\.stream", r"\.wait_stream\s*\(",
                r"\.record_stream\s*\("],
    "torch.nn compute": [r"torch\.nn\.(?!(Module|parameter|Parameter|ParameterList|ParameterDict|ModuleList|ModuleDict|init)\b)",
                         r"\bnn\.functional\.\w+"],
}
# The precision-downgrade warning (fp32 only) that docs/design.md lists: fp16 output is stored with __float2half_rn.
KB_FP16_CONVERSION = r"__float2half(_rn)?\s*\("


def kernelbench_cut(source):
    """Every line up to its first '#', then up to its first '//', as KernelBench's checker reads code."""
    return "\n".join(line.split("#", 1)[0].split("//", 1)[0] for line in source.split("\n"))


def first_match(pattern, code):
    for number, line in enumerate(code.split("\n"), 1):
        if re.search(pattern, line):
            return "line %d: %s" % (number, line.strip()[:160])
    return None


def readme_checker_warnings():
    """{precision: {warning}} from docs/design.md's table of what KernelBench's checker reports."""
    with open(os.path.join(HERE, "docs", "design.md")) as fh:
        text = fh.read()
    section = text.split("### KernelBench's static checker", 1)[1].split("\n#", 1)[0]
    listed = {}
    for row in section.split("\n"):
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`") and cells[1].endswith("`"):
            for precision in cells[0].split(","):
                listed.setdefault(precision.strip(), set()).add(cells[1].strip("`"))
    return listed


@pytest.fixture(scope="module")
def bundle_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "gqa_bundle.py"
    run = subprocess.run([sys.executable, "gqa_module.py", "--bundle", str(path)], cwd=HERE, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return path


def test_bundle_obeys_kernelbench_static_rules(bundle_path):
    """A freshly written bundle, read as KernelBench's checker reads it: no error pattern, the CUDA
    kernels visible (every __global__ of kernels/ survives the cut) and load_inline present."""
    code = kernelbench_cut(bundle_path.read_text())
    for rules in (KB_ERROR_RULES, KB_AVOIDED_WARNINGS):
        for rule, patterns in rules.items():
            for pattern in patterns:
                assert not re.search(pattern, code), (rule, pattern, first_match(pattern, code))
    kernels = "".join(kernelbench_cut(blob.decode()) for blob in gqa_module._read_kernel_files().values())
    assert kernels.count("__global__") > 0
    assert code.count("__global__") == kernels.count("__global__")
    assert "load_inline" in code
    # The one fp32 warning left is the fp16 store of the CUDA sources, and docs/design.md lists it.
    if re.search(KB_FP16_CONVERSION, code):
        assert readme_checker_warnings().get("fp32"), "docs/design.md must list the fp32 precision warning"
    # gqa_module.py itself obeys the error rules too.
    with open(os.path.join(HERE, "gqa_module.py")) as fh:
        own = kernelbench_cut(fh.read())
    for rule, patterns in KB_ERROR_RULES.items():
        for pattern in patterns:
            assert not re.search(pattern, own), (rule, pattern, first_match(pattern, own))


KERNELBENCH_SRC = os.environ.get("KERNELBENCH_SRC")


@pytest.mark.skipif(not KERNELBENCH_SRC, reason="KERNELBENCH_SRC is not set: point it at a KernelBench checkout's "
                                                "src/ directory to run KernelBench's own static checker on the bundle")
def test_bundle_passes_kernelbench_checker(bundle_path):
    """KernelBench's own validate_kernel_static: valid, no errors, and only the warnings docs/design.md lists."""
    path = os.path.join(KERNELBENCH_SRC, "kernelbench", "kernel_static_checker.py")
    assert os.path.isfile(path), "KERNELBENCH_SRC=%s has no kernelbench/kernel_static_checker.py" % KERNELBENCH_SRC
    # The checker file alone: the kernelbench package's __init__ imports API clients it does not need.
    spec = importlib.util.spec_from_file_location("kernelbench_static_checker", path)
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    listed = readme_checker_warnings()
    source = bundle_path.read_text()
    for precision in ("fp32", "fp16", "bf16"):
        valid, errors, warnings = checker.validate_kernel_static(source, backend="cuda", precision=precision)
        print(precision, (valid, errors, warnings))
        assert valid and errors == [], (precision, errors)
        assert set(warnings) <= listed.get(precision, set()), (precision, warnings, listed)


@pytest.mark.skipif(not KERNELBENCH_SRC, reason="KERNELBENCH_SRC is not set: point it at a KernelBench checkout's "
                                                "src/ directory to dry-run bench/kernelbench_eval.py")
def test_kernelbench_eval_dry_run(tmp_path):
    """The device script's steps that need no GPU: bundle, static checks, kernelbench's imports, and in
    each evaluation process KernelBench's loading of the reference (with and without init args) and
    the bundle."""
    out = tmp_path / "summary.json"
    run = subprocess.run([sys.executable, os.path.join(HERE, "bench", "kernelbench_eval.py"), str(out), "--dry-run",
                          "--work", str(tmp_path / "work")], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900, env=dict(os.environ, KERNELBENCH_SRC=KERNELBENCH_SRC))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert all(summary["static"][p]["valid"] for p in ("fp32", "fp16", "bf16"))
    evaluations = summary["evaluations"]
    assert [(e["case"], e["process"]) for e in evaluations] == [("fp32", 1), ("fp32-no-init", 2), ("fp16", 3),
                                                                 ("bf16", 4), ("fp32", 5), ("bf16", 5)]
    assert [e["dry_run"]["init_inputs"] for e in evaluations] == [[8, 2, 32], [], [8, 2, 32], [8, 2, 32], [8, 2, 32],
                                                                  [8, 2, 32]]
    assert len({e["dry_run"]["TORCH_EXTENSIONS_DIR"] for e in evaluations}) == len(evaluations)


def exec_bundle(path):
    """Load the bundle the way the harness does: exec of its source in a fresh namespace."""
    namespace = {}
    exec(compile(path.read_text(), "<bundle>", "exec"), namespace)
    return namespace


@needs_cuda_torch
def test_bundle_reads_no_files_and_refuses_cpu_tensors(bundle_path, tmp_path, monkeypatch):
    """The bundle carries kernels/ byte for byte and runs CUDA tensors only: a CPU tensor gets an
    error that points to gqa_module, which itself still runs it through PyTorch."""
    monkeypatch.chdir(tmp_path)   # nothing of the checkout is reachable by relative path
    ns = exec_bundle(bundle_path)
    assert ns["kernel_source_sha256"]() == gqa_module.kernel_source_sha256()
    assert {name: text.encode() for name, text in ns["_EMBEDDED_SOURCES"].items()} == gqa_module._read_kernel_files()
    assert "F" not in ns and "_attention_torch" not in ns and "write_bundle" not in ns
    assert ns["load_extension"]() is torch.ops.gqa_attn
    q, k, v = make_qkv(2, 80, 8, 2, 32)
    with pytest.raises(RuntimeError, match=r"q is on cpu.*CUDA tensors only.*gqa_module\.py"):
        ns["ModelNew"](8, 2, 32)(q, k, v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        ns["causal_gqa_attention"](q.tolist(), k, v)
    out = gqa_module.ModelNew()(q, k, v)
    assert torch.allclose(out.double(), reference.causal_gqa_reference(q, k, v), atol=1e-4, rtol=1e-4)


def test_bundle_exec_beside_reference_keeps_its_names(bundle_path):
    """KernelBench execs the reference and then the submission into one namespace: the bundle rebinds
    none of the reference's names to another object."""
    context = {}
    with open(os.path.join(HERE, "reference.py")) as fh:
        exec(compile(fh.read(), "<reference>", "exec"), context)
    before = dict(context)
    exec(compile(bundle_path.read_text(), "<bundle>", "exec"), context)
    rebound = sorted(name for name, value in before.items() if not name.startswith("__") and context[name] is not value)
    assert rebound == []
    assert "ModelNew" in context


@pytest.mark.parametrize("text,problem", [("a '''quoted''' b\n", "'''"), ("ends in a backslash \\", "backslash"),
                                          ("ends in a quote '", "single quote"), ("crlf\r\n", "carriage return"),
                                          ("nul \0 byte\n", "NUL")])
def test_bundle_refuses_sources_a_raw_string_cannot_hold(text, problem, monkeypatch):
    files = dict(gqa_module._read_kernel_files())
    files["gqa_params.h"] = text.encode()
    monkeypatch.setattr(gqa_module, "_read_kernel_files", lambda: files)
    with pytest.raises(ValueError, match="kernels/gqa_params.h") as info:
        gqa_module.bundle_source()
    assert problem in str(info.value)


def test_bundle_embeds_awkward_sources_byte_for_byte(monkeypatch):
    """Macro continuations, escapes and quotes inside the CUDA text read back exactly."""
    awkward = ("#define TWICE(x) \\\n    ((x) + (x))\nconst char* s = \"a\\n\\t\\\"b\\\"\"; char c = '\\'';\n"
               "// a comment with ''' inside is refused, but \"\"\" is fine: \"\"\"\n\n\n  trailing spaces  \n")
    files = dict(gqa_module._read_kernel_files())
    files["gqa_params.h"] = awkward.encode()
    monkeypatch.setattr(gqa_module, "_read_kernel_files", lambda: files)
    with pytest.raises(ValueError):
        gqa_module.bundle_source()
    files["gqa_params.h"] = awkward.replace("'''", "''").encode()
    ns = {}
    exec(compile(gqa_module.bundle_source(), "<bundle>", "exec"), ns)
    assert ns["_EMBEDDED_SOURCES"]["gqa_params.h"].encode() == files["gqa_params.h"]


@needs_cuda_torch
def test_bundle_run_as_script_loads_the_library(bundle_path, tmp_path):
    """A harness may precompile by running the file: that builds (or finds) and loads the library."""
    run = subprocess.run([sys.executable, str(bundle_path)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "kernel sources sha256 %s" % gqa_module.kernel_source_sha256() in run.stdout


# Two loads in one process, as a harness makes them: the bundle exec'd twice (each time after
# setting another TORCH_EXTENSIONS_DIR, as KernelBench's load_custom_model does), gqa_module
# imported beside it, and two copies of the bundle imported from files; then a version of the
# bundle with other kernel sources. argv: bundle, copy of it, build dirs 1, 2 and 3, device, and
# which loads first (the bundle, or gqa_module).
TWO_LOADS_CODE = r"""
import importlib.util, json, os, sys
import torch
import gqa_module
import reference
bundle, bundle_copy, dir1, dir2, dir3, device, order = sys.argv[1:8]
summary = {}

def exec_bundle(source, build_dir):
    namespace = {}
    exec(compile("import os\nos.environ['TORCH_EXTENSIONS_DIR'] = %r\n" % build_dir + source, "<bundle>", "exec"),
         namespace)
    return namespace

def import_copy(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

with open(bundle) as fh:
    source = fh.read()
loaded = {}
if order == "module-first":
    loaded["gqa_module"] = gqa_module.load_extension()
first = exec_bundle(source, dir1)             # each copy loads right after it is exec'd
loaded["exec 1"] = first["load_extension"]()
second = exec_bundle(source, dir2)
loaded["exec 2"] = second["load_extension"]()
loaded["gqa_module"] = gqa_module.load_extension()
copies = [import_copy(bundle, "gqa_bundle_a"), import_copy(bundle_copy, "gqa_bundle_b")]
loaded["copy a"] = copies[0].load_extension()
loaded["copy b"] = copies[1].load_extension()
summary["one_namespace"] = all(ns is torch.ops.gqa_attn for ns in loaded.values())
summary["libraries"] = sorted(os.path.basename(p) for p in torch.ops.loaded_libraries if "gqa_attn" in p)
summary["dir2_libraries"] = sorted(f for _, _, fs in os.walk(dir2) for f in fs if f.endswith(".so"))
summary["recorded_sha256"] = torch.ops.gqa_attn._gqa_source_sha256

models = {"gqa_module": gqa_module.ModelNew(), "exec 1": first["ModelNew"](8, 2, 32), "exec 2": second["ModelNew"](),
          "copy a": copies[0].ModelNew(8, 2, 32), "copy b": copies[1].ModelNew()}
gen = torch.Generator().manual_seed(0)
q, k, v = [torch.randn(2, 80, h, 32, generator=gen) for h in (8, 2, 2)]
if device == "cuda":
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    outs = {name: model(q, k, v) for name, model in models.items()}
    summary["bitwise_equal"] = {name: torch.equal(out, outs["gqa_module"]) for name, out in outs.items()}
    summary["max_abs_err"] = (outs["gqa_module"].double() - reference.causal_gqa_reference(q, k, v)).abs().max().item()
else:
    meta = [t.to("meta") for t in (q, k, v)]
    summary["meta_shapes"] = sorted({tuple(ns.causal_attention(*meta).shape) for ns in loaded.values()})
    summary["cpu_errors"] = {}
    for name, model in models.items():
        if name != "gqa_module":
            try:
                model(q, k, v)
                summary["cpu_errors"][name] = None
            except RuntimeError as e:
                summary["cpu_errors"][name] = str(e)
    out = models["gqa_module"](q, k, v)
    summary["max_abs_err"] = (out.double() - reference.causal_gqa_reference(q, k, v)).abs().max().item()

other = source.replace("_EMBEDDED_SOURCES = {\n", "_EMBEDDED_SOURCES = {\n    'zz_other.h': r'''// other sources\n''',\n", 1)
third = exec_bundle(other, dir3)
summary["other_sha256"] = third["kernel_source_sha256"]()
try:
    third["load_extension"]()
    summary["other_error"] = None
except RuntimeError as e:
    summary["other_error"] = str(e)
summary["dir3_entries"] = sorted(os.listdir(dir3))
summary["still_loaded"] = hasattr(torch.ops.gqa_attn, "causal_attention")
print("SUMMARY " + json.dumps(summary))
"""


def run_two_loads(bundle_path, tmp_path, device, order):
    """TWO_LOADS_CODE in a fresh process; the first build directory is torch's cache (warm after the
    other tests), the second and third are new and must stay without a library."""
    from torch.utils import cpp_extension
    copy = tmp_path / "copy_of_bundle.py"
    copy.write_text(bundle_path.read_text())
    dirs = [os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(),
            str(tmp_path / "build2"), str(tmp_path / "build3")]
    for d in dirs[1:]:
        os.makedirs(d)
    run = subprocess.run([sys.executable, "-c", TWO_LOADS_CODE, str(bundle_path), str(copy)] + dirs + [device, order],
                         cwd=HERE, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    lines = [line for line in run.stdout.splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == 1, run.stdout[-3000:]
    summary = json.loads(lines[0][len("SUMMARY "):])
    print(json.dumps(summary, indent=1))
    sha = gqa_module.kernel_source_sha256()
    assert summary["one_namespace"]
    assert len(summary["libraries"]) == 1 and summary["libraries"][0].startswith("gqa_attn_" + sha[:12])
    assert summary["dir2_libraries"] == []
    assert summary["recorded_sha256"] == sha
    assert summary["other_sha256"] != sha
    assert sha in summary["other_error"] and summary["other_sha256"] in summary["other_error"]
    assert summary["dir3_entries"] == [] and summary["still_loaded"]
    return summary


@needs_cuda_torch
@pytest.mark.parametrize("order", ["bundle-first", "module-first"])
def test_two_loads_in_one_process(bundle_path, tmp_path, order):
    """Loading is idempotent in one process: one library, no abort, other sources refused. On CPU
    tensors the ops answer shapes (meta tensors), each bundle copy refuses with its pointer to
    gqa_module, and gqa_module runs them through PyTorch."""
    summary = run_two_loads(bundle_path, tmp_path, "cpu", order)
    assert summary["meta_shapes"] == [[2, 80, 8, 32]]
    assert sorted(summary["cpu_errors"]) == ["copy a", "copy b", "exec 1", "exec 2"]
    assert all(e and "CUDA tensors only" in e and "gqa_module.py" in e for e in summary["cpu_errors"].values())
    assert summary["max_abs_err"] < 1e-4


@pytest.mark.parametrize("args,code,words", [(["--help"], 0, "--bundle PATH"),
                                             (["--bogus"], 2, "unrecognized arguments: --bogus"),
                                             (["--bundle"], 2, "argument --bundle: expected one argument"),
                                             (["--bundle", ""], 2, "expected a file path"),
                                             (["out.py"], 2, "unrecognized arguments: out.py")])
def test_argparse_command_line(args, code, words, tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "gqa_module.py")] + args, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == code, run.stderr[-2000:]
    assert words in (run.stdout if code == 0 else run.stderr)
    assert os.listdir(tmp_path) == []   # nothing written


@pytest.mark.gpu   # it checks more where a GPU is present
def test_main_without_arguments_runs_the_check():
    run = subprocess.run([sys.executable, "gqa_module.py"], cwd=HERE, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    if torch.version.cuda is None:
        assert "CPU library ready" in run.stdout and "CPU-only build" in run.stdout
    else:
        assert "extension ready" in run.stdout
    if torch.cuda.is_available():
        assert "faster" in run.stdout
    else:
        assert "CPU path checked" in run.stdout


def first_call_processes(n, cache_dir, extra_env=None):
    code = "import gqa_module; gqa_module.load_extension(); print('ok')"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(cache_dir), **(extra_env or {}))
    return [subprocess.Popen([sys.executable, "-c", code], cwd=HERE, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(n)]


@needs_cuda_torch
def test_four_processes_first_call_together(tmp_path):
    procs = first_call_processes(4, tmp_path)
    outputs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0 and "ok" in out, err[-2000:]
    assert sum(err.count("compiling the entry library") for _, err in outputs) == 1


@needs_cuda_torch
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
@pytest.mark.parametrize("shape, dtype, unit", [((2, 80, 8, 2, 32), "float32", None),
                                                ((1, 1024, 8, 2, 128), "bfloat16", "wgmma/bf16/d128")])
def test_gpu_first_call_builds_the_entry_and_its_unit_at_once(tmp_path, shape, dtype, unit):
    """A first call in a fresh process builds the entry library and, beside it in the builder,
    the plan library and the unit the call runs, each once; at the harness shape no unit (the short
    family is compiled into the entry library). The unit is built by whichever process takes its
    lock first: the builder runs at a lower priority, so on a busy machine the caller, done with
    the entry library, may get there first (test_builder_builds_the_unit_load_unit_then_loads
    covers the builder's own build)."""
    code = ("import sys, torch, gqa_module\n"
            "B, T, Hq, Hkv, D = %r\n"
            "q, k, v = (torch.randn(B, T, H, D, device='cuda', dtype=torch.%s) for H in (Hq, Hkv, Hkv))\n"
            "out = gqa_module.causal_gqa_attention(q, k, v)\n"
            "print(gqa_module.plan(q, k, v), bool(out.isfinite().all()))\n" % (shape, dtype))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [unit or "short/fp32/d32", "True"], run.stdout
    built = sorted(d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d))
    assert len(built) == (3 if unit else 2) and sum(d.endswith("_plan") for d in built) == 1, built
    assert run.stderr.count("compiling the entry library") == 1, run.stderr[-3000:]
    if unit:
        assert run.stderr.count("compiling the %s kernels" % unit) == 1, run.stderr[-3000:]


@needs_cuda_torch
def test_builder_builds_the_unit_load_unit_then_loads(tmp_path):
    """The builder, given a first call's shape, builds the plan library and the unit its plan names,
    under the names load_unit uses (no second build); for the harness shape, the plan library only."""
    code = ("import gqa_module as g\n"
            "g._use_cuda_home(g._cuda_home())\n"
            "sha, targets, files = g.kernel_source_sha256(), g._targets(), g._read_kernel_files()\n"
            "build_id = g._build_id(sha, g._cuda_home())\n"
            "for shape in ((2, 80, 8, 2, 32, 0, 1, 0, 132, 9), (2, 100, 8, 2, 64, 1, 1, 0, 132, 9)):\n"
            "    assert g._start_builder(g._unit_job(shape, build_id, targets, files)).wait() == 0\n"
            "print('unit', bool(g.load_unit('rowwise/fp16', 1, 0, False)))\n")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["unit", "True"], run.stdout
    assert run.stderr.count("compiling the rowwise/fp16 kernels beside the entry library") == 1, run.stderr[-3000:]
    assert "compiling the rowwise/fp16 kernels (first use" not in run.stderr
    built = sorted(d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d))
    assert [d.rsplit("_sm", 1)[1].split("_", 1)[-1] for d in built] == ["90a", "plan", "rowwise_fp16"], built
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".json")]   # the job files are removed


@needs_gpu
def test_gpu_bundle_matches_module(bundle_path):
    ns = exec_bundle(bundle_path)
    q, k, v = make_qkv(2, 300, 8, 2, 64, device="cuda")
    assert torch.equal(ns["ModelNew"]()(q, k, v), gqa_module.ModelNew()(q, k, v))


@needs_gpu
@pytest.mark.parametrize("order", ["bundle-first", "module-first"])
def test_gpu_two_loads_in_one_process_give_equal_outputs(bundle_path, tmp_path, order):
    """The same two loads on CUDA tensors: every copy's ModelNew gives gqa_module's output bit for bit."""
    summary = run_two_loads(bundle_path, tmp_path, "cuda", order)
    assert summary["bitwise_equal"] == {name: True for name in ("gqa_module", "exec 1", "exec 2", "copy a", "copy b")}
    assert summary["max_abs_err"] < 1e-4


@needs_gpu
def test_gpu_torch_compile_fullgraph_matches_eager():
    model = gqa_module.ModelNew()
    compiled = torch.compile(model, fullgraph=True)
    for T in (80, 200):
        q, k, v = make_qkv(2, T, 8, 2, 32, device="cuda")
        assert torch.equal(compiled(q, k, v), model(q, k, v))


@needs_gpu
def test_gpu_opcheck():
    """opcheck's schema, fake, autograd-registration and dynamo checks, with and without inputs
    that require grad."""
    op = gqa_module.load_extension().causal_attention.default
    for shape in ((2, 80, 8, 2, 32), (1, 65, 6, 3, 40)):
        q, k, v = make_qkv(*shape, device="cuda")
        torch.library.opcheck(op, (q, k, v))
        torch.library.opcheck(op, tuple(t.requires_grad_(True) for t in (q, k, v)))


# ------------------------------------------------------------------------------------------------
# Backward: gradients against float64 autograd of the reference
def reference_grads(q, k, v, grad_out):
    """dq, dk, dv in float64: autograd through reference.causal_gqa_reference, over the attended
    keys alone when grad_out holds Inf or NaN (a masked key's zero weight times it is NaN)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    attended_only = not bool(torch.isfinite(grad_out).all())
    reference.causal_gqa_reference(q64, k64, v64, attended_only).backward(grad_out.double())
    return q64.grad, k64.grad, v64.grad


def tensor_core_backward(T, D=64):
    """The family of the 16-bit tensor-core backward for T steps at head_dim D, or None: wgmma on an
    sm_90 GPU with an sm_90a build past 128 steps (head_dim 64, 128 and 256), mma.sync otherwise
    (64 and 128), none at other head dims (kernels/attention.cu)."""
    sm90a = any(plan.startswith("wgmma/") for plan in gqa_module.all_plans())
    if T > 128 and sm90a and torch.cuda.get_device_capability() == (9, 0) and D in (64, 128, 256):
        return "bwdwg"
    return "bwdmma" if D in (64, 128) else None


FUSED_MIN_T = {64: 1024, 128: 8192}   # kGqaFusedBackwardMinT64, kGqaFusedBackwardMinT (kernels/gqa_params.h)


def fused_at_64(B, T, Hq, Hkv):
    """kGqaFusedBackwardMinT64's rule (kernels/gqa_params.h): from 1024 steps, groups of 4 or more,
    and key tile 0's n_q G steps at most an eighth of an SM's share of the grid's steps."""
    G, n_q, n_k = Hq // Hkv, (T + 63) // 64, (T + 127) // 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    steps = B * Hkv * G * sum(n_q - 2 * kt for kt in range(n_k))
    return T >= FUSED_MIN_T[64] and G >= 4 and 8 * n_q * G * sms <= steps


def backward_16bit_plan(B, T, Hq, Hkv, D, name):
    """The 16-bit backward's plan at (B, T, Hq, Hkv, D) (dtype name `name`), with
    GQA_FUSED_BACKWARD_MIN_T unset: the tensor-core family's, its fused kernel where the family is
    wgmma and (head_dim 128) T reaches FUSED_MIN_T or (64) fused_at_64 holds, the row-wise kernels
    where no family runs."""
    family = tensor_core_backward(T, D)
    if family is None:
        return "backward/" + name
    fused = family == "bwdwg" and (T >= FUSED_MIN_T[128] if D == 128 else D == 64 and fused_at_64(B, T, Hq, Hkv))
    return "%s/%s/d%d%s" % (family, name, D, "/fused" if fused else "")


def fp32_backward_plan(T, D):
    """The fp32 backward's plan for T steps at head_dim D: the x3 unit (three fp16 wgmma products
    per product) where the 16-bit wgmma unit runs, at head_dim 64 and 128; the row-wise kernels
    otherwise (kernels/attention.cu)."""
    return "bwdx3/fp32/d%d" % D if tensor_core_backward(T, D) == "bwdwg" and D in (64, 128) else "backward/fp32"


def project_grads(q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    gqa_module.causal_gqa_attention(q, k, v).backward(grad_out)
    return q.grad, k.grad, v.grad


def channel_rel_errs(got, exact):
    """Norm-relative error of every head-dim channel (the last dim), as a 1-D tensor."""
    dims = tuple(range(exact.dim() - 1))
    return (got.double() - exact).pow(2).sum(dim=dims).sqrt() / exact.pow(2).sum(dim=dims).sqrt().clamp_min(1e-300)


# One case per backward plan of an sm_90a build on an H200: plan -> (B, T, Hq, Hkv, D, dtype, the
# GQA_FUSED_BACKWARD_MIN_T that takes the fused kernel at this T, or None).
BACKWARD_PLAN_CASES = {
    "backward/fp32": (1, 100, 4, 2, 40, torch.float32, None),
    "backward/fp16": (1, 140, 4, 2, 40, torch.float16, None),
    "backward/bf16": (1, 140, 4, 2, 40, torch.bfloat16, None),
    "bwdx3/fp32/d64": (1, 140, 4, 2, 64, torch.float32, None),
    "bwdx3/fp32/d128": (1, 140, 4, 2, 128, torch.float32, None),
    **{"bwdmma/%s/d%d" % (name, D): (1, 100, 4, 2, D, dtype, None)
       for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)) for D in (64, 128)},
    **{"bwdwg/%s/d%d" % (name, D): (1, 140, 4, 2, D, dtype, None)
       for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)) for D in (64, 128, 256)},
    **{"bwdwg/%s/d%d/fused" % (name, D): (2, 300, 8, 2, D, dtype, 129)
       for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)) for D in (64, 128)},
}


def backward_plan_inputs(name, monkeypatch):
    """q, k, v (requiring grad) and a grad_out for backward plan `name` (BACKWARD_PLAN_CASES), the
    plan asserted; skips where this GPU or build has no such plan."""
    B, T, Hq, Hkv, D, dtype, fused_min_t = BACKWARD_PLAN_CASES[name]
    if name.startswith(("bwdwg/", "bwdx3/")) and tensor_core_backward(T, D) != "bwdwg":
        pytest.skip("%s is the wgmma backward's: an sm_90a build on an H100 or H200" % name)
    if fused_min_t is not None:
        monkeypatch.setenv("GQA_FUSED_BACKWARD_MIN_T", str(fused_min_t))
    else:
        monkeypatch.delenv("GQA_FUSED_BACKWARD_MIN_T", raising=False)
    q, k, v = (t.requires_grad_(True) for t in make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype))
    assert gqa_module.backward_plan(q, k, v) == name
    return q, k, v, torch.randn_like(q)


@needs_gpu
@pytest.mark.parametrize("name", list(BACKWARD_PLAN_CASES))
def test_gpu_double_backward_raises_on_every_backward_plan(name, monkeypatch):
    """torch.autograd.grad(..., create_graph=True) gives the plain backward's gradients, bitwise;
    a loss built on them (a gradient penalty) raises when differentiated, naming what is not
    supported, instead of returning a number."""
    q, k, v, grad_out = backward_plan_inputs(name, monkeypatch)
    plain = project_grads(q, k, v, grad_out)
    first = torch.autograd.grad(gqa_module.causal_gqa_attention(q, k, v), (q, k, v), grad_out, create_graph=True)
    assert all(g.requires_grad for g in first)
    assert all(torch.equal(a, b) for a, b in zip(first, plain))
    penalty = sum(g.float().pow(2).sum() for g in first)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        penalty.backward()
    for target in range(3):   # d(sum dq)/d(q, k or v): each way into the backward raises
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        (dq,) = torch.autograd.grad(gqa_module.causal_gqa_attention(*leaves), leaves[:1], grad_out, create_graph=True)
        with pytest.raises(RuntimeError, match="double backward is not supported"):
            torch.autograd.grad(dq.float().sum(), leaves[target])
# ------------------------------------------------------------------------------------------------
# Backward with Inf and NaN: every plan hands such a call to the row-wise kernels
# (kernels/backward/backward.cu), whose header states the rule: dS = P (dP - delta) with autograd's
# delta = rowsum(P dP) where dO . o is not finite, so NaN, +Inf and -Inf land as in float64 autograd.
def rowwise_backward_emulation(q, k, v, o, grad_out):
    """backward.cu's query_row and key_row on the CPU in float32, vectorised over rows, with each
    Inf- or NaN-making step as the kernels take it (sums in another order: a sum's kind, NaN, +-Inf
    or finite, is the same in any order). Returns dq, dk, dv."""
    q, k, v, o, do = (t.float() for t in (q, k, v, o, grad_out))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale, scale_log2 = 1 / math.sqrt(D), 1.4426950408889634 / math.sqrt(D)
    kx, vx, rows = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2), torch.arange(T).view(1, T, 1)

    def key(j):   # every query row's score (log2 units) and dp against key j, its k row, and who attends
        kj = kx[:, j:j + 1]
        return (q * kj).sum(-1) * scale_log2, (do * vx[:, j:j + 1]).sum(-1), kj, rows >= j

    delta, m, l, acc = (do * o).sum(-1), torch.full(q.shape[:3], -math.inf), torch.zeros(q.shape[:3]), torch.zeros(q.shape)
    for j in range(T):   # kernel 1: the online softmax, dQ rescaled as the maximum grows
        s2, dp, kj, on = key(j)
        grow, r = on & (s2 > m), torch.exp2(m - s2)
        l, acc, m = torch.where(grow, l * r, l), torch.where(grow[..., None], acc * r[..., None], acc), torch.where(grow, s2, m)
        w = torch.where(on & (s2 != -math.inf), torch.exp2(s2 - m), 0.0)
        l = l + w
        acc = torch.where(on[..., None], acc + (w * (dp - delta))[..., None] * kj, acc)
    dq, lse2, redo = acc * (scale / l)[..., None], m + torch.log2(l), ~torch.isfinite(delta)
    delta2, acc = torch.zeros_like(delta), torch.zeros(q.shape)
    for j in range(T):   # rows whose dO . o is not finite: delta = sum_j p_j dp_j, then dQ again
        s2, dp, _, on = key(j)
        delta2 = torch.where(on, delta2 + torch.exp2(s2 - lse2) * dp, delta2)
    for j in range(T):
        s2, dp, kj, on = key(j)
        acc = torch.where(on[..., None], acc + (torch.exp2(s2 - lse2) * (dp - delta2))[..., None] * kj, acc)
    dq, delta = torch.where(redo[..., None], acc * scale, dq), torch.where(redo, delta2, delta)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)
    by_group = [x.unflatten(2, (-1, G)) for x in (q, do, lse2, delta)]   # [B, T, Hkv, G(, D)]
    for i in range(T):   # kernel 2: key rows j <= i, query rows in order (i, then the group's heads)
        for g in range(G):
            qi, doi, li, di = (x[:, i:i + 1, :, g] for x in by_group)
            prob = torch.exp2((qi * k).sum(-1) * scale_log2 - li)
            ds = prob * ((doi * v).sum(-1) - di)
            on = (rows <= i)[..., None]
            dv, dk = torch.where(on, dv + prob[..., None] * doi, dv), torch.where(on, dk + ds[..., None] * qi, dk)
    return dq, dk * scale, dv


NONFINITE_INJECTIONS = 15   # NaN, +Inf, -Inf at each of 5 times


def inject_one_per_batch(x, T, rng):
    """NaN, +Inf and -Inf at times 0, 37, 63, 64 and T - 1 of x (q, k, v or grad_out: B >= 15), one
    a batch (so they never meet), at a head and channel from rng (batch 0: channel 0). Returns labels."""
    labels = []
    for b, (value, t) in enumerate(itertools.product((NAN, INF, -INF), (0, 37, 63, 64, T - 1))):
        h, d = rng.randrange(x.shape[2]), 0 if b == 0 else rng.randrange(x.shape[3])
        x[b, t, h, d] = value
        labels.append("b%d: %s at (t %d, h %d, d %d)" % (b, value, t, h, d))
    return labels


def assert_grads_like_reference(got, ref, what, finite_check):
    """NaN, +Inf and -Inf at exactly the reference's elements of dq, dk and dv; finite_check(a, b) on
    the finite ones."""
    for grad_name, a, b in zip(("dq", "dk", "dv"), got, ref):
        for kind, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
            off = test(a) != test(b)
            assert not off.any(), "%s %s: %s differs from the reference at %d elements, first (b, t, h, d) %s" % (
                what, grad_name, kind, int(off.sum()), off.nonzero()[:4].tolist())
        finite = torch.isfinite(b)
        if finite.any():
            assert finite_check(a[finite], b[finite]), (what, grad_name)


def test_backward_nonfinite_rule_worked_example():
    """backward.cu's worked example (T = 2, D = 1): row 1 with p = (3/4, 1/4), v = (1, -1) and
    dO_1 = +Inf. dO_1 . o_1 = +Inf would give dS_1 = (NaN, -Inf) and dK_1 = -Inf; autograd's delta
    = sum_j p_j dP_j is NaN, so float64 autograd's dK is NaN at both keys, and so is the emulation's."""
    q = torch.tensor([1.0, 1.0]).view(1, 2, 1, 1)
    k = torch.tensor([math.log(3), 0.0]).view(1, 2, 1, 1)
    v = torch.tensor([1.0, -1.0]).view(1, 2, 1, 1)
    grad_out = torch.tensor([1.0, INF]).view(1, 2, 1, 1)
    p, dp = torch.tensor([0.75, 0.25]), grad_out[0, 1, 0, 0] * v.view(2)
    by_o = p * (dp - grad_out[0, 1, 0, 0] * (p @ v.view(2)))
    assert torch.isnan(by_o[0]) and torch.isneginf(by_o[1])
    ref = reference_grads(q, k, v, grad_out)
    assert torch.isnan(ref[1]).all() and torch.isnan(ref[0][0, 1]).all() and torch.isfinite(ref[0][0, 0]).all()
    assert torch.isposinf(ref[2]).all()
    o = reference.causal_gqa_reference(q, k, v)
    assert_grads_like_reference(rowwise_backward_emulation(q, k, v, o, grad_out), ref, "worked example",
                                lambda a, b: torch.allclose(a.double(), b, atol=1e-5))


@pytest.mark.parametrize("which", ["q", "k", "v", "grad_out"])
def test_rowwise_backward_emulation_nonfinite_like_reference(which):
    """The row-wise kernels' arithmetic (rowwise_backward_emulation, fp32 on the CPU) with NaN, +Inf
    and -Inf alone in `which` at times 0, 37, 63, 64 and T - 1, one a batch: dq, dk and dv NaN,
    +Inf and -Inf at exactly float64 autograd's elements (reference_grads), allclose 1e-4 elsewhere.
    o is the float64 forward's in fp32, whose NaN and +-Inf every forward plan gives
    (test_gpu_every_plan_nonfinite_like_reference)."""
    B, T, Hq, Hkv, D = NONFINITE_INJECTIONS, 100, 4, 2, 16
    q, k, v = make_qkv(B, T, Hq, Hkv, D)
    grad_out = torch.randn_like(q)
    labels = inject_one_per_batch(dict(q=q, k=k, v=v, grad_out=grad_out)[which], T, random.Random(seed_of("inject", which)))
    o = reference.causal_gqa_reference(q, k, v).float()
    assert_grads_like_reference(rowwise_backward_emulation(q, k, v, o, grad_out), reference_grads(q, k, v, grad_out),
                                "%s [%s]" % (which, "; ".join(labels)),
                                lambda a, b: torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4))


def test_backward_plans_list_is_every_backward_plan():
    """BACKWARD_PLAN_CASES names bench/sanitize.py's list of every backward plan: 19 on an sm_90a
    build (the row-wise kernels in three dtypes, the x3 unit at 64 and 128, mma.sync and wgmma in 16
    bits, and the fused kernel)."""
    assert sorted(BACKWARD_PLAN_CASES) == sorted(_load_sanitize().BACKWARD_PLANS) and len(BACKWARD_PLAN_CASES) == 19

@needs_gpu
@pytest.mark.parametrize("name", list(BACKWARD_PLAN_CASES))
def test_gpu_backward_nonfinite_masks_every_plan(name, monkeypatch):
    """Each backward plan (asserted through backward_plan), with NaN, +Inf and -Inf alone in q, k, v
    or grad_out (one call each) at times 0, 37, 63, 64 and T - 1, one a batch, at a seeded head and
    channel: dq, dk and dv NaN, +Inf and -Inf at exactly float64 autograd's elements, the rule of
    backward.cu's header; the finite ones within fp32's 1e-4 or 16-bit's 2e-2 norm-relative."""
    family, dtype_name = name.split("/")[:2]
    D = int(name.split("/")[2][1:]) if family != "backward" else 40
    T = 100 if family in ("backward", "bwdmma") else 130
    if family in ("bwdwg", "bwdx3") and tensor_core_backward(T, D) != "bwdwg":
        pytest.skip("the wgmma and x3 units run on an H100 or H200 with an sm_90a build")
    if name.endswith("/fused"):
        monkeypatch.setenv("GQA_FUSED_BACKWARD_MIN_T", "129")
    else:
        monkeypatch.delenv("GQA_FUSED_BACKWARD_MIN_T", raising=False)
    dtype = DTYPES[dtype_name]
    rng = random.Random(seed_of("nonfinite backward", name))
    for which in ("q", "k", "v", "grad_out"):
        q, k, v = make_qkv(NONFINITE_INJECTIONS, T, 2, 1, D, device="cuda", dtype=dtype)
        assert gqa_module.backward_plan(q, k, v) == name
        grad_out = torch.randn_like(q)
        labels = inject_one_per_batch(dict(q=q, k=k, v=v, grad_out=grad_out)[which], T, rng)
        if dtype == torch.float32:
            close = lambda a, b: torch.allclose(a.double(), b, rtol=1e-4, atol=1e-4)
        else:
            close = lambda a, b: rel_err(a, b) <= 2e-2
        assert_grads_like_reference(project_grads(q, k, v, grad_out), reference_grads(q, k, v, grad_out),
                                    "%s, %s [%s]" % (name, which, "; ".join(labels)), close)


BACKWARD_GRID = [(B, T, Hq, Hkv, D) for B, T in ((2, 1), (1, 63), (2, 65), (1, 1000))
                 for Hq, Hkv in ((4, 4), (8, 2), (4, 1)) for D in (1, 40, 64, 128, 256)] + [(1, 4097, 4, 2, 64)]


@needs_gpu
@pytest.mark.parametrize("B, T, Hq, Hkv, D", BACKWARD_GRID)
def test_gpu_backward_fp32_matches_float64(B, T, Hq, Hkv, D):
    """fp32 gradients: norm-relative error at most 1e-5 for each of dq, dk, dv, and no head-dim
    channel off by more than 1e-4 of its own norm."""
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda")
    assert gqa_module.backward_plan(q, k, v) == fp32_backward_plan(T, D)
    grad_out = torch.randn_like(q)
    exact = reference_grads(q, k, v, grad_out)
    for name, got, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), exact):
        assert got.shape == ref.shape and got.dtype == torch.float32, name
        assert torch.isfinite(got).all(), name
        if not ref.any():
            # T = 1: one key, whose softmax weight is 1 whatever q and k are, so dq and dk are
            # exactly 0. A row may carry the rounding of dP - delta (two fp32 dot products of D
            # terms) times k (for dq) or q (for dk): at most 1e-5 of |grad_out| |v| (|q| + |k|) /
            # sqrt(D) per query row, summed over a kv head's group for dk.
            kx, vx = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
            bound = grad_out.norm(dim=-1) * vx.norm(dim=-1) * (q.norm(dim=-1) + kx.norm(dim=-1)) / math.sqrt(D)
            if got.shape[2] != Hq:
                bound = bound.view(B, T, Hkv, Hq // Hkv).sum(dim=-1)
            assert (got.norm(dim=-1) <= 1e-5 * bound).all(), name
            continue
        err, worst = rel_err(got, ref), channel_rel_errs(got, ref).max().item()
        print("%s rel %.3g, worst channel %.3g" % (name, err, worst))
        assert err <= 1e-5, name
        assert worst <= 1e-4, name


def uneven_fp32_inputs(B, T, Hq, Hkv, D):
    """q, k, v and grad_out on the GPU whose magnitudes differ by orders: one query head 1e3 larger
    than the others, keys 1e-3 smaller with one channel 1e2 larger than the rest, one channel of v
    1e-3 smaller, grad_out at 1e-6 (a loss scaled down) with one query row 1e3 larger; checked to
    take the fp32 backward's plan for the shape."""
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda")
    assert gqa_module.backward_plan(q, k, v) == fp32_backward_plan(T, D)
    q[:, :, 0] *= 1e3
    k *= 1e-3
    k[..., 1] *= 1e2
    v[..., 0] *= 1e-3
    grad_out = torch.randn_like(q) * 1e-6
    grad_out[:, T // 2] *= 1e3
    return q, k, v, grad_out


@needs_gpu
@pytest.mark.parametrize("B, T, Hq, Hkv, D", [(1, 1000, 8, 2, 128), (2, 300, 6, 3, 64)])
def test_gpu_backward_fp32_ignores_the_outputs_last_bits(B, T, Hq, Hkv, D):
    """The fp32 backward takes delta = rowsum(dO o) from the forward's o, whose last bits need not
    match the P it recomputes. On uneven_fp32_inputs (a nearly one-hot head, one grad_out row 1e3
    larger) that mismatch shows magnified in dq and dk unless the kernels make their dS sum
    to zero whatever o is (Pol::kDeltaFix). o off by 1e-5 relative in each element may move dq by
    at most 2e-6 of its norm and dk by 1e-6 (a float64 model, bench/x3_backward_emulation.py
    --delta, three draws of each shape: without the correction dq moves 8e-6 to 1.7e-4 here and dk
    1.8e-6 to 4.5e-5; with it at most 1.9e-7 and 5.2e-8). dv does not read delta: it stays equal."""
    q, k, v, grad_out = uneven_fp32_inputs(B, T, Hq, Hkv, D)
    ops = gqa_module.load_extension()
    out, lse2 = ops.causal_attention_trainable.default(q, k, v)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed_of("output noise", B, T, D))
    noisy = out * (1 + 1e-5 * torch.randn(out.shape, generator=gen, dtype=torch.float64).to("cuda")).float()
    base = ops.causal_attention_backward.default(q, k, v, out, grad_out, lse2)
    moved = ops.causal_attention_backward.default(q, k, v, noisy, grad_out, lse2)
    for name, a, b, bound in zip(("dq", "dk", "dv"), base, moved, (2e-6, 1e-6, 0.0)):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        print("%s moved %.3g" % (name, rel_err(b, a)))
        assert rel_err(b, a) <= bound, name


@needs_gpu
@pytest.mark.parametrize("B, T, Hq, Hkv, D", [(1, 1000, 8, 2, 128), (2, 300, 6, 3, 64), (1, 4097, 4, 1, 128)])
def test_gpu_backward_fp32_uneven_magnitudes(B, T, Hq, Hkv, D):
    """fp32 gradients where the inputs' magnitudes differ by orders (uneven_fp32_inputs). The
    scores stay within tens, where fp32 itself keeps the softmax to about 1e-6. Against float64:
    norm-relative error at most 1e-5 for each of dq, dk, dv, and no head-dim channel off by more
    than 1e-4 of its own norm (where a power-of-two scale per tensor, as the x3 unit takes, would
    cost the small heads, channels or rows their bits)."""
    q, k, v, grad_out = uneven_fp32_inputs(B, T, Hq, Hkv, D)
    exact = reference_grads(q, k, v, grad_out)
    for name, got, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), exact):
        assert torch.isfinite(got).all(), name
        err, worst = rel_err(got, ref), channel_rel_errs(got, ref).max().item()
        print("%s rel %.3g, worst channel %.3g" % (name, err, worst))
        assert err <= 1e-5, name
        assert worst <= 1e-4, name


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, T, Hq, Hkv, D", [(2, 1, 8, 2, 64), (1, 65, 4, 1, 40), (2, 1000, 8, 2, 128),
                                              (1, 300, 4, 4, 256), (1, 1000, 4, 2, 256), (1, 4097, 4, 2, 64), (1, 700, 8, 8, 64),
                                              (2, 1500, 6, 1, 128), (3, 200, 12, 4, 128)])
def test_gpu_backward_16bit_within_twice_sdpa(B, T, Hq, Hkv, D, dtype):
    """fp16 and bf16 gradients: norm-relative error against float64, over the whole gradient and
    over its worst head-dim channel, at most 2x that of SDPA's own gradients on the same inputs,
    plus 1e-3."""
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    check_16bit_grads(B, T, Hq, Hkv, D, dtype, backward_16bit_plan(B, T, Hq, Hkv, D, name))


@needs_gpu
@pytest.mark.parametrize("B, T, Hq, Hkv, fused", [
    (16, 2048, 32, 8, True), (32, 1024, 32, 8, True), (4, 4096, 32, 8, False), (1, 8192, 32, 8, False),
    (2, 4096, 32, 4, False), (8, 2048, 16, 16, False), (64, 1023, 32, 8, False), (128, 1024, 16, 8, False)])
def test_gpu_fused_backward_rule_at_64(B, T, Hq, Hkv, fused):
    """Head_dim 64 takes the fused kernel where it measured faster than the two kernels on the
    H200's 132 SMs (bench/NOTES.md v107): the first two shapes, not the next four; below 1024 steps
    and with groups of 2 it does not either."""
    if tensor_core_backward(T, 64) != "bwdwg":
        pytest.skip("the fused kernel is the wgmma unit's: an sm_90a build on an H100 or H200")
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the measured shapes' grids are balanced as stated on 132 SMs")
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        q, k, v = (torch.empty(B, T, H, 64, device="cuda", dtype=dtype) for H in (Hq, Hkv, Hkv))
        want = "bwdwg/%s/d64%s" % (name, "/fused" if fused else "")
        assert gqa_module.backward_plan(q, k, v) == want
        assert backward_16bit_plan(B, T, Hq, Hkv, 64, name) == want


# The fused kernel's gradient cases (B, T, Hq, Hkv, GQA_FUSED_BACKWARD_MIN_T, uneven), taken at both
# widths through the environment variable.
FUSED_FORCED_CASES = [
    (1, 129, 4, 2, 129, False), (2, 1000, 8, 2, 129, False), (1, 4097, 4, 1, 129, False), (3, 200, 12, 12, 200, False),
    (2, 1000, 8, 2, 129, True), (2, 150, 6, 6, 129, False), (1, 300, 6, 2, 129, False), (2, 4097, 16, 4, 129, False),
    (150, 300, 16, 4, 129, False)]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B, T, Hq, Hkv, D, min_t, uneven", [
    case[:4] + (D,) + case[4:] for D in (64, 128) for case in FUSED_FORCED_CASES] + [(1, 8193, 4, 2, 128, None, False)])
def test_gpu_fused_backward_within_twice_sdpa(B, T, Hq, Hkv, D, min_t, uneven, dtype, monkeypatch):
    """The wgmma unit's fused kernel (head_dim 128 from 8192 query rows, 64 by fused_at_64's rule, or
    from GQA_FUSED_BACKWARD_MIN_T): gradients within test_gpu_backward_16bit_within_twice_sdpa's
    bounds, at ragged sizes around its 128-key and 64-row tiles (at head_dim 64 its steps in pairs:
    odd and even step counts), GQA, MQA and MHA, on inputs whose magnitudes differ by orders
    (check_16bit_grads' uneven), and on grids in chunks of (batch, kv head) pairs, the last
    partial: (2, 4097, 16, 4) at head_dim 64: 4 MB of dQ sums a pair, chunks of 5 and 3;
    (150, 300, 16, 4) at 64: chunks of 76, the last of 68; at 128, a balanced grid on 132 SMs:
    chunks of 102, the last of 90. The
    library's own rule takes it at 128 in the last case; at 64 only on grids of hundreds of pairs,
    too large for a float64 reference here (test_gpu_fused_backward_rule_at_64 checks that rule)."""
    if tensor_core_backward(T, D) != "bwdwg":
        pytest.skip("the fused kernel is the wgmma unit's: an sm_90a build on an H100 or H200")
    if min_t is None:
        assert T >= FUSED_MIN_T[D]
    else:
        monkeypatch.setenv("GQA_FUSED_BACKWARD_MIN_T", str(min_t))
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    check_16bit_grads(B, T, Hq, Hkv, D, dtype, "bwdwg/%s/d%d/fused" % (name, D), uneven)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fused_backward_deterministic_and_nonfinite_like_reference(D, dtype, monkeypatch):
    """The fused kernel (taken here from 129 query rows): bitwise the same gradients in two runs,
    and close to those of a call without the forward's lse2 (the statistics from the first pass);
    with Inf and NaN in q, k, v, with Inf in k alone or NaN in v alone (which only the fused
    kernel's own check of its K and V tiles sees), with -Inf at the last element of q alone or NaN
    at its first (which only the forward's log-sum-exp of that row shows to the statistics pass
    when the forward kept it), or one NaN at the last element of grad_out,
    NaN exactly where float64 autograd's gradients are, and within 2e-2 of them elsewhere."""
    T = 300
    if tensor_core_backward(T, D) != "bwdwg":
        pytest.skip("the fused kernel is the wgmma unit's: an sm_90a build on an H100 or H200")
    monkeypatch.setenv("GQA_FUSED_BACKWARD_MIN_T", "129")
    q, k, v = make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype)
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    assert gqa_module.backward_plan(q, k, v) == "bwdwg/%s/d%d/fused" % (name, D)
    grad_out = torch.randn_like(q)
    first, second = project_grads(q, k, v, grad_out), project_grads(q, k, v, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # The forward's lse2 (the row statistics kernel) against none (the dQ kernel's statistics pass).
    ops = gqa_module.load_extension()
    out, lse2 = ops.causal_attention_trainable.default(q, k, v)
    kept = ops.causal_attention_backward.default(q, k, v, out, grad_out, lse2)
    own = ops.causal_attention_backward.default(q, k, v, out, grad_out, lse2.new_empty(0))
    for grad_name, a, b, c in zip(("dq", "dk", "dv"), kept, own, first):
        assert torch.equal(a, c), grad_name
        assert rel_err(b, a) <= 1e-2, grad_name
    q[0, 5, 1, 3] = float("inf")
    k[1, 9, 0, 2] = float("-inf")
    v[0, 200, 1, 7] = float("nan")
    poisoned_out = grad_out.clone()
    poisoned_out.view(-1)[-1] = float("nan")
    k_inf = make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype)
    k_inf[1][1, 250, 1, D - 28] = float("inf")
    v_nan = make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype)
    v_nan[2][0, 3, 0, D // 2] = float("nan")
    q_inf = make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype)
    q_inf[0][1, T - 1, 7, D - 1] = float("-inf")
    q_nan = make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype)
    q_nan[0][0, 0, 0, 0] = float("nan")
    cases = (("inputs", (q, k, v, grad_out)), ("grad_out", (*make_qkv(2, T, 8, 2, D, device="cuda", dtype=dtype), poisoned_out)),
             ("k alone", (*k_inf, grad_out)), ("v alone", (*v_nan, grad_out)), ("q alone, last", (*q_inf, grad_out)),
             ("q alone, first", (*q_nan, grad_out)))
    for case, tensors in cases:
        for grad_name, got, ref in zip(("dq", "dk", "dv"), project_grads(*tensors), reference_grads(*tensors)):
            assert torch.equal(torch.isnan(got), torch.isnan(ref)), (case, grad_name)
            finite = torch.isfinite(ref)
            assert torch.equal(torch.isfinite(got), finite), (case, grad_name)
            if finite.any():
                assert rel_err(got[finite], ref[finite]) <= 2e-2, (case, grad_name)


def check_16bit_grads(B, T, Hq, Hkv, D, dtype, expected_plan, uneven=False):
    """The 16-bit gradients of a call taking expected_plan: norm-relative error against float64,
    whole and of the worst head-dim channel, at most 2x SDPA's own on the same inputs plus 1e-3.
    uneven: magnitudes that differ by orders, within 16-bit range (one query head 30x larger than
    the others, keys 10x smaller with one channel 30x larger, one channel of v 1e-3 smaller,
    grad_out at 1e-2 with one query row 1e2 larger)."""
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
    assert gqa_module.backward_plan(q, k, v) == expected_plan
    grad_out = torch.randn_like(q)
    if uneven:
        q[:, :, 0] *= 30
        k *= 0.1
        k[..., 1] *= 30
        v[..., 0] *= 1e-3
        grad_out *= 1e-2
        grad_out[:, T // 2] *= 1e2
    exact = reference_grads(q, k, v, grad_out)
    sq, sk, sv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        sq.transpose(1, 2), sk.transpose(1, 2), sv.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    sdpa.backward(grad_out)
    for name, got, theirs, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), (sq.grad, sk.grad, sv.grad), exact):
        assert got.dtype == dtype and torch.isfinite(got).all(), name
        ours_err, sdpa_err = rel_err(got, ref), rel_err(theirs, ref)
        ours_worst, sdpa_worst = channel_rel_errs(got, ref).max().item(), channel_rel_errs(theirs, ref).max().item()
        print("%s ours %.3g (worst channel %.3g), SDPA %.3g (%.3g)" % (name, ours_err, ours_worst, sdpa_err, sdpa_worst))
        assert ours_err <= 2 * sdpa_err + 1e-3, name
        assert ours_worst <= 2 * sdpa_worst + 1e-3, name


@needs_gpu
@pytest.mark.parametrize("dtype, T", [(torch.float32, 300), (torch.bfloat16, 300), (torch.float16, 100)])
def test_gpu_backward_is_deterministic(dtype, T):
    q, k, v = make_qkv(2, T, 8, 2, 64, device="cuda", dtype=dtype)
    grad_out = torch.randn_like(q)
    first, second = project_grads(q, k, v, grad_out), project_grads(q, k, v, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@needs_gpu
@pytest.mark.parametrize("dtype, D, T", [(torch.float32, 16, 140), (torch.float32, 64, 140), (torch.float32, 128, 200),
                                         (torch.bfloat16, 64, 120), (torch.bfloat16, 64, 140),
                                         (torch.float16, 128, 120), (torch.float16, 128, 140), (torch.bfloat16, 256, 140)])
def test_gpu_backward_nonfinite_like_reference(dtype, D, T):
    """Inf and NaN in q, k and v: the gradients are NaN exactly where float64 autograd's are, and
    close to them elsewhere (fp32: allclose 1e-4; 16-bit: norm-relative 2e-2)."""
    q, k, v = make_qkv(1, T, 4, 2, D, device="cuda", dtype=dtype)
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    plan = fp32_backward_plan(T, D) if dtype == torch.float32 else "%s/%s/d%d" % (tensor_core_backward(T, D), name, D)
    assert gqa_module.backward_plan(q, k, v) == plan
    q[0, 5, 1, 3] = float("inf")
    k[0, 9, 0, 2] = float("-inf")
    v[0, 70, 1, 7] = float("nan")
    q[0, 100, 2, 0] = 300.0   # a large but finite score: a row whose softmax is one-hot
    grad_out = torch.randn_like(q)
    for name, got, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), reference_grads(q, k, v, grad_out)):
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), name
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), finite), name
        if not finite.any():
            continue   # every entry NaN or infinite in float64 too (checked just above)
        if dtype == torch.float32:
            assert torch.allclose(got[finite].double(), ref[finite], rtol=1e-4, atol=1e-4), name
        else:
            assert rel_err(got[finite], ref[finite]) <= 2e-2, name


@needs_gpu
def test_gpu_backward_nonfinite_fallback_walks_more_rows_than_its_grid():
    """The tensor-core plans' row-wise fallback runs four CTAs of 8 rows per SM, each walking
    several: with more query and key rows than that grid holds, and Inf and NaN in the inputs, the
    gradients are NaN exactly where float64 autograd's are and within 2e-2 of them elsewhere."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, Hq, Hkv, D = 1, 8, 8, 64
    T = 4 * sms + 72   # 8 T rows of each kind, past the grid's 32 rows per SM
    q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=torch.bfloat16)
    assert gqa_module.backward_plan(q, k, v) == "%s/bf16/d64" % tensor_core_backward(T, D)
    q[0, 7, 3, 5] = float("inf")
    v[0, T - 9, 6, 1] = float("nan")
    grad_out = torch.randn_like(q)
    for name, got, ref in zip(("dq", "dk", "dv"), project_grads(q, k, v, grad_out), reference_grads(q, k, v, grad_out)):
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), name
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), finite), name
        assert finite.any(), name
        assert rel_err(got[finite], ref[finite]) <= 2e-2, name

@needs_gpu
@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)])
@pytest.mark.parametrize("which", ["q", "k", "v", "grad_out"])
def test_gpu_backward_nonfinite_at_either_end(dtype, D, which):
    """One Inf or NaN alone, at the first or the last element of q, k, v or grad_out: the first
    value of the first CTA's tiles and the last value of the last, partial, tile, which the
    tensor-core kernels check as they read them (head_dim 256: in column halves). The plan then
    hands the call to the row-wise kernels, and the gradients are NaN exactly where float64
    autograd's are."""
    B, T, Hq, Hkv = 1, 140, 4, 2
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    for index, value in ((0, float("inf")), (-1, float("nan"))):
        q, k, v = make_qkv(B, T, Hq, Hkv, D, device="cuda", dtype=dtype)
        assert gqa_module.backward_plan(q, k, v) == "%s/%s/d%d" % (tensor_core_backward(T, D), name, D)
        grad_out = torch.randn_like(q)
        tensors = dict(q=q, k=k, v=v, grad_out=grad_out)
        tensors[which].view(-1)[index] = value
        got, ref = project_grads(q, k, v, grad_out), reference_grads(q, k, v, grad_out)
        for grad_name, a, b in zip(("dq", "dk", "dv"), got, ref):
            assert torch.equal(torch.isnan(a), torch.isnan(b)), (which, index, grad_name)
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), (which, index, grad_name)

@needs_gpu
@pytest.mark.parametrize("dtype, D, plan", [(torch.float16, 128, "bwdmma/fp16/d128"),
                                            (torch.bfloat16, 64, "bwdmma/bf16/d64"),
                                            (torch.float32, 40, "backward/fp32")])
def test_gpu_backward_of_views_off_16_bytes(dtype, D, plan):
    """q, k, v and grad_out that start one element into their storage (rows not on 16 bytes): the
    plan of packed inputs, and gradients as close to float64 as those of packed copies (the forward
    may take another plan for such rows, so its output, and the gradients, may round differently)."""
    q, k, v = make_qkv(2, 65, 4, 2, D, device="cuda", dtype=dtype)
    grad_out = torch.randn_like(q)
    views = [offset_by_one(t) for t in (q, k, v, grad_out)]
    assert all(t.data_ptr() % 16 for t in views)
    assert gqa_module.backward_plan(*views[:3]) == plan
    exact = reference_grads(q, k, v, grad_out)
    for name, got, packed, ref in zip(("dq", "dk", "dv"), project_grads(*views), project_grads(q, k, v, grad_out), exact):
        err, packed_err = rel_err(got, ref), rel_err(packed, ref)
        print("%s offset %.3g, packed %.3g" % (name, err, packed_err))
        assert err <= (1e-5 if dtype == torch.float32 else 1.5 * packed_err + 1e-4), name


@needs_gpu
def test_gpu_backward_long_sequence_scratch_memory():
    """(1, 32768, 32, 8, 128) bf16 forward and backward: the memory beyond the inputs, the output
    and the gradients (the backward's scratch: row statistics, and with the fused kernel dQ's fp32
    sum and its counters) is at most twice the inputs' size, and the gradients are finite."""
    B, T, Hq, Hkv, D = 1, 32768, 32, 8, 128
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for H in (Hq, Hkv, Hkv))
    if tensor_core_backward(T, D) == "bwdwg":
        assert gqa_module.backward_plan(q, k, v) == "bwdwg/bf16/d128/fused"
    grad_out = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = gqa_module.causal_gqa_attention(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    inherent = out.numel() * out.element_size() + sum(g.numel() * g.element_size() for g in grads)
    extra = torch.cuda.max_memory_allocated() - base - inherent
    print("scratch %.1f MB, inputs %.1f MB" % (extra / 2**20, inputs / 2**20))
    assert extra <= 2 * inputs
    assert all(torch.isfinite(g).all() for g in grads)


@needs_gpu
@pytest.mark.parametrize("dtype, D, layout, T", [(torch.bfloat16, 128, "packed", 300), (torch.float16, 64, "packed", 300),
                                                 (torch.bfloat16, 128, "broadcast", 300), (torch.float32, 64, "packed", 300),
                                                 (torch.float32, 64, "packed", 1000)])
def test_gpu_forward_keeps_log_sum_exp_for_the_backward(dtype, D, layout, T):
    """The forward of a call a backward will follow keeps each row's log2-sum-exp2 where the
    warp-specialised kernel or the fp32 x3 kernel runs (within 1e-3 of float64), and NaN ("not
    kept") elsewhere: the other fp32 plans. Kv heads broadcast by expand may take either path;
    whichever it is, every row is NaN or every row is right. The gradients taking it match those
    of the backward's own first pass."""
    B, Hq, Hkv = 2, 8, 2
    q, k, v = make_qkv(B, T, Hq, Hkv if layout == "packed" else 1, D, device="cuda", dtype=dtype)
    if layout == "broadcast":
        k, v = k.expand(B, T, Hkv, D), v.expand(B, T, Hkv, D)
    ops = gqa_module.load_extension()
    out, lse2 = ops.causal_attention_trainable.default(q, k, v)
    assert lse2.shape == (B, T, Hq) and lse2.dtype == torch.float32
    kept = not torch.isnan(lse2).all().item()
    print("plan %s, lse2 kept: %s" % (gqa_module.plan(q, k, v), kept))
    if dtype == torch.float32:
        assert kept == gqa_module.plan(q, k, v).startswith("x3/")
        if T == 1000 and tensor_core_backward(T, D) == "bwdwg":   # an sm_90a build on an H100/H200
            assert kept, "the fp32 x3 forward keeps lse2 (plan %s)" % gqa_module.plan(q, k, v)
    elif layout == "packed":
        assert kept, "the 16-bit forward on packed inputs keeps lse2"
    if kept:
        G = Hq // Hkv
        scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double().repeat_interleave(G, 2)) / math.sqrt(D)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        exact = (torch.logsumexp(scores, dim=-1) / math.log(2)).transpose(1, 2)
        err = (lse2.double() - exact).abs().max().item()   # NaN in any row fails too
        print("lse2 max abs err %.3g" % err)
        assert err <= 1e-3
    grad_out = torch.randn_like(q)
    with_rows = ops.causal_attention_backward.default(q, k, v, out, grad_out, lse2)
    own = ops.causal_attention_backward.default(q, k, v, out, grad_out, lse2.new_empty(0))
    for name, a, b in zip(("dq", "dk", "dv"), with_rows, own):
        print("%s kept vs own %.3g" % (name, rel_err(a, b)))
        assert rel_err(a, b) <= (1e-6 if dtype == torch.float32 else 1e-2), name


@needs_gpu
def test_gpu_backward_refuses_mismatched_grad_out():
    q, k, v = make_qkv(1, 16, 4, 2, 16, device="cuda")
    op = gqa_module.load_extension().causal_attention_backward.default
    out = gqa_module.causal_gqa_attention(q, k, v)
    none = q.new_empty(0)
    with pytest.raises(ValueError, match="grad_out must have q's shape"):
        op(q, k, v, out, out[:, :8], none)
    with pytest.raises(ValueError, match="grad_out must have q's dtype"):
        op(q, k, v, out, out.double(), none)
    with pytest.raises(ValueError, match="lse2 must be empty or float32"):
        op(q, k, v, out, out, q.new_zeros(1, 16, 3))


@needs_gpu
def test_gpu_torch_compile_forward_and_backward_match_eager():
    model = gqa_module.ModelNew()
    compiled = torch.compile(model, fullgraph=True)
    q, k, v = make_qkv(2, 200, 8, 2, 64, device="cuda")
    grad_out = torch.randn_like(q)
    grads = []
    for fn in (model, compiled):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad_out)
        grads.append([out.detach()] + [t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ------------------------------------------------------------------------------------------------
# compute-sanitizer coverage (bench/sanitize.py): its case list on the CPU, and its committed results
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
SANITIZER_RESULTS = os.path.join(HERE, "bench", "results", "sanitizer.json")


def _load_sanitize():
    return load_bench_script("sanitize")


def test_sanitizer_driver_stopped_by_sigterm_kills_its_tool_run(tmp_path):
    """bench/sanitize.py stopped by SIGTERM (as `timeout` stops it) while a tool runs kills that
    run's process group instead of leaving it to hold the GPU and the build directory."""
    pid_file, ready = tmp_path / "child.pid", tmp_path / "ready"
    child = ("import os, pathlib, time; pathlib.Path(%r).write_text(str(os.getpid())); "
             "pathlib.Path(%r).touch(); time.sleep(120)" % (str(pid_file), str(ready)))
    driver = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('sanitize', %r)\n"
        "sanitize = importlib.util.module_from_spec(spec); spec.loader.exec_module(sanitize)\n"
        "sanitize.stop_on_sigterm()\n"
        "sanitize._run_logged([sys.executable, '-c', %r], None, 300, %r)\n"
        % (os.path.join(HERE, "bench", "sanitize.py"), child, str(tmp_path / "tool.log")))
    proc = subprocess.Popen([sys.executable, "-c", driver])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, "the driver ended before its tool started"
        assert time.monotonic() < deadline, "the tool did not start"
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _process_alive(pid):
        assert time.monotonic() < deadline, "the tool's process %d outlived the driver" % pid
        time.sleep(0.05)


def _process_alive(pid):
    """Whether pid names a process that has not exited (a zombie counts as exited)."""
    try:
        with open("/proc/%d/status" % pid) as fh:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in fh)
    except FileNotFoundError:
        return False


def test_sanitizer_gradient_check_catches_wrong_gradients():
    """bench/sanitize.py's gradient check: passes the reference itself, fails a NaN where the
    reference has none and a gradient off by 1%."""
    sanitize = _load_sanitize()
    exact = [torch.randn(2, 5, 3, dtype=torch.float64) for _ in range(3)]
    assert sanitize.check_grads([g.float() for g in exact], exact, "fp32", False)[0]
    poisoned = [g.clone() for g in exact]
    poisoned[1][0, 0, 0] = float("nan")
    assert not sanitize.check_grads(poisoned, exact, "fp32", True)[0]
    assert not sanitize.check_grads([exact[0] * 1.01] + exact[1:], exact, "fp32", False)[0]


@needs_cuda_torch
def test_sanitizer_cases_take_their_plans_and_cover_every_plan():
    """Each case of bench/sanitize.py takes its declared plan on an H200 (plan_for's defaults), the
    declared plans are exactly all_plans(), the backward and the row-wise kernels of any geometry
    run in every dtype, and every plan also runs with Inf/NaN injected."""
    sanitize = _load_sanitize()
    wrong = []
    for plan, B, T, Hq, Hkv, D, dtype, aligned, allow_tf32 in sanitize.CASES:
        got = gqa_module.plan_for(B, T, Hq, Hkv, D, dtype=DTYPES[dtype], aligned=aligned,
                                  allow_tf32=allow_tf32)
        if got != plan:
            wrong.append(((B, T, Hq, Hkv, D, dtype, aligned, allow_tf32), plan, got))
    assert not wrong, "cases whose plan_for differs from the declared plan (case, declared, plan_for): %s" % wrong
    declared = {case[0] for case in sanitize.CASES}
    plans = set(gqa_module.all_plans())
    assert declared == plans, "plans without a case: %s; declared plans no build has: %s" % (
        sorted(plans - declared), sorted(declared - plans))
    plans |= {"backward/fp32", "backward/fp16", "backward/bf16", "bwdx3/fp32/d64", "bwdx3/fp32/d128"} | {
        "%s/%s/d%d" % (family, dtype, width) for family in ("bwdmma", "bwdwg") for dtype in ("fp16", "bf16")
        for width in ((64, 128, 256) if family == "bwdwg" else (64, 128))} | {
        "bwdwg/%s/d%d/fused" % (dtype, width) for dtype in ("fp16", "bf16") for width in (64, 128)}
    assert set(sanitize.BACKWARD_PLANS) == plans - declared
    assert set(sanitize.GEOMETRY_PLANS) == {"rows/any/fp32", "rows/any/fp16", "rows/any/bf16"}
    plans |= set(sanitize.GEOMETRY_PLANS)
    finite = {case[0] for case, nonfinite in sanitize.runs() if not nonfinite}
    nonfinite = {case[0] for case, nonfinite in sanitize.runs() if nonfinite}
    assert finite == nonfinite == plans, "plans without a finite or a non-finite run: %s" % sorted(
        (plans - finite) | (plans - nonfinite))


def test_sanitizer_driver_reads_summaries_and_case_lines():
    sanitize = _load_sanitize()
    text = "\n".join([
        "========= COMPUTE-SANITIZER",
        "DEVICE NVIDIA H200 | sm_count 132 | cc 9.0 | torch 2.11.0 | cuda 13.0",
        "CASE 1/3 x3/fp32/d64 B=8 T=129 Hq=8 Hkv=2 D=40 fp32 seed=5: ok max_err=1.2e-07 (3 ms)",
        "CASE 2/3 x3/fp32/d64 B=8 T=129 Hq=8 Hkv=2 D=40 fp32 nonfinite seed=6: FAIL AssertionError: plan a: b (2 ms)",
        "CASE 3/3 wgmma/bf16/d64 B=2 T=129 Hq=4 Hkv=2 D=64 bf16 seed=7: ok max_err=6.6e-03 (2 ms)",
        "CASES 3 run, 2 ok, 1 failed; plans covered 2/29; 0.1 s",
        "========= ERROR SUMMARY: 3 errors",
    ])
    parsed = sanitize.parse_output(text)
    assert parsed["errors"] == 3 and parsed["warnings"] is None and parsed["finished"]
    assert parsed["cases_run"] == 3 and parsed["cases_failed"] == ["x3/fp32/d64 #2"]
    assert parsed["plans_covered"] == ["wgmma/bf16/d64", "x3/fp32/d64"]
    assert parsed["device_line"].startswith("NVIDIA H200")
    race = sanitize.parse_output("========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)")
    assert race["errors"] == 1 and race["warnings"] == 1 and race["cases_run"] == 0
    assert sanitize.parse_output("========= ERROR SUMMARY: 0 errors")["errors"] == 0
    assert sanitize.parse_output("Error: Device not supported")["errors"] is None
    # memcheck's second summary line past --print-limit is not the count
    assert sanitize.parse_output("========= ERROR SUMMARY: 158 errors\n"
                                 "========= ERROR SUMMARY: 58 errors were not printed. Use --print-limit")["errors"] == 158
    # a lost context: every case after #2 fails on a CUDA error, so the driver resumes after #2
    lost = "\n".join("CASE %d/4 tiled/bf16/d32 B=1 seed=%d: %s" % (n, n, status) for n, status in (
        (1, "ok max_err=1e-3"), (2, "FAIL AcceleratorError: CUDA error: an illegal instruction was encountered"),
        (3, "FAIL AcceleratorError: CUDA error: an illegal instruction was encountered"),
        (4, "FAIL AcceleratorError: CUDA error: an illegal instruction was encountered")))
    assert sanitize.parse_output(lost)["dead_after"] == 2
    assert parsed["dead_after"] is None


def test_sanitizer_resume_keeps_only_passed_tools_of_the_same_run():
    """--resume keeps a previous run's passed tools only when its kernels, seed, cases and versions match."""
    sanitize = _load_sanitize()
    now = {"source_sha256": "a" * 64, "seed": 7, "only": None, "cases": 112, "sanitizer": "2025.3.1.0",
           "torch": "2.11.0+cu130", "cuda": "13.0"}
    passed = {"errors": 0, "ok": True}
    previous = dict(now, tools={"memcheck": passed, "racecheck": dict(passed, ok=False, errors=2)})
    assert sanitize.kept_tools(previous, now) == {"memcheck": passed}
    for key, other in (("source_sha256", "b" * 64), ("seed", 8), ("only", "fused"), ("cases", 10),
                       ("sanitizer", "2025.4.0.0"), ("torch", "2.12.0"), ("cuda", "13.1")):
        assert sanitize.kept_tools(dict(previous, **{key: other}), now) == {}, key


def test_committed_sanitizer_results_are_clean_for_the_current_kernels():
    """bench/results/sanitizer.json, once committed: every tool ran every case with 0 errors, on
    the kernel sources as they are now."""
    if not os.path.exists(SANITIZER_RESULTS):
        pytest.skip("bench/results/sanitizer.json is not committed yet: it comes from "
                    "`python bench/sanitize.py` on a GPU machine with compute-sanitizer")
    with open(SANITIZER_RESULTS) as fh:
        data = json.load(fh)
    assert data["source_sha256"] == gqa_module.kernel_source_sha256(), (
        "kernels/ changed since the committed sanitizer run: run `python bench/sanitize.py` again")
    assert not data.get("only"), "the committed run covered only the cases matching %r" % data["only"]
    # all_plans() needs the CUDA library; on a CPU-only torch the plans' coverage is left to the run
    # with a CUDA build of torch (CI runs both), and said below
    cuda_torch = torch.version.cuda is not None
    sanitize = _load_sanitize()
    plans = set(gqa_module.all_plans() if cuda_torch else ())
    plans |= set(sanitize.BACKWARD_PLANS) | set(sanitize.GEOMETRY_PLANS)
    for tool in SANITIZER_TOOLS:
        assert tool in data["tools"], "%s did not run" % tool
        result = data["tools"][tool]
        assert result["errors"] == 0 and result.get("warnings") in (None, 0), (tool, result.get("error_digest"))
        assert result["exit_code"] == 0 and not result["timed_out"], (tool, result.get("output_tail"))
        assert result["cases_run"] > 0 and not result["cases_failed"], (tool, result["cases_failed"])
        assert plans <= set(result["plans_covered"]), (tool, sorted(plans - set(result["plans_covered"])))
    if not cuda_torch:
        pytest.skip("the forward plans' coverage needs all_plans(), which needs a CUDA build of torch; "
                    "the sha, the tools and the backward plans passed")
