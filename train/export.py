"""python -m train.export --run DIR [--output DIR] [--format raylm|hf]: the consolidated model for serving.

Reads ``<run>/final/`` (written by rank 0 at the end of training: full unsharded state dict, model
and train config, a probe of the live model's logits) and writes docs/formats.md's export layout:
``model.safetensors``, ``config.json`` (GPTConfig), ``tokenizer.json`` (copied from the data dir,
checked against the manifest's sha256) and ``lineage.json``, written last, which lists every other file with
its size and sha256. Before writing, the rebuilt model must reproduce the probe logits: proof that
consolidation lost nothing. ``--format hf`` writes the same model in Hugging Face's GPT-2 layout instead
(``train.hf_export``), for transformers, vLLM and lm-evaluation-harness. Run and output are local paths or
object-storage URIs (``s3://…``, ``gs://…``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ground.cache import fetch_published
from ground.hashing import sha256_file
from ground.logsetup import setup_logging
from ground.storage import Location, StorageError
from train.layout import FINAL_DIR, FINAL_INFO, FINAL_MODEL, FINAL_PROBE
from train.manifest import DataError, load_manifest
from train.model import GPT, GPTConfig
from train.run_dir import publish_files

# fp32 runs must match to float rounding; runs that computed in bf16 (FSDP casts parameters to bf16
# for the forward) are compared with the export in bf16, to bf16 precision.
PROBE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


class ExportError(RuntimeError):
    pass


def final_files(run_dir: str | Path | Location) -> Path:
    """``<run>/final`` as a local directory: the run's own for a local run dir; for a run dir in object storage,
    this node's cached copy, each file checked against the sha256 ``final.json`` lists (``ground.cache``)."""
    try:
        final = Location(run_dir).join(FINAL_DIR)
        if not final.join(FINAL_INFO).is_file():
            raise ExportError(
                f"{final} has no {FINAL_INFO}: did the run finish? (python -m train ... --output {run_dir})"
            )
        return fetch_published(final, FINAL_INFO)
    except StorageError as exc:
        raise ExportError(str(exc)) from exc


def load_final(run_dir: str | Path | Location) -> tuple[GPT, dict[str, Any]]:
    """Rebuild the trained model from ``<run>/final``; returns (model in eval mode, final.json)."""
    return load_final_dir(final_files(run_dir))


def load_final_dir(final: Path) -> tuple[GPT, dict[str, Any]]:
    """:func:`load_final` from a local ``final`` directory."""
    info = json.loads((final / FINAL_INFO).read_text())
    model = GPT(GPTConfig(**info["model_config"]))
    model.load_state_dict(load_file(str(final / FINAL_MODEL)), strict=True)
    return model.eval(), info


@torch.no_grad()
def probe_difference(model: GPT, probe: dict[str, torch.Tensor], precision: str, strategy: str) -> float:
    """max |Δ| between ``model``'s logits on the run's probe tokens and the live model's (``final/probe``)."""
    compute_in_bf16 = precision == "bf16" and strategy == "fsdp"
    candidate = GPT(model.config).eval()
    candidate.load_state_dict(model.state_dict())
    if compute_in_bf16:
        candidate = candidate.to(torch.bfloat16)
    logits, _ = candidate(probe["tokens"])
    return float((logits.float() - probe["logits"]).abs().max())


FORMATS = ("raylm", "hf")
LINEAGE = "lineage.json"  # the export's manifest, written last: what the run and data were, and every file's sha256


def export(run_dir: str | Path, output_dir: str | Path | None = None, fmt: str = "raylm") -> Location:
    """Check and write the export of a finished run; ``fmt`` raylm (serving's layout) or hf (GPT-2's).

    Run dir and output are local paths or object-storage URIs. The files are written into the output directory
    (a temporary one for object storage, then uploaded), and ``lineage.json``, which lists every other file with
    its size and sha256, last: a reader takes an export with a lineage.json for complete and can check each file
    (``python -m serve`` does, fetching an export from a bucket). Returns where the export is."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")
    try:
        run = Location(run_dir)
        out = Location(output_dir) if output_dir is not None else run.join("export" if fmt == "raylm" else "export-hf")
    except StorageError as exc:
        raise ExportError(str(exc)) from exc
    final = final_files(run)
    model, info = load_final_dir(final)
    train_config = info["train_config"]
    precision, strategy = train_config["parallel"]["precision"], train_config["parallel"]["strategy"]

    probe = load_file(str(final / FINAL_PROBE))
    diff = probe_difference(model, probe, precision, strategy)
    tolerance = PROBE_TOLERANCE["bf16" if precision == "bf16" and strategy == "fsdp" else "fp32"]
    if diff > tolerance:
        raise ExportError(f"consolidated model does not reproduce the trained logits: max |Δ| {diff:.3g} > {tolerance}")

    try:
        manifest = load_manifest(train_config["data_dir"])
        tokenizer = manifest.tokenizer_file()  # data in object storage: fetched and checked against the manifest
    except (DataError, StorageError) as exc:
        raise ExportError(f"cannot copy the tokenizer: {exc}") from exc
    # A mixture's lineage hash covers every source; the tokenizer comes from the first, checked by its own hash.
    sources = info.get("data_sources") or [{"manifest_sha256": info["data_manifest_sha256"]}]
    if manifest.sha256 != sources[0]["manifest_sha256"]:
        raise ExportError(f"{manifest.root.join('manifest.json')} changed since training: the tokenizer may not match")
    lineage = {
        "data_manifest_sha256": info["data_manifest_sha256"],
        "data_dir": train_config["data_dir"],
        "data_sources": info.get("data_sources"),
        "tokenizer_sha256": sha256_file(tokenizer),
        "step": info["step"],
        "run_dir": run.uri,
        "probe_max_abs_logit_diff": diff,
        "train_config": train_config,
    }
    with _staging(out) as staging:
        if fmt == "hf":
            from train.hf_export import HFExportError, export_hf

            try:
                lineage |= export_hf(model, tokenizer, staging, probe["tokens"])
            except HFExportError as exc:
                raise ExportError(str(exc)) from exc
        else:
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(staging / "model.safetensors"))
            (staging / "config.json").write_text(json.dumps(info["model_config"], indent=2))
            shutil.copyfile(tokenizer, staging / "tokenizer.json")
        publish_files(staging, out, LINEAGE, lineage)
    return out


@contextlib.contextmanager
def _staging(out: Location) -> Iterator[Path]:
    """Where the export's files are written: the output directory itself, or a temporary one for object storage
    (``publish_files`` uploads from it)."""
    if not out.is_remote:
        out.local().mkdir(parents=True, exist_ok=True)
        yield out.local()
        return
    with tempfile.TemporaryDirectory(prefix="raylm-export-") as tmp:
        yield Path(tmp)


def load_exported(export_dir: str | Path) -> GPT:
    """The serving side's loader: config.json + model.safetensors of a local export dir -> GPT in eval mode."""
    export_dir = Path(export_dir)
    model = GPT(GPTConfig(**json.loads((export_dir / "config.json").read_text())))
    model.load_state_dict(load_file(str(export_dir / "model.safetensors")), strict=True)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.export",
        description="Write model.safetensors, config.json, tokenizer.json and lineage.json for serving "
        "(--format raylm), or the same model as a Hugging Face GPT-2 directory (--format hf) that "
        "transformers.AutoModelForCausalLM / AutoTokenizer, vLLM and lm-evaluation-harness load.",
    )
    parser.add_argument("--run", required=True, help="training run dir (python -m train --output), a path or a URI")
    parser.add_argument(
        "--output", help="export dir, a path or a URI (default: RUN/export, or RUN/export-hf for --format hf)"
    )
    parser.add_argument(
        "--format", default="raylm", choices=FORMATS, help="raylm: what `python -m serve` loads (default); "
        "hf: GPT2LMHeadModel + PreTrainedTokenizerFast (needs transformers: pip install 'raylm[hf]')",
    )  # fmt: skip
    args = parser.parse_args(argv)
    setup_logging()
    try:
        out = export(args.run, args.output, args.format)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
