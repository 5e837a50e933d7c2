"""Block sizes of the attention kernels (model.attention_block_q / _k): defaults and the flash kernel's limits.

Pure arithmetic on the config's sizes, so that validation (which names a bad field before anything compiles)
and the kernels (jaxscale.model.flash_attention, chunked_attention) read one rule. The flash figures are the
Pallas GPU kernel's (`jax.experimental.pallas.ops.gpu.attention.mha`): see docs/attention.md.
"""

from __future__ import annotations

MAX_BLOCK = 128  # the Pallas kernel's default forward block
BACKWARD_BLOCK = 32  # the Pallas kernel's default backward blocks
BLOCK_BYTES = 32768  # block x head_dim_padded x itemsize at most, for the default (docs/attention.md)
SHARED_MEMORY_BYTES = 232448  # an H100's (sm_90) shared memory per block, opt-in: jaxscale.plan.targets
NUM_STAGES = 2  # the kernel's pipeline stages (mha's num_stages default)


def padded_head_dim(head_dim: int) -> int:
    """The head width the kernel computes with: the next power of two (Triton tiles are powers of two)."""
    return 1 << (head_dim - 1).bit_length()


def forward_shared_memory(block_q: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """Bytes of shared memory the forward kernel asks for: a q block and NUM_STAGES stages of k and v blocks.

    Checked against XLA's deviceless H100 compile: (128 + 4 x 128) x 256 x 2 = 327,680 is the number in its
    "Shared memory size limit exceeded" error at head_dim 256, blocks of 128, bfloat16.
    """
    return (block_q + 2 * NUM_STAGES * block_k) * padded_head_dim(head_dim) * itemsize


def default_block(head_dim: int, seq_len: int, itemsize: int) -> int:
    """The forward block when the config's is 0: the largest power of two dividing seq_len, at most
    MAX_BLOCK and at most BLOCK_BYTES / (head_dim_padded x itemsize)."""
    cap = max(1, min(MAX_BLOCK, BLOCK_BYTES // (padded_head_dim(head_dim) * itemsize)))
    block = 1 << (cap.bit_length() - 1)
    while seq_len % block:
        block //= 2
    return block


def default_key_block(seq_len: int, cap: int = 128) -> int:
    """The key block when model.attention_block_k is 0: the largest divisor of seq_len that is at most `cap`."""
    return max(b for b in range(1, min(cap, seq_len) + 1) if seq_len % b == 0)
