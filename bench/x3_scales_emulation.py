"""CPU emulation of the fp32 x3 backward's scales on inputs of uneven magnitude: today's one power
of two per tensor (kernels/bwdx3/bwdx3.cu) against powers of two per row and per channel.

Every operand of a tensor-core product is split into fp16 hi and lo after its scale, the products
are lo hi + hi lo + hi hi, exact (float64), and so is the rest, so what differs between the two is
the splits and the scales alone (not the tensor core's additions; bench/x3_backward_emulation.py
models those). Scales per row and per channel:
- S = Q K^T and dP = dO V^T (sums over channels): Q, K, dO and V scaled per row; S and dP
  unscaled per element (row exponent + column exponent);
- dQ = dS K (output columns are channels): dS scaled per query row, from the row's bound
  |dS_ij| <= |dO_i| (max_j |V_j| + |o_i|); K scaled per channel;
- dK = dS^T Q: dS^T scaled per key row, from the largest bound of the query rows at or after the
  key (a suffix maximum); Q scaled per channel;
- dV = P^T dO: P times 2^14 as today; dO scaled per channel.
The error of each design is the worst row and the worst (head, channel) norm-relative error against
float64 autograd, over the cases of bench/uneven_backward.py, beside fp32 autograd's own on the
CPU (SDPA in fp32, a stand-in for an fp32-accurate kernel).

    python bench/x3_scales_emulation.py [--shapes 2,300,6,3,64 ...]
"""
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import reference  # noqa: E402
from uneven_backward import CASES, scaled, worst_errors  # noqa: E402


def exponent(amax):
    """The power of two that puts amax (a tensor of maxima) in [2^14, 2^15); 0 where amax is 0."""
    e = 14 - torch.floor(torch.log2(amax.clamp_min(1e-300)))
    return torch.where(amax > 0, e, torch.zeros_like(e))


def split(x):
    """x as (hi, lo), fp16 values held in float64, lo from an fp32 subtraction as on the device."""
    hi = x.to(torch.float16).double()
    return hi, (x.float() - hi.float()).to(torch.float16).double()


def x3(a, b):
    """lo hi + hi lo + hi hi of two split operands, a @ b, exact."""
    return a[1] @ b[0] + a[0] @ b[1] + a[0] @ b[0]


def scaled_split(x, e):
    return split(x * 2.0 ** e)


def backward(q, k, v, g, per_row):
    """dq, dk, dv of the x3 design: one exponent per tensor (per_row False) or per row and channel."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    heads = lambda t, rep=1: t.permute(0, 2, 1, 3).double().repeat_interleave(rep, 1)   # [B, H, T, D]  # noqa: E731
    Q, K, V, dO = heads(q), heads(k, G), heads(v, G), heads(g)
    scale = 1 / math.sqrt(D)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    amax = lambda x, dim: x.abs().amax(dim=dim, keepdim=True)   # noqa: E731
    if per_row:
        eq, ek, ev, edo = (exponent(amax(x, -1)) for x in (Q, K, V, dO))   # [B, H, T, 1]
    else:
        eq, ek, ev, edo = (exponent(x.abs().max()) for x in (q.double(), k.double(), v.double(), g.double()))
    S = x3(scaled_split(Q, eq), tuple(t.transpose(-1, -2) for t in scaled_split(K, ek)))
    S = S * 2.0 ** -(eq + (ek.transpose(-1, -2) if per_row else ek)) * scale
    P = S.masked_fill(future, float("-inf")).softmax(-1)
    o = P @ V
    dP = x3(scaled_split(dO, edo), tuple(t.transpose(-1, -2) for t in scaled_split(V, ev)))
    dP = dP * 2.0 ** -(edo + (ev.transpose(-1, -2) if per_row else ev))
    delta = (dO * o).sum(-1, keepdim=True)
    dS = P * (dP - delta)
    # |dS_ij| <= |dO_i| (max_j |V_j| + |o_i|): per query row, and per key row the suffix maximum
    bound = dO.norm(dim=-1, keepdim=True) * (V.norm(dim=-1, keepdim=True).amax(-2, keepdim=True) + o.norm(dim=-1, keepdim=True))
    if per_row:
        e_rows = 14 - torch.ceil(torch.log2(bound.clamp_min(1e-300)))
        suffix = bound.flip(-2).cummax(-2).values.flip(-2)
        e_keys = (14 - torch.ceil(torch.log2(suffix.clamp_min(1e-300)))).transpose(-1, -2)   # [B, H, 1, T]
        e_kc, e_qc, e_doc = (exponent(amax(x, (0, 2))) for x in (K, Q, dO))   # [1, H, 1, D]
        dQ = x3(scaled_split(dS, e_rows), scaled_split(K, e_kc)) * 2.0 ** -(e_rows + e_kc) * scale
        dK = x3(tuple(t.transpose(-1, -2) for t in scaled_split(dS, e_keys)), scaled_split(Q, e_qc))
        dK = dK * 2.0 ** -(e_keys.transpose(-1, -2) + e_qc) * scale
        dV = x3(tuple(t.transpose(-1, -2) for t in split(P * 2.0 ** 14)), scaled_split(dO, e_doc)) * 2.0 ** -(14 + e_doc)
    else:
        e_ds = 14 - math.ceil(math.log2(bound.max().item() * 2.0 ** (edo + ev)))
        dSs = split(dS * 2.0 ** (edo + ev + e_ds))
        dQ = x3(dSs, scaled_split(K, ek)) * 2.0 ** -(edo + ev + e_ds + ek) * scale
        dK = x3(tuple(t.transpose(-1, -2) for t in dSs), scaled_split(Q, eq)) * 2.0 ** -(edo + ev + e_ds + eq) * scale
        dV = x3(tuple(t.transpose(-1, -2) for t in split(P * 2.0 ** 14)), scaled_split(dO, edo)) * 2.0 ** -(14 + edo)
    group = lambda t: t.view(B, -1, G, T, D).sum(2).permute(0, 2, 1, 3)   # noqa: E731
    return dQ.permute(0, 2, 1, 3), group(dK), group(dV)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2,300,6,3,64", "1,600,8,2,128"])
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args(argv)
    cases = CASES + [("grad_out", "rows", -2, 2), ("k", "channels", -6, 0)]
    print("%-14s %-9s %-8s %-12s %-3s %21s %21s %21s" % ("shape", "tensor", "by", "span", "", "per tensor row/chan",
                                                        "per row/chan", "fp32 autograd"))
    worst = {"per tensor": 0.0, "per row": 0.0}
    for text in args.shapes:
        B, T, Hq, Hkv, D = (int(x) for x in text.split(","))
        for which, by, lo, hi in cases:
            gen = torch.Generator().manual_seed(args.seed)
            q, k, v = (torch.randn(B, T, H, D, generator=gen) for H in (Hq, Hkv, Hkv))
            g = torch.randn(B, T, Hq, D, generator=gen)
            tensors = dict(q=q, k=k, v=v, grad_out=g)
            tensors[which] = scaled(tensors[which], by, lo, hi, gen)
            q, k, v, g = (tensors[n] for n in ("q", "k", "v", "grad_out"))
            exact_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
            exact = torch.autograd.grad(reference.causal_gqa_reference(*exact_leaves), exact_leaves, g.double())
            fp32_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in fp32_leaves), is_causal=True,
                                                                   enable_gqa=True).transpose(1, 2)
            fp32 = torch.autograd.grad(out, fp32_leaves, g)
            designs = {"per tensor": backward(q, k, v, g, False), "per row": backward(q, k, v, g, True)}
            for i, name in enumerate(("dq", "dk", "dv")):
                cells = []
                for design in ("per tensor", "per row"):
                    row, chan = worst_errors(designs[design][i], exact[i])
                    base = worst_errors(fp32[i], exact[i])
                    worst[design] = max(worst[design], row / max(base[0], 1e-12), chan / max(base[1], 1e-12))
                    cells.append("%.1e / %.1e" % (row, chan))
                cells.append("%.1e / %.1e" % worst_errors(fp32[i], exact[i]))
                print("%-14s %-9s %-8s 1e%+g..1e%+g %-3s %21s %21s %21s" % (text, which, by, lo, hi, name, *cells), flush=True)
    for design, ratio in worst.items():
        print("%s: worst ratio to fp32 autograd %.1fx" % (design, ratio))


if __name__ == "__main__":
    main()
