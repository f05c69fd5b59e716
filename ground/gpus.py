"""Accelerator table: memory capacity and dense BF16/TF32 tensor-core peaks per GPU.

The one table of GPU facts in the project: the planner sizes jobs with it, and the trainer's MFU
(``train/flops.py``) looks up the GPU it runs on by its CUDA device name (:func:`match_cuda_device`).

Why dense: NVIDIA datasheets headline tensor throughput "with sparsity" (2:4 structured sparsity), which is
2× the dense rate. LLM pretraining runs dense GEMMs, so MFU is always quoted against the dense peak
(PaLM, Chowdhery et al. 2022; Llama 3, Dubey et al. 2024). Each entry below halves the
datasheet's sparse figure where the datasheet only gives that one.

Why decimal GB for memory: datasheets print "80GB"; CUDA reports slightly more usable bytes on HBM parts
(e.g. ~79.6 GiB ≈ 85.5e9 B on an H100 SXM). Using capacity × 1e9 is therefore a conservative lower bound,
and the planner's headroom covers the CUDA context and allocator fragmentation on top of it.
"""

from __future__ import annotations

import re
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
    # Dense TF32 peak: what fp32 matmuls reach when PyTorch allows TF32 (an upper bound otherwise).
    tf32_dense_flops: float | None = None
    # Words of torch.cuda.get_device_name() that identify this GPU ("NVIDIA H100 PCIe" -> H100, PCIE).
    cuda_name_words: tuple[str, ...] = ()
    # True where no datasheet gives the peak: shown by the planner, never used to report an MFU.
    approximate: bool = False


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # NVIDIA A100 Tensor Core GPU datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), TF32 156
        # (312 sparse); 40GB HBM2 (SXM4 40GB) and 80GB HBM2e (SXM4 80GB).
        GPUSpec(
            "A100-40GB",
            40 * GB,
            312 * TFLOPS,
            "NVIDIA A100 datasheet: BF16 312 TF dense, 40GB HBM2",
            156 * TFLOPS,
            ("A100", "40GB"),
        ),
        GPUSpec(
            "A100-80GB",
            80 * GB,
            312 * TFLOPS,
            "NVIDIA A100 datasheet: BF16 312 TF dense, 80GB HBM2e",
            156 * TFLOPS,
            ("A100",),
        ),
        # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 TFLOPS with sparsity
        # (989 dense), TF32 989 sparse (494.5 dense), 80GB HBM3.
        GPUSpec(
            "H100-80GB-SXM",
            80 * GB,
            989 * TFLOPS,
            "NVIDIA H100 datasheet (SXM): BF16 1979/2 TF, 80GB",
            494.5 * TFLOPS,
            ("H100",),
        ),
        # Same datasheet, PCIe column: BF16 1,513 sparse (756 dense), TF32 756 sparse (378 dense), 80GB.
        GPUSpec(
            "H100-80GB-PCIe",
            80 * GB,
            756 * TFLOPS,
            "NVIDIA H100 datasheet (PCIe): BF16 1513/2 TF, 80GB",
            378 * TFLOPS,
            ("H100", "PCIE"),
        ),
        # Same datasheet, NVL column: BF16 1,671 sparse (835 dense), TF32 835 sparse (417.5 dense), 94GB.
        GPUSpec(
            "H100-94GB-NVL",
            94 * GB,
            835 * TFLOPS,
            "NVIDIA H100 datasheet (NVL): BF16 1671/2 TF, 94GB",
            417.5 * TFLOPS,
            ("H100", "NVL"),
        ),
        # NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS with sparsity, TF32 989
        # sparse, 141GB HBM3e.
        GPUSpec(
            "H200",
            141 * GB,
            989 * TFLOPS,
            "NVIDIA H200 datasheet (SXM): BF16 1979/2 TF, 141GB",
            494.5 * TFLOPS,
            ("H200",),
        ),
        # NVIDIA L4 Tensor Core GPU datasheet: BF16 Tensor Core 242 TFLOPS with sparsity (121 dense), TF32
        # 120 sparse, 24GB.
        GPUSpec("L4", 24 * GB, 121 * TFLOPS, "NVIDIA L4 datasheet: BF16 242/2 TF, 24GB GDDR6", 60 * TFLOPS, ("L4",)),
        # NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity (362 dense), TF32 366 sparse, 48GB GDDR6.
        GPUSpec(
            "L40S", 48 * GB, 362 * TFLOPS, "NVIDIA L40S datasheet: BF16 733/2 TF, 48GB GDDR6", 183 * TFLOPS, ("L40S",)
        ),
        # NVIDIA A10 datasheet: BF16 250 TFLOPS with sparsity (125 dense), TF32 125 sparse, 24GB GDDR6.
        GPUSpec(
            "A10", 24 * GB, 125 * TFLOPS, "NVIDIA A10 datasheet: BF16 250/2 TF, 24GB GDDR6", 62.5 * TFLOPS, ("A10",)
        ),
        # A10G is AWS's variant of the A10 (EC2 G5). NVIDIA publishes no A10G datasheet; the commonly quoted
        # AWS/NVIDIA figure is 70 TFLOPS dense BF16 tensor (vs 125 for the A10 datasheet) with the same 24GB
        # GDDR6 (see baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference). Treat it as approximate.
        GPUSpec(
            "A10G",
            24 * GB,
            70 * TFLOPS,
            "AWS A10G (EC2 G5), ~70 TF BF16 dense (no NVIDIA datasheet), 24GB",
            None,
            ("A10G",),
            approximate=True,
        ),
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
    "H100PCIE": "H100-80GB-PCIe",
    "H10080GBPCIE": "H100-80GB-PCIe",
    "H100NVL": "H100-94GB-NVL",
    "H10094GBNVL": "H100-94GB-NVL",
    "L4": "L4",
    "L40S": "L40S",
    "A10": "A10",
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


def match_cuda_device(device_name: str) -> GPUSpec | None:
    """The table entry for a CUDA device name, or None for a GPU it does not know.

    Names are compared word by word (``"NVIDIA A100-SXM4-80GB"`` → A100, SXM4, 80GB), so L4 never matches
    an L40S; where several entries match, the one naming more words wins (H100 PCIe over plain H100).
    """
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    matches = [spec for spec in GPUS.values() if spec.cuda_name_words and set(spec.cuda_name_words) <= words]
    return max(matches, key=lambda spec: len(spec.cuda_name_words), default=None)
