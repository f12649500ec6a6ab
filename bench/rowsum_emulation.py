"""CPU model, against float64, of the 16-bit forward's normaliser (NOTES v77): l summed from P in
fp32 (kRowSumByProduct off) or from P as rounded to the input dtype for P V (on). One tile, exact
products, so what it measures is the rounding of P alone: the output's norm-relative error both
ways, and how far the row's log-sum-exp (kept for a backward) moves.
`python bench/rowsum_emulation.py`."""
import math

import torch


def model(T, D, dtype, q_scale):
    q, k, v = (torch.randn(T, D, dtype=torch.float64).to(dtype).double() for _ in range(3))
    s = (q * q_scale) @ k.T / math.sqrt(D)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.softmax(s, -1) @ v
    p = torch.exp(s - s.max(-1, keepdim=True).values).float().double()   # P in fp32
    rounded = p.to(dtype).double()                                       # P as packed for P V
    numerator = rounded @ v
    errors = [((numerator / l - ref).norm() / ref.norm()).item() for l in (p.sum(-1, keepdim=True), rounded.sum(-1, keepdim=True))]
    lse_moved = (rounded.sum(-1).log() - p.sum(-1).log()).abs().max().item()
    return errors, lse_moved


if __name__ == "__main__":
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for T, D, q_scale in ((1024, 64, 1.0), (4097, 128, 1.0), (1024, 64, 8.0)):
            (off, on), moved = model(T, D, dtype, q_scale)
            print("%s T=%d D=%d q x%g: error %.3g (fp32 sum), %.3g (rounded P); lse moved by at most %.2g"
                  % (str(dtype).split(".")[-1], T, D, q_scale, off, on, moved))
