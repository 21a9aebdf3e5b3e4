"""The tokenization registry (`registry.yaml`, or the file MARIN_REGISTRY names): which tokenizers,
token caches and mixtures a deployment declares, read and checked into typed entries. The store
versions of the three artifacts live here too. No Dagster: the deployment reads this module, and
the stage's assets (`tokenization/assets.py`) are built from what it returns."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from marin_assets.tokenization.cache import CacheConfig
from marin_assets.tokenization.tokenizer import TokenizerConfig
from marin_resources.identity import InvalidPartitionKeyError, validate_partition_key
from marin_resources.typed_config import ConfigError, FieldProblem, decode, typed_config

REGISTRY_PATH = Path(__file__).with_name("registry.yaml")
# v2: a trained tokenizer is pinned to the corpus it was first trained on (recorded in its identity,
# not in its upstream), so new shards no longer retrain it.
TOKENIZER_VERSION = "v2"
TOKENIZED_VERSION = "v1"
MIXTURE_VERSION = "v1"


class RegistryError(ConfigError):
    pass


@dataclass(frozen=True)
class TokenizerEntry:
    name: str
    config: TokenizerConfig
    train_on: tuple[str, ...] = ()
    adopt: str | None = None
    # The store version; a new one retrains (or re-adopts). The only way a pinned tokenizer changes.
    version: str = TOKENIZER_VERSION


@typed_config
@dataclass(frozen=True)
class ValidationFloor:
    """Below these, `tokenized/<source>`'s `validation_size` check warns: a validation split this small
    measures loss and bits-per-byte with little confidence. A check policy, not part of the identity."""

    documents: int = 5
    tokens: int = 5_000


@dataclass(frozen=True)
class TokenizedEntry:
    source: str
    tokenizer: str
    cache: CacheConfig
    validation_floor: ValidationFloor = ValidationFloor()


@dataclass(frozen=True)
class MixtureEntry:
    name: str
    tokenizer: str
    weights: dict[str, float]


@dataclass(frozen=True)
class TokenizationRegistry:
    tokenizers: dict[str, TokenizerEntry]
    tokenized: dict[str, TokenizedEntry]
    mixtures: dict[str, MixtureEntry]
    # What a curated source without a `tokenized:` entry gets (source "*"); None: nothing.
    default: TokenizedEntry | None = None


def _decoded(tp: type, raw: Any, where: str) -> Any:
    try:
        return decode(tp, raw)
    except FieldProblem as exc:
        raise RegistryError(f"{where}: field {exc.dotted!r}: {exc.problem}") from None


def _tokenized_entry(source: str, body: dict | None, tokenizers: dict[str, TokenizerEntry],
                     where: str) -> TokenizedEntry:
    body = dict(body or {})
    tok = body.pop("tokenizer", None)
    if tok not in tokenizers:
        raise RegistryError(f"{where}: tokenizer {tok!r} is not declared")
    floor = _decoded(ValidationFloor, body.pop("validation_floor", None) or {}, f"{where}.validation_floor")
    if floor.documents < 0 or floor.tokens < 0:
        raise RegistryError(f"{where}.validation_floor: documents and tokens must be >= 0, got {floor}")
    return TokenizedEntry(source, tok, _decoded(CacheConfig, body, where), floor)


def load_registry(path: str | Path = REGISTRY_PATH) -> TokenizationRegistry:
    path = Path(path)
    if not path.is_file():
        raise RegistryError(f"tokenization registry not found: {path} (MARIN_REGISTRY names another file)")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {"tokenizers", "tokenized", "default", "mixtures"}
    if unknown:
        raise RegistryError(f"{path}: unknown section(s) {sorted(unknown)}; allowed: default, mixtures, tokenized, "
                            "tokenizers")
    tokenizers = {}
    for name, body in (raw.get("tokenizers") or {}).items():
        body = dict(body or {})
        train_on, adopt = tuple(body.pop("train_on", ())), body.pop("adopt", None)
        version = str(body.pop("version", TOKENIZER_VERSION))
        if bool(train_on) == bool(adopt):
            raise RegistryError(f"tokenizer {name!r}: give exactly one of train_on or adopt")
        try:
            validate_partition_key(version)
        except InvalidPartitionKeyError as e:
            raise RegistryError(f"tokenizer {name!r}: version {version!r} is not a valid path segment: {e}") from e
        tokenizers[name] = TokenizerEntry(name, _decoded(TokenizerConfig, body, f"tokenizer {name!r}"), train_on,
                                          adopt, version)
    tokenized = {source: _tokenized_entry(source, body, tokenizers, f"tokenized {source!r}")
                 for source, body in (raw.get("tokenized") or {}).items()}
    default = _tokenized_entry("*", raw["default"], tokenizers, "default") if raw.get("default") else None
    mixtures = {}
    for name, body in (raw.get("mixtures") or {}).items():
        comps = {c: float((v or {}).get("weight", 1.0)) for c, v in (body.get("components") or {}).items()}
        entries = {c: tokenized.get(c, default) for c in comps}
        missing = [c for c, e in entries.items() if e is None]
        if missing:
            raise RegistryError(f"mixture {name!r}: components {missing} have no tokenized entry and no default")
        tok = body.get("tokenizer")
        if any(e.tokenizer != tok for e in entries.values()):
            raise RegistryError(f"mixture {name!r}: every component must use tokenizer {tok!r}")
        mixtures[name] = MixtureEntry(name, tok, comps)
    return TokenizationRegistry(tokenizers, tokenized, mixtures, default)


def registry_for_sources(registry: TokenizationRegistry, sources: set[str]) -> TokenizationRegistry:
    """The entries this deployment can build: every curated source gets `tokenized/<source>`, from its
    own entry or the default one; entries that need a source this deployment does not declare
    (MARIN_SOURCES may name a different set) are dropped, with everything that depends on them.
    The default applies only where its tokenizer can be built here."""
    tokenizers = {n: e for n, e in registry.tokenizers.items() if set(e.train_on) <= sources}
    tokenized = {n: e for n, e in registry.tokenized.items() if n in sources and e.tokenizer in tokenizers}
    if registry.default is not None and registry.default.tokenizer in tokenizers:
        for source in sorted(sources - set(registry.tokenized)):
            tokenized[source] = replace(registry.default, source=source)
    mixtures = {n: e for n, e in registry.mixtures.items() if set(e.weights) <= set(tokenized)}
    return TokenizationRegistry(tokenizers, tokenized, mixtures, registry.default)
