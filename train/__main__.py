"""python -m train --data DIR|URI --output DIR|URI --strategy single|ddp|fsdp --workers N --steps N
[--config FILE.yaml] [--resume]"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ground.logsetup import setup_logging
from ground.overrides import add_set_option, parse_set
from ground.ray_address import add_address_option
from train.config import STRATEGIES, ConfigError, load_config
from train.guard import TrainingDiverged
from train.mixture import parse_mixture
from train.parallel import ReplicaMismatch
from train.preflight import PreflightError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m train",
        description="Train a GPT on the pipeline's token shards with Ray Train (TorchTrainer). "
        "Writes metrics.jsonl, loss_curve.png and final/ (full model) into --output; "
        "then run `python -m train.export --run OUTPUT --output DIR` for serving.",
    )
    parser.add_argument(
        "--data", required=True, help="pipeline output dir (with manifest.json), a path or a URI (s3://…, gs://…: "
        "each node fetches a shard into its cache, $RAYLM_CACHE_DIR, at its first read), or a weighted mixture of "
        "several: name=DIR:weight,name=DIR:weight (e.g. web=runs/web:0.7,books=s3://b/books:0.3; one tokenizer)",
    )  # fmt: skip
    parser.add_argument(
        "--output", required=True, help="run dir, a path or a URI such as s3://bucket/runs/NAME (also Ray Train's "
        "storage_path/name, so the checkpoints go there too)",
    )  # fmt: skip
    parser.add_argument("--strategy", choices=STRATEGIES, help="parallelism (overrides parallel.strategy)")
    parser.add_argument("--workers", type=int, help="Ray Train workers (overrides parallel.workers)")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides steps)")
    parser.add_argument("--config", help="YAML config, e.g. train/configs/demo.yaml")
    add_set_option(parser, "config key", "--set optimizer.lr=3e-4 --set parallel.precision=bf16")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest good checkpoint in --output (same or different --workers; "
        "a different world size reshards model and optimizer state). The model.* keys must be the checkpoint's "
        "(dropout aside): another model is refused",
    )
    add_address_option(parser)
    return parser.parse_args(argv)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"output_dir": args.output}
    if "=" in args.data:
        try:
            overrides["data.mixture"] = parse_mixture(args.data)
        except ValueError as exc:
            raise ConfigError(f"--data: {exc}") from exc
    else:
        overrides["data_dir"] = args.data
    for flag, key in (("strategy", "parallel.strategy"), ("workers", "parallel.workers"), ("steps", "steps")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.resume:
        overrides["checkpoint.resume"] = True
    return overrides | parse_set(args.set)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging()
    try:
        config = load_config(args.config, overrides_from_args(args))
        # Imported late: `--help` and config errors need neither Ray nor matplotlib.
        from train.curves import format_summary
        from train.launch import launch

        summary = launch(config, address=args.address)
    except (ConfigError, PreflightError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (TrainingDiverged, ReplicaMismatch) as exc:
        print(f"training stopped: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
