"""Dedup on real Common Crawl text with planted exact and near duplicates (answers known by construction)."""

import random
import re
import unicodedata

import numpy as np
import pytest

from pipeline.dedup_eval import pair_metrics, planted_set
from pipeline.steps.dedup import (
    EXACT,
    MINHASH,
    DedupConfig,
    DedupKeys,
    jaccard,
    normalise,
    shingle_hashes,
)
from pipeline.steps.dedup_index import deduplicate

BOILERPLATE = (
    "\nShare this page on social media. Subscribe to our newsletter for weekly updates. "
    "Copyright 2020 all rights reserved. Contact us with any questions about our services."
)


def text_jaccard(a: str, b: str, n: int = 5) -> float:
    return jaccard(shingle_hashes(a, n), shingle_hashes(b, n))


def word_ngrams(text: str, n: int = 5) -> frozenset[tuple[str, ...]]:
    """The oracle for MinHash accuracy, written apart from the code under test: the text's word n-grams as tuples
    of strings (no hashing), after the documented normalisation (NFKC, lower case, punctuation to spaces)."""
    words = re.sub(r"[^\w\s]", " ", unicodedata.normalize("NFKC", text).lower()).split()
    return frozenset(tuple(words[i : i + n]) for i in range(max(1, len(words) - n + 1)))


def edit_words(text: str, fraction: float, seed: int) -> str:
    """Replace a fraction of the words at random positions (deterministic)."""
    rng = random.Random(seed)
    words = text.split()
    for i in rng.sample(range(len(words)), max(1, int(len(words) * fraction))):
        words[i] = f"edited{rng.randrange(10**6)}"
    return " ".join(words)


@pytest.fixture
def long_texts(ccnet_texts):
    texts = [t for t in ccnet_texts if len(t.split()) >= 150]
    assert len(texts) >= 6
    return texts


def doc(doc_id: str, text: str) -> dict:
    return {"warc_record_id": doc_id, "text": text}


def test_exact_duplicates_modulo_case_whitespace_punctuation(long_texts):
    original = long_texts[0]
    variant = "  " + original.upper().replace(". ", " .\n\n") + "!"
    assert normalise(original) == normalise(variant)
    docs = deduplicate([doc("id-b", variant), doc("id-a", original), doc("id-c", long_texts[1])])
    assert docs[0]["reason"] == "exact_duplicate" and docs[0]["stage"] == EXACT
    assert docs[0]["duplicate_of"] == "id-a"  # the lowest record id is kept, whatever the order
    assert docs[1].get("reason") is None and docs[2].get("reason") is None


def test_near_duplicates_are_clustered_and_lowest_id_kept(long_texts):
    original = long_texts[0]
    near = edit_words(original, 0.01, seed=1)
    assert 0.8 <= text_jaccard(original, near) < 1.0
    docs = deduplicate([doc("z", near), doc("m", original), doc("a", long_texts[2])])
    assert docs[0]["stage"] == MINHASH and docs[0]["reason"] == "near_duplicate"
    assert docs[0]["duplicate_of"] == "m"
    assert docs[1].get("reason") is None and docs[2].get("reason") is None


def kept_and_dropped(docs: list[dict]) -> tuple[set[str], dict[str, tuple[str, str]]]:
    """The record ids kept, and each dropped one's (reason, duplicate_of)."""
    kept = {d["warc_record_id"] for d in docs if d.get("reason") is None}
    dropped = {d["warc_record_id"]: (d["reason"], d["duplicate_of"]) for d in docs if d.get("reason")}
    return kept, dropped


@pytest.mark.parametrize("actors", [1, 3])  # 3: id-c is owned by another shard than id-a and id-b
def test_an_exact_copy_of_a_near_duplicate_names_the_document_kept(long_texts, actors):
    """id-b is a near duplicate of id-a and id-c an exact copy of id-b: the exact cluster {b, c} has b for its lowest
    key, but b is dropped in the near cluster {a, b, c}. id-c is still dropped as an exact duplicate, and its
    duplicate_of names id-a, the document kept in b's place, not b."""
    original = long_texts[0]
    near = edit_words(original, 0.01, seed=1)
    assert 0.8 <= text_jaccard(original, near) < 1.0
    out = deduplicate(
        [doc("id-c", near), doc("id-b", near), doc("id-a", original)], DedupConfig(num_index_actors=actors)
    )
    kept, dropped = kept_and_dropped(out)
    assert kept == {"id-a"}
    assert dropped == {"id-b": ("near_duplicate", "id-a"), "id-c": ("exact_duplicate", "id-a")}
    assert all(of in kept for _, of in dropped.values())
    assert all(d["stage"] == (EXACT if d["warc_record_id"] == "id-c" else MINHASH) for d in out if d.get("reason"))


@pytest.mark.parametrize("actors", [1, 3])
def test_a_near_duplicate_of_a_kept_exact_pair_names_its_lowest_key(long_texts, actors):
    """The other order: id-b is an exact copy of id-a, which is kept, and id-c a near duplicate of both."""
    original = long_texts[0]
    docs = [doc("id-c", edit_words(original, 0.01, seed=1)), doc("id-b", original.upper()), doc("id-a", original)]
    kept, dropped = kept_and_dropped(deduplicate(docs, DedupConfig(num_index_actors=actors)))
    assert kept == {"id-a"}
    assert dropped == {"id-b": ("exact_duplicate", "id-a"), "id-c": ("near_duplicate", "id-a")}


def test_every_duplicate_names_a_kept_document_whatever_the_order_of_ids_in_a_chain(long_texts):
    """Groups of four: a base, its exact copy, a near variant and the variant's exact copy, their record ids
    shuffled, so that the lowest id of an exact pair is sometimes dropped in its near cluster. Each group keeps its
    lowest id; the others name it, as exact duplicates if a lower id has the same text, else as near ones."""
    rng = random.Random(5)
    groups = []
    for i, base in enumerate(long_texts[:4]):
        variant = edit_words(base, 0.01, seed=i)
        groups.append([base, base.lower(), variant, variant.upper()])
    ids = [f"id-{n:02d}" for n in rng.sample(range(100), 4 * len(groups))]
    docs, expected = [], {}
    for g, texts in enumerate(groups):
        group_ids = ids[4 * g : 4 * g + 4]
        lowest = min(group_ids)
        for t, (record_id, text) in enumerate(zip(group_ids, texts, strict=True)):
            docs.append(doc(record_id, text))
            twin = group_ids[t ^ 1]  # the other text of the same exact pair
            if record_id != lowest:
                expected[record_id] = ("exact_duplicate" if twin < record_id else "near_duplicate", lowest)
    rng.shuffle(docs)
    # The defect's case is there: an exact pair whose lowest id is not its group's.
    assert any(min(ids[i : i + 2]) != min(ids[i - i % 4 : i - i % 4 + 4]) for i in range(0, len(ids), 2))
    for actors in (1, 3):
        kept, dropped = kept_and_dropped(deduplicate([dict(d) for d in docs], DedupConfig(num_index_actors=actors)))
        assert dropped == expected
        assert kept == {min(ids[4 * g : 4 * g + 4]) for g in range(len(groups))}
        assert all(of in kept for _, of in dropped.values())


def test_dissimilar_documents_are_kept(long_texts):
    original = long_texts[0]
    far = edit_words(original, 0.5, seed=2)
    assert text_jaccard(original, far) < 0.3
    docs = deduplicate([doc("a", original), doc("b", far)])
    assert all(d.get("reason") is None for d in docs)


def test_distinct_documents_with_shared_boilerplate_are_kept(long_texts):
    docs = deduplicate([doc(f"id-{i}", text + BOILERPLATE) for i, text in enumerate(long_texts)])
    assert all(d.get("reason") is None for d in docs)


def test_result_does_not_depend_on_order_or_index_sharding(long_texts):
    base = [doc(f"id-{i:02d}", t) for i, t in enumerate(long_texts[:4])]
    planted = [doc(f"id-{10 + i}", edit_words(t, 0.01, seed=i)) for i, t in enumerate(long_texts[:4])]
    planted += [doc("id-20", long_texts[0]), doc("id-21", long_texts[1].lower())]

    def decisions(docs, actors):
        out = deduplicate([dict(d) for d in docs], DedupConfig(num_index_actors=actors))
        return {d["warc_record_id"]: (d.get("reason"), d.get("duplicate_of")) for d in out}

    reference = decisions(base + planted, 1)
    shuffled = base + planted
    random.Random(0).shuffle(shuffled)
    assert decisions(shuffled, 3) == reference
    dropped = {k: v for k, v in reference.items() if v[0]}
    assert dropped == {
        **{f"id-{10 + i}": ("near_duplicate", f"id-{i:02d}") for i in range(4)},
        "id-20": ("exact_duplicate", "id-00"),
        "id-21": ("exact_duplicate", "id-01"),
    }


def test_band_shape_is_validated_and_band_keys_have_one_column_per_band():
    with pytest.raises(ValueError, match="exceeds num_perm"):
        DedupConfig.model_validate({"minhash": {"bands": 30, "rows": 6}})
    keys = DedupKeys(DedupConfig())
    sigs = np.stack([keys.signature("a b c d e f g"), keys.signature("h i j k l m n")])
    assert keys.band_keys(sigs).shape == (2, keys.bands)


def test_already_dropped_documents_are_not_indexed(long_texts):
    docs = [doc("a", long_texts[0]) | {"stage": "quality", "reason": "gopher:min_words"}, doc("b", long_texts[0])]
    deduplicate(docs)
    assert docs[1].get("reason") is None  # its only twin was dropped earlier, so it is not a duplicate


def test_a_file_given_twice_keeps_one_copy_of_each_record(long_texts):
    # The same WET file under two names repeats record ids; each record must still be kept exactly once.
    first = [doc(f"<id-{i}>", t) | {"source": "a.warc.wet.gz", "source_offset": i} for i, t in enumerate(long_texts)]
    second = [d | {"source": "copy-of-a.warc.wet.gz"} for d in first]
    out = deduplicate([dict(d) for d in second + first])
    kept = [d for d in out if d.get("reason") is None]
    assert sorted(d["warc_record_id"] for d in kept) == sorted(d["warc_record_id"] for d in first)
    assert all(d["source"] == "a.warc.wet.gz" for d in kept)  # ties on record id go to the lower source
    dropped = [d for d in out if d.get("reason")]
    assert all(d["reason"] == "exact_duplicate" and d["duplicate_of"] == d["warc_record_id"] for d in dropped)


@pytest.mark.parametrize("verify", ["jaccard", "signature"])
def test_planted_near_duplicates_precision_and_recall(ccnet_texts, verify):
    """No exact copies, exact dedup off: verified MinHash reaches ≥ 0.95 precision and recall at Jaccard 0.8."""
    bases = [" ".join(t.split()[:400]) for t in ccnet_texts if len(t.split()) >= 150]
    docs = planted_set(bases, 160, seed=0)
    config = DedupConfig.model_validate({"exact": {"enabled": False}, "minhash": {"verify": verify}})
    rows = deduplicate([doc(i, t) for i, t in docs], config)
    dropped = {r["warc_record_id"]: r["duplicate_of"] for r in rows if r.get("reason")}
    assert all(r["stage"] == MINHASH for r in rows if r.get("reason"))
    metrics = pair_metrics(docs, dropped, threshold=0.8, ngram=5, shingles=word_ngrams)
    assert metrics.near_miss_pairs > 100 and metrics.true_pairs > 100  # both sides of the threshold are present
    assert metrics.precision >= 0.95 and metrics.recall >= 0.95, metrics
    unverified = deduplicate(
        [doc(i, t) for i, t in docs],
        config.model_copy(update={"minhash": config.minhash.model_copy(update={"verify": "none"})}),
    )
    unverified_dropped = {r["warc_record_id"]: r["duplicate_of"] for r in unverified if r.get("reason")}
    # Verification is what helps.
    assert pair_metrics(docs, unverified_dropped, 0.8, 5, word_ngrams).precision < metrics.precision


def test_the_sketch_is_the_shingle_sets_high_halves_and_keeps_their_jaccard(ccnet_texts):
    """``verify: jaccard`` stores 32-bit sketches: half the bytes of the 64-bit shingle hashes, and the Jaccard of two
    real pages' sketches equals their word 5-gram sets' (the oracle above) within 1/1000, at and around 0.8."""
    keys = DedupKeys(DedupConfig())
    bases = [t for t in ccnet_texts if len(t.split()) >= 150][:8]
    checked = 0
    for seed, base in enumerate(bases):
        for fraction in (0.0, 0.01, 0.03, 0.06):
            variant = edit_words(base, fraction, seed) if fraction else base
            sketches = [keys.keys(t)[2] for t in (base, variant)]
            for text, sketch in zip((base, variant), sketches, strict=True):
                high = (shingle_hashes(text, 5) >> np.uint64(32)).astype(np.uint32)
                assert sketch.dtype == np.uint32 and sketch.tolist() == sorted(set(high.tolist()))
            truth = len(word_ngrams(base) & word_ngrams(variant)) / len(word_ngrams(base) | word_ngrams(variant))
            assert abs(jaccard(*sketches) - truth) < 1e-3, (seed, fraction)
            checked += 1
    assert checked == 32
