"""The URI schemes of a source: each registered under its prefix, an unknown prefix refused in one line
naming the known ones, and each scheme's operations on a small local case."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import re
import tarfile

import pytest

from marin_assets.curation.config import SourceConfigError
from marin_assets.curation.listed_files import NOT_INSTALLED, refusal_parts
from marin_assets.curation.opening import open_binary
from marin_assets.curation.schemes import pypi_sdist
from marin_assets.curation.schemes.base import SourceUriError, UriScheme
from marin_assets.curation.schemes.installed_dists import installed_dist_index
from marin_assets.curation.schemes.registry import ALL_SCHEMES, SCHEMES, scheme_of

from .conftest import make_source

OPERATIONS = [name for name in vars(UriScheme) if not name.startswith("_") and callable(vars(UriScheme)[name])]


def _read(scheme, uri: str, decompress: bool = True) -> bytes:
    with scheme.open(uri, None, decompress) as fh:
        return fh.read()


def test_every_scheme_is_registered_under_its_prefix_with_every_operation():
    assert {s.name for s in ALL_SCHEMES} == {"files", "pypi-sdist", "installed-dists", "hf"}
    assert set(SCHEMES) == {"pypi-sdist", "installed-dists", "hf"}
    assert {"declared_uri", "identity_uri", "is_pinned", "pinned_sha256", "list_files", "resolve_url", "open",
            "open_stored", "splits_by_byte_range", "file_state"} == set(OPERATIONS)
    for scheme in ALL_SCHEMES:
        assert [op for op in OPERATIONS if not callable(getattr(scheme, op, None))] == [], scheme.name
    expected = {"pypi-sdist://toy==1.0": "pypi-sdist", "installed-dists://?limit=3": "installed-dists",
                "hf://datasets/org/name": "hf", "/data/letters/*.txt": "files", "notes.txt": "files",
                "file:///data/a.txt": "files", "gs://bucket/a.jsonl": "files", "s3://bucket/a": "files",
                "tar://*.txt::file:///data/a.tar.gz": "files", "memory://x": "files"}
    assert {uri: scheme_of(uri).name for uri in expected} == expected


def test_an_unknown_scheme_is_one_line_naming_the_known_ones(tmp_path):
    with pytest.raises(SourceUriError) as raised:
        scheme_of("ftps2://host/data.txt")
    message = str(raised.value)
    assert "\n" not in message and message.startswith("ftps2://host/data.txt: unknown URI scheme 'ftps2'; known: ")
    for known in ("hf", "installed-dists", "pypi-sdist", "file", "gs", "s3", "tar"):
        assert re.search(rf"[ (]{re.escape(known)}[,)]", message), known
    with pytest.raises(SourceConfigError, match=r"^source 'test'\.uri: ftps2://host/data\.txt: unknown URI scheme"):
        make_source(tmp_path, uri="ftps2://host/data.txt")


def test_the_files_scheme_lists_opens_and_watches_a_local_file(tmp_path):
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "notes.jsonl"
    path.write_bytes(b'{"text": "one"}\n')
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    source = make_source(tmp_path, uri="d/*.jsonl")
    files = scheme_of(source.uri)
    assert source.uri == f"{tmp_path}/d/*.jsonl"  # made absolute against the sources file's directory
    [ref] = files.list_files(source)
    assert (ref.uri, ref.relpath, ref.size, ref.etag) == (f"file://{path}", "notes.jsonl", 16, f"sha256:{digest}")
    assert _read(files, ref.uri) == path.read_bytes()
    with files.open_stored(ref.uri) as fh:
        assert fh.read() == path.read_bytes()
    assert files.splits_by_byte_range(ref.uri) and not files.splits_by_byte_range(f"tar://a.txt::{ref.uri}")
    before = files.file_state(ref.uri)
    assert before.size == 16 and before.stat is not None and before.store_tag is None
    path.write_bytes(b'{"text": "two"}\n')  # same size: the stat says it changed
    assert files.file_state(ref.uri) != before
    assert files.file_state(f"tar://a.txt::{ref.uri}") is None  # an archive member holds still
    assert not files.is_pinned(source)  # a glob
    pinned = make_source(tmp_path, uri="d/notes.jsonl", sha256=digest)
    assert files.is_pinned(pinned)
    assert files.pinned_sha256(pinned) == hashlib.sha256(b'{"text": "two"}\n').hexdigest()


def test_the_installed_dists_scheme_reads_a_pinned_distribution_of_the_venv(tmp_path):
    version = importlib.metadata.version("PyYAML")
    (tmp_path / "pins.txt").write_text(f"pyyaml=={version}\nrequests==0.0.1\n")
    installed_dist_index.cache_clear()
    source = make_source(tmp_path, uri="installed-dists://?pins=pins.txt")
    dists = scheme_of(source.uri)
    assert dists.name == "installed-dists" and source.uri == f"installed-dists://?pins={tmp_path}/pins.txt"
    refs = {ref.relpath: ref for ref in dists.list_files(source)}
    assert {"pyyaml/DESCRIPTION", "pyyaml/licenses/LICENSE"} <= set(refs)
    assert refusal_parts(refs["requests/DESCRIPTION"].refused)[0] == NOT_INSTALLED
    licence = refs["pyyaml/licenses/LICENSE"]
    assert licence.etag == version
    text = _read(dists, licence.uri)
    assert len(text) == licence.size and b"Permission is hereby granted" in text
    with open_binary(licence.uri) as fh, dists.open_stored(licence.uri) as stored:
        assert fh.read() == stored.read() == text
    assert dists.file_state(licence.uri) is None and not dists.splits_by_byte_range(licence.uri)
    assert not dists.is_pinned(source)
    with pytest.raises(ValueError, match="never pinned"):
        dists.pinned_sha256(source)
    with pytest.raises(SourceConfigError, match=r"^source 'test'\.uri: limit must be an integer"):
        make_source(tmp_path, uri="installed-dists://?limit=all")


def test_installed_dists_are_named_in_the_identity_by_their_pins_not_the_pin_files_path(tmp_path):
    """The bundled pin file sits inside each checkout: named by its path, a clone in another folder
    made raw/installed_packages "config changed" and rebuilt everything after it."""
    from marin_assets.curation.config import reading_identity

    def identity(folder, text):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "pins.txt").write_text(text)
        return reading_identity(make_source(folder, uri="installed-dists://?pins=pins.txt&limit=5"))

    here = identity(tmp_path / "clone-a", "pyyaml==6.0.2\nrequests==2.32.3\n")
    assert here == identity(tmp_path / "elsewhere/clone-b", "# the same pins, another order\nrequests==2.32.3\n"
                                                            "PyYAML==6.0.2\n")
    assert here != identity(tmp_path / "clone-c", "pyyaml==6.0.3\nrequests==2.32.3\n")
    assert str(tmp_path) not in here["uri"] and "limit=5" in here["uri"]
    # Every other scheme names its data by where it is: the identity keeps the uri as declared.
    notes = make_source(tmp_path, uri="notes.txt")
    assert reading_identity(notes)["uri"] == notes.uri


def _toy_sdist(folder) -> bytes:
    """A gzipped tarball laid out as an sdist of toy==1.0."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in (("toy-1.0/README.txt", b"A toy package.\n"), ("toy-1.0/docs/use.txt", b"Use it.\n"),
                           ("toy-1.0/setup.py", b"raise SystemExit\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(text), 1_700_000_000
            tar.addfile(info, io.BytesIO(text))
    folder.mkdir(parents=True)
    (folder / "toy-1.0.tar.gz").write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_the_pypi_sdist_scheme_lists_and_opens_members_of_a_cached_sdist(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_CACHE_DIR", str(tmp_path / "cache"))
    data = _toy_sdist(tmp_path / "cache" / "pypi-sdist" / "toy-1.0")
    digest = hashlib.sha256(data).hexdigest()
    pypi_sdist.ensure_pypi_sdist.cache_clear()
    try:
        source = make_source(tmp_path, uri="pypi-sdist://toy==1.0/toy-1.0/**/*.txt", sha256=digest)
        sdist = scheme_of(source.uri)
        refs = sorted(sdist.list_files(source), key=lambda r: r.relpath)
        assert [(r.relpath, r.uri, r.etag) for r in refs] == [
            ("README.txt", "pypi-sdist://toy==1.0/toy-1.0/README.txt", digest),
            ("docs/use.txt", "pypi-sdist://toy==1.0/toy-1.0/docs/use.txt", digest)]
        assert sdist.resolve_url(refs[0].uri, digest) == \
            f"tar://toy-1.0/README.txt::file://{tmp_path}/cache/pypi-sdist/toy-1.0/toy-1.0.tar.gz"
        assert _read(sdist, refs[1].uri) == b"Use it.\n"
        with sdist.open_stored(refs[0].uri) as fh:
            assert fh.read() == b"A toy package.\n"
        assert sdist.file_state(refs[0].uri) is None and not sdist.splits_by_byte_range(refs[0].uri)
        assert sdist.is_pinned(source) and sdist.pinned_sha256(source) is None  # checked when fetched
        pypi_sdist.ensure_pypi_sdist.cache_clear()
        with pytest.raises(RuntimeError, match=f"has sha256 {digest}, expected 0000"):
            sdist.list_files(make_source(tmp_path, uri="pypi-sdist://toy==1.0", sha256="0" * 64))
        with pytest.raises(SourceConfigError, match=r"^source 'test'\.uri: expected pypi-sdist://NAME==VERSION"):
            make_source(tmp_path, uri="pypi-sdist://toy")
    finally:
        pypi_sdist.ensure_pypi_sdist.cache_clear()


def test_the_hf_scheme_pins_files_at_a_commit_and_refuses_a_bad_uri_before_asking_the_hub(tmp_path):
    hub = scheme_of("hf://datasets/org/name")
    uri = "hf://datasets/org/name@0123abcd/data/part-0.jsonl"
    assert hub.declared_uri(uri, tmp_path, "source 'x'") == uri
    assert hub.file_state(uri) is None and hub.splits_by_byte_range(uri)
    assert hub.is_pinned(make_source(tmp_path, uri=uri, sha256="ab" * 32))
    assert not hub.is_pinned(make_source(tmp_path, uri="hf://datasets/org/name/*.jsonl", sha256="ab" * 32))
    with pytest.raises(SourceUriError, match=r"^source 'test'\.uri: expected hf://datasets/ORG/NAME"):
        hub.list_files(make_source(tmp_path, uri="hf://only-a-name"))
