"""New data flows in by itself: one sensor per source lists its URI, adds a dynamic partition
for every new shard, and requests a run for new or changed shards only.

The cursor maps shard key -> the first `CURSOR_FINGERPRINT_CHARS` of the shard's fingerprint (paths,
sizes, content checksums), as much as a run key holds: 75,000 shards' full fingerprints were 7 MB of
JSON read and written each tick. Run keys are `{shard}:{fingerprint[:16]}`, so a repeated tick or a
restarted daemon never launches a shard twice, while a shard whose files change gets exactly one
new run. While a training that reads the source
is queued or running, new and changed shards wait (the tick is skipped, saying so).
"""

import json
from dataclasses import dataclass, field

import dagster as dg

from marin_assets.automation import PENDING_RUN_STATUSES, pinned_by_runs
from marin_assets.curation.config import SourceConfig
from marin_assets.curation.discovery import Shard, discover_shards
from marin_resources.dagster_private import DATA_VERSION_TAG, PARTITION_NAME_TAG
from marin_resources.keys import NEW_SHARD_TRIGGER, TRIGGER_TAG

# A run key's share of a shard's fingerprint: a change the cursor cannot tell apart, a run key could not either.
CURSOR_FINGERPRINT_CHARS = 16


@dataclass(frozen=True)
class ShardDelta:
    new: list[Shard]
    changed: list[Shard]
    cursor: dict[str, str]
    unclaimed: list[Shard] = field(default_factory=list)
    """Partitions this sensor never saw: added by someone else (`marin` discovery, possibly during
    the tick). Each is run unless it is built or being built already (`claimed_shards`)."""


def diff_shards(shards: list[Shard], known_partitions: set[str], cursor: dict[str, str]) -> ShardDelta:
    """Which shards need a partition, which need a run. Pure, for tests and for the CLI.

    ``known_partitions`` must be read before ``shards`` were listed: a partition added in between
    is then new here too, and adding it twice is a no-op, while one read after the listing could
    hold a shard this listing already has but that nobody has run."""
    now = {s.key: s.fingerprint[:CURSOR_FINGERPRINT_CHARS] for s in shards}
    new = [s for s in shards if s.key not in known_partitions]
    # A cursor written before it held prefixes holds whole fingerprints: compared by their prefix.
    changed = [s for s in shards if s.key in known_partitions and s.key in cursor
               and cursor[s.key][:CURSOR_FINGERPRINT_CHARS] != now[s.key]]
    unclaimed = [s for s in shards if s.key in known_partitions and s.key not in cursor]
    return ShardDelta(new=new, changed=changed, cursor=now, unclaimed=unclaimed)


def claimed_shards(instance: dg.DagsterInstance, raw_key: dg.AssetKey, keys: set[str]) -> set[str]:
    """Those of ``keys`` whose raw partition is materialized or in a queued or running run."""
    if not keys:
        return set()
    claimed = set(instance.get_materialized_partitions(raw_key)) & keys
    # Filtered by partition in the query: a backfill may have tens of thousands of other runs queued.
    pending = dg.RunsFilter(statuses=PENDING_RUN_STATUSES, tags={PARTITION_NAME_TAG: sorted(keys)})
    claimed.update(run.tags[PARTITION_NAME_TAG] for run in instance.get_runs(pending)
                   if raw_key in (run.asset_selection or ()))
    return claimed


def build_new_shard_sensor(source: SourceConfig, partitions: dg.DynamicPartitionsDefinition,
                           raw_key: dg.AssetKey, source_key: dg.AssetKey,
                           excluded: tuple[str, ...]) -> dg.SensorDefinition:
    """`source_key`: the source's observable asset; each new or changed shard's fingerprint is
    recorded as its observation, so the raw run that follows records the listing it read.
    ``excluded``: the store's prefix, never listed as the source's files."""
    @dg.sensor(name=f"{source.name}_new_shards", minimum_interval_seconds=30, asset_selection=[raw_key],
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Watches {source.uri} and adds a partition and a run for each new or changed shard.")
    def new_shards(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        known = set(context.instance.get_dynamic_partitions(partitions.name))  # before listing: see diff_shards
        shards = discover_shards(source, excluded)
        cursor = json.loads(context.cursor) if context.cursor else {}
        delta = diff_shards(shards, known, cursor)
        claimed = claimed_shards(context.instance, raw_key, {s.key for s in delta.unclaimed})
        to_run = delta.new + delta.changed + [s for s in delta.unclaimed if s.key not in claimed]
        requests = [dg.RunRequest(partition_key=s.key, run_key=f"{s.key}:{s.fingerprint[:CURSOR_FINGERPRINT_CHARS]}",
                                  asset_selection=[raw_key], tags={TRIGGER_TAG: NEW_SHARD_TRIGGER})
                    for s in to_run]
        if not requests:
            return dg.SensorResult(skip_reason=f"no new or changed shards among {len(shards)}",
                                   cursor=json.dumps(delta.cursor, sort_keys=True))
        # A training reads what is built from these shards: they wait (the cursor stays) until it ends.
        readers = pinned_by_runs(context.instance, context.repository_def.asset_graph).get(raw_key)
        if readers:
            return dg.SensorResult(skip_reason=f"{len(requests)} new or changed shard(s) wait until the training "
                                               f"that reads them ends: {'; '.join(sorted(readers))}")
        return dg.SensorResult(
            run_requests=requests,
            asset_events=[dg.AssetObservation(asset_key=source_key, partition=s.key,
                                              tags={DATA_VERSION_TAG: s.fingerprint})
                          for s in to_run],
            dynamic_partitions_requests=[partitions.build_add_request([s.key for s in delta.new])] if delta.new else [],
            cursor=json.dumps(delta.cursor, sort_keys=True))

    return new_shards
