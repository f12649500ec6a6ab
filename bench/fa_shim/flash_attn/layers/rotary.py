"""FlashAttention's apply_rotary_emb, which its tests use to build the KV-cache references: written
here from its documented meaning (not from gqa_geometry.rotary, which the tests check against it).
x [B, T, H, D]; cos and sin [rows, rotary_dim / 2]; row seqlen_offsets (+ b's offset) + t turns
time t; channels paired (2i, 2i + 1) where interleaved, else (i, i + rotary_dim / 2); in fp32."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    if cu_seqlens is not None:
        raise NotImplementedError("the stand-in's apply_rotary_emb takes [B, T, H, D] inputs only")
    B, T = x.shape[:2]
    width = 2 * cos.shape[1]
    offsets = seqlen_offsets if isinstance(seqlen_offsets, torch.Tensor) else torch.full((B,), int(seqlen_offsets))
    rows = offsets.to(x.device).long().view(B, 1) + torch.arange(T, device=x.device)
    c, s = cos.float()[rows], sin.float()[rows]                      # [B, T, rotary_dim / 2]
    if interleaved:   # each angle serves two neighbouring channels
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
    else:             # each angle serves channel i and channel i + rotary_dim / 2
        c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    part = x[..., :width].float()
    if interleaved:   # the partner of (a, b) is (-b, a)
        partner = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    else:
        partner = torch.cat((-part[..., width // 2:], part[..., :width // 2]), dim=-1)
    out = torch.cat(((part * c.unsqueeze(2) + partner * s.unsqueeze(2)).to(x.dtype), x[..., width:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
