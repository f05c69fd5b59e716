"""The ablation harness (train.ablation): real training runs through Ray Train on two data variants, two seeds each,
judged on a held-out set; then a rerun that reuses them; and the plan and statistics on their own."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import ray
import yaml
from tokenizers import Tokenizer
from train_fixtures import build_token_dir, load_documents, tiny_overrides

from ground.overrides import ConfigError, load
from train.ablation import AblationSpec, main, plan
from train.ablation_stats import compare
from train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
# Relative, as a spec in the repository names it: the runs' Ray Train workers start in another directory.
HELDOUT = [{"name": "gsm8k", "path": "data/eval-sets/gsm8k-test.jsonl", "field": "question"}]


def spec_dict(token_dir: Path, output: Path, variants: list[dict], seeds: list[int] = [1, 2, 3]) -> dict:  # noqa: B006
    common = {k: v for k, v in tiny_overrides(token_dir, output).items() if k not in ("data_dir", "output_dir")}
    return {
        "output": str(output),
        "data": str(token_dir),
        "steps": 30,
        "set": common | {"data.eval_interval": 0, "data.heldout": HELDOUT},
        "seeds": seeds,
        "metric": "val_bpb/gsm8k",
        "variants": variants,
    }


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.ray
def test_an_ablation_finds_the_planted_bad_data_worse_and_reuses_its_runs(
    token_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Baseline: the cc_net text. Variant: the same documents written backwards, tokenized with the same tokenizer
    (bad data with a plausible look). Both score GSM8K's questions, English prose that neither trains on."""
    tokenizer = Tokenizer.from_file(str(token_dir / "tokenizer.json"))
    backwards = build_token_dir(tmp_path / "backwards", docs=[d[::-1] for d in load_documents()], tokenizer=tokenizer)
    output = tmp_path / "ablation"
    spec = write_spec(
        tmp_path / "spec.yaml",
        spec_dict(token_dir, output, [{"name": "clean"}, {"name": "backwards", "data": str(backwards)}]),
    )
    monkeypatch.chdir(REPO)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main([str(spec), "--concurrent", "2"]) == 0  # two runs at a time, each driver in a Ray task
        first = json.loads((output / "ablation.json").read_text())
        stamps = {r["run_dir"]: (Path(r["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns for r in first["runs"]}
        assert main([str(spec)]) == 0  # everything finished: nothing trains again
    finally:
        ray.shutdown()
    printed = capsys.readouterr().out
    second = json.loads((output / "ablation.json").read_text())

    assert [(r["variant"], r["seed"], r["status"]) for r in first["runs"]] == [
        (variant, seed, "trained") for variant in ("clean", "backwards") for seed in (1, 2, 3)
    ]
    assert {r["status"] for r in second["runs"]} == {"reused"}
    assert {r["run_dir"]: (Path(r["run_dir"]) / "metrics.jsonl").stat().st_mtime_ns for r in second["runs"]} == stamps
    assert len({Path(r["run_dir"]).parent for r in first["runs"]}) == 2  # one dir per variant, a subdir per seed

    # The numbers judged are the runs' own last evaluations, and the noise is the baseline's seed-to-seed spread.
    def last_bpb(run_dir: str) -> float:
        return [r for r in read_metrics(run_dir) if "val_loss" in r][-1]["val_bpb/gsm8k"]

    clean = [last_bpb(r["run_dir"]) for r in first["runs"] if r["variant"] == "clean"]
    (gsm8k,) = [m for m in first["verdicts"]["compared"] if m["metric"] == "val_bpb/gsm8k"]
    assert gsm8k["noise"] == pytest.approx(statistics.stdev(clean))
    backwards_cmp = gsm8k["variants"]["backwards"]
    assert backwards_cmp["verdict"] == "worse" and backwards_cmp["delta"] > 0 and backwards_cmp["p_value"] < 0.05
    # Each variant's own val split is different text: reported, never judged.
    assert "val_bpb/data" in first["verdicts"]["not_compared"]
    assert second["verdicts"] == first["verdicts"]
    assert "verdict on val_bpb/gsm8k: backwards worse (against clean)" in printed


def test_the_plan_keys_each_variants_runs_by_its_config(token_dir: Path, tmp_path: Path) -> None:
    """An unchanged variant keeps its dirs; an edited one gets new ones; the seeds differ only in data.seed."""
    variants = [{"name": "base"}, {"name": "lr", "set": {"optimizer.lr": 1e-3}}]
    spec = AblationSpec.model_validate(spec_dict(token_dir, tmp_path, variants))
    runs = plan(spec)
    assert [(r.variant, r.seed) for r in runs] == [(v, seed) for v in ("base", "lr") for seed in (1, 2, 3)]
    assert [r.config.data.seed for r in runs] == [1, 2, 3, 1, 2, 3]
    assert runs[3].config.optimizer.lr == 1e-3 and runs[0].config.optimizer.lr != 1e-3
    assert all(r.config.checkpoint.resume for r in runs)  # an interrupted run resumes from its checkpoints
    edited = spec_dict(token_dir, tmp_path, [{"name": "base"}, {"name": "lr", "set": {"optimizer.lr": 2e-3}}])
    again = plan(AblationSpec.model_validate(edited))
    dirs = [r.config.output_dir for r in runs]
    assert [r.config.output_dir for r in again][:3] == dirs[:3]
    assert all(Path(a.config.output_dir).parent != Path(b).parent for a, b in zip(again[3:], dirs[3:], strict=True))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"seeds": [1]}, "seeds"),
        ({"seeds": [3, 3]}, "seeds repeat"),
        ({"variants": [{"name": "only"}]}, "variants"),
        ({"variants": [{"name": "a"}, {"name": "a"}]}, "variant names repeat"),
        ({"variants": [{"name": "a"}, {"name": "b", "set": {"data.seed": 5}}]}, "variants.b.set: data.seed"),
        ({"metric": "val_loss"}, "metric 'val_loss'"),
        ({"variants": [{"name": "a"}, {"name": "b/c"}]}, "variants.1.name"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(token_dir: Path, tmp_path: Path, change: dict, named: str) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(token_dir, tmp_path, [{"name": "a"}, {"name": "b"}]) | change)
    with pytest.raises(ConfigError, match=named):
        load(AblationSpec, spec)


def test_a_bad_train_key_in_a_variant_is_refused_before_any_run_naming_the_variant(
    token_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    variants = [{"name": "base"}, {"name": "typo", "set": {"optimizer.lrr": 1e-3}}]
    spec = write_spec(tmp_path / "spec.yaml", spec_dict(token_dir, tmp_path / "out", variants))
    assert main([str(spec)]) == 2
    err = capsys.readouterr().err
    assert "variants.typo:" in err and "optimizer.lrr: unknown key" in err
    assert not (tmp_path / "out").exists()  # refused before any run started


def test_verdicts_follow_welchs_test_and_the_noise() -> None:
    base = [3.10, 3.12, 3.11]
    assert compare(base, [2.50, 2.52, 2.51], alpha=0.05).verdict == "better"
    assert compare(base, [3.60, 3.62, 3.61], alpha=0.05).verdict == "worse"
    within = compare(base, [3.11, 3.13, 3.09], alpha=0.05)
    assert within.verdict == "within noise" and within.p_value > 0.05
    assert within.effect == pytest.approx((statistics.fmean([3.11, 3.13, 3.09]) - 3.11) / statistics.stdev(base))
    same = compare([2.0, 2.0], [2.0, 2.0], alpha=0.05)  # seeds that change nothing: exact, and no difference
    assert same.verdict == "within noise" and same.p_value == 1.0 and same.effect is None
    assert compare([2.0, 2.0], [2.5, 2.5], alpha=0.05).verdict == "worse"
    with pytest.raises(ValueError, match="two runs a side"):
        compare([1.0], [1.0, 2.0], alpha=0.05)
