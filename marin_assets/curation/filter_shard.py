"""The `filtered/<source>` step as pure functions: the URL block list and heuristic rules, PII
removal, the optional quality score and MinHash signatures over a frame of documents, one chunk at
a time, and the merge of the chunks into the shard's outputs.

A shard filtered in one piece or as row ranges on Ray (`marin_resources.data_parallel`) gives
the same frames row for row, so the same Parquet bytes and data version: every decision is
per document, and the merge puts the rows back in one-piece order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from marin_assets.curation import kernels
from marin_assets.curation.filters import FilterConfig, apply_filters
from marin_assets.curation.language_id import LanguageIdentifier, fasttext_identifier
from marin_assets.curation.minhash import MinHashConfig, SignatureTable, compute_signatures
from marin_assets.curation.pii import PiiConfig, scrub_conversations, scrub_frame
from marin_assets.curation.quality import QualityConfig, QualityScorer
from marin_assets.curation.url_filter import blocklist_from_bytes, document_urls


@dataclass(frozen=True)
class FilterTask:
    """What filtering a shard needs besides its documents; sent once to every chunk's worker.

    Models travel as their bytes, so the task pickles to a Ray worker; each chunk loads them."""

    filters: FilterConfig
    minhash: MinHashConfig
    quality: QualityConfig | None = None
    quality_model: bytes | None = None  # the fastText classifier's bytes (None: compression, or no quality)
    language_model: bytes | None = None  # the fastText language-ID model's bytes (None: the one `filters` names)
    pii: PiiConfig | None = None  # what PII removal replaces (None: no pass)
    url_blocklist: bytes | None = None  # the block list file's bytes (None: no URL filter)
    # Chat documents (a `messages` column): no block list, rules, language id or quality score
    # (formats.SKIPPED_STEPS); PII is replaced turn by turn.
    chat: bool = False

    def identifier(self) -> LanguageIdentifier | None:
        return None if self.language_model is None else fasttext_identifier(self.language_model)


@dataclass
class FilteredChunk:
    kept: pl.DataFrame  # with a quality_score column when the source is scored
    dropped: pl.DataFrame
    counts: dict[str, int]
    hashvalues: np.ndarray  # MinHash signatures of `kept`, row-aligned
    kernel: str  # kernels.COMPILED or NUMPY: what the process that filtered it had
    pii: dict[str, int]  # kind -> addresses replaced in `kept`, and "documents" changed
    line_removals: dict[str, int]  # line rule (c4) -> lines it removed


@dataclass
class FilteredShard:
    kept: pl.DataFrame
    dropped: pl.DataFrame
    counts: dict[str, int]  # rule -> documents it dropped
    signatures: SignatureTable
    kernel: str  # kernels.COMPILED where every chunk ran the compiled kernels, else NUMPY
    pii: dict[str, int]  # kind -> addresses replaced, and "documents" changed (empty without the pass)
    line_removals: dict[str, int]  # line rule (c4) -> lines it removed (empty without c4)


def filter_chunk(docs: pl.DataFrame, task: FilterTask) -> FilteredChunk:
    """The block list and the rules (with language id), then PII removal from what they kept, then
    its quality score and signatures, so both see the text that is stored. The keep threshold is
    corpus-wide, so it is applied later, in `deduplicated/`. Chat documents skip the steps that judge
    prose: every one is kept, and only PII removal changes them."""
    if task.chat:
        return _chat_chunk(docs, task)
    blocked = None
    if task.url_blocklist is not None:
        blocked = blocklist_from_bytes(task.url_blocklist).blocked_rows(document_urls(docs))
    result = apply_filters(docs, task.filters, task.identifier(), blocked)
    kept = result.kept
    texts = kept["text"].to_list() if result.kept_texts is None else result.kept_texts
    pii: dict[str, int] = {}
    if task.pii is not None:
        kept, texts, pii = scrub_frame(kept, texts, task.pii)
    if task.quality is not None:
        scorer = QualityScorer(task.quality, task.quality_model)
        scores = scorer.score(texts) if kept.height else np.zeros(0)
        kept = kept.with_columns(pl.Series("quality_score", scores, dtype=pl.Float64))
    return FilteredChunk(kept, result.dropped, dict(result.per_rule_drop_counts),
                         compute_signatures(kept, task.minhash, texts).hashvalues, kernels.implementation(), pii,
                         dict(result.line_removals))


def _chat_chunk(docs: pl.DataFrame, task: FilterTask) -> FilteredChunk:
    """A chunk of conversations: PII replaced in their turns, then their signatures."""
    kept, texts, pii = docs, None, {}
    if task.pii is not None:
        kept, texts, pii = scrub_conversations(docs, task.pii)
    dropped = docs.clear().with_columns(pl.lit(None, pl.String).alias("reason"),
                                        pl.lit(None, pl.List(pl.String)).alias("failed_rules"))
    return FilteredChunk(kept, dropped, {}, compute_signatures(kept, task.minhash, texts).hashvalues,
                         kernels.implementation(), pii, {})


def merge_chunks(chunks: list[FilteredChunk], task: FilterTask) -> FilteredShard:
    """The chunks of one shard, in row order, as the shard's outputs (as if filtered in one piece)."""
    kept = pl.concat([c.kept for c in chunks], how="vertical").rechunk()
    dropped = pl.concat([c.dropped for c in chunks], how="vertical").rechunk()
    counts: dict[str, int] = {}
    pii: dict[str, int] = {}
    line_removals: dict[str, int] = {}
    for chunk in chunks:
        for total, part in ((counts, chunk.counts), (pii, chunk.pii), (line_removals, chunk.line_removals)):
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
    hashvalues = np.concatenate([c.hashvalues for c in chunks]).astype(np.uint32, copy=False)
    signatures = SignatureTable(ids=kept["id"].to_numpy().astype(object), hashvalues=hashvalues, config=task.minhash)
    kernel = kernels.COMPILED if all(c.kernel == kernels.COMPILED for c in chunks) else kernels.NUMPY
    return FilteredShard(kept, dropped, counts, signatures, kernel, pii, line_removals)
