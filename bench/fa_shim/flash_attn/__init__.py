"""A stand-in for the flash_attn package over gqa_module.attention, so that FlashAttention's own
test files (tests/test_flash_attn.py) run against this library (bench/fa_suite.py).

Each function takes FlashAttention 2's arguments; the varlen ones map onto
gqa_module.attention_varlen (with a block_table, onto gqa_module.attention_with_kvcache's packed
rows over the pages), flash_attn_with_kvcache onto gqa_module.attention_with_kvcache. What the
library does not compute skips the test with "unsupported: <feature>" (bench/fa_suite.py counts
those by feature); nothing is emulated around it."""
import pytest
import torch

import gqa_module


def _unsupported(feature):
    pytest.skip("unsupported: " + feature)


def _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs):
    if dropout_p:
        _unsupported("dropout")
    result = gqa_module.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_attn_probs)
    if return_attn_probs:
        out, lse = result
        return out, lse, None   # S_dmask: only read by the dropout tests
    return result


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _attention(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                      return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _attention(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                      alibi_slopes, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, return_attn_probs)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                      causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table=None):
    if dropout_p:
        _unsupported("dropout")
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=alibi_slopes, return_lse=return_attn_probs)
    if block_table is not None:   # k and v are pools of pages: attention_with_kvcache's packed rows over them
        lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        result = gqa_module.attention_with_kvcache(q, k, v, cache_seqlens=lens, page_table=block_table,
                                                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, **options)
    else:
        result = gqa_module.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)
    if return_attn_probs:
        out, lse = result
        return out, lse, None
    return result


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return _attention_varlen(q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                             softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    return _attention_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                             dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    return gqa_module.attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                             rotary_interleaved=rotary_interleaved, cache_seqlens=cache_seqlens,
                                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                             page_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                             return_lse=return_softmax_lse)
