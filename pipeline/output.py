"""Writers for the pipeline output directory (layout in DESIGN.md), and its atomic publication."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import PipelineOutputError
from pipeline.schema import DOC_SCHEMA, KEPT_COLUMNS, REJECTED_COLUMNS

KEPT_SCHEMA = pa.schema([DOC_SCHEMA.field(c) for c in KEPT_COLUMNS])
REJECTED_SCHEMA = pa.schema([DOC_SCHEMA.field(c) for c in REJECTED_COLUMNS])
DOCS_PER_ROW_GROUP = 4096


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class StagingDir:
    """Build the output in a sibling temporary directory; rename it into place only when complete.

    A crash leaves at most a ``.tmp-*`` sibling, never a half-written directory under the requested name.
    """

    def __init__(self, output: Path, overwrite: bool) -> None:
        self.output = output
        self.overwrite = overwrite
        if output.exists() and not output.is_dir():
            raise PipelineOutputError(f"{output}: exists and is not a directory")
        if output.is_dir() and any(output.iterdir()) and not overwrite:
            raise PipelineOutputError(f"{output}: directory is not empty (pass --overwrite to replace it)")
        parent = output.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PipelineOutputError(f"{parent}: cannot create output parent directory: {err}") from err
        if not os.access(parent, os.W_OK):
            raise PipelineOutputError(f"{parent}: not writable")
        self.path = parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()

    def publish(self) -> None:
        old = None
        if self.output.exists():
            old = self.output.parent / f".{self.output.name}.old-{uuid.uuid4().hex[:8]}"
            self.output.rename(old)
        self.path.rename(self.output)
        if old is not None:
            shutil.rmtree(old)

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass
class _OpenShard:
    index: int
    bin_path: Path
    bin_file: object
    sha: object
    docs_writer: pq.ParquetWriter
    tokens: int = 0
    docs: int = 0
    pending: list[dict] = field(default_factory=list)

    def flush_docs(self) -> None:
        if self.pending:
            self.docs_writer.write_table(pa.Table.from_pylist(self.pending, schema=KEPT_SCHEMA))
            self.pending.clear()


@dataclass
class SplitShardWriter:
    """Token shards ``tokens/{split}-NNNNN.bin`` with their documents in ``documents/{split}-NNNNN.parquet``.

    A shard closes at the first document end at or after ``shard_tokens``, so every document lies whole in
    one shard and its parquet row order is its order in the token stream.
    """

    root: Path
    split: str
    dtype: np.dtype
    shard_tokens: int
    entries: list[dict] = field(default_factory=list)
    _shard: _OpenShard | None = None

    def _open(self) -> _OpenShard:
        index = len(self.entries)
        name = f"{self.split}-{index:05d}"
        bin_path = self.root / "tokens" / f"{name}.bin"
        bin_path.parent.mkdir(exist_ok=True)
        (self.root / "documents").mkdir(exist_ok=True)
        writer = pq.ParquetWriter(self.root / "documents" / f"{name}.parquet", KEPT_SCHEMA)
        return _OpenShard(index, bin_path, open(bin_path, "wb"), hashlib.sha256(), writer)

    def add(self, doc: dict) -> None:
        if self._shard is None:
            self._shard = self._open()
        shard = self._shard
        data = np.asarray(doc["tokens"], dtype=self.dtype).astype(self.dtype.newbyteorder("<")).tobytes()
        shard.bin_file.write(data)
        shard.sha.update(data)
        shard.tokens += len(doc["tokens"])
        shard.docs += 1
        shard.pending.append(doc)
        if len(shard.pending) >= DOCS_PER_ROW_GROUP:
            shard.flush_docs()
        if shard.tokens >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        shard = self._shard
        if shard is None:
            return
        shard.bin_file.close()
        shard.flush_docs()
        shard.docs_writer.close()
        self.entries.append(
            {
                "path": str(shard.bin_path.relative_to(self.root)),
                "split": self.split,
                "tokens": shard.tokens,
                "docs": shard.docs,
                "sha256": shard.sha.hexdigest(),
            }
        )
        self._shard = None

    def close(self) -> list[dict]:
        self._close()
        return self.entries


class RejectedWriter:
    """``rejected/part-NNNNN.parquet``, a new file every ``rows_per_file`` rows."""

    def __init__(self, root: Path, rows_per_file: int) -> None:
        self.dir = root / "rejected"
        self.dir.mkdir(exist_ok=True)
        self.rows_per_file = rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0
        self.files = 0

    def add(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.dir / f"part-{self.files:05d}.parquet", REJECTED_SCHEMA)
                self.files += 1
                self._rows = 0
            take = min(self.rows_per_file - self._rows, table.num_rows - offset)
            self._writer.write_table(table.slice(offset, take).select(REJECTED_COLUMNS))
            self._rows += take
            offset += take
            if self._rows >= self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def finish(self) -> None:
        self.close()
        if self.files == 0:  # readers of rejected/*.parquet get an empty table, not a missing-file error
            pq.write_table(REJECTED_SCHEMA.empty_table(), self.dir / "part-00000.parquet")
            self.files = 1


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
