# Run: python3 bench/bwd_fused_emulation.py (no GPU; about a minute).
# Float64 emulation of bwdwg/fused.cuh's loops, index maps and masks (not its fragments).
import math, numpy as np, torch
def ref_grads(q, k, v, do):
    G = q.shape[2] // k.shape[2]
    qd, kd, vd = (x.clone().double().requires_grad_() for x in (q, k, v))
    kk = kd.repeat_interleave(G, 2); vv = vd.repeat_interleave(G, 2)
    o = torch.nn.functional.scaled_dot_product_attention(qd.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=True).transpose(1, 2)
    g = torch.autograd.grad(o, (qd, kd, vd), do.double())
    return o.detach().numpy(), [x.numpy() for x in g]
def emulate(q, k, v, o, do):
    B, T, Hq, D = q.shape; Hkv = k.shape[2]; G = Hq // Hkv
    scale = 1 / math.sqrt(D); sl2 = math.log2(math.e) * scale
    # stats
    lse2 = np.zeros((B, T, Hq)); delta = (do * o).sum(-1)
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h] @ k[b, :, h // G].T * sl2
            s[np.triu_indices(T, 1)] = -np.inf
            m = s.max(1); lse2[b, :, h] = m + np.log2(np.exp2(s - m[:, None]).sum(1))
    n_q = -(-T // 64); n_k = -(-T // 128)
    pad = lambda x, rows: np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:])]) if x.shape[0] < rows else x
    dq = np.zeros_like(q); dk = np.zeros_like(k); dv = np.zeros_like(v)
    order = np.zeros((B, Hq, n_q), int)
    for kt in range(n_k):
        for b in range(B):
            for kvh in range(Hkv):
                k0 = 128 * kt
                K = pad(k[b, k0:k0 + 128, kvh], 128); V = pad(v[b, k0:k0 + 128, kvh], 128)
                dK = np.zeros((128, D)); dV = np.zeros((128, D))
                steps = (n_q - 2 * kt) * G
                for i in range(steps):
                    qi = n_q - 1 - i // G; h = kvh * G + i % G; q0 = 64 * qi
                    Q = pad(q[b, q0:q0 + 64, h], 64); dO = pad(do[b, q0:q0 + 64, h], 64)
                    L = pad(lse2[b, q0:q0 + 64, h], 64); Dl = pad(delta[b, q0:q0 + 64, h], 64)
                    dS_all = np.zeros((128, 64))
                    for wg in range(2):
                        kw0 = k0 + 64 * wg
                        Kw, Vw = K[64 * wg:64 * wg + 64], V[64 * wg:64 * wg + 64]
                        sT = Kw @ Q.T; dpT = Vw @ dO.T
                        edge = q0 < kw0 + 64 or q0 + 64 > T or kw0 + 64 > T
                        j = kw0 + np.arange(64)[:, None]; t = q0 + np.arange(64)[None, :]
                        masked = (t < j) | (t >= T) | (j >= T)
                        if not edge: assert not masked.any(), ("unmasked", kt, qi, wg)
                        pT = np.where(edge & masked, 0.0, np.exp2(sT * sl2 - L[None, :]))
                        dV[64 * wg:64 * wg + 64] += pT @ dO
                        dsT = pT * (dpT - Dl[None, :])
                        dK[64 * wg:64 * wg + 64] += dsT @ Q
                        dS_all[64 * wg:64 * wg + 64] = dsT
                    assert order[b, h, qi] == kt, ("order", kt, b, h, qi, order[b, h, qi])
                    part = dS_all.T @ K   # 64 q x D
                    rows = min(64, T - q0)
                    dq[b, q0:q0 + rows, h] += part[:rows]
                    order[b, h, qi] += 1
                rows = min(128, T - k0)
                dk[b, k0:k0 + rows, kvh] = dK[:rows] * scale; dv[b, k0:k0 + rows, kvh] = dV[:rows]
    assert (order == np.array([[[qi // 2 + 1 for qi in range(n_q)]] * Hq] * B)).all()
    return dq * scale, dk, dv
rng = np.random.default_rng(0)
for (B, T, Hq, Hkv, D) in [(1, 1, 1, 1, 8), (1, 63, 2, 1, 8), (1, 65, 2, 2, 8), (2, 129, 4, 2, 16), (1, 200, 3, 1, 8), (1, 300, 6, 2, 16), (2, 257, 4, 4, 8), (1, 384, 2, 1, 8)]:
    q, k, v = (torch.from_numpy(rng.standard_normal((B, T, H, D))) for H in (Hq, Hkv, Hkv))
    do = torch.from_numpy(rng.standard_normal((B, T, Hq, D)))
    o, (gq, gk, gv) = ref_grads(q, k, v, do)
    eq, ek, ev = emulate(q.numpy(), k.numpy(), v.numpy(), o, do.numpy())
    errs = [np.abs(a - b).max() / max(np.abs(b).max(), 1.0) for a, b in ((eq, gq), (ek, gk), (ev, gv))]
    print((B, T, Hq, Hkv, D), ["%.1e" % e for e in errs]); assert max(errs) < 1e-9
print("ok")
