"""extract: stream a WET (or WARC) file with warcio into one row per WARC record.

Every record read becomes a row, so nothing is lost: WET ``conversion`` records carry the page text; WARC
``response`` records with an HTML body are turned into text with resiliparse (as Common Crawl turns WARC into
WET); every other record type (``warcinfo``, ``request``, ...), non-HTML or non-200 responses, and every
damaged record is emitted already dropped, with the reason.

Record-level damage (a record cut short by a truncated gzip member, a failed block digest, a payload that is
not UTF-8) is a counted drop. File-level damage (not a WARC file at all, a gzip stream that stops
decompressing mid-file) raises :class:`PipelineInputError` naming the file, or, with
``on_corrupt_file: drop``, becomes one dropped row standing for the unreadable rest of the file.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Literal

from pydantic import BaseModel, ConfigDict
from warcio.archiveiterator import ArchiveIterator
from warcio.exceptions import ArchiveLoadFailed

from pipeline.errors import PipelineInputError
from pipeline.sources import InputUnreadableError
from pipeline.steps.base import Doc, drop

STAGE = "extract"
GZIP_MAGIC = b"\x1f\x8b"


class ExtractConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # A truncated/corrupt gzip stream or a non-WARC file: stop the run naming the file (``fail``), or account
    # for the unreadable rest of the file as one dropped row and go on (``drop``).
    on_corrupt_file: Literal["fail", "drop"] = "fail"
    # Verify WARC-Block-Digest (sha1) of every record: catches bit rot and bad transfers record by record.
    check_digests: bool = True
    # WARC input: keep only the main content of an HTML page (drops navigation, footers, boilerplate).
    html_main_content: bool = True


def check_is_warc(path: str | Path) -> None:
    """Fail on a local file that is missing, empty or not a (gzipped) WARC/WET file, naming it."""
    path = Path(path)
    if not path.is_file():
        raise PipelineInputError(f"{path}: no such file")
    with open(path, "rb") as fh:
        check_stream_is_warc(fh, str(path))


def _header(record, name: str) -> str | None:
    return record.rec_headers.get_header(name)


def html_to_text(body: bytes, main_content: bool) -> str:
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    # With WHATWG remapping (the default) detection falls back to UTF-8 rather than None.
    return extract_plain_text(bytes_to_str(body, detect_encoding(body) or "utf-8"), main_content=main_content)


def _response_text(record, payload: bytes, doc: Doc, main_content: bool) -> str | None:
    """Text of an HTML response, or None after dropping the row with the reason."""
    status = record.http_headers.get_statuscode() if record.http_headers else None
    if status != "200":
        drop(doc, STAGE, f"http_status:{status}")
        return None
    content_type = (record.http_headers.get_header("Content-Type") or "").lower()
    if "html" not in content_type:
        drop(doc, STAGE, f"not_html:{content_type.split(';')[0].strip() or 'unknown'}")
        return None
    return html_to_text(payload, main_content)


def _record_to_doc(record, payload: bytes, source: str, offset: int, config: ExtractConfig) -> Doc:
    doc: Doc = {
        "source": source,
        "source_offset": offset,
        "warc_type": record.rec_type,
        "warc_record_id": _header(record, "WARC-Record-ID"),
        "url": _header(record, "WARC-Target-URI"),
        "warc_date": _header(record, "WARC-Date"),
        "cc_language": _header(record, "WARC-Identified-Content-Language"),
        "text": None,
    }
    if record.rec_type not in ("conversion", "response"):
        drop(doc, STAGE, f"record_type:{record.rec_type}")
        return doc
    declared = record.length
    if record.rec_type == "conversion" and declared is not None and len(payload) < int(declared):
        # warcio yields a record cut off by a truncated gzip member without raising; only the length shows it.
        drop(doc, STAGE, "truncated_record")
        return doc
    if record.digest_checker is not None and record.digest_checker.passed is False:
        drop(doc, STAGE, "digest_mismatch")
        return doc
    if record.rec_type == "response":
        text = _response_text(record, payload, doc, config.html_main_content)
        if text is None:
            return doc
    else:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            drop(doc, STAGE, "invalid_utf8")
            return doc
    doc["text"] = text
    if not text.strip():
        drop(doc, STAGE, "empty_text")
    return doc


def _describe(err: BaseException) -> str:
    """warcio quotes the undecodable bytes it met; keep the message to one printable line."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if first.startswith("Invalid WARC record"):  # warcio met bytes that are neither WARC nor a gzip member
        first = "unreadable WARC record (damaged gzip member or non-WARC data)"
    first = "".join(ch if ch.isascii() and ch.isprintable() else "?" for ch in first)
    return first[:120] + ("…" if len(first) > 120 else "")


def _iterate(stream: BinaryIO, check_digests: bool) -> Iterator[tuple[object, bytes, int]]:
    it = ArchiveIterator(stream, check_digests=check_digests)
    for record in it:
        # The payload must be read before asking for the offset: get_record_offset() skips to the record's end.
        payload = record.content_stream().read()
        yield record, payload, it.get_record_offset()


def read_wet(path: str | Path, config: ExtractConfig | None = None) -> Iterator[Doc]:
    """Yield one row per WARC record of the local file ``path`` (see :func:`read_records`)."""
    with open(path, "rb") as fh:
        yield from read_records(fh, str(path), config)


def check_stream_is_warc(stream: BinaryIO, source: str) -> None:
    """Fail on a stream that is empty or does not start with a WARC record; rewinds it to the start."""
    head = stream.read(2)
    if not head:
        raise PipelineInputError(f"{source}: empty file, expected a WARC/WET file")
    stream.seek(0)
    try:
        first = gzip.GzipFile(fileobj=stream).read(8) if head == GZIP_MAGIC else stream.read(8)
    except (OSError, EOFError, zlib.error) as err:
        raise PipelineInputError(f"{source}: unreadable gzip stream ({err})") from err
    stream.seek(0)
    if not first.startswith(b"WARC/"):
        raise PipelineInputError(f"{source}: not a WARC/WET file (it does not start with a 'WARC/' record header)")


def read_records(stream: BinaryIO, source: str, config: ExtractConfig | None = None) -> Iterator[Doc]:
    """Yield one row per WARC record of ``stream`` (see the module docstring for how damage is handled).

    ``stream`` must allow ``seek(0)``: a WET file compressed as one gzip stream is re-read from the start.
    """
    config = config or ExtractConfig()
    offset = 0
    emitted = 0
    try:
        fh = stream
        try:
            for record, payload, offset in _iterate(fh, config.check_digests):
                yield _record_to_doc(record, payload, source, offset, config)
                emitted += 1
        except ArchiveLoadFailed as err:
            if "non-chunked gzip" not in str(err) or emitted > 1:
                raise
            # One gzip stream around the whole file instead of one member per record: valid, just not
            # seekable. Decompress it as a stream and parse again from the start.
            fh.seek(0)
            already, emitted = emitted, 0
            with gzip.GzipFile(fileobj=fh) as plain:
                for record, payload, offset in _iterate(io.BufferedReader(plain), config.check_digests):
                    emitted += 1
                    if emitted > already:  # the first records were yielded before the error
                        yield _record_to_doc(record, payload, source, offset, config)
    except InputUnreadableError:
        # The bytes could not be fetched (after retries), as opposed to fetched and found damaged.
        if config.on_corrupt_file == "fail":
            raise
        yield corrupt_file_row(source, offset)
    except (ArchiveLoadFailed, OSError, EOFError, ValueError, zlib.error) as err:
        message = f"{source}: corrupt input after {emitted} records (near byte {offset}): {_describe(err)}"
        if config.on_corrupt_file == "fail":
            raise PipelineInputError(message) from err
        yield corrupt_file_row(source, offset)


def corrupt_file_row(source: str, offset: int) -> Doc:
    """One dropped row standing for the unreadable rest of a file (``on_corrupt_file: drop``)."""
    row: Doc = {"source": source, "source_offset": offset, "warc_type": "unreadable", "text": None}
    drop(row, STAGE, "corrupt_file")
    return row
