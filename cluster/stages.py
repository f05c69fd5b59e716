"""The stages of ``python -m cluster.run``, each keyed by what made its output.

A stage writes under ``<root>/<stage>/<key>/``. The key is the sha256 of the stage's effective config and the keys of
the outputs it reads, so a changed config or a changed upstream output lands in a new directory, and an unchanged one
finds its output where it left it. The code version is recorded in each output's ``stage.json`` but not hashed: a
commit that changes no behaviour (a comment, a refactor, a new feature off by default) must not redo a day of
curation and training; a change that does alter outputs is a change of config or a new version of the stage's
defaults, which the config dump captures.

``stage.json`` is written last. A directory with it is complete, and it lists the sha256 of the files that prove the
stage finished (the data manifest, the run's summary, the exports' lineage, the scores), so a skip checks them
rather than trusting the directory; one that no longer verifies is discarded and redone. A directory without it is
a stage that was cut off: the pipeline resumes it (``--resume``) and training continues from its last checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.run_spec import DataSource, Job
from ground.hashing import sha256_json, sha256_stream
from ground.logsetup import stderr_console
from ground.storage import Location, is_published, publish

MARKER = "stage.json"
TOKENIZER = "tokenizer.json"  # in a pipeline output (docs/formats.md)
KEY_CHARS = 16  # of the sha256: a directory name that reads; 64 bits of it make a collision among a root's runs moot


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


def code_version() -> str:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), or "unknown" outside a git checkout (a
    ``ray job submit --working-dir`` upload has no .git)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


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


# ---- the stages' work: each takes the job, its output and the outputs it reads ----


def curate_material(job: Job, source: DataSource, tokenizer_of: StageOutput | None) -> tuple[dict[str, Any], Any]:
    """The curate key's material for one source (the pipeline's own run identity: config, inputs with sizes, resource
    hashes; for a mixture's later sources, the key of the first, whose tokenizer they load) and the gathered inputs,
    which the run then reuses instead of listing them again."""
    from pipeline.run_inputs import gather_inputs

    gathered = gather_inputs(source.inputs, source.config, input_list=source.input_list, base_url=source.base_url)
    identity = gathered.identity(source.config)
    identity["inputs"] = [[in_checkout(uri), size] for uri, size in identity["inputs"]]
    material: dict[str, Any] = {"pipeline": identity}
    if tokenizer_of is not None:
        # Its key, not its path: the same data under another root (a copy, a bucket) is the same curation.
        material["tokenizer_of"] = tokenizer_of.key
    return material, gathered


def tokenizer_source(job: Job, curated: list[StageOutput]) -> StageOutput | None:
    """The curation whose tokenizer the next source loads: a mixture's first, for every later source; none for the
    first, or when the spec names a tokenizer of its own (which every source then loads)."""
    return curated[0] if curated and not job.pipeline.tokenize.tokenizer_path else None


def source_config(source: DataSource, tokenizer_of: StageOutput | None) -> Any:
    """The pipeline config one source runs with: its own, loading ``tokenizer_of``'s tokenizer if it has one."""
    if tokenizer_of is None:
        return source.config
    tokenize = source.config.tokenize.model_copy(update={"tokenizer_path": tokenizer_of.location.join(TOKENIZER).uri})
    return source.config.model_copy(update={"tokenize": tokenize})


def run_curate(
    job: Job, source: DataSource, out: Location, gathered: Any, resume: bool, tokenizer_of: StageOutput | None
) -> tuple[list[str], dict[str, Any]]:
    from pipeline.executor import PipelineRun

    if is_published(out, "manifest.json"):  # finished, and the job was stopped before it recorded the stage
        report = out.join("report.json").read_json()
    else:
        report = PipelineRun(
            source.inputs, out.uri, source_config(source, tokenizer_of), console=stderr_console(),
            input_list=source.input_list, base_url=source.base_url, resume=resume, prepared=gathered,
            name=f"{job.name} curate" + (f" {source.name}" if job.is_mixture else ""),
        ).run()  # fmt: skip
    return ["manifest.json"], {"input": report["input"], "output": report["output"]}


def train_material(job: Job, curated: list[StageOutput]) -> dict[str, Any]:
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
    return {"train": config, "data": [[s.name, out.key, s.weight] for s, out in zip(job.sources, curated, strict=True)]}


def run_train(job: Job, out: Location, curated: list[StageOutput], resume: bool) -> tuple[list[str], dict[str, Any]]:
    from train.config import config_from_dict
    from train.launch import launch

    proof = ["summary.json", "final/final.json"]
    if all(out.join(name).is_file() for name in proof):  # finished, and the job was stopped before recording it
        return proof, out.join("summary.json").read_json()
    config = job.train.to_dict()
    config["data_dir"] = curated[0].location.uri  # a mixture's first source: the tokenizer the export copies
    if job.is_mixture:
        config["data"]["mixture"] = [
            {"name": s.name, "path": c.location.uri, "weight": s.weight}
            for s, c in zip(job.sources, curated, strict=True)
        ]
    config["output_dir"] = out.uri
    config["checkpoint"]["resume"] = resume
    return proof, launch(config_from_dict(config))


EXPORT_FORMATS = ("raylm", "hf")


def export_material(trained: StageOutput) -> dict[str, Any]:
    return {"formats": list(EXPORT_FORMATS), "train": trained.key}


def run_export(out: Location, trained: StageOutput) -> tuple[list[str], dict[str, Any]]:
    from train.export import LINEAGE, export

    for fmt in EXPORT_FORMATS:
        if not out.join(fmt, LINEAGE).is_file():  # lineage.json is written last: a format with it is complete
            export(trained.location.uri, out.join(fmt).uri, fmt)
    return [f"{fmt}/{LINEAGE}" for fmt in EXPORT_FORMATS], {"formats": list(EXPORT_FORMATS)}


def eval_material(job: Job, curated: list[StageOutput], exported: StageOutput) -> dict[str, Any]:
    return {"eval": job.spec.eval.model_dump(), "data": [c.key for c in curated], "export": exported.key}


EVAL_SCORES = "scores.json"
HARNESS_LOG = "harness.log"  # lm-evaluation-harness's stderr (its progress bars)
CANARY_SET = "tasks/canary-evalset.jsonl"


def run_eval(
    job: Job, out: Location, curated: list[StageOutput], exported: StageOutput
) -> tuple[list[str], dict[str, Any]]:
    """lm-evaluation-harness (``hf`` backend) on the HF export, over the val documents the canary scores: the
    curation's, or a mixture's sources' in turn (a source without val documents gives none)."""
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
    return [EVAL_SCORES, CANARY_SET], {
        "scores": scores,
        "items": {c.location.uri: items[c.location.uri] for c in curated},
    }
