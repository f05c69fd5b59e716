"""``python -m pipeline compare``: drift between two pipeline outputs, with thresholds to gate on.

What is compared, and where it is read from (no text is re-tokenized):

* token unigram distribution — counted from ``tokens/*.bin`` (``np.bincount`` per shard, in chunks); Jensen–Shannon
  divergence in bits (0 = same, 1 = disjoint) and total variation distance (the share of probability mass that
  moved). Only when both outputs have the same ``tokenizer.json`` (manifest sha256): ids of two vocabularies
  are not the same tokens, so the comparison is skipped and says so.
* per-stage drop rates — ``report.json`` ``stages``; the change is candidate − baseline, in rate units.
* language mix — the ``language`` column of ``documents/*.parquet`` (one column read, not the text).
* fertility (tokens per whitespace word) per language — ``report.json`` ``fertility``, counted in the tokenize
  pass where each document's tokens are known. Outputs written before that field existed are measured from
  ``documents/`` + ``tokens/``: documents lie in a shard in token order, each followed by EOT, so the runs
  between EOTs are the documents' token counts. Either way each output with its own tokenizer: fertility is
  comparable across vocabularies, which is what a tokenizer change is judged by. The change is relative to the
  baseline.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from ground.cache import fetch_verified
from ground.storage import Location, StorageError
from pipeline.errors import PipelineInputError
from pipeline.report import KeptTokenStats

CHUNK_TOKENS = 1 << 24


@dataclass
class Output:
    """A pipeline output directory, checked to be one."""

    root: Location  # a local directory or an s3:// / gs:// prefix
    manifest: dict
    report: dict

    @classmethod
    def open(cls, path: str | Path, role: str) -> Output:
        try:
            root = Location(path)
            if not root.is_dir():
                raise PipelineInputError(f"{root}: {role} is not a directory")
        except StorageError as err:
            raise PipelineInputError(f"{path}: {role}: {err}") from err
        docs = {}
        for name in ("manifest.json", "report.json"):
            file = root / name
            if not file.is_file():
                raise PipelineInputError(f"{root}: {role} is not a pipeline output (no {name})")
            try:
                docs[name] = json.loads(file.read_bytes())
            except (OSError, StorageError, json.JSONDecodeError) as err:
                raise PipelineInputError(f"{file}: cannot read {role}'s {name} ({err})") from err
        manifest, report = docs["manifest.json"], docs["report.json"]
        for key in ("tokenizer", "dtype", "shards"):
            if key not in manifest:
                raise PipelineInputError(f"{root / 'manifest.json'}: no {key!r} ({role} is not a pipeline output)")
        if "stages" not in report:
            raise PipelineInputError(f"{root / 'report.json'}: no 'stages' ({role} is not a pipeline report)")
        for shard in manifest["shards"]:
            if not (root / shard["path"]).is_file():
                raise PipelineInputError(f"{root / shard['path']}: shard listed in the {role}'s manifest is missing")
        return cls(root, manifest, report)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    def unigram_counts(self) -> np.ndarray:
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        for shard in self.manifest["shards"]:
            tokens = np.memmap(self.shard_file(shard), dtype=dtype, mode="r")
            for start in range(0, len(tokens), CHUNK_TOKENS):
                chunk = np.asarray(tokens[start : start + CHUNK_TOKENS])
                if len(chunk) and int(chunk.max()) >= self.vocab_size:
                    raise PipelineInputError(
                        f"{self.root / shard['path']}: token id {int(chunk.max())} outside "
                        f"the vocabulary ({self.vocab_size})"
                    )
                counts += np.bincount(chunk, minlength=self.vocab_size)
        return counts

    def shard_file(self, shard: dict) -> Path:
        """The shard's tokens as a local file: itself, or for an output in object storage this machine's cached copy,
        verified against the manifest's sha256."""
        return fetch_verified(self.root / shard["path"], shard.get("sha256", ""))

    def documents(self, shard: dict, columns: list[str]) -> pa.Table:
        path = self.root / "documents" / (Path(shard["path"]).stem + ".parquet")
        if not path.is_file():
            raise PipelineInputError(f"{path}: documents of shard {shard['path']} missing")
        return pq.read_table(path.path, filesystem=path.fs, columns=columns)

    def language_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for shard in self.manifest["shards"]:
            for lang in self.documents(shard, ["language"])["language"].to_pylist():
                key = lang or "unknown"
                counts[key] = counts.get(key, 0) + 1
        return counts

    def fertility(self) -> dict[str, dict]:
        if "fertility" in self.report:
            return self.report["fertility"]
        return measure_kept_stats(self).fertility()


def measure_kept_stats(output: Output) -> KeptTokenStats:
    """The tokenize pass's kept-document statistics, recomputed from ``documents/`` and ``tokens/``."""
    stats = KeptTokenStats()
    eot = output.manifest["tokenizer"]["eot_id"]
    dtype = np.dtype(output.manifest["dtype"]).newbyteorder("<")
    for shard in output.manifest["shards"]:
        tokens = np.memmap(output.shard_file(shard), dtype=dtype, mode="r")
        ends = np.flatnonzero(np.asarray(tokens) == eot)
        lengths = np.diff(np.concatenate([[-1], ends])) - 1  # tokens between EOTs, the EOT itself excluded
        table = output.documents(shard, ["language", "text"])
        if table.num_rows != len(lengths):
            raise PipelineInputError(
                f"{output.root / shard['path']}: {len(lengths)} documents in the tokens, "
                f"{table.num_rows} in its documents parquet"
            )
        for lang, text, n in zip(
            table["language"].to_pylist(), table["text"].to_pylist(), lengths.tolist(), strict=True
        ):
            stats.add(lang, text, n)
    return stats


def divergence(p_counts: np.ndarray, q_counts: np.ndarray) -> tuple[float, float]:
    """Jensen–Shannon divergence in bits and total variation distance of two count vectors."""
    p = p_counts / max(1, p_counts.sum())
    q = q_counts / max(1, q_counts.sum())
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    jsd = max(0.0, (kl(p) + kl(q)) / 2)  # rounding can leave -1e-17
    return jsd, float(np.abs(p - q).sum() / 2)


def compare_outputs(
    baseline: str | Path,
    candidate: str | Path,
    max_jsd: float | None = None,
    max_drop_rate_change: float | None = None,
    max_fertility_change: float | None = None,
) -> dict:
    """Everything ``compare`` shows, and ``exceeded``: one line per threshold past its limit."""
    base, cand = Output.open(baseline, "baseline"), Output.open(candidate, "candidate")
    result: dict = {"baseline": str(base.root), "candidate": str(cand.root), "exceeded": []}
    exceeded: list[str] = result["exceeded"]

    if base.manifest["tokenizer"]["sha256"] == cand.manifest["tokenizer"]["sha256"]:
        jsd, tvd = divergence(base.unigram_counts(), cand.unigram_counts())
        result["unigram"] = {"jsd_bits": round(jsd, 6), "tvd": round(tvd, 6), "vocab_size": base.vocab_size}
        if max_jsd is not None and jsd > max_jsd:
            exceeded.append(f"unigram JSD {jsd:.4f} bits > --max-jsd {max_jsd}")
    else:
        result["unigram"] = {"skipped": "different tokenizers (different vocabularies): token ids are not comparable"}

    base_stages = {s["name"]: s for s in base.report["stages"]}
    stages = []
    for s in cand.report["stages"]:
        if s["name"] not in base_stages:
            continue
        b, c = base_stages[s["name"]]["drop_rate"], s["drop_rate"]
        stages.append({"stage": s["name"], "baseline": b, "candidate": c, "change": round(c - b, 6)})
        if max_drop_rate_change is not None and abs(c - b) > max_drop_rate_change:
            exceeded.append(
                f"{s['name']} drop rate {b:.2%} → {c:.2%} ({c - b:+.2%}) > --max-drop-rate-change "
                f"{max_drop_rate_change}"
            )
    result["stages"] = stages

    base_langs, cand_langs = base.language_counts(), cand.language_counts()
    nb, nc = max(1, sum(base_langs.values())), max(1, sum(cand_langs.values()))
    langs = sorted(set(base_langs) | set(cand_langs), key=lambda k: -(base_langs.get(k, 0) + cand_langs.get(k, 0)))
    result["languages"] = [
        {
            "language": k,
            "baseline": round(base_langs.get(k, 0) / nb, 6),
            "candidate": round(cand_langs.get(k, 0) / nc, 6),
        }
        for k in langs
    ]

    base_fert, cand_fert = base.fertility(), cand.fertility()
    fertility = []
    for lang in [k for k in base_fert if k in cand_fert]:
        b, c = base_fert[lang]["tokens_per_word"], cand_fert[lang]["tokens_per_word"]
        change = (c - b) / b if b and c is not None else None
        fertility.append(
            {
                "language": lang,
                "baseline": b,
                "candidate": c,
                "change": round(change, 6) if change is not None else None,
            }
        )
        if max_fertility_change is not None and change is not None and abs(change) > max_fertility_change:
            exceeded.append(
                f"{lang} fertility {b} → {c} tokens/word ({change:+.1%}) > --max-fertility-change "
                f"{max_fertility_change}"
            )
    result["fertility"] = fertility
    return result


def print_comparison(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    uni = result["unigram"]
    if "skipped" in uni:
        console.print(f"token unigrams: skipped, {uni['skipped']}")
    else:
        console.print(
            f"token unigrams ({uni['vocab_size']} ids): JSD {uni['jsd_bits']:.4f} bits, "
            f"mass moved (TVD) {uni['tvd']:.2%}"
        )
    table = Table(title="drop rate per stage")
    for col in ("stage", "baseline", "candidate", "change"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in result["stages"]:
        table.add_row(s["stage"], f"{s['baseline']:.2%}", f"{s['candidate']:.2%}", f"{s['change']:+.2%}")
    console.print(table)
    table = Table(title="language mix (kept documents)")
    for col in ("language", "baseline", "candidate"):
        table.add_column(col, justify="left" if col == "language" else "right")
    for row in result["languages"]:
        table.add_row(row["language"], f"{row['baseline']:.1%}", f"{row['candidate']:.1%}")
    console.print(table)
    table = Table(title="fertility (tokens per word, kept documents)")
    for col in ("language", "baseline", "candidate", "change"):
        table.add_column(col, justify="left" if col == "language" else "right")
    for row in result["fertility"]:
        change = row["change"]
        table.add_row(
            row["language"],
            str(row["baseline"]),
            str(row["candidate"]),
            "-" if change is None or math.isnan(change) else f"{change:+.1%}",
        )
    console.print(table)
    for line in result["exceeded"]:
        console.print(f"[bold red]threshold exceeded:[/] {line}", soft_wrap=True)
