"""``pypi-sdist://NAME==VERSION[/MEMBER-GLOB]``: the members of a PyPI package's source distribution,
fetched once with ``python -m pip download`` into a local cache and read as a tarball."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from marin_assets.curation.content_hashes import sha256_file
from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.local_cache import cache_dir
from marin_assets.curation.schemes.base import FileState, ListedSource, ReadThroughFsspec, SourceUriError
from marin_assets.curation.schemes.fsspec_listing import (
    archive_members,
    archive_protocol,
    glob_files,
    glob_root,
    listed_file,
    relative,
)
from marin_assets.curation.schemes.urls import member_url, opened_filesystem

PYPI_SDIST_SCHEME = "pypi-sdist"


@dataclass(frozen=True)
class SdistSpec:
    name: str
    version: str
    member_glob: str


def parse_sdist_uri(uri: str, where: str) -> SdistSpec:
    """The package, version and member glob a ``pypi-sdist://`` URI names; ``where`` starts the error."""
    spec, _, member = uri.split("://", 1)[1].partition("/")
    name, sep, version = spec.partition("==")
    if not sep or not name or not version:
        raise SourceUriError(f"{where}.uri: expected pypi-sdist://NAME==VERSION[/MEMBER-GLOB], got {uri!r}")
    return SdistSpec(name, version, member or "**")


def fetch_pypi_sdist(name: str, version: str, dest: str | Path, timeout_s: float = 300) -> tuple[Path, str]:
    """Download the sdist of ``name==version`` into ``dest``; return (path, sha256).

    Runs ``python -m pip download --no-deps --no-binary :all:`` so the
    package's own build is never executed beyond metadata preparation.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "--quiet", f"{name}=={version}", "-d", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip download of {name}=={version} failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        files = sorted(Path(tmp).iterdir())
        if len(files) != 1:
            raise RuntimeError(f"pip download of {name}=={version} produced {len(files)} files: {files}")
        target = dest / files[0].name
        shutil.move(str(files[0]), target)
    return target, sha256_file(target)


@cache
def ensure_pypi_sdist(name: str, version: str, expected_sha256: str | None = None) -> Path:
    """Path of the cached sdist of ``name==version``, fetching it if absent."""
    folder = cache_dir() / "pypi-sdist" / f"{name}-{version}"
    existing = sorted(p for p in folder.glob("*") if p.is_file()) if folder.exists() else []
    if existing:
        path, digest = existing[0], sha256_file(existing[0])
    else:
        path, digest = fetch_pypi_sdist(name, version, folder)
    if expected_sha256 and digest != expected_sha256.lower():
        raise RuntimeError(
            f"sdist {path} has sha256 {digest}, expected {expected_sha256}; "
            "delete it to refetch or update the source's sha256"
        )
    return path


def _member_url(sdist: Path, member: str) -> str:
    return member_url(archive_protocol(sdist.name) or "tar", member, f"file://{sdist}")


@dataclass(frozen=True)
class PypiSdistScheme(ReadThroughFsspec):
    """Members of a cached sdist: pinned by the sdist's sha256, so none changes under a reader."""

    name: str = PYPI_SDIST_SCHEME

    def declared_uri(self, uri: str, base_dir: Path, where: str) -> str:
        parse_sdist_uri(uri, where)
        return uri

    def is_pinned(self, source: ListedSource) -> bool:
        return source.sha256 is not None

    def pinned_sha256(self, source: ListedSource) -> str | None:
        return None  # ensure_pypi_sdist checks the download against the source's sha256

    def list_files(self, source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
        # The members of a cached sdist: never a store's files.
        spec = parse_sdist_uri(source.uri, f"source {source.name!r}")
        sdist = ensure_pypi_sdist(spec.name, spec.version, source.sha256)
        digest = sha256_file(sdist)
        with opened_filesystem(_member_url(sdist, spec.member_glob)) as (afs, member_glob):
            members, refusals = glob_files(afs, member_glob), archive_members(afs)
        root = glob_root(member_glob)
        refs = []
        for m, info in members.items():
            uri, relpath = f"{PYPI_SDIST_SCHEME}://{spec.name}=={spec.version}/{m}", relative(m, root)
            refused = refusals.get(m)  # a symlink, FIFO or device member (see archive_members)
            refs.append(listed_file(uri, relpath, info, etag=digest) if refused is None
                        else FileRef(uri=uri, relpath=relpath, etag=digest, refused=refused))
        return refs

    def resolve_url(self, uri: str, expected_sha256: str | None) -> str:
        spec = parse_sdist_uri(uri, uri)
        return _member_url(ensure_pypi_sdist(spec.name, spec.version, expected_sha256), spec.member_glob)

    def splits_by_byte_range(self, uri: str) -> bool:
        return False  # a member of a compressed tarball

    def file_state(self, uri: str) -> FileState | None:
        return None  # a member of a pinned sdist


PYPI_SDIST = PypiSdistScheme()
