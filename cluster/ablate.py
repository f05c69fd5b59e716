"""python -m cluster.ablate ABLATION.yaml: which data makes the better model, decided with seeds, a noise baseline
and a verdict.

An ablation is a base job spec (``python -m cluster.run``'s) and a list of variants, the first the baseline, each a set
of job-spec overrides (``data.*``: the curation, its filters, inputs or mixture; ``train.*``: the run, its mixture
schedule, ...), trained once per seed (``train.data.seed``, the model's init and the data order; or, with ``vary``, one
of them alone: ``train.init_seed``). Each (variant, seed) is a trial: the job's chain up to ``train``, through the same
stages, keys and proofs as ``cluster.run``. So trials that curate the same way share one curation, a finished trial is
verified and reused, and a killed ablation resumes the stage it was in. Curations run one at a time (each uses the whole
cluster); trainings run ``--concurrent`` at a time, each trial's driver in a Ray task (plain Ray tasks: a trial is one
stage call with no search space to explore, and Ray Train already owns each run's failures, so Ray Tune's Tuner would
add a layer that decides nothing), its workers placed by Ray as usual.

What is compared: the last evaluation's bits per byte (``val_bpb/<name>``, comparable across tokenizers) wherever every
trial scored the same text: a held-out set (``train.data.heldout``) or a source whose val split (its manifest's
sha256) every trial shares. A source whose data differs between variants scores each model on its own text; it is
listed as not compared, never judged. Held-out sets are the ablation's yardstick. The statistics and the verdict are
cluster.ablation_stats'. The report goes to stdout and to ``OUTPUT/``: ablation.json (every number, each trial's
lineage), ablation.md, and ablation.png (the compared metrics' curves, a variant's mean with its seeds' range).
A trial that fails (diverged, a crash Ray Train gave up on) is recorded with its error, its variant gets no verdict,
and the exit status is 1.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.ablation_report import plot_curves, report_markdown, report_text
from cluster.ablation_stats import Comparison, compare_all, noise
from cluster.planner import ComputePlan
from cluster.run import Chain, KeyedChain, StageFailed, keyed_stages, training_plan
from cluster.run_spec import Job, SpecError, load_job
from cluster.stages import verified
from ground.logsetup import setup_logging
from ground.overrides import ConfigError, load
from ground.ray_address import add_address_option
from ground.storage import Location
from train.layout import FINAL_DIR, FINAL_INFO
from train.metrics import read_metrics

log = logging.getLogger(__name__)

RESULTS_FILE = "ablation.json"
BPB_PREFIX = "val_bpb/"
DATA_SEED, INIT_SEED = "train.data.seed", "train.init_seed"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Variant(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    set: dict[str, Any] = Field(default_factory=dict)  # job-spec keys, applied after the ablation's own `set`
    # Its own seeds (as many as the ablation's): an A/A twin of the baseline trains on other seeds than it.
    seeds: list[int] | None = None


class AblationSpec(_Spec):
    job: str = Field(min_length=1)  # the base job spec (cluster/jobs/*.yaml); its root holds every trial's stages
    output: str = Field(min_length=1)  # where the report goes: a path or a URI
    set: dict[str, Any] = Field(default_factory=dict)  # job-spec keys for every trial (as cluster.run's --set)
    seeds: list[int] = Field(min_length=2)  # at least two: one seed measures no noise
    # What a trial's seed sets: both the data order and the init (train.data.seed), the init alone (train.init_seed;
    # the data order stays the job's), or the data order alone (the init fixed at the first of `seeds`).
    vary: Literal["both", "init", "data"] = "both"
    alpha: float = Field(0.05, gt=0, lt=1)  # the family-wise error rate of a variant's verdicts
    metrics: list[str] = Field(default_factory=list)  # val_bpb/<set or source>; empty: every one that compares
    variants: list[Variant] = Field(min_length=2)  # the first is the baseline
    # The most the trainings may cost, priced by the planner before anything runs (needs cluster.price_per_gpu_hour).
    max_usd: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _well_formed(self) -> AblationSpec:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}")
        for where, seeds in [("seeds", self.seeds)] + [(f"variants.{v.name}.seeds", v.seeds) for v in self.variants]:
            if seeds is not None and len(set(seeds)) != len(seeds):
                raise ValueError(f"{where}: seeds repeat: {seeds}")
            if seeds is not None and len(seeds) != len(self.seeds):
                raise ValueError(f"{where}: {len(seeds)} seeds; the runs pair with the ablation's {len(self.seeds)}")
        for where, keys in [("set", self.set)] + [(f"variants.{v.name}.set", v.set) for v in self.variants]:
            if taken := [key for key in (DATA_SEED, INIT_SEED) if key in keys]:
                raise ValueError(f"{where}: {taken[0]} is the ablation's own: give seeds (and vary) instead")
        for metric in self.metrics:
            if not metric.startswith(BPB_PREFIX):
                raise ValueError(f"metrics: {metric!r}: an ablation compares bits per byte, {BPB_PREFIX}<name>")
        return self

    def seeds_of(self, variant: Variant) -> list[int]:
        return variant.seeds if variant.seeds is not None else self.seeds

    def seed_keys(self, seed: int) -> dict[str, int]:
        """The job-spec keys that one trial's seed sets (see ``vary``)."""
        if self.vary == "init":
            return {INIT_SEED: seed}
        if self.vary == "data":
            return {DATA_SEED: seed, INIT_SEED: self.seeds[0]}
        return {DATA_SEED: seed}


@dataclass(frozen=True)
class Trial:
    variant: str
    seed: int
    overrides: dict[str, Any]  # over the base job spec: what the trial is, rebuilt in a Ray task from these
    chain: KeyedChain
    compute: ComputePlan | None = None  # the planner's GPU-hours and cost of its training (None: a local run)

    @property
    def run_dir(self) -> str:
        return self.chain.train.out.location.uri


@dataclass
class TrialResult:
    variant: str
    seed: int
    run_dir: str
    status: str  # "trained", "reused" or "failed"
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation's val_bpb/<name>
    evaluated_on: dict[str, str] = field(default_factory=dict)  # each metric's text: a val split, a held-out file
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # each metric at every evaluation
    lineage: dict[str, Any] = field(default_factory=dict)  # the curations and the data the run trained on
    error: str | None = None


def scored_sets(job: Job) -> set[str]:
    """What a trial's evaluations score: its held-out sets and its sources (``data`` for one)."""
    return {h.name for h in job.train.data.heldout} | {s.name for s in job.sources}


def plan(spec: AblationSpec) -> list[Trial]:
    """Every trial's job and stages, all resolved before anything runs: a bad key fails the ablation at once, naming
    its variant, and so does a metric that names no set a trial scores."""
    trials = []
    for variant in spec.variants:
        for seed in spec.seeds_of(variant):
            overrides = spec.set | variant.set | spec.seed_keys(seed)
            try:
                job = load_job(spec.job, overrides)
            except SpecError as exc:
                raise SpecError(f"variants.{variant.name}: {exc}") from exc
            for metric in spec.metrics:
                if metric.removeprefix(BPB_PREFIX) not in scored_sets(job):
                    raise SpecError(
                        f"metrics: {metric!r} names no set that variant {variant.name!r} scores "
                        f"(its held-out sets and sources: {', '.join(sorted(scored_sets(job)))})"
                    )
            try:
                planned = training_plan(job)
            except SpecError as exc:
                raise SpecError(f"variants.{variant.name}: {exc}") from exc
            compute = planned.compute if planned is not None else None
            trials.append(Trial(variant.name, seed, overrides, keyed_stages(job), compute))
    return trials


@dataclass(frozen=True)
class Price:
    """What the ablation's trainings cost by the planner, over the trials it will train (the finished ones are
    reused and cost nothing)."""

    trials: int  # to train
    reused: int
    gpu_hours: float | None  # None: local runs, nothing to price
    cost_usd: float | None  # None: no cluster.price_per_gpu_hour

    def describe(self) -> str:
        what = f"{self.trials} trainings to run, {self.reused} finished and reused"
        if self.gpu_hours is None:
            return f"{what}; no cluster section: local runs, not priced"
        cost = f", ${self.cost_usd:,.2f}" if self.cost_usd is not None else " (no cluster.price_per_gpu_hour: no cost)"
        return f"{what}; {self.gpu_hours:,.2f} GPU-hours by the planner{cost}"


def price(spec: AblationSpec, trials: list[Trial]) -> Price:
    """The planner's price of the trainings still to run; refused past ``max_usd`` (``SpecError`` naming both)."""
    todo = [t for t in trials if verified(t.chain.train.out.location)[0] is None]
    computes = [t.compute for t in todo if t.compute is not None]
    hours = sum(c.gpu_hours for c in computes) if computes else None
    costs = [c.cost_usd for c in computes if c.cost_usd is not None]
    cost = sum(costs) if computes and len(costs) == len(computes) else None
    if spec.max_usd is not None:
        if cost is None and todo:
            raise SpecError("max_usd: the trainings have no price: give the job's cluster.price_per_gpu_hour")
        if cost is not None and cost > spec.max_usd:
            raise SpecError(
                f"max_usd: the planner prices the {len(todo)} trainings to run at ${cost:,.2f} "
                f"({hours:,.2f} GPU-hours), over max_usd ${spec.max_usd:,.2f}"
            )
    return Price(len(todo), len(trials) - len(todo), hours, cost)


def read_result(trial: Trial, status: str) -> TrialResult:
    """A finished trial's evaluations, the text each bits-per-byte metric scored, and its lineage."""
    run = Location(trial.run_dir)
    evaluated = [r for r in read_metrics(run.uri) if r.get("val_loss") is not None]
    curves: dict[str, list[tuple[int, float]]] = {}
    for record in evaluated:
        for key, value in record.items():
            if key.startswith(BPB_PREFIX) and value is not None:
                curves.setdefault(key, []).append((record["step"] + 1, float(value)))
    final_step = evaluated[-1]["step"] + 1 if evaluated else None  # no val split: nothing evaluated, nothing judged
    last = {key: points[-1][1] for key, points in curves.items() if points[-1][0] == final_step}
    info = run.join(FINAL_DIR, FINAL_INFO).read_json()
    texts = {f"{BPB_PREFIX}{s['name']}": f"val split of manifest {s['manifest_sha256']}" for s in info["data_sources"]}
    for held in info["train_config"]["data"]["heldout"]:
        texts[f"{BPB_PREFIX}{held['name']}"] = f"held-out {held['path']} ({held['field']})"
    lineage = {
        "curations": [c.location.uri for c in trial.chain.curated],
        "data_manifest_sha256": info["data_manifest_sha256"],
        "step": info["step"],
    }
    return TrialResult(trial.variant, trial.seed, trial.run_dir, status, last, texts, curves, lineage)


def train_in_task(job_path: str, overrides: dict[str, Any]) -> str | None:
    """One trial's training stage inside a Ray task (``--concurrent``): its error, or None once it finished."""
    try:
        Chain(None).stage(keyed_stages(load_job(job_path, overrides)).train)
    except StageFailed as exc:
        return str(exc)
    return None


def run_trials(spec: AblationSpec, trials: list[Trial], chain: Chain, concurrent: int) -> list[TrialResult]:
    """Each distinct curation once, in order; then each trial's training, ``concurrent`` at a time. A curation that
    fails stops the ablation (its trials have no data); a training that fails is recorded, and the rest go on."""
    curations = {c.out.location.uri: c for t in trials for c in t.chain.curations}
    for curation in curations.values():
        chain.stage(curation)
    done: dict[int, TrialResult] = {}
    todo = []
    for i, trial in enumerate(trials):
        if verified(trial.chain.train.out.location)[0] is not None:
            log.info("%s: reused, finished in %s", _where(i, trials), trial.run_dir)
            done[i] = read_result(trial, "reused")
        else:
            todo.append(i)
    if concurrent == 1:
        for i in todo:
            log.info("%s: training in %s", _where(i, trials), trials[i].run_dir)
            try:
                chain.stage(trials[i].chain.train)
                done[i] = read_result(trials[i], "trained")
            except StageFailed as exc:
                done[i] = _failed(trials[i], str(exc))
        return [done[i] for i in sorted(done)]

    import ray

    chain.ensure_ray()
    task = ray.remote(num_cpus=0)(train_in_task)
    in_flight: dict[Any, int] = {}
    while todo or in_flight:
        while todo and len(in_flight) < concurrent:
            i = todo.pop(0)
            log.info("%s: training in %s", _where(i, trials), trials[i].run_dir)
            in_flight[task.remote(spec.job, trials[i].overrides)] = i
        (ref,), _ = ray.wait(list(in_flight), num_returns=1)
        i = in_flight.pop(ref)
        error = ray.get(ref)
        done[i] = read_result(trials[i], "trained") if error is None else _failed(trials[i], error)
    return [done[i] for i in sorted(done)]


def _where(i: int, trials: list[Trial]) -> str:
    return f"trial {i + 1}/{len(trials)}: {trials[i].variant} seed {trials[i].seed}"


def _failed(trial: Trial, error: str) -> TrialResult:
    log.error("%s seed %s failed: %s", trial.variant, trial.seed, error)
    return TrialResult(trial.variant, trial.seed, trial.run_dir, "failed", error=error)


@dataclass(frozen=True)
class Verdicts:
    baseline: str
    alpha: float
    compared: dict[str, str]  # metric -> the text every trial scored
    baseline_mean: dict[str, float]  # metric -> the baseline's mean over its seeds
    noise: dict[str, float]  # metric -> the baseline's seed-to-seed standard deviation
    variants: dict[str, dict[str, Comparison]]  # variant -> metric -> its comparison with the baseline
    not_compared: dict[str, str]  # metric -> why
    no_verdict: dict[str, str]  # variant -> why (a trial that failed)


def judge(spec: AblationSpec, results: list[TrialResult]) -> Verdicts:
    """Every metric that each finished trial scored on the same text (or ``spec.metrics``), each variant against the
    baseline with Holm's correction over those metrics."""
    baseline = spec.variants[0].name
    by_variant = {v.name: [r for r in results if r.variant == v.name] for v in spec.variants}
    no_verdict = {
        name: f"{sum(r.status == 'failed' for r in rs)} of {len(rs)} trials failed"
        for name, rs in by_variant.items()
        if any(r.status == "failed" for r in rs)
    }
    done = [r for r in results if r.status != "failed"]
    compared: dict[str, str] = {}
    not_compared: dict[str, str] = {}
    for metric in sorted({m for r in done for m in r.metrics} | set(spec.metrics)):
        missing = [f"{r.variant} seed {r.seed}" for r in done if metric not in r.metrics]
        texts = {r.evaluated_on.get(metric, "") for r in done}
        if missing:
            not_compared[metric] = f"not measured by {', '.join(missing)}"
        elif len(texts) > 1:
            not_compared[metric] = f"scored on different text across trials ({'; '.join(sorted(texts))})"
        elif not spec.metrics or metric in spec.metrics:
            compared[metric] = texts.pop()
    verdicts: dict[str, dict[str, Comparison]] = {}
    base_values = {m: [r.metrics[m] for r in by_variant[baseline]] for m in compared}
    if baseline in no_verdict:  # nothing to pair with
        no_verdict = {name: no_verdict.get(name, "the baseline has failed trials") for name in by_variant}
    for name, rs in by_variant.items():
        if name != baseline and name not in no_verdict and compared:
            verdicts[name] = compare_all(base_values, {m: [r.metrics[m] for r in rs] for m in compared}, spec.alpha)
    means = {m: statistics.fmean(v) for m, v in base_values.items() if v}
    noises = {m: noise(v) for m, v in base_values.items() if len(v) >= 2}
    return Verdicts(baseline, spec.alpha, compared, means, noises, verdicts, not_compared, no_verdict)


def run_ablation(
    spec: AblationSpec, address: str | None = None, concurrent: int = 1, worker_logs: str = "files"
) -> tuple[list[TrialResult], Verdicts]:
    """Plan, curate and train (or reuse) every trial, judge, and write the report into ``spec.output``."""
    trials = plan(spec)
    log.info("plan: %s", price(spec, trials).describe())
    chain = Chain(address, worker_logs)
    try:
        results = run_trials(spec, trials, chain, concurrent)
    finally:
        chain.shutdown()
    verdicts = judge(spec, results)
    records = [asdict(r) for r in results]
    out = Location(spec.output)
    out.join(RESULTS_FILE).write_json({"spec": spec.model_dump(), "trials": records, "verdicts": asdict(verdicts)})
    out.join("ablation.md").write_text(report_markdown(spec.model_dump(), records, asdict(verdicts)))
    plot_curves(out, records, list(verdicts.compared))
    return results, verdicts


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.ablate",
        description="Run every variant of an ablation once per seed through the job spec's chain (curate, train), "
        "then judge each against the first (the baseline) on bits per byte: the noise (the baseline's seed-to-seed "
        "std), the paired difference with a bootstrap 95%% interval, the signal-to-noise ratio, Holm-corrected "
        "p-values and a verdict. Finished trials are reused; OUTPUT/ablation.json, .md and .png hold the report.",
        epilog="ABLATION keys: job, output, seeds (2 or more), variants ([{name, set, seeds}], the first the "
        "baseline), and optionally set, vary (both, init or data), alpha (0.05), metrics ([val_bpb/<name>]), "
        "max_usd (the most the trainings may cost by the planner). "
        "Examples: cluster/jobs/ablation_aa.yaml, cluster/jobs/ablation_quality.yaml, "
        "cluster/jobs/ablation_curriculum.yaml",
    )
    parser.add_argument("ablation", help="the ablation's YAML file")
    parser.add_argument(
        "--concurrent", type=_positive, default=1, help="trainings at once, each trial's driver in a Ray task "
        "(default 1). Each still reserves its train.parallel workers' CPUs (and GPUs): Ray queues what does not fit",
    )  # fmt: skip
    parser.add_argument(
        "--worker-logs", choices=("files", "terminal"), default="files", help="as cluster.run's: where the Ray "
        "workers' output goes (default: each node's Ray session logs)",
    )  # fmt: skip
    parser.add_argument(
        "--plan", action="store_true", help="plan every trial and price the trainings still to run (the planner's "
        "GPU-hours and cost, for a job with a cluster section), then stop: nothing runs",
    )  # fmt: skip
    add_address_option(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        spec = load(AblationSpec, args.ablation)
        if args.plan:
            trials = plan(spec)
            for i, trial in enumerate(trials):
                print(f"{_where(i, trials)}: {trial.run_dir}")
            print(f"plan: {price(spec, trials).describe()}")
            return 0
        results, verdicts = run_ablation(spec, args.address, args.concurrent, args.worker_logs)
    except (ConfigError, SpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report_text(asdict(verdicts)))
    print(f"report: {Location(spec.output).join('ablation.md')}")
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        print(f"failed: {r.variant} seed {r.seed} ({r.run_dir}): {r.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
