"""Tokenization assets: tokenizer/<name>, tokenized/<source> (a Levanter cache root) and
mixture/<name> (Levanter's mixture data config). Declared in `registry.yaml`."""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from marin_assets.catalog import Catalog
from marin_assets.tokenization.cache import CacheConfig, build_levanter_cache, iter_parquet_texts
from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config
from marin_assets.tokenization.tokenizer import TokenizerConfig, adopt_tokenizer, train_bpe_tokenizer
from marin_resources.artifacts import (ArtifactHandle, Built, MarinStore, checked_manifest, marin_asset,
                                       materialize_artifact)
from marin_resources.environments import MarinSettings
from marin_resources.store import ArtifactStore

REGISTRY_PATH = Path(__file__).with_name("registry.yaml")
TOKENIZER_VERSION = "v1"
TOKENIZED_VERSION = "v1"
MIXTURE_VERSION = "v1"
ROUNDTRIP_SAMPLE = 32


class RegistryError(ValueError):
    pass


@dataclass(frozen=True)
class TokenizerEntry:
    name: str
    config: TokenizerConfig
    train_on: tuple[str, ...] = ()
    adopt: str | None = None


@dataclass(frozen=True)
class TokenizedEntry:
    source: str
    tokenizer: str
    cache: CacheConfig


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


def _known(cls, raw: dict, where: str, extra: set[str] = frozenset()) -> dict:
    allowed = {f.name for f in fields(cls)} | set(extra)
    unknown = set(raw) - allowed
    if unknown:
        raise RegistryError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    return raw


def load_registry(path: str | Path = REGISTRY_PATH) -> TokenizationRegistry:
    raw = yaml.safe_load(Path(path).read_text()) or {}
    tokenizers = {}
    for name, body in (raw.get("tokenizers") or {}).items():
        body = dict(body or {})
        train_on, adopt = tuple(body.pop("train_on", ())), body.pop("adopt", None)
        if bool(train_on) == bool(adopt):
            raise RegistryError(f"tokenizer {name!r}: give exactly one of train_on or adopt")
        _known(TokenizerConfig, body, f"tokenizer {name!r}")
        tokenizers[name] = TokenizerEntry(name, TokenizerConfig(**body), train_on, adopt)
    tokenized = {}
    for source, body in (raw.get("tokenized") or {}).items():
        body = dict(body or {})
        tok = body.pop("tokenizer", None)
        if tok not in tokenizers:
            raise RegistryError(f"tokenized {source!r}: tokenizer {tok!r} is not declared")
        tokenized[source] = TokenizedEntry(source, tok, CacheConfig(**_known(CacheConfig, body, f"tokenized {source!r}")))
    mixtures = {}
    for name, body in (raw.get("mixtures") or {}).items():
        comps = {c: float((v or {}).get("weight", 1.0)) for c, v in (body.get("components") or {}).items()}
        missing = [c for c in comps if c not in tokenized]
        if missing:
            raise RegistryError(f"mixture {name!r}: components {missing} have no tokenized entry")
        tok = body.get("tokenizer")
        if any(tokenized[c].tokenizer != tok for c in comps):
            raise RegistryError(f"mixture {name!r}: every component must use tokenizer {tok!r}")
        mixtures[name] = MixtureEntry(name, tok, comps)
    return TokenizationRegistry(tokenizers, tokenized, mixtures)


def restrict_to_sources(registry: TokenizationRegistry, sources: set[str]) -> TokenizationRegistry:
    """Drop entries that need a curated source this deployment does not declare (MARIN_SOURCES may
    name a different set), and everything that depends on them."""
    tokenizers = {n: e for n, e in registry.tokenizers.items() if set(e.train_on) <= sources}
    tokenized = {n: e for n, e in registry.tokenized.items() if n in sources and e.tokenizer in tokenizers}
    mixtures = {n: e for n, e in registry.mixtures.items() if set(e.weights) <= set(tokenized)}
    return TokenizationRegistry(tokenizers, tokenized, mixtures)


def parquet_files(store: ArtifactStore, uri: str) -> list[str]:
    """The deduplicated shards of the source artifact at `uri`, in shard order, as URIs."""
    manifest = store.read_manifest(uri)
    if manifest is None:
        raise dg.Failure(f"{uri} lost its manifest")
    return [f"{uri}/{f.path}" for f in sorted(manifest.files, key=lambda f: f.path)
            if f.path.startswith("data/") and f.path.endswith(".parquet")]


def build_tokenizer_asset(entry: TokenizerEntry):
    ins = {f"corpus_{src}": dg.AssetIn(key=dg.AssetKey(["deduplicated", src])) for src in entry.train_on}
    description = (f"Byte-level BPE tokenizer (vocab {entry.config.vocab_size}) trained on "
                   f"{', '.join(entry.train_on)}; a Hugging Face tokenizer directory that AutoTokenizer and "
                   "Levanter load offline." if entry.train_on else f"Tokenizer adopted from {entry.adopt}.")

    @marin_asset(key=f"tokenizer/{entry.name}", version=TOKENIZER_VERSION, ins=ins, group_name="tokenization",
                 identity={"tokenizer": asdict(entry.config), "adopt": entry.adopt},
                 kinds={"huggingface"}, description=description)
    def tokenizer(context: dg.AssetExecutionContext, store: MarinStore, **corpora: ArtifactHandle):
        artifacts = store.get()
        # The corpora's data versions are part of the identity: new data means a new tokenizer.
        identity = {"tokenizer": asdict(entry.config), "adopt": entry.adopt,
                    "corpora": {name.removeprefix("corpus_"): h.data_version for name, h in sorted(corpora.items())}}

        def build(writer) -> Built:
            out = str(writer.staging_dir())
            if entry.adopt:
                art = adopt_tokenizer(entry.adopt, out)
            else:
                files = [f for _, h in sorted(corpora.items()) for f in parquet_files(artifacts, h.uri)]
                art = train_bpe_tokenizer(iter_parquet_texts(files), entry.config, out)
            return Built(metrics={"vocab_size": art.vocab_size, "bos_token_id": art.bos_token_id,
                                  "eos_token_id": art.eos_token_id, "pad_token_id": art.pad_token_id,
                                  "tokenizer_json_sha256": art.tokenizer_json_sha256})

        return materialize_artifact(context, store, config=identity,
                                    upstream=[h for _, h in sorted(corpora.items())], build=build)

    return tokenizer


def build_tokenized_asset(entry: TokenizedEntry):
    key = f"tokenized/{entry.source}"

    @marin_asset(key=key, version=TOKENIZED_VERSION, group_name="tokenization", kinds={"levanter"},
                 identity={"cache": asdict(entry.cache)},
                 ins={"corpus": dg.AssetIn(key=dg.AssetKey(["deduplicated", entry.source])),
                      "tokenizer": dg.AssetIn(key=dg.AssetKey(["tokenizer", entry.tokenizer]))},
                 description=f"`{entry.source}` tokenized with tokenizer/{entry.tokenizer}. The artifact directory is "
                             "a Levanter cache root: `train/` and `validation/` are TreeCaches of `input_ids` "
                             "(BOS + text + EOS per document), validation chosen by a hash of the document id.")
    def tokenized(context: dg.AssetExecutionContext, store: MarinStore, corpus: ArtifactHandle,
                  tokenizer: ArtifactHandle):
        artifacts = store.get()

        def build(writer) -> Built:
            stats = build_levanter_cache(parquet_files(artifacts, corpus.uri), tokenizer.uri, writer.uri, entry.cache)
            metrics = {"documents": stats.documents, "tokens": stats.tokens, "text_bytes": stats.text_bytes,
                       "bytes_per_token": round(stats.bytes_per_token, 4),
                       "train_documents": stats.train.documents, "train_tokens": stats.train.tokens,
                       "validation_documents": stats.validation.documents,
                       "validation_tokens": stats.validation.tokens, "skipped_documents": stats.skipped_documents,
                       "shards_reused": stats.shards_reused, "shards_encoded": stats.shards_encoded}
            return Built(metrics=metrics, metadata={"dagster/row_count": stats.documents})

        # Resume keeps the previous cache so that unchanged upstream shards are reused, not re-encoded.
        return materialize_artifact(context, store, config={"cache": asdict(entry.cache)},
                                    upstream=[corpus, tokenizer], build=build, resume=True)

    @dg.asset_check(asset=tokenized, name="decode_roundtrip",
                    description=f"decode(encode(doc)) == doc on {ROUNDTRIP_SAMPLE} sampled documents, read back "
                                "through Levanter's TreeCache; row counts match the documents.")
    def roundtrip(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        from marin_assets.tokenization.cache import decode_roundtrip_check

        artifacts = store.get()
        manifest = checked_manifest(context, store, key, TOKENIZED_VERSION)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed cache"})
        refs = {u.asset_key: u for u in manifest.upstream}
        files = parquet_files(artifacts, refs[f"deduplicated/{entry.source}"].uri)
        failures = decode_roundtrip_check(manifest.uri, refs[f"tokenizer/{entry.tokenizer}"].uri, files,
                                          sample_n=ROUNDTRIP_SAMPLE)
        return dg.AssetCheckResult(passed=not failures, metadata={
            "sampled": ROUNDTRIP_SAMPLE, "failures": len(failures),
            "examples": dg.MetadataValue.json([f.__dict__ for f in failures[:5]])})

    return tokenized, roundtrip


def mixture_spec(entry: MixtureEntry, caches: dict[str, ArtifactHandle], tokenizer: ArtifactHandle,
                 seq_len: int = 1024) -> MixtureSpec:
    return MixtureSpec(name=entry.name, tokenizer_dir=tokenizer.uri, seq_len=seq_len, components={
        name: MixtureComponent(cache_root=caches[name].uri, weight=w) for name, w in sorted(entry.weights.items())})


def build_mixture_asset(entry: MixtureEntry):
    ins = {f"cache_{c}": dg.AssetIn(key=dg.AssetKey(["tokenized", c])) for c in entry.weights}
    ins["tokenizer"] = dg.AssetIn(key=dg.AssetKey(["tokenizer", entry.tokenizer]))
    identity = {"weights": dict(sorted(entry.weights.items())), "tokenizer": entry.tokenizer}

    @marin_asset(key=f"mixture/{entry.name}", version=MIXTURE_VERSION, identity=identity, ins=ins,
                 group_name="tokenization", kinds={"levanter"},
                 description=f"Training mixture `{entry.name}` ({', '.join(f'{c}: {w}' for c, w in entry.weights.items())}), "
                             "rendered to Levanter's mixture data config (`data.json`). Deterministic: same spec and "
                             "same cache data versions give the same bytes.")
    def mixture(context: dg.AssetExecutionContext, store: MarinStore, tokenizer: ArtifactHandle,
                **caches: ArtifactHandle):
        by_name = {k.removeprefix("cache_"): h for k, h in caches.items()}

        def build(writer) -> Built:
            data = render_levanter_data_config(mixture_spec(entry, by_name, tokenizer))
            writer.write_json("data.json", data)
            return Built(metrics={"components": len(by_name),
                                  "train_components": sum(1 for w in entry.weights.values() if w > 0)},
                         metadata={"data_config": dg.MetadataValue.json(data)})

        upstream = [tokenizer] + [h for _, h in sorted(by_name.items())]
        return materialize_artifact(context, store, config=identity, upstream=upstream, build=build)

    return mixture


def read_mixture_config(store: ArtifactStore, handle: ArtifactHandle) -> dict[str, Any]:
    with store.open(f"{handle.uri}/data.json") as fh:
        return json.load(fh)


def build_tokenization_stage(settings: MarinSettings, sources: set[str]) -> tuple[dg.Definitions, Catalog]:
    registry = restrict_to_sources(load_registry(REGISTRY_PATH), sources)
    catalog = Catalog()
    assets, checks = [], []
    for entry in registry.tokenizers.values():
        assets.append(build_tokenizer_asset(entry))
    for entry in registry.tokenized.values():
        asset, check = build_tokenized_asset(entry)
        catalog.add_identity(f"tokenized/{entry.source}", lambda p, e=entry: {"cache": asdict(e.cache)})
        assets.append(asset)
        checks.append(check)
    for entry in registry.mixtures.values():
        assets.append(build_mixture_asset(entry))
        catalog.add_identity(f"mixture/{entry.name}", lambda p, e=entry: {
            "weights": dict(sorted(e.weights.items())), "tokenizer": e.tokenizer})
    return dg.Definitions(assets=assets, asset_checks=checks), catalog
