"""WARC sources and HTML extraction on real pages.

The pages are real documentation found on this machine at test time (Debian's python3.11-doc
when installed, which CI installs, else other HTML under /usr/share/doc or inside installed
packages). What counts as a page's body and its navigation is read from the page's own markup
(Sphinx's div.body against its sidebar and related-links bars, <main> against <nav>), never from
the extractor under test. The WARC files are written with warcio, an implementation independent
of the FastWARC reader.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import lxml.html
import polars as pl
import pytest
from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter

from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.filters import RULE_ORDER, FilterConfig
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.pii import PiiConfig, scrub_text
from marin_assets.curation.readers import read_shard
from marin_assets.curation.url_filter import URL_BLOCKED
from marin_assets.curation.web import page_regions, reference_pages

from .conftest import NORMAL_TEXT, build_filtered_shard, make_source

N_PAGES = 5
_SPACE_RE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE_RE.sub(" ", text).strip()


@dataclass(frozen=True)
class Page:
    path: Path
    html: bytes
    body_sentence: str  # words from the middle of the main region's longest paragraph
    navigation: tuple[str, ...]  # navigation lines that occur nowhere in the main region


def _known_text(path: Path) -> Page | None:
    html = path.read_bytes()
    regions = page_regions(html)
    if regions is None or len(regions.main.split()) < 300 or len(regions.navigation) < 3:
        return None
    root = lxml.html.fromstring(html)
    main = next((found[0] for xpath in ("//main", "//*[@role='main']", "//div[@class='body']") if
                 (found := root.xpath(xpath))), None)
    if main is None:
        return None
    paragraphs = sorted((_squash(p.text_content()) for p in main.iter("p")), key=len)
    if not paragraphs or len(paragraphs[-1].split()) < 20:
        return None
    words = paragraphs[-1].split()
    middle = len(words) // 2
    return Page(path, html, " ".join(words[middle - 5: middle + 5]), regions.navigation)


@pytest.fixture(scope="module")
def pages() -> list[Page]:
    found: list[Page] = []
    for path in reference_pages():
        page = _known_text(path)
        if page is not None:
            found.append(page)
            if len(found) == 8 * N_PAGES:
                break
    if len(found) < N_PAGES:
        pytest.fail(
            f"found {len(found)} real HTML pages with a marked-up main region and navigation (need {N_PAGES}); "
            "install Debian's python3.11-doc (apt-get install python3.11-doc), as .ci/run does"
        )
    return found[:: len(found) // N_PAGES][:N_PAGES]


def _png() -> bytes:
    import matplotlib

    return next(Path(matplotlib.get_data_path(), "images").glob("*.png")).read_bytes()


def _response(writer: WARCWriter, url: str, body: bytes, content_type: str, status: str = "200 OK",
              extra: list[tuple[str, str]] = ()):
    headers = StatusAndHeaders(status, [("Content-Type", content_type), *extra], protocol="HTTP/1.1")
    return writer.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=headers)


@dataclass(frozen=True)
class Crawl:
    path: Path
    starts: list[int]  # byte offset in the file where each record written after warcinfo begins
    kinds: list[str]  # what each of those records is: page:<i>, request, metadata, image, 404
    size: int


def write_crawl(path: Path, pages: list[Page], gzipped: bool) -> Crawl:
    """A crawl of the pages with the records a real crawler writes around them: warcinfo, a request
    before each response, a metadata record, an image, a 404. The second page is sent with gzip
    content coding and chunked transfer coding, as servers do."""
    starts, kinds = [], []
    with open(path, "wb") as f:
        writer = WARCWriter(f, gzip=gzipped)
        writer.write_record(writer.create_warcinfo_record(path.name, {"software": "marin-dagster tests"}))

        def add(kind: str, record) -> None:
            starts.append(f.tell())
            kinds.append(kind)
            writer.write_record(record)

        for i, page in enumerate(pages):
            url = f"https://docs.example.org/{page.path.name}"
            request = StatusAndHeaders(f"GET /{page.path.name} HTTP/1.1", [("Host", "docs.example.org")],
                                       is_http_request=True)
            add("request", writer.create_warc_record(url, "request", http_headers=request))
            if i == 1:
                packed = gzip.compress(page.html)
                chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part)
                                   for part in (packed[:1000], packed[1000:])) + b"0\r\n\r\n"
                add(f"page:{i}", _response(writer, url, chunked, "text/html; charset=utf-8",
                                           extra=[("Content-Encoding", "gzip"), ("Transfer-Encoding", "chunked")]))
            else:
                add(f"page:{i}", _response(writer, url, page.html, "text/html; charset=utf-8"))
            if i == 0:
                add("metadata", writer.create_warc_record(url, "metadata", payload=io.BytesIO(b"fetchTimeMs: 12\r\n"),
                                                          warc_content_type="application/warc-fields"))
                add("image", _response(writer, "https://docs.example.org/logo.png", _png(), "image/png"))
                add("404", _response(writer, "https://docs.example.org/gone.html",
                                     b"<html><body><h1>Not Found</h1></body></html>", "text/html", "404 Not Found"))
    return Crawl(path, starts, kinds, path.stat().st_size)


def _read(path: Path, **fields):
    src = make_source(path.parent, uri=path.name, **fields)
    shards = discover_shards(src)
    assert len(shards) == 1
    return read_shard(src, shards[0])


@pytest.fixture(scope="module", params=["warc", "warc.gz"])
def crawl(request, pages, tmp_path_factory) -> Crawl:
    folder = tmp_path_factory.mktemp(request.param.replace(".", "-"))
    return write_crawl(folder / f"crawl.{request.param}", pages, gzipped=request.param.endswith(".gz"))


def test_warc_pages_keep_their_body_and_lose_their_navigation(crawl, pages):
    result = _read(crawl.path)
    docs = result.documents
    assert docs.height == len(pages)
    assert sorted(result.quarantine["reason"].to_list()) == ["http_status", "not_html"]
    assert result.n_records == docs.height + result.quarantine.height  # request/metadata/warcinfo are not records
    for page, text in zip(pages, docs["text"].to_list()):
        flat = _squash(text)
        assert page.body_sentence in flat, (page.path, page.body_sentence)
        leaked = [line for line in page.navigation if line in flat]
        assert not leaked, (page.path, leaked)
    meta = json.loads(docs["metadata"][1])
    assert meta["url"] == f"https://docs.example.org/{pages[1].path.name}"
    assert meta["warc_record_id"].startswith("<urn:uuid:") and meta["title"]
    assert docs["source_id"][1] == f"file://{crawl.path}:{meta['offset']}"
    image = result.quarantine.filter(result.quarantine["reason"] == "not_html")
    assert "image/png" in image["detail"][0] and image["raw"][0] == _png()


@pytest.mark.parametrize("where", ["block", "header"])
def test_a_warc_cut_off_mid_record_keeps_the_records_before_it(crawl, pages, tmp_path, where):
    """Cut inside the third page's response (in its payload, or just after its WARC header began):
    the pages before it are documents, the cut record is one ``truncated`` row, nothing raises."""
    k = crawl.kinds.index("page:2")
    start, end = crawl.starts[k], crawl.starts[k + 1] if k + 1 < len(crawl.starts) else crawl.size
    cut = (start + end) // 2 if where == "block" else start + (8 if crawl.path.suffix != ".gz" else 30)
    cut_file = tmp_path / crawl.path.name
    cut_file.write_bytes(crawl.path.read_bytes()[:cut])
    result = _read(cut_file)
    assert result.documents.height == 2
    reasons = result.quarantine["reason"].to_list()
    assert sorted(reasons) == ["http_status", "not_html", "truncated"]
    detail = result.quarantine.filter(result.quarantine["reason"] == "truncated")["detail"][0]
    assert "ends inside" in detail, detail
    assert result.n_records == result.documents.height + result.quarantine.height


def test_a_whole_file_gzip_warc_cut_off_keeps_what_was_inflated(pages, tmp_path):
    plain = write_crawl(tmp_path / "crawl.warc", pages, gzipped=False)
    whole = tmp_path / "whole" / "crawl.warc.gz"
    whole.parent.mkdir()
    packed = gzip.compress(plain.path.read_bytes())
    whole.write_bytes(packed)
    assert _read(whole).documents.height == len(pages)
    whole.write_bytes(packed[: len(packed) * 2 // 3])
    result = _read(whole)
    assert 1 <= result.documents.height < len(pages)
    assert result.quarantine["reason"].to_list().count("truncated") == 1
    assert result.n_records == result.documents.height + result.quarantine.height


def test_an_oversize_warc_payload_is_quarantined_with_its_head(crawl, pages):
    limit = min(len(p.html) for p in pages) - 1
    result = _read(crawl.path, max_doc_bytes=limit)
    too_large = result.quarantine.filter(result.quarantine["reason"] == "too_large")
    assert too_large.height >= 1 and result.documents.height == len(pages) - too_large.height
    assert all(len(raw) <= 65536 for raw in too_large["raw"].to_list())
    assert (too_large["raw_bytes"] > limit).all()


def test_warc_is_chosen_by_extension(tmp_path):
    from marin_assets.curation.readers import resolve_format

    assert resolve_format("auto", "crawl/CC-MAIN-0001.warc.gz") == "warc"
    assert resolve_format("auto", "x.warc") == "warc"


def test_a_file_that_is_not_a_warc_is_one_unreadable_row(tmp_path):
    bogus = tmp_path / "bogus.warc"
    bogus.write_bytes(Path(__file__).read_bytes())
    result = _read(bogus)
    assert result.documents.height == 0 and result.n_records == 1
    assert result.quarantine["reason"].to_list() == ["unreadable"]
    assert "no WARC record" in result.quarantine["detail"][0]


def test_a_response_without_an_http_head_costs_that_record_only(pages, tmp_path):
    crawl = write_crawl(tmp_path / "crawl.warc", pages[:1], gzipped=False)
    body = b"this response lost its HTTP status line"
    with open(crawl.path, "ab") as f:
        f.write(b"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: https://docs.example.org/broken\r\n"
                b"Content-Type: application/http; msgtype=response\r\nContent-Length: %d\r\n\r\n%s\r\n\r\n"
                % (len(body), body))
        writer = WARCWriter(f, gzip=False)
        writer.write_record(_response(writer, "https://docs.example.org/after", pages[1].html, "text/html"))
    result = _read(crawl.path)
    assert result.documents.height == 2  # the page before and the page after
    broken = result.quarantine.filter(result.quarantine["reason"] == "record_error")
    assert broken["raw"].to_list() == [body] and "status line" in broken["detail"][0]


def _page_url(page: Page) -> str:
    return f"https://docs.example.org/{page.path.name}"


def test_a_block_list_drops_the_listed_pages_of_a_crawl_with_their_reason(crawl, pages):
    docs = _read(crawl.path).documents
    no_rules = FilterConfig(languages=(), **{rule: None for rule in RULE_ORDER if rule != "language"})
    # One page by its exact URL as a crawler wrote it, one in another spelling of the same URL.
    listed = (f"# two pages of the crawl\n{_page_url(pages[0])}\n"
              f"HTTPS://Docs.Example.ORG:443/{pages[3].path.name}#section   # the same URL, spelt otherwise\n")
    task = FilterTask(no_rules, MinHashConfig(), url_blocklist=listed.encode())
    result = merge_chunks([filter_chunk(docs, task)], task)
    urls = [json.loads(m)["url"] for m in result.dropped["metadata"]]
    assert urls == [_page_url(pages[0]), _page_url(pages[3])]
    assert result.dropped["reason"].to_list() == [URL_BLOCKED] * 2 and result.counts == {URL_BLOCKED: 2}
    assert result.kept.height == len(pages) - 2
    # The host blocks every page of the site.
    host = FilterTask(no_rules, MinHashConfig(), url_blocklist=b"example.org\n")
    assert merge_chunks([filter_chunk(docs, host)], host).counts == {URL_BLOCKED: len(pages)}


PLANTED_PAGE = (b"<html><head><title>Contact</title></head><body><main>"
                + b"".join(b"<p>%s</p>" % p.encode() for p in NORMAL_TEXT.split("\n\n"))
                + b"<p>Write to jane.doe@example.net or to the office at Office@Example.com, or reach the server "
                  b"at 93.184.216.34 and 2606:4700:4700::1111 (the printer is at 192.168.1.20).</p>"
                  b"</main></body></html>")


@pytest.mark.slow  # materializes raw, documents and filtered of a WARC source in this process
def test_a_warc_source_builds_filtered_without_its_blocked_pages_and_its_pii(pages, tmp_path):
    from marin_assets.curation.assets import build_curation_stage
    from marin_assets.deployment import Deployment
    from marin_assets.stages import build_stage
    from marin_resources.environments import MarinSettings

    (tmp_path / "crawl").mkdir()
    crawl = write_crawl(tmp_path / "crawl" / "crawl.warc.gz", pages, gzipped=True)
    with open(crawl.path, "ab") as f:
        writer = WARCWriter(f, gzip=True)
        writer.write_record(_response(writer, "https://contact.example.com/", PLANTED_PAGE, "text/html"))
    (tmp_path / "block.txt").write_text(f"{_page_url(pages[2])}\n")
    sources = tmp_path / "sources.yaml"
    sources.write_text("sources:\n  - name: web\n    uri: crawl/*.warc.gz\n    url_blocklist: block.txt\n"
                       "    filters: {languages: [], min_words: 20}\n")
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources)})
    _, catalog = build_stage(build_curation_stage, settings, Deployment.load(settings))
    identity = catalog.specs["filtered/web"].identity(None)
    assert identity["pii"] == {"emails": True, "ip_addresses": True, "public_ips_only": True}  # on for WARC
    assert len(identity["url_blocklist_sha256"]) == 64
    manifest_path = build_filtered_shard(settings, "web")
    metrics = json.loads(manifest_path.read_text())["metrics"]
    assert metrics["dropped/url_blocked"] == 1
    kept = pl.read_parquet(manifest_path.parent / "documents.parquet")
    # The shard's counts are the sums over its kept documents as read (the real pages hold a few too),
    # and each stored text is its scrubbed original.
    (read_path,) = (tmp_path / "store" / "documents" / "web").glob("v*/*/documents.parquet")
    originals = dict(pl.read_parquet(read_path).select("id", "text").iter_rows())
    expected = {"emails": 0, "ipv4": 0, "ipv6": 0, "documents": 0}
    for doc_id, text in kept.select("id", "text").iter_rows():
        scrubbed, counts = scrub_text(originals[doc_id], PiiConfig())
        assert scrubbed == text
        expected = {kind: n + counts.get(kind, int(scrubbed != originals[doc_id])) for kind, n in expected.items()}
    assert {kind: metrics[f"pii/{kind}"] for kind in expected} == expected
    assert expected["emails"] >= 2 and expected["ipv4"] >= 1 and expected["ipv6"] >= 1
    dropped = pl.read_parquet(manifest_path.parent / "dropped.parquet")
    assert [json.loads(m)["url"] for m in dropped.filter(pl.col("reason") == URL_BLOCKED)["metadata"]] == \
        [_page_url(pages[2])]
    contact = kept.filter(pl.col("metadata").str.contains("contact.example.com"))["text"][0]
    assert ("Write to email@example.com or to the office at firstname.lastname@example.org, or reach the server at "
            "22.214.171.124 and 2001:db8::1f (the printer is at 192.168.1.20).") in contact
