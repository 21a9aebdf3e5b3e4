"""The tokenization registry (`registry.yaml`, or the file MARIN_REGISTRY names): which tokenizers,
token caches and mixtures a deployment declares, read and checked into typed entries. The store
versions of the three artifacts live here too. No Dagster: the deployment reads this module, and
the stage's assets (`tokenization/assets.py`) are built from what it returns."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from marin_assets.tokenization.cache_config import CacheConfig, ChatCacheConfig
from marin_assets.tokenization.tokenizer import TokenizerConfig
from marin_resources.config_identity import derived, identity, runtime
from marin_resources.keys import NAME_RULE, is_safe_name
from marin_resources.project import REGISTRY_SECTIONS
from marin_resources.storage.identity import InvalidPartitionKeyError, validate_partition_key
from marin_resources.typed_config import ConfigError, FieldProblem, decode, read_yaml, typed_config

REGISTRY_PATH = Path(__file__).with_name("registry.yaml")
# v2: a trained tokenizer is pinned to the corpus it was first trained on (recorded in its identity,
# not in its upstream), so new shards no longer retrain it.
TOKENIZER_VERSION = "v2"
TOKENIZED_VERSION = "v1"
TOKEN_SHARDS_VERSION = "v1"
MIXTURE_VERSION = "v1"
EVAL_NGRAMS_VERSION = "v1"
DECONTAMINATED_VERSION = "v1"


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

    documents: int = runtime(5)
    tokens: int = runtime(5_000)


@typed_config
@dataclass(frozen=True)
class DecontaminationPolicy:
    """What `decontaminated/<source>` does with a training document that shares eval n-grams: with
    `mode: drop` (the default) it leaves the corpus, a row of the shard's `dropped/<shard>.parquet` with the
    reason `contaminated`; with `mode: mark` it stays, listed in the shard's `marked/<shard>.parquet`.
    A document is contaminated when at least `min_matching_ngrams` of its distinct n-grams are eval
    n-grams. Part of the shards' identity."""

    mode: Literal["drop", "mark"] = identity("drop")
    min_matching_ngrams: int = identity(1)

    def __post_init__(self) -> None:
        if self.min_matching_ngrams < 1:
            raise ValueError(f"min_matching_ngrams must be at least 1, got {self.min_matching_ngrams}")


@typed_config
@dataclass(frozen=True)
class DecontaminationSettings:
    """The registry's `decontamination:` section: the n-gram size of the `eval_ngrams/<source>` indexes,
    and eval sets held as files (`name: path`, JSON lines with a `text` field; a relative path is read
    from the directory of the file that declares it), which every source is checked against besides
    its own validation split and its mixture partners'."""

    ngram: int = identity(13)
    eval_texts: dict[str, str] = derived("eval_ngrams/: the sha256 of each eval set file", default_factory=dict)
    validation_splits: bool = derived("eval_ngrams/: the validation splits it names (reference_sources)", True)
    """Check training text against the validation splits (a source's own and its mixture partners') as
    well as the eval sets. Off, the indexes hold the eval sets alone: at terabytes, where a split's
    n-grams would not fit a worker and a split that grows with each shard would check every shard
    again (docs/scaling-out.md)."""

    def __post_init__(self) -> None:
        if self.ngram < 1:
            raise ValueError(f"ngram must be at least 1, got {self.ngram}")


@dataclass(frozen=True)
class TokenizedEntry:
    source: str
    tokenizer: str
    cache: CacheConfig
    validation_floor: ValidationFloor = ValidationFloor()
    decontamination: DecontaminationPolicy = DecontaminationPolicy()


MIXTURE_FORMATS = ("text", "chat", "mixed")


@dataclass(frozen=True)
class MixtureEntry:
    name: str = derived("its key, mixture/<name>")
    tokenizer: str = identity()
    weights: dict[str, float] = identity()
    # What its components are: text caches (pretraining, the default), chat caches (loss on the
    # assistant's turns), or either, declared (`mixed`).
    format: str = identity("text", omit="default")


@dataclass(frozen=True)
class TokenizationRegistry:
    tokenizers: dict[str, TokenizerEntry]
    tokenized: dict[str, TokenizedEntry]
    mixtures: dict[str, MixtureEntry]
    # What a curated source without a `tokenized:` entry gets (source "*"); None: nothing.
    default: TokenizedEntry | None = None
    decontamination: DecontaminationSettings = DecontaminationSettings()


def _decoded(tp: type, raw: Any, where: str) -> Any:
    try:
        return decode(tp, raw)
    except FieldProblem as exc:
        raise RegistryError(f"{where}: field {exc.dotted!r}: {exc.problem}" if exc.path
                            else f"{where}: {exc.problem}") from None


def _tokenized_entry(source: str, body: dict | None, tokenizers: dict[str, TokenizerEntry],
                     where: str) -> TokenizedEntry:
    body = dict(body or {})
    tok = body.pop("tokenizer", None)
    if tok not in tokenizers:
        raise RegistryError(f"{where}: tokenizer {tok!r} is not declared")
    floor = _decoded(ValidationFloor, body.pop("validation_floor", None) or {}, f"{where}.validation_floor")
    if floor.documents < 0 or floor.tokens < 0:
        raise RegistryError(f"{where}.validation_floor: documents and tokens must be >= 0, got {floor}")
    policy = _decoded(DecontaminationPolicy, body.pop("decontamination", None) or {}, f"{where}.decontamination")
    return TokenizedEntry(source, tok, _decoded(CacheConfig, body, where), floor, policy)


_MIXTURE_KEYS = ("tokenizer", "components", "format")


def load_registry(path: str | Path = REGISTRY_PATH) -> TokenizationRegistry:
    path = Path(path)
    if not path.is_file():
        raise RegistryError(f"tokenization registry not found: {path} (MARIN_REGISTRY names another file)")
    return parse_registry(read_yaml(path, "tokenization registry", RegistryError) or {}, str(path))


def parse_registry(raw: Any, origin: str, extends: TokenizationRegistry | None = None) -> TokenizationRegistry:
    """A registry from parsed YAML; every error names ``origin`` and the entry.

    With ``extends`` (a project file's sections over the built-in registry) each entry adds to
    ``extends``'s or replaces the one of its name, `default:` replaces the default, and every mixture,
    old or new, is checked against the entries it now resolves to."""
    try:
        return _parse_registry(raw, extends, Path(origin).parent)
    except RegistryError as exc:
        raise RegistryError(f"{origin}: {exc}") from None


def _parse_registry(raw: Any, extends: TokenizationRegistry | None, directory: Path) -> TokenizationRegistry:
    if not isinstance(raw, dict):
        raise RegistryError(f"expected a mapping of sections ({', '.join(REGISTRY_SECTIONS)}), got {raw!r}")
    unknown = set(raw) - set(REGISTRY_SECTIONS)
    if unknown:
        raise RegistryError(f"unknown section(s) {sorted(unknown)}; allowed: {', '.join(sorted(REGISTRY_SECTIONS))}")
    tokenizers = dict(extends.tokenizers) if extends else {}
    for name, body in _section(raw, "tokenizers").items():
        tokenizers[name] = _tokenizer_entry(name, body)
    tokenized = dict(extends.tokenized) if extends else {}
    for source, body in _section(raw, "tokenized").items():
        tokenized[source] = _tokenized_entry(source, body, tokenizers, f"tokenized {source!r}")
    default = extends.default if extends else None
    if raw.get("default"):
        default = _tokenized_entry("*", raw["default"], tokenizers, "default")
    mixtures = dict(extends.mixtures) if extends else {}
    for name, body in _section(raw, "mixtures").items():
        mixtures[name] = _mixture_entry(name, body)
    for mixture in mixtures.values():
        entries = {c: tokenized.get(c, default) for c in mixture.weights}
        missing = [c for c, e in entries.items() if e is None]
        if missing:
            raise RegistryError(f"mixture {mixture.name!r}: components {missing} have no tokenized entry and no "
                                "default")
        others = sorted({e.tokenizer for e in entries.values()} - {mixture.tokenizer})
        if others:
            raise RegistryError(f"mixture {mixture.name!r}: every component must use tokenizer "
                                f"{mixture.tokenizer!r}; some use {others}")
    decontamination = extends.decontamination if extends else DecontaminationSettings()
    if raw.get("decontamination"):
        decontamination = _decoded(DecontaminationSettings, raw["decontamination"], "decontamination")
        # Eval sets of the extended registry stay; a name given again is replaced.
        decontamination = replace(decontamination, eval_texts={
            **(extends.decontamination.eval_texts if extends else {}),
            **{name: str(directory / path) for name, path in decontamination.eval_texts.items()}})
    return TokenizationRegistry(tokenizers, tokenized, mixtures, default, decontamination)


def _section(raw: dict, name: str) -> dict:
    section = raw.get(name) or {}
    if not isinstance(section, dict):
        raise RegistryError(f"{name}: expected a mapping of name to entry, got {section!r}")
    return section


def _tokenizer_entry(name: str, body: Any) -> TokenizerEntry:
    where = f"tokenizer {name!r}"
    _require_safe_name(name, where)
    if body is not None and not isinstance(body, dict):
        raise RegistryError(f"{where}: expected a mapping, got {body!r}")
    body = dict(body or {})
    train_on = _decoded(tuple[str, ...], body.pop("train_on", ()), f"{where}.train_on")
    adopt = _decoded(str | None, body.pop("adopt", None), f"{where}.adopt")
    version = str(body.pop("version", TOKENIZER_VERSION))
    if bool(train_on) == bool(adopt):
        raise RegistryError(f"{where}: give exactly one of train_on or adopt")
    try:
        validate_partition_key(version)
    except InvalidPartitionKeyError as e:
        raise RegistryError(f"{where}: version {version!r} is not a valid path segment: {e}") from e
    return TokenizerEntry(name, _decoded(TokenizerConfig, body, where), train_on, adopt, version)


def _require_safe_name(name: Any, where: str) -> None:
    if not is_safe_name(name):
        raise RegistryError(f"{where}: not a safe name ({NAME_RULE})")


def _mixture_entry(name: str, body: Any) -> MixtureEntry:
    where = f"mixture {name!r}"
    _require_safe_name(name, where)
    if not isinstance(body, dict):
        raise RegistryError(f"{where}: expected a mapping with tokenizer and components, got {body!r}")
    unknown = sorted(set(body) - set(_MIXTURE_KEYS))
    if unknown:
        raise RegistryError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(_MIXTURE_KEYS)})")
    tokenizer = _decoded(str, body.get("tokenizer"), f"{where}.tokenizer")
    components = body.get("components")
    if not isinstance(components, dict) or not components:
        raise RegistryError(f"{where}.components: expected a mapping of source to {{weight: W}}, got {components!r}")
    weights = {}
    for component, value in components.items():
        value = value or {}
        if not isinstance(value, dict) or set(value) - {"weight"}:
            raise RegistryError(f"{where}.components.{component}: expected {{weight: W}}, got {value!r}")
        weight = _decoded(float, value.get("weight", 1.0), f"{where}.components.{component}.weight")
        if weight < 0:  # NaN and infinities are refused by the decoder
            raise RegistryError(f"{where}.components.{component}.weight: must be >= 0 (0: validation only), "
                                f"got {weight}")
        weights[component] = weight
    if not any(weight > 0 for weight in weights.values()):
        raise RegistryError(f"{where}.components: at least one component needs a weight > 0, got {weights}")
    mixture_format = body.get("format", "text")
    if mixture_format not in MIXTURE_FORMATS:
        raise RegistryError(f"{where}.format: one of {', '.join(MIXTURE_FORMATS)}, got {mixture_format!r}")
    return MixtureEntry(name, tokenizer, weights, mixture_format)


def registry_for_sources(registry: TokenizationRegistry, sources: set[str],
                         chat_sources: frozenset[str] = frozenset()) -> TokenizationRegistry:
    """The entries this deployment can build: every curated source gets `tokenized/<source>`, from its
    own entry or the default one; entries that need a source this deployment does not declare
    (MARIN_SOURCES may name a different set) are dropped, with everything that depends on them.
    The default applies only where its tokenizer can be built here.

    A chat source (``chat_sources``, of ``sources``) gets a chat cache (turns through a chat template,
    with the assistant mask; docs/post-training.md) from its own `tokenized:` entry only: the default
    is a text cache, which would train on role labels as prose. Refused in one line: a text entry's
    `chat:` settings, a tokenizer trained on a chat source, and a mixture that mixes chat and text
    caches without declaring it (`format: mixed`), or of the other format than it declares."""
    for name, entry in registry.tokenizers.items():
        if set(entry.train_on) & chat_sources:
            raise RegistryError(f"tokenization registry: tokenizers.{name}.train_on: "
                                f"{sorted(set(entry.train_on) & chat_sources)[0]!r} is a chat source; a tokenizer is "
                                "trained on prose (a chat source's plain rendering carries role labels)")
    for source, entry in registry.tokenized.items():
        if entry.cache.chat is not None and source in sources - chat_sources:
            raise RegistryError(f"tokenization registry: tokenized.{source}.chat: {source!r} is not a chat source "
                                "(`format: chat`); a text cache has no chat template")
    text_sources = sources - chat_sources
    tokenizers = {n: e for n, e in registry.tokenizers.items() if set(e.train_on) <= text_sources}
    tokenized = {n: e if n in text_sources or e.cache.chat is not None
                 else replace(e, cache=replace(e.cache, chat=ChatCacheConfig()))
                 for n, e in registry.tokenized.items() if n in sources and e.tokenizer in tokenizers}
    if registry.default is not None and registry.default.tokenizer in tokenizers:
        for source in sorted(text_sources - set(registry.tokenized)):
            tokenized[source] = replace(registry.default, source=source)
    for name, mixture in registry.mixtures.items():
        kinds = {c: "chat" if c in chat_sources else "text" for c in mixture.weights if c in tokenized}
        other = sorted(c for c, kind in kinds.items() if kind != mixture.format)
        if mixture.format != "mixed" and other:
            raise RegistryError(f"tokenization registry: mixtures.{name}: {other[0]!r} is a {kinds[other[0]]} cache in "
                                f"a {mixture.format} mixture; declare `format: mixed` to train on both (the chat "
                                "caches' loss on the assistant's turns, the text caches' on every token)")
    mixtures = {n: e for n, e in registry.mixtures.items() if set(e.weights) <= set(tokenized)}
    return TokenizationRegistry(tokenizers, tokenized, mixtures, registry.default, registry.decontamination)
