"""Quality classifiers on the demo corpus: the fastText classifier against the logistic-regression one it
replaced, and what each keeps.

Prints, side by side: training time, scoring throughput (MB/s per core, CPU seconds, so the shared
machine's load matters less), the compression-ratio classifier's throughput, and how many of the 77
Shakespeare texts each setup drops as low quality. The baseline is ``quality.py`` at ``--baseline-rev``
(logistic regression on hashed n-grams, trained on Shakespeare against the READMEs of the installed
packages, threshold at the (1 - keep_fraction) quantile of its own positives' training scores). Ours
trains on the pinned sources of ``marin_assets/sources.yaml`` and thresholds over the corpus it filters
(every source the classifier scores), through the per-shard sketches.

    python -m benchmarks.quality [--baseline-rev 731b02a]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import polars as pl

from benchmarks.filters import load_documents, module_at
from marin_assets.curation.config import DEFAULT_SOURCES_PATH, load_curation_config
from marin_assets.curation.filters import apply_filters
from marin_assets.curation.model_assets import pinned_source_texts
from marin_assets.curation.quality import QualityScorer, compression_ratios, train_quality_model
from marin_assets.curation.sketch import QuantileSketch, keep_threshold


def cpu(fn):
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def megabytes(texts: list[str]) -> float:
    return sum(len(t.encode("utf-8")) for t in texts) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default="731b02a")
    args = parser.parse_args()
    cfg = load_curation_config(DEFAULT_SOURCES_PATH)
    docs = load_documents()
    sources = {name: docs.filter(pl.col("source") == name) for name in cfg.quality_sources}
    # The filtered step scores what the heuristic rules keep; the same rules for both setups.
    rules_s, kept = cpu(lambda: {name: apply_filters(frame, cfg.source(name).filters).kept
                                 for name, frame in sources.items()})
    input_mb = megabytes([t for frame in sources.values() for t in frame["text"].to_list()])
    plays = kept["shakespeare"]["text"].to_list()
    corpus = [t for frame in kept.values() for t in frame["text"].to_list()]
    mb = megabytes(corpus)
    print(f"demo corpus after the heuristic rules: {len(corpus)} documents, {mb:.2f} MB "
          f"({len(plays)} of 77 Shakespeare texts)")

    old = module_at(args.baseline_rev, "marin_assets/curation/quality.py")
    negatives_old = kept["installed_packages"]["text"].to_list()
    train_old, model_old = cpu(lambda: old.train_quality_classifier(plays, negatives_old, old.QualityConfig(
        keep_fraction=cfg.quality.keep_fraction)))
    score_old, scores_old = cpu(lambda: old.score(model_old, corpus))
    threshold_old = old.quality_threshold(old.score(model_old, plays), cfg.quality.keep_fraction)
    plays_dropped_old = int((scores_old[:len(plays)] < threshold_old).sum())

    positives = [t for s in cfg.quality_positive_sources for t in pinned_source_texts(s)]
    negatives = [t for s in cfg.quality_negative_sources for t in pinned_source_texts(s)]
    train_new, (model, summary) = cpu(lambda: train_quality_model(positives, negatives, cfg.quality))
    scorer = QualityScorer(cfg.quality, model)
    score_new, scores = cpu(lambda: scorer.score(corpus))
    threshold = keep_threshold(QuantileSketch(cfg.quality.sketch_relative_accuracy).add(scores),
                               cfg.quality.keep_fraction)
    plays_dropped = int((scores[:len(plays)] <= threshold).sum())
    corpus_kept = float((scores > threshold).mean())
    compression_s, _ = cpu(lambda: compression_ratios(corpus))
    sketch_s, _ = cpu(lambda: QuantileSketch(cfg.quality.sketch_relative_accuracy).add(scores).to_json())

    rows = [("", "baseline (LR, installed READMEs)", "ours (fastText, pinned sdists)"),
            ("training CPU s", f"{train_old:.2f}", f"{train_new:.2f}"),
            ("scoring MB/s per core", f"{mb / score_old:.2f}", f"{mb / score_new:.2f}"),
            ("filtered step MB/s per core", f"{input_mb / (rules_s + score_old):.2f}",
             f"{input_mb / (rules_s + score_new + sketch_s):.2f}"),
            ("threshold set on", "positives' training scores", "the scored corpus (sketch)"),
            ("Shakespeare texts dropped", f"{plays_dropped_old} of {len(plays)}", f"{plays_dropped} of {len(plays)}"),
            ("corpus share kept", f"{float((scores_old >= threshold_old).mean()):.3f}", f"{corpus_kept:.3f}"),
            ("held-out accuracy", "-", f"{summary.get('held_out_accuracy')}")]
    for row in rows:
        print(f"{row[0]:<26} {row[1]:>32} {row[2]:>32}")
    print(f"filtered step = rules and language id ({rules_s:.2f} CPU s over {input_mb:.2f} MB) + scoring"
          " (+ the sketch, ours); the previous classifier did not score its negative source, counted here all the same")
    print(f"compression-ratio classifier: {mb / compression_s:.1f} MB/s per core")
    print(f"model: {len(model) / 1e6:.1f} MB, {summary['examples_train']} training examples; "
          "score quantiles (0, 0.1, 0.5): "
          f"plays {np.round(np.quantile(scores[:len(plays)], [0, .1, .5]), 4).tolist()}, "
          f"other {np.round(np.quantile(scores[len(plays):], [0, .1, .5]), 4).tolist()}")


if __name__ == "__main__":
    main()
