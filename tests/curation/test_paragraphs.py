"""Exact paragraph dedup: later copies of a line are removed as spans, first occurrences stay."""

import polars as pl

from marin_assets.curation.paragraphs import paragraph_hash, remove_duplicate_paragraphs

FOOTER = "Subscribe to our newsletter for weekly updates."


def test_duplicate_lines_are_removed_as_spans_across_documents_and_batches():
    docs = pl.DataFrame({"id": ["a", "b", "c"], "text": [
        f"The harbour was quiet.\n\n{FOOTER}",
        f"{FOOTER}\nThe boats came in late.\nThe boats came in late.\n\n",
        FOOTER,
    ]})
    seen: set[int] = set()
    result = remove_duplicate_paragraphs(docs, seen)
    assert result.documents["text"].to_list() == [f"The harbour was quiet.\n\n{FOOTER}", "The boats came in late."]
    assert result.emptied["id"].to_list() == ["c"]
    spans = result.spans.rows()
    original = dict(zip(docs["id"], docs["text"], strict=True))
    # Each span is the removed line with its newline, in the original text's coordinates.
    assert [(doc, original[doc][start:end]) for doc, start, end, _ in spans] == [
        ("b", FOOTER + "\n"), ("b", "The boats came in late.\n"), ("c", FOOTER)]
    assert all(h == paragraph_hash(original[d][s:e].rstrip("\n")) for d, s, e, h in spans)
    assert len(result.new_hashes) == 3 and set(result.new_hashes.tolist()) == seen
    # A later batch (the next shard) sees the first batch's paragraphs; blank lines never count.
    later = remove_duplicate_paragraphs(pl.DataFrame({"id": ["d"], "text": ["New line.\n\n\nThe harbour was quiet."]}),
                                        seen)
    assert later.documents["text"].to_list() == ["New line."] and later.spans.height == 1


def test_documents_without_duplicates_keep_their_exact_text():
    text = "First line.\r\n\n  Indented second line.  \n"
    result = remove_duplicate_paragraphs(pl.DataFrame({"id": ["x"], "text": [text]}), set())
    assert result.documents["text"].to_list() == [text] and result.spans.height == 0
