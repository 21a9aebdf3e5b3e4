"""A source's filter report: drops by rule over its shards, shares of the documents read, score
quantiles, and the warning when one rule drops most of the source."""

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
