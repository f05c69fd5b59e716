"""python -m train.ablation SPEC.yaml: which data makes the better model, decided with seeds, a noise baseline and a
verdict.

An ablation is a list of variants, the first of them the baseline, each a change to one base training run (other
data, another mixture or schedule, any ``--set`` key), trained once per seed (``data.seed``: the model's init and the
data order). Every run is an ordinary ``python -m train`` run (``train.launch``), one after another on the same Ray,
in ``OUTPUT/runs/<variant>-<hash>/seed-<seed>``. The hash is of the variant's train config without its seed and
output dir, as Marin's executor names a step's output: an edited variant trains again in a new dir, an unchanged one
that finished (its final.json written) is reused, and one that was interrupted resumes from its checkpoints.

What is compared: the last evaluation's bits per byte (``val_bpb/<name>``, comparable across tokenizers) wherever every
run scored the same text, that is a held-out set (``data.heldout``) with the same path and field in every run, or a
source whose val split (its manifest's sha256) every run shares. A source whose data differs between variants scores
each model on its own text; it is listed as not compared, never judged. Held-out sets are the ablation's yardstick.

Per compared metric: the baseline's seed-to-seed standard deviation (the noise), each variant's difference from the
baseline in those units, Welch's p-value and a verdict (train.ablation_stats). The table goes to stdout, everything
to ``OUTPUT/ablation.json``. A run that fails (diverged, replicas differ, a crash Ray Train gave up on) is recorded
with its error and left out; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ground.hashing import sha256_json
from ground.logsetup import setup_logging
from ground.overrides import ConfigError, load
from ground.ray_address import add_address_option
from ground.storage import Location, join
from train.ablation_stats import Comparison, compare, noise
from train.config import TrainConfig, config_from_dict, load_config
from train.layout import FINAL_DIR, FINAL_INFO
from train.metrics import read_metrics
from train.mixture import data_overrides
from train.preflight import PreflightError

log = logging.getLogger(__name__)

RESULTS_FILE = "ablation.json"
RUNS_DIR = "runs"
BPB_PREFIX = "val_bpb/"
# Keys that the ablation sets itself: the seed of each run, where it goes, and resuming an interrupted one.
OWN_KEYS = ("data.seed", "output_dir", "checkpoint.resume", "data_dir", "data.mixture")


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Variant(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # a directory name
    data: str | None = None  # --data's form (a dir, or name=DIR:weight,...); None: the ablation's
    set: dict[str, Any] = Field(default_factory=dict)  # dotted train config keys, applied after the ablation's


class AblationSpec(_Spec):
    output: str = Field(min_length=1)  # a path or a URI: the runs and ablation.json
    config: str | None = None  # the train config every run starts from (as --config)
    data: str = Field(min_length=1)  # as --data
    steps: int | None = Field(None, ge=1)
    set: dict[str, Any] = Field(default_factory=dict)  # dotted train config keys for every run
    seeds: list[int] = Field(min_length=2)  # at least two: one seed measures no noise
    alpha: float = Field(0.05, gt=0, lt=1)  # the p-value under which a difference is a verdict
    metric: str | None = None  # the metric of the headline verdict; None: every compared metric has one
    variants: list[Variant] = Field(min_length=2)  # the first is the baseline

    @model_validator(mode="after")
    def _well_formed(self) -> AblationSpec:
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds repeat: {self.seeds}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names repeat: {names}")
        for where, keys in [("set", self.set)] + [(f"variants.{v.name}.set", v.set) for v in self.variants]:
            if taken := sorted(k for k in keys if k in OWN_KEYS):
                raise ValueError(f"{where}: {', '.join(taken)} is the ablation's own (seeds, output, data)")
        if self.metric is not None and not self.metric.startswith(BPB_PREFIX):
            raise ValueError(f"metric {self.metric!r}: an ablation compares bits per byte, {BPB_PREFIX}<name>")
        return self


@dataclass(frozen=True)
class PlannedRun:
    variant: str
    seed: int
    config: TrainConfig  # its output_dir is the run dir


@dataclass
class RunResult:
    variant: str
    seed: int
    run_dir: str
    status: str  # "trained", "reused" or "failed"
    metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation's val_bpb/<name>
    evaluated_on: dict[str, str] = field(default_factory=dict)  # each metric's text: a val split's sha, a file
    error: str | None = None


def variant_hash(config: TrainConfig) -> str:
    """What a variant trains, without the seed and the run dir: the key of its runs' directory."""
    data = config.to_dict()
    data.pop("output_dir")
    data["data"].pop("seed")
    data["checkpoint"].pop("resume")
    return sha256_json(data)[:12]


def plan(spec: AblationSpec) -> list[PlannedRun]:
    """Every (variant, seed) run's config, all built before the first run starts: a bad key fails the ablation at
    once, naming its variant."""
    runs = []
    for variant in spec.variants:
        try:
            base = data_overrides(variant.data or spec.data)
        except ValueError as exc:
            raise ConfigError(f"variants.{variant.name}: data: {exc}") from exc
        if spec.steps is not None:
            base["steps"] = spec.steps
        base["metrics.run_id"] = variant.name  # Prometheus' and the tracker's name; the seed is added below
        base |= spec.set | variant.set | {"checkpoint.resume": True}
        try:
            key = variant_hash(load_config(spec.config, base | {"output_dir": spec.output}))
        except ConfigError as exc:
            raise ConfigError(f"variants.{variant.name}: {exc}") from exc
        variant_dir = join(join(spec.output, RUNS_DIR), f"{variant.name}-{key}")
        for seed in spec.seeds:
            overrides = base | {"data.seed": seed, "output_dir": join(variant_dir, f"seed-{seed}")}
            overrides["metrics.run_id"] = f"{overrides['metrics.run_id']}-seed-{seed}"
            runs.append(PlannedRun(variant.name, seed, load_config(spec.config, overrides)))
    return runs


def finished(run_dir: str) -> bool:
    return Location(run_dir).join(FINAL_DIR, FINAL_INFO).exists()


def read_result(planned: PlannedRun, status: str) -> RunResult:
    """A finished run's last evaluation, and the text each of its bits-per-byte metrics scored."""
    run_dir = planned.config.output_dir
    evaluated = [r for r in read_metrics(run_dir) if r.get("val_loss") is not None]
    last = evaluated[-1] if evaluated else {}
    metrics = {k: float(v) for k, v in last.items() if k.startswith(BPB_PREFIX) and v is not None}
    info = Location(run_dir).join(FINAL_DIR, FINAL_INFO).read_json()
    texts = {f"{BPB_PREFIX}{s['name']}": f"val split of manifest {s['manifest_sha256']}" for s in info["data_sources"]}
    for held in info["train_config"]["data"]["heldout"]:
        texts[f"{BPB_PREFIX}{held['name']}"] = f"held-out {held['path']} ({held['field']})"
    return RunResult(planned.variant, planned.seed, run_dir, status, metrics, texts)


def launch_in_task(config: TrainConfig) -> tuple[str, str | None]:
    """One run inside a Ray task (``train_all``'s concurrent mode), without its live progress line, which would
    interleave with the others': ("finished", None), ("failed", error) or ("refused", a preflight error)."""
    from train.launch import launch

    data = config.to_dict()
    data["metrics"]["progress"] = False
    try:
        launch(config_from_dict(data))
    except PreflightError as exc:
        return "refused", str(exc)
    except Exception as exc:  # a run's own failure is a result of the ablation, recorded with its error
        return "failed", str(exc)
    return "finished", None


def train_all(runs: list[PlannedRun], address: str | None, concurrent: int = 1) -> list[RunResult]:
    """Every run: reused when finished, else trained (or resumed), ``concurrent`` at a time (1: in this process,
    with the progress line; more: each run's driver in a Ray task, its workers placed by Ray as usual). A run that
    fails is recorded, and the rest go on; a preflight refusal (bad data, no room) stops the ablation once the runs
    in flight end, since every later run would meet it."""
    import ray  # Ray and torch: not for --help or a bad spec

    from train.launch import launch

    results: dict[int, RunResult] = {}
    todo = []
    for i, planned in enumerate(runs):
        if finished(planned.config.output_dir):
            log.info("%s: reused, finished in %s", _where(i, runs), planned.config.output_dir)
            results[i] = read_result(planned, "reused")
        else:
            todo.append(i)
    if concurrent == 1:
        for i in todo:
            log.info("%s: training in %s", _where(i, runs), runs[i].config.output_dir)
            try:
                launch(runs[i].config, address=address)
                outcome: tuple[str, str | None] = ("finished", None)
            except PreflightError as exc:
                outcome = ("refused", str(exc))
            except Exception as exc:  # recorded, as in launch_in_task
                outcome = ("failed", str(exc))
            if outcome[0] == "refused":
                raise PreflightError(f"{_where(i, runs)}: {outcome[1]}")
            results[i] = _result(runs[i], *outcome)
    else:
        if not ray.is_initialized():
            ray.init(address=address)
        task = ray.remote(num_cpus=0)(launch_in_task)
        in_flight: dict[Any, int] = {}
        refused: str | None = None
        while todo or in_flight:
            while todo and len(in_flight) < concurrent and refused is None:
                i = todo.pop(0)
                log.info("%s: training in %s", _where(i, runs), runs[i].config.output_dir)
                in_flight[task.remote(runs[i].config)] = i
            if not in_flight:
                break
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            i = in_flight.pop(ref)
            status, error = ray.get(ref)
            if status == "refused":
                refused = refused or f"{_where(i, runs)}: {error}"
            else:
                results[i] = _result(runs[i], status, error)
        if refused is not None:
            raise PreflightError(refused)
    return [results[i] for i in sorted(results)]


def _where(i: int, runs: list[PlannedRun]) -> str:
    return f"run {i + 1}/{len(runs)}: {runs[i].variant} seed {runs[i].seed}"


def _result(planned: PlannedRun, status: str, error: str | None) -> RunResult:
    if status == "failed":
        log.error("%s seed %s failed: %s", planned.variant, planned.seed, error)
        return RunResult(planned.variant, planned.seed, planned.config.output_dir, "failed", error=error)
    log.info("%s seed %s finished in %s", planned.variant, planned.seed, planned.config.output_dir)
    return read_result(planned, "trained")


@dataclass(frozen=True)
class MetricVerdicts:
    metric: str
    evaluated_on: str
    noise: float  # the baseline's seed-to-seed standard deviation
    variants: dict[str, Comparison]  # every other variant against the baseline


@dataclass(frozen=True)
class Verdicts:
    baseline: str
    compared: list[MetricVerdicts]
    not_compared: dict[str, str]  # metric -> why
    short: dict[str, str]  # variant -> why it has no comparison (fewer than two finished runs)


def judge(spec: AblationSpec, results: list[RunResult]) -> Verdicts:
    """Every metric that each finished run scored on the same text, compared variant by variant to the baseline."""
    baseline = spec.variants[0].name
    done = [r for r in results if r.status != "failed"]
    by_variant = {v.name: [r for r in done if r.variant == v.name] for v in spec.variants}
    short = {name: f"{len(rs)} finished run(s) of {len(spec.seeds)}" for name, rs in by_variant.items() if len(rs) < 2}
    if baseline in short:
        return Verdicts(baseline, [], {}, short)
    metrics = sorted({m for r in done for m in r.metrics})
    compared, not_compared = [], {}
    for metric in metrics:
        missing = [f"{r.variant} seed {r.seed}" for r in done if metric not in r.metrics]
        texts = {r.evaluated_on.get(metric, "unknown text") for r in done}
        if missing:
            not_compared[metric] = f"not measured by {', '.join(missing)}"
        elif len(texts) > 1:
            not_compared[metric] = f"scored on different text across runs ({'; '.join(sorted(texts))})"
        else:
            base_values = [r.metrics[metric] for r in by_variant[baseline]]
            variants = {
                name: compare(base_values, [r.metrics[metric] for r in rs], spec.alpha)
                for name, rs in by_variant.items()
                if name != baseline and name not in short
            }
            compared.append(MetricVerdicts(metric, texts.pop(), noise(base_values), variants))
    return Verdicts(baseline, compared, not_compared, short)


def report(spec: AblationSpec, verdicts: Verdicts) -> str:
    """The verdicts as text: per compared metric, the noise, then each variant's mean, difference and verdict."""
    lines = [f"baseline {verdicts.baseline!r}, {len(spec.seeds)} seeds a variant, alpha {spec.alpha:g}"]
    for mv in verdicts.compared:
        lines.append(f"{mv.metric} (on {mv.evaluated_on}): noise {mv.noise:.4f} (the baseline's seed-to-seed std)")
        for name, c in mv.variants.items():
            effect = f"{c.effect:+.1f} noise" if c.effect is not None else "no baseline noise"
            lines.append(
                f"  {name}: {c.mean:.4f} ± {c.std:.4f}, {c.delta:+.4f} ({effect}), p={c.p_value:.3g}: {c.verdict}"
            )
    for metric, why in verdicts.not_compared.items():
        lines.append(f"not compared: {metric}: {why}")
    for name, why in verdicts.short.items():
        lines.append(f"no verdict for {name}: {why}")
    if spec.metric is not None:
        headline = next((mv for mv in verdicts.compared if mv.metric == spec.metric), None)
        if headline is None:
            why = verdicts.not_compared.get(spec.metric, "no run measured it")
            lines.append(f"verdict on {spec.metric}: none: {why}")
        else:
            verdict = ", ".join(f"{name} {c.verdict}" for name, c in headline.variants.items())
            lines.append(f"verdict on {spec.metric}: {verdict} (against {verdicts.baseline})")
    return "\n".join(lines)


def run_ablation(
    spec: AblationSpec, address: str | None = None, concurrent: int = 1
) -> tuple[list[RunResult], Verdicts]:
    """Plan, train (or reuse) every run, judge, and write OUTPUT/ablation.json."""
    runs = plan(spec)
    results = train_all(runs, address, concurrent)
    verdicts = judge(spec, results)
    Location(spec.output).join(RESULTS_FILE).write_json(
        {"spec": spec.model_dump(), "runs": [asdict(r) for r in results], "verdicts": asdict(verdicts)}
    )
    return results, verdicts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train.ablation",
        description="Train every variant of SPEC once per seed, then judge each against the first (the baseline) "
        "on bits per byte: the noise (the baseline's seed-to-seed std), the difference in noise units, Welch's "
        "p-value and a verdict. Runs finished earlier are reused; OUTPUT/ablation.json holds every number.",
        epilog="SPEC keys: output, data, seeds (2 or more), variants ([{name, data, set}], the first the baseline), "
        "and optionally config, steps, set, alpha (0.05), metric (val_bpb/<name>). "
        "Example: train/configs/ablation_demo.yaml",
    )
    parser.add_argument("spec", help="the ablation's YAML file")
    parser.add_argument(
        "--concurrent", type=_positive, default=1, help="runs trained at once, each run's driver in a Ray task "
        "(default 1: one after another, in this process, with the progress line). Each run still reserves its "
        "parallel.workers × cpus_per_worker CPUs (and GPUs), so Ray queues what does not fit",
    )  # fmt: skip
    add_address_option(parser)
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        spec = load(AblationSpec, args.spec)
        results, verdicts = run_ablation(spec, args.address, args.concurrent)
    except (ConfigError, PreflightError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(spec, verdicts))
    print(f"results: {Location(spec.output).join(RESULTS_FILE)}")
    failed = [r for r in results if r.status == "failed"]
    for r in failed:
        print(f"failed: {r.variant} seed {r.seed} ({r.run_dir}): {r.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
