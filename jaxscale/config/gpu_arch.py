"""The per-architecture limits of NVIDIA GPUs (threads, shared memory, registers per SM), by compute capability.

On the config floor because both the GPU targets (jaxscale.plan.targets, which write them into XLA's target
configs) and the flash kernel's block rule (jaxscale.config.kernel_blocks, which checks shared memory) read them.
"""

from __future__ import annotations

# Limits of one SM by compute capability: CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability" (max threads per SM, shared memory per SM and per block with opt-in), and FP32 lanes per SM
# from the architecture whitepapers (A100: 64; GA10x, AD10x, GH100: 128).
ARCH_LIMITS: dict[tuple[int, int], dict[str, int]] = {
    (8, 0): dict(
        threads_per_core_limit=2048,
        shared_memory_per_core=167936,
        shared_memory_per_block_optin=166912,
        fpus_per_core=64,
    ),
    (8, 6): dict(
        threads_per_core_limit=1536,
        shared_memory_per_core=102400,
        shared_memory_per_block_optin=101376,
        fpus_per_core=128,
    ),
    (8, 9): dict(
        threads_per_core_limit=1536,
        shared_memory_per_core=102400,
        shared_memory_per_block_optin=101376,
        fpus_per_core=128,
    ),
    (9, 0): dict(
        threads_per_core_limit=2048,
        shared_memory_per_core=233472,
        shared_memory_per_block_optin=232448,
        fpus_per_core=128,
    ),
    # Blackwell B200 (sm_100): the same limits in the guide's table, and in OpenXLA's B200 spec read from a device
    # (xla/backends/gpu/target_config/specs/b200.txtpb @ 300ec95: shared_memory_per_core 233472, fpus_per_core 128).
    (10, 0): dict(
        threads_per_core_limit=2048,
        shared_memory_per_core=233472,
        shared_memory_per_block_optin=232448,
        fpus_per_core=128,
    ),
}

# FP8 tensor cores (e4m3 / e5m2 GEMMs: model.fp8) from Ada (8.9) and Hopper (9.0) on; Ampere (8.0, 8.6) has none.
# NVIDIA's Transformer Engine documents FP8 for Ada and Hopper (and later) GPUs, and cuBLASLt's FP8 matmul types
# (CUDA_R_8F_E4M3 / _E5M2, cuBLAS docs, cublasLtMatmul) likewise need compute capability 8.9 or newer.
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)

# The same on every architecture listed above (same guide).
COMMON_LIMITS: dict[str, int] = dict(
    threads_per_block_limit=1024,
    threads_per_warp=32,
    shared_memory_per_block=49152,
    block_dim_limit_x=2**31 - 1,
    block_dim_limit_y=65535,
    block_dim_limit_z=65535,
    registers_per_core_limit=65536,
    registers_per_block_limit=65536,
)
