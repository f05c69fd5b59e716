"""``parallel.deterministic``: what the flag switches, checked in a fresh interpreter (the switches are
process-wide), and a CUBLAS_WORKSPACE_CONFIG that would break the guarantee refused. Whether two GPU runs then
repeat the same bits is measured by bench/train_gpu_bench.py on a GPU (bench/README.md).

On every run, flag or not, the Trainer settles PyTorch's vector math library first (``settle_vector_math``);
fresh interpreters check that a settled process's first sqrt split across two threads gives the one-thread bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs a fresh interpreter that imports torch and trains a step
REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, sys
import torch
import torch._inductor.config as inductor
from train.config import load_config
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import Trainer
sys.path.insert(0, "tests")
from train_fixtures import tiny_overrides

config = load_config(None, tiny_overrides(sys.argv[1], sys.argv[2], **{"checkpoint.enabled": False,
                                                                       "parallel.deterministic": sys.argv[3] == "on"}))
check_data(config)
trainer = Trainer.from_config(config, DistContext(0, 1, torch.device("cpu")))
loss = trainer.train_step()["loss"]
print(json.dumps({
    "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    "cudnn_deterministic": torch.backends.cudnn.deterministic,
    "cudnn_benchmark": torch.backends.cudnn.benchmark,
    "flash_sdp": torch.backends.cuda.flash_sdp_enabled(),
    "mem_efficient_sdp": torch.backends.cuda.mem_efficient_sdp_enabled(),
    "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
    "math_sdp": torch.backends.cuda.math_sdp_enabled(),
    "inductor_deterministic": bool(inductor.deterministic),
    "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "loss": loss,
}))
"""


def probe(token_dir: Path, out: Path, flag: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"} | (env or {})
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(token_dir), str(out), flag],
        cwd=REPO, env=environ, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_flag_switches_every_source_of_nondeterminism_and_nothing_without_it(token_dir: Path, tmp_path: Path):
    on = probe(token_dir, tmp_path / "on", "on")
    off = probe(token_dir, tmp_path / "off", "off")
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    on_state, off_state = json.loads(on.stdout.splitlines()[-1]), json.loads(off.stdout.splitlines()[-1])
    assert on_state == {
        "deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "flash_sdp": False,
        "mem_efficient_sdp": False,
        "cudnn_sdp": False,
        "math_sdp": True,
        "inductor_deterministic": True,
        "cublas_workspace": ":4096:8",
        "loss": on_state["loss"],
    }
    # Without the flag the process keeps PyTorch's defaults.
    assert not off_state["deterministic_algorithms"] and off_state["flash_sdp"]
    assert off_state["cublas_workspace"] is None
    # On CPU the steps were reproducible already: the flag changes no number.
    assert on_state["loss"] == off_state["loss"]


def test_a_workspace_setting_that_breaks_reproducibility_is_refused(token_dir: Path, tmp_path: Path) -> None:
    proc = probe(token_dir, tmp_path / "bad", "on", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"})
    assert proc.returncode != 0
    assert "CUBLAS_WORKSPACE_CONFIG=':0:0'" in proc.stderr and "parallel.deterministic" in proc.stderr


FIRST_SQRT = """
import sys
import numpy as np
import torch
from train.determinism import settle_vector_math

settle_vector_math()
# The input comes from numpy: the sqrt below is this process's first call into torch's vector math after settling.
values = torch.from_numpy(np.random.default_rng(0).random(49152, dtype=np.float32))
torch.set_num_threads(2)
split = torch.sqrt(values)
torch.set_num_threads(1)
print(torch.equal(split, torch.sqrt(values)))
"""


def test_a_settled_process_computes_its_first_sqrt_on_two_threads_as_on_one() -> None:
    """Without ``settle_vector_math``, 6 of 30 fresh processes measured here computed the second thread's half of
    their first two-thread sqrt less accurately (up to 3e-4 relative): two DDP replicas parted at AdamW's first
    step. Eight processes (each pays an interpreter start) caught its removal in 2 of 3 runs here; the DDP runs'
    replica checks (train.trainer.check_replicas) are the other net."""
    outcomes = [
        subprocess.run(
            [sys.executable, "-c", FIRST_SQRT], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
        ).stdout.split()[-1]
        for _ in range(8)
    ]
    assert outcomes == ["True"] * 8
