"""Command line: ``python -m pipeline run|sample|classifier|compare ...`` (see ``--help``)."""

from __future__ import annotations

import argparse
import sys
import textwrap

from rich.console import Console

from ground.logsetup import setup_logging, stderr_console
from ground.overrides import add_set_option
from ground.ray_address import add_address_option
from pipeline.stage_plan import stage_list_help


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="CommonCrawl WET shards → clean, deduplicated, tokenized training shards, on Ray Data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run the pipeline",
        description=textwrap.fill(
            "Runs every stage below, in order, over the input files; writes manifest.json, tokens/*.bin, "
            "tokenizer.json, documents/ and rejected/ parquet, report.json and report.md. Each stage has its "
            "section in --config (see pipeline/configs/demo.yaml); a config's steps: adds filter steps of your "
            "own (pipeline/README.md).",
            100,
        ),
        epilog="stages:\n" + stage_list_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        help="WARC/WET input: a local directory or glob (quote it), s3://bucket/prefix/ (every WARC/WET file under "
        "it) or an s3:// glob, or an http(s):// URL of one file",
    )
    source.add_argument(
        "--input-list",
        help="a Common Crawl paths listing (e.g. wet.paths.gz; gz or plain, local or remote): one path a line, "
        "joined to --base-url",
    )
    run.add_argument("--base-url", help="prefix for the relative paths of --input-list (https://… or s3://…)")
    run.add_argument(
        "--output",
        required=True,
        help="output directory: a local path, or s3://bucket/prefix or gs://bucket/prefix (workers write "
        "straight to it; on a cluster without a shared filesystem, use object storage). Must not exist "
        "or be empty; complete once manifest.json, written last, is there",
    )
    run.add_argument("--config", help="YAML file overriding the defaults (see pipeline/configs/demo.yaml)")
    add_set_option(run, "config key", "--set dedup.minhash.verify=signature")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="remove what the output holds first (its manifest.json before anything else), finished "
        "output or an unfinished run's work, then run",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished run of this output (same config and inputs), redoing only unfinished work",
    )
    run.add_argument(
        "--accept-code-change",
        action="store_true",
        help="with --resume: continue a run that began under another code version (commit or local changes); "
        "without it such a resume is refused. The finished work keeps the old code's output (each unit's marker "
        "in OUTPUT/.staging/work/done/ names the code that wrote it)",
    )
    run.add_argument(
        "--name",
        help="what the Ray dashboard lists the run's datasets by, and its metrics' run label (default: the output "
        "directory's name)",
    )
    add_address_option(run)
    run.add_argument("--num-cpus", type=int, help="CPUs for a local Ray (default: all)")

    sample = sub.add_parser(
        "sample",
        help="print random kept or rejected documents with their signals and reasons (spot checks)",
    )
    sample.add_argument("--output", required=True, help="a pipeline output directory")
    sample.add_argument("-n", type=int, default=10, help="number of documents (default 10)")
    sample.add_argument("--rejected", action="store_true", help="sample rejected documents instead of kept ones")
    sample.add_argument("--stage", help="only rejected documents of this stage (implies --rejected)")
    sample.add_argument("--reason", help="only rejected documents with this reason (implies --rejected)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--chars", type=int, default=600, help="characters of text to show per document")

    classifier = sub.add_parser("classifier", help="the trained quality classifier (the classifier stage)")
    csub = classifier.add_subparsers(dest="classifier_command", required=True)
    train = csub.add_parser(
        "train",
        help="train a fastText hq/lq classifier on two text files and report its held-out accuracy",
        description="Train a fastText supervised classifier, __label__hq (--positive) against __label__lq "
        "(--negative); one document a line, or JSON lines with a text field (.jsonl/.json/.ndjson, optionally "
        ".gz). Writes MODEL.bin and MODEL.bin.json (training files' sha256, counts, hyperparameters, held-out "
        "accuracy). Deterministic: one thread and --seed.",
    )
    from pipeline.steps.quality_classifier import TrainParams

    defaults = TrainParams()
    train.add_argument("--positive", required=True, help="high-quality examples (label hq)")
    train.add_argument("--negative", required=True, help="low-quality / random web examples (label lq)")
    train.add_argument("--output", required=True, help="the model file to write (e.g. quality.bin)")
    train.add_argument("--epochs", type=int, default=defaults.epochs, help=f"default {defaults.epochs}")
    train.add_argument("--lr", type=float, default=defaults.lr, help=f"default {defaults.lr}")
    train.add_argument(
        "--ngrams",
        type=int,
        default=defaults.ngrams,
        help=f"word n-gram length (fastText wordNgrams), default {defaults.ngrams}",
    )
    train.add_argument("--dim", type=int, default=defaults.dim, help=f"vector size, default {defaults.dim}")
    train.add_argument(
        "--bucket",
        type=int,
        default=defaults.bucket,
        help=f"n-gram hash buckets (model size ≈ bucket × dim × 4 bytes), default {defaults.bucket}",
    )
    train.add_argument(
        "--min-count",
        type=int,
        default=defaults.min_count,
        help=f"drop words seen fewer times, default {defaults.min_count}",
    )
    train.add_argument(
        "--heldout-fraction",
        type=float,
        default=defaults.heldout_fraction,
        help=f"share of documents held out (chosen by a hash of the text), default {defaults.heldout_fraction}",
    )
    train.add_argument("--seed", type=int, default=defaults.seed, help=f"default {defaults.seed}")

    compare = sub.add_parser(
        "compare",
        help="drift between two pipeline outputs: token unigrams, drop rates, language mix, fertility",
        description="Compare two pipeline outputs. Exit 0: within every threshold given; 1: past one (each named); "
        "2: bad input. A threshold not given is not checked.",
    )
    compare.add_argument("--baseline", required=True, help="the reference output directory")
    compare.add_argument("--candidate", required=True, help="the output directory to check")
    compare.add_argument(
        "--max-jsd", type=float, help="largest token unigram Jensen-Shannon divergence allowed, in bits (0-1)"
    )
    compare.add_argument(
        "--max-drop-rate-change",
        type=float,
        help="largest change of any stage's drop rate allowed, absolute (0.05 = 5 points)",
    )
    compare.add_argument(
        "--max-fertility-change",
        type=float,
        help="largest relative change of any language's tokens per word allowed (0.1 = 10%%)",
    )
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON instead of tables")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = stderr_console()
    setup_logging(console=console)
    from ground.storage import StorageError
    from pipeline.errors import PipelineInputError, PipelineOutputError

    try:
        if args.command == "sample":
            from pipeline.sample import print_sample

            print_sample(
                args.output,
                args.n,
                args.rejected or bool(args.stage or args.reason),
                args.stage,
                args.reason,
                args.seed,
                args.chars,
            )
            return 0
        if args.command == "classifier":
            return _classifier(args)
        if args.command == "compare":
            return _compare(args)
        return _run(args, console)
    except (PipelineInputError, PipelineOutputError, StorageError, FileNotFoundError) as err:
        console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        return 2


def _classifier(args: argparse.Namespace) -> int:
    from pipeline.steps.quality_classifier import TrainParams, train_classifier

    params = TrainParams(
        epochs=args.epochs,
        lr=args.lr,
        ngrams=args.ngrams,
        dim=args.dim,
        bucket=args.bucket,
        min_count=args.min_count,
        seed=args.seed,
        heldout_fraction=args.heldout_fraction,
    )
    meta = train_classifier(args.positive, args.negative, args.output, params)
    train, heldout = meta["counts"]["train"], meta["counts"]["heldout"]
    accuracy = meta["heldout_accuracy"]
    print(
        f"trained on {train['hq']} hq + {train['lq']} lq documents; held-out accuracy "
        + (f"{accuracy:.4f}" if accuracy is not None else "n/a")
        + f" on {heldout['hq']} hq + {heldout['lq']} lq"
    )
    print(f"model: {args.output} (sha256 {meta['model']['sha256']}); metadata: {args.output}.json")
    return 0


def _compare(args: argparse.Namespace) -> int:
    import json

    from pipeline.compare import compare_outputs, print_comparison

    result = compare_outputs(
        args.baseline, args.candidate, args.max_jsd, args.max_drop_rate_change, args.max_fertility_change
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_comparison(result, Console())
    return 1 if result["exceeded"] else 0


def _run(args: argparse.Namespace, console: Console) -> int:
    from ground.overrides import ConfigError, parse_set
    from pipeline.config import load_config
    from pipeline.errors import PipelineInputError
    from pipeline.executor import PipelineRun

    try:
        overrides = parse_set(args.set)
    except ConfigError as err:
        raise PipelineInputError(str(err)) from err
    config = load_config(args.config, overrides)
    run = PipelineRun(
        args.input,
        args.output,
        config,
        overwrite=args.overwrite,
        console=console,
        input_list=args.input_list,
        base_url=args.base_url,
        resume=args.resume,
        accept_code_change=args.accept_code_change,
        name=args.name,
    )
    import ray
    from ray.exceptions import RayTaskError

    ray.init(
        address=args.address,
        num_cpus=args.num_cpus if not args.address else None,
        include_dashboard=None,
        log_to_driver=True,
    )
    try:
        run.run()
    except RayTaskError as err:
        # Name the root cause rather than Ray's wrapping of it.
        cause = err.cause if getattr(err, "cause", None) is not None else err
        console.print(f"[bold red]error:[/] {cause}", soft_wrap=True)
        return 1
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
