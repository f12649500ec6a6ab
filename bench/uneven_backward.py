#!/usr/bin/env python3
"""fp32 backward accuracy on inputs of uneven magnitude, row by row and channel by channel (GPU).

For each case (one tensor of q, k, v, grad_out scaled by 10^u, u uniform in a span, per row
(b, t, h) or per channel (head, d)), the worst row error and the worst (head, channel) error of
dq, dk and dv against float64 autograd, for the project and for SDPA's memory-efficient backend
on k and v expanded to every query head, and their ratio (project / SDPA; the bar is <= 4).

    python bench/uneven_backward.py [--shapes 1,600,8,2,128 2,300,6,3,64] [--spans 4,8] [--out F.json]
"""
import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import gqa_module  # noqa: E402
import reference  # noqa: E402

# (tensor, "rows" or "channels", lowest power of ten, highest): the four cases, then spans.
CASES = [("grad_out", "rows", -4, 4), ("k", "channels", -8, 0), ("q", "channels", -8, 0), ("grad_out", "channels", -4, 4)]


def scaled(x, by, lo, hi, gen):
    """x times 10^u, u uniform in [lo, hi], drawn per row (b, t, h) or per (head, channel)."""
    B, T, H, D = x.shape
    shape = (B, T, H, 1) if by == "rows" else (1, 1, H, D)
    u = torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo
    return (x.double().cpu() * 10.0 ** u).to(x.dtype).to(x.device)


def worst_errors(got, exact):
    """(worst row error, worst (head, channel) error), each a norm-relative error over D or (B, T),
    over the rows and channels whose reference is not zero."""
    err = (got.double() - exact)
    rows = err.norm(dim=3) / exact.norm(dim=3)
    chans = err.norm(dim=(0, 1)) / exact.norm(dim=(0, 1))
    pick = lambda r, ref: r[ref > 0].max().item()   # noqa: E731
    return pick(rows, exact.norm(dim=3)), pick(chans, exact.norm(dim=(0, 1)))


def sdpa_efficient_grads(q, k, v, grad_out):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    group = q.shape[2] // k.shape[2]
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ke, ve = (t.repeat_interleave(group, dim=2) for t in leaves[1:])
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(leaves[0].transpose(1, 2), ke.transpose(1, 2),
                                                               ve.transpose(1, 2), is_causal=True).transpose(1, 2)
    return torch.autograd.grad(out, leaves, grad_out)


def project_grads(q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    return torch.autograd.grad(gqa_module.causal_gqa_attention(*leaves), leaves, grad_out)


def reference_grads(q, k, v, grad_out):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    return torch.autograd.grad(reference.causal_gqa_reference(*leaves), leaves, grad_out.double())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1,600,8,2,128", "2,300,6,3,64"])
    parser.add_argument("--spans", default="", help="also each case at these half-spans (powers of ten), e.g. 1,2,3")
    parser.add_argument("--seed", type=int, default=52)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    cases = list(CASES)
    for span in [float(s) for s in args.spans.split(",") if s]:
        cases += [("grad_out", "rows", -span, span), ("k", "channels", -2 * span, 0)]
    rows = []
    for text in args.shapes:
        B, T, Hq, Hkv, D = (int(x) for x in text.split(","))
        for which, by, lo, hi in cases:
            gen = torch.Generator().manual_seed(args.seed)
            q, k, v = (torch.randn(B, T, H, D, generator=gen).cuda() for H in (Hq, Hkv, Hkv))
            grad_out = torch.randn(B, T, Hq, D, generator=gen).cuda()
            tensors = dict(q=q, k=k, v=v, grad_out=grad_out)
            tensors[which] = scaled(tensors[which], by, lo, hi, gen)
            q, k, v, grad_out = (tensors[n] for n in ("q", "k", "v", "grad_out"))
            plan = gqa_module.backward_plan(q, k, v)
            exact = reference_grads(q, k, v, grad_out)
            ours, theirs = project_grads(q, k, v, grad_out), sdpa_efficient_grads(q, k, v, grad_out)
            for name, a, b, ref in zip(("dq", "dk", "dv"), ours, theirs, exact):
                (row_a, chan_a), (row_b, chan_b) = worst_errors(a, ref), worst_errors(b, ref)
                row = dict(shape=[B, T, Hq, Hkv, D], plan=plan, tensor=which, by=by, span=[lo, hi], grad=name,
                           row=row_a, row_sdpa=row_b, channel=chan_a, channel_sdpa=chan_b,
                           row_ratio=row_a / row_b, channel_ratio=chan_a / chan_b)
                rows.append(row)
                print("%-16s %-15s %-8s %-8s 1e%+g..1e%+g %s  row %.2e (sdpa %.2e, %.1fx)  channel %.2e (sdpa %.2e, %.1fx)"
                      % (text, plan, which, by, lo, hi, name, row_a, row_b, row["row_ratio"], chan_a, chan_b,
                         row["channel_ratio"]), flush=True)
    worst = max(max(r["row_ratio"], r["channel_ratio"]) for r in rows)
    print("worst ratio to SDPA mem-efficient: %.1fx (bar: 4x)" % worst)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"source_sha256": gqa_module.kernel_source_sha256(), "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "seed": args.seed, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
