"""python -m train.export --run DIR [--output DIR] [--format raylm|hf]: the consolidated model for serving.

Reads ``<run>/final/`` (written by rank 0 at the end of training: full unsharded state dict, model
and train config, a probe of the live model's logits) and writes DESIGN.md's export layout:
``model.safetensors``, ``config.json`` (GPTConfig), ``tokenizer.json`` (copied from the data dir,
checked against the manifest's sha256) and ``lineage.json``. Before writing, the rebuilt model must
reproduce the probe logits: proof that consolidation lost nothing. ``--format hf`` writes the same model
in Hugging Face's GPT-2 layout instead (``train.hf_export``), for transformers, vLLM and lm-evaluation-harness.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from train.layout import FINAL_DIR, FINAL_INFO, FINAL_MODEL, FINAL_PROBE
from train.logsetup import setup_logging
from train.manifest import DataError, load_manifest, sha256_file
from train.model import GPT, GPTConfig

# fp32 runs must match to float rounding; runs that computed in bf16 (FSDP casts parameters to bf16
# for the forward) are compared with the export in bf16, to bf16 precision.
PROBE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


class ExportError(RuntimeError):
    pass


def load_final(run_dir: str | Path) -> tuple[GPT, dict[str, Any]]:
    """Rebuild the trained model from ``<run>/final``; returns (model in eval mode, final.json)."""
    final = Path(run_dir) / FINAL_DIR
    if not (final / FINAL_INFO).is_file():
        raise ExportError(f"{final} has no {FINAL_INFO}: did the run finish? (python -m train ... --output {run_dir})")
    info = json.loads((final / FINAL_INFO).read_text())
    model = GPT(GPTConfig(**info["model_config"]))
    model.load_state_dict(load_file(str(final / FINAL_MODEL)), strict=True)
    return model.eval(), info


@torch.no_grad()
def probe_difference(model: GPT, run_dir: str | Path, precision: str, strategy: str) -> float:
    probe = load_file(str(Path(run_dir) / FINAL_DIR / FINAL_PROBE))
    compute_in_bf16 = precision == "bf16" and strategy == "fsdp"
    candidate = GPT(model.config).eval()
    candidate.load_state_dict(model.state_dict())
    if compute_in_bf16:
        candidate = candidate.to(torch.bfloat16)
    logits, _ = candidate(probe["tokens"])
    return float((logits.float() - probe["logits"]).abs().max())


FORMATS = ("raylm", "hf")


def export(run_dir: str | Path, output_dir: str | Path | None = None, fmt: str = "raylm") -> Path:
    """Check and write the export of a finished run; ``fmt`` raylm (serving's layout) or hf (GPT-2's)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: one of {', '.join(FORMATS)}")
    run = Path(run_dir)
    out = Path(output_dir) if output_dir is not None else run / ("export" if fmt == "raylm" else "export-hf")
    model, info = load_final(run)
    train_config = info["train_config"]
    precision, strategy = train_config["parallel"]["precision"], train_config["parallel"]["strategy"]

    diff = probe_difference(model, run, precision, strategy)
    tolerance = PROBE_TOLERANCE["bf16" if precision == "bf16" and strategy == "fsdp" else "fp32"]
    if diff > tolerance:
        raise ExportError(f"consolidated model does not reproduce the trained logits: max |Δ| {diff:.3g} > {tolerance}")

    try:
        manifest = load_manifest(train_config["data_dir"])
    except DataError as exc:
        raise ExportError(f"cannot copy the tokenizer: {exc}") from exc
    # A mixture's lineage hash covers every source; the tokenizer comes from the first, checked by its own hash.
    sources = info.get("data_sources") or [{"manifest_sha256": info["data_manifest_sha256"]}]
    if manifest.sha256 != sources[0]["manifest_sha256"]:
        raise ExportError(f"{manifest.root}/manifest.json changed since training: the tokenizer may not match")
    tokenizer_sha = sha256_file(manifest.tokenizer_path)
    lineage = {
        "data_manifest_sha256": info["data_manifest_sha256"],
        "data_dir": train_config["data_dir"],
        "data_sources": info.get("data_sources"),
        "tokenizer_sha256": tokenizer_sha,
        "step": info["step"],
        "run_dir": str(run.resolve()),
        "probe_max_abs_logit_diff": diff,
        "train_config": train_config,
    }
    if fmt == "hf":
        from train.hf_export import HFExportError, export_hf

        probe = load_file(str(run / FINAL_DIR / FINAL_PROBE))["tokens"]
        try:
            return export_hf(model, manifest.tokenizer_path, lineage, out, probe)
        except HFExportError as exc:
            raise ExportError(str(exc)) from exc

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(info["model_config"], indent=2))
    shutil.copyfile(manifest.tokenizer_path, out / "tokenizer.json")
    (out / "lineage.json").write_text(json.dumps(lineage, indent=2))
    return out


def load_exported(export_dir: str | Path) -> GPT:
    """The serving side's loader: config.json + model.safetensors -> GPT in eval mode."""
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
    parser.add_argument("--run", required=True, help="training run dir (python -m train --output)")
    parser.add_argument("--output", help="export dir (default: RUN/export, or RUN/export-hf for --format hf)")
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
