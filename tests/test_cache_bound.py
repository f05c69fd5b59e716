"""A node's cache stays within ``RAYLM_CACHE_MAX_GB`` (ground/cache.py): after a download, the least recently used
entries go, a cache hit counting as a use, and never one that a live process holds; a bound that cannot be met is
a warning, not a failed fetch; a value that is not a positive number is refused by name; no bound, nothing goes.

The files are real objects on moto's S3 server, fetched into a real cache directory; the other process holding an
entry is a real Python process that fetched it through the public API and waits on its stdin.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from remote_servers import s3_bucket

from ground.cache import CACHE_ENV, MAX_GB_ENV, CacheBoundError, fetch_published, fetch_verified, release
from ground.storage import Location

BUCKET = "raylm-cache-bound"
MB = 10**6  # RAYLM_CACHE_MAX_GB counts 10^9 bytes a gigabyte
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with s3_bucket(BUCKET) as client:
        yield client


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(MAX_GB_ENV, raising=False)
    return tmp_path / "cache"


class Objects:
    """Files of 1 MB in a fresh prefix of the bucket, each with its own content, by name."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.prefix = f"test-{uuid.uuid4().hex[:8]}"
        self.sha256: dict[str, str] = {}

    def put(self, name: str, data: bytes | None = None) -> Location:
        data = data if data is not None else os.urandom(MB)
        self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{name}", Body=data)
        self.sha256[name] = hashlib.sha256(data).hexdigest()
        return self.location(name)

    def location(self, name: str) -> Location:
        return Location(f"s3://{BUCKET}/{self.prefix}/{name}")

    def fetch(self, name: str, keep: bool = False) -> Path:
        """Fetch ``name`` into the cache; unless ``keep``, stop holding it at once (a user done with it)."""
        path = fetch_verified(self.location(name), self.sha256[name])
        assert path.read_bytes()[:16]  # there, whole, readable
        if not keep:
            release(path)
        return path

    def cached(self, cache: Path) -> set[str]:
        """The names whose entries are in the cache."""
        return {name for name, sha in self.sha256.items() if (cache / "sha256" / sha / name).is_file()}


@pytest.fixture
def objects(s3: Any) -> Objects:
    return Objects(s3)


def test_the_least_recently_used_entry_goes_and_a_hit_counts_as_a_use(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_GB_ENV, "0.003")  # room for three of the files
    for name in "abcd":
        objects.put(name)
    for name in "abc":
        objects.fetch(name)
    assert objects.cached(cache) == {"a", "b", "c"}
    objects.fetch("a")  # a hit: a is now used more recently than b and c
    objects.fetch("d")
    assert objects.cached(cache) == {"a", "c", "d"}
    assert not (cache / "sha256" / objects.sha256["b"]).exists()  # nothing of b left: no lock or hold file
    objects.fetch("b")  # downloaded again, and c, now the least recent, goes
    assert objects.cached(cache) == {"a", "b", "d"}


def test_an_entry_another_live_process_holds_is_never_evicted_until_it_exits(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_GB_ENV, "0.003")
    for name in "abcde":
        objects.put(name)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from ground.cache import fetch_verified\n"
            "from ground.storage import Location\n"
            f"path = fetch_verified(Location({objects.location('a').uri!r}), {objects.sha256['a']!r})\n"
            "print(path, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        held = Path(holder.stdout.readline().strip())
        assert held.is_file()
        objects.fetch("b")
        objects.fetch("c")
        objects.fetch("d")  # a is the least recent, but held: b goes instead
        assert objects.cached(cache) == {"a", "c", "d"}
        objects.fetch("b")  # and again: c goes, a stays
        assert objects.cached(cache) == {"a", "b", "d"}
        assert held.is_file()
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
        holder.wait()
    objects.fetch("e")  # a, no longer held, is the least recent
    assert objects.cached(cache) == {"b", "d", "e"}


def test_an_entry_fetched_twice_is_held_until_both_fetches_are_released(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_GB_ENV, "0.001")  # room for one file
    for name in "abc":
        objects.put(name)
    objects.fetch("a", keep=True)
    path = objects.fetch("a", keep=True)
    release(path)  # one fetch answered, one still holding it
    objects.fetch("b")
    assert objects.cached(cache) == {"a", "b"}  # a, the least recent, is held: over the bound, not evicted
    release(path)
    objects.fetch("c")
    assert objects.cached(cache) == {"c"}


def test_a_bound_that_only_held_entries_break_is_warned_about_once_and_every_fetch_succeeds(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(MAX_GB_ENV, "0.0015")  # room for one file and a half
    for name in "abc":
        objects.put(name)
    caplog.set_level(logging.WARNING, logger="ground.cache")
    paths = [objects.fetch(name, keep=True) for name in "abc"]  # this process holds all three
    try:
        assert objects.cached(cache) == {"a", "b", "c"}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert f"{MAX_GB_ENV}=0.0015" in warnings[0]
        assert f"bound of {1500 * 1000} bytes" in warnings[0]
        assert f"holds {2 * MB} bytes" in warnings[0] and f"{2 * MB} bytes of it are held" in warnings[0]
    finally:
        for path in paths:
            release(path)
    objects.put("d")
    objects.fetch("d")  # nothing held now: the bound is met again
    assert objects.cached(cache) == {"d"}


@pytest.mark.slow  # processes that each import pyarrow
def test_processes_fetching_and_evicting_at_once_each_read_every_file_whole(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes, each downloading, hitting and evicting in the same cache at once, and each holding the
    last files it fetched: every file a process holds stays whole for as long as it holds it, and no fetch fails."""
    monkeypatch.setenv(MAX_GB_ENV, "0.003")
    names = "abcdefgh"
    for name in names:
        objects.put(name)
    wanted = {name: (objects.location(name).uri, objects.sha256[name]) for name in names}
    script = (
        "import hashlib, json, random, sys\n"
        "from ground.cache import fetch_verified, release\n"
        "from ground.storage import Location\n"
        "wanted = json.loads(sys.argv[1])\n"
        "rng = random.Random(int(sys.argv[2]))\n"
        "held = []\n"
        "for name in rng.choices(sorted(wanted), k=10):\n"
        "    uri, sha = wanted[name]\n"
        "    held.append((fetch_verified(Location(uri), sha), sha))\n"
        "    for path, sha in held:  # what this process holds is whole, whatever the others evicted meanwhile\n"
        "        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, path\n"
        "    if len(held) > 2:\n"
        "        release(held.pop(0)[0])\n"
    )
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(wanted), str(seed)], cwd=REPO, stderr=subprocess.PIPE
        )
        for seed in range(4)
    ]
    failures = []
    for worker in workers:
        _, err = worker.communicate(timeout=120)
        if worker.returncode:
            failures.append(err.decode())
    assert not failures, failures
    objects.put("z")
    objects.fetch("z")  # nothing is held now: the next download leaves the cache within its bound
    entries = [p for p in (cache / "sha256").rglob("*") if p.is_file() and not p.name.endswith((".lock", ".hold"))]
    assert sum(p.stat().st_size for p in entries) <= 3 * MB


@pytest.mark.parametrize("value", ["lots", "0", "-1", "nan", "inf"])
def test_a_bound_that_is_not_a_positive_number_is_refused_naming_it(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    objects.put("a")
    monkeypatch.setenv(MAX_GB_ENV, value)
    with pytest.raises(CacheBoundError, match=rf"{MAX_GB_ENV}='{value}'"):
        objects.fetch("a")
    assert objects.cached(cache) == set()  # refused before downloading


def test_no_bound_evicts_nothing_and_a_bound_set_later_applies_at_the_next_download(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in "abcde":
        objects.put(name)
    for name in "abcd":
        objects.fetch(name)
    assert objects.cached(cache) == {"a", "b", "c", "d"}
    monkeypatch.setenv(MAX_GB_ENV, "0.002")
    objects.fetch("e")
    assert objects.cached(cache) == {"d", "e"}


def test_a_published_copy_whose_files_were_evicted_is_fetched_again_whole(
    cache: Path, objects: Objects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fetch_published links to entries; once they are evicted, the copy's next fetch downloads them again."""
    monkeypatch.setenv(MAX_GB_ENV, "0.002")
    data = {name: os.urandom(MB) for name in ("weights.bin", "tokens.bin")}
    for name, content in data.items():
        objects.put(name, content)
    files = {name: {"sha256": objects.sha256[name]} for name in data}
    objects.client.put_object(Bucket=BUCKET, Key=f"{objects.prefix}/final.json", Body=json.dumps({"files": files}))
    directory = Location(f"s3://{BUCKET}/{objects.prefix}")
    root = fetch_published(directory, "final.json")
    for name in data:
        release(root / name)
    for name in ("x", "y"):
        objects.put(name)
        objects.fetch(name)
    assert not any((root / name).exists() for name in data)  # both evicted: the links lead nowhere
    again = fetch_published(directory, "final.json")
    assert again == root
    assert {name: (root / name).read_bytes() for name in data} == data
