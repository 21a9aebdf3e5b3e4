"""The file formats a source may declare, and how ``auto`` picks one from a file's name.

Its own module so that the source configuration (which validates ``format``) and the readers (which
dispatch on it) both read one table without importing each other."""

FORMATS = ("text", "jsonl", "parquet", "html", "warc", "chat", "auto")
_EXTENSION_FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".warc": "warc",
}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".zst", ".xz", ".lz4", ".zip", ".snappy")


def resolve_format(fmt: str, relpath: str) -> str:
    """The concrete format of one file: ``fmt`` unless it is ``auto`` (which never picks ``chat``: a
    chat file is JSONL by its name, so a chat source declares ``format: chat``)."""
    if fmt != "auto":
        return fmt
    name = relpath.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    for ext, concrete in _EXTENSION_FORMATS.items():
        if name.endswith(ext):
            return concrete
    return "text"


def record_layout(fmt: str, relpath: str) -> str:
    """How one file's records lie in it: its concrete format, except that chat data is JSONL lines,
    or Parquet rows where the file's name says Parquet (Hugging Face's chat datasets)."""
    concrete = resolve_format(fmt, relpath)
    if concrete == "chat":
        return "parquet" if resolve_format("auto", relpath) == "parquet" else "jsonl"
    return concrete


# The curation steps of filtered/ and deduplicated/ (and decontaminated/, in tokenization) that a
# format may skip. A source of a format listed below skips the steps named for it, by declaration:
# its filtered/ and deduplicated/ artifacts name them in their metadata and docs/post-training.md
# says why; a source setting what a skipped step reads (its own `filters:`) is refused.
LANGUAGE_ID = "language_id"
HEURISTIC_RULES = "heuristic_rules"  # Gopher and the opt-in families (C4, FineWeb, Gopher repetition)
URL_BLOCKLIST = "url_blocklist"
QUALITY_SCORE = "quality_score"  # the quality classifier and the corpus-wide keep threshold
EXACT_PARAGRAPHS = "exact_paragraphs"

# Chat data (a conversation of turns, see readers.read_chat_record): the steps that judge prose
# would judge a rendering of turns with role labels, not text anyone wrote as one piece; the URL
# block list reads a page's `url`, which a conversation has not; paragraph dedup cuts lines out of
# the rendering, which would no longer match the turns it renders. Exact and fuzzy dedup, PII (on
# each turn) and decontamination apply, on the conversation's text.
SKIPPED_STEPS: dict[str, tuple[str, ...]] = {
    "chat": (LANGUAGE_ID, HEURISTIC_RULES, URL_BLOCKLIST, QUALITY_SCORE, EXACT_PARAGRAPHS),
}


def skipped_steps(fmt: str) -> tuple[str, ...]:
    """The curation steps a source of format ``fmt`` skips by declaration (none for prose formats)."""
    return SKIPPED_STEPS.get(fmt, ())
