"""Tokenization assets: tokenizer/<name>, tokenized/<source> (a Levanter cache root) and
mixture/<name> (Levanter's mixture data config). Declared in `registry.yaml` (or the file named by
MARIN_REGISTRY, read into `MarinSettings.registry_file`), extended by the project file's sections."""

import json
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import dagster as dg

from marin_assets.automation import FOLLOWS_NEW_DATA
from marin_assets.catalog import Catalog
from marin_assets.tokenization.assembly import assemble_levanter_cache, held_shards, split_by_fraction_alone
from marin_assets.tokenization.cache import appended_shard_keys, cache_shard_order, iter_parquet_texts
from marin_assets.tokenization.cache_config import CacheConfig
from marin_assets.tokenization.cache_format import MANIFEST_NAME as CACHE_MANIFEST
from marin_assets.tokenization.cache_format import read_json
from marin_assets.tokenization.chat_template import chat_counts
from marin_assets.tokenization.decontamination_assets import (
    build_decontamination_assets,
    decontaminated_identity,
    eval_ngrams_key,
    shard_file,
)
from marin_assets.tokenization.encoding import ROWS, ShardSpec, encode_shard_rows
from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config
from marin_assets.tokenization.registry import (
    DECONTAMINATED_VERSION,
    MIXTURE_VERSION,
    TOKEN_SHARDS_VERSION,
    TOKENIZED_VERSION,
    MixtureEntry,
    TokenizationRegistry,
    TokenizedEntry,
    TokenizerEntry,
    ValidationFloor,
)
from marin_assets.tokenization.tokenizer import adopt_tokenizer, train_bpe_tokenizer
from marin_resources.artifact_spec import ArtifactSpec, FileRead
from marin_resources.artifacts import (
    CHECKED_SHARDS_AT_MOST,
    ArtifactHandle,
    Built,
    MarinStore,
    checked_manifest,
    checked_shards,
    input_of,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.config_identity import config_identity
from marin_resources.data_parallel import DataParallel
from marin_resources.environments import MarinSettings, store_resource
from marin_resources.keys import asset_key, shard_partitions
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, FileEntry, Manifest

if TYPE_CHECKING:
    from marin_assets.deployment import Deployment  # which reads tokenization/registry.py

ROUNDTRIP_SAMPLE = 32

def corpus_files(store: ArtifactStore, uri: str) -> dict[str, str]:
    """The deduplicated shards of the source artifact at `uri`, in shard order: URI -> the sha256
    its manifest records (committed shards keep their bytes, so this recognises them)."""
    manifest = store.read_manifest(uri)
    if manifest is None:
        raise dg.Failure(f"{uri} lost its manifest")
    return {f"{uri}/{f.path}": f"sha256={f.sha256}" for f in sorted(manifest.files, key=lambda f: f.path)
            if f.path.startswith("data/") and f.path.endswith(".parquet")}


def parquet_files(store: ArtifactStore, uri: str) -> list[str]:
    return list(corpus_files(store, uri))


# ---- pinned tokenizers ---------------------------------------------------------------------------


def tokenizer_identity(entry: TokenizerEntry, corpora: dict[str, str]) -> dict[str, Any]:
    """A tokenizer's identity: its settings and the data versions of the corpora it was trained on
    (the pin). The corpora are not upstream dependencies of the artifact: once trained it stays."""
    return {"tokenizer": config_identity(entry.config), "adopt": entry.adopt, "corpora": dict(sorted(corpora.items()))}


def tokenizer_spec(entry: TokenizerEntry, store: Callable[[], ArtifactStore]) -> ArtifactSpec:
    """A pinned tokenizer's identity is its settings and the corpora of its first build: once one is
    committed, the corpora it recorded (``store``: where it is looked up); before, decided by that
    build from its inputs (`materialize_artifact`'s ``first_identity``)."""
    key = f"tokenizer/{entry.name}"

    def identity(_partition: str | None) -> dict[str, Any] | None:
        previous = store().find(key, entry.version, None)
        return None if previous is None else tokenizer_identity(entry, dict(previous.config.get("corpora") or {}))

    return ArtifactSpec(key, entry.version, identity, note=pin_note, code_identity={
        "tokenizer": config_identity(entry.config), "adopt": entry.adopt, "train_on": list(entry.train_on)})


def pin_note(manifest: Manifest, store: ArtifactStore) -> str | None:
    """What `marin status` says about a fresh tokenizer: the corpus it is pinned to, and whether the
    corpus has grown since."""
    pinned = manifest.metrics.get("pinned_corpus") or {}
    if not pinned:
        return None
    parts = []
    for source, pin in sorted(pinned.items()):
        current = store.find(f"deduplicated/{source}", pin["code_version"], None)
        now = "gone" if current is None else (
            "unchanged" if current.data_version == pin["data_version"] else f"now {current.data_version[:12]}")
        parts.append(f"deduplicated/{source}@{pin['data_version'][:12]} ({now})")
    return (f"pinned to {', '.join(parts)}; new shards do not retrain it "
            f"(retrain: a new `version:` in the registry)")


def build_tokenizer_asset(entry: TokenizerEntry, catalog: Catalog, store: Callable[[], ArtifactStore],
                          corpora: Mapping[str, ArtifactSpec]):
    """``corpora``: the `deduplicated/<source>` spec of each source, as the curation stage declared it."""
    spec = tokenizer_spec(entry, store)
    key = spec.key
    ins = {f"corpus_{src}": input_of(corpora[src]) for src in entry.train_on}
    description = (f"Byte-level BPE tokenizer (vocab {entry.config.vocab_size}) trained on "
                   f"{', '.join(entry.train_on)}; a Hugging Face tokenizer directory that AutoTokenizer and "
                   "Levanter load offline. Pinned: trained once on the corpus as it was then; new shards do not "
                   "retrain it (a new `version:` in the registry does)." if entry.train_on
                   else f"Tokenizer adopted from {entry.adopt}.")

    @catalog.asset(spec, ins=ins, group_name="tokenization", kinds={"huggingface"},
                   tags={"marin/tokenizer": entry.name}, description=description)
    def tokenizer(context: dg.AssetExecutionContext, store: MarinStore, **corpora: ArtifactHandle):
        artifacts = store.get()
        current = {name.removeprefix("corpus_"): h for name, h in sorted(corpora.items())}
        trained_on = {src: h.data_version for src, h in current.items()}
        # Source -> the corpus data version the tokenizer is pinned to: the committed one's, else today's.
        committed = spec.identity(None)
        pin = trained_on if committed is None else committed["corpora"]

        def build(writer) -> Built:
            if pin != trained_on:  # only a missing tokenizer is built, and it pins today's corpora
                raise dg.Failure(f"{key}: pinned to {pin} but would train on {trained_on}")
            out = str(writer.staging_dir())
            if entry.adopt:
                art = adopt_tokenizer(entry.adopt, out)
            else:
                files = [f for _, h in sorted(current.items()) for f in parquet_files(artifacts, h.uri)]
                art = train_bpe_tokenizer(iter_parquet_texts(files), entry.config, out)
            return Built(metrics={"vocab_size": art.vocab_size, "bos_token_id": art.bos_token_id,
                                  "eos_token_id": art.eos_token_id, "pad_token_id": art.pad_token_id,
                                  "tokenizer_json_sha256": art.tokenizer_json_sha256,
                                  "pinned_corpus": {src: {"data_version": h.data_version, "uri": h.uri,
                                                          "code_version": h.code_version}
                                                    for src, h in current.items()}})

        # No upstream refs: the corpora are a pin (in the identity), so a grown corpus is not "stale".
        return materialize_artifact(context, store, spec, first_identity=tokenizer_identity(entry, pin), upstream=[],
                                    build=build)

    return tokenizer


# ---- append-only token caches --------------------------------------------------------------------


ROWS_DIR = "rows"  # a `token_shards/<source>` partition's row files, under its artifact
CACHES_FILE = "caches.json"  # a mixture's record of the caches' and tokenizer's data versions
PARTS_DIR = ".row_ranges"  # a shard encoded in row ranges: their files, until they are concatenated into ROWS_DIR
SHARD_LOOKUPS_IN_FLIGHT = 32


def token_shards_identity(entry: TokenizedEntry) -> dict[str, Any]:
    return {"encoding": entry.cache.encoding_identity()}


def build_token_shards_asset(entry: TokenizedEntry, catalog: Catalog):
    """`token_shards/<source>`: one partition per deduplicated shard, each that shard's decontaminated
    documents encoded into row files (`encode_shard_rows`) in its own run: on a cluster its own pod."""
    shard_key = f"decontaminated/{entry.source}"
    spec = ArtifactSpec.fixed(f"token_shards/{entry.source}", TOKEN_SHARDS_VERSION, token_shards_identity(entry),
                              file_read=FileRead(shard_key, shard_file))

    @catalog.asset(spec, partitions_def=shard_partitions(entry.source), group_name="tokenization", kinds={"numpy"},
                   # Its one input is its own shard's decontaminated file: new data there is this shard's.
                   automation_condition=FOLLOWS_NEW_DATA,
                   ins={"documents": dg.AssetIn(key=asset_key(shard_key)),
                        "tokenizer": dg.AssetIn(key=asset_key(f"tokenizer/{entry.tokenizer}"))},
                   tags={"marin/source": entry.source, "marin/tokenizer": entry.tokenizer},
                   description=f"One shard of `{entry.source}` encoded with tokenizer/{entry.tokenizer}, per "
                               f"partition: the documents of decontaminated/{entry.source} for that shard as rows "
                               "([BOS] + text + [EOS], int32), split by the validation fraction, and their id hashes, "
                               "which `tokenized/<source>` moves into its Levanter cache. Follows its own shard: a new "
                               "shard elsewhere does not touch it.")
    def token_shards(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                     documents: ArtifactHandle, tokenizer: ArtifactHandle):
        artifacts = store.get()
        rel = shard_file(context.partition_key)
        manifest = artifacts.read_manifest(documents.uri)
        version = manifest.file_version(rel) if manifest is not None else None
        if version is None:
            raise input_refused(f"{shard_key}[{context.partition_key}] holds no {rel}; materialize it again")
        stored_bytes = next((f.bytes for f in manifest.files if f.path == rel), 0)

        def build(writer) -> Built:
            uri = f"{documents.uri}/{rel}"
            started = time.monotonic()
            # One piece by default. Where its units spread (Ray) and the file is worth it, row ranges of
            # about a chunk of text each, as their own tasks: the same row files either way.
            chunks = []

            def split_rows(weights):
                chunks.extend(data_parallel.ranges(weights))
                return chunks

            # Ledger key store-relative (store://...): the cache's bytes are the same under any prefix.
            encoded = encode_shard_rows(ShardSpec(artifacts.portable(uri), version, uri), tokenizer.uri,
                                        writer.path(ROWS_DIR), entry.cache,
                                        split_rows=split_rows if data_parallel.worth_spreading(stored_bytes) else None,
                                        parts_uri=writer.path(PARTS_DIR),
                                        parallel_map=data_parallel.parallel_map(context))
            count = encoded["train_documents"] + encoded["validation_documents"]
            return Built(metrics={"shard": {k: v for k, v in encoded.items() if k != ROWS}, "documents": count,
                                  "tokens": encoded["train_tokens"] + encoded["validation_tokens"],
                                  "text_bytes": encoded["text_bytes"],
                                  "encode_seconds": round(time.monotonic() - started, 3)},
                         metadata={"dagster/row_count": count, "chunks": max(len(chunks), 1)})

        # Recorded as the shard's data file, not the whole partition: a changed eval index that leaves the
        # kept documents as they were (only the dropped or marked lists move) does not re-encode them.
        shard_input = replace(documents, data_version=version)
        return materialize_artifact(context, store, spec, upstream=[shard_input, tokenizer], build=build)

    return token_shards


@dataclass(frozen=True)
class EncodedShards:
    """Every shard of a corpus as `tokenized/<source>` assembles it, in corpus order: its entry for
    `assemble_levanter_cache` and its `decontaminated` and `token_shards` partitions as inputs, with
    which of them were carried from the previous build's record and which were looked up now."""

    entries: list[dict]
    inputs: list[ArtifactHandle]
    carried: list[ArtifactHandle]
    looked_up: int  # shards whose decontaminated and token_shards manifests were read
    sources: dict[str, list[str | None]]
    """shard -> [its deduplicated file's version, its decontaminated file's version]: what the next
    build checks a shard it holds against, without reading its partitions' manifests."""


def encoded_shards(artifacts: ArtifactStore, entry: TokenizedEntry, corpus: ArtifactHandle,
                   tokenizer: ArtifactHandle, eval_ngrams: ArtifactHandle,
                   previous: Manifest | None = None) -> EncodedShards:
    """The `decontaminated/<source>` and `token_shards/<source>` partitions of every shard the corpus
    holds, in its order: each shard decontaminated from its file as it is now against today's
    `eval_ngrams/<source>`, and encoded from that with this tokenizer. Refuses in one line, naming them,
    where any is missing (never built, or failed) or was built from other inputs: a cache is assembled
    from every shard its corpus lists, never with a hole, never from a shard checked against an older
    index.

    With ``previous``, the committed cache this build resumes, a shard it holds from the same file,
    checked against the same index and encoded with the same tokenizer is taken as it recorded it
    (`carried_shards`), not looked up: an append reads the new shards' manifests, not the corpus's."""
    key, dec_key = f"token_shards/{entry.source}", f"decontaminated/{entry.source}"
    manifest = artifacts.read_manifest(corpus.uri)
    if manifest is None:
        raise dg.Failure(f"{corpus.uri} lost its manifest")
    fp, dec_fp = fingerprint(token_shards_identity(entry)), fingerprint(decontaminated_identity(entry))
    files = sorted(f.path for f in manifest.files if f.path.startswith("data/") and f.path.endswith(".parquet"))
    shards = [rel[len("data/"):-len(".parquet")] for rel in files]
    versions = {shard: manifest.file_version(rel) for rel, shard in zip(files, shards, strict=True)}
    carried = carried_shards(artifacts, entry, tokenizer, eval_ngrams, previous, versions)
    todo = [shard for shard in shards if shard not in carried]

    def lookup(shard: str) -> tuple[Manifest | None, Manifest | None]:
        return (artifacts.find(dec_key, DECONTAMINATED_VERSION, shard, fingerprint=dec_fp),
                artifacts.find(key, TOKEN_SHARDS_VERSION, shard, fingerprint=fp))

    # Two manifests per shard (tens of thousands at scale): read concurrently, as the store allows.
    with ThreadPoolExecutor(max_workers=SHARD_LOOKUPS_IN_FLIGHT) as pool:
        manifests = dict(zip(todo, pool.map(lookup, todo)))
    found, missing, outdated = {}, [], []
    for shard in todo:
        checked, encoded = manifests[shard]
        checked_refs = checked.upstream_versions() if checked is not None else {}
        refs = encoded.upstream_versions() if encoded is not None else {}
        if checked is None or encoded is None:
            missing.append(shard)
        elif checked_refs.get((corpus.asset_key, shard)) != versions[shard] \
                or checked_refs.get((eval_ngrams.asset_key, None)) != eval_ngrams.data_version \
                or refs.get((dec_key, shard)) != checked.file_version(shard_file(shard)) \
                or refs.get((tokenizer.asset_key, None)) != tokenizer.data_version:
            outdated.append(shard)
        else:
            found[shard] = (checked, encoded)
    if missing or outdated:
        def named(shards: list[str]) -> str:
            return ", ".join(shards[:5]) + (f" and {len(shards) - 5} more" if len(shards) > 5 else "")

        problems = ([f"{len(missing)} not encoded ({named(missing)})"] if missing else []) \
            + ([f"{len(outdated)} encoded from another file, eval index or tokenizer ({named(outdated)})"]
               if outdated else [])
        raise input_refused(f"tokenized/{entry.source}: of the {len(shards)} shards of {corpus.asset_key}, "
                            + "; ".join(problems)
                            + f"; materialize them first: marin materialize {key} (or tokenized/{entry.source}, "
                            "which plans them)")
    # The ledger keys them store-relative: the cache's bytes are the same under any prefix.
    entries = [carried[shard][0] if shard in carried
               else {**artifacts.portable(found[shard][1].metrics["shard"]), ROWS: f"{found[shard][1].uri}/{ROWS_DIR}"}
               for shard in shards]
    if carried and not split_by_fraction_alone(entry.cache, entries):
        # A validation minimum the fraction does not meet: the assembly reads every shard's id hashes.
        return encoded_shards(artifacts, entry, corpus, tokenizer, eval_ngrams)
    inputs = [handle for shard in shards for handle in (
        carried[shard][1] if shard in carried else tuple(ArtifactHandle.from_manifest(m) for m in found[shard]))]
    sources = {shard: [versions[shard], carried[shard][2] if shard in carried
                       else found[shard][0].file_version(shard_file(shard))] for shard in shards}
    return EncodedShards(entries, inputs, [h for _, handles, _ in carried.values() for h in handles], len(todo),
                         sources)


def carried_shards(artifacts: ArtifactStore, entry: TokenizedEntry, tokenizer: ArtifactHandle,
                   eval_ngrams: ArtifactHandle, previous: Manifest | None, versions: dict[str, str | None]
                   ) -> dict[str, tuple[dict, tuple[ArtifactHandle, ArtifactHandle], str]]:
    """shard -> (its ledger entry, its `decontaminated` and `token_shards` inputs as ``previous`` recorded
    them, its decontaminated file's version), for the shards of ``versions`` (shard -> its deduplicated
    file's version now) that the committed cache ``previous`` holds and keeps (`held_shards`): built
    from the same deduplicated file (recorded in its `decontaminated_from`), against the same eval
    index and with the same tokenizer it recorded. That build found each one's partitions made from
    those, and recorded them; nothing it checked has changed, so they are not looked up or checked
    again. A shard whose partitions it did not record at the place this code looks is looked up."""
    if previous is None:
        return {}
    recorded = {(ref.asset_key, ref.partition): ref for ref in previous.upstream}
    used, index = recorded.get((tokenizer.asset_key, None)), recorded.get((eval_ngrams.asset_key, None))
    ledger = next((f for f in previous.files if f.path == CACHE_MANIFEST), None)
    if used is None or used.data_version != tokenizer.data_version or index is None \
            or index.data_version != eval_ngrams.data_version or ledger is None:
        return {}
    key, fp = f"token_shards/{entry.source}", fingerprint(token_shards_identity(entry))
    dec_key, dec_fp = f"decontaminated/{entry.source}", fingerprint(decontaminated_identity(entry))
    sources = previous.metrics.get("decontaminated_from") or {}
    wanted: dict[str, tuple[str, str]] = {}  # ledger key -> (shard, the decontaminated file's version)
    for shard, version in versions.items():
        was = sources.get(shard)
        if was is not None and was[0] == version and was[1] is not None:
            uri = artifacts.artifact_uri(dec_key, DECONTAMINATED_VERSION, shard, fingerprint=dec_fp)
            wanted[artifacts.portable(f"{uri}/{shard_file(shard)}")] = (shard, was[1])
    carried = {}
    for held in held_shards(previous.uri, {k: version for k, (_, version) in wanted.items()}, entry.cache,
                            sha256=ledger.sha256):
        shard, version = wanted[held["key"]]
        ref, dec_ref = recorded.get((key, shard)), recorded.get((dec_key, shard))
        if ref is not None and dec_ref is not None \
                and ref.uri == artifacts.artifact_uri(key, TOKEN_SHARDS_VERSION, shard, fingerprint=fp) \
                and dec_ref.uri == artifacts.artifact_uri(dec_key, DECONTAMINATED_VERSION, shard, fingerprint=dec_fp):
            carried[shard] = (held, (ArtifactHandle(dec_key, shard, DECONTAMINATED_VERSION, dec_ref.uri,
                                                    dec_ref.data_version),
                                     ArtifactHandle(key, shard, TOKEN_SHARDS_VERSION, ref.uri, ref.data_version)),
                              version)
    return carried


def build_tokenized_asset(entry: TokenizedEntry, catalog: Catalog, corpus: ArtifactSpec):
    """`token_shards/<source>` and `tokenized/<source>`, which assembles the shards' rows into one
    Levanter cache, with its checks; ``corpus`` is the source's `deduplicated/<source>`."""
    spec = ArtifactSpec.fixed(f"tokenized/{entry.source}", TOKENIZED_VERSION, {"cache": entry.cache.identity()})
    key = spec.key
    token_shards = build_token_shards_asset(entry, catalog)

    description = (f"`{entry.source}` tokenized with tokenizer/{entry.tokenizer}. The artifact directory "
                   "is a Levanter cache root: `train/` and `validation/` are TreeCaches of `input_ids` "
                   "(BOS + text + EOS per document), validation chosen by a hash of the document id. "
                   "Append-only: each deduplicated shard is one ledger shard, encoded once by its own "
                   f"partition of token_shards/{entry.source}; this step only moves their rows into the "
                   "cache, and a new shard is appended.")
    if entry.cache.chat is not None:
        template = "its declared chat template" if entry.cache.chat.template else "the tokenizer's chat template"
        description = (f"`{entry.source}`'s conversations rendered through {template} with tokenizer/"
                       f"{entry.tokenizer}, in a Levanter chat cache root: `train/` and `validation/` hold "
                       "`input_ids` and `assistant_masks` (1 on the tokens the template's generation blocks "
                       "make: the loss), as Levanter's ChatProcessor writes them, so its chat dataset reads them. "
                       f"A conversation over {entry.cache.chat.seq_len} tokens is {entry.cache.chat.overflow}d; "
                       "one the template fails on is quarantined; counted here. Append-only, per shard, as a text "
                       "cache (docs/post-training.md).")

    @catalog.asset(spec, group_name="tokenization", kinds={"levanter"}, automation_condition=FOLLOWS_NEW_DATA,
                   ins={"corpus": input_of(corpus),
                        "tokenizer": dg.AssetIn(key=asset_key(f"tokenizer/{entry.tokenizer}")),
                        "eval_ngrams": dg.AssetIn(key=asset_key(eval_ngrams_key(entry.source)))},
                   deps=[token_shards.key, asset_key(f"decontaminated/{entry.source}")],
                   tags={"marin/source": entry.source, "marin/tokenizer": entry.tokenizer},
                   description=description)
    def tokenized(context: dg.AssetExecutionContext, store: MarinStore, data_parallel: DataParallel,
                  corpus: ArtifactHandle, tokenizer: ArtifactHandle, eval_ngrams: ArtifactHandle):
        artifacts = store.get()
        # The cache a build resumes: the shards it holds are taken from its record, not looked up again.
        previous = artifacts.find(key, TOKENIZED_VERSION, None, fingerprint=fingerprint(spec.identity(None)))
        shards = encoded_shards(artifacts, entry, corpus, tokenizer, eval_ngrams, previous)

        def build(writer) -> Built:
            # A damaged cache is built from scratch, from every shard's rows: each is looked up.
            encoded = shards if writer.resumed else encoded_shards(artifacts, entry, corpus, tokenizer, eval_ngrams)
            # Assembly only moves bytes: one unit of work per zarr shard file, here or on the resource's workers.
            stats = assemble_levanter_cache(encoded.entries, tokenizer.uri, writer.uri, entry.cache,
                                            parallel_map=data_parallel.parallel_map(context))
            # The shard files were hashed as the units wrote them: the commit does not read them back.
            writer.vouch(FileEntry(*written) for written in stats.files_written)
            metrics = {"documents": stats.documents, "tokens": stats.tokens, "text_bytes": stats.text_bytes,
                       "bytes_per_token": round(stats.bytes_per_token, 4),
                       "train_documents": stats.train.documents, "train_tokens": stats.train.tokens,
                       "validation_documents": stats.validation.documents,
                       "validation_tokens": stats.validation.tokens, "skipped_documents": stats.skipped_documents,
                       "shards": stats.shards, "shards_reused": stats.shards_reused,
                       "shards_encoded": stats.shards_encoded, "documents_encoded": stats.documents_encoded,
                       "assembly_seconds": stats.assembly_seconds,
                       # What assembly moved per second: MB of int32 tokens into the cache's arrays.
                       "assembly_mb_per_s": round(stats.tokens_encoded * 4 / 1e6 / stats.assembly_seconds, 1)
                       if stats.assembly_seconds else None,
                       "decontaminated_from": encoded.sources}
            if entry.cache.chat is not None:  # every shard's quarantined and cut conversations, by reason
                shards_of_cache = read_json(f"{writer.uri}/{CACHE_MANIFEST}")["shards"]
                metrics |= {name: sum(s[name] for s in shards_of_cache) for name in chat_counts()}
                # Rows are renderings (the template's markers, no BOS/EOS framing): text bytes over
                # tokens would not be the tokenizer's compression.
                metrics["bytes_per_token"] = None
            return Built(metrics=metrics, metadata={"dagster/row_count": stats.documents,
                                                    "marin/shard_manifests_read": encoded.looked_up})

        # Resume keeps the previous cache so that unchanged upstream shards are reused, not moved again.
        # Its files are replaced only by renames (shard files are staged, ledgers written aside), so the
        # committed cache is kept readable by hard links while an append runs.
        return materialize_artifact(context, store, spec, upstream=[corpus, tokenizer, eval_ngrams, *shards.inputs],
                                    build=build, resume=True, writes_by_rename=True, carried=shards.carried)

    @marin_check(tokenized, name="decode_roundtrip",
                 description=f"Up to {CHECKED_SHARDS_AT_MOST} of the shards the last build encoded (a sample "
                             "when it encoded more), and one earlier shard: their documents match the ledger's "
                             f"row counts, and decode(encode(doc)) == doc on {ROUNDTRIP_SAMPLE} sampled documents "
                             "read back from the cache; every split's row count matches the manifest and "
                             "Levanter's ledger.")
    def roundtrip(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        from marin_assets.tokenization.cache import chat_rows_check, decode_roundtrip_check

        artifacts = store.get()
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed cache"})
        if entry.cache.chat is not None:  # a chat row is a rendering, not the text's encoding: its own check
            failures = chat_rows_check(manifest.uri, entry.cache.chat.seq_len, sample_n=ROUNDTRIP_SAMPLE,
                                       seed=manifest.data_version)
            return dg.AssetCheckResult(passed=not failures, description="; ".join(
                f"{f.split}[{f.row}]: {f.reason}" for f in failures[:3]) or None,
                metadata={"sampled": ROUNDTRIP_SAMPLE, "failures": len(failures)})
        refs = {u.asset_key: u for u in manifest.upstream}
        # The decontaminated shards it assembled, each a ledger shard (the refs of one key keep one per shard).
        wanted = {artifacts.portable(f"{u.uri}/{shard_file(u.partition)}") for u in manifest.upstream
                  if u.asset_key == f"decontaminated/{entry.source}"}
        ledger = cache_shard_order(manifest.uri)
        missing = sorted(wanted - set(ledger))
        # The check costs a few shards, not the corpus: a new shard's append reads that shard (and one
        # earlier shard, a different one as the cache grows); a first build, a sample of what it encoded.
        appended = appended_shard_keys(manifest.uri)
        encoded = set(appended)
        earlier = [key for key in ledger if key not in encoded]
        checked = checked_shards(appended, manifest.data_version) \
            + ([random.Random(manifest.data_version).choice(earlier)] if earlier else [])
        uris = {artifacts.resolve(key): key for key in checked}
        failures = decode_roundtrip_check(manifest.uri, refs[f"tokenizer/{entry.tokenizer}"].uri, list(uris),
                                          sample_n=ROUNDTRIP_SAMPLE, keys=uris)
        broken = ([f"failures={len(failures)} of sampled={ROUNDTRIP_SAMPLE}: {failures[0].reason}"]
                  if failures else []) \
            + ([f"upstream_files_not_in_cache={len(missing)}"] if missing else [])
        return dg.AssetCheckResult(passed=not broken, description="; ".join(broken) or None, metadata={
            "shards_checked": len(checked), "shards_encoded": len(appended), "sampled": ROUNDTRIP_SAMPLE,
            "failures": len(failures),
            "upstream_files_not_in_cache": len(missing),
            "examples": dg.MetadataValue.json([f.__dict__ for f in failures[:5]] + missing[:5])})

    floor = entry.validation_floor

    @marin_check(tokenized, name="validation_size",
                 description=f"The validation split holds at least {floor.documents} documents and {floor.tokens:,} "
                             "tokens (the registry's `validation_floor`): fewer measure loss with little confidence. "
                             "A warning; `validation_min_documents` sets a minimum for the split itself.")
    def validation_size(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, spec)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": "no committed cache"})
        return validation_size_result(manifest.metrics, floor, entry.cache)

    return token_shards, tokenized, roundtrip, validation_size


def validation_size_result(metrics: dict[str, Any], floor: ValidationFloor, cache: CacheConfig) -> dg.AssetCheckResult:
    """`validation_size`'s verdict on a cache's metrics: WARN below either floor, saying what to set."""
    documents, tokens = metrics.get("validation_documents", 0), metrics.get("validation_tokens", 0)
    short = [f"{documents} validation document(s) < {floor.documents}"] if documents < floor.documents else []
    short += [f"{tokens:,} validation tokens < {floor.tokens:,}"] if tokens < floor.tokens else []
    hint = (f"; raise validation_fraction ({cache.validation_fraction}) or set validation_min_documents in the "
            "tokenization registry") if short else ""
    return dg.AssetCheckResult(passed=not short, severity=dg.AssetCheckSeverity.WARN,
                               description="; ".join(short) + hint or None,
                               metadata={"validation_documents": documents, "validation_tokens": tokens,
                                         "floor_documents": floor.documents, "floor_tokens": floor.tokens})


def mixture_spec(entry: MixtureEntry, caches: dict[str, ArtifactHandle], tokenizer: ArtifactHandle,
                 seq_len: int = 1024, chat_templates: Mapping[str, str] | None = None) -> MixtureSpec:
    """``chat_templates``: the chat caches' templates, by component (`cache_chat_template`)."""
    return MixtureSpec(name=entry.name, tokenizer_dir=tokenizer.uri, seq_len=seq_len, components={
        name: MixtureComponent(cache_root=caches[name].uri, weight=w, chat_template=(chat_templates or {}).get(name))
        for name, w in sorted(entry.weights.items())})


def cache_chat_template(store: ArtifactStore, cache: ArtifactHandle) -> str | None:
    """The chat template a committed cache's rows were rendered with, as its manifest records it
    (Levanter's metadata); None for a text cache."""
    with store.open(f"{cache.uri}/{CACHE_MANIFEST}") as fh:
        return (json.load(fh).get("levanter_metadata") or {}).get("chat_template")


def build_mixture_asset(entry: MixtureEntry, catalog: Catalog):
    ins = {f"cache_{c}": dg.AssetIn(key=asset_key(f"tokenized/{c}")) for c in entry.weights}
    ins["tokenizer"] = dg.AssetIn(key=asset_key(f"tokenizer/{entry.tokenizer}"))
    spec = ArtifactSpec.fixed(f"mixture/{entry.name}", MIXTURE_VERSION, config_identity(entry))

    @catalog.asset(spec, ins=ins, group_name="tokenization", kinds={"levanter", "json"},
                   automation_condition=FOLLOWS_NEW_DATA,
                   tags={"marin/mixture": entry.name, "marin/tokenizer": entry.tokenizer},
                   description=f"Training mixture `{entry.name}` "
                               f"({', '.join(f'{c}: {w}' for c, w in entry.weights.items())}), "
                               "rendered to Levanter's mixture data config (`data.json`), with the data versions of "
                               f"the caches and tokenizer it was rendered from (`{CACHES_FILE}`). Deterministic: same "
                               "spec and same cache data versions give the same bytes.")
    def mixture(context: dg.AssetExecutionContext, store: MarinStore, tokenizer: ArtifactHandle,
                **caches: ArtifactHandle):
        by_name = {k.removeprefix("cache_"): h for k, h in caches.items()}

        def build(writer) -> Built:
            # A text mixture's caches are text caches (the registry checked): their manifests are not read.
            templates = {} if entry.format == "text" else {
                name: template for name, h in by_name.items()
                if (template := cache_chat_template(store.get(), h)) is not None}
            data = render_levanter_data_config(mixture_spec(entry, by_name, tokenizer, chat_templates=templates))
            # Caches and tokenizer as store-relative URIs: a copied store's mixture reads its own caches.
            writer.write_json("data.json", store.get().portable(data))
            # data.json names the caches by path, which an append leaves as it was: their data versions
            # make a mixture over grown caches another mixture (a checkpoint trained on it is stale).
            writer.write_json(CACHES_FILE, {"caches": {name: h.data_version for name, h in sorted(by_name.items())},
                                            "tokenizer": tokenizer.data_version})
            return Built(metrics={"components": len(by_name),
                                  "train_components": sum(1 for w in entry.weights.values() if w > 0)},
                         metadata={"data_config": dg.MetadataValue.json(data)})

        upstream = [tokenizer] + [h for _, h in sorted(by_name.items())]
        return materialize_artifact(context, store, spec, upstream=upstream, build=build)

    return mixture


def read_mixture_config(store: ArtifactStore, handle: ArtifactHandle) -> dict[str, Any]:
    """A mixture's Levanter data config, its caches and tokenizer resolved against this store."""
    with store.open(f"{handle.uri}/data.json") as fh:
        return store.resolve(json.load(fh))


def mixture_caches(store: ArtifactStore, data_config: dict[str, Any], mixture: ArtifactHandle) -> list[ArtifactHandle]:
    """The token caches a mixture's data config (``data_config``, `read_mixture_config`) names, as committed
    now: what a run that reads the mixture reads. A training records them as its inputs, so that its
    lineage names the very cache it read, and its freshness follows that cache (issue 50)."""
    handles = []
    for name, component in sorted(data_config["configs"].items()):
        manifest = store.read_manifest(component["cache_dir"])
        if manifest is None:
            raise input_refused(f"{mixture.asset_key} names the cache {component['cache_dir']} (component {name!r}), "
                                "which holds no committed artifact; materialize the mixture again")
        handles.append(ArtifactHandle.from_manifest(manifest))
    return handles


def corpus_specs(registry: TokenizationRegistry, upstream: Catalog) -> dict[str, ArtifactSpec]:
    """The `deduplicated/<source>` spec of every source the registry reads, as the curation stage
    declared it (one it does not declare is refused when the code location loads)."""
    sources = {*registry.tokenized, *(source for entry in registry.tokenizers.values() for source in entry.train_on)}
    return {source: upstream.spec(f"deduplicated/{source}") for source in sorted(sources)}


def build_tokenization_stage(settings: MarinSettings, deployment: "Deployment",
                             upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """Tokenizers, tokenized caches and mixtures of `deployment.tokenization`."""
    registry = deployment.tokenization
    catalog = Catalog()
    assets, checks = [], []
    corpora = corpus_specs(registry, upstream)
    for entry in registry.tokenizers.values():
        assets.append(build_tokenizer_asset(entry, catalog, store_resource(settings).get, corpora))
    for entry in registry.tokenized.values():
        token_shards, tokenized, *asset_checks = build_tokenized_asset(entry, catalog, corpora[entry.source])
        assets.extend([token_shards, tokenized])
        checks.extend(asset_checks)
    decontamination, decontamination_checks = build_decontamination_assets(registry, catalog, corpora,
                                                                           store_resource(settings).get)
    assets.extend(decontamination)
    checks.extend(decontamination_checks)
    for entry in registry.mixtures.values():
        assets.append(build_mixture_asset(entry, catalog))
    return dg.Definitions(assets=assets, asset_checks=checks), catalog
