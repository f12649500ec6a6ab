"""Correctness before timing: a float64 reference for the inputs, and one output's relative error."""
import math
import warnings

from .config import FULL_REFERENCE_LIMIT, SLICE_ROWS, TOLERANCE
from .errors import format_error, warning_hints
from .impls import FLOORS


def sliced_reference(q, k, v, rows):
    """float64 causal GQA output for the given query rows only: [B, len(rows), Hq, D]."""
    import torch

    B, _, Hq, D = q.shape
    Hkv = k.shape[2]
    group = Hq // Hkv
    idx = torch.as_tensor(list(rows), device=q.device, dtype=torch.long)
    n_keys = int(max(rows)) + 1
    future = torch.arange(n_keys, device=q.device)[None, :] > idx[:, None]  # [R, K]
    out = torch.empty(B, len(rows), Hq, D, dtype=torch.float64, device=q.device)
    scale = 1.0 / math.sqrt(D)
    for j in range(Hkv):
        heads = slice(j * group, (j + 1) * group)
        qj = q[:, idx, heads, :].to(torch.float64).permute(0, 2, 1, 3)  # [B, g, R, D]
        kj = k[:, :n_keys, j, :].to(torch.float64)  # [B, K, D]
        vj = v[:, :n_keys, j, :].to(torch.float64)
        scores = torch.matmul(qj, kj.transpose(1, 2).unsqueeze(1)) * scale  # [B, g, R, K]
        scores = scores.masked_fill(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, :, heads, :] = torch.matmul(probs, vj.unsqueeze(1)).permute(0, 2, 1, 3)
    return out


def reference_for(reference, q, k, v, shape, log):
    """Return (float64 reference, its query rows or None for all rows).

    Where the T x T float64 scores fit in FULL_REFERENCE_LIMIT, all rows: from reference.py's
    causal_gqa_reference (`reference`, None where it did not import), else from sliced_reference.
    Beyond it, the first and last SLICE_ROWS query rows.
    """
    import torch

    B, T, Hq, _, _ = shape
    if B * Hq * T * T * 8 <= FULL_REFERENCE_LIMIT:
        if reference is not None:
            try:
                return reference.causal_gqa_reference(q, k, v).to(torch.float64), None
            except Exception as e:
                log(f"reference.causal_gqa_reference failed ({format_error(e)}); using the in-file float64 reference")
        return sliced_reference(q, k, v, range(T)), None
    rows = sorted(set(range(min(SLICE_ROWS, T))) | set(range(max(0, T - SLICE_ROWS), T)))
    return sliced_reference(q, k, v, rows), rows


def check(fn, name, dtype_name, args, ref, ref_rows):
    """Run once (also the first warm-up/compile); return (rel_err, error)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn(*args)
            torch.cuda.synchronize()
        except Exception as e:
            return None, format_error(e) + warning_hints(caught)
    if name in FLOORS:  # their outputs are not attention
        del out
        return None, None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(args[0].shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return None, f"wrong: output shape {got}, expected {tuple(args[0].shape)}"
    got = out if ref_rows is None else out[:, ref_rows]
    got = got.to(torch.float64)
    rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
    del out, got
    if not math.isfinite(rel) or rel > TOLERANCE[dtype_name]:
        return (rel if math.isfinite(rel) else None), f"wrong: rel_err={rel:.3e} (tolerance {TOLERANCE[dtype_name]:g})"
    return rel, None
