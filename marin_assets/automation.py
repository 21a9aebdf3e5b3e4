"""New data flows to the token cache by itself.

A source's `<source>_new_shards` sensor (curation/sensors.py, running by default) adds a
partition and requests `raw/<source>` for each new or changed shard. From there every asset up
to the training mixture carries `FOLLOWS_NEW_DATA`, which the one `automation` sensor evaluates:

    raw[shard] -> documents[shard] -> filtered[shard] -> dedup_index/<group> -> deduplicated
               -> tokenized -> mixture

Each of them is requested once an input was updated (or will be, in the same tick), while no
input is missing or in progress; the cross-shard ones are append-only (the dedup index, the
token cache), so a new shard costs its own work, not a rebuild. The tokenizer is pinned and
training is not automated: a new checkpoint is a decision (`marin materialize`, the UI).
"""

import dagster as dg

FOLLOWS_NEW_DATA = dg.AutomationCondition.eager()
AUTOMATION_INTERVAL_S = 30


def build_automation_sensor() -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "automation", target=dg.AssetSelection.all(), default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=AUTOMATION_INTERVAL_S,
        description="Carries new shards from raw/ to the token cache and the mixtures: evaluates every asset's "
                    "automation condition (curation, dedup, tokenization; training has none).")
