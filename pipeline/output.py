"""Writers for the pipeline output (layout in docs/formats.md), run inside Ray workers.

A tokenize task writes its input file's kept documents as *pieces*: token runs that close at the first document
end at or after ``shard_tokens``, each with its documents' parquet in token order. The pack step then joins
consecutive pieces into the published shards ``tokens/{split}-NNNNN.bin`` (a shard closes at the first piece end
at or after ``shard_tokens``), so every document lies whole in one shard and shards are not tiny when input
files are.
"""

from __future__ import annotations

import functools
import hashlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ground.storage import Location

DOCS_PER_ROW_GROUP = 4096
COPY_CHUNK = 1 << 22


@dataclass
class _OpenPiece:
    name: str
    files: ExitStack  # the two outputs: whole at their final names when it closes without an error
    bin_file: BinaryIO
    sha: hashlib._Hash
    docs_writer: pq.ParquetWriter
    schema: pa.Schema
    tokens: int = 0
    docs: int = 0
    pending: list[dict] = field(default_factory=list)

    def flush_docs(self) -> None:
        if self.pending:
            self.docs_writer.write_table(pa.Table.from_pylist(self.pending, schema=self.schema))
            self.pending.clear()


@dataclass
class PieceWriter:
    """Pieces ``{prefix}-KKK.bin`` + ``.parquet`` of one split of one input file, in ``directory``; the
    documents with the run's ``schema`` (``DocumentSchemas.kept``)."""

    directory: Location
    prefix: str
    split: str
    dtype: np.dtype
    shard_tokens: int
    schema: pa.Schema
    pieces: list[dict] = field(default_factory=list)
    _piece: _OpenPiece | None = None

    def _open(self) -> _OpenPiece:
        name = f"{self.prefix}-{len(self.pieces):03d}"
        with ExitStack() as files:
            bin_file = files.enter_context((self.directory / f"{name}.bin").open_output())
            docs_file = files.enter_context((self.directory / f"{name}.parquet").open_output())
            writer = pq.ParquetWriter(docs_file, self.schema)
            return _OpenPiece(name, files.pop_all(), bin_file, hashlib.sha256(), writer, self.schema)

    def add(self, doc: dict) -> None:
        if self._piece is None:
            self._piece = self._open()
        piece = self._piece
        data = np.asarray(doc["tokens"], dtype=self.dtype).astype(self.dtype.newbyteorder("<")).tobytes()
        piece.bin_file.write(data)
        piece.sha.update(data)
        piece.tokens += len(doc["tokens"])
        piece.docs += 1
        piece.pending.append(doc)
        if len(piece.pending) >= DOCS_PER_ROW_GROUP:
            piece.flush_docs()
        if piece.tokens >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        piece = self._piece
        if piece is None:
            return
        piece.flush_docs()
        piece.docs_writer.close()
        piece.files.close()
        self.pieces.append(
            {
                "name": piece.name,
                "split": self.split,
                "tokens": piece.tokens,
                "docs": piece.docs,
                "sha256": piece.sha.hexdigest(),
            }
        )
        self._piece = None

    def close(self) -> list[dict]:
        self._close()
        return self.pieces


class RejectedWriter:
    """``rejected/part-FFFFF-KKK.parquet`` for input file FFFFF, a new part every ``rows_per_file`` rows, with the
    run's ``schema`` (``DocumentSchemas.rejected``)."""

    def __init__(self, directory: Location, file_index: int, rows_per_file: int, schema: pa.Schema) -> None:
        self.dir = directory
        self.schema = schema
        self.file_index = file_index
        self.rows_per_file = rows_per_file
        self._writer: pq.ParquetWriter | None = None
        self._file = ExitStack()
        self._name = ""
        self._rows = 0
        self.files: list[str] = []

    def add(self, table: pa.Table) -> None:
        offset = 0
        while offset < table.num_rows:
            if self._writer is None:
                self._name = f"part-{self.file_index:05d}-{len(self.files):03d}.parquet"
                sink = self._file.enter_context((self.dir / self._name).open_output())
                self._writer = pq.ParquetWriter(sink, self.schema)
                self._rows = 0
            take = min(self.rows_per_file - self._rows, table.num_rows - offset)
            self._writer.write_table(table.slice(offset, take).select(self.schema.names).cast(self.schema))
            self._rows += take
            offset += take
            if self._rows >= self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self.files.append(self._name)
            self._writer = None


def write_empty_rejected(directory: Location, schema: pa.Schema) -> None:
    """Readers of rejected/*.parquet get an empty table, not a missing-file error, when nothing was dropped."""
    with (directory / "part-00000-000.parquet").open_output() as out:
        pq.write_table(schema.empty_table(), out)


def pack_shard(root: Location, pieces_dir: Location, pieces: list[dict], name: str, schema: pa.Schema) -> dict:
    """Join consecutive pieces into ``tokens/{name}.bin`` and ``documents/{name}.parquet`` (the run's ``schema``,
    ``DocumentSchemas.kept``, as the pieces have it); return its entry."""
    sha = hashlib.sha256()
    with (root / "tokens" / f"{name}.bin").open_output() as out:
        for piece in pieces:
            with (pieces_dir / f"{piece['name']}.bin").open_input() as src:
                for chunk in iter(functools.partial(src.read, COPY_CHUNK), b""):
                    sha.update(chunk)
                    out.write(chunk)
    with (root / "documents" / f"{name}.parquet").open_output() as out:
        if len(pieces) == 1:
            with (pieces_dir / f"{pieces[0]['name']}.parquet").open_input() as src:
                for chunk in iter(lambda: src.read(COPY_CHUNK), b""):
                    out.write(chunk)
        else:
            with pq.ParquetWriter(out, schema) as writer:
                for piece in pieces:
                    with (pieces_dir / f"{piece['name']}.parquet").open_input() as src:
                        for batch in pq.ParquetFile(src).iter_batches():
                            writer.write_batch(batch)
    return {
        "path": f"tokens/{name}.bin",
        "split": pieces[0]["split"],
        "tokens": sum(p["tokens"] for p in pieces),
        "docs": sum(p["docs"] for p in pieces),
        "sha256": sha.hexdigest(),
    }


def plan_shards(pieces: list[dict], shard_tokens: int) -> list[tuple[str, list[dict]]]:
    """Group pieces (in input-file order) into shards per split: a shard closes at the first piece end at or
    after ``shard_tokens``. A pure function of the pieces, so shard names and contents are deterministic."""
    plan: list[tuple[str, list[dict]]] = []
    for split in ("train", "val"):
        groups: list[list[dict]] = [[]]
        tokens = 0
        for piece in (p for p in pieces if p["split"] == split):
            groups[-1].append(piece)
            tokens += piece["tokens"]
            if tokens >= shard_tokens:
                groups.append([])
                tokens = 0
        plan += [(f"{split}-{i:05d}", group) for i, group in enumerate(g for g in groups if g)]
    return plan
