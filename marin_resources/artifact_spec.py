"""An artifact, declared once.

An `ArtifactSpec` names an artifact (its marin key and code version) and says what defines each of
its partitions: the identity config, fingerprinted into its storage path. Everything else derives
from it, so that nothing can disagree with it:

- the Dagster asset (`artifacts.marin_asset`): its key, its code version, and Dagster's staleness
  after a change of a partition-independent identity;
- the identity a build commits (`artifacts.materialize_artifact`);
- what `marin status`, `marin lineage` and the planner compare committed artifacts with (the
  graph's catalog holds the specs: `marin_assets.catalog`), with the spec's optional facts for them:
  inputs from outside the graph, the inputs a partition actually reads, a note on a fresh artifact,
  the results `marin materialize` prints once it built one, the partitions of the same asset a
  partition starts from (built before it).

As in Marin's `StepSpec`, identity (what defines the artifact) is kept apart from runtime choices
(resources, region, prefix), which never enter it. Pure: no Dagster import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# partition (None when unpartitioned) -> the identity config of that partition; where the spec has a
# `run_config`, also (partition, that config) -> the identity of a build given one.
IdentityFn = Callable[..., Any]
# partition -> {upstream asset key: current data version} for inputs from outside the graph.
ExternalFn = Callable[[str | None], dict[str, str]]
# (manifest, store) -> what `marin status` adds about a fresh artifact (e.g. what a pinned input is pinned to).
NoteFn = Callable[[Any, Any], str | None]
# manifest -> the lines `marin materialize` prints once it built the artifact: the figures a researcher
# looks for first (an eval's loss, an export's path, what curation dropped), not only in the manifest.
ResultsFn = Callable[[Any], list[str]]
# partition -> the marin keys of the declared inputs that partition reads, where it reads fewer than
# its asset declares (a run reads its own mixture and tokenizer, not those of every run).
ReadsFn = Callable[[str], set[str]]
# partition -> the path of the one file of its unpartitioned input that the partition reads.
FileOfFn = Callable[[str], str]
# partition -> the partitions of the same asset it starts from and reads (a cooldown: its base run's
# checkpoint). Dagster declares no dependency of a dynamic partition on another of its own asset
# (only time-window partitions may depend on earlier ones), so the planner builds these first and
# judges freshness by them (`marin_assets.planning`).
StartsFromFn = Callable[[str], list[str]]


@dataclass(frozen=True)
class FileRead:
    """Each partition reads one file of an unpartitioned input: it is stale when that file changes, not
    whenever the input gains others (`Manifest.file_version`)."""

    parent_key: str
    file_of: FileOfFn


@dataclass(frozen=True)
class ArtifactSpec:
    """`identity(partition)` is the config that defines a partition's artifact, computed the same way
    when the asset builds it and when status looks for it. `code_identity`, where given, is the part
    of it that no partition changes: it joins Dagster's code version, so the UI marks the asset
    stale after a config change. `run_config`: the Dagster config class of an asset whose run config
    is part of its identity (an export's step): a build passes its config, status assumes the
    defaults."""

    key: str
    version: str
    identity: IdentityFn
    code_identity: Any = None
    external: ExternalFn | None = None
    note: NoteFn | None = None
    reads: ReadsFn | None = None
    file_read: FileRead | None = None
    run_config: type | None = None
    results: ResultsFn | None = None
    starts_from: StartsFromFn | None = None

    @classmethod
    def fixed(cls, key: str, version: str, identity: Any, **facts: Any) -> ArtifactSpec:
        """A spec whose every partition has the same identity (or that is unpartitioned)."""
        return cls(key, version, lambda _partition: identity, code_identity=identity, **facts)

    def __post_init__(self) -> None:
        if not self.key or not self.version:
            raise ValueError(f"an artifact spec needs a key and a version, got {self.key!r} at {self.version!r}")
