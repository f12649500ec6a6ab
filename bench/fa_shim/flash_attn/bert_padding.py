"""Padding helpers with FlashAttention's signatures, for the varlen tests' set-up."""
import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(tokens of the rows attention_mask keeps, their flat indices, cu_seqlens, max_seqlen, used
    lengths), with `unused_mask`'s tokens kept too but not counted as used."""
    keep = attention_mask if unused_mask is None else attention_mask | unused_mask
    lengths = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    tokens = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return tokens, indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0, used


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse: tokens back to [batch, seqlen, ...], zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
