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

from marin_assets.curation.sketch import QuantileSketch, keep_threshold

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
        for rule, n in rule_drops(metrics).items():
            drops[rule] = drops.get(rule, 0) + n
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


def rule_drops(metrics: Mapping[str, Any]) -> dict[str, int]:
    """What each rule dropped from one filtered shard (its manifest's `dropped/<rule>` metrics)."""
    return {key[len(RULE_DROP_PREFIX):]: int(value) for key, value in metrics.items()
            if key.startswith(RULE_DROP_PREFIX)}


def shard_line(metrics: Mapping[str, Any]) -> str:
    """One filtered shard for a terminal: documents kept of those read, and each rule's drops."""
    drops = sorted(((rule, n) for rule, n in rule_drops(metrics).items() if n), key=lambda rn: (-rn[1], rn[0]))
    line = f"kept {int(metrics['documents']):,} of {int(metrics['input_documents']):,} documents"
    return line + (f"; dropped: {', '.join(f'{rule} {n:,}' for rule, n in drops)}" if drops else "")


def report_lines(report: Mapping[str, Any], kept: int) -> list[str]:
    """A source's report for a terminal (`marin materialize` prints it once the source is
    deduplicated): the documents kept of those read, then a line per rule with its drops and their
    share of the documents read, largest first. ``kept``: the documents the source ends with."""
    read = int(report.get("documents_read", 0))
    drops = sorted(report.get("dropped", {}).items(), key=lambda rn: (-rn[1], rn[0]))
    lines = [f"kept {kept:,} of {read:,} documents read" + (f" ({kept / read:.1%})" if read else "")
             + ("; dropped:" if drops else "; none dropped")]
    width = max((len(rule) for rule, _ in drops), default=0)
    digits = max((len(f"{n:,}") for _, n in drops), default=0)
    shares = report.get("dropped_share", {})
    lines += [f"  {rule:<{width}}  {n:>{digits},}  ({shares.get(rule, 0):.1%})" for rule, n in drops]
    return lines


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


def threshold_shifts(per_source: Mapping[str, QuantileSketch], keep_fraction: float,
                     threshold: float) -> dict[str, dict[str, Any]]:
    """What each source does to the shared quality threshold (``threshold``, from the merge of
    ``per_source``): the threshold the other sources' scores alone would give, and how far this
    source moves it (``shift``: the shared threshold minus that). A source whose text the classifier
    scores low pulls the threshold down, so every other source keeps more; one scored high pushes it
    up, and the others lose documents. None where nothing would be filtered (no other source, or
    keep_fraction 1)."""
    shifts = {}
    for name, sketch in sorted(per_source.items()):
        others = QuantileSketch(sketch.relative_accuracy)
        for other, other_sketch in per_source.items():
            if other != name:
                others.merge(other_sketch)
        without = keep_threshold(others, keep_fraction)
        finite = without != float("-inf") and threshold != float("-inf")
        shifts[name] = {"scored_documents": sketch.count,
                        "threshold_without": round(without, 6) if without != float("-inf") else None,
                        "shift": round(threshold - without, 6) if finite else None}
    return shifts


def shifts_table(shifts: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per source, its scored documents, the threshold without it and the shift it causes."""
    lines = ["| source | scored documents | threshold without it | shift it causes |", "|---|---:|---:|---:|"]
    for name, row in shifts.items():
        without = "keep all" if row["threshold_without"] is None else f"{row['threshold_without']:.4f}"
        shift = "-" if row["shift"] is None else f"{row['shift']:+.4f}"
        lines.append(f"| {name} | {row['scored_documents']:,} | {without} | {shift} |")
    return "\n".join(lines)

