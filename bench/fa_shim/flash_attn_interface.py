"""A stand-in for FlashAttention 3's flash_attn_interface module (hopper/), over gqa_module's
entries, so that hopper/test_flash_attn.py runs against this library (bench/fa_suite.py).

Each function takes FlashAttention 3's arguments. Its speed knobs (num_splits, pack_gqa,
scheduler_metadata, sm_margin, deterministic) change nothing here; what the library does not
compute (qv over a KV cache, a combine into a given tensor) skips the test with
"unsupported: <feature>", as the FlashAttention 2 stand-in does."""
import pytest

import gqa_module


def _unsupported(feature):
    pytest.skip("unsupported: " + feature)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                    window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    return gqa_module.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                softcap=softcap, attention_chunk=attention_chunk, return_lse=return_attn_probs,
                                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qv=qv)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    return gqa_module.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, softcap=softcap, attention_chunk=attention_chunk, seqused_q=seqused_q,
        seqused_k=seqused_k, return_lse=return_attn_probs, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, qv=qv)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    if qv is not None:
        _unsupported("qv over a KV cache")
    return gqa_module.attention_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        rotary_seqlens=rotary_seqlens, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
        max_seqlen_q=max_seqlen_q, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, page_table=page_table, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, softcap=softcap, attention_chunk=attention_chunk, return_lse=return_softmax_lse,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    if out is not None:
        _unsupported("combine into a given out")
    # FlashAttention 3's layouts: out_partial [S, B, T, H, D], lse_partial [S, B, T, H]
    result, lse = gqa_module.attention_combine(out_partial, lse_partial.transpose(-1, -2), out_dtype=out_dtype)
    return result, lse.transpose(-1, -2)


def get_scheduler_metadata(*args, **kwargs):
    """A speed hint for flash_attn_with_kvcache's scheduler; the stand-in has none to give."""
    return None
