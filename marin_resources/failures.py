"""Failed materializations are part of the record: read them back from the Dagster instance."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import dagster as dg


def failed_materializations(instance: dg.DagsterInstance, limit: int = 200) -> list[dict[str, Any]]:
    """One row per failed step of a failed run: run id, asset, partition, config, error, time."""
    records = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]), limit=limit)
    rows = []
    for record in records:
        run = record.dagster_run
        assets = sorted("/".join(k.path) for k in (run.asset_selection or []))
        failures = []
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
            event = entry.dagster_event
            err = event.step_failure_data.error if event and event.step_failure_data else None
            while err is not None and err.cause is not None and "StepExecutionError" in err.cls_name:
                err = err.cause
            failures.append({"step": event.step_key if event else None,
                             "error": f"{err.cls_name}: {err.message.strip()}" if err else "unknown",
                             "time": _iso(entry.timestamp)})
        if not failures:
            failures.append({"step": None, "error": "run failed before any step (see the run's event log)",
                             "time": _iso(record.end_time or record.create_timestamp.timestamp())})
        for failure in failures:
            rows.append({"run_id": run.run_id, "job": run.job_name, "assets": assets,
                         "partition": run.tags.get("dagster/partition"), "config": run.run_config,
                         "tags": {k: v for k, v in run.tags.items() if not k.startswith(".dagster")}, **failure})
    return rows


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")
