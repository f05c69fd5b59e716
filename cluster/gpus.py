"""Accelerator table: memory capacity and dense BF16 tensor-core peak per GPU.

Why dense: NVIDIA datasheets headline tensor throughput "with sparsity" (2:4 structured sparsity), which is
2× the dense rate. LLM pretraining runs dense GEMMs, so MFU is always quoted against the dense peak
(PaLM, Chowdhery et al. 2022; Llama 3, Dubey et al. 2024). Each entry below halves the
datasheet's sparse figure where the datasheet only gives that one.

Why decimal GB for memory: datasheets print "80GB"; CUDA reports slightly more usable bytes on HBM parts
(e.g. ~79.6 GiB ≈ 85.5e9 B on an H100 SXM). Using capacity × 1e9 is therefore a conservative lower bound,
and the planner's headroom covers the CUDA context and allocator fragmentation on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass

TFLOPS = 1e12
GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: the numbers the planner needs, with where they come from."""

    name: str
    memory_bytes: float
    bf16_dense_flops: float
    source: str


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity),
        # 40GB HBM2 (SXM4 40GB) and 80GB HBM2e (SXM4 80GB).
        GPUSpec("A100-40GB", 40 * GB, 312 * TFLOPS, "NVIDIA A100 datasheet: BF16 312 TF dense, 40GB HBM2"),
        GPUSpec("A100-80GB", 80 * GB, 312 * TFLOPS, "NVIDIA A100 datasheet: BF16 312 TF dense, 80GB HBM2e"),
        # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity
        # (989 dense), 80GB HBM3.
        GPUSpec("H100-80GB-SXM", 80 * GB, 989 * TFLOPS, "NVIDIA H100 datasheet (SXM): BF16 1979/2 TF, 80GB"),
        # NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS with sparsity, 141GB HBM3e.
        GPUSpec("H200", 141 * GB, 989 * TFLOPS, "NVIDIA H200 datasheet (SXM): BF16 1979/2 TF, 141GB"),
        # NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity (121 dense), 24GB.
        GPUSpec("L4", 24 * GB, 121 * TFLOPS, "NVIDIA L4 datasheet: BF16 242/2 TF, 24GB GDDR6"),
        # A10G is AWS's variant of the A10 (EC2 G5). NVIDIA publishes no A10G datasheet; the commonly quoted
        # AWS/NVIDIA figure is 70 TFLOPS dense BF16 tensor (vs 125 for the A10 datasheet) with the same 24GB
        # GDDR6 (see baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference). Treat it as approximate.
        GPUSpec("A10G", 24 * GB, 70 * TFLOPS, "AWS A10G (EC2 G5), ~70 TF BF16 dense (no NVIDIA datasheet), 24GB"),
    )
}

# Names people actually type in job specs, normalised (upper case, no spaces/underscores) → canonical.
_ALIASES: dict[str, str] = {
    "A10040GB": "A100-40GB",
    "A100SXM40GB": "A100-40GB",
    "A10080GB": "A100-80GB",
    "A100SXM80GB": "A100-80GB",
    "A100": "A100-80GB",
    "H100": "H100-80GB-SXM",
    "H10080GB": "H100-80GB-SXM",
    "H100SXM": "H100-80GB-SXM",
    "H100SXM80GB": "H100-80GB-SXM",
    "H10080GBSXM": "H100-80GB-SXM",
    "H200": "H200",
    "H200SXM": "H200",
    "H200141GB": "H200",
    "L4": "L4",
    "A10G": "A10G",
}


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def lookup_gpu(name: str) -> GPUSpec:
    """Resolve a GPU name (canonical or a common alias, case-insensitive) or raise a clear ValueError."""
    canonical = _ALIASES.get(_normalise(name))
    if canonical is None:
        known = ", ".join(GPUS)
        raise ValueError(f"unknown GPU type {name!r}; known types: {known}")
    return GPUS[canonical]
