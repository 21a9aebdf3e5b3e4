"""The file formats a source may declare, and how ``auto`` picks one from a file's name.

Its own module so that the source configuration (which validates ``format``) and the readers (which
dispatch on it) both read one table without importing each other."""

FORMATS = ("text", "jsonl", "parquet", "html", "warc", "auto")
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
    """The concrete format of one file: ``fmt`` unless it is ``auto``."""
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
