"""Model FLOPs utilisation (MFU).

FLOPs per token for a forward + backward pass: ``6·N + 12·L·H·Q·T`` (PaLM, Chowdhery et al. 2022,
appendix B; the same estimate nanoGPT uses): 6N for the matmuls against N parameters (2 forward,
4 backward) plus the attention score/value matmuls, with L layers, H heads, head size Q and
sequence length T. MFU = achieved model FLOP/s / (peak FLOP/s per device × devices).

Peak dense (non-sparse) tensor-core throughput per GPU comes from the project's one GPU table,
``ground/gpus.py`` (NVIDIA datasheets, cited there): bf16 for ``precision: bf16`` runs and TF32 for fp32
runs. A GPU whose peak no datasheet gives (AWS's A10G) reports no MFU unless
``metrics.peak_flops_per_device`` is set, rather than a guessed one.
"""

from __future__ import annotations

import torch

from ground.gpus import match_cuda_device
from train.model import GPT


def lookup_peak_flops(device_name: str, precision: str) -> float | None:
    spec = match_cuda_device(device_name)
    if spec is None or spec.approximate:
        return None
    return spec.bf16_dense_flops if precision == "bf16" else spec.tf32_dense_flops


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
