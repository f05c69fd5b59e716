"""cluster.ablate without Ray: the spec's refusals, the trials it plans from a job spec, and the statistics. The
ablation itself (trials trained through the chain, an A/A twin and planted junk) is in tests/test_cluster_run.py,
where it shares the chain's curation."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import SAMPLE

from cluster.ablate import AblationSpec, main, plan
from cluster.ablation_stats import bootstrap_interval, compare_all, holm, paired_p_value
from cluster.run import training_plan
from cluster.run_spec import load_job
from ground.overrides import ConfigError, load

HELDOUT = [{"name": "gsm8k", "path": "data/eval-sets/gsm8k-test.jsonl", "field": "question"}]


def job_spec(tmp_path: Path, **sections: Any) -> Path:
    spec = {
        "root": str(tmp_path / "root"),
        "data": {"inputs": str(SAMPLE), "base": "pipeline/configs/demo.yaml"},
        "train": {"base": "train/configs/demo.yaml", "steps": 20, "data": {"heldout": HELDOUT}},
    } | sections
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def ablation(tmp_path: Path, variants: list[dict[str, Any]], **keys: Any) -> dict[str, Any]:
    return {"job": str(job_spec(tmp_path)), "output": str(tmp_path / "report"), "seeds": [1, 2, 3],
            "variants": variants} | keys  # fmt: skip


def test_the_plan_shares_curations_and_keys_each_trial_by_its_config(tmp_path: Path) -> None:
    variants = [{"name": "base"}, {"name": "lr", "set": {"train.optimizer.lr": 1e-3}},
                {"name": "strict", "set": {"data.language.min_score": 0.9}}]  # fmt: skip
    trials = plan(AblationSpec.model_validate(ablation(tmp_path, variants)))
    assert [(t.variant, t.seed) for t in trials] == [(v, s) for v in ("base", "lr", "strict") for s in (1, 2, 3)]
    curations = [t.chain.curated[0].location.uri for t in trials]
    assert len(set(curations[:6])) == 1 and len(set(curations[6:])) == 1 and curations[0] != curations[6]
    run_dirs = [t.run_dir for t in trials]
    assert len(set(run_dirs)) == 9  # the seed is a train key
    again = plan(AblationSpec.model_validate(ablation(tmp_path, variants[:2])))
    assert [t.run_dir for t in again] == run_dirs[:6]  # an unchanged trial keeps its directory: reused, not redone


@pytest.mark.parametrize(
    ("vary", "data_seeds", "init_seeds"),
    [("both", [1, 2, 3], [None] * 3), ("init", [1337] * 3, [1, 2, 3]), ("data", [1, 2, 3], [1, 1, 1])],
)
def test_vary_sets_the_init_seed_and_the_data_seed_apart(
    tmp_path: Path, vary: str, data_seeds: list[int], init_seeds: list[int | None]
) -> None:
    spec = AblationSpec.model_validate(ablation(tmp_path, [{"name": "a"}, {"name": "b"}], vary=vary))
    trials = plan(spec)[:3]
    assert [t.chain.train.job.train.data.seed for t in trials] == data_seeds
    assert [t.chain.train.job.train.init_seed for t in trials] == init_seeds


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"seeds": [1]}, "seeds"),
        ({"seeds": [3, 3, 4]}, "seeds repeat"),
        ({"variants": [{"name": "only"}]}, "variants"),
        ({"variants": [{"name": "a"}, {"name": "a"}]}, "variant names repeat"),
        ({"variants": [{"name": "a"}, {"name": "b", "seeds": [4, 5]}]}, "variants.b.seeds: 2 seeds"),
        ({"variants": [{"name": "a"}, {"name": "b", "set": {"train.data.seed": 5}}]}, "variants.b.set: train.data"),
        ({"set": {"train.init_seed": 5}}, "set: train.init_seed is the ablation's own"),
        ({"vary": "model"}, "vary: Input should be"),
        ({"metrics": ["val_loss"]}, "metrics: 'val_loss'"),
        ({"variants": [{"name": "a"}, {"name": "b/c"}]}, "variants.1.name"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_a_bad_ablation_is_refused_naming_the_field(tmp_path: Path, change: dict, named: str) -> None:
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(ablation(tmp_path, [{"name": "a"}, {"name": "b"}]) | change))
    with pytest.raises(ConfigError, match=named):
        load(AblationSpec, path)


@pytest.mark.parametrize(
    ("variants", "keys", "named"),
    [
        ([{"name": "base"}, {"name": "typo", "set": {"train.optimizer.lrr": 1e-3}}], {}, "variants.typo: .*lrr"),
        ([{"name": "base"}, {"name": "b"}], {"metrics": ["val_bpb/wiki"]}, "'val_bpb/wiki' names no set .*gsm8k"),
    ],
)
def test_a_trial_that_cannot_run_is_refused_before_any_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], variants: list, keys: dict, named: str
) -> None:
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(ablation(tmp_path, variants, **keys)))
    assert main([str(path)]) == 2
    assert re.search(named, capsys.readouterr().err)
    assert not (tmp_path / "root").exists() and not (tmp_path / "report").exists()


def test_the_planner_prices_the_trainings_before_any_runs_and_refuses_past_max_usd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = {"gpus": 1, "gpu_type": "A10G", "price_per_gpu_hour": 1.25}
    (tmp_path / "gpu").mkdir()
    job = job_spec(tmp_path / "gpu", cluster=cluster)  # ablation() writes the local job.yaml beside it
    variants = [{"name": "base"}, {"name": "long", "set": {"train.steps": 40}}]
    path = tmp_path / "ablation.yaml"
    path.write_text(yaml.safe_dump(ablation(tmp_path, variants) | {"job": str(job)}))
    assert main([str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    # One trial's training as cluster.run's plan stage prices it; the long variant trains twice the tokens.
    one = training_plan(load_job(str(job))).compute
    total = 3 * one.gpu_hours + 3 * 2 * one.gpu_hours
    assert f"plan: 6 trainings to run, 0 finished and reused; {total:,.2f} GPU-hours by the planner" in out, out
    assert f"${total * 1.25:,.2f}" in out and out.count("trial ") == 6
    assert not (tmp_path / "gpu" / "root").exists()  # nothing ran
    path.write_text(yaml.safe_dump(ablation(tmp_path, variants) | {"job": str(job), "max_usd": total}))
    assert main([str(path), "--plan"]) == 2
    assert f"over max_usd ${total:,.2f}" in capsys.readouterr().err
    # A variant whose model cannot fit the job's GPUs is refused by name before anything runs.
    big = {"train.model.n_layer": 48, "train.model.n_embd": 6144, "train.model.n_head": 48}
    path.write_text(yaml.safe_dump(ablation(tmp_path, [variants[0], {"name": "huge", "set": big}]) | {"job": str(job)}))
    assert main([str(path)]) == 2
    assert "variants.huge: " in (err := capsys.readouterr().err) and "does not fit on one A10G" in err, err
    assert not (tmp_path / "gpu" / "root").exists() and not (tmp_path / "report").exists()


def test_verdicts_pair_the_seeds_and_correct_for_several_metrics() -> None:
    base = {"a": [3.10, 3.12, 3.11], "b": [2.00, 2.02, 2.01]}
    worse = compare_all(base, {"a": [3.60, 3.63, 3.61], "b": [2.00, 2.03, 2.00]}, alpha=0.05)
    assert worse["a"].verdict == "worse" and worse["a"].interval[0] > 0
    assert worse["a"].delta == pytest.approx(0.5 + (0.01 - 0.00) / 3, abs=1e-9)
    assert worse["a"].snr == pytest.approx(abs(worse["a"].delta) / statistics.stdev(base["a"]))
    assert worse["b"].verdict == "no detectable difference"
    assert worse["a"].p_holm == pytest.approx(min(1.0, 2 * worse["a"].p_value))  # the smaller of two p-values
    better = compare_all(base, {"a": [2.50, 2.53, 2.51], "b": base["b"]}, alpha=0.05)
    assert better["a"].verdict == "better" and better["b"].p_value == 1.0  # equal pairs: exactly no difference
    assert compare_all({"a": [2.0, 2.0]}, {"a": [2.5, 2.5]}, alpha=0.05)["a"].verdict == "worse"  # exact
    with pytest.raises(ValueError, match="pairs two or more"):
        compare_all({"a": [1.0, 2.0]}, {"a": [1.0, 2.0, 3.0]}, alpha=0.05)


def test_holm_bootstrap_and_the_paired_test_against_direct_computations() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    low, high = bootstrap_interval([0.1, 0.2, 0.3])
    assert 0.1 <= low < 0.2 < high <= 0.3 and bootstrap_interval([0.1, 0.2, 0.3]) == (low, high)  # seeded
    low, high = bootstrap_interval([-0.1, 0.1, 0.05])
    assert low < 0 < high
    d = [0.3, 0.5, 0.4]
    t = statistics.fmean(d) / (statistics.stdev(d) / len(d) ** 0.5)
    from scipy import stats

    assert paired_p_value(d) == pytest.approx(2 * stats.t.sf(t, df=len(d) - 1))
