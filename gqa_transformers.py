"""The library as a Hugging Face transformers attention implementation.

    import gqa_transformers
    gqa_transformers.register()                      # once per process; returns the name, "gqa_causal"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="gqa_causal")

`register` adds an attention function and its mask function under one name (transformers'
`AttentionInterface` and `AttentionMaskInterface`). The mask function is transformers' own SDPA
mask, which comes out as None exactly where the causal mask alone is the mask; the attention
function then runs `gqa_module.attention` (causal aligned bottom-right, so a step of generation
over a dynamic cache is served too), with the module's scaling, soft cap and attention sinks
(gpt-oss's s_aux, as learnable_sink). Where transformers built a mask, the function serves it only
after checking it element by element against one it can run: each batch row causal over its own
span of keys (left padding before them, a static cache's unfilled slots after them, a sliding
window or Llama 4's attention chunks inside), run row by row through `gqa_module.attention`; or
sequences packed into one row by position_ids (transformers' padding-free collator), run through
`gqa_module.attention_varlen`, as are the cu_seq_lens offsets that collator passes with
return_flash_attn_kwargs (with no mask, or the same packing's). Any other mask or dropout is never
served silently: by default it raises a ValueError naming what the library does not support; with
`fallback="sdpa"` that call runs transformers' SDPA attention instead, and the first call of each
kind says so on stderr. The checks read the mask on the host, so under torch.compile a masked call
takes the fallback (or a graph break).
"""

import sys

import torch

import gqa_module

NAME = "gqa_causal"
_FALLBACK = {}   # registered name -> None or "sdpa"
_SAID = set()


def _unsupported(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs):
    """What of this call the library does not compute, in words ([] when it serves the call)."""
    Tq, Tk = query.shape[2], key.shape[2]
    reasons = []
    if attention_mask is not None:
        reasons.append("an attention mask beyond the causal one (padding, packed sequences, a static cache's "
                       "unfilled slots or a custom mask)")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        reasons.append("packed sequences (cu_seq_lens)")
    if sliding_window is not None and Tk > sliding_window:
        reasons.append("a sliding window (%d) shorter than the keys (%d)" % (sliding_window, Tk))
    if Tq > Tk:
        reasons.append("more queries (%d) than keys (%d)" % (Tq, Tk))
    if dropout:
        reasons.append("attention dropout (%g)" % dropout)
    if kwargs.get("output_attentions"):
        reasons.append("output_attentions")
    if kwargs.get("position_bias") is not None:
        reasons.append("a score bias")
    if query.shape[-1] != key.shape[-1]:   # (value's may differ: the library takes head_dim_v)
        reasons.append("different query and key head dims")
    return reasons


def _packed_offsets(query, key, attention_mask, kwargs, left):
    """int32 offsets of the sequences packed into one row (position_ids restarting, as
    transformers' padding-free collator gives them), where the call's mask is exactly theirs
    (causal within each sequence, within `left` keys before each query where left is not None,
    nothing across), compared element by element; else None."""
    position_ids = kwargs.get("position_ids")
    T = query.shape[2]
    if (attention_mask is None or position_ids is None or attention_mask.dtype != torch.bool or query.shape[0] != 1
            or key.shape[2] != T or tuple(position_ids.shape) != (1, T) or attention_mask.shape[-2:] != (T, T)):
        return None
    starts = torch.ones(T, dtype=torch.bool, device=query.device)
    starts[1:] = position_ids[0, 1:] != position_ids[0, :-1] + 1
    sequence = torch.cumsum(starts, 0)
    rows = torch.arange(T, device=query.device)
    expected = (sequence[:, None] == sequence[None, :]) & (rows[None, :] <= rows[:, None])
    if left is not None:
        expected &= rows[None, :] >= rows[:, None] - left
    if not bool((attention_mask.reshape(-1, T, T) == expected).all()):
        return None
    ends = torch.nonzero(starts).flatten()[1:]
    return torch.cat([torch.zeros(1, device=query.device), ends, torch.full((1,), T, device=query.device)]).to(torch.int32)


def _row_spans(query, key, attention_mask, left, chunk=None):
    """(first, end) per batch row where each row's mask is the causal one over its keys first ..
    end - 1, aligned bottom-right (left padding before them, a static cache's unfilled slots after
    them), within `left` keys before each query where left is not None (a sliding window), and
    within the query's chunk of `chunk` keys counted from `first` where chunk is not None (Llama
    4's chunked attention), compared element by element; else None. Query rows that see no key
    (padding) must see none in the mask either."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4 \
            or attention_mask.shape[1] != 1:
        return None
    B, Tq, Tk = query.shape[0], query.shape[2], key.shape[2]
    if tuple(attention_mask.shape) != (B, 1, Tq, Tk):
        return None
    mask = attention_mask[:, 0]
    union = mask.any(dim=1).to(torch.int32)                 # [B, Tk]: the keys some query sees
    seen = union.any(dim=-1)
    first = torch.where(seen, union.argmax(dim=-1), 0)
    end = torch.where(seen, Tk - union.flip(-1).argmax(dim=-1), 0)
    j = torch.arange(Tk, device=mask.device).view(1, 1, Tk)
    i = torch.arange(Tq, device=mask.device).view(1, Tq, 1)
    aligned = i + (end - Tq).view(B, 1, 1)                   # the key each query is aligned with
    expected = (j >= first.view(B, 1, 1)) & (j <= aligned)
    if left is not None:
        expected &= j >= aligned - left
    if chunk is not None:
        start = first.view(B, 1, 1)
        expected &= torch.div(j - start, chunk, rounding_mode="floor") == \
            torch.div(aligned - start, chunk, rounding_mode="floor")
    if not bool((mask == expected).all()):
        return None
    return list(zip(first.tolist(), end.tolist()))


def _given_offsets(query, attention_mask, kwargs, packed):
    """The cu_seq_lens_q offsets a padding-free collator passed (return_flash_attn_kwargs), where
    they name sequences packed into one row, equal for queries and keys, and agree with the mask
    (none, or the packed one that position_ids gave); else None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if not (isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)) or query.shape[0] != 1:
        return None
    cu_q, cu_k = cu_q.to(query.device, torch.int32), cu_k.to(query.device, torch.int32)
    if not torch.equal(cu_q, cu_k) or int(cu_q[-1]) != query.shape[2]:
        return None
    if attention_mask is not None and (packed is None or not torch.equal(packed, cu_q)):
        return None
    return cu_q


def _attention(name):
    """The attention function registered under `name` (see the module's docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
        # query [B, Hq, Tq, D], key and value [B, Hkv, Tk, D]; the output is [B, Tq, Hq, D].
        causal = getattr(module, "is_causal", True) and kwargs.get("is_causal") is not False
        left = sliding_window - 1 if sliding_window is not None else None   # transformers': q - k < window
        packed = _packed_offsets(query, key, attention_mask, kwargs, left) if causal else None
        given = _given_offsets(query, attention_mask, kwargs, packed) if causal and key.shape[2] == query.shape[2] else None
        if given is not None:
            packed = given
            kwargs = {word: item for word, item in kwargs.items() if not word.startswith("cu_seq_lens")}
        spans = _row_spans(query, key, attention_mask, left) if causal and packed is None else None
        chunk = getattr(getattr(module, "config", None), "attention_chunk_size", None)
        if spans is None and causal and packed is None and isinstance(chunk, int) and chunk > 0:
            spans = _row_spans(query, key, attention_mask, left, chunk)   # Llama 4's chunked layers
        else:
            chunk = None
        verified = packed is not None or spans is not None
        reasons = _unsupported(module, query, key, value, None if verified else attention_mask, dropout, scaling,
                               None if verified else sliding_window, softcap, kwargs)
        if not reasons:
            q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            options = dict(softmax_scale=scaling, softcap=softcap or 0.0, learnable_sink=kwargs.get("s_aux"))
            window = (-1 if left is None else left, 0)
            if packed is not None:   # causal within each packed sequence
                longest = int((packed[1:] - packed[:-1]).max())
                return gqa_module.attention_varlen(q[0], k[0], v[0], packed, packed, longest, longest, causal=True,
                                                   window_size=window, **options)[None], None
            if spans is not None:    # each row causal over its own keys; padding rows see none (0)
                return torch.cat([gqa_module.attention(q[b:b + 1], k[b:b + 1, first:end], v[b:b + 1, first:end],
                                                       causal=True, window_size=window, attention_chunk=chunk or 0,
                                                       **options)
                                  for b, (first, end) in enumerate(spans)]), None
            # no mask: causal (aligned bottom-right) over every key, or none
            return gqa_module.attention(q, k, v, causal=causal, **options), None
        if _FALLBACK.get(name) != "sdpa":
            raise ValueError("gqa_transformers (%s): the library does not support %s. Register with "
                             "fallback=\"sdpa\" to run such calls through transformers' SDPA attention, or use "
                             "attn_implementation=\"sdpa\"." % (name, "; ".join(reasons)))
        said = "gqa_transformers (%s): %s: this call runs transformers' SDPA attention" % (name, "; ".join(reasons))
        if said not in _SAID:
            _SAID.add(said)
            print(said, file=sys.stderr, flush=True)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)

    return attention


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          local_size=None, allow_is_causal_skip=True, **kwargs):
    """The mask function registered beside the attention: None (the causal mask alone) where the
    arguments show that the mask is the causal one, also while torch.compile traces the model (where
    transformers' SDPA mask always builds a tensor); transformers' SDPA mask otherwise, which is
    None where its own checks of the padding find the causal mask alone."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    causal = mask_function is None or mask_function is causal_mask_function or (local_size is not None and kv_length < local_size)
    # No padding, and the queries are the last q_length of the keys (a dynamic cache's chunk, or no
    # cache): the causal mask aligned bottom-right, the library's causal=True
    no_padding = attention_mask is None or (attention_mask.dtype in (torch.bool, torch.int64, torch.int32)
                                            and not torch.compiler.is_compiling() and bool(attention_mask.all()))
    if (causal and allow_is_causal_skip and no_padding and isinstance(q_offset, int) and kv_offset == 0
            and q_offset + q_length == kv_length):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def register(name=NAME, fallback=None):
    """Register the library with transformers under `name` (attention and mask function); returns
    the name. fallback: None (calls the library does not serve raise a ValueError naming what they
    need) or "sdpa" (they run transformers' SDPA attention, saying so once per kind of call)."""
    if fallback not in (None, "sdpa"):
        raise ValueError("gqa_transformers.register: fallback must be None or \"sdpa\", got %r" % (fallback,))
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _FALLBACK[name] = fallback
    AttentionInterface.register(name, _attention(name))
    AttentionMaskInterface.register(name, _mask)
    return name
