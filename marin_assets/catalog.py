"""What the CLI and the sensors need to know about the graph beyond Dagster's own definitions:
how to discover each dynamic partition set, and each asset's identity config per partition.

Stage modules register into a `Catalog` while they build their definitions; nothing here
touches storage or imports heavy libraries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Discoverer = Callable[[], list[str]]
IdentityFn = Callable[[str | None], Any]
# partition -> {upstream asset key: current data version} for inputs from outside the graph.
ExternalFn = Callable[[str | None], dict[str, str]]
# (manifest, store) -> what `marin status` adds about a fresh artifact (e.g. what a pinned input is pinned to).
NoteFn = Callable[[Any, Any], str | None]
# partition -> the marin keys of the declared inputs that partition reads, where it reads fewer than
# its asset declares (a run reads its own mixture and tokenizer, not those of every run).
ReadsFn = Callable[[str], set[str]]
# partition -> the path of the one file of its unpartitioned input that the partition reads.
FileOfFn = Callable[[str], str]


@dataclass
class Catalog:
    discoverers: dict[str, Discoverer] = field(default_factory=dict)
    identities: dict[str, IdentityFn] = field(default_factory=dict)
    externals: dict[str, ExternalFn] = field(default_factory=dict)
    notes: dict[str, NoteFn] = field(default_factory=dict)
    reads: dict[str, ReadsFn] = field(default_factory=dict)
    # asset key -> (its unpartitioned input, the file of it each partition reads)
    file_reads: dict[str, tuple[str, FileOfFn]] = field(default_factory=dict)

    def add_discoverer(self, partitions_name: str, fn: Discoverer) -> None:
        self.discoverers[partitions_name] = fn

    def add_identity(self, asset_key: str, fn: IdentityFn) -> None:
        self.identities[asset_key] = fn

    def add_external(self, asset_key: str, fn: ExternalFn) -> None:
        self.externals[asset_key] = fn

    def add_note(self, asset_key: str, fn: NoteFn) -> None:
        self.notes[asset_key] = fn

    def add_reads(self, asset_key: str, fn: ReadsFn) -> None:
        self.reads[asset_key] = fn

    def add_file_read(self, asset_key: str, parent_key: str, fn: FileOfFn) -> None:
        """Each partition of ``asset_key`` reads one file of ``parent_key`` (unpartitioned): it is stale
        when that file changes, not whenever the parent gains others (`Manifest.file_version`)."""
        self.file_reads[asset_key] = (parent_key, fn)

    def merge(self, other: Catalog) -> Catalog:
        return Catalog({**self.discoverers, **other.discoverers}, {**self.identities, **other.identities},
                       {**self.externals, **other.externals}, {**self.notes, **other.notes},
                       {**self.reads, **other.reads}, {**self.file_reads, **other.file_reads})
