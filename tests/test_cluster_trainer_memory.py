"""predict_trainer_state_bytes against real torch tensors after one AdamW step.

The stand-in below is built from plain torch.nn modules with exactly the parameter structure the brief
gives for our trainer's GPT (tied embeddings, learned positions, LayerNorm with bias, qkv/proj/fc/proj
Linears with configurable bias, final LayerNorm). We run a real forward/backward/AdamW step and add up the
bytes of every parameter, gradient and optimizer-state tensor:
  - single/ddp: the prediction must match to the byte;
  - fsdp: two gloo ranks on CPU with FSDP2 `fully_shard`, odd dimensions so the dim-0 padding matters;
    the prediction must equal the largest rank's bytes exactly and the sum over ranks must be ≈ the
    single-replica bytes (1/N each).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cluster.model_shape import gpt_param_count
from cluster.trainer_memory import predict_trainer_state_bytes


class Block(nn.Module):
    def __init__(self, d: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.attn_proj = nn.Linear(d, d, bias=bias)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.mlp_proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, vocab: int, bias: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2 / nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters, gradients and the optimizer state derived from them are DTensors.
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _one_step_state_bytes(model: nn.Module, vocab: int, block_size: int) -> int:
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (2, block_size))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    params = list(model.parameters())  # tied weight appears once
    total = sum(_nbytes(p) for p in params)
    total += sum(_nbytes(p.grad) for p in params if p.grad is not None)
    for state in opt.state.values():
        total += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


SHAPE = dict(n_layer=2, n_head=3, n_embd=24, block_size=13, vocab_size=67)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_single_and_ddp_match_measured_bytes_exactly(strategy: str, bias: bool) -> None:
    model = TinyGPT(SHAPE["n_layer"], SHAPE["n_head"], SHAPE["n_embd"], SHAPE["block_size"], SHAPE["vocab_size"], bias)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == gpt_param_count(
        SHAPE["n_layer"], SHAPE["n_embd"], SHAPE["vocab_size"], SHAPE["block_size"], bias=bias
    )
    measured = _one_step_state_bytes(model, SHAPE["vocab_size"], SHAPE["block_size"])
    # DDP keeps a full replica per rank, so its per-rank state equals the single-process one.
    world = 1 if strategy == "single" else 4
    predicted = predict_trainer_state_bytes(**SHAPE, bias=bias, strategy=strategy, world_size=world)
    assert predicted == measured
    # 16 B/param (4 weight + 4 grad + 8 AdamW) plus a 4-byte step tensor per parameter tensor.
    assert predicted == 16 * n_params + 4 * len(list(model.parameters()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(
            SHAPE["n_layer"], SHAPE["n_head"], SHAPE["n_embd"], SHAPE["block_size"], SHAPE["vocab_size"], True
        )
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        queue.put((rank, _one_step_state_bytes(model, SHAPE["vocab_size"], SHAPE["block_size"])))
    finally:
        dist.destroy_process_group()


def test_fsdp2_prediction_equals_largest_rank_and_is_about_one_over_n() -> None:
    world = 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_fsdp_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    measured = dict(queue.get(timeout=5) for _ in range(world))

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
    rows += [6 * d, 6]  # c_attn weight (24, 8) → 6 rows; bias (24,) → 6
    rows += [2 * d, 2]  # attn proj (8, 8) → 2 rows; bias → 2
    rows += [2, 2]  # ln_2
    rows += [8 * d, 8]  # c_fc (32, 8) → 8 rows; bias (32,) → 8
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
