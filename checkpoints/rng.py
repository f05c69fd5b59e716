"""Every RNG a rank draws from, packed into one uint8 tensor per rank.

DCP treats a plain (non-DTensor) tensor saved under the same key by several ranks as replicated and
writes only one copy, so per-rank RNG states must live under rank-unique keys (``rank0``, ``rank1``,
...). Packing Python's, NumPy's and torch's states (CUDA's too, when present) into one pickled byte
tensor keeps them a single tensor item instead of nested tuples DCP would have to interpret.
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import torch


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def capture_rng(device: torch.device) -> torch.Tensor:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8).clone()


def restore_rng(packed: torch.Tensor, device: torch.device) -> None:
    # The bytes come from our own checkpoint, verified against its sha256 before loading.
    state = pickle.loads(packed.cpu().numpy().tobytes())
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
