"""Curation configuration: the sources file's schema (`SourceConfig`, `CurationConfig`) and its
parsing, from YAML or from a project file's sections over the built-in file.

A source's ``uri`` is checked and made absolute by its scheme (schemes/) when the file is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marin_assets.curation.filters import FilterConfig, LanguageIdConfig
from marin_assets.curation.formats import EXACT_PARAGRAPHS, FORMATS, resolve_format
from marin_assets.curation.pii import PiiConfig
from marin_assets.curation.quality import CLASSIFIER, QualityConfig
from marin_assets.curation.schemes.base import SourceUriError, absolute_uri
from marin_assets.curation.schemes.registry import scheme_of
from marin_assets.curation.url_filter import UrlBlocklistError, read_url_blocklist
from marin_resources.config_identity import config_identity, derived, identity
from marin_resources.keys import NAME_RULE, is_safe_name
from marin_resources.typed_config import ConfigError, FieldProblem, decode, read_yaml, typed_config

# About 128 MB of input per partition: 100k small files make a few hundred partitions, not 100k runs.
DEFAULT_BYTES_PER_SHARD = 128 * 2**20
# Sane bytes_per_shard. Below one 4 KiB block nearly every file is a shard of its own and a JSONL file
# is cut into runs of a few lines each, every run seconds of start-up for milliseconds of work
# (`files_per_shard: 1` says one shard per file directly). Above 16 GiB one run copies and reads
# up to twice that on one worker, and a failure redoes all of it.
MIN_BYTES_PER_SHARD = 4 * 2**10
MAX_BYTES_PER_SHARD = 16 * 2**30


class SourceConfigError(ConfigError):
    """A sources YAML file is invalid; the message names the source and field."""


@typed_config
@dataclass(frozen=True)
class SourceConfig:
    name: str = identity()
    # fsspec URL or special scheme; relative paths are already resolved
    # against the YAML file's directory.
    uri: str = identity()
    format: str = identity("auto")
    text_field: str = identity("text")
    # Record field used as ``source_id``; default is ``path:line`` / ``path:row``.
    id_field: str | None = identity(None)
    # Expected bytes of input per shard, by listed file size (the default). See group_into_shards.
    bytes_per_shard: int | None = identity(DEFAULT_BYTES_PER_SHARD)
    # Alternative to bytes_per_shard: expected files per shard (1: one shard per file).
    files_per_shard: int | None = identity(None)
    # Records (files, lines, rows) larger than this are quarantined.
    max_doc_bytes: int = identity(16 * 2**20)
    strip_gutenberg: bool = identity(True)
    # A matched .tar/.tgz/.zip file is read as its members, one file each.
    expand_archives: bool = identity(True)
    # Read symlinks that resolve outside the source root. Off: such a link is quarantined
    # (reason outside_root) and not one byte of its target is read.
    follow_symlinks: bool = identity(False)
    # Expected sha256 of a pypi-sdist download; a mismatch is an error.
    sha256: str | None = identity(None)
    filters: FilterConfig = identity(default_factory=FilterConfig, scopes=[CLASSIFIER])
    # Passed through unvalidated to the deduplication stage, which owns its schema.
    dedup: Mapping[str, Any] = identity(default_factory=dict, scopes=[CLASSIFIER])
    # PII removal in filtered/: true, false, or a PiiConfig mapping; None: on for web formats (see pii_of).
    pii: bool | PiiConfig | None = derived("filtered/: pii_of(source)", None)
    # A local file of blocked hosts and URLs (url_filter.py); documents whose `url` it lists are dropped.
    url_blocklist: str | None = derived("filtered/: the sha256 of the block list", None)


WEB_FORMATS = ("html", "warc")
# Formats whose sources get the default PII pass without `pii:`: pages from the web, and
# conversations (people write their addresses into chats).
PII_BY_DEFAULT_FORMATS = (*WEB_FORMATS, "chat")
# What a chat source may not set: what only its skipped steps read (formats.SKIPPED_STEPS), and
# `text_field` (its turns are always in `messages`). Refused in one line rather than ignored.
_NOT_FOR_CHAT = {"filters": "its heuristic filters and language id are skipped for chat data",
                 "url_blocklist": "the URL block list is skipped for chat data",
                 "text_field": "a chat record holds its turns in 'messages'"}


def reading_identity(source: SourceConfig) -> dict[str, Any]:
    """The fields of a source that decide what raw/ and documents/ hold (those of every identity of it),
    its uri as its scheme names the data."""
    return {**config_identity(source), "uri": scheme_of(source.uri).identity_uri(source.uri)}


def pii_of(source: SourceConfig) -> PiiConfig | None:
    """What the PII pass replaces in a source's documents, None for no pass: as declared, else
    the defaults for web sources (format html or warc, or auto with a uri that names such files)
    and chat sources, and none for the others."""
    if isinstance(source.pii, PiiConfig):
        return source.pii
    on = resolve_format(source.format, source.uri) in PII_BY_DEFAULT_FORMATS if source.pii is None else source.pii
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


_SOURCE_KEYS = {f.name for f in dataclasses.fields(SourceConfig)}
_QUALITY_EXTRA_KEYS = ("positive_sources", "negative_sources", "sources")


def _parse_source(raw: Any, index: int, base_dir: Path, global_filters: FilterConfig) -> SourceConfig:
    if not isinstance(raw, Mapping):
        raise SourceConfigError(f"sources[{index}]: expected a mapping, got {raw!r}")
    name = raw.get("name")
    if not is_safe_name(name):
        raise SourceConfigError(f"sources[{index}].name: {name!r} is not a safe source name ({NAME_RULE})")
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
    if fmt == "chat":
        for key, why in _NOT_FOR_CHAT.items():
            if key in raw:
                raise SourceConfigError(f"{where}.{key}: not for a chat source ({why}; docs/post-training.md)")
        if isinstance(raw.get("dedup"), Mapping) and raw["dedup"].get(EXACT_PARAGRAPHS):
            raise SourceConfigError(f"{where}.dedup.{EXACT_PARAGRAPHS}: not for a chat source (removing lines from "
                                    "its text would part it from its turns; docs/post-training.md)")
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
    try:
        scheme = scheme_of(cfg.uri)
    except SourceUriError as exc:
        raise SourceConfigError(f"{where}.uri: {exc}") from None
    try:
        uri = scheme.declared_uri(cfg.uri, base_dir, where)
    except SourceUriError as exc:
        raise SourceConfigError(str(exc)) from None
    blocklist = cfg.url_blocklist
    if blocklist is not None:
        if "://" in blocklist:
            raise SourceConfigError(f"{where}.url_blocklist: a local file path, got {blocklist!r} (nothing is "
                                    "downloaded)")
        blocklist = absolute_uri(blocklist, base_dir)
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
    return dataclasses.replace(language_id, model_uri=absolute_uri(language_id.model_uri, base))


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
        quality = dataclasses.replace(quality, model_uri=absolute_uri(quality.model_uri, base))
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
            if src.format == "chat":
                raise SourceConfigError(f"quality.{key}: source {src.name!r} is chat data; the quality classifier "
                                        "judges prose and is skipped for chat sources (docs/post-training.md)")
            if not scheme_of(src.uri).is_pinned(src):
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
        else inherited.quality_sources if previous is not None else tuple(s.name for s in sources
                                                                          if s.format != "chat")
    for name in scored:
        if name not in declared:
            raise SourceConfigError(f"quality.sources: {name!r} is not a declared source")
        if declared[name].format == "chat":
            raise SourceConfigError(f"quality.sources: {name!r} is chat data; the quality score is skipped for chat "
                                    "sources (docs/post-training.md)")
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
