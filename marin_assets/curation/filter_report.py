"""A source's filter report: what each rule dropped from the whole source, and its quality scores.

`deduplicated/<source>` is the first asset that sees a source whole, so it carries the report: the
heuristic and language rules' drops summed over the `filtered/<source>` shards' manifests, the
duplicates, and the corpus-wide quality threshold's drops, each as a share of the documents read;
and the quantiles of the quality scores (the merge of the shards' sketches, which the threshold is
read from too). Its `no_rule_drops_most` check warns when one rule drops more than half the source:
a language filter that does not fit the text, or a quality classifier that scores a whole kind of
text low, which otherwise only shows when someone reads the counts. Pure: no Dagster import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from marin_assets.curation.sketch import QuantileSketch

RULE_DROP_PREFIX = "dropped/"
MOST = 0.5
"""A rule dropping more than this share of a source is reported by the check."""
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def filter_report(shard_metrics: Iterable[Mapping[str, Any]], *, duplicates: int, quality_dropped: int | None,
                  scores: QuantileSketch | None) -> dict[str, Any]:
    """The report of one source: ``shard_metrics`` are its filtered shards' manifest metrics
    (`input_documents`, `dropped/<rule>`); ``duplicates`` and ``quality_dropped`` (None: no quality
    threshold) what deduplication and the threshold then dropped; ``scores`` the merged sketch of
    the filter-kept documents' quality scores."""
    documents, drops = 0, {}
    for metrics in shard_metrics:
        documents += int(metrics.get("input_documents", 0))
        for key, value in metrics.items():
            if key.startswith(RULE_DROP_PREFIX):
                rule = key[len(RULE_DROP_PREFIX):]
                drops[rule] = drops.get(rule, 0) + int(value)
    drops["duplicates"] = duplicates
    if quality_dropped is not None:
        drops["quality_threshold"] = quality_dropped
    drops = {rule: n for rule, n in sorted(drops.items()) if n}
    shares = {rule: round(n / documents, 6) for rule, n in drops.items()} if documents else {}
    worst = max(shares.items(), key=lambda item: (item[1], item[0]), default=(None, 0.0))
    report: dict[str, Any] = {"documents_read": documents, "dropped": drops, "dropped_share": shares,
                              "largest_rule": worst[0], "largest_rule_share": worst[1]}
    if scores is not None and scores.count:
        report["quality_score"] = {f"p{round(q * 100)}": round(scores.quantile(q), 6) for q in QUANTILES}
    return report


def largest_rule_problem(report: Mapping[str, Any], most: float = MOST) -> str | None:
    """Why one rule dropped most of the source (a sentence), or None."""
    rule, share = report.get("largest_rule"), float(report.get("largest_rule_share") or 0.0)
    if rule is None or share <= most:
        return None
    return (f"{rule} dropped {report['dropped'][rule]:,} of {report['documents_read']:,} documents read "
            f"({share:.0%}), more than {most:.0%} of the source")


def report_table(report: Mapping[str, Any]) -> str:
    """Markdown: one row per rule, its drops and share; then the quality score quantiles."""
    rows = ["| rule | dropped | share of documents read |", "|---|---|---|"]
    shares = report["dropped_share"]
    rows += [f"| {rule} | {n:,} | {shares.get(rule, 0):.1%} |" for rule, n in report["dropped"].items()]
    if "quality_score" in report:
        rows += ["", "| quality score | " + " | ".join(report["quality_score"]) + " |",
                 "|---|" + "---|" * len(report["quality_score"]),
                 "| filter-kept documents | " + " | ".join(f"{v:.3g}" for v in report["quality_score"].values()) + " |"]
    return "\n".join(rows)
