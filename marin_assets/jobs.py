"""One asset job per stage, so that a GraphQL client or the UI's Jobs list can launch a stage by name
instead of through Dagster's hidden `__ASSET_JOB`.

A Dagster job has one partitions definition, so a stage whose assets are partitioned differently
becomes several jobs: `<stage>` for its unpartitioned assets and `<stage>_<partitions>` for the assets
partitioned by each definition (`training_runs`, `curation_shakespeare_shards`,
`scaling_demo_sweep_runs`). A job selects the stage's assets, with their checks; a launch names the
assets it wants and, for a partitioned job, the partition (docs/ui.md, "Stage jobs")."""

from __future__ import annotations

import re
from collections import defaultdict

import dagster as dg

# Stage groups that get jobs; `reports` has its own job and schedule (`failure_report_job`).
JOB_STAGES = ("curation", "tokenization", "training", "evaluation", "export", "scaling")


def stage_job_name(stage: str, partitions: dg.PartitionsDefinition | None) -> str:
    if partitions is None:
        return stage
    name = getattr(partitions, "name", None)
    if not name:
        raise ValueError(f"stage {stage!r}: a partitions definition without a name cannot name a job: {partitions}")
    return f"{stage}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"


def build_stage_jobs(stage_definitions: list[dg.Definitions]) -> list[dg.UnresolvedAssetJobDefinition]:
    """A job per stage group of `JOB_STAGES` and partitions definition, over the materializable assets of
    `stage_definitions` (observable sources are observed, not materialized, so no job selects them)."""
    selected: dict[str, list[dg.AssetKey]] = defaultdict(list)
    partitions_of: dict[str, tuple[str, dg.PartitionsDefinition | None]] = {}
    for definitions in stage_definitions:
        for assets in definitions.assets or ():
            if not isinstance(assets, dg.AssetsDefinition) or not assets.is_materializable:
                continue
            for spec in assets.specs:
                if spec.group_name not in JOB_STAGES:
                    continue
                name = stage_job_name(spec.group_name, spec.partitions_def)
                if partitions_of.setdefault(name, (spec.group_name, spec.partitions_def))[1] != spec.partitions_def:
                    raise ValueError(f"job {name!r} would mix two partitions definitions: {partitions_of[name][1]} "
                                     f"and {spec.partitions_def} (of {spec.key.to_user_string()})")
                selected[name].append(spec.key)
    return [dg.define_asset_job(name, selection=dg.AssetSelection.assets(*sorted(keys, key=str)),
                                description=_description(*partitions_of[name]))
            for name, keys in sorted(selected.items())]


def _description(stage: str, partitions: dg.PartitionsDefinition | None) -> str:
    which = "that are not partitioned" if partitions is None else f"partitioned by `{partitions.name}`"
    return (f"The {stage} stage's assets {which}, with their checks. A launch names the assets to build"
            + ("." if partitions is None else " and the partition."))
