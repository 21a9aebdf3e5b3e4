"""Read a shard's files into normalised documents plus a quarantine.

Every input record (a file for text/html, a non-blank line for jsonl and chat, a row
for parquet and chat in Parquet files, a response or resource record for warc) ends up
either as one document or as one quarantine row; a bad record never fails the shard,
whatever exception processing it raises.
``ReadResult.n_records`` counts records as they are *read* (plus one per file
that failed part-way, standing for its unread rest), independently of what
became of them, so ``documents.height + quarantine.height == n_records`` is a
real check that nothing was dropped.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from marin_assets.curation import chat, listed_files
from marin_assets.curation.config import SourceConfig
from marin_assets.curation.discovery import Shard
from marin_assets.curation.formats import FORMATS, record_layout, resolve_format
from marin_assets.curation.listed_files import FileRef, refusal_parts
from marin_assets.curation.opening import open_binary, prefetch_tar_members
from marin_assets.curation.web import HTML_CONTENT_TYPES, html_to_text, iter_warc, looks_like_html
from marin_resources.progress import ProgressMeter


class Reason:
    """Quarantine reasons."""

    MALFORMED_JSON = "malformed_json"
    MISSING_TEXT_FIELD = "missing_text_field"
    INVALID_ENCODING = "invalid_encoding"
    BINARY = "binary"
    EMPTY = "empty"
    TOO_LARGE = "too_large"
    UNREADABLE = "unreadable"  # the file itself could not be opened or parsed
    RECORD_ERROR = "record_error"  # processing one record raised; the rest of its file is read on
    # Files listed but never read (FileRef.refused): see listed_files.REFUSAL_REASONS.
    OUTSIDE_ROOT = listed_files.OUTSIDE_ROOT  # a symlink resolving outside the source root; its target is not read
    BROKEN_LINK = listed_files.BROKEN_LINK  # a symlink to nothing
    NOT_A_REGULAR_FILE = listed_files.NOT_A_REGULAR_FILE  # a FIFO, socket or device
    CHANGED_DURING_READ = listed_files.CHANGED_DURING_READ  # never the same twice while it was copied
    TRUNCATED = "truncated"  # a WARC file ends inside this record; the records before it are read
    NOT_HTML = "not_html"  # a WARC payload that is not an HTML page (an image, a PDF, ...)
    HTTP_STATUS = "http_status"  # a WARC response that is not a success (404, a redirect, ...)
    # Chat records (format chat) that are not a conversation: see chat.CHAT_REASONS.
    MISSING_MESSAGES = chat.MISSING_MESSAGES
    MALFORMED_MESSAGE = chat.MALFORMED_MESSAGE
    UNKNOWN_ROLE = chat.UNKNOWN_ROLE
    NON_STRING_CONTENT = chat.NON_STRING_CONTENT
    NO_ASSISTANT_TURN = chat.NO_ASSISTANT_TURN


QUARANTINE_REASONS = (
    Reason.MALFORMED_JSON,
    Reason.MISSING_TEXT_FIELD,
    Reason.INVALID_ENCODING,
    Reason.BINARY,
    Reason.EMPTY,
    Reason.TOO_LARGE,
    Reason.UNREADABLE,
    Reason.RECORD_ERROR,
    Reason.OUTSIDE_ROOT,
    Reason.BROKEN_LINK,
    Reason.NOT_A_REGULAR_FILE,
    Reason.CHANGED_DURING_READ,
    Reason.TRUNCATED,
    Reason.NOT_HTML,
    Reason.HTTP_STATUS,
)


def quarantine_reasons(fmt: str) -> tuple[str, ...]:
    """The reasons a source of format ``fmt`` counts, each counted even when zero: a chat source's
    own reasons too (a text source's counts stay the ones they were before chat data)."""
    return QUARANTINE_REASONS + chat.CHAT_REASONS if fmt == "chat" else QUARANTINE_REASONS


DOCUMENT_SCHEMA = {
    "id": pl.String,
    "text": pl.String,
    "source": pl.String,
    "source_id": pl.String,
    "metadata": pl.String,
}
# A chat source's documents: the text rendering of each conversation and, beside it, its turns as JSON.
CHAT_DOCUMENT_SCHEMA = {**DOCUMENT_SCHEMA, chat.MESSAGES_COLUMN: pl.String}
QUARANTINE_SCHEMA = {
    "source": pl.String,
    "source_id": pl.String,
    "reason": pl.String,
    "detail": pl.String,
    "raw_bytes": pl.Int64,  # size of the offending record
    "preview": pl.String,  # first characters, for humans
    "raw": pl.Binary,  # the record itself (first bytes only for oversize files)
}
_PREVIEW_CHARS = 200
_OVERSIZE_PAYLOAD_BYTES = 64 * 1024
# Characters that do not occur in real text: C0/C1 controls (except common
# whitespace), DEL, U+FFFD replacement marks and private-use code points.
_GARBAGE_RE = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufffd\ue000-\uf8ff]")
_MAX_GARBAGE_FRACTION = 0.02


@dataclass
class ReadResult:
    documents: pl.DataFrame  # DOCUMENT_SCHEMA
    quarantine: pl.DataFrame  # QUARANTINE_SCHEMA
    n_records: int
    # reason -> count, every reason present (zero when unused).
    quarantine_counts: dict[str, int] = field(default_factory=dict)
    # Documents whose bytes were not valid UTF-8 but were repaired.
    n_repaired_encoding: int = 0
    # Files listed but never read (FileRef.refused), each one record and one quarantine row.
    n_refused_files: int = 0


# ---------------------------------------------------------------- text helpers


@dataclass(frozen=True)
class Decoded:
    text: str | None  # None when the bytes are not text
    encoding: str | None
    reason: str | None = None
    detail: str = ""


# The ASCII characters of _GARBAGE_RE, as bytes: for ASCII text, deleting them with
# ``bytes.translate`` counts them in one C pass instead of a regex match per character.
_ASCII_GARBAGE = bytes(b for b in range(128) if _GARBAGE_RE.match(chr(b)))


def garbage_fraction(text: str) -> float:
    if not text:
        return 0.0
    if text.isascii():
        data = text.encode("ascii")
    else:
        data = text.encode("utf-8", "surrogatepass")
        # The non-ASCII garbage (U+0080..U+009F, U+E000..U+F8FF, U+FFFD) starts with one of these
        # bytes in UTF-8; without them only ASCII bytes can be garbage.
        if b"\xc2" in data or b"\xee" in data or b"\xef" in data:
            return len(_GARBAGE_RE.findall(text)) / len(text)
    return (len(data) - len(data.translate(None, _ASCII_GARBAGE))) / len(text)


def normalize_text(text: str) -> str:
    """Unify newlines, drop a BOM, NFC-normalise and trim trailing whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return unicodedata.normalize("NFC", text).strip()


def repair_text(text: str, force: bool = False) -> str:
    """Fix mojibake and legacy-encoding artefacts with ftfy.

    ftfy runs at a few MB/s, so clean text skips it: pure ASCII cannot hold
    mojibake, and ftfy's own badness heuristic screens the rest. Curly quotes
    are left alone (they are content, and uncurling them can break JSON).
    """
    import ftfy

    if force or (not text.isascii() and looks_like_mojibake(text)):
        return ftfy.fix_text(text, ftfy.TextFixerConfig(uncurl_quotes=False))
    return text


_NON_ASCII_RUN_RE = re.compile(r"[^\x00-\x7f]+")


@functools.lru_cache(maxsize=1)
def _badness_pattern() -> tuple[re.Pattern, int | None]:
    """ftfy's mojibake pattern and the longest text one match can span (None if unbounded)."""
    from ftfy.badness import BADNESS_RE

    widest = re._parser.parse(BADNESS_RE.pattern, BADNESS_RE.flags).getwidth()[1]  # type: ignore[attr-defined]
    return BADNESS_RE, (widest if widest < re._constants.MAXREPEAT else None)  # type: ignore[attr-defined]


def looks_like_mojibake(text: str) -> bool:
    """``ftfy.is_bad(text)``, searching only around non-ASCII characters.

    Every alternative of ftfy's pattern needs a non-ASCII character (so pure ASCII is
    never bad) and a match spans at most a few characters, so a match lies within that
    many characters of a non-ASCII run. Searching those windows alone gives the same
    answer without scanning the ASCII bulk of a mostly-English document, where
    ``is_bad`` spent most of the reader's time. ``^`` still means the start of the
    text: ``Pattern.search(text, pos, endpos)`` does not move it.
    """
    pattern, widest = _badness_pattern()
    if widest is None:
        return bool(pattern.search(text))
    low = high = -1
    for run in _NON_ASCII_RUN_RE.finditer(text):
        start, end = max(0, run.start() - widest), min(len(text), run.end() + widest)
        if start > high:
            if high >= 0 and pattern.search(text, low, high):
                return True
            low = start
        high = end
    return high >= 0 and bool(pattern.search(text, low, high))


def decode_bytes(raw: bytes, repair: bool = True) -> Decoded:
    """Decode bytes as text, repairing legacy encodings and mojibake.

    UTF-8 first; otherwise Windows-1252, then Latin-1 (which accepts any byte),
    followed by ftfy when ``repair``. Only NUL bytes or a residue of control
    characters mark the record as binary / undecodable.
    """
    nul = raw.find(b"\x00")
    if nul >= 0:
        return Decoded(None, None, Reason.BINARY, f"NUL byte at offset {nul}")
    try:
        text, encoding = raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError as exc:
        first_error = f"not UTF-8 ({exc.reason} at byte {exc.start})"
        try:
            text, encoding = raw.decode("cp1252"), "cp1252"
        except UnicodeDecodeError:
            text, encoding = raw.decode("latin-1"), "latin-1"
    else:
        first_error = ""
    if repair:
        text = repair_text(text, force=encoding != "utf-8")
    fraction = garbage_fraction(text)
    if fraction > _MAX_GARBAGE_FRACTION:
        if encoding == "utf-8":
            return Decoded(None, encoding, Reason.BINARY, f"{fraction:.1%} control characters")
        return Decoded(
            None, encoding, Reason.INVALID_ENCODING,
            f"{first_error}; {fraction:.1%} control characters after {encoding} fallback",
        )  # fmt: skip
    return Decoded(text, encoding, None, first_error)


# Gutenberg boilerplate. Marker lines vary across decades of releases:
#   *** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***
#   ***START OF THE PROJECT GUTENBERG EBOOK ...
#   *END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*
#   *** END OF THIS PROJECT GUTENBERG EBOOK ... ***
#   End of the Project Gutenberg EBook of ...  /  End of Project Gutenberg's ...
_GUTENBERG_START_RE = re.compile(
    r"^[ \t]*(?:\*{1,3}[ \t]*START[ \t]+OF[ \t]+(?:THE|THIS)[ \t]+PROJECT[ \t]+GUTENBERG.*"
    r"|\*END\*THE SMALL PRINT!.*"
    r"|\*{3}[ \t]*START\*\*THE SMALL PRINT.*\*END\*.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END_RE = re.compile(
    r"^[ \t]*(?:\*{1,3}[ \t]*END[ \t]+OF[ \t]+(?:THE|THIS)[ \t]+PROJECT[ \t]+GUTENBERG.*"
    r"|END[ \t]+OF[ \t]+(?:THE[ \t]+|THIS[ \t]+)?PROJECT[ \t]+GUTENBERG.*"
    r"|\*{3}[ \t]*END[ \t]+OF[ \t]+THE[ \t]+PROJECT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
# 1990s World Library releases repeat a <<THIS ELECTRONIC VERSION ...>> notice
# between scenes.
_GUTENBERG_INLINE_NOTICE_RE = re.compile(
    r"<<THIS ELECTRONIC VERSION OF .*?>>\s*", re.IGNORECASE | re.DOTALL
)
_PRODUCER_LINE_RE = re.compile(
    r"^(?:Produced by|This e-?text was (?:produced|prepared) by|E-?text prepared by|Transcribed by)\b",
    re.IGNORECASE,
)


# Every match of the marker patterns contains one of these (lower-cased; no character but the
# ASCII capital matches these letters under re.IGNORECASE), and every inline notice "<<":
# "gutenberg", "**the", "*end*the", or both "***" and "project" (the third end marker).


def _may_hold_gutenberg_markup(text: str) -> bool:
    """False only where :func:`strip_gutenberg`'s patterns cannot match: a few substring searches
    instead of three regex scans, which cost a third of reading a shard of non-Gutenberg text."""
    if "<<" in text:
        return True
    lowered = text.lower()
    return ("gutenberg" in lowered or "**the" in lowered or "*end*the" in lowered
            or ("***" in text and "project" in lowered))


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Remove Project Gutenberg header, footer and licence; (text, changed).

    The header is cut at the last start marker in the first half of the text
    and the footer at the first end marker in the second half, so a marker-like
    line quoted inside the body does not truncate the work. Producer credits
    directly after the header are dropped as well.
    """
    if not _may_hold_gutenberg_markup(text):
        text = text.strip()
        return text, False
    original = text
    half = len(text) // 2
    starts = [m for m in _GUTENBERG_START_RE.finditer(text) if m.start() < half]
    if starts:
        text = text[starts[-1].end() :]
        lines = text.lstrip("\n").split("\n")
        # Credits paragraph(s) right after the marker.
        while lines and (_PRODUCER_LINE_RE.match(lines[0].strip()) or not lines[0].strip()):
            if _PRODUCER_LINE_RE.match(lines[0].strip()):
                while lines and lines[0].strip():
                    lines.pop(0)
            else:
                lines.pop(0)
        text = "\n".join(lines)
    ends = [m for m in _GUTENBERG_END_RE.finditer(text) if m.start() >= len(text) // 2]
    if ends:
        text = text[: ends[0].start()]
    text = _GUTENBERG_INLINE_NOTICE_RE.sub("", text)
    text = text.strip()
    return text, text != original.strip()


# ------------------------------------------------------------------- reading


class _Collector:
    def __init__(self, source: SourceConfig):
        self.source = source
        self.schema = CHAT_DOCUMENT_SCHEMA if source.format == "chat" else DOCUMENT_SCHEMA
        self.docs: dict[str, list] = {k: [] for k in self.schema}
        self.bad: dict[str, list] = {k: [] for k in QUARANTINE_SCHEMA}
        self.n_records = 0
        self.n_repaired = 0
        self.n_refused_files = 0
        self.prefetched: dict[str, bytes] = {}

    def open(self, ref: FileRef, decompress: bool = True):
        return open_binary(ref.uri, self.source.sha256, self.prefetched, decompress=decompress)

    def quarantine(self, source_id: str, reason: str, detail: str, raw: bytes, raw_size: int | None = None):
        self.bad["source"].append(self.source.name)
        self.bad["source_id"].append(source_id)
        self.bad["reason"].append(reason)
        self.bad["detail"].append(detail)
        self.bad["raw_bytes"].append(len(raw) if raw_size is None else raw_size)
        self.bad["preview"].append(raw[: _PREVIEW_CHARS * 4].decode("utf-8", "replace")[:_PREVIEW_CHARS])
        self.bad["raw"].append(raw)

    def document(self, source_id: str, text: str, raw: bytes, metadata: dict[str, Any]):
        """Normalise, strip, and either keep ``text`` or quarantine it as empty."""
        text = normalize_text(text)
        if self.source.strip_gutenberg:
            text, stripped = strip_gutenberg(text)
            if stripped:
                metadata["gutenberg_stripped"] = True
        if not text:
            self.quarantine(source_id, Reason.EMPTY, "no text after normalisation", raw)
            return
        self._append(source_id, text, metadata)

    def conversation(self, source_id: str, turns: list[dict[str, Any]], metadata: dict[str, Any]):
        """A checked conversation (`chat.check_conversation`) as a document: its text is rendered from
        its turns as they are, with no further normalisation, so it always matches them."""
        self._append(source_id, chat.render_text(turns), metadata, messages=chat.messages_json(turns))

    def _append(self, source_id: str, text: str, metadata: dict[str, Any], **extra: str):
        # Everything that can raise happens before the first append, so columns never go out of step.
        row = {"id": hashlib.sha256(text.encode("utf-8")).hexdigest(), "text": text, "source": self.source.name,
               "source_id": source_id, "metadata": json.dumps(metadata, sort_keys=True, default=str), **extra}
        for column, values in self.docs.items():
            values.append(row[column])

    @contextlib.contextmanager
    def record(self, source_id: str, raw: bytes):
        """Count one record as read; if processing it raises, quarantine it alone and carry on."""
        self.n_records += 1
        try:
            yield
        except RecursionError:
            self.quarantine(source_id, Reason.MALFORMED_JSON, "nested too deeply to parse", raw)
        except Exception as exc:  # noqa: BLE001 -- one bad record must not end its file
            self.quarantine(source_id, Reason.RECORD_ERROR, f"{type(exc).__name__}: {exc}", raw)

    def decoded_document(self, source_id: str, raw: bytes, metadata: dict[str, Any], fmt: str,
                         charset: str | None = None):
        """``raw`` as a document, decoded as its declared ``charset`` when that works, else as
        :func:`decode_bytes` guesses."""
        if len(raw) > self.source.max_doc_bytes:
            # Its head, as every other too-large record: a quarantine row stays bounded.
            limit = self.source.max_doc_bytes
            self.quarantine(source_id, Reason.TOO_LARGE, f"{len(raw)} bytes > max_doc_bytes {limit}; "
                            f"payload truncated to {_OVERSIZE_PAYLOAD_BYTES} bytes", raw[:_OVERSIZE_PAYLOAD_BYTES],
                            raw_size=len(raw))
            return
        decoded = _decode_declared(raw, charset) or decode_bytes(raw)
        if decoded.text is None:
            self.quarantine(source_id, decoded.reason or Reason.BINARY, decoded.detail, raw)
            return
        if decoded.encoding != "utf-8":
            metadata["repaired_encoding"] = decoded.encoding
            self.n_repaired += 1
        text = decoded.text
        if fmt == "html":
            text, html_meta = html_to_text(text)
            metadata.update(html_meta)
        self.document(source_id, text, raw, metadata)

    def result(self) -> ReadResult:
        documents = pl.DataFrame(self.docs, schema=self.schema)
        quarantine = pl.DataFrame(self.bad, schema=QUARANTINE_SCHEMA)
        counts = {r: 0 for r in quarantine_reasons(self.source.format)}
        for reason in self.bad["reason"]:
            counts[reason] += 1
        return ReadResult(documents, quarantine, self.n_records, counts, self.n_repaired, self.n_refused_files)


def _read_whole_file(col: _Collector, ref: FileRef, fmt: str):
    """text / html: the whole file is one record, counted once its bytes are read (a read error is
    the file-level ``unreadable`` record of :func:`read_shard`)."""
    limit = col.source.max_doc_bytes
    with col.open(ref) as f:
        raw = f.read(limit + 1)
        if len(raw) > limit:
            # Keep memory bounded: store the head, record the full size.
            rest = 0
            while chunk := f.read(1 << 20):
                rest += len(chunk)
            size = len(raw) + rest
            col.n_records += 1
            col.quarantine(
                ref.uri, Reason.TOO_LARGE,
                f"{size} bytes > max_doc_bytes {limit}; payload truncated to {_OVERSIZE_PAYLOAD_BYTES} bytes, "
                "the file itself is unchanged at source_id",
                raw[:_OVERSIZE_PAYLOAD_BYTES], raw_size=size,
            )  # fmt: skip
            return
    with col.record(ref.uri, raw):
        col.decoded_document(ref.uri, raw, {"path": ref.relpath}, fmt)


def _decode_declared(raw: bytes, charset: str | None) -> Decoded | None:
    """``raw`` decoded strictly as the charset its HTTP headers declare; None if absent, unknown or wrong."""
    if not charset:
        return None
    try:
        encoding = codecs.lookup(charset).name
        text = raw.decode(encoding)
    except (LookupError, UnicodeDecodeError):
        return None
    if "\x00" in text or garbage_fraction(text) > _MAX_GARBAGE_FRACTION:
        return None
    return Decoded(text, encoding)


def _read_warc(col: _Collector, ref: FileRef):
    """warc: each response or resource record is one record (crawl bookkeeping records are not);
    a file cut off mid-record ends in one ``truncated`` record after the complete ones."""
    from fsspec.utils import infer_compression

    gzipped = infer_compression(ref.relpath) == "gzip"
    with col.open(ref, decompress=not gzipped) as f:
        for rec in iter_warc(f, gzipped, col.source.max_doc_bytes):
            source_id = f"{ref.uri}:{rec.offset}"
            if rec.problem is not None:
                col.n_records += 1
                col.quarantine(source_id, rec.problem[0], rec.problem[1], rec.payload, raw_size=rec.payload_size)
                continue
            with col.record(source_id, rec.payload):
                _warc_document(col, ref, source_id, rec)


def _warc_document(col: _Collector, ref: FileRef, source_id: str, rec) -> None:
    if rec.http_status is not None and not 200 <= rec.http_status < 300:
        col.quarantine(source_id, Reason.HTTP_STATUS, f"HTTP {rec.http_status} for {rec.url}", rec.payload)
        return
    is_html = rec.content_type in HTML_CONTENT_TYPES or (not rec.content_type and looks_like_html(rec.payload))
    if not is_html:
        col.quarantine(source_id, Reason.NOT_HTML, f"payload is {rec.content_type or 'untyped and not HTML'} "
                       f"({rec.url})", rec.payload)
        return
    metadata = {"path": ref.relpath, "offset": rec.offset, "url": rec.url, "warc_record_id": rec.warc_record_id,
                "warc_date": rec.date}
    col.decoded_document(source_id, rec.payload, metadata, "html", charset=rec.charset)


def _record_metadata(record: dict[str, Any], text_field: str, id_field: str | None) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in (text_field, id_field)}


def _record_source_id(col: _Collector, record: Any, default_id: str, raw: bytes) -> str | None:
    """The source id of a JSONL or Parquet record (its `id_field`, else ``default_id``); None, with
    the record quarantined, where it is not a JSON object."""
    if not isinstance(record, dict):
        col.quarantine(default_id, Reason.MALFORMED_JSON, f"record is a {type(record).__name__}, not an object", raw)
        return None
    id_field = col.source.id_field
    return str(record[id_field]) if id_field is not None and record.get(id_field) is not None else default_id


def _quarantined_unfit(col: _Collector, source_id: str, text: str, raw: bytes, what: str) -> bool:
    """Whether ``text`` (a record's text, or a conversation's rendering) was quarantined: over
    `max_doc_bytes`, or more control characters than text holds."""
    limit = col.source.max_doc_bytes
    if len(text.encode("utf-8", "surrogatepass")) > limit:
        col.quarantine(source_id, Reason.TOO_LARGE, f"{what} exceeds max_doc_bytes {limit}", raw)
        return True
    fraction = garbage_fraction(text)
    if fraction > _MAX_GARBAGE_FRACTION:
        col.quarantine(source_id, Reason.BINARY, f"{fraction:.1%} control characters in {what}", raw)
        return True
    return False


def _record_document(col: _Collector, record: Any, default_id: str, raw: bytes, extra: dict[str, Any]):
    src = col.source
    source_id = _record_source_id(col, record, default_id, raw)
    if source_id is None:
        return
    text = record.get(src.text_field)
    if not isinstance(text, str):
        got = "missing" if text is None else f"a {type(text).__name__}"
        col.quarantine(source_id, Reason.MISSING_TEXT_FIELD, f"field {src.text_field!r} is {got}", raw)
        return
    if _quarantined_unfit(col, source_id, text, raw, "text"):
        return
    metadata = {**extra, **_record_metadata(record, src.text_field, src.id_field)}
    col.document(source_id, repair_text(text, force="repaired_encoding" in extra), raw, metadata)


def _bounded_lines(f, keep: int) -> Iterator[tuple[bytes, int]]:
    """Each line of ``f`` without its newline as (first ``keep`` bytes, full size), so a line of any
    length (a gzip bomb without newlines) costs at most ``keep`` bytes of memory."""
    head, size = bytearray(), 0
    # Small reads: a stream that breaks (truncated gzip) loses only the chunk it breaks in.
    while chunk := f.read(64 * 1024):
        start = 0
        while True:
            newline = chunk.find(b"\n", start)
            piece = chunk[start:] if newline < 0 else chunk[start:newline]
            size += len(piece)
            if len(head) < keep:
                head += piece[: keep - len(head)]
            if newline < 0:
                break
            yield bytes(head), size
            head, size, start = bytearray(), 0, newline + 1
    if size:
        yield bytes(head), size


def _read_jsonl(col: _Collector, ref: FileRef):
    limit = col.source.max_doc_bytes
    with col.open(ref) as f:
        for line_no, (head, size) in enumerate(_bounded_lines(f, limit + 2), start=1):
            raw = head.rstrip(b"\r")
            if not raw.strip():
                continue  # blank lines are separators, not records
            default_id = f"{ref.uri}:{line_no}"
            if len(raw) > limit or size > len(head):
                col.n_records += 1
                col.quarantine(default_id, Reason.TOO_LARGE, f"{size} bytes > max_doc_bytes {limit}; payload "
                               f"truncated to {_OVERSIZE_PAYLOAD_BYTES} bytes", raw[:_OVERSIZE_PAYLOAD_BYTES],
                               raw_size=size)
                continue
            with col.record(default_id, raw):
                _jsonl_record(col, ref, raw, line_no, default_id)


def _jsonl_record(col: _Collector, ref: FileRef, raw: bytes, line_no: int, default_id: str):
    # JSON syntax must survive decoding, so ftfy runs on the text field later.
    decoded = decode_bytes(raw, repair=False)
    if decoded.text is None:
        col.quarantine(default_id, decoded.reason or Reason.BINARY, decoded.detail, raw)
        return
    try:
        record = json.loads(decoded.text)
    except json.JSONDecodeError as exc:
        col.quarantine(default_id, Reason.MALFORMED_JSON, f"{exc.msg} at column {exc.colno}", raw)
        return
    extra: dict[str, Any] = {"path": ref.relpath, "line": line_no}
    if decoded.encoding != "utf-8":
        extra["repaired_encoding"] = decoded.encoding
        col.n_repaired += 1
    if col.source.format == "chat":
        _chat_document(col, record, default_id, raw, extra)
    else:
        _record_document(col, record, default_id, raw, extra)


def _chat_document(col: _Collector, record: Any, default_id: str, raw: bytes, extra: dict[str, Any]):
    """A chat line: a conversation (`chat.check_conversation`), each turn's content repaired and
    normalised as a text record's text is, or one quarantine row saying why it is not one."""
    source_id = _record_source_id(col, record, default_id, raw)
    if source_id is None:
        return
    force = "repaired_encoding" in extra
    turns = chat.check_conversation(record, lambda content: normalize_text(repair_text(content, force=force)))
    if isinstance(turns, chat.Refused):
        col.quarantine(source_id, turns.reason, turns.detail, raw)
        return
    # A JSONL line is held to max_doc_bytes by its length already; a Parquet row is by its turns here.
    if _quarantined_unfit(col, source_id, chat.render_text(turns), raw, "its turns"):
        return
    metadata = _record_metadata(record, chat.MESSAGES_FIELD, col.source.id_field)
    col.conversation(source_id, turns, {**extra, **metadata})


def _read_parquet(col: _Collector, ref: FileRef):
    import pyarrow.parquet as pq

    to_document = _chat_document if col.source.format == "chat" else _record_document
    with col.open(ref) as f:
        parquet = pq.ParquetFile(f)
        row = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                default_id = f"{ref.uri}:{row}"
                raw = json.dumps(record, default=str, ensure_ascii=False).encode("utf-8")
                with col.record(default_id, raw):
                    to_document(col, record, default_id, raw, {"path": ref.relpath, "row": row})
                row += 1


def with_original_source_ids(frame: pl.DataFrame, originals: dict[str, str]) -> pl.DataFrame:
    """``frame`` with ``source_id`` naming the original files instead of the copies the reader saw.

    ``originals`` maps a copy's URI to its original location. The readers' source ids are a
    file's URI, or its URI followed by ``:<line>`` / ``:<row>``, or a record's own id (which is
    left alone). One vectorised lookup for the whole frame: a replacement per file would cost
    files x records, and would also rewrite ``a.jsonl.gz:3`` through the copy ``a.jsonl``.
    """
    if frame.height == 0 or not originals:
        return frame
    source_id = pl.col("source_id")
    copy = pl.when(source_id.is_in(list(originals))).then(source_id).otherwise(
        source_id.str.replace(r":[0-9]+$", "")
    )
    original = copy.replace_strict(originals, default=None, return_dtype=pl.String)
    return frame.with_columns(
        pl.when(original.is_not_null())
        .then(original + source_id.str.slice(copy.str.len_chars()))
        .otherwise(source_id)
        .alias("source_id")
    )


# One reader per concrete format of `formats.FORMATS` (all but ``auto``, which `resolve_format` resolves
# per file): a format added there without a reader here fails at import, not on the first such file.
READERS: dict[str, Callable[[_Collector, FileRef], None]] = {
    "text": functools.partial(_read_whole_file, fmt="text"),
    "html": functools.partial(_read_whole_file, fmt="html"),
    "jsonl": _read_jsonl,
    # Each JSONL line or Parquet row a conversation (_chat_document).
    "chat": lambda col, ref: READERS[record_layout("chat", ref.relpath)](col, ref),
    "parquet": _read_parquet,
    "warc": _read_warc,
}
if set(READERS) != set(FORMATS) - {"auto"}:
    raise ImportError(f"readers: formats {sorted(set(FORMATS) - {'auto'} - set(READERS))} have no reader")


def read_shard(source: SourceConfig, shard: Shard, progress: ProgressMeter | None = None) -> ReadResult:
    """Read every file of ``shard`` into documents and quarantined records; ``progress`` counts
    each file's documents and bytes as it is read.

    A file that cannot be opened or parsed at all (corrupt archive, truncated
    parquet footer) becomes one ``unreadable`` quarantine row together with
    whatever records were read from it before the error.
    """
    col = _Collector(source)
    try:
        col.prefetched = prefetch_tar_members([ref.uri for ref in shard.files if ref.refused is None], source.sha256)
    except Exception:  # noqa: BLE001 -- fall back to per-member reads, which report per file
        col.prefetched = {}
    for ref in shard.files:
        if ref.refused is not None:
            col.n_records += 1
            col.n_refused_files += 1
            col.quarantine(ref.uri, *refusal_parts(ref.refused), b"", raw_size=0)
            continue
        try:
            READERS[resolve_format(source.format, ref.relpath)](col, ref)
        except Exception as exc:  # noqa: BLE001 -- one bad file must not fail the shard
            col.n_records += 1  # the unread rest of the file, reported as one record
            col.quarantine(ref.uri, Reason.UNREADABLE, f"{type(exc).__name__}: {exc}", b"", raw_size=ref.size or 0)
        if progress is not None:
            progress.add(documents=len(col.docs["id"]) - progress.documents, nbytes=ref.size or 0)
    return col.result()
