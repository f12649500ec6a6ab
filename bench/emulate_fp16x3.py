"""CPU emulation, against float64, of fp32 as three fp16 products as first proposed (NOTES v16;
the kernel scales K and V per head and Q per tile instead): row-scaled hi/lo fp16 splits for Q
and K, P split unscaled, V scaled per (tile, column), exact products summed in fp32, online
softmax over 64-key tiles. `python bench/emulate_fp16x3.py`."""
import torch
torch.manual_seed(0)

def split16(x):
    """x (fp32) scaled per row to max |x| in [1, 2): returns hi, lo (fp16 values as fp32) and the row exponent."""
    m = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-38)
    e = torch.floor(torch.log2(m))
    xs = x * torch.exp2(-e)
    hi = xs.half().float()
    lo = (xs - hi).half().float()
    return hi, lo, e

def split16_cols(x):   # per column scale (over rows)
    hi, lo, e = split16(x.transpose(-1, -2))
    return hi.transpose(-1, -2), lo.transpose(-1, -2), e.transpose(-1, -2)

def mm3(ahi, alo, bhi, blo):
    """hi.hi + hi.lo + lo.hi, products exact, fp32 accumulation (matmul in fp32 of fp16-exact values)."""
    f = lambda a, b: a @ b
    return f(ahi, bhi) + f(ahi, blo) + f(alo, bhi)

def attn_fp16x3(q, k, v, BN=64):
    T, D = q.shape
    scale = 1.0 / D ** 0.5
    qh, ql, eq = split16(q)
    o = torch.zeros(T, D); m = torch.full((T, 1), -float("inf")); l = torch.zeros(T, 1)
    for n0 in range(0, T, BN):
        kt, vt = k[n0:n0 + BN], v[n0:n0 + BN]
        kh, kl, ek = split16(kt)
        s = mm3(qh, ql, kh.T, kl.T) * torch.exp2(eq) * torch.exp2(ek.T) * scale
        keys = torch.arange(n0, n0 + kt.shape[0])
        s = s.masked_fill(keys[None, :] > torch.arange(T)[:, None], -float("inf"))
        m_new = torch.maximum(m, s.amax(dim=1, keepdim=True))
        mref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        f = torch.exp(m - mref); p = torch.exp(s - mref)
        l = l * f + p.sum(1, keepdim=True)
        ph = p.half().float(); pl = (p - ph).half().float()
        vh, vl, ev = split16_cols(vt)           # per (tile, column) scale
        o = o * f + mm3(ph, pl, vh, vl) * torch.exp2(ev)
        m = m_new
    return o / l

def attn_ref(q, k, v):
    T, D = q.shape
    s = (q.double() @ k.double().T) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -float("inf"))
    return torch.softmax(s, -1) @ v.double()

for T, D, mag in ((1024, 128, 1.0), (2048, 64, 1.0), (1024, 128, 30.0), (1024, 128, 1e-6), (1024, 128, 1e6)):
    errs = []
    for h in range(3):
        q, k, v = (torch.randn(T, D) * mag for _ in range(3))
        if mag == 30.0:
            v = torch.randn(T, D)
        out, ref = attn_fp16x3(q, k, v), attn_ref(q, k, v)
        errs.append(((out.double() - ref).norm() / ref.norm()).item())
    print("T=%d D=%d scale %g: norm-relative error %s" % (T, D, mag, ", ".join("%.2e" % e for e in errs)))
