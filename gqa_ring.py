"""Context-parallel attention: a sequence sharded over a torch.distributed process group, K and V
passed around the ring, each block attended by the library and merged by its log-sum-exp.

    x_local = gqa_ring.shard(x, rank, world)             # [B, T, H, D] -> this rank's [B, 2T/(2W), H, D]
    out_local = gqa_ring.ring_attention(q_local, k_local, v_local, causal=True)   # differentiable

The sequence is cut into 2W chunks; rank r holds chunks r and 2W - 1 - r (mirrored, so that under
the causal mask every rank has the same work). At step s rank r holds the K and V of rank
r - s (sent on to r + 1 while the step computes). A block of query chunk i against key chunk j is
full (j < i, or no mask), causal (j = i) or skipped (j > i under the causal mask); each is one
`gqa_module.attention` call with return_lse=True, merged by gqa_geometry.combine in fp32 (float64
for float64 inputs): lse = logaddexp(lse_a, lse_b), o = o_a exp(lse_a - lse) + o_b exp(lse_b -
lse). The backward
walks the ring again: each block's dQ stays, its dK and dV travel with the K and V they belong to
and are home after W steps. In this version the block backward runs in PyTorch from the global
log-sum-exp (the library's backward recomputes a block's own); inputs are taken finite.

`simulate` runs the same blocks for every rank in one process (no communication), so tests on one
device or CPU see what the ring computes, bitwise.
"""

import torch

import gqa_geometry
import gqa_module


# ------------------------------------------------------------------------------------------------
# Layout
def chunks_of(rank, world):
    """The two chunks (of 2 world) that rank holds: rank and its mirror 2 world - 1 - rank."""
    return rank, 2 * world - 1 - rank


def shard(x, rank, world):
    """This rank's part of x [B, T, H, D]: its two chunks along T, one after the other. T must be
    a multiple of 2 world."""
    T = x.shape[1]
    if T % (2 * world):
        raise ValueError("gqa_ring.shard: the sequence length (%d) must be a multiple of 2 x world (%d)"
                         % (T, 2 * world))
    n = T // (2 * world)
    return torch.cat([x[:, c * n:(c + 1) * n] for c in chunks_of(rank, world)], dim=1)


def unshard(parts):
    """The inverse of shard over every rank's part (a list in rank order): [B, T, H, D]."""
    world, n = len(parts), parts[0].shape[1] // 2
    pieces = [None] * (2 * world)
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, world)
        pieces[first], pieces[second] = part[:, :n], part[:, n:]
    return torch.cat(pieces, dim=1)


def _block_mode(i, j, causal):
    """How query chunk i attends key chunk j: "full", "causal" (the diagonal) or None (skipped)."""
    if not causal or j < i:
        return "full"
    return "causal" if j == i else None


# ------------------------------------------------------------------------------------------------
# Transport: the ranks this process computes for, and how K/V move to the next rank
class _Simulated:
    """Every rank in this process: a shift moves each rank's tensors to the next rank at once."""

    def __init__(self, world):
        self.world, self.ranks = world, list(range(world))

    def start(self, per_rank):
        return [per_rank[(r - 1) % self.world] for r in range(self.world)]

    @staticmethod
    def finish(pending):
        return pending


class _Distributed:
    """This rank of a process group: a shift sends to rank + 1 and receives from rank - 1."""

    def __init__(self, group):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.ranks = [rank]
        self.next = dist.get_global_rank(group, (rank + 1) % self.world) if group is not None else (rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (rank - 1) % self.world) if group is not None else (rank - 1) % self.world

    def start(self, per_rank):
        sent = [t.contiguous() for t in per_rank[0]]   # kept alive until the sends complete
        received = [torch.empty_like(t) for t in sent]
        requests = [self.dist.isend(t, self.next, group=self.group) for t in sent]
        requests += [self.dist.irecv(t, self.prev, group=self.group) for t in received]
        return requests, received, sent

    @staticmethod
    def finish(pending):
        requests, received, _ = pending
        for request in requests:
            request.wait()
        return [received]


# ------------------------------------------------------------------------------------------------
# The ring
def _wide(x):
    """x in the merge's and the backward's type (gqa_geometry.wide_dtype)."""
    return x.to(gqa_geometry.wide_dtype(x.dtype))


def _merge(acc, out, lse):
    """acc (o [B, n, Hq, D], lse [B, Hq, n], both _wide) merged with one block's (out, lse)."""
    out = _wide(out)
    lse = lse.to(out.dtype)
    if acc is None:
        return out, lse
    return gqa_geometry.combine(torch.stack([acc[0], out]), torch.stack([acc[1], lse]))


def _ring_forward(transport, q, k, v, causal, scale):
    """Per local rank (dim 0): out [B, 2n, Hq, D] in q's dtype and lse [B, Hq, 2n] fp32."""
    world, n = transport.world, q.shape[2] // 2
    kv = [(k[i], v[i]) for i in range(len(transport.ranks))]
    acc = [[None, None] for _ in transport.ranks]
    for step in range(world):
        pending = transport.start(kv) if step < world - 1 else None
        for local, rank in enumerate(transport.ranks):
            owner = (rank - step) % world
            for a, i in enumerate(chunks_of(rank, world)):
                for c, j in enumerate(chunks_of(owner, world)):
                    mode = _block_mode(i, j, causal)
                    if mode is None:
                        continue
                    keys = slice(c * n, (c + 1) * n)
                    out, lse = gqa_module.attention(q[local][:, a * n:(a + 1) * n], kv[local][0][:, keys],
                                                    kv[local][1][:, keys], causal=mode == "causal",
                                                    softmax_scale=scale, return_lse=True)
                    acc[local][a] = _merge(acc[local][a], out, lse)
        if pending is not None:
            kv = transport.finish(pending)
    out = torch.stack([torch.cat([o for o, _ in parts], dim=1) for parts in acc]).to(q.dtype)
    lse = torch.stack([torch.cat([l for _, l in parts], dim=2) for parts in acc])
    return out, lse


def _block_backward(q, k, v, grad, lse, delta, causal, scale):
    """One block's dq, dk, dv (_wide) from the global log-sum-exp and delta = rowsum(dO o)."""
    group = q.shape[2] // k.shape[2]
    qf, gf = _wide(q), _wide(grad)
    kf, vf = (_wide(t).repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -float("inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dp = torch.einsum("bqhd,bkhd->bhqk", gf, vf)
    ds = p * (dp - delta.transpose(1, 2).unsqueeze(-1))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    B, n, Hkv, D = k.shape
    dk = (torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale).view(B, n, Hkv, group, D).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, gf).view(B, n, Hkv, group, D).sum(3)
    return dq, dk, dv


def _ring_backward(transport, q, k, v, out, lse, grad, causal, scale):
    world, n = transport.world, q.shape[2] // 2
    delta = (_wide(grad) * _wide(out)).sum(-1)                            # [R, B, 2n, Hq]
    dq = torch.zeros_like(_wide(q))
    travelling = [(k[i], v[i], torch.zeros_like(_wide(k[i])), torch.zeros_like(_wide(v[i])))
                  for i in range(len(transport.ranks))]
    for step in range(world):
        for local, rank in enumerate(transport.ranks):
            owner = (rank - step) % world
            k_blk, v_blk, dk_acc, dv_acc = travelling[local]
            for a, i in enumerate(chunks_of(rank, world)):
                rows = slice(a * n, (a + 1) * n)
                for c, j in enumerate(chunks_of(owner, world)):
                    mode = _block_mode(i, j, causal)
                    if mode is None:
                        continue
                    keys = slice(c * n, (c + 1) * n)
                    dq_b, dk_b, dv_b = _block_backward(q[local][:, rows], k_blk[:, keys], v_blk[:, keys],
                                                       grad[local][:, rows], lse[local][:, :, rows],
                                                       delta[local][:, rows], mode == "causal", scale)
                    dq[local][:, rows] += dq_b
                    dk_acc[:, keys] += dk_b
                    dv_acc[:, keys] += dv_b
        travelling = transport.finish(transport.start(travelling))          # W shifts: home again
    return dq.to(q.dtype), torch.stack([t[2] for t in travelling]).to(k.dtype), \
        torch.stack([t[3] for t in travelling]).to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, transport, causal, scale):
        out, lse = _ring_forward(transport, q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.transport, ctx.causal, ctx.scale = transport, causal, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.transport, q, k, v, out, lse, grad.contiguous(), ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)


def ring_attention(q, k, v, *, group=None, causal=True, softmax_scale=None):
    """This rank's attention output for its part of the sequence (shard()): q [B, 2n, Hq, D], k and
    v [B, 2n, Hkv, D], every rank of `group` (default: the world) calling with its own part.
    Differentiable; the gradients of this rank's q, k and v."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] % 2:
            raise ValueError("gqa_ring.ring_attention: %s must be this rank's [B, 2n, H, D] (gqa_ring.shard)" % name)
    transport = _Distributed(group)
    return _RingAttention.apply(q[None], k[None], v[None], transport, causal, _scale(q, softmax_scale))[0]


def simulate(q, k, v, world, *, causal=True, softmax_scale=None):
    """The ring's result for the whole sequence (q [B, T, Hq, D], k and v [B, T, Hkv, D]), every
    rank's blocks computed in this process in the ring's order: [B, T, Hq, D], differentiable."""
    parts = [torch.stack([shard(x, r, world) for r in range(world)]) for x in (q, k, v)]
    out = _RingAttention.apply(*parts, _Simulated(world), causal, _scale(q, softmax_scale))
    return unshard(list(out))
