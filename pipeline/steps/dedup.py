"""dedup_exact and dedup_minhash: find duplicate clusters across all input files, keep the lowest record id.

Deduplication has to see every document before it can decide, so it runs in three parts, each a plain Python
object so the same code runs in-process (tests, bench: :func:`deduplicate`) and in Ray actors (the executor):

1. :class:`DedupKeys` turns a document into its keys: the exact key (hash of the normalised text), a MinHash
   signature over word n-grams, one LSH bucket key per band, and the sketch used to verify candidates.
2. :class:`~pipeline.steps.dedup_index.BucketIndex` shards hold the buckets (exact keys and LSH bands spread
   over the shards), verify every LSH candidate pair against ``minhash.threshold`` and keep the verified edges.
3. The shards compute connected components among themselves by min-label propagation
   (:func:`~pipeline.steps.dedup_index.resolve_clusters`), so no process ever holds every edge; each shard then
   knows, for the documents it owns, whether they are exact or near duplicates and of which kept document.

Exact clusters keep their lowest document key (record id first); near clusters are formed over exact and
verified near edges and keep their lowest key, which is always an exact-cluster survivor.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.steps.base import Doc, Step, drop

EXACT = "dedup_exact"
MINHASH = "dedup_minhash"

_PUNCT = re.compile(r"[^\w\s]", re.UNICODE)
# Odd 64-bit constants: the n-gram rolling multiplier and splitmix64's finaliser (public-domain constants).
_ROLL = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MAX_ROWS_PER_CHUNK = 8192  # shingles hashed against all permutations at once (bounds memory on huge pages)


class ExactDedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True


class MinHashDedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    threshold: float = Field(0.8, gt=0.0, lt=1.0)  # Jaccard similarity of word n-gram sets
    num_perm: int = Field(128, ge=16)
    ngram: int = Field(5, ge=1)
    seed: int = 1
    # Bands × rows are chosen for recall (a pair at Jaccard 0.8 becomes a candidate with p = 0.998 at 20 × 6);
    # precision comes from verifying every candidate, not from the band shape. p(J) = 1 - (1 - J^rows)^bands.
    bands: int = Field(20, ge=1)
    rows: int = Field(6, ge=1)
    # How a candidate pair is confirmed: ``jaccard`` = Jaccard of the two shingle sets (stores each document's
    # shingles in the index as 32-bit hashes, see ``sketch_of``); ``signature`` = the Jaccard estimated from the
    # MinHash signatures (num_perm × 4 bytes per document; std error ≈ sqrt(J(1-J)/num_perm)); ``none`` = every
    # LSH candidate is a duplicate (datatrove's and NeMo Curator's default).
    verify: Literal["jaccard", "signature", "none"] = "jaccard"

    @model_validator(mode="after")
    def _bands_fit(self) -> MinHashDedupConfig:
        if self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands × rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}")
        return self


class DedupConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exact: ExactDedupConfig = Field(default_factory=ExactDedupConfig)
    minhash: MinHashDedupConfig = Field(default_factory=MinHashDedupConfig)
    num_index_actors: int = Field(2, ge=1)  # index shards (Ray actors) holding buckets, sketches and labels
    # Each shard keeps its documents, sketches and bucket entries in files on its node's local disk
    # (pipeline/steps/dedup_spill.py), in this directory (None: the system's temp dir on that node).
    spill_dir: str | None = None
    # Bucket entries are split over this many files by key; verifying holds one file's entries in memory at a
    # time (16 bytes each). A file grown past 2^19 entries is split on disk first, so a corpus too big for this
    # count costs disk passes, not memory.
    spill_partitions: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _spill_dir_is_local(self) -> DedupConfig:
        if self.spill_dir is not None and "://" in self.spill_dir:
            raise ValueError(
                f"dedup.spill_dir must be a local directory on each index shard's node, not a URI: {self.spill_dir!r}"
            )
        return self


def doc_key(doc: Doc) -> str:
    """The identity dedup clusters: the record id first, so the lowest key is the lowest record id.

    Record ids are unique within a crawl, but the same file listed twice or copied repeats them; source and
    offset keep such records apart instead of merging them into one node.
    """
    return f"{doc['warc_record_id']}\x00{doc.get('source') or ''}\x00{doc.get('source_offset') or 0}"


def record_id_of(key: str) -> str:
    return key.split("\x00", 1)[0]


def normalise(text: str) -> str:
    """Case, punctuation, Unicode form and whitespace differences do not make a document new."""
    text = unicodedata.normalize("NFKC", text).lower()
    return " ".join(_PUNCT.sub(" ", text).split())


def exact_key(text: str) -> bytes:
    return _exact_key_of(normalise(text))


def _exact_key_of(normalised: str) -> bytes:
    return hashlib.blake2b(normalised.encode("utf-8"), digest_size=16).digest()


@functools.lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
    # Python's hash() is salted per process; workers must agree, so a keyed-free stable hash is used.
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def shingle_hashes(text: str, n: int) -> np.ndarray:
    """Sorted unique 64-bit hashes of the word n-grams of the normalised text (one n-gram if it is shorter).

    Written with numpy rather than hashing each n-gram string (datasketch hashes every shingle with sha1 in
    Python, the pipeline's slowest step): each word is hashed once, n-grams are combined vectorised.
    """
    return ngram_hashes(normalise(text), n)


def ngram_hashes(normalised: str, n: int) -> np.ndarray:
    """:func:`shingle_hashes` of text already passed through :func:`normalise` (decontamination hashes eval
    items and documents with it too, so their n-grams meet in the same hash space)."""
    words = normalised.split()
    if not words:
        return np.zeros(1, dtype=np.uint64)
    wh = np.fromiter((_word_hash(w) for w in words), dtype=np.uint64, count=len(words))
    count = max(1, len(words) - n + 1)
    rolled = np.zeros(count, dtype=np.uint64)
    for j in range(min(n, len(words))):
        rolled = rolled * _ROLL + wh[j : j + count]
    return np.unique(_mix(rolled))


def first_of_runs(ordered: np.ndarray) -> np.ndarray:
    """True where a sorted array's value differs from the one before it: each distinct value's first place."""
    return np.concatenate([[True], ordered[1:] != ordered[:-1]]) if len(ordered) else np.ones(0, bool)


def sketch_of(hashes: np.ndarray) -> np.ndarray:
    """A document's verification sketch: the high 32 bits of its sorted unique 64-bit shingle hashes, each once.

    Half the bytes of the 64-bit hashes on the index shards' disks and on the wire to them (at 10⁷ synthetic
    documents one shard of 2 wrote 18.6 GB instead of 34.5: pipeline/README.md). The price: two pages of 3,000
    distinct shingles share a 32-bit value that no shingle of both has with probability 3000²/2³² ≈ 0.2%, which
    moves their Jaccard by 1/3000; decisions can only change for pairs that close to the threshold."""
    high = (hashes >> np.uint64(32)).astype(np.uint32)  # still sorted: the hashes are
    return high[first_of_runs(high)]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard of two sorted unique hash arrays."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


class DedupKeys:
    """Keys of one document: exact key, MinHash signature, LSH band keys, verification sketch."""

    def __init__(self, config: DedupConfig) -> None:
        self.config = config
        mh = config.minhash
        self.bands, self.rows = mh.bands, mh.rows
        rng = np.random.default_rng(mh.seed)
        # Multiply-shift hashing of the (already mixed) shingle hashes: one odd multiplier per permutation.
        self._a = rng.integers(0, 2**64, size=mh.num_perm, dtype=np.uint64) | np.uint64(1)
        self._b = rng.integers(0, 2**64, size=mh.num_perm, dtype=np.uint64)

    def signature_of(self, hashes: np.ndarray) -> np.ndarray:
        sig = np.full(len(self._a), np.iinfo(np.uint32).max, dtype=np.uint32)
        for start in range(0, len(hashes), _MAX_ROWS_PER_CHUNK):
            chunk = hashes[start : start + _MAX_ROWS_PER_CHUNK, None]
            values = ((chunk * self._a + self._b) >> np.uint64(32)).astype(np.uint32)
            np.minimum(sig, values.min(axis=0), out=sig)
        return sig

    def signature(self, text: str) -> np.ndarray:
        return self.signature_of(shingle_hashes(text, self.config.minhash.ngram))

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """(docs, bands) uint64 bucket keys from (docs, num_perm) signatures; the band index is mixed in."""
        sig = signatures[:, : self.bands * self.rows].reshape(len(signatures), self.bands, self.rows)
        key = np.broadcast_to(np.arange(self.bands, dtype=np.uint64), sig.shape[:2]).copy()
        for r in range(self.rows):
            key = _mix(key * _ROLL + sig[:, :, r].astype(np.uint64))
        return key

    def keys(self, text: str) -> tuple[bytes, np.ndarray, np.ndarray | None]:
        """(exact key, signature, its sketch (:func:`sketch_of`) when ``verify: jaccard`` else None) of one
        document."""
        normalised = normalise(text)
        hashes = ngram_hashes(normalised, self.config.minhash.ngram)
        sketch = sketch_of(hashes) if self.config.minhash.verify == "jaccard" else None
        return _exact_key_of(normalised), self.signature_of(hashes), sketch


class MarkDuplicates(Step):
    name = "dedup"

    def __init__(self, decisions: dict[str, tuple[str, str]]) -> None:
        self.decisions = decisions

    def apply(self, docs: list[Doc]) -> None:
        for doc in docs:
            decision = self.decisions.get(doc_key(doc))
            if decision is not None:
                stage, kept = decision
                reason = "exact_duplicate" if stage == EXACT else "near_duplicate"
                drop(doc, stage, reason, duplicate_of=record_id_of(kept))


def keyed_batch(
    config: DedupConfig,
    doc_keys: list[str],
    exact_keys: list[bytes],
    signatures: np.ndarray,
    shingle_sets: Sequence[np.ndarray | None],
) -> dict:
    """What the index shards need of a batch of documents, given what the config enables: exact keys, LSH band
    keys, and the sketch each candidate is verified with (shingle hashes, or the signature itself)."""
    mh = config.minhash
    sketches = None
    if mh.enabled and mh.verify == "jaccard":
        sketches = shingle_sets
    elif mh.enabled and mh.verify == "signature":
        sketches = list(signatures)
    return {
        "doc_keys": doc_keys,
        "exact_keys": exact_keys if config.exact.enabled else None,
        "band_keys": DedupKeys(config).band_keys(signatures) if mh.enabled else None,
        "sketches": sketches,
    }
