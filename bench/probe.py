"""Quick timing probe of the project kernel against SDPA's fastest fp32 path (development aid;
the numbers of record come from bench_gqa.py)."""
import sys, os
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from triton.testing import do_bench
import gqa_module

def flops(B, T, Hq, D):
    return 4 * B * Hq * T * T * D / 2

shapes = [(2, 80, 8, 2, 32), (4, 1024, 32, 8, 128), (1, 8192, 32, 8, 128), (16, 2048, 32, 8, 64)]
for dtype in (torch.float32, torch.bfloat16):
    for B, T, Hq, Hkv, D in (shapes[:1] if '--small' in sys.argv else shapes):
        q = torch.randn(B, T, Hq, D, device="cuda", dtype=dtype)
        k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        v = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype)
        ours = do_bench(lambda: gqa_module.causal_gqa_attention(q, k, v), return_mode="median")
        G = Hq // Hkv
        def eff():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2),
                                                      v.repeat_interleave(G, 2).transpose(1, 2), is_causal=True)
        theirs = do_bench(eff, return_mode="median")
        empty = do_bench(lambda: gqa_module.empty_call(q, k, v), return_mode="median")
        f = flops(B, T, Hq, D)
        print("%-22s %-9s ours %8.4f ms %6.1f TF/s | sdpa_eff %8.4f ms %6.1f TF/s | ratio %.2f | empty %.4f"
              % ((B, T, Hq, Hkv, D), str(dtype)[6:], ours, f / ours / 1e9, theirs, f / theirs / 1e9, theirs / ours, empty),
              flush=True)

# Graph replay of the harness shape: GPU time per call without host overhead.
q, k, v = [torch.randn(2, 80, H, 32, device="cuda") for H in (8, 2, 2)]
for fn, name in ((gqa_module.causal_gqa_attention, "project"), (gqa_module.empty_call, "empty")):
    fn(q, k, v)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn(q, k, v)
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    print("graph replay %s: %.2f us per call" % (name, s.elapsed_time(e) / 200 * 1000))
