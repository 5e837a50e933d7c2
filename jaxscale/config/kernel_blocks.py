"""Block sizes of the attention kernels (model.attention_block_q / _k): defaults and the flash kernel's limits.

Pure arithmetic on the config's sizes, so that validation (which names a bad field before anything compiles)
and the kernels (jaxscale.model.flash_attention, chunked_attention) read one rule. The flash figures are the
Pallas GPU kernel's (`jax.experimental.pallas.ops.gpu.attention.mha`): see docs/attention.md.
"""

from __future__ import annotations

from jaxscale.config.gpu_arch import ARCH_LIMITS

MAX_BLOCK = 128  # the Pallas kernel's default forward block
BACKWARD_BLOCK = 32  # the Pallas kernel's default backward blocks
BLOCK_BYTES = 32768  # block x head_dim_padded x itemsize at most, for the default (docs/attention.md)
NUM_STAGES = 2  # the kernel's pipeline stages (mha's num_stages default)
HOPPER = (9, 0)  # the compute capability whose Triton pipeline keeps NUM_STAGES buffers of k and v


def shared_memory_limit(compute_capability: tuple[int, int]) -> int:
    """Shared memory one block may opt in to on that architecture (jaxscale.config.gpu_arch.ARCH_LIMITS)."""
    return ARCH_LIMITS[compute_capability]["shared_memory_per_block_optin"]


# The largest of any target (an H100's 232,448): config validation knows no target, so it refuses only the
# blocks that no GPU compiles; a plan for a target checks that target's own limit (forward_shared_memory).
SHARED_MEMORY_BYTES = max(shared_memory_limit(cc) for cc in ARCH_LIMITS)


def padded_head_dim(head_dim: int) -> int:
    """The head width the kernel computes with: the next power of two (Triton tiles are powers of two)."""
    return 1 << (head_dim - 1).bit_length()


def forward_shared_memory(
    block_q: int, block_k: int, head_dim: int, itemsize: int, compute_capability: tuple[int, int] = HOPPER
) -> int:
    """Bytes of shared memory XLA's Triton compile gives the forward kernel on that architecture.

    sm_90 (Hopper) with block_q >= 64 (a warpgroup's wgmma tile): a q block and NUM_STAGES buffers of k and v,
    (block_q + 4 block_k) x head_dim_padded x bytes: exactly XLA's number in the deviceless H100 compile
    (327,680 requested at head_dim 256, blocks of 128, bf16; 163,840 at head_dim 128), for bfloat16; float32
    asks for less (conservative there). Smaller block_q on sm_90, and sm_8x (Ampere, Ada): Triton's
    pipeline keeps one buffer each of q, k and v, (block_q + 2 block_k) x
    head_dim_padded x bytes, plus the [block_q, block_k] probabilities passed through shared memory to the
    second dot unless each of the kernel's warps holds whole 16-row slices of both dots (block_q >= 16 x
    warps, head_dim_padded <= 128). Exact for all 27 bf16 block pairs (head_dim 64/128/256, blocks 32-128) of
    the deviceless rtx4090 and A100 compiles and the H100's at block_q 32 (docs/attention.md); blocks of 128
    at head_dim 128 take 98,304 there.
    """
    padded = padded_head_dim(head_dim)
    if compute_capability >= HOPPER and block_q >= 64:
        return (block_q + 2 * NUM_STAGES * block_k) * padded * itemsize
    warps = 4 if head_dim <= 64 else 8  # the Pallas kernel's num_warps default
    probabilities = 0 if block_q >= 16 * warps and padded <= 128 else block_q * block_k * itemsize
    return (block_q + 2 * block_k) * padded * itemsize + probabilities


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
