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


def test_a_shard_and_a_source_read_as_kept_and_dropped_counts_by_rule():
    from marin_assets.curation.filter_report import report_lines, shard_line

    shard = {"input_documents": 1930, "documents": 1235, "dropped": 695, "dropped/max_non_alpha_word_fraction": 84,
             "dropped/min_words": 611, "dropped/language": 0, "pii/email": 3}
    assert shard_line(shard) == "kept 1,235 of 1,930 documents; dropped: min_words 611, max_non_alpha_word_fraction 84"
    assert shard_line({"input_documents": 2, "documents": 2}) == "kept 2 of 2 documents"
    report = filter_report([shard], duplicates=12, quality_dropped=None, scores=None)
    assert report_lines(report, 1223) == ["kept 1,223 of 1,930 documents read (63.4%); dropped:",
                                          "  min_words                    611  (31.7%)",
                                          "  max_non_alpha_word_fraction   84  (4.4%)",
                                          "  duplicates                    12  (0.6%)"]
    nothing = filter_report([{"input_documents": 5, "documents": 5}], duplicates=0, quality_dropped=None, scores=None)
    assert report_lines(nothing, 5) == ["kept 5 of 5 documents read (100.0%); none dropped"]


NOTES = ["The harbour master counted the boats at dawn and wrote each name in a heavy green ledger, while gulls "
         "argued over the nets and the tide turned slowly against the stone wall of the old pier. ",
         "In the mountain village the school bell rang twice, and the children climbed the steep path with their "
         "satchels, stopping to watch a hawk circle above the pine trees near the mill by the river. ",
         "A travelling clockmaker arrived with a cart full of gears, springs and tiny brass hammers, offering to "
         "mend every broken timepiece in the province for the price of a warm supper and a bed. "]


@pytest.mark.slow  # builds a small source to deduplicated/ through the planner, in process
def test_materialize_prints_what_curation_kept_and_each_rule_dropped(curation_planner, tmp_path):
    from marin_assets.curation.filter_report import report_lines, shard_line
    from marin_assets.run_submission import InProcessRuns
    from marin_resources.keys import asset_key

    data = tmp_path / "notes"
    data.mkdir()
    for i, body in enumerate(NOTES):
        (data / f"note{i}.txt").write_text(body * 2)
    (data / "short.txt").write_text("Far too short a note to keep.")  # under the default 50 words
    plan = curation_planner(f"sources:\n  - name: notes\n    uri: {data}/*.txt\n    format: text\n")
    plan.discover()
    printed: list[str] = []
    steps = plan.materialize(asset_key("deduplicated/notes"), None, log=printed.append,
                             runs=InProcessRuns(plan.defs, plan.instance))
    assert all(s.success for s in steps)

    (shard,) = plan.partitions_of(asset_key("filtered/notes"))
    filtered = plan.current(asset_key("filtered/notes"), shard).metrics
    deduplicated = plan.current(asset_key("deduplicated/notes"), None).metrics
    assert filtered["dropped/min_words"] == 1 and filtered["documents"] == 3
    assert f"          filtered/notes [{shard}]: {shard_line(filtered)}" in printed
    assert shard_line(filtered).startswith("kept 3 of 4 documents; dropped: min_words 1")
    source = report_lines(deduplicated["filter_report"], deduplicated["documents"])
    at = printed.index(f"          deduplicated/notes: {source[0]}")
    assert printed[at + 1:at + len(source)] == [f"          {line}" for line in source[1:]]
    assert source[0].startswith("kept 3 of 4 documents read (75.0%)")
    assert "min_words" in source[1]


@pytest.mark.slow  # builds a small source to deduplicated/ through the planner, in process
def test_a_source_failing_its_drop_bound_still_prints_what_each_rule_dropped(curation_planner, tmp_path):
    # Four copies of one note: deduplication drops three of five documents, over the 0.5 ERROR bound.
    # The step fails, and the counts printed under it say why.
    from marin_assets.run_submission import InProcessRuns
    from marin_resources.keys import asset_key

    data = tmp_path / "notes"
    data.mkdir()
    for i in range(4):
        (data / f"copy{i}.txt").write_text(NOTES[0] * 2)
    (data / "other.txt").write_text(NOTES[1] * 2)
    plan = curation_planner(f"sources:\n  - name: notes\n    uri: {data}/*.txt\n    format: text\n")
    plan.discover()
    printed: list[str] = []
    steps = plan.materialize(asset_key("deduplicated/notes"), None, log=printed.append,
                             runs=InProcessRuns(plan.defs, plan.instance))
    assert not steps[-1].success and "drop_fraction_bound" in steps[-1].error
    at = next(i for i, line in enumerate(printed) if "FAILED" in line)
    assert printed[at + 1:at + 3] == ["          deduplicated/notes: kept 2 of 5 documents read (40.0%); dropped:",
                                      "            duplicates  3  (60.0%)"]
