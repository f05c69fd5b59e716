"""URL filter stage: a small blocklist of domains that really are in data/sample, on the sample's own URLs."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import REPO, SAMPLE
from pydantic import ValidationError

from pipeline.config import PipelineConfig, load_config
from pipeline.errors import PipelineInputError
from pipeline.steps.base import drop_reasons
from pipeline.steps.extract import read_wet
from pipeline.steps.url_filter import UrlFilter, UrlFilterConfig, load_blocklist

BLOCKLIST = """\
# Test blocklist: domains and a path prefix taken from the sample's URLs.
allenai.org            # the domain and its subdomains (prior.allenai.org)
commoncrawl.org/blog/  # only the blog
https://Creativecommons.ORG:443/mission/
antoniak.github.io     # a suffix of maria-antoniak.github.io, but not a parent domain of it
clo.com                # a suffix of kyleclo.com, likewise

*.fc2.com
"""


@pytest.fixture(scope="module")
def sample_rows() -> list[dict]:
    rows = [d for f in sorted(SAMPLE.iterdir()) for d in read_wet(f)]
    return [d for d in rows if d.get("reason") is None]


def _host(url: str) -> str:
    return urlsplit(url).hostname or ""


def _filtered(rows: list[dict], config: UrlFilterConfig, blocklist=None) -> list[dict]:
    docs = [{"url": r["url"], "text": r["text"]} for r in rows]
    return UrlFilter(config, blocklist)(docs)


def test_blocklist_on_the_samples_real_urls(tmp_path: Path, sample_rows):
    path = tmp_path / "blocklist.txt"
    path.write_text(BLOCKLIST)
    blocklist = load_blocklist(str(path))
    assert blocklist.entries == 6  # 4 domains, 2 path prefixes
    docs = _filtered(sample_rows, UrlFilterConfig(blocklist=str(path)), blocklist)
    blocked = {d["url"] for d in docs if d.get("reason") == "url:blocklist"}
    assert all(d["stage"] == "url_filter" for d in docs if d.get("reason"))

    def expected(url: str) -> bool:
        host, path_ = _host(url), urlsplit(url).path
        return (
            host == "allenai.org"
            or host.endswith(".allenai.org")
            or host.endswith(".fc2.com")
            or (host == "commoncrawl.org" and path_.startswith("/blog/"))
            or (host == "creativecommons.org" and path_.startswith("/mission/"))
        )

    urls = [d["url"] for d in docs]
    assert blocked == {u for u in urls if expected(u)}
    # The cases the list was written for are really in the sample.
    hosts = {_host(u) for u in blocked}
    assert {"allenai.org", "prior.allenai.org", "commoncrawl.org", "creativecommons.org"} <= hosts
    assert any(h.endswith(".blog.fc2.com") for h in hosts)  # a.b.fc2.com: any depth below the domain
    kept = {_host(d["url"]) for d in docs if d.get("reason") is None}
    assert {"maria-antoniak.github.io", "kyleclo.com", "www.semanticscholar.org"} <= kept
    assert "https://commoncrawl.org/faq" in {d["url"] for d in docs if d.get("reason") is None}


def test_banned_substrings_match_the_decoded_lower_cased_url(sample_rows):
    config = UrlFilterConfig(banned_substrings=["/BLOG/", "淫乱"])
    docs = _filtered(sample_rows, config)
    banned = [d["url"] for d in docs if d.get("reason") == "url:banned_word"]
    # The Japanese word is percent-encoded in the 101jav.com URL: it matches after decoding.
    assert any("101jav.com" in u for u in banned)
    assert {u for u in banned if "101jav.com" not in u} == {d["url"] for d in docs if "/blog/" in d["url"].lower()}


def test_blocklist_is_checked_before_banned_substrings(tmp_path: Path, sample_rows):
    path = tmp_path / "blocklist.txt"
    path.write_text("commoncrawl.org\n")
    config = UrlFilterConfig(blocklist=str(path), banned_substrings=["blog"])
    docs = _filtered(sample_rows, config, load_blocklist(str(path)))
    reasons = {d["url"]: d.get("reason") for d in docs}
    assert reasons["https://commoncrawl.org/blog/march-april-2024-newsletter"] == "url:blocklist"
    assert reasons["http://akindleinhongkong.blogspot.com/2012/02/walking-tour-stanley.html"] == "url:banned_word"


def test_the_demo_blocklist_names_domains_of_the_sample(sample_rows):
    cfg = load_config(REPO / "pipeline" / "configs" / "demo.yaml").url_filter
    docs = _filtered(sample_rows, cfg, load_blocklist(str(REPO / cfg.blocklist)))
    reasons = drop_reasons(docs)
    assert reasons["url:blocklist"] >= 3 and reasons["url:banned_word"] >= 1
    # Only pages language id would drop anyway: the demo's kept output does not change.
    assert all(not d["text"].isascii() for d in docs if d.get("reason"))


def test_no_list_drops_nothing_and_rows_without_url_pass(sample_rows):
    docs = _filtered(sample_rows, UrlFilterConfig())
    assert drop_reasons(docs) == {}
    rows = [{"url": None, "text": "x"}, {"text": "y"}]
    UrlFilter(UrlFilterConfig(banned_substrings=["x"]))(rows)
    assert drop_reasons(rows) == {}


def test_disabled_ignores_the_lists(tmp_path: Path, sample_rows):
    path = tmp_path / "blocklist.txt"
    path.write_text("allenai.org\n")
    config = UrlFilterConfig(enabled=False, blocklist=str(path), banned_substrings=["a"])
    assert drop_reasons(_filtered(sample_rows, config, load_blocklist(str(path)))) == {}


def test_a_missing_blocklist_fails_naming_it(tmp_path: Path):
    missing = tmp_path / "adult-domains.txt"
    with pytest.raises(PipelineInputError, match=str(missing)):
        load_blocklist(str(missing))
    with pytest.raises(ValueError, match="no UrlBlocklist"):
        UrlFilter(UrlFilterConfig(blocklist=str(missing)), None)


def test_config_rejects_unknown_keys():
    with pytest.raises(ValidationError):
        PipelineConfig.model_validate({"url_filter": {"block_list": "x.txt"}})
