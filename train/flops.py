"""Model FLOPs utilisation (MFU).

FLOPs per token for a forward + backward pass: ``6·N + 12·L·H·Q·T`` (PaLM, Chowdhery et al. 2022,
appendix B; the same estimate nanoGPT uses): 6N for the matmuls against N parameters (2 forward,
4 backward) plus the attention score/value matmuls, with L layers, H heads, head size Q and
sequence length T. MFU = achieved model FLOP/s / (peak FLOP/s per device × devices).

Peak dense (non-sparse) tensor-core throughput per GPU from NVIDIA's datasheets: bf16 for
``precision: bf16`` runs and TF32 for fp32 runs (PyTorch matmuls use TF32 when allowed; the number
is an upper bound otherwise). The datasheets quote "with sparsity" figures; these are half of them.
- A100 (SXM and PCIe), NVIDIA A100 datasheet: BF16 312 TFLOPS, TF32 156 TFLOPS.
- H100 SXM, NVIDIA H100 datasheet: BF16 989 TFLOPS (1,979 sparse), TF32 494.5 (989 sparse).
- H100 PCIe: BF16 756 TFLOPS (1,513 sparse), TF32 378 (756 sparse).
- H100 NVL: BF16 835 TFLOPS (1,671 sparse), TF32 417.5 (835 sparse).
- H200 (SXM), NVIDIA H200 datasheet: BF16 989 TFLOPS (1,979 sparse), TF32 494.5 (989 sparse).
- L4, NVIDIA L4 datasheet: BF16 121 TFLOPS (242 sparse), TF32 60 (120 sparse).
- A10, NVIDIA A10 datasheet: BF16 125 TFLOPS (250 sparse), TF32 62.5 (125 sparse). AWS's A10G is
  a variant with lower clocks and no published datasheet figure, so it is deliberately absent:
  set ``metrics.peak_flops_per_device`` for it.
- L40S, NVIDIA L40S datasheet: BF16 362 TFLOPS (733 sparse), TF32 183 (366 sparse).
"""

from __future__ import annotations

import torch

from train.model import GPT

T = 1e12
# Ordered: the first name fragment contained in the device name wins, so the specific variants
# ("H100 PCIe") come before the generic one ("H100").
PEAK_FLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H100", "PCIE"), {"bf16": 756 * T, "fp32": 378 * T}),
    (("H100", "NVL"), {"bf16": 835 * T, "fp32": 417.5 * T}),
    (("H100",), {"bf16": 989 * T, "fp32": 494.5 * T}),
    (("H200",), {"bf16": 989 * T, "fp32": 494.5 * T}),
    (("A100",), {"bf16": 312 * T, "fp32": 156 * T}),
    (("L40S",), {"bf16": 362 * T, "fp32": 183 * T}),
    (("L4",), {"bf16": 121 * T, "fp32": 60 * T}),
    (("A10",), {"bf16": 125 * T, "fp32": 62.5 * T}),
]


def lookup_peak_flops(device_name: str, precision: str) -> float | None:
    name = device_name.upper()
    if "A10G" in name:
        return None
    for fragments, peaks in PEAK_FLOPS:
        if all(fragment in name for fragment in fragments):
            return peaks[precision]
    return None


def device_peak_flops(device: torch.device, precision: str, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type == "cuda":
        return lookup_peak_flops(torch.cuda.get_device_name(device), precision)
    return None


def flops_per_token(model: GPT) -> float:
    cfg = model.config
    return 6 * model.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.block_size


def mfu(flops_per_tok: float, tokens_per_s: float, peak_per_device: float | None, devices: int) -> float | None:
    if peak_per_device is None:
        return None
    return flops_per_tok * tokens_per_s / (peak_per_device * devices)
