"""The pipeline bench's inputs: distinct copies of WARC files (record ids renumbered), the Debian-docs set."""

from __future__ import annotations

import gzip
import os
import re
import shutil
import uuid
import zlib
from pathlib import Path

from pipeline_bench_common import CACHE, WARC_SUFFIXES

# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------

# A WARC header line whose value is a record id (WARC-Record-ID, WARC-Refers-To, WARC-Warcinfo-ID, ...).
_ID_HEADER = re.compile(rb"^(WARC-[A-Za-z-]+: <urn:uuid:)([0-9A-Fa-f-]{36})(>\r?)$", re.MULTILINE)
_COPY_NAMESPACE = uuid.UUID("6f1c6c38-5d0e-4d53-9a52-3a1f0c2b7e11")


def _split_gzip_members(raw: bytes) -> list[bytes]:
    members = []
    while raw:
        inflater = zlib.decompressobj(wbits=31)
        members.append(inflater.decompress(raw) + inflater.flush())
        raw = inflater.unused_data
    return members


def _renumber(data: bytes, copy: int) -> bytes:
    """Give every record id a new uuid, stable per (copy, old id); ids are outside WARC-Block-Digest."""

    def repl(m: re.Match) -> bytes:
        new = uuid.uuid5(_COPY_NAMESPACE, f"{copy}:{m.group(2).decode().lower()}")
        return m.group(1) + str(new).upper().encode() + m.group(3)

    return _ID_HEADER.sub(repl, data)


def warc_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name.endswith(WARC_SUFFIXES))


def renumbered_copies(originals: list[Path], repeat: int, dest: Path) -> list[Path]:
    """``originals`` copied ``repeat`` times: copy 0 as is, copy k with fresh record ids (exact content duplicates)."""
    dest.mkdir(parents=True, exist_ok=True)
    if not originals:
        raise SystemExit("no WARC/WET files to copy")
    out = []
    for k in range(repeat):
        for src in originals:
            target = dest / f"r{k:03d}-{src.name}"
            raw = src.read_bytes()
            if k == 0:
                target.write_bytes(raw)
            elif raw[:2] == b"\x1f\x8b":
                target.write_bytes(
                    b"".join(gzip.compress(_renumber(m, k), compresslevel=6, mtime=0) for m in _split_gzip_members(raw))
                )
            else:
                target.write_bytes(_renumber(raw, k))
            out.append(target)
    return out


def link_files(files: list[Path], dest: Path, prefix: str = "") -> list[Path]:
    """Hard links (copies across file systems) of ``files`` in ``dest``, so one directory is the whole input."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for f in files:
        target = dest / f"{prefix}{f.name}"
        try:
            os.link(f, target)
        except OSError:
            shutil.copyfile(f, target)
        out.append(target)
    return out


def debian_set(mb_total: float, n_files: int | None, deb_cache: Path, wet: bool = False) -> tuple[Path, dict]:
    """The Debian-docs WARC set of this size, or with ``wet`` its WET (each page's text as a conversion record);
    built once by bench/debian_warc.py, then reused from the cache."""
    import debian_warc

    n = n_files or max(2, round(mb_total / 6))
    out = CACHE / f"debian-{'wet' if wet else 'warc'}-{mb_total:g}mb-{n}f"
    meta = debian_warc.build(out, mb_total, n, list(debian_warc.DEFAULT_PACKAGES), [], deb_cache, wet=wet)
    return out, meta


def describe_debian(meta: dict) -> str:
    packages = [s["package"] for s in meta["sources"] if "package" in s]
    head = ", ".join(packages[:6]) + (f", ... ({len(packages)} packages)" if len(packages) > 6 else "")
    if meta["params"].get("wet"):
        return f"Debian documentation pages' text as WET conversion records ({head}; bench/debian_warc.py --wet)"
    return f"Debian documentation HTML as WARC responses ({head}; bench/debian_warc.py)"
