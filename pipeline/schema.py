"""The columns a document row carries through the pipeline, and which of them each output file keeps.

Every batch of a run is converted with the run's one schema (``DocumentSchemas``, from its filter steps' columns:
``pipeline.stage_plan``), so blocks from different files and workers always concatenate (a column that happens
to be all-null in one batch still has its type).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

RECORD_FIELDS = [
    pa.field("source", pa.string()),
    pa.field("source_offset", pa.int64()),
    pa.field("warc_type", pa.string()),
    pa.field("warc_record_id", pa.string()),
    pa.field("url", pa.string()),
    pa.field("warc_date", pa.string()),
    pa.field("cc_language", pa.string()),
    pa.field("language", pa.string()),
    pa.field("language_score", pa.float64()),
]
DECISION_FIELDS = [
    pa.field("stage", pa.string()),
    pa.field("reason", pa.string()),
    pa.field("duplicate_of", pa.string()),
]
TEXT_FIELD = pa.field("text", pa.large_string())
WORK_FIELDS = [pa.field("tokens", pa.list_(pa.uint32())), pa.field("split", pa.string())]
# Dedup keys the filter pass persists for the dedup pass (null for documents already dropped).
DEDUP_FIELDS = [
    pa.field("exact_key", pa.binary(16)),
    pa.field("signature", pa.binary()),  # MinHash signature, num_perm little-endian uint32
    pa.field("shingles", pa.list_(pa.uint32())),  # the dedup sketch (sketch_of), only when minhash.verify = jaccard
]


@dataclass(frozen=True)
class DocumentSchemas:
    """The schemas of one run's documents, given the columns its filter steps add (``Step.columns``: the built-in
    steps' rule signals, classifier score, perplexity and its bucket, contamination and PII counts, in stage order,
    then the columns of the steps a config adds; ``StagePlan.schemas``)."""

    step_fields: tuple[pa.Field, ...]

    @property
    def filtered(self) -> pa.Schema:
        """work/filtered/NNNNN.parquet: every record of one input file after the filter steps, with its keys."""
        return pa.schema([*RECORD_FIELDS, *self.step_fields, *DECISION_FIELDS, TEXT_FIELD, *DEDUP_FIELDS])

    @property
    def kept(self) -> pa.Schema:
        """documents/*.parquet (docs/formats.md): provenance, language, the steps' columns, split, text."""
        return pa.schema([*RECORD_FIELDS, *self.step_fields, WORK_FIELDS[1], TEXT_FIELD])

    @property
    def rejected(self) -> pa.Schema:
        """rejected/*.parquet: as documents/, with the decision (stage, reason, duplicate_of) instead of split."""
        return pa.schema([*RECORD_FIELDS, *self.step_fields, *DECISION_FIELDS, TEXT_FIELD])


def to_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)
