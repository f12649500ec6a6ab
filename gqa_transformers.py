"""The library as a Hugging Face transformers attention implementation.

    import gqa_transformers
    gqa_transformers.register()                      # once per process; returns the name, "gqa_causal"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="gqa_causal")

`register` adds an attention function and its mask function under one name (transformers'
`AttentionInterface` and `AttentionMaskInterface`). The attention function runs
`gqa_module.attention` wherever the mask is the causal one (aligned bottom-right, so a step of
generation over a KV cache with no padding is served too), with the module's scaling and soft cap,
and non-causal modules. The mask function is transformers' own SDPA mask, which comes out as None
exactly where the causal mask alone is the mask; a batch with padding, packed sequences
(position_ids that restart, or cu_seq_lens), a sliding window shorter than the keys, a static
cache's unfilled slots, dropout, or an option the tensors' device does not run (softcap on CUDA) is
never served silently: by default it raises a ValueError naming what the library does not support;
with `fallback="sdpa"` that call runs transformers' SDPA attention instead, and the first call of
each kind says so on stderr. While torch.compile traces a model, transformers builds a mask from
position_ids for every batch (it cannot tell one sequence from packed ones then), so compiled
models are served only through that fallback.
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
    if query.is_cuda and softcap:
        reasons.append("a soft cap on the scores (%g) on CUDA tensors" % softcap)
    if kwargs.get("output_attentions"):
        reasons.append("output_attentions")
    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        reasons.append("a score bias or attention sinks")
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        reasons.append("different query, key and value head dims")
    return reasons


def _attention(name):
    """The attention function registered under `name` (see the module's docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                  softcap=None, **kwargs):
        # query [B, Hq, Tq, D], key and value [B, Hkv, Tk, D]; the output is [B, Tq, Hq, D].
        reasons = _unsupported(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                               kwargs)
        if not reasons:   # no mask: causal (aligned bottom-right) over every key, or none
            causal = getattr(module, "is_causal", True) and kwargs.get("is_causal") is not False
            out = gqa_module.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                       causal=causal, softmax_scale=scaling, softcap=softcap or 0.0)
            return out, None
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
