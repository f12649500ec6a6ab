"""Sequence geometry with FlashAttention's arguments and meanings, and attention over it in PyTorch.

The arguments of `gqa_module.attention` that say which keys each query sees and how scores are
formed, their rules (one copy, here), and the PyTorch implementation that CPU tensors run:

- q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]; query head h reads kv head h // (Hq // Hkv).
- Query i is aligned with key i + Tk - Tq (bottom right, as FlashAttention does when Tq != Tk).
  It sees key j when i + Tk - Tq - left <= j <= i + Tk - Tq + right, for window_size = (left,
  right), where -1 (or None) means unbounded on that side; causal=True sets right to 0. With
  attention_chunk = C > 0 (FlashAttention 3's), only the keys of the chunk [c, c + C) that holds
  key i + Tk - Tq, c a multiple of C (floor division), among those.
- Scores are q . k * softmax_scale (default 1 / sqrt(D)), then softcap * tanh(score / softcap)
  when softcap > 0, then - alibi_slopes[h] * |i + Tk - Tq - j| (FlashAttention 2's ALiBi, slopes
  per query head, or per batch row and query head) where alibi_slopes is given.
- learnable_sink (FlashAttention 4's, gpt-oss's attention sinks: a logit per query head, [Hq])
  joins each row's softmax as one more term that weighs no value: the keys' weights are
  exp(s_j) / (sum of exp(s) + exp(sink)), and the log-sum-exp includes the sink.
- A row that sees no key gives an output of 0 and a log-sum-exp of -inf (FlashAttention-3's rule;
  with a sink, the sink's logit).
- The log-sum-exp is the natural log, laid out [B, Hq, Tq] as FlashAttention's, in float32
  (float64 for float64 inputs).
- Packed sequences (attention_varlen, flash_attn_varlen_func's conventions): q [total_q, Hq, D],
  k and v [total_k, Hkv, D]; sequence b is q rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
  against k and v rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 (only the first seqused_k[b]
  of those where seqused_k is given), every rule above applying within each sequence. Rows of q
  past cu_seqlens_q[-1] belong to no sequence: output 0 and log-sum-exp -inf. The log-sum-exp of
  a packed call is [Hq, total_q].
- v's head_dim may differ from q's and k's (FlashAttention 3's head_dim_v); the output takes v's.
  qv (FlashAttention 3's, [B, Tq, Hq, head_dim_v]) adds qv . v to each score before the scale,
  whose default becomes 1 / sqrt(head_dim + head_dim_v).
- float8 inputs (FlashAttention 3's): q, k and v all float8_e4m3fn (or all float8_e5m2), with
  optional float32 q_descale, k_descale and v_descale [B, Hkv] (None: 1). Each is widened to
  bfloat16 as its descale times its value (q's head h taking kv head h // (Hq // Hkv)'s), the
  attention runs in bfloat16, and the output is bfloat16. For packed sequences B counts the
  sequences; for a KV cache, the batch rows of q.
- A KV cache (attention_with_kvcache, flash_attn_with_kvcache's conventions): batch row b of q
  [B, Tq, Hq, D] attends cache rows cache_leftpad[b] .. cache_seqlens[b] + Tnew - 1 of its cache
  (row c = cache_batch_idx[b], default b, of k_cache [B_cache, Tk_max, Hkv, D], or the pages
  page_table[c] of a pool [pages, page_size, Hkv, D]), after k and v [B, Tnew, Hkv, D] are written
  there in place from position cache_seqlens[b]; every rule above applying to each row's keys.
"""

import collections
import math
import numbers
import operator

import torch
import torch.utils.checkpoint

def wide_dtype(dtype):
    """The type that sums, merges and log-sum-exps run in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def out_dtype(dtype):
    """The output dtype of inputs of `dtype`: bfloat16 for float8 (FlashAttention 3's), else the same."""
    return torch.bfloat16 if dtype in FLOAT8 else dtype


def check_descale(name, d, batch, Hkv, q, entry):
    """A float8 descale's rule: None, or a float32 tensor [batch, Hkv] on q's device."""
    if d is None:
        return
    if not isinstance(d, torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor (float32) or None, got %s" % (entry, name, type(d).__name__))
    if d.dtype != torch.float32 or tuple(d.shape) != (batch, Hkv):
        raise ValueError("%s: %s must be float32 of shape (batch, Hkv) = (%d, %d), got %s of shape %s"
                         % (entry, name, batch, Hkv, d.dtype, tuple(d.shape)))
    if d.device != q.device:
        raise ValueError("%s: %s must be on q's device %s, got %s" % (entry, name, q.device, d.device))


def split_value_dim(k, v):
    """Whether v differs from k only in its head_dim (the last dim: FlashAttention 3's head_dim_v,
    which the PyTorch path takes)."""
    return (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == v.dim() >= 1 and
            k.shape[:-1] == v.shape[:-1] and v.shape[-1] != k.shape[-1] and v.shape[-1] >= 1)


def check_qv(qv, q, v, entry):
    """FlashAttention 3's qv rule: None, or a tensor of q's shape but for its head_dim, which is
    v's, and of q's dtype (float8 inputs take none, as FlashAttention 3's) and device."""
    if qv is None:
        return
    if not isinstance(qv, torch.Tensor):
        raise TypeError("%s: qv must be a torch.Tensor or None, got %s" % (entry, type(qv).__name__))
    if q.dtype in FLOAT8:
        raise ValueError("%s: qv does not take float8 inputs (q is %s)" % (entry, q.dtype))
    want = tuple(q.shape[:-1]) + tuple(v.shape[-1:])
    if tuple(qv.shape) != want or qv.dtype != q.dtype or qv.device != q.device:
        raise ValueError("%s: qv must have q's shape with v's head_dim, %s, and q's dtype and device (%s, %s); got "
                         "%s, %s, %s" % (entry, list(want), q.dtype, q.device, list(qv.shape), qv.dtype, qv.device))


def widen_float8(q, k, v, descales, entry, packed=None):
    """q, k and v as the call computes them: float8 inputs widened to bfloat16 by their descales
    (q_descale, k_descale, v_descale: None or float32 [batch, Hkv] on q's device), other inputs as
    they are. 4-D [B, T, H, D] tensors (batch B), or packed [total, H, D] ones with packed =
    (batch, the batch index of each q row, of each k row; int64 tensors on q's device). A
    ValueError or TypeError names a descale that breaks its rule, a descale given beside inputs
    that are not float8, or inputs that are not all float8; tensors of the wrong rank are returned
    as they are, for the tensor rules to name."""
    names = ("q_descale", "k_descale", "v_descale")
    if not any(isinstance(x, torch.Tensor) and x.dtype in FLOAT8 for x in (q, k, v)):
        for name, d in zip(names, descales):
            if d is not None:
                raise ValueError("%s: %s applies to float8 inputs (float8_e4m3fn or float8_e5m2), got q of dtype %s"
                                 % (entry, name, q.dtype))
        return q, k, v
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError("%s: q, k and v must share one dtype, got q %s, k %s, v %s"
                         % (entry, q.dtype, k.dtype, v.dtype))
    dims = 4 if packed is None else 3
    if q.dim() != dims or k.dim() != dims or v.shape != k.shape or k.shape[-2] < 1 or q.shape[-2] % k.shape[-2]:
        return q, k, v
    batch = q.shape[0] if packed is None else packed[0]
    Hq, Hkv = q.shape[-2], k.shape[-2]
    wide = []
    for i, (x, d, name) in enumerate(zip((q, k, v), descales, names)):
        if d is None:
            wide.append(x.to(torch.bfloat16))
            continue
        check_descale(name, d, batch, Hkv, q, entry)
        per_head = d.repeat_interleave(Hq // Hkv if i == 0 else 1, dim=1)   # [batch, heads of x]
        if packed is None:
            factor = per_head[:, None, :, None]
        else:   # rows of no sequence take row 0's (their outputs are 0 whatever they hold)
            factor = per_head[packed[1 if i == 0 else 2].clamp(0, max(batch - 1, 0))][:, :, None] if batch else 1.0
        wide.append((x.float() * factor).to(torch.bfloat16))
    return tuple(wide)


# chunk: FlashAttention 3's attention_chunk (0: none); alibi: [1 or B, Hq] slopes, or None; sink:
# the learnable sink's [Hq] logits, or None
Geometry = collections.namedtuple("Geometry", "Tq Tk causal left right scale softcap return_lse chunk alibi sink",
                                  defaults=(0, None, None))
Sequence = collections.namedtuple("Sequence", "q0 Tq k0 Tk")   # one sequence of a packed call


def _is_real(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _as_int(x):
    """x as an int where it has __index__ and is no bool (FlashAttention takes a NumPy integer or
    a 0-d integer tensor as an int), else None."""
    try:
        return None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        return None


def _window_side(name, side, x):
    """One side of window_size as an int >= -1 (None: -1, unbounded). Anything with __index__
    serves, as in FlashAttention (a NumPy integer, a 0-d integer tensor from torch.randint)."""
    if x is None:
        return -1
    value = _as_int(x)
    if value is None:
        raise TypeError("attention: window_size[%d] (%s) must be an int or None, got %s"
                        % (side, name, type(x).__name__))
    if value < -1:
        raise ValueError("attention: window_size[%d] (%s) must be -1 or None (unbounded) or >= 0, got %d"
                         % (side, name, value))
    return value


def arguments(q, k, causal, softmax_scale, window_size, softcap, return_lse, attention_chunk=0, alibi_slopes=None,
              learnable_sink=None):
    """The checked geometry of a call on q [B, Tq, Hq, D] and k [B, Tk, Hkv, D] (their shapes are
    the tensor rules' to check): a Geometry, or a TypeError or ValueError naming the argument. A
    chunk that holds every key for every query (Tq <= Tk <= chunk) is none."""
    if not isinstance(causal, bool):
        raise TypeError("attention: causal must be a bool, got %s" % type(causal).__name__)
    if not isinstance(return_lse, bool):
        raise TypeError("attention: return_lse must be a bool, got %s" % type(return_lse).__name__)
    D = q.shape[-1]
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif not _is_real(softmax_scale):
        raise TypeError("attention: softmax_scale must be a float or None (1 / sqrt(head_dim)), got %s"
                        % type(softmax_scale).__name__)
    elif not math.isfinite(softmax_scale):
        raise ValueError("attention: softmax_scale must be finite, got %r" % softmax_scale)
    else:
        scale = float(softmax_scale)
    if not _is_real(softcap):
        raise TypeError("attention: softcap must be a float (0 for none), got %s" % type(softcap).__name__)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError("attention: softcap must be finite and >= 0 (0 for none), got %r" % softcap)
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ValueError("attention: window_size must be a pair (left, right) of ints, -1 or None for "
                         "unbounded, got %r" % (window_size,))
    left = _window_side("left", 0, window_size[0])
    right = _window_side("right", 1, window_size[1])   # checked even where causal sets it to 0
    if causal:
        right = 0
    chunk = _as_int(attention_chunk)
    if chunk is None:
        raise TypeError("attention: attention_chunk must be an int (0 for none), got %s"
                        % type(attention_chunk).__name__)
    if chunk < 0:
        raise ValueError("attention: attention_chunk must be >= 0 (0 for none), got %d" % chunk)
    Tq, Tk = q.shape[1], k.shape[1]
    if Tq <= Tk <= chunk:
        chunk = 0
    alibi = None
    if alibi_slopes is not None:
        alibi_rows(alibi_slopes, q, q.shape[0], q.shape[2])   # the slopes' rules
        alibi = alibi_slopes.reshape(-1, q.shape[2])
    sink = None
    if learnable_sink is not None:
        if not isinstance(learnable_sink, torch.Tensor):
            raise TypeError("attention: learnable_sink must be a torch.Tensor or None, got %s"
                            % type(learnable_sink).__name__)
        if not learnable_sink.is_floating_point() or tuple(learnable_sink.shape) != (q.shape[2],) or \
                learnable_sink.device != q.device:
            raise ValueError("attention: learnable_sink must be a floating tensor of shape (Hq,) = (%d,) on q's "
                             "device %s, got %s of shape %s on %s" % (q.shape[2], q.device, learnable_sink.dtype,
                                                                    tuple(learnable_sink.shape), learnable_sink.device))
        sink = learnable_sink
    return Geometry(Tq, Tk, causal, left, right, scale, float(softcap), return_lse, chunk, alibi, sink)


def alibi_rows(x, q, batch, Hq, entry="attention"):
    """alibi_slopes as FlashAttention 2 takes them, float32 (float64 beside float64 inputs) [Hq]
    or [batch, Hq] on q's device: the slopes of each of the batch's rows ([Hq] each), or None for
    each where x is None."""
    if x is None:
        return [None] * batch
    if not isinstance(x, torch.Tensor):
        raise TypeError("%s: alibi_slopes must be a torch.Tensor (float32) or None, got %s" % (entry, type(x).__name__))
    if x.dtype not in (torch.float32, wide_dtype(q.dtype)) or tuple(x.shape) not in ((Hq,), (batch, Hq)):
        raise ValueError("%s: alibi_slopes must be float32 of shape (Hq,) = (%d,) or (batch, Hq) = (%d, %d), got %s "
                         "of shape %s" % (entry, Hq, batch, Hq, x.dtype, tuple(x.shape)))
    if x.device != q.device:
        raise ValueError("%s: alibi_slopes must be on q's device %s, got %s" % (entry, q.device, x.device))
    return [x if x.dim() == 1 else x[b] for b in range(batch)]


def key_ranges(geo, device=None):
    """The keys each query row sees, as int64 tensors (first, last) of Tq values: query i sees keys
    first[i] .. last[i], none where first[i] > last[i]. The one statement of the mask here."""
    aligned = torch.arange(geo.Tq, device=device) + (geo.Tk - geo.Tq)
    first = (aligned - geo.left).clamp(min=0) if geo.left >= 0 else torch.zeros_like(aligned)
    last = (aligned + geo.right).clamp(max=geo.Tk - 1) if geo.right >= 0 else torch.full_like(aligned, geo.Tk - 1)
    if geo.chunk > 0:   # within the chunk of keys that holds the aligned key (floor division)
        start = aligned - torch.remainder(aligned, geo.chunk)
        first, last = torch.maximum(first, start), torch.minimum(last, start + geo.chunk - 1)
    return first, last


def is_causal_square(geo):
    """Whether the call is causal attention with Tq = Tk: each query t sees keys 0..t, no fewer."""
    return (geo.Tq == geo.Tk and geo.right == 0 and (geo.left < 0 or geo.left >= geo.Tk - 1) and geo.chunk == 0
            and geo.alibi is None)


def _scores(geo, q, k, slopes, rows, keys):
    """q [..., rows, D] against k [..., keys, D] (query rows `rows` and keys `keys`, int64
    positions) as the call forms them: scale, then softcap, then ALiBi (slopes [..., 1, 1]
    broadcasting against the scores' leading dims, or None)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * geo.scale
    if geo.softcap > 0:
        s = geo.softcap * torch.tanh(s / geo.softcap)
    if slopes is not None:   # slopes times |aligned row - key|
        distance = ((rows + geo.Tk - geo.Tq).view(-1, 1) - keys.view(1, -1)).abs().to(s.dtype)
        s = s - slopes.to(s.dtype)[..., None, None] * distance
    return s


def _kv_head_slopes(geo, Hkv):
    """The ALiBi slopes as [1 or B, Hkv, group], or None."""
    return None if geo.alibi is None else geo.alibi.view(geo.alibi.shape[0], Hkv, -1)


def attention_torch(q, k, v, geo):
    """(out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq]) through PyTorch, differentiable (the
    log-sum-exp too), computed in float32 (float64 for float64 inputs) one kv head at a time.

    Where q, k or v holds Inf or NaN, each query row takes only the keys it sees (a masked key's
    zero weight would otherwise multiply its Inf or NaN into every row), row by row."""
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    acc = wide_dtype(q.dtype)
    # [B, Hkv, group, Tq, D] and [B, Hkv, Tk, D] in the accumulation type
    qa = q.to(acc).reshape(B, Tq, Hkv, group, D).permute(0, 2, 3, 1, 4)
    ka, va = k.to(acc).permute(0, 2, 1, 3), v.to(acc).permute(0, 2, 1, 3)
    finite = Tq == 0 or all(bool(torch.isfinite(t).all()) for t in (q, k, v))
    out, lse = (_dense if finite else _row_by_row)(geo, qa, ka, va)
    if geo.sink is not None:   # the sink joins each row's normaliser: the keys' weights shrink by exp(lse - total)
        total = torch.logaddexp(lse, geo.sink.to(acc).view(1, Hkv, group, 1))
        out = out * torch.exp(lse - total).unsqueeze(-1)
        lse = total
    out = out.permute(0, 3, 1, 2, 4).reshape(B, Tq, Hq, v.shape[3]).to(q.dtype)
    return out, lse.reshape(B, Hq, Tq)


# Query rows a block of the PyTorch path holds: a kv head's float32 scores for the block stay within
# this many elements, and with gradients each block is recomputed in the backward
# (torch.utils.checkpoint), so memory grows with Tk, not Tq x Tk.
_BLOCK_SCORES = 1 << 26


def _dense(geo, qa, ka, va):
    """Every score of a kv head at once, masked, a block of query rows at a time (one block where
    the scores fit _BLOCK_SCORES)."""
    B, _, group, Tq, _ = qa.shape
    rows = max(1, _BLOCK_SCORES // max(1, B * group * geo.Tk))
    if rows >= Tq:
        return _dense_rows(geo, qa, ka, va, 0, Tq)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (qa, ka, va))
    parts = []
    for first in range(0, Tq, rows):
        span = (geo, qa, ka, va, first, min(Tq, first + rows))
        parts.append(torch.utils.checkpoint.checkpoint(_dense_rows, *span, use_reentrant=False) if recompute
                     else _dense_rows(*span))
    return torch.cat([o for o, _ in parts], dim=3), torch.cat([l for _, l in parts], dim=3)


def _dense_rows(geo, qa, ka, va, first, end):
    """_dense's query rows first .. end - 1: (out [B, Hkv, group, rows, D], lse [B, Hkv, group, rows])."""
    starts, lasts = (x[first:end] for x in key_ranges(geo, qa.device))
    keys = torch.arange(geo.Tk, device=qa.device)
    sees = (keys.view(1, -1) >= starts.view(-1, 1)) & (keys.view(1, -1) <= lasts.view(-1, 1))
    blind = ~sees.any(dim=-1, keepdim=True)   # rows that see no key
    outs, lses = [], []
    rows = torch.arange(first, end, device=qa.device)
    slopes = _kv_head_slopes(geo, qa.shape[1])
    for h in range(qa.shape[1]):
        s = _scores(geo, qa[:, h, :, first:end], ka[:, h].unsqueeze(1), None if slopes is None else slopes[:, h],
                    rows, keys)
        s = s.masked_fill(~sees, -math.inf)
        # A blind row's scores become zeros (a finite stand-in: no -inf - -inf, whose NaN would
        # reach the gradients); its weights and log-sum-exp are set below.
        s = s.masked_fill(blind, 0.0)
        row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - row_lse).masked_fill(blind, 0.0)
        outs.append(torch.matmul(p, va[:, h].unsqueeze(1)))
        lses.append(row_lse.squeeze(-1).masked_fill(blind.squeeze(-1), -math.inf))
    return torch.stack(outs, dim=1), torch.stack(lses, dim=1)


def _row_by_row(geo, qa, ka, va):
    """Each query row over the keys it sees alone."""
    B, Hkv, group, Tq, _ = qa.shape
    slopes = _kv_head_slopes(geo, Hkv)
    outs, lses = [], []
    for i, (first, last) in enumerate(zip(*(r.tolist() for r in key_ranges(geo)))):
        if first > last:
            outs.append(qa.new_zeros(B, Hkv, group, va.shape[-1]))
            lses.append(qa.new_full((B, Hkv, group), -math.inf))
            continue
        row, keys = torch.tensor([i], device=qa.device), torch.arange(first, last + 1, device=qa.device)
        s = _scores(geo, qa[:, :, :, i:i + 1], ka[:, :, first:last + 1].unsqueeze(2), slopes, row, keys)[..., 0, :]
        # torch.softmax's weights: a row with a score of +inf has NaN weights at every key (SDPA's
        # and FlashAttention's references); its log-sum-exp is torch.logsumexp's +inf
        outs.append(torch.matmul(torch.softmax(s, dim=-1), va[:, :, first:last + 1]))
        lses.append(torch.logsumexp(s, dim=-1))
    return torch.stack(outs, dim=3), torch.stack(lses, dim=3)


def takes_causal_kernels(geo, D):
    """Whether a CUDA call is causal attention with Tq = Tk, the default scale (within float32
    rounding) and no log-sum-exp output: the tensor-core kernels of causal_gqa_attention."""
    default = 1.0 / math.sqrt(D)
    return (not geo.return_lse and geo.softcap == 0 and is_causal_square(geo)
            and abs(geo.scale - default) <= default * 2.0 ** -24)


def cuda_gap(geo, D):
    """What the call asks for that no CUDA kernel of this version computes, in words, or None (the
    row-wise kernels take every geometry and scale, and the log-sum-exp): attention() runs such a
    call on the GPU through attention_torch."""
    if geo.softcap > 0:
        return "softcap=%r" % geo.softcap
    if geo.chunk > 0:
        return "attention_chunk=%d" % geo.chunk
    if geo.alibi is not None:
        return "alibi_slopes"
    if geo.sink is not None:
        return "learnable_sink"
    return None


# ------------------------------------------------------------------------------------------------
# Packed sequences
def _seqlens(name, x, q, count=None, entry="attention_varlen"):
    """cu_seqlens_q, cu_seqlens_k, seqused_k (or a KV cache's per-row ints) as a list of ints,
    checked as FlashAttention takes them: a 1-D int32 tensor on q's device (of `count` values
    where given)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError("%s: %s must be a torch.Tensor (int32), got %s" % (entry, name, type(x).__name__))
    if x.dtype != torch.int32 or x.dim() != 1:
        raise ValueError("%s: %s must be a 1-D int32 tensor, got %s of shape %s" % (entry, name, x.dtype, tuple(x.shape)))
    if x.device != q.device:
        raise ValueError("%s: %s must be on q's device %s, got %s" % (entry, name, q.device, x.device))
    if count is not None and x.numel() != count:
        raise ValueError("%s: %s must have %d values (one per sequence), got %d" % (entry, name, count, x.numel()))
    return x.tolist()


def offsets(name, x, q, total, tensor_name, entry="attention_varlen"):
    """The checked offsets of one side of a packed call (a 1-D int32 tensor on q's device, as
    _seqlens), as ints: 0 first, never decreasing, the last at most the rows of `tensor_name`."""
    values = _seqlens(name, x, q, entry=entry)
    if not values or values[0] != 0:
        raise ValueError("%s: %s must start with 0 (it has batch + 1 values), got %s" % (entry, name, values[:4]))
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError("%s: %s must not decrease, got %d then %d at %d"
                             % (entry, name, values[b], values[b + 1], b))
    if values[-1] > total:
        raise ValueError("%s: %s ends at %d, past the %d rows of %s" % (entry, name, values[-1], total, tensor_name))
    return values


def varlen_sequences(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=None, seqused_q=None):
    """The sequences of a packed call (q [total_q, Hq, D], k [total_k, Hkv, D]) as Sequence
    tuples, or a TypeError or ValueError naming the argument and its rule. max_seqlen_q and
    max_seqlen_k must be at least the longest sequence (FlashAttention sizes its grid by them; a
    smaller one would leave rows unwritten there); seqused_q and seqused_k, where given, shorten
    each sequence to its first queries and keys."""
    starts_q = offsets("cu_seqlens_q", cu_seqlens_q, q, q.shape[0], "q")
    starts_k = offsets("cu_seqlens_k", cu_seqlens_k, q, k.shape[0], "k")
    if len(starts_q) != len(starts_k):
        raise ValueError("attention_varlen: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         "got %d and %d" % (len(starts_q), len(starts_k)))
    batch = len(starts_q) - 1
    lens_q = [starts_q[b + 1] - starts_q[b] for b in range(batch)]
    lens_k = [starts_k[b + 1] - starts_k[b] for b in range(batch)]
    def used(name, x, lens, side):
        if x is None:
            return lens
        values = _seqlens(name, x, q, batch)
        for b in range(batch):
            if not 0 <= values[b] <= lens[b]:
                raise ValueError("attention_varlen: %s[%d] must be in 0 .. %d (that sequence's %s in cu_seqlens_%s), "
                                 "got %d" % (name, b, lens[b], "queries" if side == "q" else "keys", side, values[b]))
        return values
    lens_q, lens_k = used("seqused_q", seqused_q, lens_q, "q"), used("seqused_k", seqused_k, lens_k, "k")
    longest("max_seqlen_q", max_seqlen_q, lens_q)
    longest("max_seqlen_k", max_seqlen_k, lens_k)
    return [Sequence(starts_q[b], lens_q[b], starts_k[b], lens_k[b]) for b in range(batch)]


def rows_batch(seqs, q, k):
    """widen_float8's `packed` for a packed call: (batch, the sequence of each q row, of each k
    row) as int64 tensors on q's device (a row between sequences counts as the next one's); the
    row indices only where q is float8."""
    if q.dtype not in FLOAT8:
        return len(seqs), None, None
    def owners(starts, total):
        bounds = torch.tensor(starts[1:], dtype=torch.int64, device=q.device)
        return torch.bucketize(torch.arange(total, device=q.device), bounds, right=True)
    return len(seqs), owners([s.q0 for s in seqs], q.shape[0]), owners([s.k0 for s in seqs], k.shape[0])


def longest(name, given, lens, entry="attention_varlen"):
    """max_seqlen_q or max_seqlen_k checked: an int, at least the longest of `lens`."""
    value = _as_int(given)
    if value is None:
        raise TypeError("%s: %s must be an int, got %s" % (entry, name, type(given).__name__))
    if value < max(lens, default=0):
        raise ValueError("%s: %s (%d) must be at least the longest sequence (%d)"
                         % (entry, name, value, max(lens, default=0)))


def per_sequence(run, q, k, v, seqs, return_lse):
    """A packed call assembled from one call per sequence: run(b, q_b, k_b, v_b) on sequence b's
    [1, T, H, D] slices gives (out [1, Tq, Hq, D], lse [1, Hq, Tq] or None); -> out [total_q, Hq,
    Dv], and lse [Hq, total_q] with return_lse. Rows past the last sequence: output 0, log-sum-exp
    -inf; so are the rows of a sequence past its Tq (seqused_q). Differentiable where run is."""
    total_q, Hq, Dv = q.shape[0], q.shape[1], v.shape[2]
    lse_dtype = wide_dtype(q.dtype)
    outs, lses, row = [], [], 0
    def gap(rows):   # rows of no sequence
        outs.append(q.new_zeros(rows, Hq, Dv))
        lses.append(torch.full((Hq, rows), -math.inf, dtype=lse_dtype, device=q.device))
    for b, seq in enumerate(seqs):   # cu_seqlens_q's sequences lie one after another from row 0
        if seq.Tq == 0:
            continue
        if seq.q0 > row:   # the unused rows of the sequences before
            gap(seq.q0 - row)
        keys = slice(seq.k0, seq.k0 + seq.Tk)
        out, lse = run(b, q[seq.q0:seq.q0 + seq.Tq].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0))
        outs.append(out[0])
        lses.append(lse[0] if lse is not None else None)
        row = seq.q0 + seq.Tq
    if row < total_q or not outs:
        gap(total_q - row)
    out = torch.cat(outs, dim=0)
    return (out, torch.cat(lses, dim=1)) if return_lse else out


# ------------------------------------------------------------------------------------------------
# KV caches
def row_ints(name, x, q, batch, default):
    """cache_seqlens, cache_batch_idx or cache_leftpad as a list of `batch` ints: `default` for
    None, an int for every row, or a 1-D int32 tensor on q's device."""
    if x is None:
        return [default] * batch
    if isinstance(x, int) and not isinstance(x, bool) and name == "cache_seqlens":
        return [x] * batch
    if not isinstance(x, torch.Tensor):
        raise TypeError("attention_with_kvcache: %s must be a torch.Tensor (int32)%s, got %s"
                        % (name, " or an int" if name == "cache_seqlens" else "", type(x).__name__))
    return _seqlens(name, x, q, batch, "attention_with_kvcache")


def kvcache_rows(q, k_cache, t_new, cache_seqlens, cache_batch_idx, cache_leftpad, page_table):
    """Where each batch row's keys lie in a KV cache, row b bringing t_new[b] new keys: a list of
    (cache index or page list, first key, end of the keys, where the new keys go), checked, or a
    TypeError or ValueError naming the argument and its rule. Batch row b reads cache row
    cache_batch_idx[b] (default b): of k_cache, or of page_table, whose row lists the pages
    (FlashAttention 3's meaning with pages). Tk_max is k_cache's rows, or page_table's pages times
    the page size."""
    B = len(t_new)
    index = row_ints("cache_batch_idx", cache_batch_idx, q, B, None)
    if page_table is not None:
        if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2:
            got = ("%s of shape %s" % (page_table.dtype, tuple(page_table.shape)) if isinstance(page_table, torch.Tensor)
                   else type(page_table).__name__)
            raise ValueError("attention_with_kvcache: page_table must be a 2-D int32 tensor [cache rows, pages], got %s"
                             % got)
        if page_table.device != q.device:
            raise ValueError("attention_with_kvcache: page_table must be on q's device %s, got %s"
                             % (q.device, page_table.device))
        table = page_table.tolist()
        for r, row in enumerate(table):
            for page in row:
                if not 0 <= page < k_cache.shape[0]:
                    raise ValueError("attention_with_kvcache: page_table[%d] holds page %d, outside the %d pages "
                                     "of k_cache" % (r, page, k_cache.shape[0]))
        tk_max, cache_rows = page_table.shape[1] * k_cache.shape[1], page_table.shape[0]
    else:
        tk_max, cache_rows = k_cache.shape[1], k_cache.shape[0]
    seqlens = row_ints("cache_seqlens", cache_seqlens, q, B, tk_max)
    leftpad = row_ints("cache_leftpad", cache_leftpad, q, B, 0)
    rows = []
    for b in range(B):
        if not 0 <= seqlens[b] <= tk_max - t_new[b]:
            raise ValueError("attention_with_kvcache: cache_seqlens[%d] must be in 0 .. %d (the cache's %d rows less "
                             "the %d new keys), got %d" % (b, tk_max - t_new[b], tk_max, t_new[b], seqlens[b]))
        if not 0 <= leftpad[b] <= seqlens[b]:
            raise ValueError("attention_with_kvcache: cache_leftpad[%d] must be in 0 .. cache_seqlens[%d] (%d), got %d"
                             % (b, b, seqlens[b], leftpad[b]))
        row = b if index[b] is None else index[b]
        if not 0 <= row < cache_rows:
            raise ValueError("attention_with_kvcache: %s (%d) must index the %d rows of %s"
                             % ("cache_batch_idx[%d]" % b if index[b] is not None else "batch row %d" % b, row,
                                cache_rows, "page_table" if page_table is not None else "k_cache"))
        rows.append((table[row] if page_table is not None else row, leftpad[b], seqlens[b] + t_new[b], seqlens[b]))
    return rows


def _cache_rows(cache, where, first, end):
    """The index of rows first .. end - 1 of one batch row's cache: of a contiguous cache's row
    `where`, or through the pages `where` of a pool [pages, page_size, Hkv, D]."""
    if isinstance(where, int):
        return where, slice(first, end)
    positions = torch.arange(first, end, device=cache.device)
    size = cache.shape[1]
    return torch.tensor(where, dtype=torch.long, device=cache.device)[positions // size], positions % size


def cache_keys(cache, where, first, end):
    """Rows first .. end - 1 of one batch row's cache (a view where the cache is contiguous)."""
    return cache[_cache_rows(cache, where, first, end)]


def write_cache(cache, where, start, new):
    """new [Tnew, Hkv, D] into one batch row's cache from position `start`, in place."""
    cache[_cache_rows(cache, where, start, start + new.shape[0])] = new


def rotary(q, k, rotary_cos, rotary_sin, interleaved, start, causal, window, tk_max, first_row=0):
    """One batch row's q [1, Tq, Hq, D] and new keys k [1, Tnew, Hkv, D] with
    flash_attn_with_kvcache's rotary embedding, or a TypeError or ValueError naming the argument:
    the first rotary_dim = 2 rotary_cos.shape[1] channels of each row turned by the angles of row p
    of rotary_cos and rotary_sin ([rows, rotary_dim / 2]), pairing channels (2i, 2i + 1) where
    interleaved and (i, i + rotary_dim / 2) otherwise (GPT-NeoX's). Key s takes p = start + s
    (start: rotary_seqlens' value for the row, or where its keys go in the cache); query s takes
    start + s too where the call is causal or local (a window side in 0 .. tk_max - 1), else start.
    Computed in wide_dtype, returned in the inputs' dtypes. Messages name the row first_row."""
    entry = "attention_with_kvcache"
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("%s: rotary_cos and rotary_sin must be given together" % entry)
    if rotary_cos is None:
        return q, k
    if k is None:
        raise ValueError("%s: rotary_cos and rotary_sin need the new keys k and v (they turn q and k as k is "
                         "written)" % entry)
    if not isinstance(interleaved, bool):
        raise TypeError("%s: rotary_interleaved must be a bool, got %s" % (entry, type(interleaved).__name__))
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(x, torch.Tensor):
            raise TypeError("%s: %s must be a torch.Tensor, got %s" % (entry, name, type(x).__name__))
        if x.dim() != 2 or x.shape != rotary_cos.shape or not x.is_floating_point() or x.device != q.device:
            raise ValueError("%s: %s must be a 2-D float tensor [rows, rotary_dim / 2] on q's device %s, of "
                             "rotary_cos's shape, got %s of shape %s on %s"
                             % (entry, name, q.device, x.dtype, tuple(x.shape), x.device))
    half, D = rotary_cos.shape[1], q.shape[3]
    if not 1 <= 2 * half <= D:
        raise ValueError("%s: rotary_dim (twice rotary_cos.shape[1], %d) must be in 2 .. head_dim (%d)"
                         % (entry, 2 * half, D))
    per_query = causal or any(0 <= side < tk_max for side in window)
    Tq, Tnew = q.shape[1], k.shape[1]
    reach = start + max(Tnew, Tq if per_query else 1)   # one past the last row of the angles used
    if start < 0 or reach > rotary_cos.shape[0]:
        raise ValueError("%s: batch row %d turns by rows %d .. %d of rotary_cos and rotary_sin, which have %d"
                         % (entry, first_row, start, reach - 1, rotary_cos.shape[0]))
    rows_q = (start + torch.arange(Tq, device=q.device) * per_query)[None]
    rows_k = (start + torch.arange(Tnew, device=q.device))[None]
    return _turn(q, rotary_cos, rotary_sin, rows_q, interleaved), _turn(k, rotary_cos, rotary_sin, rows_k, interleaved)


def _turn(x, cos, sin, rows, interleaved):
    """x [B, T, H, D] turned by the angles of rows [B, T] (see rotary)."""
    wide = wide_dtype(x.dtype)
    c, s = (t.to(wide)[rows].unsqueeze(2) for t in (cos, sin))   # [B, T, 1, rotary_dim / 2]
    width = 2 * cos.shape[1]
    part = x[..., :width].to(wide)
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = part[..., :width // 2], part[..., width // 2:]
        turned = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., width:]), dim=-1)


# ------------------------------------------------------------------------------------------------
# Partial results
def combine(outs, lses, out_dtype=None):
    """Attention over the union of disjoint key sets from its parts: outs [S, B, T, H, D] and lses
    [S, B, H, T] (each part's output and natural-log log-sum-exp, attention()'s layouts) -> (out
    [B, T, H, D] in out_dtype, default outs', lse [B, H, T]). lse = logsumexp over the parts; out =
    sum of exp(lse_s - lse) out_s, in float32 (float64 for float64 parts); a row no part saw
    (every lse -inf) gives 0 and -inf."""
    if not isinstance(outs, torch.Tensor) or not isinstance(lses, torch.Tensor) or outs.dim() != 5 \
            or lses.shape != (outs.shape[0], outs.shape[1], outs.shape[3], outs.shape[2]):
        raise ValueError("combine: outs must be [S, B, T, H, D] and lses [S, B, H, T], got %s and %s"
                         % (tuple(getattr(outs, "shape", ())), tuple(getattr(lses, "shape", ()))))
    wide = wide_dtype(outs.dtype)
    lses = lses.to(wide)
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - lse)
    weights = torch.where(torch.isneginf(lse), torch.zeros_like(weights), weights)   # no part saw the row
    out = (weights.transpose(2, 3).unsqueeze(-1) * outs.to(wide)).sum(dim=0)
    return out.to(out_dtype or outs.dtype), lse
