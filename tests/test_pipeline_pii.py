"""PII stage: recall on real-looking PII planted in real web text, precision on look-alikes, real sample pages."""

from __future__ import annotations

import random
import re

import pytest
from conftest import SAMPLE
from pydantic import ValidationError

from pipeline.config import PipelineConfig
from pipeline.report import count_annotations
from pipeline.steps.base import drop
from pipeline.steps.extract import read_wet
from pipeline.steps.pii import PII_COLUMNS, PLACEHOLDERS, MaskPii, PiiConfig, find_pii, mask_pii


def _private_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    return (
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        .decode()
        .strip()
    )


# Real-looking PII as pages write it: (text, type).
PII = [
    ("jane.doe@example.com", "email"),
    ("J.Smith+newsletter@mail.cs.university.edu", "email"),
    ("INFO@Example-Shop.CO.UK", "email"),
    ("(415) 555-2671", "phone"),
    ("415-555-2671", "phone"),
    ("415.555.2671", "phone"),
    ("+1 415 555 2671", "phone"),
    ("1-800-273-8255", "phone"),
    ("+44 20 7946 0958", "phone"),
    ("+49 30 901820", "phone"),
    ("192.168.1.20", "ip_address"),
    ("8.8.8.8", "ip_address"),
    ("2001:db8:85a3::8a2e:370:7334", "ip_address"),
    ("2001:0db8:0000:0000:0000:ff00:0042:8329", "ip_address"),
    ("fe80::1ff:fe23:4567:890a", "ip_address"),
    ("::ffff:203.0.113.7", "ip_address"),
    ("AKIAIOSFODNN7EXAMPLE", "secret"),  # the AWS documentation's example key id
    ("ASIAY34FZKBOKMUTVV7A", "secret"),
]
SENTENCES = [
    "For questions about this article, write to {} and we will reply within two days.",
    "Contact: {}",
    "The office can be reached at {}, Monday to Friday.",
    "The page listed {} under the photo.",
]
# Text that looks like PII but is not: none of it may change.
LOOK_ALIKES = [
    "Upgrade to v1.2.3 or version 2.0.1.12 before the 3.4.5.6.7 series.",
    "The package was tagged release 10.4.0.1 last week, build 4.18.0.80 is next.",
    "Published on 2024-01-15, updated 15.01.2024 and 01/15/2024 at 12:30:45.",
    "The jacket costs $1,234.56 (was €1.299,00); shipping is $12.50.",
    "ISBN 978-0-13-110362-7, ISBN-10 0-306-40615-2 and ISBN 9780131103627.",
    "Population grew from 3,456,789 to 4,012,345 between 1999-2005 and 2010-2015.",
    "The coordinates are 40.7128, -74.0060 and the ZIP code is 94103-1234.",
    "Use std::vector and std::map; the loopback is ::1 and the MAC is 00:1A:2B:3C:4D:5E.",
    "Octets over 255 are not addresses: 256.1.1.1 or 999.10.10.10, nor 1.2.3.",
    "Follow @mhoye@mastodon.social and @someone on the fediverse.",
    "Chapter 3.2.1.4 covers it; see figure 12.3 and table 4.5.",
    "Our store has 1,234,567 items and 24/7 support, order #12345.",
    "The Bearer of this letter, Authorization pending, is welcome.",
]


def _plant(text: str, items: list[str], rng: random.Random) -> tuple[str, list[str]]:
    """``text`` with each item in a sentence between paragraphs; also the same text with the placeholders."""
    paragraphs = text.split("\n")
    expected = list(paragraphs)
    got = list(paragraphs)
    for item, placeholder in items:
        at = rng.randrange(0, len(got) + 1)
        sentence = rng.choice(SENTENCES)
        got.insert(at, sentence.format(item))
        expected.insert(at, sentence.format(placeholder))
    return "\n".join(got), "\n".join(expected)


def test_real_pages_carry_no_pii_to_begin_with(ccnet_texts):
    # The planting tests below rely on it: all that changes is what was planted.
    assert all(not find_pii(t, PiiConfig()) for t in ccnet_texts)


def test_recall_every_planted_item_is_replaced_and_nothing_else_changes(ccnet_texts):
    rng = random.Random(0)
    items = [(text, PLACEHOLDERS[kind]) for text, kind in PII] + [(_private_key(), PLACEHOLDERS["secret"])]
    for i, page in enumerate(ccnet_texts):
        chosen = rng.sample(items, 4)
        text, expected = _plant(page, chosen, rng)
        masked, counts = mask_pii(text, PiiConfig())
        assert masked == expected, f"page {i}: {chosen}"
        assert sum(counts.values()) == 4


BEARER = ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig", "secret")


@pytest.mark.parametrize(("item", "kind"), [*PII, BEARER])
def test_each_type_is_counted_as_its_type(item: str, kind: str):
    masked, counts = mask_pii(f"Details: {item} (see above).", PiiConfig())
    assert counts[kind] == 1 and sum(counts.values()) == 1
    assert PLACEHOLDERS[kind] in masked


def test_bearer_token_keeps_the_header_and_hides_the_token():
    line = 'curl -H "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl" https://api.test/v1'
    masked, _ = mask_pii(line, PiiConfig())
    assert masked == 'curl -H "Authorization: Bearer <SECRET>" https://api.test/v1'
    code = '{"headers": {"authorization": "bearer sk_live_4eC39HqLyjWDarjtT1zdp7dc"}}'
    assert mask_pii(code, PiiConfig())[0] == '{"headers": {"authorization": "bearer <SECRET>"}}'


def test_a_private_key_cut_off_before_its_end_line_is_still_hidden():
    key = _private_key()
    lines = key.splitlines()
    cut = "\n".join(lines[: len(lines) // 2])
    masked, counts = mask_pii(f"My server key:\n{cut}\nThe rest of the page was lost.", PiiConfig())
    assert masked == "My server key:\n<SECRET>\nThe rest of the page was lost." and counts["secret"] == 1


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_precision_look_alikes_are_left_alone(text: str, ccnet_texts):
    page = f"{ccnet_texts[0]}\n{text}\n{ccnet_texts[1]}"
    assert mask_pii(page, PiiConfig()) == (page, dict.fromkeys(PiiConfig().types, 0))


def test_a_bare_valid_dotted_quad_is_an_address_but_not_after_a_version_word():
    assert mask_pii("Mirror at 2.0.1.12 today.", PiiConfig())[0] == "Mirror at <IP_ADDRESS> today."
    assert mask_pii("Upgrade to version 2.0.1.12 today.", PiiConfig())[0] == "Upgrade to version 2.0.1.12 today."


def test_real_sample_pages_lose_their_email_addresses_and_phone_numbers():
    # The WARC sample holds real faculty and project pages with contact details.
    texts = [d["text"] for f in sorted(SAMPLE.glob("sample-*.warc.gz")) for d in read_wet(f) if d.get("reason") is None]
    # A looser oracle than the stage's regex: anything@domain.tld not written as a fediverse @handle.
    email = re.compile(r"(?<![@\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-z]{2,}", re.IGNORECASE)
    phone = re.compile(r"\b\d{3}-\d{3}-\d{4}\b")
    before = sum(len(email.findall(t)) for t in texts)
    phones = sum(len(phone.findall(t)) for t in texts)
    assert before >= 3 and phones >= 1
    docs = [{"text": t} for t in texts]
    MaskPii()(docs)
    assert all(not email.search(d["text"]) and not phone.search(d["text"]) for d in docs)
    totals = count_annotations(docs)
    assert totals[("pii", "email")] >= before and totals[("pii", "phone")] >= phones


def test_step_sets_counts_per_type_and_leaves_dropped_documents_alone(ccnet_texts):
    docs = [
        {"text": f"{ccnet_texts[0]}\nMail a@example.org or b@example.org, call (415) 555-2671."},
        {"text": ccnet_texts[1]},
        {"text": "Mail c@example.org"},
    ]
    drop(docs[2], "quality", "gopher:min_words")
    MaskPii()(docs)
    assert [docs[0][c] for c in PII_COLUMNS] == [0, 2, 0, 1]  # secret, email, ip_address, phone
    assert docs[0]["text"].endswith("Mail <EMAIL> or <EMAIL>, call <PHONE>.")
    assert docs[1]["text"] == ccnet_texts[1] and all(docs[1][c] == 0 for c in PII_COLUMNS)
    assert docs[2]["text"] == "Mail c@example.org" and "pii_email" not in docs[2]
    counts = count_annotations(docs)
    assert counts[("pii", "email")] == 2 and counts[("pii", "phone")] == 1 and counts[("pii", "secret")] == 0


def test_types_and_enabled_are_configurable():
    text = "Write to a@example.org from 10.0.0.1 or call (415) 555-2671."
    only_email = PiiConfig(types=["email"])
    assert mask_pii(text, only_email) == ("Write to <EMAIL> from 10.0.0.1 or call (415) 555-2671.", {"email": 1})
    docs = [{"text": text}]
    MaskPii(only_email)(docs)
    assert docs[0]["pii_email"] == 1 and docs[0]["pii_phone"] is None
    off = [{"text": text}]
    MaskPii(PiiConfig(enabled=False))(off)
    assert off == [{"text": text}]
    # A national number of another region is found once that region is listed.
    german = "Rufen Sie uns an: 030 901820."
    assert mask_pii(german, PiiConfig())[0] == german
    assert mask_pii(german, PiiConfig(phone_regions=["US", "DE"]))[0] == "Rufen Sie uns an: <PHONE>."


def test_config_rejects_unknown_types_and_keys():
    with pytest.raises(ValidationError):
        PiiConfig(types=["credit_card"])
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate({"pii": {"type": ["email"]}})
