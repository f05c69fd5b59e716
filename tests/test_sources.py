"""pipeline.sources against real endpoints on 127.0.0.1: moto's S3 server, and an HTTP server with Range support
that fails on purpose (tests/remote_servers.py)."""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import pickle
import shutil
from pathlib import Path

import aiohttp
import pytest
from conftest import SAMPLE
from remote_servers import (
    FAKE_KEY_ID,
    SLOW_DOWN,
    FaultPlan,
    http_proxy,
    http_server,
    moto_server,
    s3_prefix,
    upload_dir,
    use_s3_endpoint,
)

from pipeline.errors import PipelineInputError
from pipeline.sources import (
    InputFile,
    InputUnreadableError,
    ReadStats,
    RetryConfig,
    is_remote,
    is_transient,
    list_inputs,
    open_input,
)

FAST = RetryConfig(attempts=3, initial_backoff_s=0.001, max_backoff_s=0.005)
SAMPLE_FILES = sorted(p for p in SAMPLE.iterdir() if p.name.endswith((".warc.gz", ".warc.wet.gz")))
BIG = SAMPLE / "sample-0001.warc.gz"  # 237 kB, the largest sample


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read(uri: str, retry: RetryConfig = FAST, **kwargs) -> tuple[bytes, ReadStats]:
    stats = ReadStats()
    with open_input(uri, retry, stats, **kwargs) as fh:
        data = fh.read()
    return data, stats


@pytest.fixture(scope="module")
def moto_endpoint():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_sample(monkeypatch, moto_endpoint) -> str:
    with s3_prefix(monkeypatch, SAMPLE, prefix="crawl/sample", endpoint=moto_endpoint) as uri:
        yield uri


@pytest.fixture(scope="module")
def http_sample():
    with http_server(SAMPLE) as server:
        yield server


@pytest.fixture
def tree(tmp_path) -> Path:
    """Nested inputs whose string order differs from path-component order ('a-b/…' sorts before 'a/…')."""
    root = tmp_path / "tree"
    names = [
        "b/2.warc.wet.gz",
        "a-b/1.warc",
        "a/3.warc.gz",
        "a/z/4.warc.wet",
        "top.warc.wet.gz",
        "notes.txt",
        "a/partial.warc.gz.tmp",
    ]
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * (i + 1))
    return root


# ---- listing ----


def test_local_dir_is_recursive_filtered_and_sorted_as_strings(tree):
    files = list_inputs(str(tree))
    rel = [Path(f.uri).relative_to(tree).as_posix() for f in files]
    assert rel == ["a-b/1.warc", "a/3.warc.gz", "a/z/4.warc.wet", "b/2.warc.wet.gz", "top.warc.wet.gz"]
    assert all(Path(f.uri).is_absolute() for f in files)
    assert [f.size for f in files] == [Path(f.uri).stat().st_size for f in files]


def test_local_glob_and_single_file(tree, monkeypatch):
    monkeypatch.chdir(tree)
    files = list_inputs("**/*.warc.gz")  # relative patterns come back absolute
    assert [f.uri for f in files] == [str(tree / "a/3.warc.gz")]
    assert [Path(f.uri).name for f in list_inputs(str(tree / "*" / "*.warc*"))] == [
        "1.warc",
        "3.warc.gz",
        "partial.warc.gz.tmp",
        "2.warc.wet.gz",
    ]
    assert list_inputs(str(tree / "notes.txt")) == [InputFile(str(tree / "notes.txt"), 6)]  # named: taken as is


def test_nothing_to_read_names_the_pattern(tmp_path):
    with pytest.raises(PipelineInputError, match=r"nowhere: no such file or directory"):
        list_inputs(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineInputError, match=r"empty: matches no WARC/WET files"):
        list_inputs(str(tmp_path / "empty"))
    with pytest.raises(PipelineInputError, match=r"\*\.warc\.wet\.gz: matches no WARC/WET files"):
        list_inputs(str(tmp_path / "*.warc.wet.gz"))
    with pytest.raises(PipelineInputError, match="exactly one"):
        list_inputs()
    with pytest.raises(PipelineInputError, match="ftp://bucket/prefix: unsupported scheme 'ftp'"):
        list_inputs("ftp://bucket/prefix")


def test_s3_prefix_lists_recursively_in_the_local_order(s3_sample, moto_endpoint, tree):
    files = list_inputs(s3_sample, retry=FAST)
    assert [f.uri for f in files] == [f"{s3_sample}/{p.name}" for p in SAMPLE_FILES]
    assert [f.size for f in files] == [p.stat().st_size for p in SAMPLE_FILES]
    bucket = s3_sample.split("/")[2]
    uri = upload_dir(moto_endpoint, tree, bucket, "tree")
    local = [Path(f.uri).relative_to(tree).as_posix() for f in list_inputs(str(tree))]
    assert [f.uri for f in list_inputs(uri, retry=FAST)] == [f"{uri}/{rel}" for rel in local]
    assert [f.uri for f in list_inputs(uri + "/", retry=FAST)] == [f"{uri}/{rel}" for rel in local]


def test_s3_glob_and_single_key(s3_sample, moto_endpoint, tree):
    assert [f.uri.rsplit("/", 1)[1] for f in list_inputs(s3_sample + "/cc_*.warc.wet.gz", retry=FAST)] == [
        "cc_en_head-0091.warc.wet.gz",
        "cc_en_head-0174.warc.wet.gz",
    ]
    bucket = s3_sample.split("/")[2]
    uri = upload_dir(moto_endpoint, tree, bucket, "tree")
    assert [f.uri for f in list_inputs(f"s3://{bucket}/tree/**/*.warc.gz", retry=FAST)] == [f"{uri}/a/3.warc.gz"]
    assert [f.uri for f in list_inputs(f"s3://{bucket}/*/a/*/*.warc.wet", retry=FAST)] == [f"{uri}/a/z/4.warc.wet"]
    assert list_inputs(f"{uri}/notes.txt", retry=FAST) == [InputFile(f"{uri}/notes.txt", 6)]


def test_s3_empty_match_names_the_pattern(s3_sample):
    with pytest.raises(PipelineInputError, match=r"/nothing-here: matches no WARC/WET files"):
        list_inputs(s3_sample.rsplit("/", 1)[0] + "/nothing-here", retry=FAST)
    with pytest.raises(PipelineInputError, match=r"/\*\.txt: matches no WARC/WET files"):
        list_inputs(s3_sample + "/*.txt", retry=FAST)


LISTING = """# a Common Crawl paths listing, shuffled: its order is kept
cc_en_head-0174.warc.wet.gz

sample-0000.warc.gz
   CC-MAIN-2024-22-whirlwind.warc.wet.gz
"""
LISTED = ["cc_en_head-0174.warc.wet.gz", "sample-0000.warc.gz", "CC-MAIN-2024-22-whirlwind.warc.wet.gz"]


def test_paths_listing_plain_and_gz_joined_to_any_base(tmp_path, http_sample, s3_sample, monkeypatch):
    (tmp_path / "wet.paths").write_text(LISTING)
    (tmp_path / "wet.paths.gz").write_bytes(gzip.compress(LISTING.encode()))
    for listing in ("wet.paths", "wet.paths.gz"):
        path = str(tmp_path / listing)
        for base in (http_sample.base_url, http_sample.base_url + "/", s3_sample):
            files = list_inputs(input_list=path, base_url=base, retry=FAST)
            assert files == [InputFile(f"{base.rstrip('/')}/{name}", None) for name in LISTED]
        files = list_inputs(input_list=path, base_url=str(SAMPLE))
        assert [f.uri for f in files] == [str(SAMPLE / name) for name in LISTED]
        monkeypatch.chdir(SAMPLE.parent)
        assert list_inputs(input_list=path, base_url=SAMPLE.name) == files  # a relative base comes back absolute
    # the listed files are readable where they were joined
    files = list_inputs(input_list=str(tmp_path / "wet.paths.gz"), base_url=s3_sample, retry=FAST)
    assert read(files[0].uri)[1].sha256 == sha256(SAMPLE / LISTED[0])


def test_paths_listing_may_itself_be_remote_and_hold_absolute_entries(tmp_path, http_sample, s3_sample, moto_endpoint):
    served = tmp_path / "served"
    served.mkdir()
    text = LISTING + f"{http_sample.base_url}/sample-0001.warc.gz\n{SAMPLE / 'sample-0001.warc.gz'}\n"
    (served / "wet.paths.gz").write_bytes(gzip.compress(text.encode()))
    expected = [f"{s3_sample}/{name}" for name in LISTED] + [
        f"{http_sample.base_url}/sample-0001.warc.gz",
        str(SAMPLE / "sample-0001.warc.gz"),
    ]
    with http_server(served) as server:
        files = list_inputs(input_list=f"{server.base_url}/wet.paths.gz", base_url=s3_sample, retry=FAST)
    assert [f.uri for f in files] == expected
    listing_uri = upload_dir(moto_endpoint, served, s3_sample.split("/")[2], "listings") + "/wet.paths.gz"
    assert [f.uri for f in list_inputs(input_list=listing_uri, base_url=s3_sample, retry=FAST)] == expected


def test_paths_listing_errors(tmp_path, http_sample):
    (tmp_path / "wet.paths").write_text(LISTING)
    with pytest.raises(PipelineInputError, match=r"wet\.paths:2: .*relative path; give a base URL"):
        list_inputs(input_list=str(tmp_path / "wet.paths"))
    with pytest.raises(PipelineInputError, match=r"missing\.paths: input list not found"):
        list_inputs(input_list=str(tmp_path / "missing.paths"), base_url=str(SAMPLE))
    with pytest.raises(InputUnreadableError, match=r"/missing\.paths: unreadable after 1 attempt: .*404"):
        list_inputs(input_list=f"{http_sample.base_url}/missing.paths", base_url=str(SAMPLE), retry=FAST)
    (tmp_path / "empty.paths").write_text("# nothing\n\n")
    with pytest.raises(PipelineInputError, match=r"empty\.paths: the input list names no files"):
        list_inputs(input_list=str(tmp_path / "empty.paths"), base_url=str(SAMPLE))
    (tmp_path / "bad.paths.gz").write_bytes(gzip.compress(LISTING.encode())[:20])
    with pytest.raises(PipelineInputError, match=r"bad\.paths\.gz: unreadable input list"):
        list_inputs(input_list=str(tmp_path / "bad.paths.gz"), base_url=str(SAMPLE))
    with pytest.raises(PipelineInputError, match="exactly one"):
        list_inputs(str(SAMPLE), input_list=str(tmp_path / "wet.paths"))
    with pytest.raises(PipelineInputError, match="base URL applies only to an input list"):
        list_inputs(str(SAMPLE), base_url="https://data.commoncrawl.org")


def test_http_url_is_one_file_with_its_size(http_sample):
    assert list_inputs(f"{http_sample.base_url}/{BIG.name}", retry=FAST) == [
        InputFile(f"{http_sample.base_url}/{BIG.name}", BIG.stat().st_size)
    ]
    with pytest.raises(InputUnreadableError, match=r"/nope\.warc\.gz: unreadable after 1 attempt"):
        list_inputs(f"{http_sample.base_url}/nope.warc.gz", retry=FAST)


def test_is_remote():
    assert is_remote("s3://b/k") and is_remote("https://x/y") and is_remote("HTTP://x/y")
    assert not is_remote("/data/x.warc.gz") and not is_remote("file:///data/x") and not is_remote("C:\\x")


# ---- reading ----


def test_local_s3_and_http_give_the_same_bytes_and_sha256(s3_sample, http_sample):
    for path in SAMPLE_FILES:
        want = path.read_bytes()
        for uri in (str(path), f"{s3_sample}/{path.name}", f"{http_sample.base_url}/{path.name}"):
            data, stats = read(uri)
            assert data == want, uri
            assert (stats.sha256, stats.bytes, stats.retries) == (hashlib.sha256(want).hexdigest(), len(want), 0)


def test_http_503s_are_retried(caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.sources")
    with http_server(SAMPLE, FaultPlan(fail_first=2)) as server:
        uri = f"{server.base_url}/{BIG.name}"
        data, stats = read(uri)
    assert data == BIG.read_bytes() and stats.sha256 == sha256(BIG)
    assert stats.retries == 2
    assert [r.status for r in server.log] == [503, 503, 200]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all(uri in r.getMessage() and "503" in r.getMessage() for r in warnings)


def test_http_reset_mid_body_resumes_at_the_byte_delivered():
    plan = FaultPlan(reset_first=2, reset_after=50_000, reset_delay_s=0.3)
    with http_server(SAMPLE, plan) as server:
        data, stats = read(f"{server.base_url}/{BIG.name}", buffer_size=16 << 10)
    assert data == BIG.read_bytes() and stats.sha256 == sha256(BIG) and stats.bytes == len(data)
    assert stats.retries == 2
    # Each attempt continues where the last one stopped: nothing re-downloaded from the start.
    assert [(r.range, r.status) for r in server.log] == [(None, 200), ("bytes=50000-", 206), ("bytes=100000-", 206)]


def test_server_that_ignores_range_is_resumed_by_skipping():
    plan = FaultPlan(reset_first=1, reset_after=30_000, reset_delay_s=0.3, ignore_range=True)
    with http_server(SAMPLE, plan) as server:
        data, stats = read(f"{server.base_url}/{BIG.name}", buffer_size=16 << 10)
    assert data == BIG.read_bytes() and stats.sha256 == sha256(BIG) and stats.retries == 1
    assert [(r.range, r.status) for r in server.log] == [(None, 200), ("bytes=30000-", 200)]


def test_permanent_errors_fail_at_once_naming_the_input(http_sample, s3_sample, tmp_path):
    slow = RetryConfig(attempts=5, initial_backoff_s=10)  # a retry would time the test out
    for uri in (
        f"{http_sample.base_url}/missing.warc.gz",
        f"{s3_sample}/missing.warc.gz",
        str(tmp_path / "missing.warc.gz"),
    ):
        stats = ReadStats()
        with (
            pytest.raises(InputUnreadableError, match="unreadable after 1 attempt: ") as err,
            open_input(uri, slow, stats),
        ):
            pass
        assert str(err.value).startswith(f"{uri}: ") and stats.retries == 0
        assert isinstance(err.value, PipelineInputError) and err.value.uri == uri
    forbidden = pytest.raises(InputUnreadableError, match=r"unreadable after 1 attempt: ClientResponseError: 403")
    with http_server(SAMPLE, FaultPlan(fail_first=100, status=403)) as server, forbidden:
        read(f"{server.base_url}/{BIG.name}", slow)
    assert len(server.log) == 1


def test_always_503_gives_up_after_the_attempts():
    with http_server(SAMPLE, FaultPlan(fail_first=10**6)) as server:
        uri = f"{server.base_url}/{BIG.name}"
        stats = ReadStats()
        with pytest.raises(InputUnreadableError) as err, open_input(uri, FAST, stats):
            pass
    assert str(err.value).startswith(f"{uri}: unreadable after 3 attempts: ClientResponseError: 503")
    assert "\n" not in str(err.value) and str(err.value).isascii()
    assert stats.retries == 2 and len(server.log) == 3


def test_s3_throttling_and_resets_are_retried(s3_sample, moto_endpoint, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="pipeline.sources")
    patient = RetryConfig(attempts=5, initial_backoff_s=0.001, max_backoff_s=0.005)
    with http_proxy(moto_endpoint, FaultPlan(fail_first=1, body=SLOW_DOWN)) as proxy:  # every path, once
        use_s3_endpoint(monkeypatch, proxy.base_url)
        # (one pyarrow call may be several requests: a key's info is a HEAD, then a listing if it is no object)
        files = list_inputs(s3_sample, retry=patient)
    assert [f.uri for f in files] == [f"{s3_sample}/{p.name}" for p in SAMPLE_FILES]
    # SlowDown twice, then the first GET of the object reset mid-body.
    plan = FaultPlan(fail_first=2, body=SLOW_DOWN, reset_first=1, reset_after=5_000, only=BIG.name)
    with http_proxy(moto_endpoint, plan) as proxy:
        use_s3_endpoint(monkeypatch, proxy.base_url)
        data, stats = read(f"{s3_sample}/{BIG.name}", patient)
    assert data == BIG.read_bytes() and stats.sha256 == sha256(BIG)
    assert stats.retries == 3  # two SlowDowns on HEAD, one reset GET
    messages = [r.getMessage() for r in caplog.records]
    assert any("SLOW_DOWN" in m for m in messages) and any("NETWORK_CONNECTION" in m for m in messages)
    with http_proxy(moto_endpoint, FaultPlan(fail_first=10**6, body=SLOW_DOWN)) as proxy:
        use_s3_endpoint(monkeypatch, proxy.base_url)
        with pytest.raises(InputUnreadableError, match=r"unreadable after 3 attempts: OSError: .*HTTP status 503"):
            read(f"{s3_sample}/{BIG.name}")
    assert len(proxy.log) == 3  # the AWS SDK's own retries are off: every attempt is ours


def test_seek_to_start_restarts_hash_and_count(http_sample):
    for uri in (str(BIG), f"{http_sample.base_url}/{BIG.name}"):
        stats = ReadStats()
        with open_input(uri, FAST, stats, buffer_size=4096) as fh:
            head = fh.read(10_000)
            assert fh.tell() == 10_000 and stats.bytes >= 10_000
            fh.seek(0)
            assert fh.tell() == 0 and stats.bytes == 0
            assert fh.read(10_000) == head
            with pytest.raises(io.UnsupportedOperation):
                fh.seek(5)
            fh.seek(0)
            assert fh.read() == BIG.read_bytes()
        assert (stats.bytes, stats.sha256) == (BIG.stat().st_size, sha256(BIG))


def test_warc_reader_streams_remote_inputs_including_single_stream_gzip(tmp_path, http_sample):
    from pipeline.steps.extract import check_stream_is_warc, read_records, read_wet

    one_stream = tmp_path / "one-stream.warc.wet.gz"  # one gzip stream, not one member per record: rewinds once
    one_stream.write_bytes(gzip.compress(gzip.decompress((SAMPLE / "cc_en_head-0174.warc.wet.gz").read_bytes())))
    shutil.copy(SAMPLE / "cc_en_head-0091.warc.wet.gz", tmp_path)
    # Every GET of a file, up to the third, is reset after 20 kB: the rewinds (at most two) restart reading from
    # the start, so at least one reset happens while reading on, and is resumed.
    with http_server(tmp_path, FaultPlan(reset_first=3, reset_after=20_000, reset_delay_s=0.2)) as server:
        for path in (one_stream, tmp_path / "cc_en_head-0091.warc.wet.gz"):
            stats = ReadStats()
            with open_input(f"{server.base_url}/{path.name}", FAST, stats) as fh:
                check_stream_is_warc(fh, path.name)
                rows = [(d["warc_record_id"], d["text"]) for d in read_records(fh, path.name)]
                while fh.read(1 << 20):
                    pass
            assert rows == [(d["warc_record_id"], d["text"]) for d in read_wet(path)]
            assert len(rows) > 5 and stats.sha256 == sha256(path) and stats.bytes == path.stat().st_size
            assert stats.retries >= 1


def test_s3_settings_come_from_the_standard_aws_environment(tmp_path, monkeypatch):
    """pyarrow's from_uri honours AWS_ENDPOINT_URL_S3 over AWS_ENDPOINT_URL, the key pair and the region."""
    with http_server(tmp_path) as server:
        use_s3_endpoint(monkeypatch, "http://127.0.0.1:9", region="ap-south-1")  # a dead port: must not be used
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.base_url)
        with pytest.raises(PipelineInputError, match="matches no WARC/WET files"):
            list_inputs("s3://some-bucket/prefix/", retry=FAST)
    authorization = server.log[-1].headers["authorization"]
    assert f"Credential={FAKE_KEY_ID}/" in authorization and "/ap-south-1/s3/aws4_request" in authorization


def test_unreadable_error_survives_pickling():
    err = InputUnreadableError("s3://b/k.warc.gz", 5, "OSError: AWS Error SLOW_DOWN")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, PipelineInputError) and str(back) == str(err)
    assert str(err) == "s3://b/k.warc.gz: unreadable after 5 attempts: OSError: AWS Error SLOW_DOWN"


def _caused_by(err: BaseException, cause: BaseException) -> BaseException:
    err.__cause__ = cause
    return err


def _response_error(status: int) -> aiohttp.ClientResponseError:
    return aiohttp.ClientResponseError(None, (), status=status)


@pytest.mark.parametrize(
    ("err", "transient"),
    [
        (OSError("When reading 'k': AWS Error SLOW_DOWN during GetObject operation: Please reduce"), True),
        (OSError("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body."), True),
        (OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56"), True),
        (OSError("AWS Error ACCESS_DENIED during HeadObject operation: (HTTP status 403)"), False),
        (FileNotFoundError("Path does not exist 'b/k'"), False),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (TimeoutError(), True),
        (_response_error(429), True),
        (_response_error(500), True),
        (_response_error(404), False),
        (_caused_by(FileNotFoundError("http://x/y"), _response_error(503)), True),  # fsspec's size probe
        (ValueError("not a gzip file"), False),
    ],
)
def test_transient_errors(err, transient):
    assert is_transient(err) is transient
