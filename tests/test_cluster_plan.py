"""The planner against worked public answers, and the CLI on the shipped example job specs.

References used below:
  - Dubey et al. 2024 (Llama 3): 405B trained on 15.6T tokens with 3.8e25 FLOPs; Llama 3.1 model card:
    30.84M H100 GPU-hours for 405B; Table 4: TP8·CP1·PP16·DP128 on 16,384 GPUs, 16M-token batches.
  - Brown et al. 2020 (GPT-3): 175B on 300B tokens, 3.14e23 FLOPs.
  - Hoffmann et al. 2022 (Chinchilla): 70B on 1.4T tokens, ~20 tokens/param; the §3.3 closed form.
  - Rajbhandari et al. 2020 (ZeRO), Figure 1: Ψ = 7.5B, N_d = 64 → 120 / 31.4 / 16.6 / 1.88 GB.
  - Korthikanti et al. 2022: per-layer activations; selective recomputation saves 70% (GPT-3) and 65%
    (MT-NLG) of activation memory.
  - Young 1974: √(2·60·86400) ≈ 3220 s.
  - GPT-2 parameter counts (Radford et al. 2019, as released): 124,439,808 / 354,823,168 / 774,030,080 /
    1,557,611,200.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from tokenizers import Tokenizer, models

from cluster import checkpointing, flops, memory, scaling
from cluster.job_spec import JobSpec, load_job_spec
from cluster.model_shape import gpt_param_count
from cluster.plan import main
from cluster.planner import build_plan
from cluster.run import plan_verdict, planned_vocab_size
from cluster.run_spec import Job, SpecError, load_job
from cluster.trainer_memory import predict_trainer_state_bytes
from ground.formats import EOT
from ground.gpus import GPUS, lookup_gpu
from pipeline.steps.tokenize import TokenizeConfig, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "cluster" / "jobs"


# ---------------------------------------------------------------- compute


def test_llama31_405b_training_flops_match_meta() -> None:
    assert flops.training_flops(405e9, 15.6e12) == pytest.approx(3.8e25, rel=0.01)


def test_gpt3_training_flops_match_brown_et_al() -> None:
    assert flops.training_flops(175e9, 300e9) == pytest.approx(3.14e23, rel=0.01)


def test_405b_gpu_hours_at_reported_mfu_are_near_the_model_card() -> None:
    # The model card's 30.84M H100-hours include restarts and evaluation; 6ND at 40% of 989 TF gives
    # 26.6M, within 20% of it.
    hours = flops.gpu_hours(flops.training_flops(405e9, 15.6e12), lookup_gpu("H100").bf16_dense_flops, 0.4)
    assert hours == pytest.approx(26.6e6, rel=0.01)
    assert abs(hours - 30.84e6) / 30.84e6 < 0.2
    assert flops.wall_clock_days(hours, 16384) == pytest.approx(hours / 16384 / 24)


def test_dollar_budget_buys_gpu_hours_times_sustained_rate() -> None:
    # $1M at $2/GPU-h = 500k GPU-h; at 40% of 989 TF that is 500e3 · 3600 · 395.6e12 FLOPs.
    assert flops.flops_for_dollars(1e6, 2.0, 989e12, 0.4) == pytest.approx(500e3 * 3600 * 989e12 * 0.4)


@pytest.mark.parametrize(
    ("n_layer", "n_embd", "expected"),
    [(12, 768, 124_439_808), (24, 1024, 354_823_168), (36, 1280, 774_030_080), (48, 1600, 1_557_611_200)],
)
def test_gpt2_parameter_counts(n_layer: int, n_embd: int, expected: int) -> None:
    assert gpt_param_count(n_layer, n_embd, 50257, 1024) == expected


# ---------------------------------------------------------------- sizing


def test_chinchilla_rule_recovers_chinchilla_70b() -> None:
    model = scaling.chinchilla_optimal(6 * 70e9 * 1.4e12)
    assert model.n_params == pytest.approx(70e9, rel=1e-9)
    assert model.tokens == pytest.approx(1.4e12, rel=1e-9)
    assert model.tokens_per_param == pytest.approx(20.0)
    assert model.n_params == pytest.approx(math.sqrt(model.train_flops / 120))


def test_training_only_optimum_is_hoffmann_closed_form() -> None:
    # Hoffmann et al. §3.3 closed form: N_opt(C) = G·(C/6)^(β/(α+β)), G = (αA/(βB))^(1/(α+β)).
    a, b = scaling.ALPHA, scaling.BETA
    g = (a * scaling.A_LOSS / (b * scaling.B_LOSS)) ** (1 / (a + b))
    for target in (2.2, 2.0, 1.9):
        opt = scaling.inference_aware_optimal(target, 0.0)
        assert opt.loss == pytest.approx(target, rel=1e-12)
        assert opt.n_params == pytest.approx(g * (opt.train_flops / 6) ** (b / (a + b)), rel=1e-9)


def _brute_force_total_flops(target: float, inference_tokens: float) -> float:
    delta = target - scaling.E_LOSS
    n_min = (scaling.A_LOSS / delta) ** (1 / scaling.ALPHA)
    best = math.inf
    for i in range(1, 20001):
        n = n_min * math.exp(i * 8.0 / 20000)  # up to e^8 × the smallest feasible model
        g = delta - scaling.A_LOSS / n**scaling.ALPHA
        d = (scaling.B_LOSS / g) ** (1 / scaling.BETA)
        best = min(best, 6 * n * d + 2 * n * inference_tokens)
    return best


@pytest.mark.parametrize("inference_tokens", [1e11, 2e12, 1e14])
def test_inference_aware_sizing_is_optimal_at_equal_loss(inference_tokens: float) -> None:
    target = scaling.chinchilla_optimal(6 * 70e9 * 1.4e12).loss
    aware = scaling.inference_aware_optimal(target, inference_tokens)
    train_only = scaling.sized(*_n_d(scaling.inference_aware_optimal(target, 0.0)), inference_tokens)
    assert aware.loss == pytest.approx(target, rel=1e-10)
    # Sardana et al.: with inference demand, a smaller model trained on more tokens is cheaper overall.
    assert aware.n_params < train_only.n_params
    assert aware.tokens > train_only.tokens
    assert aware.total_flops < train_only.total_flops
    # And it is the minimum: a dense brute-force search over N finds nothing cheaper.
    assert aware.total_flops <= _brute_force_total_flops(target, inference_tokens) * (1 + 1e-6)


def _n_d(model: scaling.SizedModel) -> tuple[float, float]:
    return model.n_params, model.tokens


def test_inference_aware_rejects_unreachable_loss() -> None:
    with pytest.raises(ValueError, match="irreducible"):
        scaling.inference_aware_optimal(scaling.E_LOSS, 1e12)


# ---------------------------------------------------------------- memory


def test_70b_mixed_precision_adam_state_is_1_1_tb() -> None:
    states = memory.model_state_bytes(70e9, zero_stage=0, dp=1)
    assert states.total == pytest.approx(16 * 70e9)
    assert states.total == pytest.approx(1.1e12, rel=0.02)
    assert (states.weights, states.gradients, states.optimizer) == (140e9, 140e9, 840e9)


@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_figure_1(stage: int, gb: float) -> None:
    states = memory.model_state_bytes(7.5e9, zero_stage=stage, dp=64)
    assert states.total / 1e9 == pytest.approx(gb, abs=0.05)


def test_tp_and_pp_divide_states_and_fp32_grads_double_gradients() -> None:
    base = memory.model_state_bytes(70e9, 0, 1)
    split = memory.model_state_bytes(70e9, 0, 1, tp=8, pp=2)
    assert split.total == pytest.approx(base.total / 16)
    fp32 = memory.model_state_bytes(70e9, 0, 1, grad_bytes=4.0)
    assert fp32.gradients == pytest.approx(2 * base.gradients)


def test_korthikanti_gpt3_per_layer_activations() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    assert 5 * a * s / h == 80
    none = memory.activation_bytes_per_layer(s, b, h, a, recompute="none")
    assert none == s * b * h * (34 + 80)
    assert memory.activation_bytes_per_layer(s, b, h, a, tp=8, recompute="none") == none / 8
    tp_only = memory.activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=False)
    assert tp_only == s * b * h * (10 + 24 / 8 + 80 / 8)
    selective = memory.activation_bytes_per_layer(s, b, h, a, tp=8, recompute="selective")
    # The paper: selective recomputation cuts GPT-3's activation memory by 70%.
    assert 1 - selective / (none / 8) == pytest.approx(0.70, abs=0.005)
    assert memory.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    assert memory.activation_bytes_per_layer(s, b, h, a, recompute="none", cp=2) == none / 2


def test_korthikanti_mt_nlg_selective_saving() -> None:
    s, h, a = 2048, 20480, 128  # MT-NLG 530B
    none = memory.activation_bytes_per_layer(s, 1, h, a, tp=8, recompute="none")
    selective = memory.activation_bytes_per_layer(s, 1, h, a, tp=8, recompute="selective")
    assert 1 - selective / none == pytest.approx(0.65, abs=0.005)


def test_pipeline_first_stage_holds_pp_microbatches_of_its_layers() -> None:
    # 1F1B: L/p layers × p micro-batches in flight = L layers' worth (Korthikanti §4.2.3) ...
    assert memory.first_stage_activation_bytes(1.0, n_layer=96, pp=8, grad_accum=64) == 96
    # ... but never more micro-batches than there are.
    assert memory.first_stage_activation_bytes(1.0, n_layer=96, pp=8, grad_accum=2) == 24


# ---------------------------------------------------------------- checkpointing


def test_young_interval_worked_example() -> None:
    interval = checkpointing.young_interval(60, 24 * 3600)
    assert interval == pytest.approx(math.sqrt(2 * 60 * 86400))
    assert round(interval) == 3220


def test_daly_refines_young() -> None:
    young = checkpointing.young_interval(60, 86400)
    daly = checkpointing.daly_interval(60, 86400)
    ratio = 60 / (2 * 86400)
    assert daly == pytest.approx(young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - 60)
    assert daly < young
    assert checkpointing.daly_interval(1e-3, 1e9) == pytest.approx(checkpointing.young_interval(1e-3, 1e9), rel=1e-5)
    assert checkpointing.daly_interval(100, 40) == 40  # C ≥ 2M: checkpoint every MTBF


def test_lost_work_and_overhead_at_young_optimum() -> None:
    c, m = 60.0, 86400.0
    tau = checkpointing.young_interval(c, m)
    assert checkpointing.expected_lost_seconds(tau, c) == pytest.approx(tau / 2 + c)
    # At τ = √(2CM), C/τ + τ/(2M) = √(2C/M); the extra C/M is the write a failure may interrupt.
    assert checkpointing.overhead_fraction(tau, c, m) == pytest.approx(math.sqrt(2 * c / m) + c / m)
    with pytest.raises(ValueError, match="positive"):
        checkpointing.young_interval(0, m)


# ---------------------------------------------------------------- job spec validation


def _spec(**overrides: object) -> dict:
    spec = yaml.safe_load((JOBS / "plan_llama70b_64xh100.yaml").read_text())
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        spec[section][key] = value
    return spec


def test_parallel_degrees_must_multiply_to_gpu_count() -> None:
    with pytest.raises(ValidationError, match=r"TP·PP·DP·CP = 8·1·4·1 = 32, but cluster.gpus = 64"):
        JobSpec.model_validate(_spec(parallelism__dp=4))


def test_tp_must_fit_in_a_node() -> None:
    spec = _spec(parallelism__tp=16, parallelism__dp=4)
    with pytest.raises(ValidationError, match=r"TP = 16 exceeds cluster\.gpus_per_node = 8"):
        JobSpec.model_validate(spec)


def test_unknown_gpu_lists_known_types() -> None:
    with pytest.raises(ValidationError, match=r"unknown GPU type 'V100'.*H100-80GB-SXM"):
        JobSpec.model_validate(_spec(cluster__gpu_type="V100"))


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        JobSpec.model_validate(_spec(training__learning_rate=3e-4))


def test_gpu_aliases_and_table() -> None:
    assert lookup_gpu("h100").name == "H100-80GB-SXM"
    assert lookup_gpu("A100 80GB").name == "A100-80GB"
    assert lookup_gpu("H100 PCIe").name == "H100-80GB-PCIe"
    assert set(GPUS) == {
        "A100-40GB",
        "A100-80GB",
        "H100-80GB-SXM",
        "H100-80GB-PCIe",
        "H100-94GB-NVL",
        "H200",
        "L4",
        "L40S",
        "A10",
        "A10G",
    }
    # Dense BF16 is half the datasheet's with-sparsity figure (H100 SXM: 1979 → 989).
    assert GPUS["H100-80GB-SXM"].bf16_dense_flops == 989e12
    assert GPUS["H200"].memory_bytes == 141e9


def test_fsdp_full_shard_is_zero_3_and_conflicts_are_errors() -> None:
    spec = JobSpec.model_validate(_spec(training__zero_stage=None, training__fsdp_sharding="FULL_SHARD"))
    assert spec.training.zero == 3
    with pytest.raises(ValidationError, match="FULL_SHARD is ZeRO stage 3"):
        JobSpec.model_validate(_spec(training__zero_stage=1, training__fsdp_sharding="FULL_SHARD"))


def test_activation_checkpointing_accepts_on_off() -> None:
    assert (
        JobSpec.model_validate(_spec(training__activation_checkpointing=True)).training.activation_checkpointing
        == "full"
    )
    off = JobSpec.model_validate(_spec(training__activation_checkpointing=False))
    assert off.training.activation_checkpointing == "none"


# ---------------------------------------------------------------- plans for the example specs


def test_gpt2_small_plan() -> None:
    spec = load_job_spec(JOBS / "plan_gpt2_small_8xa10g.yaml")
    plan = build_plan(spec)
    assert plan.model.n_params == 124_439_808
    assert plan.compute.training_flops == pytest.approx(6 * 124_439_808 * 10e9)
    assert plan.batch.global_batch_sequences == 8 * 8 * 8
    assert plan.batch.global_batch_tokens == 524_288
    per_layer = 1024 * 8 * 768 * (34 + 5 * 12 * 1024 / 768)
    assert plan.memory.activations_per_layer_bytes == pytest.approx(per_layer)
    logits = 4 * 1024 * 8 * 50257
    assert plan.memory.activations_bytes == pytest.approx(12 * per_layer + logits)
    assert plan.memory.model_states_bytes == pytest.approx(16 * 124_439_808)
    assert plan.memory.fits
    assert plan.trainer is not None
    assert plan.trainer.state_bytes_per_rank == predict_trainer_state_bytes(12, 12, 768, 1024, 50257, True, "ddp", 8)
    # MFU override changes time, not FLOPs.
    faster = build_plan(spec, mfu=0.8)
    assert faster.compute.gpu_hours == pytest.approx(plan.compute.gpu_hours / 2)


def test_llama70b_plan_fits_with_tp8_zero1_full_recompute() -> None:
    plan = build_plan(load_job_spec(JOBS / "plan_llama70b_64xh100.yaml"))
    m = plan.memory
    psi = 70.6e9 / 8
    assert m.weights_bytes == pytest.approx(2 * psi)
    assert m.optimizer_bytes == pytest.approx(12 * psi / 8)
    assert m.activations_per_layer_bytes == pytest.approx(2 * 8192 * 8192 / 8)
    assert m.fits and plan.parallelism.tp_within_node
    assert plan.checkpointing is not None
    assert plan.checkpointing.mtbf_seconds == pytest.approx(50000 * 3600 / 64)
    # Without recomputation the same job does not fit: 80 layers of s·b·h·(34 + 5as/h)/t.
    spec = JobSpec.model_validate(_spec(training__activation_checkpointing="none"))
    assert not build_plan(spec).memory.fits


def test_dollar_budget_drives_sizing() -> None:
    spec = JobSpec.model_validate({**_spec(), "budget": {"dollars": 1e6, "inference_tokens": 0}})
    plan = build_plan(spec)
    assert plan.sizing.budget_flops == pytest.approx(1e6 / 6.88 * 3600 * 989e12 * 0.4)
    assert plan.sizing.chinchilla.n_params == pytest.approx(math.sqrt(plan.sizing.budget_flops / 120))
    with pytest.raises(ValidationError, match="price_per_gpu_hour"):
        spec_dict = _spec()
        del spec_dict["cluster"]["price_per_gpu_hour"]
        JobSpec.model_validate({**spec_dict, "budget": {"dollars": 1e6}})


# ---------------------------------------------------------------- the chain's plan (python -m cluster.run)


def _chain_job(tmp_path: Path, tokenizer_path: str | None = None, **model: int) -> Job:
    """A cluster.run spec on the sample with the demo pipeline and train configs (``model``: train.model keys over
    them), planned for one L4."""
    data: dict[str, Any] = {"inputs": str(ROOT / "data" / "sample"), "base": str(ROOT / "pipeline/configs/demo.yaml")}
    if tokenizer_path is not None:
        data["tokenize"] = {"tokenizer_path": tokenizer_path}
    spec = {
        "root": str(tmp_path / "root"),
        "data": data,
        "train": {"base": str(ROOT / "train/configs/demo.yaml"), "model": model},
        "cluster": {"gpus": 1, "gpu_type": "L4", "gpus_per_node": 1},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_job(path)


def _gpt2_sized_tokenizer(path: Path) -> Path:
    """A tokenizer.json with GPT-2's 50,257 ids, EOT among them: the size is what the plan reads."""
    vocab = {EOT: 0, **{f"t{i}": i for i in range(1, 50257)}}
    Tokenizer(models.BPE(vocab=vocab, merges=[])).save(str(path))
    return path


def test_chain_plan_sizes_the_embedding_by_the_tokenizer_the_spec_names(tmp_path: Path) -> None:
    sentences = ["The planner reads the tokenizer the data stage will load.", "A model has one embedding table."] * 4
    path = tmp_path / "tokenizer.json"
    train_tokenizer(sentences, TokenizeConfig(vocab_size=300, min_frequency=1)).save(str(path))
    rows = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)  # what train/preflight.py checks
    job = _chain_job(tmp_path, str(path))
    assert rows != job.pipeline.tokenize.vocab_size  # the spec's own vocab_size (8192) sizes a trained tokenizer only
    assert planned_vocab_size(job) == rows
    status, detail = plan_verdict(job)
    m = job.train.model
    assert status == "done"
    n_params = gpt_param_count(m.n_layer, m.n_embd, rows, m.block_size, m.bias)
    assert detail.startswith(f"{n_params / 1e6:.1f}M parameters")
    assert planned_vocab_size(_chain_job(tmp_path)) == job.pipeline.tokenize.vocab_size  # no tokenizer named


def test_chain_plan_refuses_a_model_that_fits_only_with_the_specs_vocab_size(tmp_path: Path) -> None:
    # 6 × 4096 on one L4: the trainer's state fits with 8,192 embedding rows, not with GPT-2's 50,257.
    shape = {"n_layer": 6, "n_embd": 4096, "n_head": 32}
    assert plan_verdict(_chain_job(tmp_path, **shape))[0] == "done"
    job = _chain_job(tmp_path, str(_gpt2_sized_tokenizer(tmp_path / "gpt2.json")), **shape)
    with pytest.raises(SpecError, match=r"plan: train\.model does not fit on one L4"):
        plan_verdict(job)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("missing.json", "no such file"),
        ("not-json.json", "cannot read the tokenizer"),
        ("http://example.com/tokenizer.json", "unsupported scheme 'http'"),
    ],
)
def test_chain_plan_names_a_tokenizer_it_cannot_read(tmp_path: Path, name: str, problem: str) -> None:
    (tmp_path / "not-json.json").write_text("not a tokenizer")
    where = name if "://" in name else str(tmp_path / name)
    with pytest.raises(SpecError, match=r"data\.tokenize\.tokenizer_path") as refused:
        plan_verdict(_chain_job(tmp_path, where))
    assert where in str(refused.value) and problem in str(refused.value)


# ---------------------------------------------------------------- CLI


def test_cli_json_on_every_shipped_spec(capsys: pytest.CaptureFixture[str]) -> None:
    specs = sorted(JOBS.glob("plan_*.yaml"))
    assert {p.name for p in specs} >= {"plan_gpt2_small_8xa10g.yaml", "plan_llama70b_64xh100.yaml"}
    for path in specs:
        assert main(["--config", str(path), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert set(out) >= {"compute", "batch", "parallelism", "memory", "checkpointing", "sizing", "notes"}
        assert set(out["compute"]) >= {"training_flops", "gpu_hours", "wall_clock_days", "mfu"}
        memory_fields = {"weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"}
        assert set(out["memory"]) >= memory_fields | {"fits", "usable_bytes"}
        ckpt_fields = {"young_interval_seconds", "expected_lost_seconds_per_failure", "overhead_fraction"}
        assert set(out["checkpointing"]) >= ckpt_fields
        assert set(out["sizing"]) >= {"chinchilla", "inference_aware"}
        assert out["parallelism"]["product"] == out["parallelism"]["gpus"]


def test_cli_405b_spec_reports_meta_flops(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(JOBS / "plan_llama31_405b_16384xh100.yaml"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compute"]["training_flops"] == pytest.approx(3.8e25, rel=0.01)
    assert out["batch"]["global_batch_tokens"] == 2048 * 8192
    assert any("not divisible by PP" in note for note in out["notes"])


def test_cli_tables_render(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(JOBS / "plan_gpt2_small_8xa10g.yaml")]) == 0
    text = capsys.readouterr().out
    for heading in ("Compute and time", "Per-GPU memory", "Checkpointing", "Sizing", "Our trainer"):
        assert heading in text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"parallelism__dp": 4}, "TP·PP·DP·CP = 8·1·4·1 = 32, but cluster.gpus = 64"),
        ({"parallelism__tp": 16, "parallelism__dp": 4}, "exceeds cluster.gpus_per_node"),
        ({"cluster__gpu_type": "TPUv5"}, "unknown GPU type 'TPUv5'"),
    ],
)
def test_cli_bad_specs_exit_2_with_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: dict, message: str
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_spec(**overrides)))
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "invalid job spec" in err and message in err


def test_cli_missing_file_and_help() -> None:
    assert main(["--config", "/nonexistent/job.yaml"]) == 2
    result = subprocess.run(
        [sys.executable, "-m", "cluster.plan", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert "--config" in result.stdout and "--json" in result.stdout and "A10G" in result.stdout


def test_cli_set_overrides_the_spec_like_every_other_cli(capsys: pytest.CaptureFixture[str]) -> None:
    spec = str(JOBS / "plan_gpt2_small_8xa10g.yaml")
    assert main(["--config", spec, "--json", "--set", "training.mfu=0.5", "--set", "training.tokens=2e9"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["compute"]["mfu"] == 0.5
    assert plan["compute"]["training_flops"] == pytest.approx(6 * 124_439_808 * 2e9, rel=0.05)
    assert main(["--config", spec, "--set", "training.mfuu=0.5"]) == 2
    assert "training.mfuu: unknown key" in capsys.readouterr().err
    assert main(["--config", spec, "--set", "training.mfu"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_unreliable_cluster_is_reported_not_divided_by_zero(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # 0.01 h per GPU over 64 GPUs is a job MTBF of 0.56 s, far shorter than one 120 s checkpoint write.
    spec = _spec(reliability__mtbf_hours=0.01)
    plan = build_plan(JobSpec.model_validate(spec))
    assert plan.checkpointing is not None and plan.checkpointing.overhead_fraction >= 1
    assert plan.compute.wall_clock_days_with_failures is None
    assert any("never finish" in note for note in plan.notes)
    path = tmp_path / "flaky.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert main(["--config", str(path), "--json"]) == 0
    json.loads(capsys.readouterr().out)  # still strict JSON (no Infinity)


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB-SXM"),
        ("NVIDIA H100 PCIe", "H100-80GB-PCIe"),
        ("NVIDIA H100 NVL", "H100-94GB-NVL"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),  # not L4: names match word by word
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_cuda_device_names_resolve_to_one_gpu_table(device_name, expected):
    from ground.gpus import match_cuda_device
    from train.flops import lookup_peak_flops

    spec = match_cuda_device(device_name)
    assert (spec.name if spec else None) == expected
    # The trainer's MFU reads the same entry, and refuses approximate peaks rather than guessing.
    peak = lookup_peak_flops(device_name, "bf16")
    assert peak == (spec.bf16_dense_flops if spec and not spec.approximate else None)
