"""What the CLI, the planner and the sensors know about the graph beyond Dagster's own definitions:
each artifact's spec (`marin_resources.artifact_spec`: its identity per partition and the facts
status needs), and how to discover each dynamic partition set.

A stage declares an artifact through its catalog, `@catalog.asset(spec, ...)`, which makes the
Dagster asset from the spec and records the spec here: the asset and `marin status` cannot be given
two different identities. Nothing here touches storage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import marin_asset

Discoverer = Callable[[], list[str]]


@dataclass
class Catalog:
    discoverers: dict[str, Discoverer] = field(default_factory=dict)
    specs: dict[str, ArtifactSpec] = field(default_factory=dict)

    def spec(self, key: str) -> ArtifactSpec:
        """The spec of ``key``: a stage asks the catalog of the stages before it, or its own."""
        spec = self.specs.get(key)
        if spec is None:
            raise ValueError(f"no artifact {key!r} is declared by the stages built so far; declared: "
                             f"{', '.join(sorted(self.specs)) or 'none'}")
        return spec

    def add_discoverer(self, partitions_name: str, fn: Discoverer) -> None:
        self.discoverers[partitions_name] = fn

    def asset(self, spec: ArtifactSpec, **asset_kwargs: Any):
        """`marin_asset` for ``spec``, recorded in this catalog."""
        if spec.key in self.specs:
            raise ValueError(f"artifact {spec.key!r} is declared twice")
        self.specs[spec.key] = spec
        return marin_asset(spec, **asset_kwargs)

    def merge(self, other: Catalog) -> Catalog:
        twice = set(self.specs) & set(other.specs)
        if twice:
            raise ValueError(f"artifacts declared by two stages: {sorted(twice)}")
        return Catalog({**self.discoverers, **other.discoverers}, {**self.specs, **other.specs})
