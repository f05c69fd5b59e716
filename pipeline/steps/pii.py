"""pii: replace personal data and secrets in the kept text by typed placeholders (the document is kept).

| type | placeholder | found by |
|---|---|---|
| ``email`` | ``<EMAIL>`` | a regex (below) |
| ``ip_address`` | ``<IP_ADDRESS>`` | a regex for candidates, validated by Python's ``ipaddress`` |
| ``phone`` | ``<PHONE>`` | ``phonenumbers.PhoneNumberMatcher`` (Google's libphonenumber rules), leniency ``VALID`` |
| ``secret`` | ``<SECRET>`` | regexes: AWS access key ids, PEM private-key blocks, ``Authorization: Bearer`` tokens |

Libraries where one does the job well: phone numbers are validated per region by ``phonenumbers`` (number
lengths and prefixes of every country, dates and times rejected), which no regex matches for precision; IP
candidates are validated by ``ipaddress`` (octets ≤ 255, no leading zeros, IPv6 compression rules). Emails and
key formats are hand-written: no maintained library finds them in free text (``email-validator`` checks one
given address), and the key formats are fixed, documented prefixes and armour lines.

Precision choices, each tested on look-alikes (``tests/test_pipeline_pii.py``):

* A valid dotted quad is an IPv4 address, except right after a version word (``v``, ``version``, ``ver``,
  ``release``, ``build``, ``firmware``, ``update``) or a numbering word (``chapter``, ``section``, ``§``,
  ``figure``, ``table``, ...): ``version 2.0.1.12`` and ``Chapter 3.2.1.4`` are kept, a bare ``2.0.1.12`` is
  masked (it is a valid address, and the text cannot tell). Three-part versions (``1.2.3``), quads with an octet over
  255 and dotted runs of five or more numbers (``1.2.3.4.5``) never match.
* Dates, prices, ISBNs and plain counts are not phone numbers for libphonenumber at ``VALID`` leniency. The
  matcher only reads windows around runs of 7+ digits (most pages have none; it finds the same numbers as on the
  whole text, several times faster).
* IPv6 needs two non-empty groups (so ``::`` in C++ or ``::1`` alone stay) and validation by ``ipaddress``.

Spans are found on the original text for every enabled type, overlaps are resolved by type priority (secret,
email, ip_address, phone: a key block may contain anything), and all are replaced in one pass. Per-type counts
go to the ``pii_<type>`` columns (None for a type not enabled) and from there to the report.
"""

from __future__ import annotations

import bisect
import ipaddress
import re
from collections.abc import Iterator
from typing import Literal, get_args

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from pipeline.steps.base import Doc, Step

STAGE = "pii"

PiiType = Literal["email", "ip_address", "phone", "secret"]
# Also the priority order when spans overlap, and the order of the pii_* columns.
PII_TYPES: tuple[str, ...] = ("secret", "email", "ip_address", "phone")
PLACEHOLDERS = {"email": "<EMAIL>", "ip_address": "<IP_ADDRESS>", "phone": "<PHONE>", "secret": "<SECRET>"}
PII_COLUMNS: tuple[str, ...] = tuple(f"pii_{t}" for t in PII_TYPES)


class PiiConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # On by default: masking keeps every document and its text around the placeholder, and personal data and
    # credentials are what a model must not memorise (FineWeb masks emails and IPs; Dolma emails, phones, IPs).
    enabled: bool = True
    types: list[PiiType] = Field(default_factory=lambda: list(get_args(PiiType)))
    # Regions (ISO 3166 alpha-2) whose national number formats are recognised; numbers written with a +country
    # code are found whatever the region. US matches the default language filter (English).
    phone_regions: list[str] = Field(default_factory=lambda: ["US"])


# --- finders: each yields (start, end) spans of one type ---------------------------------------------------

# Local part and domain per RFC 5322's common subset (dot-atoms; no quoted local parts, which web text does
# not carry); the TLD must be 2+ letters so "name@host" in code or "a@b.c" does not match. Not after "@": a
# fediverse handle (@user@mastodon.social) is a public name, like an @handle, not a mailbox.
_EMAIL = re.compile(
    r"(?<![\w.%+@-])[A-Za-z0-9][A-Za-z0-9._%+-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
    r"[A-Za-z]{2,24}(?![\w-])"
)
# Four dot-separated numbers, not part of a longer dotted number run or a word.
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
# Words after which a dotted quad is a version or a section number, not an address.
_NUMBERING_WORDS = (
    "version",
    "ver",
    "release",
    "build",
    "firmware",
    "update",
    "chapter",
    "section",
    "sec",
    "clause",
    "article",
    "figure",
    "fig",
    "table",
    "appendix",
    "step",
    "rule",
)
_NUMBERING_BEFORE = re.compile(rf"(?:\bv|\b(?:{'|'.join(_NUMBERING_WORDS)})[\s:.#-]*|§\s*)$", re.IGNORECASE)
# Hex groups and colons (with an optional trailing dotted quad, ::ffff:1.2.3.4), validated by ipaddress.
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{1,4})?(?![\w:]|\.\d)")
# AWS access key ids: "AKIA" (long-term) or "ASIA" (temporary) + 16 upper-case letters/digits (AWS IAM docs,
# "Understanding unique ID prefixes").
_AWS_KEY = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")
# PEM armour (RFC 7468) of any private key; a block cut off before its END line is masked up to the last
# line that is base64 (no spaces) or an armour header ("Proc-Type: ..."), so a truncated page does not leak the
# key either.
_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
    r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|(?:[ \t]*\r?\n[ \t]*(?:[A-Za-z0-9+/=]{4,}|[\w-]+:[^\n]*))+)",
    re.DOTALL,
)
# The token of an Authorization header (RFC 6750 b64token), as in curl lines, HTTP dumps, JSON or code; the
# header name and "Bearer" stay so the text reads the same.
_BEARER = re.compile(r"(?i:authorization)[\"']?\s*[:=]\s*[\"']?(?i:bearer)\s+([A-Za-z0-9\-._~+/]{8,}=*)")
# At least 7 digits with only phone punctuation between them: the pre-check before the (slow) phone matcher.
_DIGIT_RUN = re.compile(r"\d(?:[\s().+/-]{0,3}\d){6,}")
_WINDOW_BEFORE, _WINDOW_AFTER = 16, 24


def _emails(text: str) -> Iterator[tuple[int, int]]:
    for m in _EMAIL.finditer(text):
        yield m.span()


def _is_ip(candidate: str) -> bool:
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True


def _ip_addresses(text: str) -> Iterator[tuple[int, int]]:
    # IPv6 first: "::ffff:10.0.0.1" is one address, not a prefix and an IPv4 one (later overlaps are skipped).
    for m in _IPV6.finditer(text):
        value = m.group()
        head = value.rsplit(":", 1)[0] if "." in value else value  # groups before an embedded IPv4
        if sum(1 for g in head.split(":") if g) + ("." in value) >= 2 and _is_ip(value):
            yield m.span()
    for m in _IPV4.finditer(text):
        if _is_ip(m.group()) and not _NUMBERING_BEFORE.search(text, max(0, m.start() - 12), m.start()):
            yield m.span()


def _digit_windows(text: str) -> Iterator[tuple[int, int]]:
    """Stretches of text around runs of 7+ digits, merged where they overlap: the only places a phone number
    can be. Context on each side keeps what the matcher reads around a number ("+", "(", "ext. 12", an
    adjacent letter that disqualifies it)."""
    start = end = -1
    for m in _DIGIT_RUN.finditer(text):
        s, e = max(0, m.start() - _WINDOW_BEFORE), min(len(text), m.end() + _WINDOW_AFTER)
        if s > end:
            if end > start:
                yield start, end
            start = s
        end = max(end, e)
    if end > start:
        yield start, end


def _phones(text: str, regions: list[str]) -> Iterator[tuple[int, int]]:
    # PhoneNumberMatcher is pure Python and scans all it is given (~8 ms per 10 kB page with digits in it);
    # given only the windows around digit runs it finds the same numbers at a fraction of the cost.
    from phonenumbers import Leniency, PhoneNumberMatcher

    for start, end in _digit_windows(text):
        window = text[start:end]
        for region in regions:
            for match in PhoneNumberMatcher(window, region, leniency=Leniency.VALID):
                yield start + match.start, start + match.end


def _secrets(text: str) -> Iterator[tuple[int, int]]:
    for m in _AWS_KEY.finditer(text):
        yield m.span()
    if "PRIVATE KEY-----" in text:
        for m in _PRIVATE_KEY.finditer(text):
            yield m.span()
    for m in _BEARER.finditer(text):
        yield m.span(1)


def find_pii(text: str, config: PiiConfig) -> list[tuple[int, int, str]]:
    """Non-overlapping ``(start, end, type)`` spans in text order; on overlap the higher-priority type wins."""
    finders = {
        "secret": lambda: _secrets(text),
        "email": lambda: _emails(text),
        "ip_address": lambda: _ip_addresses(text),
        "phone": lambda: _phones(text, config.phone_regions),
    }
    taken: list[tuple[int, int, str]] = []  # sorted by start, non-overlapping
    for kind in PII_TYPES:
        if kind not in config.types:
            continue
        for start, end in finders[kind]():
            # Only the neighbours in start order can overlap a new span (the kept spans do not overlap).
            i = bisect.bisect_left(taken, (start, end))
            if (i > 0 and taken[i - 1][1] > start) or (i < len(taken) and taken[i][0] < end):
                continue
            taken.insert(i, (start, end, kind))
    return taken


def mask_pii(text: str, config: PiiConfig) -> tuple[str, dict[str, int]]:
    """``text`` with every span replaced by its placeholder, and the number of placeholders per type."""
    spans = find_pii(text, config)
    counts: dict[str, int] = dict.fromkeys(config.types, 0)
    if not spans:
        return text, counts
    parts: list[str] = []
    pos = 0
    for start, end, kind in spans:
        parts += [text[pos:start], PLACEHOLDERS[kind]]
        counts[kind] += 1
        pos = end
    parts.append(text[pos:])
    return "".join(parts), counts


class MaskPii(Step):
    """Rewrites ``text`` with placeholders and sets ``pii_<type>`` (placeholders of that type; None if the type
    or the stage is off). Never drops."""

    name = STAGE
    summary = "mask emails, IP addresses, phone numbers and secrets with placeholders (pii_<type> counts them)"
    columns = tuple(pa.field(column, pa.int64()) for column in PII_COLUMNS)
    config_model = PiiConfig

    def __init__(self, config: PiiConfig | None = None) -> None:
        self.config = config or PiiConfig()

    def apply(self, docs: list[Doc]) -> None:
        if not self.config.enabled:
            return
        for doc in docs:
            text, counts = mask_pii(doc.get("text") or "", self.config)
            if any(counts.values()):
                doc["text"] = text
            for kind in PII_TYPES:
                doc[f"pii_{kind}"] = counts.get(kind)
