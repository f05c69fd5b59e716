"""``parallel.deterministic``: make a run's steps bitwise reproducible on GPU.

Two fresh GPU runs with the same seed differ from the first step by default: cuBLAS may split a reduction
differently per call, flash and memory-efficient attention accumulate the backward with atomics, and Inductor
picks kernels by timing them on the device. Each of these is switched to its fixed-order variant here. Seeds and
data order are already pure functions of (seed, step, rank) in this package, so with these set a rerun, and a
resume from a checkpoint, repeat the same bits.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# cuBLAS's documented setting for reproducible results (CUDA's "Results reproducibility" notes): a fixed
# workspace per stream, so split-K reductions do not depend on which workspace a call happens to get.
CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic(device: torch.device) -> None:
    """Switch this process to deterministic kernels. Call before the first matmul on ``device``: cuBLAS reads
    ``CUBLAS_WORKSPACE_CONFIG`` when it creates its handle."""
    configured = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    if configured not in (":4096:8", ":16:8"):
        raise ValueError(
            f"CUBLAS_WORKSPACE_CONFIG={configured!r} is set in the environment; parallel.deterministic needs "
            "':4096:8' or ':16:8' (the two settings cuBLAS makes reproducible)"
        )
    # An op with no deterministic implementation raises rather than silently breaking the guarantee.
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # The math attention kernel: its backward is matmuls and a softmax, with no atomics. Flash, memory-efficient
    # and cuDNN attention are faster, but their backward adds partial gradients in whatever order blocks finish.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
    # Inductor's autotuning picks among kernels by timing them, so two compiles may pick different reductions.
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = True
    log.info("parallel.deterministic: deterministic kernels on %s (this costs speed)", device)
