"""URL filtering: the block list file's format, what it blocks (hosts with their subdomains, exact
URLs in one normal form), a damaged or missing list refused in one line, the drop reason and its
count in filtered/, and the list's sha256 in filtered/'s identity."""

from __future__ import annotations

import json
import os

import dagster as dg
import polars as pl
import pytest

from marin_assets.catalog import Catalog
from marin_assets.curation.config import SourceConfigError, parse_curation_config, reading_identity
from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.filters import FilterConfig
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.refine import build_refinement_assets
from marin_assets.curation.url_filter import (
    URL_BLOCKED,
    UrlBlocklistError,
    blocklist_bytes,
    parse_url_blocklist,
    read_url_blocklist,
)

from .conftest import NORMAL_TEXT

BLOCKLIST = """\
# Sites we never train on.
spam.example            # and all of its subdomains
*.tracker.example.net
.ads.example.org
bücher.example          # an internationalised name, compared in its xn-- form
203.0.113.50
[2001:DB8::7]

https://news.example.com/story?id=7#comments   # one page only
HTTP://Blog.Example.com:80
"""


@pytest.fixture
def blocklist():
    return parse_url_blocklist(BLOCKLIST.encode(), "test")


@pytest.mark.parametrize("url", [
    "http://spam.example/", "https://www.spam.example/page", "https://a.b.SPAM.example:8443/x?y#z",
    "https://tracker.example.net/p.gif", "http://x.tracker.example.net", "https://ads.example.org/",
    "https://xn--bcher-kva.example/buch", "https://www.bücher.example/", "http://203.0.113.50/admin",
    "http://[2001:db8:0::7]:8080/", "https://news.example.com/story?id=7", "https://NEWS.example.com:443/story?id=7",
    "https://news.example.com/story?id=7#top", "https://user@news.example.com/story?id=7", "http://blog.example.com/",
    "http://blog.example.com", "http://spam.example./",
])
def test_a_listed_host_its_subdomains_and_a_listed_url_are_blocked(blocklist, url):
    assert blocklist.blocks(url)


@pytest.mark.parametrize("url", [
    "https://notspam.example/", "https://spam.example.evil.net/", "https://example.net/", "https://news.example.com/",
    "https://news.example.com/story?id=8", "https://news.example.com/story", "http://news.example.com:8080/story?id=7",
    "https://blog.example.com/post", "http://203.0.113.5/", "http://[2001:db8::8]/", "spam.example/no-scheme",
    "not a url", "", "https://[::1/broken",
])
def test_other_urls_pass(blocklist, url):
    assert not blocklist.blocks(url)


def test_the_list_parses_to_hosts_and_normal_urls(blocklist):
    assert blocklist.hosts == {"spam.example", "tracker.example.net", "ads.example.org", "xn--bcher-kva.example",
                               "203.0.113.50", "2001:db8::7"}
    assert blocklist.urls == {"https://news.example.com/story?id=7", "http://blog.example.com/"}
    assert parse_url_blocklist(b"# nothing\n\n   \n", "empty").hosts == frozenset()


@pytest.mark.parametrize("content, problem", [
    (b"spam.example\nfoo.example bar.example\n", "line 2: one entry per line, got 'foo.example bar.example'"),
    (b"0.0.0.0 spam.example\n", "line 1: one entry per line, got '0.0.0.0 spam.example'"),
    (b"ok.example\nexample.com/path\n", "line 2: not a host name or a URL with its scheme: 'example.com/path'"),
    (b"https://\n", "line 1: not a URL with a host: 'https://'"),
    (b"under_score.ok\nbad!host\n", "line 2: not a host name or a URL with its scheme: 'bad!host'"),
    (b"spam.example\n\xff\xfe\n", "not UTF-8 text (byte 13)"),
])
def test_a_damaged_list_is_refused_naming_the_line(content, problem):
    with pytest.raises(UrlBlocklistError) as raised:
        parse_url_blocklist(content, "/lists/x.txt")
    message = str(raised.value)
    assert message.startswith("block list /lists/x.txt") and message.endswith(problem) and "\n" not in message


def _config(tmp_path, **fields):
    return parse_curation_config({"sources": [{"name": "s", "uri": "crawl/*.warc.gz", **fields}]}, tmp_path)


def test_the_yaml_refuses_a_missing_damaged_or_remote_list_in_one_line(tmp_path):
    with pytest.raises(SourceConfigError) as raised:
        _config(tmp_path, url_blocklist="lists/missing.txt")
    assert str(raised.value) == (f"source 's'.url_blocklist: block list {tmp_path}/lists/missing.txt: cannot read "
                                 "it: No such file or directory")
    (tmp_path / "lists").mkdir()
    with pytest.raises(SourceConfigError, match=r"cannot read it: Is a directory"):
        _config(tmp_path, url_blocklist="lists")
    (tmp_path / "lists" / "bad.txt").write_text("a.example b.example\n")
    with pytest.raises(SourceConfigError, match=r"source 's'.url_blocklist: block list .*/lists/bad.txt line 1: one "):
        _config(tmp_path, url_blocklist="lists/bad.txt")
    with pytest.raises(SourceConfigError, match=r"a local file path, got 'https://lists.example/block.txt'"):
        _config(tmp_path, url_blocklist="https://lists.example/block.txt")


def _filtered_identity(config) -> dict:
    catalog = Catalog()
    build_refinement_assets(config.sources[0], config, dg.DynamicPartitionsDefinition(name="s_shards"),
                            dg.AssetKey(["documents", "s"]), catalog)
    return catalog.specs["filtered/s"].identity(None)


def test_the_lists_sha256_is_filtereds_identity_and_not_raws(tmp_path):
    path = tmp_path / "block.txt"
    path.write_text("spam.example\n")
    listed = _config(tmp_path, url_blocklist="block.txt", pii=False)
    plain = _config(tmp_path, pii=False)
    first = _filtered_identity(listed)
    assert first == {**_filtered_identity(plain), "url_blocklist_sha256": read_url_blocklist(str(path)).sha256}
    assert reading_identity(listed.sources[0]) == reading_identity(plain.sources[0])
    path.write_text("spam.example\nmore.example\n")
    second = _filtered_identity(_config(tmp_path, url_blocklist="block.txt", pii=False))
    assert second["url_blocklist_sha256"] != first["url_blocklist_sha256"]
    # A build whose list changed after the code location loaded it refuses to run on the new bytes.
    stale = read_url_blocklist(str(path))
    path.write_text("spam.example\n")
    os.utime(path, ns=(1, 1))
    with pytest.raises(UrlBlocklistError, match=r"changed since the code location loaded it"):
        blocklist_bytes(str(path), stale)


def _documents(urls: list[str | None]) -> pl.DataFrame:
    return pl.DataFrame({"id": [f"d{i}" for i in range(len(urls))], "text": NORMAL_TEXT, "source": "s",
                         "source_id": [f"f:{i}" for i in range(len(urls))],
                         "metadata": [json.dumps({} if url is None else {"url": url}) for url in urls]})


def test_blocked_documents_are_dropped_with_their_reason_and_counted():
    urls = ["https://www.spam.example/a", None, "https://fine.example/", "https://news.example.com/story?id=7",
            "https://fine.example/2", "http://tracker.example.net/x"] * 3
    docs = _documents(urls)
    # Every sixth document also fails rules: it is dropped for its URL, and both are listed.
    docs = docs.with_columns(pl.when(pl.int_range(pl.len()) % 6 == 5).then(pl.lit("too short"))
                             .otherwise(pl.col("text")).alias("text"))
    task = FilterTask(FilterConfig(languages=()), MinHashConfig(), url_blocklist=BLOCKLIST.encode())
    whole = merge_chunks([filter_chunk(docs, task)], task)
    parts = merge_chunks([filter_chunk(docs.slice(start, 4), task) for start in range(0, docs.height, 4)], task)
    assert whole.counts[URL_BLOCKED] == 9 and whole.dropped.height == 9
    assert whole.dropped["id"].to_list() == [f"d{i}" for i in range(18) if i % 6 in (0, 3, 5)]
    assert set(whole.dropped["reason"]) == {URL_BLOCKED}
    assert whole.dropped.filter(pl.col("id") == "d5")["failed_rules"].to_list() == [
        [URL_BLOCKED, "min_words", "min_stop_words"]]
    assert whole.kept.height == 9 and whole.counts["min_words"] == 0
    assert parts.dropped.equals(whole.dropped) and parts.kept.equals(whole.kept) and parts.counts == whole.counts
    # Without a list nothing is blocked and there is no such rule.
    plain = filter_chunk(docs, FilterTask(FilterConfig(languages=()), MinHashConfig()))
    assert URL_BLOCKED not in plain.counts and plain.dropped.height == 3
