"""``installed-dists://[?pins=FILE][&limit=N]``: the long descriptions and licence files of the Python
distributions installed in the running interpreter, sorted by name.

With ``pins``, only the distributions FILE lists (``name==version`` lines, relative to the sources
file), each read where it is installed at that version: installing anything else changes nothing
(one missing or at another version is listed as refused, ``not_installed``). Without it, every
installed distribution.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import re
import urllib.parse
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

from marin_assets.curation.listed_files import NOT_INSTALLED, FileRef, refusal
from marin_assets.curation.schemes.base import FileState, ListedSource, SourceUriError

INSTALLED_DISTS_SCHEME = "installed-dists"
_LICENSE_FILE_RE = re.compile(r"^(?:LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)


@dataclass(frozen=True)
class InstalledSpec:
    limit: int | None
    pins: str | None  # the pin file's path (absolute once the sources file is parsed)


def parse_installed_uri(uri: str, where: str) -> InstalledSpec:
    """Which installed distributions an ``installed-dists://`` URI names; ``where`` starts the error."""
    parsed = urllib.parse.urlsplit(uri)
    query = urllib.parse.parse_qs(parsed.query)
    unknown = sorted(set(query) - {"limit", "pins"})
    if unknown or parsed.netloc or parsed.path not in ("", "/") or any(len(v) > 1 for v in query.values()):
        raise SourceUriError(f"{where}.uri: expected installed-dists://[?pins=FILE][&limit=N], got {uri!r}")
    limit = None
    if "limit" in query:
        try:
            limit = int(query["limit"][0])
        except ValueError:
            raise SourceUriError(f"{where}.uri: limit must be an integer, got {query['limit'][0]!r}") from None
        if limit < 1:
            raise SourceUriError(f"{where}.uri: limit must be >= 1, got {limit}")
    return InstalledSpec(limit, query["pins"][0] if "pins" in query else None)


def read_pins(path: str | Path) -> list[tuple[str, str]]:
    """(canonical name, version) of each ``name==version`` line of a pin file (``#`` comments and
    blank lines skipped), sorted by name; SourceUriError naming the line for anything else."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SourceUriError(f"pins file {path}: cannot read it: {exc.strerror or exc}") from None
    pins: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, sep, version = (part.strip() for part in text.partition("=="))
        if not sep or not name or not version or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise SourceUriError(f"pins file {path}, line {number}: expected NAME==VERSION, got {text!r}")
        if canonical_dist_name(name) in pins:
            raise SourceUriError(f"pins file {path}, line {number}: {name} is pinned twice")
        pins[canonical_dist_name(name)] = version
    return sorted(pins.items())


def canonical_dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@lru_cache(maxsize=1)
def installed_dist_index() -> dict[str, importlib.metadata.Distribution]:
    # Parsing every METADATA file is slow (email parser), so do it once.
    by_name: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            # First on sys.path wins, as for imports.
            by_name.setdefault(canonical_dist_name(name), dist)
    return by_name


def installed_distributions(limit: int | None = None) -> list[importlib.metadata.Distribution]:
    """Installed distributions sorted by canonical name."""
    index = installed_dist_index()
    ordered = [index[k] for k in sorted(index)]
    return ordered[:limit] if limit else ordered


def _dist_description(dist: importlib.metadata.Distribution) -> str:
    meta = dist.metadata
    body = meta.get_payload() if hasattr(meta, "get_payload") else None
    return (body or meta.get("Description") or "").strip()


def _dist_license_files(dist: importlib.metadata.Distribution) -> list[str]:
    """Licence files inside the .dist-info folder, relative to that folder."""
    found = []
    for p in dist.files or []:
        parts = p.parts
        if len(parts) >= 2 and parts[0].endswith(".dist-info") and _LICENSE_FILE_RE.match(parts[-1]):
            found.append("/".join(parts[1:]))
    return sorted(found)


def _installed_dist(canonical_name: str) -> importlib.metadata.Distribution:
    try:
        return installed_dist_index()[canonical_name]
    except KeyError:
        raise FileNotFoundError(f"no installed distribution named {canonical_name!r}") from None


def _installed_dist_bytes(uri: str) -> bytes:
    rest = uri.split("://", 1)[1]
    name, _, rel = rest.partition("/")
    dist = _installed_dist(name)
    if rel == "DESCRIPTION":
        return _dist_description(dist).encode("utf-8")
    if rel not in _dist_license_files(dist):
        raise FileNotFoundError(f"{uri}: not a licence file of {name}")
    data = dist.read_text(rel)
    if data is None:
        raise FileNotFoundError(uri)
    return data.encode("utf-8")


def _dist_refs(dists: list[importlib.metadata.Distribution]) -> list[FileRef]:
    """Each distribution's description (if it has one) and licence files, versioned by its version."""
    refs = []
    for dist in dists:
        name = canonical_dist_name(dist.metadata["Name"])
        description = _dist_description(dist)
        texts = [("DESCRIPTION", description)] if description else []
        texts += [(rel, dist.read_text(rel) or "") for rel in _dist_license_files(dist)]
        refs += [FileRef(uri=f"{INSTALLED_DISTS_SCHEME}://{name}/{rel}", relpath=f"{name}/{rel}",
                         size=len(text.encode("utf-8")), etag=dist.version) for rel, text in texts]
    return refs


@dataclass(frozen=True)
class InstalledDistsScheme:
    """Virtual files of the running interpreter's distributions: never pinned, never changed under a
    reader (a distribution is listed at its version)."""

    name: str = INSTALLED_DISTS_SCHEME

    def declared_uri(self, uri: str, base_dir: Path, where: str) -> str:
        """With a pin file named relative to the sources file, made absolute (as every local path of a
        source is) and read once, so a bad pin file is refused at load."""
        spec = parse_installed_uri(uri, where)
        if spec.pins is None:
            return uri
        path = Path(spec.pins).expanduser()
        path = path if path.is_absolute() else base_dir / path
        try:
            read_pins(path)
        except SourceUriError as exc:
            raise SourceUriError(f"{where}.uri: {exc}") from None
        query = {"pins": str(path), **({"limit": str(spec.limit)} if spec.limit is not None else {})}
        return f"{INSTALLED_DISTS_SCHEME}://?{urllib.parse.urlencode(query, safe='/')}"

    def identity_uri(self, uri: str) -> str:
        """The pins by what they pin (the sha256 of their sorted ``name==version`` lines), not by the pin
        file's path: the bundled file sits inside each checkout, and a clone elsewhere reads the same
        distributions."""
        spec = parse_installed_uri(uri, "installed-dists")
        if spec.pins is None:
            return uri
        pinned = "".join(f"{name}=={version}\n" for name, version in read_pins(spec.pins))
        query = {"pins-sha256": hashlib.sha256(pinned.encode()).hexdigest(),
                 **({"limit": str(spec.limit)} if spec.limit is not None else {})}
        return f"{INSTALLED_DISTS_SCHEME}://?{urllib.parse.urlencode(query)}"

    def is_pinned(self, source: ListedSource) -> bool:
        return False  # what is installed is the machine's, never a classifier's training data

    def pinned_sha256(self, source: ListedSource) -> str | None:
        raise ValueError(f"{source.uri}: installed distributions are never pinned")

    def list_files(self, source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
        """The files of the installed distributions the URI names: every one, or the pinned ones (never
        a store's)."""
        spec = parse_installed_uri(source.uri, f"source {source.name!r}")
        if spec.pins is None:
            return _dist_refs(installed_distributions(spec.limit))
        refs, index = [], installed_dist_index()
        for name, version in read_pins(spec.pins)[:spec.limit]:
            dist = index.get(name)
            if dist is not None and dist.version == version:
                refs += _dist_refs([dist])
                continue
            found = "it is not installed" if dist is None else f"{dist.version} is installed"
            refs.append(FileRef(uri=f"{INSTALLED_DISTS_SCHEME}://{name}/DESCRIPTION", relpath=f"{name}/DESCRIPTION",
                                etag=version, refused=refusal(NOT_INSTALLED, f"{name}=={version} is pinned; {found}")))
        return refs

    def resolve_url(self, uri: str, expected_sha256: str | None) -> str:
        return uri  # a virtual file: no fsspec URL reads it

    def open(self, uri: str, expected_sha256: str | None, decompress: bool) -> contextlib.AbstractContextManager[
            BinaryIO]:
        return contextlib.nullcontext(io.BytesIO(_installed_dist_bytes(uri)))

    def open_stored(self, uri: str) -> contextlib.AbstractContextManager[BinaryIO]:
        return self.open(uri, None, decompress=False)

    def splits_by_byte_range(self, uri: str) -> bool:
        return False

    def file_state(self, uri: str) -> FileState | None:
        return None  # listed at its installed version


INSTALLED_DISTS = InstalledDistsScheme()
