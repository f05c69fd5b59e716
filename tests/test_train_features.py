"""Trainer features the READMEs name, each exercised on CPU with the tiny model for a few steps:
bf16 (autocast for single, FSDP2's MixedPrecisionPolicy over two gloo ranks), activation checkpointing,
torch.compile, and time-based checkpoints (``checkpoint.interval_seconds``). W&B is not installed here:
see train/README.md, "Tested and untested"."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gloo_ranks import FlushedQueue, cpu_rank, run_gloo_ranks
from torch.distributed.tensor import DTensor
from train_fixtures import tiny_overrides

from checkpoints.manifest import list_checkpoints, verify
from train.config import TrainConfig, load_config
from train.optim import learning_rate
from train.parallel import DistContext
from train.preflight import check_data
from train.trainer import StepInfo, Trainer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
CPU = DistContext(rank=0, world_size=1, device=torch.device("cpu"))
STEPS = 4


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def make_config(data: Path, out: Path, **extra: object) -> TrainConfig:
    overrides = {"steps": STEPS, "checkpoint.enabled": False} | extra
    config = load_config(None, tiny_overrides(data, out, **overrides))
    check_data(config)
    return config


def dtypes_seen(trainer: Trainer) -> list[torch.dtype]:
    """The dtype of the first block's qkv matmul output, once per forward: what the compute ran in."""
    seen: list[torch.dtype] = []
    trainer.gpt.blocks[0].attn.qkv.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    return seen


def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_weights(token_dir: Path, tmp_path: Path) -> None:
    fp32 = Trainer.from_config(make_config(token_dir, tmp_path / "fp32"), CPU)
    bf16 = Trainer.from_config(make_config(token_dir, tmp_path / "bf16", **{"parallel.precision": "bf16"}), CPU)
    seen = dtypes_seen(bf16)
    reference = [fp32.train_step()["loss"] for _ in range(STEPS)]
    losses = [bf16.train_step()["loss"] for _ in range(STEPS)]
    assert seen and set(seen) == {torch.bfloat16}  # the matmuls ran under autocast
    assert all(p.dtype == torch.float32 for p in bf16.gpt.parameters())  # master weights stay fp32
    assert all(s.dtype == torch.float32 for st in bf16.optimizer.state.values() for s in st.values())
    # Same data and init: bf16 rounding moves the losses by well under 1%, but it does move them.
    assert losses == pytest.approx(reference, rel=1e-2) and losses != reference


def run_two_gloo_ranks(worker: Callable[..., None], *args: object) -> list[dict]:
    """``worker(rank, world, port, *args, queue)`` on two gloo ranks; what each put on the queue, by rank."""
    return sorted(run_gloo_ranks(worker, 2, *args), key=lambda r: r["rank"])


def _fsdp_bf16_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        overrides = {"parallel.strategy": "fsdp", "parallel.workers": 2, "parallel.precision": "bf16"}
        trainer = Trainer.from_config(make_config(Path(data), Path(out), **overrides), ctx)
        seen = dtypes_seen(trainer)
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        params = list(trainer.gpt.parameters())
        states = [s for state in trainer.optimizer.state.values() for s in state.values()]
        queue.put(
            {
                "rank": rank,
                "losses": losses,
                "compute_dtypes": sorted({str(d) for d in seen}),
                "sharded": all(isinstance(p, DTensor) for p in params),
                "param_dtypes": sorted({str(p.dtype) for p in params}),
                "optimizer_dtypes": sorted({str(s.dtype) for s in states}),
            }
        )


@pytest.mark.slow
def test_fsdp_bf16_mixed_precision_policy(token_dir: Path, tmp_path: Path) -> None:
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on two gloo ranks: the blocks
    compute in bf16 from fp32 sharded master weights, and the losses track the fp32 single-process run."""
    results = run_two_gloo_ranks(_fsdp_bf16_worker, str(token_dir), str(tmp_path / "fsdp"))
    reference = Trainer.from_config(make_config(token_dir, tmp_path / "fp32"), CPU)
    expected = [reference.train_step()["loss"] for _ in range(STEPS)]
    for r in results:
        assert r["compute_dtypes"] == ["torch.bfloat16"], r
        assert r["sharded"] and r["param_dtypes"] == ["torch.float32"], r
        assert r["optimizer_dtypes"] == ["torch.float32"], r
        assert r["losses"] == results[0]["losses"]  # the global loss, all-reduced: the same on both ranks
        assert r["losses"] == pytest.approx(expected, rel=1e-2) and r["losses"] != expected


def _guard_worker(rank: int, world: int, port: int, data: str, out: str, strategy: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        overrides = {"parallel.strategy": strategy, "parallel.workers": 2, "steps": 5}
        trainer = Trainer.from_config(make_config(Path(data), Path(out), **overrides), ctx)
        if rank == 1:  # one rank's forward blows up at step 2; the other's is healthy
            trainer.gpt.blocks[0].register_forward_hook(
                lambda module, args, output: output * float("nan") if trainer.step == 2 else output
            )
        skipped, digests = [], []
        for _ in range(5):
            skipped.append(trainer.optimizer_step().record["skipped"])
            digests.append(trainer.check_replicas()[rank] if strategy == "ddp" else None)
        queue.put({"rank": rank, "skipped": skipped, "digests": digests, "bad_steps": trainer.bad_steps})


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_bad_step_on_one_rank_is_skipped_by_every_rank_at_the_same_step(
    token_dir: Path, tmp_path: Path, strategy: str
) -> None:
    """Two gloo ranks; only rank 1's loss goes non-finite, at step 2. Both ranks reach the same verdict, skip that
    step's update and carry on; DDP replicas stay identical (the update they skipped was skipped everywhere)."""
    results = run_two_gloo_ranks(_guard_worker, str(token_dir), str(tmp_path / "run"), strategy)
    for r in results:
        assert r["skipped"] == [False, False, True, False, False], r
        assert [b["step"] for b in r["bad_steps"]] == [2], r
    assert "non-finite loss" in results[1]["bad_steps"][0]["reasons"]
    if strategy == "ddp":
        assert results[0]["digests"] == results[1]["digests"]


def _rollback_worker(rank: int, world: int, port: int, data: str, out: str, strategy: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        overrides = {
            "parallel.strategy": strategy,
            "parallel.workers": 2,
            "steps": 8,
            "checkpoint.enabled": True,
            "checkpoint.interval_steps": 2,
            "checkpoint.rollback_after_bad": 1,
            "checkpoint.rollback_lr_factor": 0.25,
            "checkpoint.rollback_lr_steps": 2,
        }
        trained: list[tuple[int, float]] = []  # (step, lr) of every step this rank trained and kept

        def record(info: StepInfo) -> None:
            if not info.record.get("skipped"):
                trained.append((info.step, info.record["lr"]))

        trainer = Trainer.from_config(make_config(Path(data), Path(out), **overrides), ctx, on_step_end=record)
        if rank == 1:  # only this rank's forward blows up, on the batch of data step 5
            trainer.gpt.blocks[0].register_forward_hook(
                lambda module, args, output: output * float("nan") if trainer.data_step == 5 else output
            )
        trainer.train()
        queue.put(
            {
                "rank": rank,
                "rollbacks": trainer.rollbacks,
                "trained": trained,
                "steps": (trainer.step, trainer.data_step),
                "digest": trainer.check_replicas()[rank] if strategy == "ddp" else None,
            }
        )


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rollback_after_one_ranks_bad_step_lowers_the_lr_on_every_rank_alike(
    token_dir: Path, tmp_path: Path, strategy: str
) -> None:
    """Two gloo ranks, a checkpoint every 2 steps; only rank 1's loss goes non-finite, at step 5. Both ranks roll back
    to the step-4 checkpoint together, skip the bad data window, train steps 4 and 5 again at a quarter of the
    schedule's LR, then follow the schedule; DDP replicas end identical."""
    results = run_two_gloo_ranks(_rollback_worker, str(token_dir), str(tmp_path / "run"), strategy)
    config = make_config(token_dir, tmp_path / "schedule", steps=8)
    schedule = {step: learning_rate(step, 8, config.optimizer) for step in range(8)}
    for r in results:
        [rollback] = r["rollbacks"]
        assert (rollback["bad_step"], rollback["restored_step"], rollback["lr_factor_until_step"]) == (5, 4, 6), r
        assert r["steps"] == (8, 10)  # 8 steps trained; two data steps skipped
        steps = [step for step, _ in r["trained"]]
        assert steps == [0, 1, 2, 3, 4, 4, 5, 6, 7], r  # step 4 before the bad step 5, then again after the rollback
        again = dict(r["trained"][5:])
        assert again == {4: 0.25 * schedule[4], 5: 0.25 * schedule[5], 6: schedule[6], 7: schedule[7]}, r
    assert results[0]["trained"] == results[1]["trained"] and results[0]["rollbacks"] == results[1]["rollbacks"]
    if strategy == "ddp":
        assert results[0]["digest"] == results[1]["digest"]


def test_activation_checkpointing_recomputes_blocks_and_changes_nothing_else(token_dir: Path, tmp_path: Path) -> None:
    plain = Trainer.from_config(make_config(token_dir, tmp_path / "plain"), CPU)
    ac = Trainer.from_config(
        make_config(token_dir, tmp_path / "ac", **{"parallel.activation_checkpointing": True}), CPU
    )
    calls = {"plain": 0, "ac": 0}
    for name, trainer in (("plain", plain), ("ac", ac)):
        # A pre-hook: the recomputation stops early once it has what backward needs (checkpoint's default
        # early stop), so it never reaches a block's forward (post-)hook.
        trainer.gpt.blocks[0].register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    losses = {name: [t.train_step()["loss"] for _ in range(STEPS)] for name, t in (("plain", plain), ("ac", ac))}
    micro_steps = STEPS * plain.grad_accum
    # Each block's forward runs again in backward under checkpointing: twice per micro-batch instead of once.
    assert calls == {"plain": micro_steps, "ac": 2 * micro_steps}
    assert losses["ac"] == losses["plain"]  # recomputation is the same arithmetic: bitwise equal
    for (name, value), other in zip(plain.gpt.state_dict().items(), ac.gpt.state_dict().values(), strict=True):
        assert torch.equal(value, other), name


@pytest.mark.slow
def test_torch_compile_compiles_the_whole_model_and_keeps_names_and_losses(token_dir: Path, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    eager = Trainer.from_config(make_config(token_dir, tmp_path / "eager"), CPU)
    compiled = Trainer.from_config(make_config(token_dir, tmp_path / "compiled", **{"parallel.compile": True}), CPU)
    graphs_before = counters["stats"]["unique_graphs"]
    expected = [eager.train_step()["loss"] for _ in range(STEPS)]
    losses = [compiled.train_step()["loss"] for _ in range(STEPS)]
    assert counters["stats"]["unique_graphs"] > graphs_before  # dynamo really captured graphs
    # single: one graph for the whole model with its loss (embeddings, final LayerNorm, tied projection included)
    assert compiled.gpt._compiled_call_impl is not None
    # Compiled in place: the state dict (checkpoints, export) keeps the plain names.
    assert list(compiled.gpt.state_dict()) == list(eager.gpt.state_dict())
    assert losses == pytest.approx(expected, rel=1e-4)


def _fsdp_compile_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    from torch._dynamo.utils import counters

    with cpu_rank(rank, world, port) as ctx:
        fsdp = {"parallel.strategy": "fsdp", "parallel.workers": world}
        eager = Trainer.from_config(make_config(Path(data), Path(out) / "eager", **fsdp), ctx)
        compiled = Trainer.from_config(
            make_config(Path(data), Path(out) / "compiled", **fsdp, **{"parallel.compile": True}), ctx
        )
        expected = [eager.train_step()["loss"] for _ in range(STEPS)]
        losses = [compiled.train_step()["loss"] for _ in range(STEPS)]
        queue.put(
            {
                "rank": rank,
                "expected": expected,
                "losses": losses,
                "graphs": counters["stats"]["unique_graphs"],
                # Each block's forward is the compiled function; the block's call (with FSDP2's hooks) is not.
                "forwards_compiled": [hasattr(b.forward, "_torchdynamo_orig_callable") for b in compiled.gpt.blocks],
                "calls_compiled": [b._compiled_call_impl is not None for b in compiled.gpt.blocks],
                "sharded": any(isinstance(p, DTensor) for p in compiled.gpt.parameters()),
            }
        )


@pytest.mark.slow
def test_torch_compile_under_fsdp_compiles_each_block_forward_between_hooks(token_dir: Path, tmp_path: Path) -> None:
    """FSDP2, one gloo rank: each block's forward is compiled, its hooks (all-gather, reshard) are left around the
    compiled regions, one graph serves every block (no recompiles), and the losses are the eager run's."""
    (result,) = run_gloo_ranks(_fsdp_compile_worker, 1, str(token_dir), str(tmp_path))
    assert result["sharded"] and all(result["forwards_compiled"]) and not any(result["calls_compiled"])
    assert result["graphs"] == 1, result
    assert result["losses"] == pytest.approx(result["expected"], rel=1e-4)


def _fsdp_reshard_worker(rank: int, world: int, port: int, data: str, out: str, queue: FlushedQueue) -> None:
    with cpu_rank(rank, world, port) as ctx:
        result: dict = {"rank": rank}
        for policy in ("always", "default", "never"):
            fsdp = {"parallel.strategy": "fsdp", "parallel.workers": 2, "parallel.fsdp_reshard_after_forward": policy}
            config = make_config(Path(data), Path(out) / policy, **fsdp)
            trainer = Trainer.from_config(config, ctx)
            # Which blocks hold their shards (DTensor parameters) rather than the gathered parameters: as a micro-
            # step starts (the embeddings), and once every block has run forward (the final LayerNorm).
            seen: dict[str, list[list[bool]]] = {"start": [], "after_blocks": []}

            def sharded(when: str, *_: object, seen: dict = seen, trainer: Trainer = trainer) -> None:
                seen[when].append([isinstance(b.attn.qkv.weight, DTensor) for b in trainer.gpt.blocks])

            trainer.gpt.wte.register_forward_hook(functools.partial(sharded, "start"))
            trainer.gpt.ln_f.register_forward_hook(functools.partial(sharded, "after_blocks"))
            losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
            at_rest = all(isinstance(p, DTensor) for p in trainer.gpt.parameters())
            result[policy] = {"losses": losses, "seen": seen, "at_rest_sharded": at_rest}
        queue.put(result)


@pytest.mark.slow
def test_fsdp_reshard_policies_keep_what_they_say_and_train_alike(token_dir: Path, tmp_path: Path) -> None:
    """``parallel.fsdp_reshard_after_forward`` over two gloo ranks, 2 blocks and 2 micro-steps a step: ``always``
    frees every block's gathered parameters after its forward, ``default`` every block but the last, ``never``
    none, and keeps them gathered into the next micro-step; every policy steps the shards (all sharded between
    steps) and trains to the same losses."""
    for result in run_two_gloo_ranks(_fsdp_reshard_worker, str(token_dir), str(tmp_path)):
        always, default, never = result["always"], result["default"], result["never"]
        assert always["losses"] == default["losses"] == never["losses"]
        assert all(p["at_rest_sharded"] for p in (always, default, never))
        micro_steps = 2 * STEPS
        assert always["seen"]["after_blocks"] == [[True, True]] * micro_steps
        assert default["seen"]["after_blocks"] == [[True, False]] * micro_steps
        assert never["seen"]["after_blocks"] == [[False, False]] * micro_steps
        # Each step's first micro-step starts from the shards; under never, its second one from the parameters
        # the first gathered (the others gather again).
        assert always["seen"]["start"] == default["seen"]["start"] == [[True, True]] * micro_steps
        assert never["seen"]["start"] == [[True, True], [False, False]] * STEPS


def test_fused_adamw_is_chosen_for_gpus_only_and_matches_the_default(token_dir: Path, tmp_path: Path) -> None:
    plain = Trainer.from_config(make_config(token_dir, tmp_path / "plain"), CPU)
    fused = Trainer.from_config(make_config(token_dir, tmp_path / "fused", **{"optimizer.fused": True}), CPU)
    assert not plain.optimizer.defaults["fused"]  # None on CPU parameters: PyTorch's default loop, as before
    assert fused.optimizer.defaults["fused"]
    expected = [plain.train_step()["loss"] for _ in range(STEPS)]
    assert [fused.train_step()["loss"] for _ in range(STEPS)] == pytest.approx(expected, rel=1e-5)
    for (name, value), other in zip(plain.gpt.state_dict().items(), fused.gpt.state_dict().values(), strict=True):
        if name.endswith("attn.qkv.bias"):
            # The keys' bias gets no gradient but rounding noise (a softmax is unchanged when every score q.b_k shifts
            # alike), which Adam scales up to steps of its learning rate: the two implementations' roundings show
            # there alone (1.3e-6 after 4 steps on an AVX-512 CPU, every other entry within 3e-8).
            (q, k, v), (q2, k2, v2) = value.view(3, -1), other.view(3, -1)
            assert torch.allclose(torch.cat([q, v]), torch.cat([q2, v2]), atol=1e-6), name
            assert torch.allclose(k, k2, atol=1e-5), name
        else:
            assert torch.allclose(value, other, atol=1e-6), name


def test_interval_seconds_saves_after_a_slow_step_and_not_before(token_dir: Path, tmp_path: Path) -> None:
    """interval_steps off, interval_seconds on: the checkpointer's clock (the test's own) stands still through
    steps 0-2 (no save), then moves past the interval at the end of step 2, so the save check after step 3 saves."""
    interval = 1.5
    now = [0.0]

    def slow_step_2(info: StepInfo) -> None:
        if info.step == 2:
            now[0] += interval + 0.1

    overrides = {
        "checkpoint.enabled": True,
        "checkpoint.interval_steps": 0,
        "checkpoint.interval_seconds": interval,
        "checkpoint.save_best": False,
        "checkpoint.save_final": False,
    }
    trainer = Trainer.from_config(
        make_config(token_dir, tmp_path, **overrides), CPU, on_step_end=slow_step_2, clock=lambda: now[0]
    )
    records = [trainer.run_step() for _ in range(STEPS)]
    saved = [r["step"] for r in records if "checkpoints" in r]
    assert saved == [3]  # not before the slow step, and right after it
    manifest = verify(tmp_path / "checkpoint_step_000000004")
    assert manifest["kinds"] == ["periodic"] and manifest["step"] == 4
    assert "checkpoint_step_000000004" in [p.name for p in list_checkpoints(tmp_path)]


def test_init_seed_sets_the_initial_weights_apart_from_the_data_order(token_dir: Path, tmp_path: Path) -> None:
    def start(name: str, **seeds: object) -> tuple[dict[str, torch.Tensor], list]:
        trainer = Trainer.from_config(make_config(token_dir, tmp_path / name, **seeds), CPU)
        weights = {k: v.clone() for k, v in trainer.gpt.state_dict().items()}
        return weights, trainer.train_batches.position(0)["rank_windows"]

    base, base_data = start("base", **{"data.seed": 1})
    same_init, other_data = start("init", **{"data.seed": 2, "init_seed": 1})
    other_init, same_data = start("data", **{"data.seed": 1, "init_seed": 2})
    assert all(torch.equal(base[k], same_init[k]) for k in base) and other_data != base_data
    assert not torch.equal(base["wte.weight"], other_init["wte.weight"]) and same_data == base_data
