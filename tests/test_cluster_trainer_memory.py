"""predict_trainer_state_bytes against the trainer's real model after one real optimizer step.

The model is ``train.model.GPT`` itself, wrapped by ``train.parallel.apply_strategy`` and stepped by the
trainer's own ``train.optim.build_optimizer`` (AdamW with decay groups). We run a real
forward/backward/AdamW step and add up the bytes of every parameter, gradient and optimizer-state
tensor a rank holds:
  - single/ddp: the prediction must match to the byte;
  - fsdp: two gloo ranks on CPU with FSDP2 `fully_shard`, odd dimensions so the dim-0 padding matters;
    the prediction must equal the largest rank's bytes exactly and the sum over ranks must be ≈ the
    single-replica bytes (1/N each).
"""

from __future__ import annotations

import os

import pytest
import torch
from gloo_ranks import FlushedQueue, run_gloo_ranks
from torch import nn

from cluster.model_shape import gpt_block_param_count, gpt_param_count, gpt_param_shapes
from cluster.trainer_memory import predict_trainer_state_bytes
from train.config import OptimizerConfig
from train.memory import state_bytes
from train.model import GPT, GPTConfig
from train.optim import build_optimizer
from train.parallel import DistContext, apply_strategy

SHAPE = dict(n_layer=2, n_head=3, n_embd=24, block_size=13, vocab_size=67)


def _nbytes(t: torch.Tensor) -> int:
    # FSDP2 parameters, gradients and the optimizer state derived from them are DTensors.
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _one_step_state_bytes(gpt: GPT, model: nn.Module) -> int:
    """One trainer-style step on ``model`` (``gpt`` wrapped); the bytes of what this rank then holds."""
    torch.manual_seed(0)
    opt = build_optimizer(gpt, OptimizerConfig())
    idx = torch.randint(0, SHAPE["vocab_size"], (2, SHAPE["block_size"] + 1))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    params = list(model.parameters())  # the tied output projection is wte itself: listed once
    total = sum(_nbytes(p) for p in params)
    total += sum(_nbytes(p.grad) for p in params if p.grad is not None)
    for state in opt.state.values():
        total += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    # The trainer's own per-rank measure (metrics.jsonl state_bytes) counts the same tensors.
    assert sum(state_bytes(model, opt).values()) == total
    return total


def test_shapes_are_the_models_own() -> None:
    gpt = GPT(GPTConfig(**SHAPE, bias=True))
    shapes = gpt_param_shapes(SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["vocab_size"], SHAPE["block_size"])
    assert shapes == tuple(tuple(p.shape) for p in gpt.parameters())
    assert gpt_block_param_count(SHAPE["n_embd"]) == sum(p.numel() for p in gpt.blocks[0].parameters())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_single_and_ddp_match_measured_bytes_exactly(strategy: str, bias: bool) -> None:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(**SHAPE, bias=bias))
    n_params = sum(p.numel() for p in gpt.parameters())
    assert n_params == gpt_param_count(
        SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["vocab_size"], SHAPE["block_size"], bias=bias
    )
    # One process: DDP keeps a full replica per rank, so its per-rank state equals the single-process one
    # (what DDP's wrapper adds, gradient buckets, is communication buffer, not model state).
    model = apply_strategy(gpt, "single", DistContext(0, 1, torch.device("cpu")), "fp32")
    measured = _one_step_state_bytes(gpt, model)
    world = 1 if strategy == "single" else 4
    predicted = predict_trainer_state_bytes(**SHAPE, bias=bias, strategy=strategy, world_size=world)
    assert predicted == measured
    # 16 B/param (4 weight + 4 grad + 8 AdamW) plus a 4-byte step tensor per parameter tensor.
    assert predicted == 16 * n_params + 4 * len(list(gpt.parameters()))


def _fsdp_worker(rank: int, world: int, port: int, queue: FlushedQueue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(**SHAPE, bias=True))
        model = apply_strategy(gpt, "fsdp", DistContext(rank, world, torch.device("cpu")), "fp32")
        queue.put((rank, _one_step_state_bytes(gpt, model)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_prediction_equals_largest_rank_and_is_about_one_over_n() -> None:
    world = 2
    measured = dict(run_gloo_ranks(_fsdp_worker, world, timeout_s=120))

    predicted = predict_trainer_state_bytes(**SHAPE, bias=True, strategy="fsdp", world_size=world)
    single = predict_trainer_state_bytes(**SHAPE, bias=True, strategy="single", world_size=1)
    # Rank 0 always receives ceil(dim0/N) rows, so it is the largest and the prediction is exact for it.
    assert predicted == measured[0] == max(measured.values())
    # block_size 13 and vocab 67 are odd, so rank 1 holds one row fewer of wpe and of the tied wte.
    assert measured[1] < measured[0]
    # Apart from padding and the per-rank step tensors, the ranks split the replica: within 5% of 1/N.
    assert abs(predicted - single / world) / (single / world) < 0.05
    assert abs(sum(measured.values()) - single) / single < 0.05


def test_fsdp_padding_rounds_each_dim0_up() -> None:
    # One layer, d = 8, vocab 5, block 3, 4 ranks: wte (5, 8) → 2 rows; wpe (3, 8) → 1 row; every
    # LayerNorm/bias vector of length 8·k → 2k elements; Linear weights (3d, d), (d, d), (4d, d), (d, 4d).
    shape = dict(n_layer=1, n_head=2, n_embd=8, block_size=3, vocab_size=5)
    d = 8
    rows = [2 * d, 1 * d]  # wte, wpe
    rows += [2, 2]  # ln_1 weight, bias: ceil(8/4) = 2
    rows += [6 * d, 6]  # qkv weight (24, 8) → 6 rows; bias (24,) → 6
    rows += [2 * d, 2]  # attn proj (8, 8) → 2 rows; bias → 2
    rows += [2, 2]  # ln_2
    rows += [8 * d, 8]  # fc (32, 8) → 8 rows; bias (32,) → 8
    rows += [2 * 4 * d, 2]  # mlp proj (8, 32) → 2 rows of 32; bias (8,) → 2
    rows += [2, 2]  # ln_f
    expected = 16 * sum(rows) + 4 * len(rows)
    assert predict_trainer_state_bytes(**shape, bias=True, strategy="fsdp", world_size=4) == expected


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="divisible"):
        predict_trainer_state_bytes(2, 5, 24, 8, 10, True, "single", 1)
    with pytest.raises(ValueError, match="single"):
        predict_trainer_state_bytes(2, 3, 24, 8, 10, True, "single", 2)
    with pytest.raises(ValueError, match="unknown strategy"):
        predict_trainer_state_bytes(2, 3, 24, 8, 10, True, "zero", 2)  # type: ignore[arg-type]
