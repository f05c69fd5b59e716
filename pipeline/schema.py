"""The columns a document row carries through the pipeline, and which of them each output file keeps.

Every batch is converted with this one schema, so blocks from different files and workers always concatenate
(a column that happens to be all-null in one batch still has its type).
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.steps.perplexity import BUCKET_COLUMN
from pipeline.steps.perplexity import SCORE_COLUMN as PERPLEXITY_COLUMN
from pipeline.steps.pii import PII_COLUMNS
from pipeline.steps.quality import QUALITY_SIGNALS
from pipeline.steps.quality_classifier import SCORE_COLUMN

# Stage order is the order of the report and of the steps (pipeline.file_tasks.filter_steps runs the ones before
# dedup). url_filter comes right after extract: it needs only the URL and spares blocked pages every later step.
STAGES = (
    "extract",
    "url_filter",
    "language",
    "quality",
    "classifier",
    "perplexity",
    "decontamination",
    "pii",
    "dedup_exact",
    "dedup_minhash",
    "tokenize",
)
# The stages the filter pass runs and counts; the tokenize pass (dedup decisions, tokens) counts the rest.
FILTER_STAGES = STAGES[: STAGES.index("dedup_exact")]
TOKENIZE_PASS_STAGES = STAGES[len(FILTER_STAGES) :]

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
# The rule signals, then the trained classifier's P(hq) and the reference LM's perplexity (null when their stage is
# off), and the perplexity's head / middle / tail within its language over the run (set in the tokenize pass).
SIGNAL_FIELDS = [
    *(pa.field(name, pa.float64()) for name in (*QUALITY_SIGNALS, SCORE_COLUMN, PERPLEXITY_COLUMN)),
    pa.field(BUCKET_COLUMN, pa.string()),
]
# What decontamination and PII masking found: the eval sets a document matched (comma-separated, null when none
# or the stage is off; kept documents carry it under ``action: flag``) and the placeholders of each PII type.
ANNOTATION_FIELDS = [
    pa.field("contamination", pa.string()),
    *(pa.field(name, pa.int64()) for name in PII_COLUMNS),
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
    pa.field("shingles", pa.list_(pa.uint64())),  # sorted shingle hashes, only when minhash.verify = jaccard
]

DOC_SCHEMA = pa.schema([*RECORD_FIELDS, *SIGNAL_FIELDS, *ANNOTATION_FIELDS, *DECISION_FIELDS, TEXT_FIELD, *WORK_FIELDS])
# work/filtered/NNNNN.parquet: every record of one input file after the filter steps (extract … pii), with keys.
FILTERED_SCHEMA = pa.schema(
    [*RECORD_FIELDS, *SIGNAL_FIELDS, *ANNOTATION_FIELDS, *DECISION_FIELDS, TEXT_FIELD, *DEDUP_FIELDS]
)

# documents/*.parquet and rejected/*.parquet (docs/formats.md): provenance, language, signals, annotations, text
# (+ decision).
KEPT_COLUMNS = [f.name for f in (*RECORD_FIELDS, *SIGNAL_FIELDS, *ANNOTATION_FIELDS)] + ["split", "text"]
REJECTED_COLUMNS = [f.name for f in (*RECORD_FIELDS, *SIGNAL_FIELDS, *ANNOTATION_FIELDS, *DECISION_FIELDS)] + ["text"]


def to_table(rows: list[dict], schema: pa.Schema = DOC_SCHEMA) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)
