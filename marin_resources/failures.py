"""Failed materializations are part of the record: read them back from the Dagster instance.

A failed ERROR-severity asset check is a failure too, even in a run Dagster counts as a success
(the step that built the asset succeeded): it gets its own row."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import dagster as dg

from marin_resources.keys import marin_key


def failed_materializations(instance: dg.DagsterInstance, limit: int = 200) -> list[dict[str, Any]]:
    """One row per failed step of a failed run, and per failed ERROR check of any finished run: run
    id, the run's assets and the failed step's assets, partition, config, error, time."""
    records = [record for status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.SUCCESS)
               for record in instance.get_run_records(dg.RunsFilter(statuses=[status]), limit=limit)]
    rows = []
    for record in sorted(records, key=lambda r: r.create_timestamp, reverse=True):
        run = record.dagster_run
        failures = _failed_error_checks(instance, run.run_id)
        if run.status != dg.DagsterRunStatus.FAILURE and not failures:
            continue
        # In-process runs (dg.materialize, the marin CLI) leave asset_selection empty; the planned
        # materializations name every asset of the run and the step that was to produce it.
        planned: dict[str | None, list[str]] = {}
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED):
            event = entry.dagster_event
            if event is not None and event.asset_key is not None:
                planned.setdefault(event.step_key, []).append(marin_key(event.asset_key))
        assets = sorted({marin_key(k) for k in (run.asset_selection or [])}
                        | {k for keys in planned.values() for k in keys})
        for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
            event = entry.dagster_event
            err = event.step_failure_data.error if event and event.step_failure_data else None
            while err is not None and err.cause is not None and "StepExecutionError" in err.cls_name:
                err = err.cause
            step = event.step_key if event else None
            failures.append({"step": step, "failed_assets": sorted(planned.get(step, [])),
                             "error": _describe(err) if err else "unknown",
                             "time": _iso(entry.timestamp)})
        if run.status == dg.DagsterRunStatus.FAILURE and not failures:
            failures.append({"step": None, "failed_assets": [],
                             "error": "run failed before any step (see the run's event log)",
                             "time": _iso(record.end_time or record.create_timestamp.timestamp())})
        for failure in failures:
            rows.append({"run_id": run.run_id, "job": run.job_name, "assets": assets,
                         "partition": run.tags.get("dagster/partition"), "config": run.run_config,
                         "tags": {k: v for k, v in run.tags.items() if not k.startswith(".dagster")}, **failure})
    return rows


def _failed_error_checks(instance: dg.DagsterInstance, run_id: str) -> list[dict[str, Any]]:
    rows = []
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION):
        event = entry.dagster_event
        evaluation = event.event_specific_data if event is not None else None
        if evaluation is None or evaluation.passed or evaluation.severity != dg.AssetCheckSeverity.ERROR:
            continue
        rows.append({"step": event.step_key, "failed_assets": [marin_key(evaluation.asset_key)],
                     "error": f"AssetCheckFailed: {describe_check(evaluation)}", "time": _iso(entry.timestamp)})
    return rows


def describe_check(evaluation) -> str:
    """`asset:check (key=value, ...)` of one check evaluation."""
    details = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in sorted((evaluation.metadata or {}).items()))
    return f"{marin_key(evaluation.asset_key)}:{evaluation.check_name} ({details})"


def _describe(err) -> str:
    """`Class: message`; Dagster's message usually carries the class name already."""
    message = err.message.strip()
    return message if message.startswith(f"{err.cls_name}:") else f"{err.cls_name}: {message}"


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")
