"""Command line: ``python -m pipeline run|sample ...`` (see ``--help``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rich.console import Console


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="CommonCrawl WET shards → clean, deduplicated, tokenized training shards, on Ray Data.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run the pipeline",
        description="extract → language → quality → dedup_exact → dedup_minhash → tokenize; writes manifest.json, "
        "tokens/*.bin, tokenizer.json, documents/ and rejected/ parquet, report.json and report.md.",
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
    run.add_argument("--output", required=True,
                     help="output directory (must not exist or be empty); on a cluster, a path every node sees")
    run.add_argument("--config", help="YAML file overriding the defaults (see pipeline/configs/demo.yaml)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value, e.g. --set dedup.minhash.verify=signature (repeatable)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace a non-empty output directory when done, and discard an unfinished run's work")
    run.add_argument("--resume", action="store_true",
                     help="continue the unfinished run of this output (same config and inputs), redoing only "
                     "unfinished work")
    run.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster address ('auto' for the cluster this node belongs to); default: a local Ray",
    )
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
    return parser


def _setup_logging(console: Console) -> None:
    """Rich log lines on a terminal; plain, unwrapped lines when stderr is a file or a pipe (CI, ray job logs)."""
    if console.is_terminal:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    _setup_logging(console)
    from pipeline.errors import PipelineInputError, PipelineOutputError

    try:
        if args.command == "sample":
            from pipeline.sample import print_sample

            print_sample(args.output, args.n, args.rejected or bool(args.stage or args.reason),
                         args.stage, args.reason, args.seed, args.chars)
            return 0
        return _run(args, console)
    except (PipelineInputError, PipelineOutputError, FileNotFoundError) as err:
        console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    from pipeline.config import load_config
    from pipeline.errors import PipelineInputError
    from pipeline.executor import PipelineRun
    from train.overrides import ConfigError, parse_set

    try:
        overrides = parse_set(args.set)
    except ConfigError as err:
        raise PipelineInputError(str(err)) from err
    config = load_config(args.config, overrides)
    run = PipelineRun(args.input, args.output, config, overwrite=args.overwrite, console=console,
                      input_list=args.input_list, base_url=args.base_url, resume=args.resume)
    import ray
    from ray.exceptions import RayTaskError

    ray.init(address=args.address, num_cpus=args.num_cpus if not args.address else None,
             include_dashboard=None, log_to_driver=True)
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
