"""A source's filter report: drops by rule over its shards, shares of the documents read, score
quantiles, and the warning when one rule drops most of the source."""

import numpy as np
import pytest

from marin_assets.curation.filter_report import filter_report, largest_rule_problem, report_table
from marin_assets.curation.sketch import QuantileSketch


def test_drops_are_summed_over_shards_and_one_rule_dropping_most_is_named():
    shards = [{"input_documents": 40, "dropped/language": 17, "dropped/min_words": 2, "documents": 21},
              {"input_documents": 26, "dropped/language": 0, "dropped/min_words": 1, "documents": 25}]
    scores = QuantileSketch(0.01).add([0.05, 0.07, 0.07, 0.08, 0.9])
    report = filter_report(shards, duplicates=3, quality_dropped=20, scores=scores)
    assert report["documents_read"] == 66
    assert report["dropped"] == {"duplicates": 3, "language": 17, "min_words": 3, "quality_threshold": 20}
    assert report["dropped_share"]["language"] == round(17 / 66, 6)
    assert report["largest_rule"] == "quality_threshold" and report["largest_rule_share"] == round(20 / 66, 6)
    assert abs(report["quality_score"]["p50"] - 0.07) <= 0.07 * 0.01
    assert largest_rule_problem(report) is None
    assert "| language | 17 | 25.8% |" in report_table(report) and "| filter-kept documents |" in report_table(report)

    most = filter_report(shards, duplicates=3, quality_dropped=40, scores=None)
    assert largest_rule_problem(most) == ("quality_threshold dropped 40 of 66 documents read (61%), more than 50% "
                                          "of the source")
    assert "quality_score" not in most and "quality_threshold" not in filter_report(shards, duplicates=0,
                                                                                    quality_dropped=None, scores=None)
    empty = filter_report([], duplicates=0, quality_dropped=None, scores=None)
    assert empty["largest_rule"] is None and largest_rule_problem(empty) is None


def test_a_source_scored_low_pulls_the_shared_threshold_down_by_its_shift():
    from marin_assets.curation.filter_report import shifts_table, threshold_shifts
    from marin_assets.curation.sketch import QuantileSketch, keep_threshold

    rng = np.random.default_rng(0)
    prose = QuantileSketch(0.01).add(rng.uniform(0.5, 1.0, 4000))
    docs = QuantileSketch(0.01).add(rng.uniform(0.0, 0.2, 4000))  # the classifier scores it low
    shared = keep_threshold(QuantileSketch(0.01).merge(prose).merge(docs), 0.8)
    shifts = threshold_shifts({"prose": prose, "docs": docs}, keep_fraction=0.8, threshold=shared)
    assert shifts["docs"]["threshold_without"] == pytest.approx(keep_threshold(prose, 0.8), abs=1e-6)
    assert shifts["docs"]["shift"] == pytest.approx(shared - keep_threshold(prose, 0.8), abs=1e-6)
    assert shifts["docs"]["shift"] < -0.3  # adding docs lets prose keep much more
    assert 0 < shifts["prose"]["shift"] < 0.1 and shifts["prose"]["scored_documents"] == 4000
    table = shifts_table(shifts)
    assert "| docs | 4,000 |" in table and "| prose | 4,000 |" in table
    alone = threshold_shifts({"prose": prose}, keep_fraction=0.8, threshold=keep_threshold(prose, 0.8))
    assert alone["prose"] == {"scored_documents": 4000, "threshold_without": None, "shift": None}
    assert "keep all" in shifts_table(alone)
