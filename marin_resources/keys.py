"""Marin keys and Dagster asset keys: one rule, used by every part that names an asset.

A *marin key* is what the store, the manifests and the `marin` CLI use: `stage/subject`
(`filtered/shakespeare`, `tokenizer/shakespeare`, `scaling_fit/micro-delphi`) or a single word
(`checkpoint`, `eval`, `quality_classifier`). Store paths are built from it and never change.

The Dagster asset key of `stage/subject` is `[stage, subject_stage]`: the web UI labels a graph
node with the last component only, so that component names both the subject and the stage
(`shakespeare_filtered`), unique across the graph, while the first component keeps the catalog's
folders by stage. A one-word key is its own asset key. See docs/ui.md.
"""

from __future__ import annotations

import re

import dagster as dg

# A name the project file gives a source, tokenizer or mixture: it becomes a path segment and a Dagster
# tag value (`marin/source`, `marin/mixture`), and Dagster refuses a tag value outside this set when the
# code location loads, with a stack trace.
NAME_RULE = "letters, digits, '_', '.', '-'; starts with a letter or digit; at most 63 characters"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def is_safe_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None

# Run tag of what set a run off, and its values for the new-shard flow: the `<source>_new_shards`
# sensor's runs and the automation sensor's (marin_assets/automation.py; the launcher that sends the flow
# to Ray, marin_resources/new_shard_launcher.py, routes by it).
TRIGGER_TAG = "marin/trigger"
NEW_SHARD_TRIGGER = "new_shard_sensor"
AUTOMATION_TRIGGER = "automation"
NEW_SHARD_FLOW_TRIGGERS = (NEW_SHARD_TRIGGER, AUTOMATION_TRIGGER)

# Who answers for each stage's assets (Dagster owners are e-mail addresses or `team:` names).
STAGE_OWNERS = {"curation": "team:marin-curation", "tokenization": "team:marin-tokenization",
                "training": "team:marin-training", "export": "team:marin-training",
                "evaluation": "team:marin-evaluation",
                "scaling": "team:marin-scaling", "reports": "team:marin-ops"}


def shard_partitions(source: str) -> dg.DynamicPartitionsDefinition:
    """The partitions of a source's per-shard assets, one per shard its discovery found: curation's
    (`raw`, `documents`, `filtered`) and tokenization's (`token_shards`)."""
    return dg.DynamicPartitionsDefinition(name=f"{source}_shards")


def asset_key(marin_key: str) -> dg.AssetKey:
    """The Dagster asset key of a marin key (`filtered/shakespeare` -> `filtered/shakespeare_filtered`)."""
    parts = [p for p in marin_key.split("/") if p]
    if len(parts) == 1:
        return dg.AssetKey(parts)
    if len(parts) != 2:
        raise ValueError(f"asset key {marin_key!r}: expected `stage/subject` or one word")
    stage, subject = parts
    return dg.AssetKey([stage, f"{subject}_{stage}"])


def marin_key(key: dg.AssetKey) -> str:
    """The marin key of a Dagster asset key; the inverse of `asset_key`."""
    path = list(key.path)
    if len(path) == 2 and path[1].endswith(f"_{path[0]}") and len(path[1]) > len(path[0]) + 1:
        return f"{path[0]}/{path[1][:-len(path[0]) - 1]}"
    return "/".join(path)


def parse_selection(text: str) -> dg.AssetKey:
    """What a user typed on the command line: a marin key (`filtered/shakespeare`) or the asset key
    the web UI shows (`filtered/shakespeare_filtered`)."""
    parts = [p for p in text.split("/") if p]
    if len(parts) == 2 and parts[1].endswith(f"_{parts[0]}"):
        return dg.AssetKey(parts)
    return asset_key(text)


def stage_owners(group: str) -> list[str]:
    return [STAGE_OWNERS[group]] if group in STAGE_OWNERS else []
