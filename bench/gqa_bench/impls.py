"""The implementations under test, as a registry from name to builder.

A builder takes (impls, shape, dtype_name, inputs) and returns (fn, context factory): fn(q, k, v)
returns [B, T, Hq, D], and the timed calls run inside a context from the factory (an SDPA backend
choice, or nothing). torch is imported only when a builder runs.
"""
import contextlib
import functools
import math

from .errors import format_error
from .shapes import shape_str

NULL = contextlib.nullcontext
# Flex's kernel options, tried in turn. For short sequences its default selection picks the decoding
# kernel, which can have no valid config (seen at T=80); the other two ask for the regular kernel,
# spelled as newer and older torch versions accept it.
FLEX_OPTIONS = (None, {"BACKEND": "TRITON"}, {"FORCE_USE_FLEX_ATTENTION": True})


class Implementations:
    """Builds implementations by name; models and compiled functions are kept for the whole run."""

    def __init__(self, torch, modules: dict, import_errors: dict):
        self.torch = torch
        self.modules = modules  # "gqa_module" and "reference" where they imported
        self.import_errors = import_errors
        self.notes: list[str] = []  # fallbacks taken, for the report's method section
        self._kept: dict = {}

    def build(self, name: str, shape, dtype_name: str, inputs):
        """Return (fn, context factory) for `name` at this shape; flex runs once on `inputs`."""
        return BUILDERS[name](self, shape, dtype_name, inputs)

    def module(self, name: str):
        if self.modules.get(name) is None:
            raise RuntimeError(f"{name} not importable ({self.import_errors.get(name)})")
        return self.modules[name]

    def kept(self, key: str, make):
        """make(), called the first time `key` is asked for."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]


def make_eager_expand(torch):
    def eager_expand(q, k, v):
        T, Hq, D = q.shape[1], q.shape[2], q.shape[3]
        group = Hq // k.shape[2]
        k_full = k.repeat_interleave(group, dim=2)
        v_full = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k_full) * (1.0 / math.sqrt(D))
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bhqk,bkhd->bqhd", probs, v_full)

    return eager_expand


def _sdpa_gqa_fn(torch):
    F = torch.nn.functional

    def sdpa_gqa(q, k, v):
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return o.transpose(1, 2)

    return sdpa_gqa


def _sdpa_expand_fn(torch):
    F = torch.nn.functional

    def sdpa_expand(q, k, v):
        group = q.shape[2] // k.shape[2]
        k_full = k.repeat_interleave(group, dim=2)
        v_full = v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_full.transpose(1, 2), v_full.transpose(1, 2), is_causal=True
        )
        return o.transpose(1, 2)

    return sdpa_expand


# --------------------------------------------------------------------------
# Builders
# --------------------------------------------------------------------------
def _project(impls, shape, dtype_name, inputs):
    gqa_module = impls.module("gqa_module")
    return impls.kept("project", lambda: gqa_module.ModelNew().to("cuda").eval()), NULL


def _floor(name, impls, shape, dtype_name, inputs):
    return getattr(impls.module("gqa_module"), name), NULL


def _reference_loops(impls, shape, dtype_name, inputs):
    reference = impls.module("reference")
    return impls.kept("reference_loops", lambda: reference.Model().to("cuda").eval()), NULL


def _eager_expand(impls, shape, dtype_name, inputs):
    return impls.kept("eager_expand", lambda: make_eager_expand(impls.torch)), NULL


def _compiled_expand(impls, shape, dtype_name, inputs):
    eager, _ = _eager_expand(impls, shape, dtype_name, inputs)
    return impls.kept("compiled_expand", lambda: impls.torch.compile(eager, dynamic=False)), NULL


def _sdpa_gqa(impls, shape, dtype_name, inputs):
    return _sdpa_gqa_fn(impls.torch), NULL


def _sdpa_backend(backend_name, make_fn, impls, shape, dtype_name, inputs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    return make_fn(impls.torch), lambda: sdpa_kernel(backend)


def _flex(impls, shape, dtype_name, inputs):
    torch = impls.torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex_c = impls.kept("flex", lambda: torch.compile(flex_attention, dynamic=False))
    T = shape[1]

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = create_block_mask(causal, None, None, T, T, device="cuda")

    def make_flex(options):
        def flex(q, k, v):
            o = flex_c(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_mask=block_mask,
                enable_gqa=True,
                kernel_options=options,
            )
            return o.transpose(1, 2)

        return flex

    first_error = None
    for options in FLEX_OPTIONS:
        candidate = make_flex(options)
        try:
            candidate(*inputs)
            torch.cuda.synchronize()
        except Exception as e:
            first_error = first_error or e
            continue
        if options is not None:
            impls.notes.append(
                f"flex at {shape_str(shape)} {dtype_name}: default kernel selection failed "
                f"({format_error(first_error)[:120]}); used kernel_options={options}"
            )
        return candidate, NULL
    raise first_error


def fa4_missing():
    """None where FlashAttention-4 (the package flash_attn.cute) imports, else why not."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # absent, or present without its CuTe DSL runtime
        return f"FlashAttention-4 (flash_attn.cute) not importable: {format_error(e)[:160]}"
    return None


def _fa4(deterministic, impls, shape, dtype_name, inputs):
    """FlashAttention-4's causal attention on [B, T, H, D] inputs, GQA native; its backward is
    deterministic only where asked (not its default)."""
    if dtype_name not in SIXTEEN_BIT:
        raise ValueError(f"fa4 takes float16 and bfloat16, not {dtype_name}")
    from flash_attn.cute import flash_attn_func

    def fa4(q, k, v):
        out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        return out[0] if isinstance(out, tuple) else out

    return fa4, NULL


BUILDERS = {
    "project": _project,
    "reference_loops": _reference_loops,
    "eager_expand": _eager_expand,
    "compiled_expand": _compiled_expand,
    "sdpa_gqa": _sdpa_gqa,
    "sdpa_expand_efficient": functools.partial(_sdpa_backend, "EFFICIENT_ATTENTION", _sdpa_expand_fn),
    "sdpa_flash": functools.partial(_sdpa_backend, "FLASH_ATTENTION", _sdpa_gqa_fn),
    "sdpa_cudnn": functools.partial(_sdpa_backend, "CUDNN_ATTENTION", _sdpa_gqa_fn),
    "flex": _flex,
    "fa4": functools.partial(_fa4, False),
    "fa4_deterministic": functools.partial(_fa4, True),
    "empty_call": functools.partial(_floor, "empty_call"),
    "read_floor": functools.partial(_floor, "read_floor"),
}
IMPL_NAMES = tuple(BUILDERS)
# The floors, not attention and not checked: empty_call allocates o and launches an empty kernel;
# read_floor reads q, k and v once and writes o (no arithmetic), the memory floor of any implementation.
FLOORS = ("read_floor", "empty_call")
# Implementations that are not peers when picking the best competitor.
NON_PEERS = ("project",) + FLOORS + ("reference_loops",)
SIXTEEN_BIT = ("float16", "bfloat16")
# Implementations run only where their package imports (else the run says so once, in its notes),
# and only in SIXTEEN_BIT.
OPTIONAL = {"fa4": fa4_missing, "fa4_deterministic": fa4_missing}
SIXTEEN_BIT_ONLY = tuple(OPTIONAL)
# Implementations run at the harness shape only.
HARNESS_ONLY = ("reference_loops", "read_floor")


# --------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------
def materialises_scores(name: str, dtype_name: str) -> bool:
    if name in ("eager_expand", "compiled_expand"):
        return True
    # With enable_gqa, fp32 SDPA has no fused kernel and falls back to the math backend.
    return name == "sdpa_gqa" and dtype_name == "float32"


def estimate_bytes(name: str, shape, dtype_name: str) -> int:
    """Rough extra device memory an implementation needs beyond its inputs."""
    B, T, Hq, Hkv, D = shape
    esize = 4 if dtype_name == "float32" else 2
    act = B * T * Hq * D * esize  # one [B, T, Hq, D] tensor
    scores = B * Hq * T * T * esize
    if name == "eager_expand":
        return 3 * scores + T * T + 3 * act
    if name == "compiled_expand":
        return 2 * scores + 3 * act
    if name == "sdpa_gqa" and dtype_name == "float32":
        return 3 * scores + T * T + 3 * act
    if name == "reference_loops":
        return 2 * scores + 3 * act
    if name == "sdpa_expand_efficient":
        return 3 * act + B * Hq * T * 4
    if name == "flex":
        return 2 * act + 2 * T * T
    return 2 * act + B * Hq * T * 4
