"""Every kind of bad input, mixed with good files, through `marin materialize` as a user runs it.

One store is built per module (fresh DAGSTER_HOME, MARIN_PREFIX, MARIN_SOURCES, MARIN_CACHE_DIR)
and every test reads its outcome:

* ``corpus``: the 14 bad-input kinds of issue #17 among good files, in one shard with enough good
  records that every ERROR check passes; every good document must reach ``deduplicated`` and every
  bad record must be quarantined with its reason.
* ``names``: ``a.txt``, ``report..final.txt``, ``z.txt``, one shard each (issue #17, defect 3).
* ``odd``: files that are not files (issue #30): a FIFO, a socket and a dangling link beside good
  JSONL in one shard, a FIFO alone in a shard and a binary file alone in another: listed as
  quarantined, never opened, the empty shards valid, and none of them keeps the good documents
  from ``deduplicated``.
* ``mostlybad``: a shard of one good line and four malformed ones, so its quarantine bound fails:
  the command exits 1 and ``marin failures`` names the check and the counts that broke it.
* ``archives``: a tarball and a zip whose good members sit beside members named ``../../x`` and
  ``/etc/x``, symlinks, a FIFO, a device and a dangling hard link (issue 50, finding 4).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from tests.curation.conftest import write_odd_archives

# Every test reads the module's `marin materialize` build (about 3 min on 2 loaded cores).
pytestmark = pytest.mark.slow

SECRET = b"TOP-SECRET-MARKER-7c1f"
MAX_DOC_BYTES = 4 * 2**20

_SUBJECTS = ["the old miller", "a young teacher", "the harbour pilot", "my grandmother", "the village baker",
             "a tired soldier", "the quiet librarian", "our neighbour", "the ferryman", "a curious child",
             "the blacksmith", "a travelling poet", "the shepherd", "the mayor's clerk", "a retired captain"]
_VERBS = ["carried", "painted", "repaired", "described", "borrowed", "planted", "measured", "questioned",
          "delivered", "admired", "polished", "counted", "wrapped", "studied", "forgot"]
_OBJECTS = ["the broken cart", "a basket of apples", "the copper kettle", "an unfinished letter",
            "the garden gate", "a map of the coast", "the chapel bell", "a bundle of letters", "the wooden bridge",
            "a pair of boots", "the winter coat", "a jar of honey", "the striped awning", "a lantern", "the fence"]
_PLACES = ["near the river", "behind the chapel", "at the market", "on the hill road", "beside the mill pond",
           "under the chestnut tree", "in the narrow lane", "by the harbour wall", "at the crossroads",
           "inside the granary", "along the canal", "outside the inn", "past the orchard", "in the square"]
_TIMES = ["before dawn", "after the storm", "during the fair", "late that evening", "on a windy morning",
          "in early spring", "while it snowed", "at harvest time", "before supper", "one rainy afternoon"]


def prose(seed: int, sentences: int = 7) -> str:
    """English prose that passes the default filters; different seeds do not near-duplicate."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        out.append(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                   f"{rng.choice(_PLACES)} {rng.choice(_TIMES)}, and {rng.choice(_SUBJECTS)} "
                   f"{rng.choice(_VERBS)} {rng.choice(_OBJECTS)} with great care.")
    return f"Record {seed}. " + " ".join(out)


def write_corpus(root: Path) -> list[str]:
    """The bad-input corpus; returns the text of every good document in it."""
    corpus, outside = root / "corpus", root / "outside"
    (corpus / "inner").mkdir(parents=True)
    outside.mkdir()
    good: list[str] = []

    def text_file(name: str, seed: int) -> None:
        good.append(prose(seed))
        (corpus / name).write_text(good[-1])

    def jsonl(seeds: range) -> list[str]:
        good.extend(prose(s) for s in seeds)
        return [json.dumps({"text": prose(s)}) for s in seeds]

    for i in range(30):
        text_file(f"good_{i:02d}.txt", i)
    (corpus / "good.jsonl").write_text("\n".join(jsonl(range(100, 160))) + "\n")
    # 1. malformed JSON among good lines
    (corpus / "malformed.jsonl").write_text("\n".join([*jsonl(range(200, 220)), '{"text": "unterminated']) + "\n")
    # 2. a deeply nested line as the 6th of 100 (issue #17, defect 1)
    lines = jsonl(range(300, 399))
    lines.insert(5, '{"text": ' + "[" * 5000 + "]" * 5000)
    (corpus / "nested.jsonl").write_text("\n".join(lines) + "\n")
    # 3. invalid UTF-8 that no legacy encoding makes into text
    (corpus / "invalid_utf8.txt").write_bytes(b"Caf\xe9 " + bytes(range(0x81, 0x90)) * 40)
    # 4. binary without NUL bytes, 5. text with a NUL byte
    (corpus / "binary.dat").write_bytes(bytes(range(1, 32)) * 100)
    (corpus / "nul.txt").write_bytes(prose(900).encode() + b"\x00" + prose(901).encode())
    # 6. empty file
    (corpus / "empty.txt").write_bytes(b"")
    # 7. a 10 MB JSONL line
    (corpus / "huge_line.jsonl").write_text(json.dumps({"text": "lorem ipsum " * (10 * 2**20 // 12)}) + "\n")
    # 8. a truncated gzip
    packed = gzip.compress("\n".join(prose(s) for s in range(950, 990)).encode())
    (corpus / "truncated.txt.gz").write_bytes(packed[: len(packed) // 2])
    # 9. a gzip bomb: 61 KB on disk, 50 MB expanded
    (corpus / "bomb.txt.gz").write_bytes(gzip.compress(b"A" * 50 * 2**20))
    # 10. a 5 MB file of one line
    (corpus / "long_lines.txt").write_text(" ".join(prose(s) for s in range(5000, 5000 + 5 * 2**20 // 700)))
    # 11. odd names, good content
    text_file("report..final.txt", 1000)
    text_file("odd name \u00fc #1.txt", 1001)
    # 12. a symlink that stays inside the root (its target is not matched by the glob itself)
    good.append(prose(1002))
    (corpus / "inner" / "real.txt").write_text(good[-1])
    (corpus / "in_link.txt").symlink_to(corpus / "inner" / "real.txt")
    # 13. a symlink out of the root
    (outside / "secret.txt").write_bytes(SECRET + b" " + prose(1003).encode())
    (corpus / "out_link.txt").symlink_to(outside / "secret.txt")
    return good


EXPECTED_QUARANTINE = {"malformed_json": 2, "invalid_encoding": 1, "binary": 2, "empty": 1, "too_large": 3,
                       "unreadable": 1, "outside_root": 1, "missing_text_field": 0, "record_error": 0,
                       "broken_link": 0, "not_a_regular_file": 0, "changed_during_read": 0,
                       "truncated": 0, "not_html": 0, "http_status": 0}
ODD_GOOD_LINES = 6  # 5,987 bytes: over ODD_BYTES_PER_SHARD, under twice it (no split into ranges)
ODD_BYTES_PER_SHARD = 4096  # the least a source may set


def write_odd_files(odd: Path) -> None:
    """Three shards (``odd_shards`` checks them): a FIFO alone (sorted first, it starts the first shard;
    files of size 0 never start one), a binary JSONL file alone, and good JSONL (over
    ``ODD_BYTES_PER_SHARD``, so it starts a shard) followed by a dangling link, a FIFO and a socket."""
    for folder in ("a_fifo", "b_binary", "c_mixed"):
        (odd / folder).mkdir(parents=True)
    os.mkfifo(odd / "a_fifo" / "fifo.jsonl")
    (odd / "b_binary" / "noise.jsonl").write_bytes(bytes(range(14, 32)) * 250)  # one line of control bytes
    (odd / "c_mixed" / "a_good.jsonl").write_text(
        "".join(json.dumps({"text": prose(4000 + i)}) + "\n" for i in range(ODD_GOOD_LINES)))
    (odd / "c_mixed" / "broken.jsonl").symlink_to(odd / "c_mixed" / "nowhere.jsonl")
    os.mkfifo(odd / "c_mixed" / "fifo.jsonl")
    with socket.socket(socket.AF_UNIX) as sock:  # the socket's file stays after it is closed
        sock.bind(str(odd / "c_mixed" / "sock.jsonl"))


def marin(env: dict, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "marin_assets.cli", *args], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:  # a hang (a FIFO opened for reading) is a failure, not a stall
        return subprocess.CompletedProcess(exc.cmd, -9, exc.stdout or "", f"timed out after 300 s\n{exc.stderr}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    good = write_corpus(root)
    (root / "names").mkdir()
    for i, name in enumerate(["a.txt", "report..final.txt", "z.txt"]):
        (root / "names" / name).write_text(prose(2000 + i))
    write_odd_files(root / "odd")
    (root / "mostlybad").mkdir()
    (root / "mostlybad" / "bad.jsonl").write_text(
        "\n".join([json.dumps({"text": prose(3000)}), *['{"text": "unterminated'] * 4]) + "\n")
    archive_texts = [prose(6000 + i) for i in range(6)]
    refused_members = write_odd_archives(
        root / "archives", *("".join(json.dumps({"text": t}) + "\n" for t in half).encode()
                             for half in (archive_texts[:3], archive_texts[3:])))
    sources = root / "sources.yaml"
    sources.write_text(
        "sources:\n"
        f"  - {{name: corpus, uri: '{root}/corpus/*', max_doc_bytes: {MAX_DOC_BYTES},"
        " bytes_per_shard: 17179869184}\n"
        f"  - {{name: names, uri: '{root}/names/*.txt', format: text, files_per_shard: 1}}\n"
        f"  - {{name: odd, uri: '{root}/odd', format: jsonl, bytes_per_shard: {ODD_BYTES_PER_SHARD}}}\n"
        f"  - {{name: mostlybad, uri: '{root}/mostlybad/*.jsonl'}}\n"
        f"  - {{name: archives, uri: '{root}/archives', format: jsonl}}\n")
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
           "DAGSTER_HOME": str(root / "home"), "MARIN_CACHE_DIR": str(root / "cache"), "MARIN_ENV": "local"}
    runs = {name: marin(env, "materialize", f"deduplicated/{name}", "--json")
            for name in ("corpus", "names", "odd", "mostlybad", "archives")}
    runs["status"] = marin(env, "status", "--json")
    runs["failures"] = marin(env, "failures", "--json")
    return {"root": root, "store": root / "store", "good": good, "runs": runs, "archive_texts": archive_texts,
            "refused_members": refused_members}


def _ok(proc: subprocess.CompletedProcess) -> dict | list:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    return json.loads(proc.stdout)


def _downstream_texts(store: Path, source: str) -> list[str]:
    files = sorted((store / "deduplicated" / source).glob("v1-*/data/*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files])["text"].to_list()


def test_every_good_document_reaches_deduplicated(built):
    assert _ok(built["runs"]["corpus"])["success"]
    texts = set(_downstream_texts(built["store"], "corpus"))
    missing = [t[:60] for t in built["good"] if t not in texts]
    assert not missing and len(built["good"]) == 212
    assert len(texts) == len(built["good"])  # nothing bad got through either


def test_every_bad_record_is_quarantined_with_its_reason(built):
    (shard,) = next((built["store"] / "documents" / "corpus").glob("v1-*")).iterdir()
    manifest = json.loads((shard / ".artifact.json").read_text())["metrics"]
    quarantine = pl.read_parquet(shard / "quarantine.parquet")
    counts = {r: quarantine.filter(pl.col("reason") == r).height for r in EXPECTED_QUARANTINE}
    assert counts == EXPECTED_QUARANTINE and quarantine.height == sum(EXPECTED_QUARANTINE.values())
    assert {k.removeprefix("quarantine/"): v for k, v in manifest.items() if k.startswith("quarantine/")} \
        == EXPECTED_QUARANTINE
    assert manifest["records"] == manifest["documents"] + manifest["quarantined"] == 212 + quarantine.height
    assert all(quarantine["detail"].str.len_chars() > 0)
    by_file = {row["source_id"].split("/corpus/")[-1]: row["reason"] for row in quarantine.iter_rows(named=True)}
    assert by_file["nested.jsonl:6"] == by_file["malformed.jsonl:21"] == "malformed_json"
    assert by_file["huge_line.jsonl:1"] == by_file["long_lines.txt"] == by_file["bomb.txt.gz"] == "too_large"
    assert by_file["truncated.txt.gz"] == "unreadable" and by_file["out_link.txt"] == "outside_root"
    assert by_file["binary.dat"] == by_file["nul.txt"] == "binary" and by_file["empty.txt"] == "empty"
    assert by_file["invalid_utf8.txt"] == "invalid_encoding"


def test_no_byte_of_a_link_target_outside_the_root_is_stored(built):
    for path in built["store"].rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_bytes(), path
            if path.suffix == ".parquet":
                frame = pl.read_parquet(path)
                for column in frame.columns:
                    if frame.schema[column] in (pl.String, pl.Binary):
                        assert not any(SECRET in (v.encode() if isinstance(v, str) else v)
                                       for v in frame[column].drop_nulls()), (path, column)
    listing = json.loads(next(built["store"].glob("raw/corpus/v1-*/*/listing.json")).read_text())
    (link,) = [item for item in listing if item["relpath"] == "out_link.txt"]
    assert link["bytes"] == 0 and "outside the source root" in link["refused"]


def test_a_dotted_file_name_builds_with_its_siblings(built):
    summary = _ok(built["runs"]["names"])
    built_parts = [s["partition"] for s in summary["steps"] if s["ran"]]
    assert built_parts[0] == "a.txt" and built_parts[1].startswith("report.final.txt-") and built_parts[2] == "z.txt"
    assert built_parts[3] is None  # deduplicated/names ran after all three shards
    assert len(_downstream_texts(built["store"], "names")) == 3


def test_status_lists_every_partition_without_a_traceback(built):
    states = _ok(built["runs"]["status"])
    names = {(s["asset_key"], s["partition"]): s["state"] for s in states if s["asset_key"].endswith("/names")}
    # raw, documents and filtered per shard, then dedup_index and deduplicated
    assert len(names) == 3 * 3 + 2 and set(names.values()) == {"fresh"}


def test_a_failed_error_check_fails_the_command_and_says_which_count_broke_it(built):
    proc = built["runs"]["mostlybad"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    (failed,) = [s for s in summary["steps"] if not s["success"] and not s["skipped"]]
    assert not summary["success"] and "documents/mostlybad:documents_quarantine_bound" in failed["error"]
    assert "quarantine_fraction=0.8 > bound=0.2: quarantined=4 of the records=5 read" in failed["error"]
    # deduplicated/mostlybad reads the failed partition, so it is not run: it joined that shard's run
    # (its only input), and what that run committed for it was withdrawn when the shard's check failed.
    assert summary["steps"][-1]["skipped"] and summary["steps"][-1]["partition"] is None
    assert "in the same run" in proc.stderr, proc.stderr[-3000:]
    assert "withdrew what this run committed for" in proc.stderr, proc.stderr[-3000:]
    from marin_resources.storage.store import ArtifactStore
    artifacts = ArtifactStore(str(built["store"]))
    assert all(artifacts.find(key, "v1", None) is None for key in ("dedup_index/mostlybad", "deduplicated/mostlybad"))
    rows = [r for r in _ok(built["runs"]["failures"]) if r["partition"] == "bad.jsonl"]
    assert any(r["error"].startswith("AssetCheckFailed: documents/mostlybad:documents_quarantine_bound")
               and "quarantined=4 of the records=5 read" in r["error"] for r in rows)
    # The other sources' runs recorded no failure: the empty shards of `odd` among them.
    assert all(r["partition"] == "bad.jsonl" for r in _ok(built["runs"]["failures"]))


def _documents_metrics(store: Path, source: str) -> dict[str, dict]:
    return {shard.name: json.loads((shard / ".artifact.json").read_text())["metrics"]
            for shard in next((store / "documents" / source).glob("v1-*")).iterdir()}


def test_files_that_are_not_files_are_quarantined_alone_and_block_nothing(built):
    """Issue #30: a FIFO hung `marin materialize` forever; a dangling link failed its shard on every run;
    a shard of nothing but quarantine failed documents_accounted and kept deduplicated from running."""
    summary = _ok(built["runs"]["odd"])
    assert summary["success"]
    metrics = _documents_metrics(built["store"], "odd")
    assert metrics.keys() == {"a_fifo+fifo.jsonl", "b_binary+noise.jsonl", "c_mixed+a_good.jsonl"}
    fifo, binary, mixed = (metrics[k] for k in sorted(metrics))
    # Empty shards: counted, complete, and no ERROR check failed (the command succeeded).
    assert (fifo["documents"], fifo["quarantined"], fifo["records"], fifo["refused_files"]) == (0, 1, 1, 1)
    assert fifo["quarantine/not_a_regular_file"] == 1
    assert (binary["documents"], binary["quarantined"], binary["records"], binary["quarantine/binary"]) == (0, 1, 1, 1)
    assert binary["quarantine_fraction"] == 1.0  # over the bound, but an empty shard: a warning
    # Beside good documents: each odd file one row with its reason, and the bound is over what was read.
    assert (mixed["documents"], mixed["quarantined"], mixed["refused_files"]) == (ODD_GOOD_LINES, 3, 3)
    assert (mixed["quarantine/not_a_regular_file"], mixed["quarantine/broken_link"]) == (2, 1)
    assert mixed["quarantine_fraction"] == 0.0
    listing = json.loads(next(built["store"].glob("raw/odd/v1-*/c_mixed+a_good.jsonl/listing.json")).read_text())
    refused = {item["relpath"]: item.get("refused", "") for item in listing}
    assert refused["c_mixed/fifo.jsonl"].startswith("not_a_regular_file: a FIFO")
    assert refused["c_mixed/sock.jsonl"].startswith("not_a_regular_file: a socket")
    assert refused["c_mixed/broken.jsonl"].startswith("broken_link: symlink to ")
    assert all(item["bytes"] == 0 for item in listing if item.get("refused"))
    # The good documents reached deduplicated, the source's global step, past two empty shards.
    assert sorted(_downstream_texts(built["store"], "odd")) == sorted(prose(4000 + i) for i in range(ODD_GOOD_LINES))


def test_odd_archive_members_are_quarantined_one_by_one_and_the_good_ones_reach_deduplicated(built):
    """Issue 50 (4): a member named ``../../x`` or ``/etc/x``, a symlink, FIFO or device member failed
    the whole shard on every run, so its good members never reached ``deduplicated``."""
    summary = _ok(built["runs"]["archives"])
    assert summary["success"]
    (metrics,) = _documents_metrics(built["store"], "archives").values()
    refused = built["refused_members"]
    assert (metrics["documents"], metrics["refused_files"], metrics["quarantined"]) == (6, len(refused), len(refused))
    assert {reason: metrics[f"quarantine/{reason}"] for reason in set(refused.values())} == \
        {reason: list(refused.values()).count(reason) for reason in set(refused.values())}
    listing = json.loads(next(built["store"].glob("raw/archives/v1-*/*/listing.json")).read_text())
    assert {item["relpath"]: item["refused"].split(":")[0] for item in listing if item.get("refused")} == refused
    assert all(item["bytes"] == 0 for item in listing if item.get("refused"))
    assert sorted(_downstream_texts(built["store"], "archives")) == sorted(built["archive_texts"])
