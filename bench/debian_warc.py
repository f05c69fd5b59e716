"""Build a WARC set of real, distinct, multilingual HTML pages from Debian's documentation packages.

    .venv/bin/python bench/debian_warc.py --out bench/.cache/debian-warc-200mb --mb 200
    .venv/bin/python bench/debian_warc.py --out /tmp/w --mb 8 --files 4
    .venv/bin/python bench/debian_warc.py --out /tmp/w --mb 1 --html-dir some/site   # local HTML, no apt
    .venv/bin/python bench/debian_warc.py --wet --out bench/.cache/debian-wet-200mb --mb 200

The packages are fetched with ``apt-get download`` (no install, no root needed for the download itself) into
``--deb-cache`` (default ``bench/.cache/debs``), unpacked with ``dpkg-deb -x`` into a temp dir, and every
HTML file (``*.html``, ``*.htm``, ``*.xhtml``, Apache's ``*.html.en``-style variants, and gzipped ``*.html.gz``)
becomes one WARC ``response`` record, gzip-compressed per record with warcio: HTTP/1.1 200 with
``Content-Type: text/html``, and Common Crawl's ``WARC-Identified-Payload-Type`` (``text/html``, or
``application/xhtml+xml`` for XML-declared pages; datatrove's WarcReader skips records without a known type).
Packages are taken in the listed order (a mix of languages first, so small sets are multilingual too), files in
sorted path order, until the output reaches ``--mb`` megabytes (10^6 bytes, compressed, on disk). Each record
goes to whichever of the ``--files`` output files is smallest so far, so the files end up within one record of
equal size and each holds a similar mix of packages.

With ``--wet`` the output is WET instead, as Common Crawl derives it from its WARCs: each page's text, taken with
the pipeline's own extractor (``pipeline.steps.extract.html_to_text``, resiliparse main content, the default for
WARC input), becomes one ``conversion`` record (``Content-Type: text/plain``, ``WARC-Refers-To`` the response
record it stands for), gzip-compressed per record, in ``*.warc.wet.gz`` files; pages with no text are left out
and counted in the sidecar (``empty_text``). ``--mb`` then counts megabytes of .warc.wet.gz. Like Common Crawl's
WET, the records carry no ``WARC-Identified-Payload-Type``.

Deterministic: the same .deb files and arguments give the same bytes. Record ids are uuid5 of the pseudo URL
``https://<package>.debian-doc.invalid/<path in package>``, WARC-Date is a fixed date, gzip headers carry no
timestamp. A sidecar ``debian-warc.json`` records the arguments, the package versions and sha256 of the .debs
used, and every output file's size, records and sha256; a rerun with the same arguments whose files are all
present reuses them (``--force`` rebuilds). The output is built in a hidden sibling directory and renamed into
place when complete. Only packages missing from the cache are downloaded; ``apt-get update`` is run once if
apt knows none of the requested packages.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from ground.hashing import sha256_file
from pipeline.steps.extract import html_to_text

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = ROOT / "bench" / ".cache" / "debs"
SIDECAR = "debian-warc.json"
FORMAT_VERSION = 2

# Order matters: a small --mb takes only the first packages, so the multilingual ones come first.
DEFAULT_PACKAGES = (
    # The first 63: ~1.9 GB of HTML (bookworm), ~10 MB to ~480 MB per package; 200 MB of .warc.gz needs most of it.
    "debian-reference-en",
    "debian-reference-fr",
    "debian-reference-de",
    "debian-reference-es",
    "debian-reference-it",
    "debian-reference-ja",
    "debian-reference-zh-cn",
    "debian-reference-pt",
    "debian-reference-id",
    "debian-reference-zh-tw",
    "debian-reference-pt-br",
    "debian-faq",
    "debian-faq-de",
    "debian-faq-fr",
    "debian-faq-it",
    "debian-faq-ja",
    "debian-faq-ru",
    "debian-faq-nl",
    "debian-faq-pt",
    "debian-faq-zh-cn",
    "maint-guide",
    "maint-guide-de",
    "maint-guide-es",
    "maint-guide-fr",
    "maint-guide-it",
    "maint-guide-ja",
    "maint-guide-ru",
    "maint-guide-zh-cn",
    "maint-guide-ca",
    "maint-guide-vi",
    "developers-reference",
    "developers-reference-de",
    "developers-reference-fr",
    "developers-reference-it",
    "developers-reference-ja",
    "developers-reference-ru",
    "debian-policy",
    "python3.11-doc",
    "debian-handbook",
    "libreoffice-help-en-us",
    "libreoffice-help-fr",
    "libreoffice-help-de",
    "libreoffice-help-es",
    "libreoffice-help-it",
    "libreoffice-help-ja",
    "libreoffice-help-pt-br",
    "libreoffice-help-ru",
    "libreoffice-help-zh-cn",
    "libreoffice-help-nl",
    "libreoffice-help-pl",
    "apache2-doc",
    "debmake-doc",
    "harden-doc",
    "git-doc",
    "postgresql-doc-15",
    "python-django-doc",
    "sphinx-doc",
    "python-scipy-doc",
    "python-pandas-doc",
    "openjdk-17-doc",
    "rust-doc",
    "libstdc++-12-doc",
    "libboost1.81-doc",
    # Enough for 200 MB of --wet output: the packages above give 119.5 MB of .warc.wet.gz, 190.6 MB with these
    # up to libreoffice-help-tr, and 200 MB stops in llvm-15-doc (the rest is headroom). Appended, so the sets
    # that stop earlier keep their bytes.
    "linux-doc-6.1",
    "erlang-doc",
    "ghc-doc",
    "python-sympy-doc",
    "qtbase5-doc-html",
    "python-astropy-doc",
    "python-sklearn-doc",
    "ruby3.1-doc",
    "nodejs-doc",
    "octave-doc",
    "libreoffice-help-ca",
    "libreoffice-help-cs",
    "libreoffice-help-da",
    "libreoffice-help-el",
    "libreoffice-help-fi",
    "libreoffice-help-hu",
    "libreoffice-help-ko",
    "libreoffice-help-sl",
    "libreoffice-help-sv",
    "libreoffice-help-tr",
    "wx3.2-doc",
    "llvm-15-doc",
    "cmake-doc",
    "libgtk-3-doc",
    "libglib2.0-doc",
    "clang-15-doc",
    "gimp-help-en",
    "gimp-help-de",
    "gimp-help-fr",
    "gimp-help-es",
    "gimp-help-it",
    "gimp-help-ru",
)
WARC_DATE = "2024-06-01T00:00:00Z"
ID_NAMESPACE = uuid.UUID("2b0f4c0e-7d3a-5a43-9c61-6f1d2f0f7a55")
_HTML_NAME = re.compile(r"\.(html?|xhtml)(\.[a-z]{2}([-_][a-z]{2,4})?)?(\.gz)?$", re.IGNORECASE)


def log(msg: str) -> None:
    print(f"[debian_warc] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Sources: Debian packages (apt-get download + dpkg-deb -x) or local HTML directories
# ---------------------------------------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _require(tool: str) -> None:
    if shutil.which(tool) is None:
        raise SystemExit(f"debian_warc: `{tool}` not found; this needs a Debian/Ubuntu machine (or use --html-dir)")


def apt_known(package: str) -> bool:
    res = _run(["apt-cache", "show", "--no-all-versions", package])
    return res.returncode == 0 and "Package:" in res.stdout


class DebSource:
    """One Debian package: a cached .deb, downloaded on first use."""

    def __init__(self, package: str, cache: Path) -> None:
        self.package = package
        self.cache = cache
        self.deb: Path | None = None

    def cached(self) -> Path | None:
        found = sorted(self.cache.glob(f"{glob_escape(self.package)}_*.deb"))
        return found[-1] if found else None

    def fetch(self) -> Path | None:
        """The .deb (downloaded if not cached), or None when apt does not know the package."""
        self.deb = self.cached()
        if self.deb is not None:
            return self.deb
        _require("apt-get")
        if not apt_known(self.package):
            return None
        make_cache_dir(self.cache)
        log(f"apt-get download {self.package}")
        res = _run(["apt-get", "download", self.package], cwd=self.cache)
        self.deb = self.cached()
        if res.returncode != 0 or self.deb is None:
            raise SystemExit(f"debian_warc: `apt-get download {self.package}` failed:\n{res.stderr.strip()}")
        return self.deb

    def version(self) -> str:
        assert self.deb is not None
        res = _run(["dpkg-deb", "--field", str(self.deb), "Version"])
        return res.stdout.strip() or self.deb.name.split("_")[1]

    def extract(self, into: Path) -> Path:
        _require("dpkg-deb")
        assert self.deb is not None
        target = into / self.package
        target.mkdir(parents=True, exist_ok=True)
        res = _run(["dpkg-deb", "-x", str(self.deb), str(target)])
        if res.returncode != 0:
            raise SystemExit(f"debian_warc: `dpkg-deb -x {self.deb}` failed:\n{res.stderr.strip()}")
        return target


def make_cache_dir(path: Path) -> None:
    """Create ``path``; directly under ``bench/.cache`` it gets a ``.gitignore`` of ``*``, so the cache never
    shows up in git (no change to the repository's .gitignore needed)."""
    path.mkdir(parents=True, exist_ok=True)
    cache_root = ROOT / "bench" / ".cache"
    if path.resolve().is_relative_to(cache_root.resolve()):
        ignore = cache_root / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# bench/debian_warc.py and bench/pipeline_bench.py caches (downloads, WARC sets)\n*\n")


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", name)


def html_files(tree: Path) -> list[Path]:
    """Regular files (not symlinks) that are HTML, in sorted relative-path order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if _HTML_NAME.search(name) and not path.is_symlink() and path.is_file():
                out.append(path)
    return sorted(out, key=lambda p: p.relative_to(tree).as_posix())


def read_html(path: Path) -> bytes:
    data = path.read_bytes()
    if path.name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return b""
    return data


def pseudo_url(package: str, rel: str) -> str:
    rel = rel.removeprefix("usr/share/doc/").removesuffix(".gz")
    host = re.sub(r"[^a-z0-9-]", "-", package.lower())
    return f"https://{host}.debian-doc.invalid/{quote(rel)}"


# ---------------------------------------------------------------------------------------------------------
# WARC writing
# ---------------------------------------------------------------------------------------------------------


def _gzip_member(url: str, rec_type: str, body: bytes, warc_headers: dict[str, str], **record_args) -> bytes:
    """One gzip member holding one WARC record of ``rec_type``, its headers in the given order (deterministic:
    warcio's gzip carries no mtime)."""
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    writer = WARCWriter(buf, gzip=True)
    record = writer.create_warc_record(
        url,
        rec_type,
        payload=io.BytesIO(body),
        length=len(body),
        warc_headers_dict=warc_headers,
        **record_args,
    )
    writer.write_record(record)
    return buf.getvalue()


def record_bytes(url: str, html: bytes) -> bytes:
    """One gzip member holding one WARC response record."""
    from warcio.statusandheaders import StatusAndHeaders

    try:
        html.decode("utf-8")
        content_type = "text/html; charset=utf-8"
    except UnicodeDecodeError:
        content_type = "text/html"
    http_headers = StatusAndHeaders(
        "200 OK", [("Content-Type", content_type), ("Content-Length", str(len(html)))], protocol="HTTP/1.1"
    )
    # Common Crawl's WARCs carry the sniffed payload type; readers such as datatrove's WarcReader select on it.
    payload_type = "application/xhtml+xml" if html.lstrip()[:5] == b"<?xml" else "text/html"
    headers = {
        "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, url)}>",
        "WARC-Date": WARC_DATE,
        "WARC-Identified-Payload-Type": payload_type,
    }
    return _gzip_member(url, "response", html, headers, http_headers=http_headers)


def conversion_bytes(url: str, text: str) -> bytes:
    """One gzip member holding one WET conversion record: the page's text."""
    headers = {
        "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, 'wet:' + url)}>",
        "WARC-Refers-To": f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, url)}>",
        "WARC-Date": WARC_DATE,
    }
    return _gzip_member(url, "conversion", text.encode("utf-8"), headers, warc_content_type="text/plain")


def warcinfo_bytes(filename: str, info: dict[str, str]) -> bytes:
    body = "".join(f"{k}: {v}\r\n" for k, v in info.items()).encode("utf-8")
    headers = {
        "WARC-Record-ID": f"<urn:uuid:{uuid.uuid5(ID_NAMESPACE, 'warcinfo:' + filename)}>",
        "WARC-Date": WARC_DATE,
        "WARC-Filename": filename,
    }
    return _gzip_member("", "warcinfo", body, headers, warc_content_type="application/warc-fields")


def _documents(sources: list[tuple[str, object]], scratch: Path, used: list[dict]) -> Iterator[tuple[str, bytes]]:
    """(url, html) in deterministic order; fills ``used`` with the sources actually opened."""
    for name, src in sources:
        if isinstance(src, DebSource):
            deb = src.fetch()
            if deb is None:
                log(f"skipping {name}: apt does not know it")
                continue
            tree = src.extract(scratch)
            entry = {"package": name, "version": src.version(), "deb": deb.name, "sha256": sha256_file(deb)}
        else:
            tree = Path(src)
            entry = {"html_dir": name, "path": str(tree)}
        files = html_files(tree)
        entry["html_files"] = len(files)
        entry["records"] = 0
        used.append(entry)
        log(f"{name}: {len(files)} HTML files")
        for path in files:
            html = read_html(path)
            if not html.strip():
                continue
            entry["records"] += 1
            yield pseudo_url(name, path.relative_to(tree).as_posix()), html
        if isinstance(src, DebSource):
            shutil.rmtree(tree, ignore_errors=True)


def build(
    out: Path,
    mb: float,
    n_files: int,
    packages: list[str],
    html_dirs: list[Path],
    deb_cache: Path,
    force: bool = False,
    wet: bool = False,
) -> dict:
    """Write (or reuse) the WARC set, or with ``wet`` the WET set; returns the sidecar dict."""
    params = {
        "format": FORMAT_VERSION,
        "mb": mb,
        "files": n_files,
        "sources": [f"html-dir:{d.resolve()}" for d in html_dirs] if html_dirs else list(packages),
    }
    if wet:  # only when set, so that WARC sets built before --wet existed are still reused
        params["wet"] = True
    existing = out / SIDECAR
    if existing.is_file() and not force:
        meta = json.loads(existing.read_text())
        if meta.get("params") == params and all(
            (out / f["name"]).is_file() and (out / f["name"]).stat().st_size == f["bytes"] for f in meta["files"]
        ):
            log(f"reusing {out} ({meta['total_bytes'] / 1e6:.1f} MB, {meta['records']} records)")
            return meta
    if out.exists() and any(out.iterdir()) and not existing.is_file() and not force:
        raise SystemExit(f"debian_warc: {out} is not empty and was not written by this script (use --force)")

    if html_dirs:
        sources: list[tuple[str, object]] = [(d.resolve().name, d) for d in html_dirs]
    else:
        if (
            not any(DebSource(p, deb_cache).cached() for p in packages)
            and shutil.which("apt-cache")
            and not any(apt_known(p) for p in packages[:3])
        ):
            log("apt knows none of the packages: apt-get update")
            _run(["apt-get", "update"])
        sources = [(p, DebSource(p, deb_cache)) for p in packages]

    target = int(mb * 1e6)
    suffix = ".warc.wet.gz" if wet else ".warc.gz"
    names = [f"debian-docs-{i:05d}{suffix}" for i in range(n_files)]
    make_cache_dir(out.parent)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    used: list[dict] = []
    info = {
        "software": "raylm bench/debian_warc.py",
        "format": "WARC File Format 1.0",
        "description": (
            "text of Debian documentation pages as WET conversion records (benchmark input)"
            if wet
            else "HTML of Debian documentation packages as WARC response records (benchmark input)"
        ),
        "isPartOf": f"debian-docs-{'wet-' if wet else ''}{mb:g}mb",
    }
    try:
        handles = [open(staging / n, "wb") for n in names]  # noqa: SIM115 (closed below; N files at once)
        sizes = [0] * n_files
        records = [0] * n_files
        digests = [hashlib.sha256() for _ in names]
        for i, name in enumerate(names):
            data = warcinfo_bytes(name, info)
            handles[i].write(data)
            digests[i].update(data)
            sizes[i] += len(data)
        total = sum(sizes)
        empty_text = 0
        with tempfile.TemporaryDirectory(prefix="debian-warc-") as scratch:
            for url, html in _documents(sources, Path(scratch), used):
                if wet:
                    text = html_to_text(html, main_content=True)
                    if not text.strip():
                        empty_text += 1
                        continue
                    data = conversion_bytes(url, text)
                else:
                    data = record_bytes(url, html)
                i = min(range(n_files), key=lambda k: (sizes[k], k))
                handles[i].write(data)
                digests[i].update(data)
                sizes[i] += len(data)
                records[i] += 1
                total += len(data)
                if total >= target:
                    break
        for h in handles:
            h.close()
        if not sum(records):
            raise SystemExit(
                "debian_warc: no HTML written: none of the packages could be fetched (is apt set up? "
                "`apt-get update` needs root) and no --html-dir was given"
            )
        if total < target:
            log(
                f"WARNING: sources exhausted at {total / 1e6:.1f} MB < {mb:g} MB requested; "
                "add packages with --packages"
            )
        meta = {
            "params": params,
            "total_bytes": total,
            "records": sum(records),
            **({"empty_text": empty_text} if wet else {}),
            "warc_date": WARC_DATE,
            "sources": used,
            "files": [
                {"name": n, "bytes": s, "records": r, "sha256": d.hexdigest()}
                for n, s, r, d in zip(names, sizes, records, digests, strict=True)
            ],
        }
        (staging / SIDECAR).write_text(json.dumps(meta, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log(f"wrote {out}: {n_files} files, {total / 1e6:.1f} MB, {meta['records']} records")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (created; reused if complete)")
    parser.add_argument(
        "--mb",
        type=float,
        default=200.0,
        help="total size to write, in MB of .warc.gz (of .warc.wet.gz with --wet; default 200)",
    )
    parser.add_argument(
        "--wet",
        action="store_true",
        help="write WET (each page's extracted text as a conversion record) instead of WARC responses",
    )
    parser.add_argument(
        "--files",
        type=int,
        default=None,
        help="number of output files of about equal size (default: one per ~6 MB, at least 2)",
    )
    parser.add_argument(
        "--deb-cache",
        type=Path,
        default=DEFAULT_CACHE,
        help=f"where downloaded .deb files are kept (default {DEFAULT_CACHE.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--packages",
        default=",".join(DEFAULT_PACKAGES),
        metavar="P1,P2,...",
        help=f"comma-separated Debian packages, taken in order (default: the {len(DEFAULT_PACKAGES)} "
        "in DEFAULT_PACKAGES, multilingual Debian guides first, then python3.11-doc, "
        "debian-handbook, libreoffice-help-*, API docs)",
    )
    parser.add_argument(
        "--html-dir",
        type=Path,
        action="append",
        default=[],
        help="use the HTML files under this local directory instead of Debian packages (repeatable; no apt needed)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if --out holds a matching set")
    args = parser.parse_args(argv)
    if args.mb <= 0:
        parser.error("--mb must be positive")
    n_files = args.files or max(2, round(args.mb / 6))
    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    meta = build(args.out, args.mb, n_files, packages, args.html_dir, args.deb_cache, args.force, args.wet)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "files": len(meta["files"]),
                "bytes": meta["total_bytes"],
                "records": meta["records"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
