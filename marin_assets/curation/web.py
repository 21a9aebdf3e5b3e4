"""Web data: HTML to text, and WARC files as a stream of records.

HTML goes through Resiliparse's main-content extraction (:func:`html_to_text`), chosen over
trafilatura by ``benchmarks/html_extract.py`` on real documentation pages (figures in
docs/curation.md, "Web data"). WARC files (plain, or gzip with one member per record or one for
the whole file) are framed by FastWARC one record at a time (:func:`iter_warc`), so a file of any
size costs the memory of one record, and a file cut off mid-record yields every record before the
cut and then says where it was cut.

:func:`page_regions` and :func:`reference_pages` serve the measurement: the text of a page's
marked-up main region and of its navigation, read from the page's own HTML5/ARIA/Sphinx markup,
and real pages found on this machine.
"""

from __future__ import annotations

import io
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# Payload types read as HTML; any other payload is quarantined as not_html.
HTML_CONTENT_TYPES = ("text/html", "application/xhtml+xml")
_HTML_SNIFF_RE = re.compile(rb"^\s*(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html|head|body)[\s>]",
                            re.IGNORECASE | re.DOTALL)


def html_to_text(html: str) -> tuple[str, dict[str, Any]]:
    """Main-content text of a page (navigation, scripts and footers removed); (text, {title})."""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse(html)
    # alt_texts off: image descriptions ("logo", "Previous topic") are page furniture, not prose.
    text = extract_plain_text(tree, main_content=True, alt_texts=False)
    title = (tree.title or "").strip()
    return text, ({"title": title} if title else {})


def looks_like_html(payload: bytes) -> bool:
    """For payloads without a Content-Type: does it start like an HTML document?"""
    return bool(_HTML_SNIFF_RE.match(payload[:4096]))


# ------------------------------------------------------------------ WARC records


@dataclass(frozen=True)
class WarcRecord:
    """A WARC ``response`` or ``resource`` record, or where a cut-off file ends."""

    offset: int  # byte offset of the record in the decompressed stream: its id within the file
    url: str = ""  # WARC-Target-URI
    warc_record_id: str = ""
    date: str = ""  # WARC-Date
    content_type: str = ""  # of the payload (HTTP Content-Type for responses), lower case, no parameters
    charset: str | None = None
    http_status: int | None = None
    payload: bytes = b""  # the HTTP body (responses) or the block (resources); the head only when oversize
    payload_size: int = 0  # the full size, also when only the head was kept
    # Set when the record cannot be used as it stands: (reason, detail). A cut-off file ends with one.
    problem: tuple[str, str] | None = None


_CHARSET_RE = re.compile(r"charset\s*=\s*[\"']?([A-Za-z0-9_.:-]+)", re.IGNORECASE)
_KEPT_TYPES = ("response", "resource")


def _content_type(value: str | None) -> tuple[str, str | None]:
    if not value:
        return "", None
    charset = _CHARSET_RE.search(value)
    return value.split(";", 1)[0].strip().lower(), charset.group(1) if charset else None


class _Gunzip:
    """A gzip stream (one member or many) decompressed exactly up to where its bytes end.

    Python's ``gzip`` raises at a cut-off member and loses what that read had already inflated;
    here every inflated byte is returned, and ``cut`` says why the stream stopped early. FastWARC
    skips record bodies by seeking forward, which is done by reading.
    """

    def __init__(self, raw: BinaryIO, chunk: int = 1 << 16):
        self.raw, self.chunk = raw, chunk
        self.inflater = zlib.decompressobj(wbits=31)
        self.pending = bytearray()
        self.position = 0
        self.in_member = False  # the current member has started and not yet ended
        self.cut: str | None = None
        self.done = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else self.position + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < self.position:
            raise io.UnsupportedOperation("a gzip stream only seeks forward from where it is")
        while self.position < target and self.read(min(target - self.position, 1 << 20)):
            pass
        return self.position

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self.pending) < size) and not self.done:
            data = self.raw.read(self.chunk)
            if not data:
                if self.in_member:
                    self.cut = "the gzip stream ends inside a member"
                self.done = True
                break
            self._inflate(data)
        n = len(self.pending) if size < 0 else min(size, len(self.pending))
        out = bytes(self.pending[:n])
        del self.pending[:n]
        self.position += n
        return out

    def _inflate(self, data: bytes) -> None:
        while data:
            self.in_member = True
            try:
                self.pending += self.inflater.decompress(data)
            except zlib.error as exc:
                self.cut, self.done = f"the gzip data is corrupt: {exc}", True
                return
            if not self.inflater.eof:
                return
            data = self.inflater.unused_data  # the next member, if any
            self.inflater = zlib.decompressobj(wbits=31)
            self.in_member = False
            if data.strip(b"\0") == b"":  # padding after the last member
                return


def iter_warc(stream: BinaryIO, gzipped: bool, max_payload_bytes: int) -> Iterator[WarcRecord]:
    """The ``response`` and ``resource`` records of a WARC stream, one at a time.

    ``request``, ``metadata``, ``warcinfo`` and the other record types describe a crawl rather
    than carry a page and are passed over. FastWARC frames the records but stops quietly where a
    file is cut off, so each record is checked here: a header without ``Content-Length``, or a
    block shorter than it, means the stream ended inside that record, and a read or parse error
    means it ended inside the next header; either way the last item is a record whose ``problem``
    is ``("truncated", why)``, after every complete record before it. A payload over
    ``max_payload_bytes`` keeps its first 64 KiB and is flagged ``too_large``.
    """
    from fastwarc.warc import ArchiveIterator, HeaderMap

    gunzip = _Gunzip(stream) if gzipped else None
    source = gunzip or stream
    # Where the last complete record starts, and a position inside it past its header (distinct from
    # every record's offset, so a row for a cut after it has an id of its own).
    last_start, last_end, seen = 0, 0, False
    try:
        for record in ArchiveIterator(source, parse_http=False, stream_detect=False, verify_digests=False):
            offset, seen = record.stream_pos, True
            headers = record.headers
            declared = headers.get("Content-Length")
            if declared is None or not declared.strip().isdigit():
                yield WarcRecord(offset, problem=("truncated", f"the record at byte {offset} has no complete "
                                                  "WARC header (no Content-Length): the file ends inside it"))
                return
            kind = (headers.get("WARC-Type") or "").strip().lower()
            length = int(declared)
            if kind not in _KEPT_TYPES:
                received = record.reader.consume()
                if received < length:
                    yield WarcRecord(offset, problem=("truncated", f"the {kind or 'untyped'} record at byte {offset}"
                                                      f" has {received} of its {length} bytes"))
                    return
                continue
            block = record.reader.read(max_payload_bytes + 65536)
            rest = record.reader.consume()
            received = len(block) + rest
            base = dict(url=headers.get("WARC-Target-URI") or "", warc_record_id=headers.get("WARC-Record-ID") or "",
                        date=headers.get("WARC-Date") or "")
            if received < length:
                yield WarcRecord(offset, **base, payload=block[:65536], payload_size=received,
                                 problem=("truncated", f"the record at byte {offset} has {received} of its "
                                          f"{length} bytes: the file ends inside it"))
                return
            last_start, last_end = offset, offset + length
            try:
                parsed = _warc_record(offset, base, kind, headers.get("Content-Type"), block, length,
                                      max_payload_bytes, HeaderMap)
            except Exception as exc:  # noqa: BLE001 -- a malformed HTTP head costs its record, not the file
                parsed = WarcRecord(offset, **base, payload=block[:65536], payload_size=received,
                                    problem=("record_error", f"{type(exc).__name__}: {exc}"))
            yield parsed
    except BaseException as exc:  # noqa: BLE001 -- FastWARC's Rust panics are BaseExceptions
        if not isinstance(exc, (OSError, EOFError, ValueError)) and type(exc).__name__ != "PanicException":
            raise
        if not seen:
            yield WarcRecord(0, problem=("unreadable", f"no WARC record could be parsed: {type(exc).__name__}: {exc}"))
        else:
            yield WarcRecord(last_end, problem=("truncated", f"the file ends (or is corrupt) inside the record header "
                                                 f"after the record at byte {last_start}: {type(exc).__name__}: {exc}"))
        return
    if gunzip is not None and gunzip.cut:
        yield WarcRecord(last_end, problem=("truncated", f"{gunzip.cut}, after the last whole record "
                                             f"(at byte {last_start})"))


def _warc_record(offset: int, base: dict[str, str], kind: str, warc_content_type: str | None, block: bytes,
                 length: int, max_payload_bytes: int, header_map) -> WarcRecord:
    """Split a complete block into HTTP status, headers and the (decoded) body."""
    status: int | None = None
    content_type, charset = _content_type(warc_content_type)
    payload = block
    if kind == "response" and content_type.startswith("application/http"):
        http = header_map()
        head_len = http.parse(io.BytesIO(block))
        status = http.status_code
        if status is None:
            return WarcRecord(offset, **base, payload=block[:65536], payload_size=length,
                              problem=("record_error", "the HTTP response has no status line"))
        content_type, charset = _content_type(http.get("Content-Type"))
        payload = block[head_len:]
        size = length - head_len
        if size > max_payload_bytes:
            return WarcRecord(offset, **base, content_type=content_type, charset=charset, http_status=status,
                              payload=payload[:65536], payload_size=size,
                              problem=("too_large", f"{size} bytes > max_doc_bytes {max_payload_bytes}"))
        payload, problem = _decode_http_body(payload, http)
        if problem is not None:
            return WarcRecord(offset, **base, content_type=content_type, charset=charset, http_status=status,
                              payload=payload[:65536], payload_size=size, problem=problem)
    elif length > max_payload_bytes:
        return WarcRecord(offset, **base, content_type=content_type, charset=charset, payload=payload[:65536],
                          payload_size=length, problem=("too_large", f"{length} bytes > max_doc_bytes "
                                                        f"{max_payload_bytes}"))
    return WarcRecord(offset, **base, content_type=content_type, charset=charset, http_status=status,
                      payload=payload, payload_size=len(payload))


def _decode_http_body(body: bytes, http) -> tuple[bytes, tuple[str, str] | None]:
    """Undo chunked transfer coding and gzip/deflate content coding, as a browser would."""
    transfer = (http.get("Transfer-Encoding") or "").strip().lower()
    if transfer == "chunked":
        try:
            body = _dechunk(body)
        except ValueError as exc:
            return body, ("record_error", f"bad chunked transfer coding: {exc}")
    coding = (http.get("Content-Encoding") or "").strip().lower()
    if coding in ("", "identity"):
        return body, None
    if coding in ("gzip", "x-gzip", "deflate"):
        try:
            return zlib.decompress(body, wbits=47 if coding != "deflate" else 15), None
        except zlib.error:
            try:
                return zlib.decompress(body, wbits=-15), None  # raw deflate, as some servers send
            except zlib.error as exc:
                return body, ("record_error", f"Content-Encoding {coding}: {exc}")
    return body, ("record_error", f"unsupported Content-Encoding {coding!r}")


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        line_end = body.find(b"\r\n", pos)
        if line_end < 0:
            raise ValueError(f"no chunk size line at byte {pos}")
        size = int(body[pos:line_end].split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return bytes(out)
        start = line_end + 2
        if start + size > len(body):
            raise ValueError(f"chunk of {size} bytes at byte {start} runs past the body")
        out += body[start:start + size]
        pos = start + size + 2


# -------------------------------------------------------- measuring extraction


@dataclass(frozen=True)
class PageRegions:
    """What a page's own markup says is its content and its furniture."""

    main: str  # text of the main region (<main>, role=main, Sphinx's div.body, ...), navigation removed
    navigation: tuple[str, ...]  # lines of navigation regions (2+ words) that do not occur in the main text


_MAIN_XPATHS = ("//main", "//*[@role='main']", "//div[@id='apicontent']", "//div[@class='body']", "//article")
_NAV_XPATH = ("//nav | //*[@role='navigation'] | //header | //footer | //div[@class='footer']"
              " | //div[contains(concat(' ', normalize-space(@class), ' '), ' sphinxsidebar ')]"
              " | //div[@id='column2']")
_SPACE_RE = re.compile(r"\s+")


def _squash(text: str) -> str:
    return _SPACE_RE.sub(" ", text).strip()


def page_regions(html: str | bytes) -> PageRegions | None:
    """The main and navigation text of a page from its markup; None when it marks up neither."""
    import lxml.html

    try:
        root = lxml.html.fromstring(html)
    except (ValueError, lxml.etree.ParserError):
        return None
    for bad in root.xpath("//script | //style | //noscript | //template"):
        bad.drop_tree()
    main = next((found[0] for xpath in _MAIN_XPATHS if (found := root.xpath(xpath))), None)
    if main is None:
        return None
    nav_set = set(root.xpath(_NAV_XPATH))
    nav_elements = [el for el in nav_set if not any(a in nav_set for a in el.iterancestors())]
    nav_lines: list[str] = []
    for el in nav_elements:
        for piece in el.itertext():
            line = _squash(piece)
            if len(line.split()) >= 2:
                nav_lines.append(line)
    for el in [el for el in main.iter() if el in nav_set]:
        el.drop_tree()
    main_text = _squash(" ".join(main.itertext()))
    navigation = tuple(dict.fromkeys(line for line in nav_lines if line not in main_text))
    return PageRegions(main_text, navigation)


def reference_pages(limit: int | None = None) -> list[Path]:
    """Real HTML pages on this machine, in a stable order: Debian's Python documentation when
    installed (``python3.11-doc``), then other HTML documentation under /usr/share/doc, then HTML
    files shipped inside installed Python packages (which every environment has)."""
    roots = [Path("/usr/share/doc/python3.11/html"), Path("/usr/share/doc")]
    roots += sorted({Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()})
    found: dict[Path, None] = {}
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.htm*")):
            if path.suffix.lower() in (".html", ".htm") and path.is_file():
                found.setdefault(path.resolve(), None)
                if limit is not None and len(found) >= limit:
                    return list(found)
    return list(found)
