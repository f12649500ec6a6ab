"""The reference problem, in KernelBench's format: causal grouped-query attention with Python loops.

q is [B, T, Hq, D]; k and v are [B, T, Hkv, D]; query head h reads kv head h // (Hq // Hkv).
"""

import math

import torch
from torch import nn

batch_size = 2
seq_len = 80
num_q_heads = 8
num_kv_heads = 2
head_dim = 32


class Model(nn.Module):
    def __init__(self, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim):
        super().__init__()
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, q, k, v):
        B, T, Hq, D = q.shape
        group = Hq // k.shape[2]
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        out = torch.empty_like(q)
        for b in range(B):
            for h in range(Hq):
                for t in range(T):
                    scores = k[b, : t + 1, h] @ q[b, t, h] / math.sqrt(D)
                    out[b, t, h] = torch.softmax(scores, dim=0) @ v[b, : t + 1, h]
        return out


def get_inputs():
    q = torch.randn(batch_size, seq_len, num_q_heads, head_dim)
    k = torch.randn(batch_size, seq_len, num_kv_heads, head_dim)
    v = torch.randn(batch_size, seq_len, num_kv_heads, head_dim)
    return [q, k, v]


def get_init_inputs():
    return [num_q_heads, num_kv_heads, head_dim]


def causal_gqa_reference(q, k, v, attended_only=False):
    """The same function in float64 on the inputs' device, vectorised one query head at a time
    (so memory stays at B x T x T per head). attended_only forces the loops below, which sum over
    the attended keys alone; they are taken anyway when q, k or v holds Inf or NaN, and a caller
    whose output gradient does must ask for them (autograd multiplies a masked zero by it)."""
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.empty(B, T, Hq, D, dtype=torch.float64, device=q.device)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    if attended_only or not (torch.isfinite(q64).all() and torch.isfinite(k64).all() and torch.isfinite(v64).all()):
        # A product 0 * inf or 0 * nan with a masked future value would poison rows that never
        # attend to it (through V in the forward, and through K and Q in autograd's backward,
        # where masked scores get a zero gradient); sum over the attended keys only, as the loops do.
        for h in range(Hq):
            kv = h // group
            for t in range(T):
                s = torch.einsum("bd,bsd->bs", q64[:, t, h], k64[:, : t + 1, kv]) / math.sqrt(D)
                out[:, t, h] = torch.einsum("bs,bsd->bd", torch.softmax(s, dim=-1), v64[:, : t + 1, kv])
        return out
    for h in range(Hq):
        kv = h // group
        scores = torch.einsum("btd,bsd->bts", q64[:, :, h], k64[:, :, kv]) / math.sqrt(D)
        scores = scores.masked_fill(future, float("-inf"))
        out[:, :, h] = torch.softmax(scores, dim=-1) @ v64[:, :, kv]
    return out


def attention_ref(q, k, v, causal=True, window=(-1, -1), scale=None, softcap=0.0, chunk=0, alibi=None, qv=None,
                  sink=None):
    """Attention in float64 with FlashAttention's arguments and meanings, the reference for every
    mask: q [B, Tq, Hq, D], k [B, Tk, Hkv, D] and v [B, Tk, Hkv, Dv] (query head h reads kv head h //
    (Hq // Hkv)); qv [B, Tq, Hq, Dv] (FlashAttention 3's) adds qv . v to q . k.

    Query i is aligned with key i + Tk - Tq (bottom right, as FlashAttention does when Tq != Tk).
    It sees key j when j <= i + Tk - Tq + right and j >= i + Tk - Tq - left, for window = (left,
    right) where -1 means unbounded; causal=True sets right to 0; with chunk > 0 (FlashAttention 3's
    attention_chunk) only where j also lies in the chunk of `chunk` keys that holds key i + Tk - Tq
    (chunks start at multiples of chunk; a negative aligned key's chunk holds no key). Scores are
    (q . k + qv . v) * scale (default 1/sqrt(D), or 1/sqrt(D + Dv) with qv), then softcap *
    tanh(score / softcap) when softcap > 0, then minus alibi[b, h] * |i + Tk - Tq - j| where alibi
    ([Hq] or [B, Hq] slopes) is given. A row that sees no key gives 0 and a log-sum-exp of -inf.
    sink ([Hq] logits) joins each row's softmax as one more column that weighs no value (the
    log-sum-exp includes it). Returns (out [B, Tq, Hq, Dv], lse [B, Hq, Tq], natural log), float64.
    As causal_gqa_reference, inputs holding Inf or NaN take loops over the keys each row sees, so
    a masked key's 0 weight never multiplies them."""
    B, Tq, Hq, D = q.shape
    Tk, group = k.shape[1], Hq // k.shape[2]
    Dv = v.shape[3]
    scale = 1 / math.sqrt(D if qv is None else D + Dv) if scale is None else scale
    left, right = window[0], 0 if causal else window[1]
    i = torch.arange(Tq, device=q.device).view(Tq, 1) + (Tk - Tq)
    j = torch.arange(Tk, device=q.device).view(1, Tk)
    sees = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if right >= 0:
        sees &= j <= i + right
    if left >= 0:
        sees &= j >= i - left
    if chunk > 0:
        start = i - torch.remainder(i, chunk)   # the chunk's first key (floor, also for negative i)
        sees &= (j >= start) & (j < start + chunk)
    q64, k64, v64 = q.double(), k.double(), v.double()
    out = torch.zeros(B, Tq, Hq, Dv, dtype=torch.float64, device=q.device)
    qv64 = None if qv is None else qv.double()
    def dot(t, h, kv, keys=slice(None)):   # q . k (+ qv . v) of query rows t of head h
        s = torch.einsum("b...d,bsd->b...s", q64[:, t, h], k64[:, keys, kv])
        return s if qv64 is None else s + torch.einsum("b...d,bsd->b...s", qv64[:, t, h], v64[:, keys, kv])
    lse = torch.full((B, Hq, Tq), -math.inf, dtype=torch.float64, device=q.device)
    slopes = None if alibi is None else alibi.double().reshape(-1, Hq).expand(B, Hq)
    distance = (i - j).abs().double()   # |aligned query - key|, [Tq, Tk]
    def capped(s, h, rows=slice(None), keys=slice(None)):   # softcap, then ALiBi
        s = softcap * torch.tanh(s / softcap) if softcap > 0 else s
        if slopes is not None:
            s = s - slopes[:, h].view(-1, *([1] * (s.dim() - 1))) * distance[rows, keys]
        return s
    finite = all(bool(torch.isfinite(t).all()) for t in (q64, k64, v64) + (() if qv is None else (qv64,)))
    def with_sink(s, h):   # the sink's column after the keys' scores
        return s if sink is None else torch.cat([s, sink[h].double().expand(*s.shape[:-1], 1)], dim=-1)
    for h in range(Hq):
        kv = h // group
        if finite:
            s = with_sink(capped(dot(slice(None), h, kv) * scale, h).masked_fill(~sees, -math.inf), h)
            row_lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - row_lse.unsqueeze(-1)).nan_to_num(0.0)[..., :Tk]   # rows that see no key: 0
            out[:, :, h], lse[:, h] = p @ v64[:, :, kv], row_lse
            continue
        for t in range(Tq):
            keys = sees[t].nonzero().flatten()
            if keys.numel() > 0:
                s = with_sink(capped(dot(t, h, kv, keys) * scale, h, t, keys), h)
                lse[:, h, t] = torch.logsumexp(s, dim=-1)
                out[:, t, h] = torch.einsum("bs,bsd->bd", torch.softmax(s, dim=-1)[..., :keys.numel()],
                                            v64[:, keys, kv])
            elif sink is not None:
                lse[:, h, t] = sink[h].double()
    return out, lse
