"""A file as a source's listing names it (`FileRef`), and why a listed file is not read.

Every URI scheme lists its files as `FileRef`s (schemes/); discovery groups them into shards,
copying and reading take them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a listed file is not read. Each becomes one quarantine row with this reason; ``FileRef.refused``
# holds "<reason>: <detail>".
OUTSIDE_ROOT = "outside_root"  # a symlink resolving outside the source root
BROKEN_LINK = "broken_link"  # a symlink whose target does not exist (or a loop of links)
NOT_A_REGULAR_FILE = "not_a_regular_file"  # a FIFO, socket or device: opening or reading it can wait forever
CHANGED_DURING_READ = "changed_during_read"  # rewritten or grown during every read of its copy
UNREADABLE_FILE = "unreadable"  # opening it failed (no permission)
NOT_INSTALLED = "not_installed"  # a pinned distribution missing from the environment, or at another version
REFUSAL_REASONS = (OUTSIDE_ROOT, BROKEN_LINK, NOT_A_REGULAR_FILE, CHANGED_DURING_READ, UNREADABLE_FILE, NOT_INSTALLED)


@dataclass(frozen=True)
class FileRef:
    uri: str  # reopenable with opening.open_binary()
    relpath: str  # relative to the source root; sort order and shard key
    size: int | None = None
    mtime: str | None = None
    # Content checksum: "sha256:<hex>" for local files, the store's ETag / crc32c / md5 otherwise.
    etag: str | None = None
    # Why the file is not read (a symlink out of the source root); it becomes one quarantine row.
    refused: str | None = None
    # Part of a big JSONL file: the lines that start in bytes [start, end). See discovery.split_large_files.
    byte_range: tuple[int, int] | None = None

    @property
    def shard_path(self) -> str:
        """The path a shard starting at this file is keyed by: one per range of a split file."""
        return self.relpath if self.byte_range is None else f"{self.relpath}/bytes={self.byte_range[0]:012d}"


def refusal(reason: str, detail: str) -> str:
    """``FileRef.refused`` for a file listed but not read."""
    return f"{reason}: {detail}"


def refusal_parts(refused: str) -> tuple[str, str]:
    """(reason, detail) of ``FileRef.refused``. Listings written before refusals named their reason
    held only links out of the root."""
    reason, sep, detail = refused.partition(": ")
    return (reason, detail) if sep and reason in REFUSAL_REASONS else (OUTSIDE_ROOT, refused)
