"""python -m cluster.run JOB.yaml [--until STAGE] [--set KEY=VALUE]: the whole chain from one spec, resumable.

Runs plan, curate, train, export, eval and serve in order on one Ray (a local one, or the cluster's inside
``ray job submit``: cluster/jobs/submit_job.sh). Each stage writes under ``<root>/<stage>/<key>/``, keyed by its
config and its inputs (cluster/stages.py): a rerun skips what is done and verifies, resumes what was cut off, and
redoes only what a changed key reaches. ``<root>/lineage.json`` ties the inputs' sha256 to the data, the run, the
exports, the served model id and the scores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cluster.run_spec import STAGES, Job, SpecError, add_spec_arguments, load_job
from cluster.stages import (
    CANARY_SET,
    Curate,
    Eval,
    Export,
    Stage,
    StageOutput,
    Train,
    finish,
    lease_file,
    set_aside_unverified,
    stage_errors,
    tokenizer_source,
    verified,
)
from ground.cache import fetch_verified
from ground.lease import Lease, LeaseHeld
from ground.logsetup import setup_logging
from ground.overrides import ConfigError, parse_set
from ground.ray_address import add_address_option
from ground.storage import Location, StorageError

if TYPE_CHECKING:
    from cluster.planner import Plan

LINEAGE = "lineage.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.run",
        description="Run the whole chain (plan, curate, train, export, eval, serve) from one job spec; rerun it to "
        "resume: finished stages are verified and skipped, a stage that was cut off continues.",
    )
    add_spec_arguments(parser)
    parser.add_argument("--until", choices=STAGES, default=STAGES[-1], help="stop after this stage (default: serve)")
    parser.add_argument(
        "--where",
        choices=STAGES[1:-1],
        help="print the directory this spec's STAGE writes (whether or not it has run) and exit, e.g. "
        "--data $(python -m cluster.run JOB.yaml --where curate); a mixture's curate prints one per source, in order",
    )
    parser.add_argument(
        "--worker-logs",
        choices=("files", "terminal"),
        default="files",
        help="where the Ray workers' and Serve replicas' output goes: 'files' (default) leaves it in each node's Ray "
        "session logs (the Ray dashboard's Logs view), so that this job's output is its stages, their progress and "
        "the served completion; 'terminal' also copies every line here, prefixed with its process",
    )
    parser.add_argument(
        "--accept-code-change",
        action="store_true",
        help="let a curation that was cut off resume under another code version (commit or local changes) than it "
        "began with, which is refused otherwise; its finished work keeps the old code's output",
    )
    add_address_option(parser)
    return parser.parse_args(argv)


def say(stage: str, state: str, detail: str = "") -> None:
    """One line per stage and state, plain text: it reads the same in a terminal, `ray job logs` and CI."""
    print(f"[{stage:<7}] {state:<9} {detail}".rstrip(), flush=True)


class StageFailed(RuntimeError):
    """A stage stopped on an error it explains (bad input, a diverged run, too few val documents...)."""


@dataclass
class KeyedChain:
    """Every keyed stage of a spec, in order, each with where it writes (from its config and the keys upstream):
    known before anything runs, and without Ray, so ``--where`` can print it."""

    curations: list[Curate]  # one per data source (one, or each source of a mixture), in spec order
    train: Train
    export: Export
    eval: Eval

    @property
    def curated(self) -> list[StageOutput]:
        return [c.out for c in self.curations]

    def through(self, until: str) -> list[Stage]:
        """The stages that run for ``--until``, in order: curate up to ``until`` (eval at most; serve comes after
        them and writes no output of its own)."""
        stages: list[Stage] = [*self.curations, self.train, self.export, self.eval]
        return [stage for stage in stages if STAGES.index(stage.name) <= STAGES.index(until)]

    def where(self, stage: str) -> list[str]:
        return [s.out.location.uri for s in self.through(stage) if s.name == stage]


def keyed_stages(job: Job, accept_code_change: bool = False) -> KeyedChain:
    """The spec's stages, each keyed by its config and the keys of the outputs it reads. ``accept_code_change``: a
    cut-off curation may resume under other code (``--accept-code-change``)."""
    curations: list[Curate] = []
    for source in job.sources:
        tokenizer_of = tokenizer_source(job, [c.out for c in curations])
        curations.append(Curate(job, source, tokenizer_of, accept_code_change))
    curated = [c.out for c in curations]
    trained = Train(job, curated)
    exported = Export(job, trained.out)
    return KeyedChain(curations, trained, exported, Eval(job, curated, exported.out))


class Chain:
    """Runs the stages in order; Ray starts once, at the first stage that has work to do."""

    def __init__(self, address: str | None, worker_logs: str = "files") -> None:
        self.address = address
        self.worker_logs = worker_logs
        self.started_ray = False

    def ensure_ray(self) -> None:
        import ray

        if not ray.is_initialized():
            # Serve's replicas, controller and proxies log to their files under the Ray session's logs/serve/, not
            # to this job's output, where their access lines would cut into the report and the streamed completion.
            # A local Ray's workers inherit this environment; a cluster's get it from cluster/jobs/runtime_env.yaml.
            os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
            # Ray Train lists its runs in the dashboard only with its state tracking on (off by default in 2.60).
            os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
            # The workers' own output (vLLM's engine, Ray Train's workers, libraries' import warnings) stays in the
            # session's log files too unless asked for: the stages report their progress from this driver, and a
            # worker's error reaches it with the task's or the training run's failure.
            terminal = self.worker_logs == "terminal"
            ray.init(address=self.address, log_to_driver=terminal)
            self.started_ray = True
            if not terminal:
                where = "by default /tmp/ray/session_latest/logs on this one; --worker-logs terminal shows them here"
                print(f"Ray's workers and Serve's replicas log to each node's Ray session logs ({where})", flush=True)

    def stage(self, stage: Stage) -> None:
        """Skip ``stage`` if its output is recorded and verifies; else, holding the output's lease (no other run on
        this root writes it meanwhile), record it, running its work first unless the output is already whole
        (finished by a job stopped before it recorded the stage)."""
        out = stage.out
        if self._skipped(out):
            return
        try:
            with Lease(out.location, lease_file(out)):
                if not self._skipped(out):  # finished by the run that held the lease until now
                    self._run(stage)
        except LeaseHeld as exc:
            say(out.name, "failed", str(exc))
            raise StageFailed(f"{out.name}: {exc}") from exc

    def _skipped(self, out: StageOutput) -> bool:
        record, _ = verified(out.location)
        if record is None:
            return False
        out.record = record
        part = f"{out.part}: " if out.part else ""  # a mixture's source
        say(out.name, "skipped", f"{part}{out.location} (done {record['finished']}, verified)")
        return True

    def _run(self, stage: Stage) -> None:
        out = stage.out
        name, location = out.name, out.location
        part = f"{out.part}: " if out.part else ""
        _, problem = verified(location)
        if problem is not None:
            aside = set_aside_unverified(out)
            say(name, "redoing", f"{part}{location}: {problem}; the old output moved to {aside}")
        resume = location.exists() and not location.is_empty()
        say(name, "resuming" if resume else "running", f"{part}{location}")
        self.ensure_ray()
        started = time.time()
        try:
            # Whole but unrecorded (the job stopped between the work's end and stage.json): recorded, not redone.
            result = stage.finished()
            if result is None:
                result = stage.run(resume)
        except stage_errors() as exc:
            say(name, "failed", f"{part}{location}: its work so far is kept; run the job again to continue")
            raise StageFailed(f"{name}: {part}{exc}") from exc
        finish(out, stage.proofs(), result, started, time.time())
        say(name, "done", f"{part}in {out.record['seconds']:.1f} s")

    def shutdown(self) -> None:
        if self.started_ray:
            import ray

            ray.shutdown()


def run_chain(
    job: Job, until: str, address: str | None = None, worker_logs: str = "files", accept_code_change: bool = False
) -> int:
    say("plan", *plan_verdict(job))
    if until == "plan":
        return 0
    keyed = keyed_stages(job, accept_code_change)
    stages = keyed.through(until)
    chain = Chain(address, worker_logs)
    try:
        for stage in stages:
            chain.stage(stage)
        root = Location(job.spec.root)
        later = {stage.name: stage.out for stage in stages if not isinstance(stage, Curate)}
        lineage = write_lineage(job, root, keyed.curated, later)
        say("lineage", "written", f"{root.join(LINEAGE)}: model {lineage.get('model_id', '(not exported)')}")
        if until == "serve":
            chain.ensure_ray()  # this job's Ray, also when every stage before was skipped
            return serve_stage(job, keyed.export.out, keyed.eval.out, lineage["model_id"])
        return 0
    finally:
        chain.shutdown()


def served_model_id(job: Job, exported: StageOutput) -> str:
    """The name clients send and /v1/models lists: the spec's serve.name, or one the export's key makes unique."""
    return str(job.spec.serve.get("name") or f"raylm-{exported.key[:12]}")


def write_lineage(
    job: Job, root: Location, curated: list[StageOutput], outputs: dict[str, StageOutput]
) -> dict[str, Any]:
    inputs, data = [], []
    for source, out in zip(job.sources, curated, strict=True):
        manifest = out.location.join("manifest.json").read_json()
        entry = {"dir": out.location.uri, "key": out.key, "manifest_sha256": out.record["files"]["manifest.json"]}
        if job.is_mixture:
            entry = {"name": source.name, "weight": source.weight, **entry}
            inputs += [{"source": source.name, **read} for read in manifest["sources"]]
        else:
            inputs += manifest["sources"]
        data.append(entry)
    # One curation: its output. A mixture: each source's, in the spec's order (the first gave the tokenizer).
    lineage: dict[str, Any] = {"spec": job.source, "inputs": inputs, "data": {"mixture": data} if job.is_mixture
                               else data[0]}  # fmt: skip
    if "train" in outputs:
        trained = outputs["train"]
        final = trained.location.join("final", "final.json").read_json()
        lineage["train"] = {"run_dir": trained.location.uri, "key": trained.key, "step": final["step"],
                            "summary": trained.record["result"]}  # fmt: skip
    if "export" in outputs:
        exported = outputs["export"]
        lineage["export"] = {
            name.split("/")[0]: {"dir": exported.location.join(name.split("/")[0]).uri, "lineage_sha256": digest}
            for name, digest in exported.record["files"].items()
        }
        lineage["model_id"] = served_model_id(job, exported)
    if "eval" in outputs:
        result = outputs["eval"].record["result"]
        # items: how many of the scored val documents each curation gave (a mixture's sources give theirs in turn).
        lineage["eval"] = {"dir": outputs["eval"].location.uri, "scores": result["scores"], "items": result["items"]}
    root.join(LINEAGE).write_text(json.dumps(lineage, indent=2))
    return lineage


def serve_stage(job: Job, exported: StageOutput, evaluated: StageOutput, model_id: str) -> int:
    """``python -m serve`` on the export, with the eval stage's canary set, in this process and on this Ray."""
    from serve.__main__ import main as serve_main

    argv = ["--model", exported.location.join("raylm").uri, *job.serve_argv]
    if "name" not in job.spec.serve:
        argv += ["--name", model_id]
    # The canary reads a local file: this node's verified copy when the root is in object storage.
    canary = fetch_verified(evaluated.location.join(CANARY_SET), evaluated.record["files"][CANARY_SET])
    argv += ["--canary-evalset", str(canary)]
    say("serve", "running", " ".join(argv))
    return serve_main(argv)


def planned_vocab_size(job: Job) -> int:
    """The embedding rows the trainer will build: the named tokenizer's vocabulary when the spec loads one
    (``data.tokenize.tokenizer_path``), else the size the pipeline trains its tokenizer to, an upper bound.

    The trainer takes its vocabulary from the data manifest, which records ``get_vocab_size()`` of the tokenizer the
    pipeline used, unpadded; the file is read here as the pipeline reads it (``load_tokenizer``: a local path or an
    object-storage URI, any other scheme refused)."""
    tokenize = job.pipeline.tokenize
    if not tokenize.tokenizer_path:
        return tokenize.vocab_size
    from pipeline.steps.tokenize import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenize.tokenizer_path)
    # tokenizers raises a bare Exception for a file it cannot parse; every failure here is the spec's path's.
    except Exception as exc:
        raise SpecError(
            f"{job.source}: plan: data.tokenize.tokenizer_path {tokenize.tokenizer_path!r}: cannot read the "
            f"tokenizer to size the model's embedding: {exc}"
        ) from exc
    return int(tokenizer.get_vocab_size())


def plan_verdict(job: Job) -> tuple[str, str]:
    """The planner's check of the spec's training on the spec's GPUs: a spec that cannot fit is refused here,
    before anything starts (``SpecError`` naming the fields)."""
    plan = training_plan(job)
    if plan is None:
        return "skipped", "no cluster section: a local run, nothing to plan"
    assert job.spec.cluster is not None and plan.trainer is not None
    cluster, gpu, usable = job.spec.cluster, job.spec.cluster.gpu_type, plan.memory.usable_bytes
    return "done", (
        f"{plan.model.n_params / 1e6:.1f}M parameters on {cluster.gpus} × {gpu}: "
        f"{plan.trainer.state_bytes_per_rank / 1e9:.2f} GB state a rank of {usable / 1e9:.1f} GB usable"
    )


def training_plan(job: Job) -> Plan | None:
    """The planner's plan of the spec's training on the spec's GPUs (its compute: GPU-hours and cost), or None for a
    spec without a cluster section. A spec whose model cannot fit is refused (``SpecError`` naming the fields)."""
    if job.spec.cluster is None:
        return None
    from cluster.job_spec import JobSpec
    from cluster.planner import build_plan

    train, cluster = job.train, job.spec.cluster
    par, data, model = train.parallel, train.data, train.model
    micro_steps = max(1, data.global_batch_size // (data.micro_batch_size * par.workers))
    # FSDP is ZeRO-3, unless its parameters stay gathered through the step (fsdp_reshard_after_forward: never):
    # then every rank holds the whole bf16 model, as ZeRO-2 does, besides its shards.
    zero = 0 if par.strategy != "fsdp" else 2 if par.fsdp_reshard_after_forward == "never" else 3
    planned = {
        "name": job.source,
        "model": {"n_layer": model.n_layer, "n_embd": model.n_embd, "n_head": model.n_head,
                  "vocab_size": planned_vocab_size(job), "seq_len": model.block_size, "bias": model.bias,
                  "arch": model.arch, "n_kv_head": model.n_kv_head, "ffn_hidden": model.ffn_hidden,
                  "tie_embeddings": model.tie_embeddings},
        "training": {"tokens": float(train.steps * data.global_batch_size * model.block_size),
                     "micro_batch": data.micro_batch_size, "grad_accum": micro_steps,
                     "zero_stage": zero,
                     "activation_checkpointing": par.activation_checkpointing},
        "cluster": cluster.model_dump(),
        "parallelism": {"dp": par.workers},
        "trainer": {"strategy": par.strategy, "world_size": par.workers},
    }  # fmt: skip
    try:
        spec = JobSpec.model_validate(planned)
    except ValidationError as exc:
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise SpecError(f"{job.source}: plan: {problems} (DP is train.parallel.workers)") from exc
    plan = build_plan(spec)
    gpu, usable = cluster.gpu_type, plan.memory.usable_bytes
    assert plan.trainer is not None  # the spec above has a trainer section
    if plan.trainer.state_bytes_per_rank > usable:
        raise SpecError(
            f"{job.source}: plan: train.model does not fit on one {gpu} with train.parallel.strategy "
            f"{par.strategy} over {par.workers} workers: the trainer's state is "
            f"{plan.trainer.state_bytes_per_rank / 1e9:.1f} GB a rank, {usable / 1e9:.1f} GB usable "
            "(cluster.gpu_type, cluster.memory_headroom); shard it (fsdp) or use more workers"
        )
    if not plan.memory.fits:
        raise SpecError(
            f"{job.source}: plan: train.model with train.data.micro_batch_size {data.micro_batch_size} needs "
            f"{plan.memory.total_bytes / 1e9:.1f} GB a GPU, {usable / 1e9:.1f} GB usable on one {gpu}"
        )
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        job = load_job(args.spec, parse_set(args.set))
        if args.where:
            print("\n".join(keyed_stages(job).where(args.where)))  # a mixture's curations: one line each
            return 0
        return run_chain(job, args.until, args.address, args.worker_logs, args.accept_code_change)
    except (SpecError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (StageFailed, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
