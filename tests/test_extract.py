"""extract: real Common Crawl WET/WARC files, including the damaged ones, and files built to be bad."""

import io
from collections import Counter
from pathlib import Path

import pytest
from conftest import DATA, SAMPLE
from wet_builder import article, record_id, write_wet

from pipeline.errors import PipelineInputError
from pipeline.steps.extract import ExtractConfig, check_is_warc, read_wet

BAD = DATA / "bad-input"


def reasons(docs):
    return Counter(d.get("reason") for d in docs)


def test_real_wet_file_one_row_per_record():
    docs = list(read_wet(SAMPLE / "CC-MAIN-2017-30-head44.warc.wet.gz"))
    assert len(docs) == 44
    assert reasons(docs) == {None: 43, "record_type:warcinfo": 1}
    page = docs[1]
    assert page["url"].startswith("http")
    assert page["warc_record_id"].startswith("<urn:uuid:")
    assert page["warc_date"].startswith("2017-07")
    assert page["text"] and page["source_offset"] > 0


def test_common_crawl_language_header_is_kept():
    docs = list(read_wet(SAMPLE / "CC-MAIN-2024-22-whirlwind.warc.wet.gz"))
    assert [d["cc_language"] for d in docs if d.get("reason") is None] == ["spa"]


def test_truncated_last_member_is_a_counted_drop_not_a_kept_fragment():
    docs = list(read_wet(BAD / "CC-MAIN-2017-30-truncated-last-member.warc.wet.gz"))
    assert len(docs) == 45
    assert reasons(docs) == {None: 43, "record_type:warcinfo": 1, "truncated_record": 1}
    assert docs[-1]["reason"] == "truncated_record" and docs[-1]["text"] is None


def test_unexpected_eof_fragment():
    docs = list(read_wet(BAD / "unexpected-eof.warc.wet.gz"))
    assert reasons(docs) == {None: 15, "record_type:warcinfo": 1, "truncated_record": 1}


def test_single_gzip_stream_is_read_whole_without_duplicates():
    docs = list(read_wet(BAD / "CC-MAIN-2016-50-non-chunked-gzip.warc.wet.gz"))
    assert reasons(docs) == {None: 25, "record_type:warcinfo": 1}
    assert len({d["warc_record_id"] for d in docs}) == len(docs)


def test_plain_uncompressed_wet(tmp_path):
    path = tmp_path / "plain.warc.wet"
    ids = write_wet(path, [("a", article("a harbour")), ("b", article("a mountain"))], gzip=False)
    docs = [d for d in read_wet(path) if d.get("reason") is None]
    assert [d["warc_record_id"] for d in docs] == ids


def test_bad_records_inside_a_good_file_are_counted_drops(tmp_path):
    path = tmp_path / "mixed.warc.wet.gz"
    write_wet(path, [("ok", article("x")), ("latin1", "caf\xe9 cr\xe8me".encode("latin-1")), ("empty", " \n ")])
    docs = list(read_wet(path))
    assert [d.get("reason") for d in docs] == ["record_type:warcinfo", None, "invalid_utf8", "empty_text"]
    assert docs[2]["warc_record_id"] == record_id("latin1")


def _corrupt_copy(src: Path, dst: Path) -> Path:
    data = bytearray(src.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    dst.write_bytes(data)
    return dst


def test_corrupt_gzip_member_fails_naming_the_file(tmp_path):
    good = tmp_path / "good.warc.wet.gz"
    write_wet(good, [(f"d{i}", article(f"town {i}")) for i in range(6)])
    bad = _corrupt_copy(good, tmp_path / "bad.warc.wet.gz")
    with pytest.raises(PipelineInputError, match=r"bad\.warc\.wet\.gz: corrupt input after \d+ records") as err:
        list(read_wet(bad))
    assert str(err.value).isascii() and "\n" not in str(err.value)  # no raw compressed bytes in the message


def test_corrupt_file_can_be_accounted_instead(tmp_path):
    good = tmp_path / "good.warc.wet.gz"
    write_wet(good, [(f"d{i}", article(f"town {i}")) for i in range(6)])
    bad = _corrupt_copy(good, tmp_path / "bad.warc.wet.gz")
    docs = list(read_wet(bad, ExtractConfig(on_corrupt_file="drop")))
    assert docs[-1]["reason"] == "corrupt_file" and docs[-1]["warc_type"] == "unreadable"
    assert 0 < sum(d.get("reason") is None for d in docs) < 6


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"url,text\nhttp://a,hello\n", "not a WARC/WET file"),
        (b"\x1f\x8b\x08\x00garbage-not-deflate", "unreadable gzip stream"),
    ],
)
def test_non_wet_files_are_refused_up_front(tmp_path, content, message):
    path = tmp_path / "input.warc.wet.gz"
    path.write_bytes(content)
    with pytest.raises(PipelineInputError, match=message) as err:
        check_is_warc(path)
    assert str(path) in str(err.value)


def test_gzipped_json_is_not_wet():
    with pytest.raises(PipelineInputError, match="not a WARC/WET file"):
        check_is_warc(DATA / "ccnet-text" / "cc_en_head-0091.jsonl.gz")


def test_warc_html_responses_become_text():
    docs = list(read_wet(SAMPLE / "sample-0000.warc.gz"))
    kept = [d for d in docs if d.get("reason") is None]
    assert len(kept) == 22  # the HTML responses
    assert all(d["warc_type"] == "response" and d["text"].strip() for d in kept)
    assert not any("<html" in d["text"].lower() for d in kept)
    assert reasons(docs)["record_type:request"] == 22


def _write_responses(path, responses):
    """WARC ``response`` records: (name, HTTP status line, content type, body bytes)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as fh:
        writer = WARCWriter(fh, gzip=True)
        for name, status, content_type, body in responses:
            http = StatusAndHeaders(status, [("Content-Type", content_type)], protocol="HTTP/1.1")
            record = writer.create_warc_record(
                f"https://example.org/{name}", "response", payload=io.BytesIO(body), http_headers=http
            )
            writer.write_record(record)


def test_http_status_and_non_html_responses_are_named_drops(tmp_path):
    page = b"<html><body><p>" + b"A real paragraph of text about the town library. " * 10 + b"</p></body></html>"
    path = tmp_path / "crawl.warc.gz"
    _write_responses(
        path,
        [
            ("ok", "200 OK", "text/html; charset=utf-8", page),
            ("missing", "404 Not Found", "text/html", b"<html><body>gone</body></html>"),
            ("logo", "200 OK", "image/png", b"\x89PNG\r\n\x1a\n" + b"\x00" * 64),
        ],
    )
    rows = list(read_wet(path))
    assert [r.get("reason") for r in rows] == [None, "http_status:404", "not_html:image/png"]
    assert "town library" in rows[0]["text"]


def test_a_record_whose_block_no_longer_matches_its_digest_is_dropped(tmp_path):
    path = tmp_path / "crawl.warc"
    body = b"<html><body><p>" + b"The committee met on Tuesday to discuss the budget. " * 8 + b"</p></body></html>"
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    with open(path, "wb") as fh:  # uncompressed, so one byte of the payload can be flipped in place
        http = StatusAndHeaders("200 OK", [("Content-Type", "text/html")], protocol="HTTP/1.1")
        writer = WARCWriter(fh, gzip=False)
        writer.write_record(
            writer.create_warc_record("https://example.org/a", "response", payload=io.BytesIO(body), http_headers=http)
        )
    data = bytearray(path.read_bytes())
    at = data.index(b"committee")
    data[at] = ord("C")  # bit rot inside the block: same length, different bytes
    path.write_bytes(bytes(data))
    rows = list(read_wet(path))
    assert [r.get("reason") for r in rows] == ["digest_mismatch"]
    assert [r.get("reason") for r in read_wet(path, ExtractConfig(check_digests=False))] == [None]
