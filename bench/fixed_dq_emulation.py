"""Float64 model of the fused backward's fixed-point dQ sum (DqAdd::kFixed in bwdwg/fused.cuh of
branch bwd-fixed).

Each key tile's share of a dQ row (dS rounded to the input's 16 bits, times K, summed in fp32) is
scaled by 2^e (e per query row, fixed_dq_exp in bwdmma/kernels.cuh), rounded to an integer, and the
integers are summed; dQ = sum * 2^-e / sqrt(D). The model checks that every share stays below the
kernel's limit (else the kernel hands the call to the row-wise kernels) and compares the error
against float64 with that of the same shares summed in fp32 in key-tile order.

    python3 bench/fixed_dq_emulation.py
"""
import math

import torch

KEYS = 128  # keys a fused CTA (a share)


def bits_exp_above(x: torch.Tensor, bf16: bool, dim=None) -> torch.Tensor:
    """The kernel's E with every value of x (16-bit) below 2^E, from the largest magnitude's bits
    (over all of x, or along dim)."""
    bits = x.view(torch.int16).to(torch.int32) & 0x7FFF
    bits = bits.amax() if dim is None else bits.amax(dim)
    return (bits >> 7).clamp(min=1) - 126 if bf16 else (bits >> 10).clamp(min=1) - 14


def share_log2(T: int) -> int:
    return ((T + 127) // 128).bit_length()


def model(q, k, v, do, bf16=True):
    """q, do [T, G, D] of one kv head's group, k, v [T, D], all 16-bit. Returns (errors, worst share
    against its limit)."""
    T, G, D = q.shape
    qd, kd, vd, dod = (x.double() for x in (q, k, v, do))
    scale = 1 / math.sqrt(D)
    s = torch.einsum("tgd,jd->gtj", qd, kd) * scale
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, -math.inf)
    p = torch.softmax(s, -1)
    o = torch.einsum("gtj,jd->tgd", p, vd)
    o16 = o.to(q.dtype)  # the forward's output, rounded
    dp = torch.einsum("tgd,jd->gtj", dod, vd)
    delta = (dod * o16.double()).sum(-1).permute(1, 0)  # [G, T], from the rounded output, as the kernel
    ds_exact = p * (dp - (dod * o.double()).sum(-1).permute(1, 0)[..., None])
    dq_ref = torch.einsum("gtj,jd->tgd", ds_exact, kd) * scale
    ds = (p * (dp - delta[..., None])).to(q.dtype).float()  # dS rounded to 16 bits, as the kernel's pack
    k_e, v_e = bits_exp_above(k, bf16), bits_exp_above(v, bf16)
    L = share_log2(T)
    limit = 2.0 ** (62 - L)
    fp32_sum = torch.zeros(G, T, D, dtype=torch.float32)
    ints = torch.zeros(G, T, D, dtype=torch.int64)  # exact: every share stays below the limit, the sum below 2^62
    worst = 0.0
    above = k_e + v_e + bits_exp_above(do, bf16, dim=-1).T + (D - 1).bit_length() + 2  # [G, T]
    exps = (62 - L - above).clamp(-252, 252)
    for j0 in range(0, T, KEYS):
        share = torch.einsum("gtj,jd->gtd", ds[:, :, j0:j0 + KEYS], k[j0:j0 + KEYS].float())  # fp32 products
        fp32_sum += share
        scaled = share.double() * torch.pow(2.0, exps.double())[..., None]
        worst = max(worst, float(scaled.abs().max()) / limit)
        if not worst < 1:  # the kernel flags the call: the row-wise kernels take it
            return {"flagged": True, "share_over_limit": worst}
        ints += torch.round(scaled).to(torch.int64)  # __float2ll_rn (ties to even, as torch.round)
    sums = ints.double() * torch.pow(2.0, -exps.double())[..., None]  # __ll2double_rn, then 2^-e
    fixed = (sums.permute(1, 0, 2) * scale)
    fp32 = (fp32_sum.double().permute(1, 0, 2) * scale)

    def rel(x):
        return float((x - dq_ref).norm() / dq_ref.norm())

    def worst_channel(x):
        return float(((x - dq_ref).norm(dim=(0, 1)) / dq_ref.norm(dim=(0, 1)).clamp_min(1e-300)).max())

    out16 = lambda x: x.to(q.dtype).double()  # noqa: E731 (the output's rounding)
    return {"fixed": rel(fixed), "fp32": rel(fp32), "fixed_out": rel(out16(fixed)), "fp32_out": rel(out16(fp32)),
            "fixed_channel": worst_channel(fixed), "fp32_channel": worst_channel(fp32),
            "share_over_limit": worst, "e_range": (int(exps.min()), int(exps.max()))}


def cases(dtype):
    torch.manual_seed(0)
    T, G = 300, 2
    for D in (64, 128):
        def r(*shape):
            return torch.randn(*shape)
        yield f"randn D={D}", r(T, G, D), r(T, D), r(T, D), r(T, G, D)
        ch = torch.logspace(-3, 3, D)  # uneven magnitudes per channel
        yield f"channels 1e-3..1e3 D={D}", r(T, G, D) * ch, r(T, D) * ch, r(T, D) * ch.flip(0), r(T, G, D) * ch
        yield f"large 2^60 D={D}", r(T, G, D) * 2.0**-55, r(T, D) * 2.0**60, r(T, D) * 2.0**60, r(T, G, D) * 2.0**60
        yield f"tiny 2^-60 D={D}", r(T, G, D), r(T, D) * 2.0**-60, r(T, D) * 2.0**-60, r(T, G, D) * 2.0**-60
        sharp = r(T, G, D) * 8  # near one-hot softmax
        yield f"sharp D={D}", sharp, r(T, D) * 8, r(T, D), r(T, G, D) * 100
        rows = torch.logspace(-20, 20, T)[:, None, None]  # dO rows of uneven size
        yield f"dO rows 1e-20..1e20 D={D}", r(T, G, D), r(T, D), r(T, D), r(T, G, D) * rows


def main():
    for dtype, bf16 in ((torch.bfloat16, True), (torch.float16, False)):
        for name, q, k, v, do in cases(dtype):
            if not bf16 and ("2^" in name or "1e-20" in name):
                continue  # outside fp16's range
            m = model(*(x.to(dtype) for x in (q, k, v, do)), bf16=bf16)
            if m.get("flagged"):
                print(f"{str(dtype)[6:]:8} {name:28} a share at {m['share_over_limit']:.1e} of the limit: row-wise kernels")
                continue
            print(f"{str(dtype)[6:]:8} {name:28} fixed {m['fixed']:.2e} fp32 {m['fp32']:.2e} | after rounding to "
                  f"16 bits {m['fixed_out']:.2e} {m['fp32_out']:.2e} | worst channel {m['fixed_channel']:.2e} "
                  f"{m['fp32_channel']:.2e} | largest share / limit {m['share_over_limit']:.1e} e {m['e_range']}")


if __name__ == "__main__":
    main()
