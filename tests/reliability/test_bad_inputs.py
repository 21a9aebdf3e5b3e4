"""Every kind of bad input, mixed with good files, through `marin materialize` as a user runs it.

One store is built per module (fresh DAGSTER_HOME, MARIN_PREFIX, MARIN_SOURCES, MARIN_CACHE_DIR)
and every test reads its outcome:

* ``corpus``: the 14 bad-input kinds of issue #17 among good files, in one shard with enough good
  records that every ERROR check passes; every good document must reach ``deduplicated`` and every
  bad record must be quarantined with its reason.
* ``names``: ``a.txt``, ``report..final.txt``, ``z.txt``, one shard each (issue #17, defect 3).
* ``allbad``: a shard holding only a binary file, so its quarantine bound fails: the command exits 1
  and ``marin failures`` names the check.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

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
                       "truncated": 0, "not_html": 0, "http_status": 0}


def marin(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marin_assets.cli", *args], env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    good = write_corpus(root)
    (root / "names").mkdir()
    for i, name in enumerate(["a.txt", "report..final.txt", "z.txt"]):
        (root / "names" / name).write_text(prose(2000 + i))
    (root / "allbad").mkdir()
    (root / "allbad" / "noise.txt").write_bytes(bytes(range(1, 32)) * 60)
    sources = root / "sources.yaml"
    sources.write_text(
        "sources:\n"
        f"  - {{name: corpus, uri: '{root}/corpus/*', max_doc_bytes: {MAX_DOC_BYTES},"
        " bytes_per_shard: 1000000000000}\n"
        f"  - {{name: names, uri: '{root}/names/*.txt', format: text, files_per_shard: 1}}\n"
        f"  - {{name: allbad, uri: '{root}/allbad/*.txt', format: text}}\n")
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
           "DAGSTER_HOME": str(root / "home"), "MARIN_CACHE_DIR": str(root / "cache"), "MARIN_ENV": "local"}
    runs = {name: marin(env, "materialize", f"deduplicated/{name}", "--json") for name in ("corpus", "names", "allbad")}
    runs["status"] = marin(env, "status", "--json")
    runs["failures"] = marin(env, "failures", "--json")
    return {"root": root, "store": root / "store", "good": good, "runs": runs}


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


def test_a_failed_error_check_fails_the_command_and_is_recorded(built):
    proc = built["runs"]["allbad"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)
    (failed,) = [s for s in summary["steps"] if not s["success"] and not s["skipped"]]
    assert not summary["success"] and "documents/allbad:documents_quarantine_bound" in failed["error"]
    # deduplicated/allbad reads the failed partition, so it is not run: it joined that shard's run
    # (its only input), and what that run committed for it was withdrawn when the shard's check failed.
    assert summary["steps"][-1]["skipped"] and summary["steps"][-1]["partition"] is None
    assert "in the same run" in proc.stderr and "withdrew what this run committed for" in proc.stderr, proc.stderr[-3000:]
    from marin_resources.store import ArtifactStore
    artifacts = ArtifactStore(str(built["store"]))
    assert all(artifacts.find(key, "v1", None) is None for key in ("dedup_index/allbad", "deduplicated/allbad"))
    rows = [r for r in _ok(built["runs"]["failures"]) if r["partition"] == "noise.txt"]
    assert any(r["error"].startswith("AssetCheckFailed: documents/allbad:documents_quarantine_bound")
               and "quarantine_fraction=1.0" in r["error"] for r in rows)
    # The good sources' runs recorded no failure.
    assert all(r["partition"] == "noise.txt" for r in _ok(built["runs"]["failures"]))
