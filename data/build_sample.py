"""Rebuild the two wrapped cc_net files of data/sample/ from data/ccnet-text/ (the output is committed).

The cc_net documents (real Common Crawl text, already extracted) are wrapped as WET `conversion` records
with warcio, keeping their URL and crawl date, so the demo sample is larger while staying real web text.
The sample's other files are upstream files copied unchanged (data/README.md names each source).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import uuid
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter


def wrap_ccnet_as_wet(src: Path, dst: Path) -> int:
    """Write every JSON line of a cc_net file as one WET conversion record; return the record count."""
    count = 0
    with gzip.open(src, "rt", encoding="utf-8") as lines, open(dst, "wb") as out:
        writer = WARCWriter(out, gzip=True)
        writer.write_record(
            writer.create_warcinfo_record(dst.name, {"software": "raylm data/build_sample.py", "source": src.name})
        )
        for line in lines:
            doc = json.loads(line)
            payload = doc["text"].encode("utf-8")
            # A name-based UUID keeps record ids stable across rebuilds.
            record_id = f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, doc['id'])}>"
            headers = StatusAndHeaders(
                "",
                [
                    ("WARC-Type", "conversion"),
                    ("WARC-Target-URI", doc["id"]),
                    ("WARC-Date", doc["metadata"]["date_download"]),
                    ("WARC-Record-ID", record_id),
                    ("WARC-Identified-Content-Language", "eng"),
                    ("Content-Type", "text/plain"),
                ],
                protocol="WARC/1.0",
            )
            record = writer.create_warc_record(
                doc["id"], "conversion", payload=io.BytesIO(payload), length=len(payload), warc_headers=headers
            )
            writer.write_record(record)
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    here = Path(__file__).resolve().parent
    parser.add_argument("--ccnet", type=Path, default=here / "ccnet-text", help="folder of cc_net *.jsonl.gz")
    parser.add_argument("--output", type=Path, default=here / "sample")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    sources = sorted(args.ccnet.glob("*.jsonl.gz"))
    if not sources:
        parser.error(f"{args.ccnet}: no *.jsonl.gz")
    for src in sources:
        dst = args.output / src.name.replace(".jsonl.gz", ".warc.wet.gz")
        print(f"{dst.name}: {wrap_ccnet_as_wet(src, dst)} records")


if __name__ == "__main__":
    main()
