"""``model.arch: llama`` (train/model.py): each of its parts against the computation written out (rotary positions,
grouped-query attention, SwiGLU), its settings checked, the planner's shapes and the MFU count, and training that
resumes bitwise from a checkpoint, in one process and under DDP and FSDP on two gloo ranks, and across the switch
of a context schedule (train/context_schedule.py) that raises the RoPE base. Its Hugging Face export
(LlamaForCausalLM) is tests/test_hf_export.py's, beside GPT-2's."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gloo_ranks import FlushedQueue, cpu_rank, run_gloo_ranks
from train_fixtures import tiny_overrides

from cluster.model_shape import ArchOptions, gpt_param_shapes
from cluster.trainer_memory import predict_trainer_state_bytes
from train.config import TrainConfig, load_config
from train.final import train_to_completion
from train.flops import flops_per_token
from train.metrics import read_metrics
from train.model import GPT, CausalSelfAttention, GPTConfig, apply_rope, rope_tables
from train.optim import build_optimizer
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LLAMA = {"model.arch": "llama", "model.n_kv_head": 1, "model.tie_embeddings": False}
STEPS = 4  # a checkpoint at step 2, then resumed to 4
REPO = Path(__file__).resolve().parents[1]


def llama(**extra: object) -> GPTConfig:
    return GPTConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "vocab_size": 61, "arch": "llama"}
                     | extra)  # type: ignore[arg-type]  # fmt: skip


def test_rope_turns_each_channel_pair_by_its_positions_angle() -> None:
    torch.manual_seed(0)
    batch, heads, seq, head_dim, theta = 2, 3, 7, 8, 500.0
    x = torch.randn(batch, heads, seq, head_dim)
    got = apply_rope(x, *rope_tables(seq, head_dim, theta, x.device))
    half = head_dim // 2
    expected = torch.empty_like(x)
    for p in range(seq):
        for i in range(half):  # the pair (i, i + half) turned by p·θ^(-2i/d)
            angle = p * theta ** (-2 * i / head_dim)
            a, b = x[..., p, i], x[..., p, i + half]
            expected[..., p, i] = a * math.cos(angle) - b * math.sin(angle)
            expected[..., p, i + half] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A turn keeps each pair's length, and position 0 is not turned.
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(got[..., 0, :], x[..., 0, :])


def attention_written_out(attn: CausalSelfAttention, x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """softmax(q·kᵀ/√d + causal mask)·v with each k/v head repeated for its group of query heads, then proj."""
    batch, seq, width = x.shape
    heads, head_dim = attn.n_head, width // attn.n_head
    q, k, v = attn.qkv(x).split((width, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
    k, v = (t.view(batch, seq, kv_heads, head_dim).transpose(1, 2) for t in (k, v))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # query head h reads k/v head h // group
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, width)
    return attn.proj(y)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_grouped_query_attention_equals_attention_over_repeated_keys_and_values(kv_heads: int) -> None:
    torch.manual_seed(0)
    attn = CausalSelfAttention(llama(n_kv_head=kv_heads)).eval()
    assert attn.qkv.out_features == 32 + 2 * kv_heads * 8  # k and v are kv_heads heads of 8 wide
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), attention_written_out(attn, x, kv_heads), rtol=1e-5, atol=1e-6)


def test_swiglu_is_a_gated_silu_and_the_default_width_keeps_a_4x_mlps_size() -> None:
    torch.manual_seed(0)
    model = GPT(llama(n_embd=48, n_head=4))
    mlp = model.blocks[0].mlp
    assert mlp.gate.out_features == mlp.up.out_features == 128  # 8/3 · 48 = 128, a multiple of 64
    x = torch.randn(3, 5, 48)
    gate, up = x @ mlp.gate.weight.T, x @ mlp.up.weight.T
    expected = (gate * torch.sigmoid(gate) * up) @ mlp.proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)
    assert GPT(llama(ffn_hidden=40)).blocks[0].mlp.up.out_features == 40


def test_a_llama_has_no_biases_no_position_table_and_rms_norms() -> None:
    model = GPT(llama(tie_embeddings=False))
    names = dict(model.named_parameters())
    assert not [name for name in names if name.endswith("bias")]
    assert model.wpe is None and isinstance(model.ln_f, torch.nn.RMSNorm)
    assert "lm_head.weight" in names
    assert "lm_head.weight" not in dict(GPT(llama()).named_parameters())  # tied: the embedding itself


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"arch": "llama", "bias": True}, "bias: true"),
        ({"n_kv_head": 2}, "n_kv_head: set only with arch 'llama'"),
        ({"tie_embeddings": False}, "tie_embeddings: set only with arch 'llama'"),
        ({"arch": "llama", "n_kv_head": 3}, "must be a multiple of n_kv_head"),
        ({"arch": "llama", "activation": "gelu"}, "arch 'llama' expects 'swiglu'"),
        ({"activation": "swiglu"}, "arch 'gpt2' expects 'gelu_tanh' or 'gelu'"),
        ({"arch": "llama", "n_head": 8, "n_embd": 24}, "head size 3 .* must be even"),
    ],
)
def test_a_setting_the_arch_does_not_have_is_refused_naming_it(settings: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainConfig.model_validate({"model": {"n_head": 4, "n_embd": 32} | settings})


def test_the_planner_lists_the_models_own_shapes_and_mfu_counts_no_lookup() -> None:
    config = llama(n_kv_head=2, tie_embeddings=False, ffn_hidden=96)
    model = GPT(config)
    options = ArchOptions("llama", n_head=4, n_kv_head=2, ffn_hidden=96, tie_embeddings=False)
    assert gpt_param_shapes(2, 32, 61, 16, None, options) == tuple(tuple(p.shape) for p in model.parameters())
    optimizer = build_optimizer(model, TrainConfig().optimizer)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for p in model.parameters() for t in (p, p.grad))
    held += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    assert predict_trainer_state_bytes(2, 4, 32, 16, 61, None, "single", 1, options) == held
    # The untied embedding is a lookup: 6·N counts the output projection's matmul, not the table.
    assert model.num_params() == model.num_params(exclude_lookups=False) - 61 * 32
    assert flops_per_token(model) == 6 * model.num_params() + 12 * 2 * 4 * 8 * 16


def run_and_resume(data: Path, out: Path, ctx: DistContext, **extra: object) -> tuple[list, list, dict]:
    """Losses of an uninterrupted run of STEPS and of one stopped after STEPS/2 and resumed (rank 0's; none on other
    ranks), and whether the resumed one's weights equal the uninterrupted one's (per name)."""

    def config(where: Path, **more: object) -> TrainConfig:
        overrides = {"steps": STEPS, "checkpoint.interval_steps": STEPS // 2, **LLAMA, **extra, **more}
        loaded = load_config(None, tiny_overrides(data, where, **overrides))
        check_data(loaded)
        return loaded

    whole = Trainer.from_config(config(out / "whole"), ctx)
    whole.train()
    first = Trainer.from_config(config(out / "cut"), ctx)
    for _ in range(STEPS // 2):
        first.run_step()
    first.checkpointer.close()
    resumed = Trainer.from_config(config(out / "cut", **{"checkpoint.resume": True}), ctx)
    resumed.train()
    same = {name: torch.equal(value, resumed.gpt.state_dict()[name]) for name, value in whole.gpt.state_dict().items()}
    if ctx.rank != 0:  # rank 0 writes metrics.jsonl, maybe still as another rank gets here
        return [], [], same
    losses = [[(r["step"], r["loss"]) for r in read_metrics(out / name)] for name in ("whole", "cut")]
    return losses[0], losses[1], same


def test_a_llama_resumes_bitwise_in_one_process(token_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    whole, resumed, same = run_and_resume(token_dir, tmp_path, DistContext(0, 1, torch.device("cpu")))
    assert len(whole) == STEPS and resumed == whole  # the same floats, not just close
    assert all(same.values()), same


def _resume_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        result: dict = {"rank": rank}
        for strategy in ("ddp", "fsdp"):
            parallel = {"parallel.strategy": strategy, "parallel.workers": 2}
            result[strategy] = run_and_resume(Path(data), Path(out) / strategy, ctx, **parallel)
        queue.put(result)


@pytest.mark.slow
def test_a_llama_resumes_bitwise_under_ddp_and_fsdp(token_dir: Path, tmp_path: Path) -> None:
    for result in run_gloo_ranks(_resume_worker, 2, str(token_dir), str(tmp_path)):
        for strategy in ("ddp", "fsdp"):
            whole, resumed, same = result[strategy]
            assert all(same.values()), (result["rank"], strategy, same)
            if result["rank"] == 0:
                assert len(whole) == STEPS and resumed == whole, strategy


SCHEDULE = [{"from_step": 0, "block_size": 16}, {"from_step": 3, "block_size": 32, "rope_theta": 40000.0}]


# A run of the schedule that SIGKILLs itself after step 2 (checkpointed after step 1; the switch is at step 3).
KILLED_RUN = """
import json, os, signal, sys
import torch
from train.config import load_config
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import Trainer

def kill_after_step_2(info):
    if info.step == 2:
        os.kill(os.getpid(), signal.SIGKILL)

torch.set_num_threads(1)
config = load_config(None, json.loads(sys.argv[1]))
check_data(config)
Trainer.from_config(config, DistContext(0, 1, torch.device("cpu")), on_step_end=kill_after_step_2).train()
"""


@pytest.mark.slow
def test_a_context_schedule_switches_block_and_theta_and_resumes_bitwise_across_the_switch(
    token_dir: Path, tmp_path: Path
) -> None:
    """16-token windows for 3 steps, then model.block_size's 32 with another RoPE base: a run SIGKILLed after step 2
    and resumed (from its checkpoint after step 1) through the switch repeats the uninterrupted run's losses and
    weights bitwise; the export's config is the last phase's."""
    torch.set_num_threads(1)
    cpu = DistContext(0, 1, torch.device("cpu"))

    def config(where: Path, **more: object) -> TrainConfig:
        overrides = {"steps": 6, "checkpoint.interval_steps": 2, "context_schedule": SCHEDULE, **LLAMA, **more}
        loaded = load_config(None, tiny_overrides(token_dir, where, **overrides))
        check_data(loaded)
        return loaded

    whole = Trainer.from_config(config(tmp_path / "whole"), cpu)
    shapes = [tuple(whole.train_batches.load(s).micro_batches[0].inputs.shape) for s in (2, 3)]
    assert shapes == [(4, 16), (2, 32)]  # twice the windows at half the length: a micro-batch keeps its tokens
    info = train_to_completion(whole)
    assert info is not None and info["model_config"]["rope_theta"] == 40000.0  # the export's: the last phase's
    assert info["model_config"]["block_size"] == 32

    overrides = tiny_overrides(token_dir, tmp_path / "cut", steps=6, context_schedule=SCHEDULE, **LLAMA,
                               **{"checkpoint.interval_steps": 2})  # fmt: skip
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, json.dumps(overrides)], cwd=REPO, timeout=300,
                            capture_output=True, text=True)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = Trainer.from_config(config(tmp_path / "cut", **{"checkpoint.resume": True}), cpu)
    resumed.train()
    assert resumed.resumed_from[0]["checkpoint"] == "checkpoint_step_000000002"
    records = read_metrics(tmp_path / "whole")
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "cut")] == [(r["step"], r["loss"]) for r in records]
    assert [r["block_size"] for r in records] == [16, 16, 16, 32, 32, 32]
    assert len({r["step_tokens"] for r in records}) == 1  # a step keeps its tokens
    for name, value in whole.gpt.state_dict().items():
        assert torch.equal(resumed.gpt.state_dict()[name], value), name

    # An evaluation after a phase's last step scores that phase's windows, not the next one's.
    boundary = Trainer.from_config(config(tmp_path / "boundary", **{"checkpoint.enabled": False}), cpu)
    for _ in range(3):
        boundary.run_step()
    assert boundary.val_batches.windows.block_size == 16 and boundary.gpt.rope_theta == 10000.0
    boundary.run_step()
    assert boundary.val_batches.windows.block_size == 32 and boundary.gpt.rope_theta == 40000.0
    boundary.close()


@pytest.mark.parametrize(
    ("schedule", "named"),
    [
        ([{"from_step": 1, "block_size": 32}], "must start at 0"),
        ([{"from_step": 0, "block_size": 16}], "the last phase's block_size \\(16\\) must be model.block_size"),
        ([{"from_step": 0, "block_size": 12}, {"from_step": 2, "block_size": 32}], "12\\] does not divide"),
        ([{"from_step": 0, "block_size": 16}, {"from_step": 20, "block_size": 32}], "after the run's last step"),
        (
            [
                {"from_step": 0, "block_size": 32},
                {"from_step": 2, "block_size": 16},
                {"from_step": 4, "block_size": 32},
            ],
            "may not shrink the context",
        ),
    ],
)
def test_a_context_schedule_that_cannot_keep_a_steps_tokens_is_refused(schedule: list, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        TrainConfig.model_validate({"model": {"block_size": 32}, "steps": 10, "context_schedule": schedule})
    with pytest.raises(ValueError, match=r"rope_theta is set only with model\.arch llama"):
        TrainConfig.model_validate({"model": {"block_size": 32}, "context_schedule": SCHEDULE})
