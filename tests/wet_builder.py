"""Build small WET files with warcio whose right answers are known (languages, duplicates, bad documents)."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter


def record_id(name: str) -> str:
    return f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, name)}>"


def write_wet(path: Path, docs: list[tuple[str, str | bytes]], gzip: bool = True, warcinfo: bool = True) -> list[str]:
    """Write ``(name, text)`` documents as WET conversion records; return their record ids in order."""
    ids = []
    with open(path, "wb") as out:
        writer = WARCWriter(out, gzip=gzip)
        if warcinfo:
            writer.write_record(writer.create_warcinfo_record(path.name, {"software": "tests"}))
        for name, text in docs:
            payload = text if isinstance(text, bytes) else text.encode("utf-8")
            rid = record_id(name)
            headers = StatusAndHeaders(
                "",
                [
                    ("WARC-Type", "conversion"),
                    ("WARC-Target-URI", f"https://example.test/{name}"),
                    ("WARC-Date", "2024-05-18T01:58:10Z"),
                    ("WARC-Record-ID", rid),
                    ("Content-Type", "text/plain"),
                ],
                protocol="WARC/1.0",
            )
            writer.write_record(
                writer.create_warc_record(
                    f"https://example.test/{name}",
                    "conversion",
                    payload=io.BytesIO(payload),
                    length=len(payload),
                    warc_headers=headers,
                )
            )
            ids.append(rid)
    return ids


# Real-sounding English prose of several paragraphs that passes the default quality rules.
ARTICLE_PARAGRAPHS = [
    "The old harbour town has changed a great deal over the last twenty years. Where fishing boats once crowded "
    "the quay, there are now small cafes, a bookshop and a museum that tells the story of the people who built "
    "the sea wall by hand.",
    "Most visitors arrive by the coastal train, which runs every hour in the summer and twice a day in the winter. "
    "The station is a short walk from the market square, and the walk takes you past the church and the former "
    "customs house.",
    "Local historians say that the first houses were built with stone taken from the cliffs to the north. Some of "
    "those houses are still standing, and a few of them have been turned into guest houses that are open all year.",
    "If you plan to stay for more than a day, it is worth taking the ferry to the island. The crossing is calm "
    "in good weather, and the island has a lighthouse, a colony of seabirds and a long beach with fine white sand.",
]


def article(topic: str, paragraphs: int = 4) -> str:
    """A clean multi-paragraph article; ``topic`` makes each one distinct in its first sentence."""
    opening = (
        f"This is a short guide about {topic}, written for readers who have never been there before and who "
        f"want to know what to expect when they arrive."
    )
    return "\n\n".join([opening, *ARTICLE_PARAGRAPHS[:paragraphs]])
