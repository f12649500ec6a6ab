"""The two names FlashAttention's tests import from flash_attn.flash_attn_interface."""
USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """Read only by the dropout tests' conversion of S_dmask, which the stand-in skips."""
    return 128 if head_dim <= 64 else 64
