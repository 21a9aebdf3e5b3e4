"""Where curation keeps what it fetches or computes once per machine (source archives, content
hashes, language-ID results). Its own module so that the filters and the source configuration both
use it without importing each other."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Local cache for fetched artifacts: $MARIN_CACHE_DIR or ~/.cache/marin."""
    return Path(os.environ.get("MARIN_CACHE_DIR", Path.home() / ".cache" / "marin")).expanduser()
