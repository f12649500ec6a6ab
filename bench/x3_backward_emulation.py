"""CPU emulation, against float64, of the fp32 backward's x3 unit (kernels/bwdx3/bwdx3.cu; NOTES
v71): q, k, v and dO each scaled by a power of two (largest |x| into [2^14, 2^15)) and split into
fp16 hi and lo; S and dP as lo hi + hi lo + hi hi; P times 2^14 and dS times 2^e_ds (from the row
norm bound |dS| <= |dO| (|V| + |o|)) split the same way for dV, dK and dQ. Products and sums are
exact (float64), so what it measures is the splits and scales alone, not the tensor core's
additions. Plain inputs and those of test_gpu_backward_fp32_uneven_magnitudes.
With --accumulation: dV's sums over the steps of a long sequence with every k16 chunk added to
the accumulator rounded toward zero (a model of the tensor core's additions), never flushed or
flushed into an fp32 sum every 4 or 2 steps (NOTES v72).
With --delta: on the uneven inputs, exact arithmetic except delta = rowsum(dO o) from an o off by
a given relative noise per element (the forward's error), against delta = sum P dP (NOTES v74),
and with the dQ kernel's correction of it (v75).
`python bench/x3_backward_emulation.py [--accumulation | --delta]`."""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reference  # noqa: E402

torch.manual_seed(1)
def exp_of(amax):
    """x3_exponent: the power of two that puts amax in [2^14, 2^15)."""
    if amax == 0: return 0
    return 14 - math.floor(math.log2(amax))
def split(x):
    """A scaled tensor as (hi, lo): fp16 values held in float64, lo from an fp32 subtraction."""
    hi = x.to(torch.float16).double()
    lo = (x.float() - hi.float()).to(torch.float16).double()   # fp32 subtraction as on the device
    return hi, lo
def x3mm(a, b):
    """lo hi + hi lo + hi hi of two split operands, exact."""
    ah, al = a; bh, bl = b
    return al @ bh + ah @ bl + ah @ bh
def run(B, T, Hq, Hkv, D, uneven):
    """Prints the norm-relative error and the worst channel's of dq, dk and dv."""
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64).float() for H in (Hq, Hkv, Hkv))
    g = torch.randn(B, T, Hq, D, dtype=torch.float64).float()
    if uneven:
        q[:, :, 0] *= 1e3; k *= 1e-3; k[..., 1] *= 1e2; v[..., 0] *= 1e-3
        g *= 1e-6; g[:, T // 2] *= 1e3
    # float64 reference
    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    o64 = reference.causal_gqa_reference(q64, k64, v64)
    o64.backward(g.double())
    o = o64.detach().float()   # the forward's output, as fp32
    G = Hq // Hkv
    eq, ek, ev, edo = (exp_of(t.abs().max().item()) for t in (q, k, v, g))
    Q = split(q.double() * 2**eq); K = split(k.double() * 2**ek); V = split(v.double() * 2**ev); dO = split(g.double() * 2**edo)
    def heads(t, rep):   # [B, T, H, D] -> [B, Hq, T, D]
        t = t.permute(0, 2, 1, 3)
        return t.repeat_interleave(rep, 1) if rep > 1 else t
    Qh = tuple(heads(x, 1) for x in Q); Kh = tuple(heads(x, G) for x in K); Vh = tuple(heads(x, G) for x in V); dOh = tuple(heads(x, 1) for x in dO)
    scale = 1 / math.sqrt(D)
    S = x3mm(Qh, tuple(x.transpose(-1, -2) for x in Kh)) * 2.0**-(eq + ek) * scale
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    S = S.masked_fill(mask, float('-inf'))
    P = torch.softmax(S, -1)
    dP = x3mm(dOh, tuple(x.transpose(-1, -2) for x in Vh))   # scaled by 2^(edo+ev)
    delta = (g.double() * o.double()).sum(-1).permute(0, 2, 1).unsqueeze(-1) * 2.0**(edo + ev)
    # bound: max row norms of scaled dO, V, o
    nd = (g.double() * 2**edo).norm(dim=-1).max().item(); nv = (v.double() * 2**ev).norm(dim=-1).max().item(); no = (o.double() * 2**ev).norm(dim=-1).max().item()
    eds = 14 - math.ceil(math.log2(nd * (nv + no)))
    dS = P * (dP - delta)
    Pp = split(P * 2**14); dSs = split(dS * 2**eds)
    dV = x3mm(tuple(x.transpose(-1, -2) for x in Pp), dOh) * 2.0**-(14 + edo)
    dK = x3mm(tuple(x.transpose(-1, -2) for x in dSs), Qh) * 2.0**-(edo + ev + eds + eq) * scale
    dQ = x3mm(dSs, Kh) * 2.0**-(edo + ev + eds + ek) * scale
    def sum_group(t):  # [B, Hq, T, D] -> [B, T, Hkv, D]
        return t.view(B, Hkv, G, T, D).sum(2).permute(0, 2, 1, 3)
    got = (dQ.permute(0, 2, 1, 3), sum_group(dK), sum_group(dV))
    for name, a, ref in zip(("dq", "dk", "dv"), got, (q64.grad, k64.grad, v64.grad)):
        err = ((a - ref).norm() / ref.norm()).item()
        ch = ((a - ref).pow(2).sum(dim=(0, 1, 2)).sqrt() / ref.pow(2).sum(dim=(0, 1, 2)).sqrt()).max().item()
        print(name, "rel %.3g worst channel %.3g" % (err, ch), "eds", eds)
def toward_zero(x):
    """float64 values rounded to fp32 toward zero (held in float64)."""
    y = x.float()
    over = y.double().abs() > x.abs()
    return torch.where(over, torch.nextafter(y, torch.zeros_like(y)), y).double()


def accumulation(T=4097, D=64, G=2, keys=1024):
    """dV of the first `keys` keys (the longest sums) of one kv head, steps of 64 query rows per
    head of the group as the dK/dV kernel takes them: norm-relative error against float64 for each
    flush interval."""
    q, dout = (torch.randn(G, T, D, dtype=torch.float64) for _ in range(2))
    k = torch.randn(T, D, dtype=torch.float64)
    scores = torch.einsum("gtd,sd->gts", q, k) / math.sqrt(D)
    P = torch.softmax(scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1)[:, :, :keys]
    exact = torch.einsum("gtk,gtd->kd", P, dout)
    e = exp_of(dout.abs().max().item())
    Ps, dOs = split(P * 2**14), split(dout * 2**e)
    for flush in (0, 4, 2):
        acc, total, step = torch.zeros(keys, D, dtype=torch.float64), torch.zeros(keys, D, dtype=torch.float64), 0
        for qt in range((T + 63) // 64):
            rows = slice(qt * 64, min(qt * 64 + 64, T))
            for g in range(G):
                for a, b in ((1, 0), (0, 1), (0, 0)):   # lo hi, hi lo, hi hi
                    A, B = Ps[a][g, rows].transpose(0, 1), dOs[b][g, rows]
                    for c in range(0, A.shape[1], 16):
                        acc = toward_zero(acc + A[:, c:c + 16] @ B[c:c + 16])
                step += 1
                if flush and step % flush == 0:
                    total, acc = (total + acc).float().double(), torch.zeros_like(acc)
        got = (total + acc) * 2.0**-(14 + e)
        print("flush every %s steps: dV rel %.3g" % (flush or "no", ((got - exact).norm() / exact.norm()).item()))


def delta_sensitivity(B=1, T=1000, Hq=8, Hkv=2, D=128):
    """dq's and dk's norm-relative errors on the uneven inputs when everything is exact but the o
    that delta is taken from (exact, rounded to fp32, or with relative noise per element); then
    the same with the dQ kernel's correction (NOTES v75): c = the row sums of dS (rounded to fp32),
    dq -= c sum_j P_ij k_j / sqrt(D) with that sum from fp16 P and k, and dk from delta + c."""
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for H in (Hq, Hkv, Hkv))
    g = torch.randn(B, T, Hq, D, dtype=torch.float64)
    q[:, :, 0] *= 1e3; k *= 1e-3; k[..., 1] *= 1e2; v[..., 0] *= 1e-3
    g *= 1e-6; g[:, T // 2] *= 1e3
    G = Hq // Hkv
    kk, vv = k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)
    sc = 1 / math.sqrt(D)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * sc
    P = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", P, vv)
    dP = torch.einsum("bthd,bshd->bhts", g, vv)
    def grads(delta):   # delta [B, Hq, T, 1]
        dS = P * (dP - delta)
        dq = torch.einsum("bhts,bshd->bthd", dS, kk) * sc
        dk = torch.einsum("bhts,bthd->bshd", dS, q).reshape(B, T, Hkv, G, D).sum(3) * sc
        return dS, dq, dk
    _, dq0, dk0 = grads((P * dP).sum(-1, keepdim=True))
    pk = torch.einsum("bhts,bshd->bthd", P.half().double(), kk.half().double())
    rel = lambda a, r: ((a - r).norm() / r.norm()).item()
    cases = [("o exact", o), ("o rounded to fp32", o.float().double())]
    cases += [("o with %.2g relative noise" % r, o * (1 + r * torch.randn_like(o))) for r in (2.5e-7, 5e-7, 1e-6)]
    for name, oo in cases:
        delta = (g * oo).sum(-1).transpose(1, 2).unsqueeze(-1)
        dS, dq, dk = grads(delta)
        c = dS.float().double().sum(-1, keepdim=True)
        dq_fixed = dq - sc * c.squeeze(-1).transpose(1, 2).unsqueeze(-1) * pk
        _, _, dk_fixed = grads(delta + c)
        print("%s: dq rel %.3g, dk rel %.3g; corrected: dq %.3g, dk %.3g"
              % (name, rel(dq, dq0), rel(dk, dk0), rel(dq_fixed, dq0), rel(dk_fixed, dk0)))
    # What test_gpu_backward_fp32_ignores_the_outputs_last_bits measures: how far o off by 1e-5
    # relative moves dq and dk, without and with the correction.
    noisy = o * (1 + 1e-5 * torch.randn_like(o))
    for fixed in (False, True):
        got = []
        for oo in (o, noisy):
            delta = (g * oo).sum(-1).transpose(1, 2).unsqueeze(-1)
            dS, dq, _ = grads(delta)
            c = dS.float().double().sum(-1, keepdim=True) if fixed else torch.zeros_like(delta)
            dq = dq - sc * c.squeeze(-1).transpose(1, 2).unsqueeze(-1) * pk
            got.append((dq, grads(delta + c)[2]))
        print("o off by 1e-5, %s: dq moves %.3g, dk moves %.3g" % (
            "corrected" if fixed else "as it is", rel(got[1][0], got[0][0]), rel(got[1][1], got[0][1])))

if __name__ == "__main__":
    if "--accumulation" in sys.argv:
        accumulation()
    elif "--delta" in sys.argv:
        for seed in range(3):
            for shape in ((1, 1000, 8, 2, 128), (2, 300, 6, 3, 64)):
                torch.manual_seed(seed)
                print("seed %d, shape %s" % (seed, shape))
                delta_sensitivity(*shape)
    else:
        for uneven in (False, True):
            print("uneven" if uneven else "plain")
            run(1, 1000, 8, 2, 128, uneven)
