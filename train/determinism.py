"""Bitwise reproducible steps: ``settle_vector_math`` on every CPU run, ``parallel.deterministic`` on GPU.

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


def settle_vector_math() -> None:
    """Make this process's first call into PyTorch's vector math library (MKL's VML: sqrt, exp, log, ...) on one
    thread, before any parallel region makes it on several.

    Why (measured with torch 2.13 CPU and MKL 2024.2 on a Sapphire Rapids VM, 2 intra-op threads): when a process's
    first VML call runs on two OpenMP threads at once, in 6 of 30 fresh processes the second thread's half of the
    tensor came out of a lower-accuracy code path for that one call (sqrt off by up to 3e-4 relative, log by 3e-6);
    later calls were exact. AdamW's first step takes a sqrt, so two DDP replicas parted at step 0 (a
    ``ReplicaMismatch``) and two runs of one config could too. After a one-element exp on one thread, 0 of 75
    processes differed. MKL's ``MKL_CBWR=COMPATIBLE`` also cures it, but pins every MKL routine, the matmuls too, to its
    slowest code path."""
    probe = torch.ones(1)  # one element: computed on the calling thread, never split across threads
    torch.sqrt(probe)
    torch.exp(probe)
    torch.log(probe)
