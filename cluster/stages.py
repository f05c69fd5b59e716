"""The stages of ``python -m cluster.run``, each keyed by what made its output.

A stage writes under ``<root>/<stage>/<key>/``. The key is the sha256 of the stage's effective config and the keys of
the outputs it reads, so a changed config or a changed upstream output lands in a new directory, and an unchanged one
finds its output where it left it. The code version is recorded in each output's ``stage.json`` but not hashed: a
commit that changes no behaviour (a comment, a refactor, a new feature off by default) must not redo a day of
curation and training; a change that does alter outputs is a change of config or a new version of the stage's
defaults, which the config dump captures.

``stage.json`` is written last. A directory with it is complete, and it lists the sha256 of the files that prove the
stage finished (the data manifest, the run's summary, the exports' lineage, the scores), so a skip checks them
rather than trusting the directory; one that no longer verifies is moved aside (never deleted) and redone. A
directory without it is a stage that was cut off: the pipeline resumes it (``--resume``) and training continues
from its last checkpoint.

Every stage is a ``Stage``: its keyed output (``out``), the files that prove it (``proofs``), its work (``run``) and,
for a job stopped between the work's end and ``stage.json``, the result read back from an output that is already
whole (``finished``). One class per stage: ``Curate`` (one per data source), ``Train``, ``Export``, ``Eval``; the
driver (cluster/run.py) runs them all alike.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cluster.run_spec import DataSource, Job
from ground.code_version import code_version
from ground.hashing import sha256_json, sha256_stream
from ground.logsetup import stderr_console
from ground.overrides import ConfigError
from ground.storage import Location, StorageError, is_published, move_aside, publish

MARKER = "stage.json"
TOKENIZER = "tokenizer.json"  # in a pipeline output (docs/formats.md)
KEY_CHARS = 16  # of the sha256: a directory name that reads; 64 bits of it make a collision among a root's runs moot
T = TypeVar("T")


@dataclass
class StageOutput:
    name: str
    key: str
    location: Location
    material: dict[str, Any]  # what the key hashes: the stage's effective config and the keys of what it reads
    record: dict[str, Any] = field(default_factory=dict)
    part: str | None = None  # which of the stage's outputs, where it has several (a mixture's source): for the report


def keyed(
    root: Location, name: str, material: dict[str, Any], part: str | None = None, label: str | None = None
) -> StageOutput:
    """The stage's output, at ``root/<name>/<key>`` where the key hashes ``material``; with a label, at
    ``root/<name>/<label>-<key>``, unless an output of that key is there already under another label (or under its
    key alone): the key says what the output is, the label only names it, so that output is this one (a finished
    one first, where there are several)."""
    key = sha256_json({"stage": name, **material})
    short = key[:KEY_CHARS]
    directory = short
    if label:
        directory = f"{label}-{short}"
        same = [d for d in root.join(name).dirs() if d == short or d.endswith(f"-{short}")]
        if same and directory not in same:
            directory = next((d for d in same if is_published(root.join(name, d), MARKER)), same[0])
    return StageOutput(name, key, root.join(name, directory), material, part=part)


def run_label(job_name: str) -> str:
    """A training run's label: the spec's name, in the characters a directory and Ray Train's run name take."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", job_name)


def verified(out: Location) -> tuple[dict[str, Any] | None, str | None]:
    """(the stage record, None) for a complete output whose proof files still hash as recorded; (None, why) for a
    complete one that does not verify; (None, None) for an output that is missing or was cut off."""
    if not is_published(out, MARKER):
        return None, None
    record = out.join(MARKER).read_json()
    for name, digest in record.get("files", {}).items():
        path = out.join(name)
        if not path.is_file():
            return None, f"{name} is missing"
        if _sha256(path) != digest:
            return None, f"{name} changed since the stage finished"
    return record, None


def lease_file(out: StageOutput) -> Location:
    """Where the lease on ``out`` lives while a run writes it (ground/lease.py): ``<root>/.leases/<stage>/<dir>``,
    outside the output, so that the output stays empty until its work starts and moves aside without it."""
    directory = out.location
    return directory.parent.parent.join(".leases", directory.parent.name, directory.name)


def set_aside_unverified(out: StageOutput) -> Location:
    """Move a finished output that no longer verifies (``verified`` gave why) out of its key's way, to
    ``<its directory>.unverified-<UTC time>`` beside it, and return where. Its stage is then redone from scratch, since
    a finished output is not trusted in part; but nothing of it is deleted: a training run extended by hand keeps its
    checkpoints, to resume from or to compare."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return move_aside(out.location, MARKER, f"{out.location.name}.unverified-{stamp}")


def _sha256(file: Location) -> str:
    with file.open_input() as stream:
        return sha256_stream(stream)


def finish(out: StageOutput, proof_files: list[str], result: dict[str, Any], started: float, ended: float) -> None:
    """Write ``stage.json``, last: the stage's key and what it hashes (to compare two keys), its result, the proof
    files' sha256, the code version and timings."""
    files = {name: _sha256(out.location.join(name)) for name in proof_files}
    out.record = {
        "stage": out.name,
        "key": out.key,
        "material": out.material,
        "result": result,
        "files": files,
        "code_version": code_version(),
        "started": _iso(started),
        "finished": _iso(ended),
        "seconds": round(ended - started, 1),
    }
    publish(out.location, MARKER, out.record)


CHECKOUT = Path(__file__).resolve().parents[1]  # the repository this code runs from


def in_checkout(uri: str, checkout: Path = CHECKOUT) -> str:
    """An input file inside the checkout as ``checkout:<path in it>``, anything else as it is. A `ray job submit`
    unpacks the checkout under a directory named after a hash of its content, so an absolute path there (the
    bundled sample, a file beside the spec) would change, and the curation's key with it, at every edit to any
    file of the checkout; by its path in the checkout, the same input keeps its key (its size is keyed too)."""
    if "://" in uri or not Path(uri).is_absolute():
        return uri
    try:
        return f"checkout:{Path(uri).relative_to(checkout).as_posix()}"
    except ValueError:
        return uri


def _iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).isoformat(timespec="seconds")


def stage_errors() -> tuple[type[BaseException], ...]:
    """The stages' own errors, whose message says what is wrong: reported as one line, not a traceback."""
    from pipeline.errors import PipelineInputError, PipelineOutputError
    from serve.evalset import EvalSetError
    from train.export import ExportError
    from train.guard import TrainingDiverged
    from train.manifest import DataError
    from train.parallel import ReplicaMismatch
    from train.preflight import PreflightError

    return (
        PipelineInputError, PipelineOutputError, PreflightError, TrainingDiverged, ReplicaMismatch, DataError,
        ExportError, EvalSetError, ConfigError, StorageError,
    )  # fmt: skip


def as_ray_task(name: str, local_root: bool, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` as a Ray task called ``name``, which is how the Ray dashboard lists the stage (the curations are
    its datasets, training its Train run; export and eval would otherwise be nothing but the driver's own time). With
    the root in object storage it takes a CPU on any node, so that a cluster's head (which holds none) does not
    score the model; with a local root it runs where the root is, on this node, as the driver's own work would. A
    stage's own error reaches the chain as itself, not wrapped in Ray's task error."""
    import ray
    from ray.exceptions import RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placement: dict[str, Any] = {"num_cpus": 1}
    if local_root:
        here = ray.get_runtime_context().get_node_id()
        placement = {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
    task = ray.remote(fn).options(name=name, max_retries=0, **placement)
    try:
        return ray.get(task.remote(*args))
    except RayTaskError as err:
        if isinstance(err.cause, stage_errors()):
            raise err.cause from None
        raise


# ---- the stages: each is keyed when it is made (no Ray, nothing run), then run by the driver ----


class Stage(ABC):
    """One keyed output of the chain and the work that makes it. ``out`` (where it writes, keyed by ``material``) is
    known as soon as the stage is made, so ``--where`` prints it without running anything."""

    name: ClassVar[str]  # the stage's directory under the root, and its name in the report

    def __init__(self, job: Job, material: dict[str, Any], part: str | None = None, label: str | None = None) -> None:
        self.job = job
        self.out = keyed(Location(job.spec.root), self.name, material, part=part, label=label)

    @abstractmethod
    def proofs(self) -> list[str]:
        """The files, relative to the output, whose sha256 ``stage.json`` records: a skip hashes them again."""

    @abstractmethod
    def run(self, resume: bool) -> dict[str, Any]:
        """Do the stage's work into ``out`` (with ``resume``, continuing what a cut-off run left there); its result,
        for ``stage.json``."""

    def finished(self) -> dict[str, Any] | None:
        """The result of an output that is whole but has no ``stage.json`` (the job stopped after the work ended,
        before it was recorded), read back from the output; None if it is not whole. A stage that does not override
        this has its unrecorded output run again."""
        return None


class Curate(Stage):
    """``python -m pipeline run`` on one data source: the spec's inputs, or one source of a mixture."""

    name = "curate"

    def __init__(
        self, job: Job, source: DataSource, tokenizer_of: StageOutput | None, accept_code_change: bool = False
    ) -> None:
        """Keyed by the pipeline's own run identity (config, inputs with sizes, resource hashes) and, for a mixture's
        later sources, the key of the curation whose tokenizer they load (``tokenizer_of``). The gathered inputs
        are kept: the run reuses them instead of listing the inputs again. ``accept_code_change``: a cut-off
        curation resumes under another code version than it began with (the pipeline's --accept-code-change)."""
        from pipeline.run_inputs import gather_inputs

        self.source, self.tokenizer_of, self.accept_code_change = source, tokenizer_of, accept_code_change
        self.gathered = gather_inputs(
            source.inputs, source.config, input_list=source.input_list, base_url=source.base_url
        )
        identity = self.gathered.identity(source.config)
        identity["inputs"] = [[in_checkout(uri), size] for uri, size in identity["inputs"]]
        material: dict[str, Any] = {"pipeline": identity}
        if tokenizer_of is not None:
            # Its key, not its path: the same data under another root (a copy, a bucket) is the same curation.
            material["tokenizer_of"] = tokenizer_of.key
        super().__init__(job, material, part=source.name if job.is_mixture else None)

    def proofs(self) -> list[str]:
        return ["manifest.json"]

    def finished(self) -> dict[str, Any] | None:
        if not is_published(self.out.location, "manifest.json"):  # the pipeline writes its manifest last
            return None
        return self._result(self.out.location.join("report.json").read_json())

    def run(self, resume: bool) -> dict[str, Any]:
        from pipeline.executor import PipelineRun

        job, source = self.job, self.source
        report = PipelineRun(
            source.inputs, self.out.location.uri, self.config(), console=stderr_console(),
            input_list=source.input_list, base_url=source.base_url, resume=resume,
            accept_code_change=self.accept_code_change, prepared=self.gathered,
            name=f"{job.name} curate" + (f" {source.name}" if job.is_mixture else ""),
        ).run()  # fmt: skip
        return self._result(report)

    def config(self) -> Any:
        """The pipeline config the source runs with: its own, loading ``tokenizer_of``'s tokenizer if it has one."""
        if self.tokenizer_of is None:
            return self.source.config
        tokenizer = self.tokenizer_of.location.join(TOKENIZER).uri
        tokenize = self.source.config.tokenize.model_copy(update={"tokenizer_path": tokenizer})
        return self.source.config.model_copy(update={"tokenize": tokenize})

    @staticmethod
    def _result(report: dict[str, Any]) -> dict[str, Any]:
        return {"input": report["input"], "output": report["output"]}


def tokenizer_source(job: Job, curated: list[StageOutput]) -> StageOutput | None:
    """The curation whose tokenizer the next source loads: a mixture's first, for every later source; none for the
    first, or when the spec names a tokenizer of its own (which every source then loads)."""
    return curated[0] if curated and not job.pipeline.tokenize.tokenizer_path else None


class Train(Stage):
    """``python -m train`` on the curated data (a mixture's sources at their weights). Labelled with the spec's name,
    ``root/train/<spec>-<key>/``: Ray Train names the run after its directory, and the dashboard lists it so."""

    name = "train"

    def __init__(self, job: Job, curated: list[StageOutput]) -> None:
        self.curated = curated
        super().__init__(job, self._material(job, curated), label=run_label(job.name))

    @staticmethod
    def _material(job: Job, curated: list[StageOutput]) -> dict[str, Any]:
        config = job.train.to_dict()
        for key in ("data_dir", "output_dir"):
            config.pop(key, None)
        config["checkpoint"].pop("resume", None)
        # What only watches the run (a profile window, prices, the experiment tracker) changes nothing it trains: set
        # later, it must not redo the stage. The run it watches is the one already done.
        for section in ("profile", "cost"):
            config.pop(section, None)
        for key in ("tracker", "tracker_project", "tracker_uri"):
            config["metrics"].pop(key, None)
        if not job.is_mixture:
            return {"train": config, "data": curated[0].key}
        mixture = [[s.name, out.key, s.weight] for s, out in zip(job.sources, curated, strict=True)]
        return {"train": config, "data": mixture}

    def proofs(self) -> list[str]:
        return ["summary.json", "final/final.json"]

    def finished(self) -> dict[str, Any] | None:
        if not all(self.out.location.join(name).is_file() for name in self.proofs()):
            return None
        return self.out.location.join("summary.json").read_json()

    def run(self, resume: bool) -> dict[str, Any]:
        from train.config import config_from_dict
        from train.launch import launch

        job = self.job
        config = job.train.to_dict()
        config["data_dir"] = self.curated[0].location.uri  # a mixture's first source: the tokenizer the export copies
        if job.is_mixture:
            config["data"]["mixture"] = [
                {"name": s.name, "path": c.location.uri, "weight": s.weight}
                for s, c in zip(job.sources, self.curated, strict=True)
            ]
        config["output_dir"] = self.out.location.uri
        config["checkpoint"]["resume"] = resume
        return launch(config_from_dict(config))


EXPORT_FORMATS = ("raylm", "hf")


class Export(Stage):
    """The trained run in the raylm layout (for serving) and the Hugging Face one (for the harness), as one Ray task."""

    name = "export"

    def __init__(self, job: Job, trained: StageOutput) -> None:
        self.trained = trained
        super().__init__(job, {"formats": list(EXPORT_FORMATS), "train": trained.key})

    def proofs(self) -> list[str]:
        from train.export import LINEAGE

        return [f"{fmt}/{LINEAGE}" for fmt in EXPORT_FORMATS]  # each format's lineage.json, written last

    def finished(self) -> dict[str, Any] | None:
        if not all(self.out.location.join(name).is_file() for name in self.proofs()):
            return None
        return {"formats": list(EXPORT_FORMATS)}

    def run(self, resume: bool) -> dict[str, Any]:
        local = not self.out.location.is_remote
        as_ray_task(f"{self.job.name} export", local, _export, self.out.location, self.trained)
        return {"formats": list(EXPORT_FORMATS)}


def _export(out: Location, trained: StageOutput) -> None:
    """Export's work, in its Ray task: each format not complete yet (a cut-off stage keeps the formats it finished)."""
    from train.export import LINEAGE, export

    for fmt in EXPORT_FORMATS:
        if not out.join(fmt, LINEAGE).is_file():  # lineage.json is written last: a format with it is complete
            export(trained.location.uri, out.join(fmt).uri, fmt)


EVAL_SCORES = "scores.json"
HARNESS_LOG = "harness.log"  # lm-evaluation-harness's stderr (its progress bars)
CANARY_SET = "tasks/canary-evalset.jsonl"


class Eval(Stage):
    """lm-evaluation-harness (``hf`` backend) on the HF export, over the val documents the canary scores, as one Ray
    task. An eval output without ``stage.json`` is scored again (``finished`` is the base's)."""

    name = "eval"

    def __init__(self, job: Job, curated: list[StageOutput], exported: StageOutput) -> None:
        self.curated, self.exported = curated, exported
        material = {"eval": job.spec.eval.model_dump(), "data": [c.key for c in curated], "export": exported.key}
        super().__init__(job, material)

    def proofs(self) -> list[str]:
        return [EVAL_SCORES, CANARY_SET]

    def run(self, resume: bool) -> dict[str, Any]:
        local = not self.out.location.is_remote
        return as_ray_task(
            f"{self.job.name} eval", local, _evaluate, self.job, self.out.location, self.curated, self.exported
        )


def _evaluate(job: Job, out: Location, curated: list[StageOutput], exported: StageOutput) -> dict[str, Any]:
    """Eval's work, in its Ray task: the harness over the curation's val documents, or a mixture's sources' in turn
    (a source without val documents gives none)."""
    import lm_eval

    from ground.cache import fetch_published
    from serve.harness_tasks import build_tasks, relocated_task_yaml
    from train.export import LINEAGE

    spec = job.spec.eval
    with tempfile.TemporaryDirectory(prefix="raylm-eval-") as scratch:
        tasks = build_tasks(
            [c.location.uri for c in curated], Path(scratch) / "tasks", items=spec.items,
            max_tokens=job.train.model.block_size - 2,  # an item, its document-start token and one generated token
        )  # fmt: skip
        hf_model = fetch_published(exported.location.join("hf"), LINEAGE)  # this node's verified copy, if remote
        # The harness draws tqdm bars on stderr, which in this Ray task (never a terminal) are a screenful of
        # carriage-return updates in the worker's log: its stderr goes to the stage's harness.log instead.
        harness_log = Path(scratch) / HARNESS_LOG
        with harness_log.open("w") as log, contextlib.redirect_stderr(log):
            results = lm_eval.simple_evaluate(
                model="hf",
                # add_bos_token=False: the harness puts its own prefix token (<|endoftext|>) before a rolling window.
                model_args=f"pretrained={hf_model},dtype=float32,add_bos_token=False",
                tasks=list(spec.tasks),
                task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks)),
                batch_size=4,
                device="cpu",
                bootstrap_iters=0,
            )
        scores = {
            task: {k.removesuffix(",none"): v for k, v in metrics.items() if k.endswith(",none") and "stderr" not in k}
            for task, metrics in results["results"].items()
        }
        # Which curation each item came from: a mixture's sources give items in turn while their val documents last.
        canary = (tasks / Path(CANARY_SET).name).read_text(encoding="utf-8").splitlines()
        items = collections.Counter(json.loads(line)["source"] for line in canary if line.strip())
        # The stored task YAMLs name the stored jsonl, not the scratch copies the harness read: they run from there.
        stored = out.join("tasks")
        for path in sorted(tasks.iterdir()):
            if path.suffix == ".yaml":
                stored.join(path.name).write_text(relocated_task_yaml(path, stored.uri))
            else:
                stored.join(path.name).upload_from(path)
        out.join(HARNESS_LOG).upload_from(harness_log)
    out.join(EVAL_SCORES).write_json(scores)
    return {"scores": scores, "items": {c.location.uri: items[c.location.uri] for c in curated}}
