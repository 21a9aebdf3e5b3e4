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
            step = event.step_key if event else None
            failures.append({"step": step, "failed_assets": sorted(planned.get(step, [])),
                             "error": describe_error(err) if err else "unknown",
                             "time": _iso(entry.timestamp)})
        if run.status == dg.DagsterRunStatus.FAILURE and not failures:
            step, error = failure_outside_steps(instance, run.run_id)
            failures.append({"step": step, "failed_assets": sorted(planned.get(step, [])), "error": error,
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
    """`asset:check (key=value, ...)` of one check evaluation, then what broke the rule when the check
    says (its description: which count, against what)."""
    details = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in sorted((evaluation.metadata or {}).items()))
    described = f": {evaluation.description}" if getattr(evaluation, "description", None) else ""
    return f"{marin_key(evaluation.asset_key)}:{evaluation.check_name} ({details}){described}"


def failure_outside_steps(instance: dg.DagsterInstance, run_id: str) -> tuple[str | None, str]:
    """Why a failed run that recorded no step failure failed: the step it was in, if any, and one line.

    A step that started and never reported an end means the run's process stopped under it (kill
    -9, out of memory, a lost pod): "killed mid-step (worker gone)". A process that stopped after
    one step ended and before the next planned step started is "killed between steps". With no
    step started, the run failed before any step, for the cause Dagster recorded with the run's
    failure (a resource that could not start, such as an unreachable store), not its generic "An
    exception was thrown"."""
    def steps(kinds) -> list[str]:
        return [e.dagster_event.step_key for e in instance.all_logs(run_id, of_type=kinds)
                if e.dagster_event is not None and e.dagster_event.step_key is not None]

    ended = set(steps({dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE,
                       dg.DagsterEventType.STEP_SKIPPED}))
    started = steps(dg.DagsterEventType.STEP_START)
    planned = list(dict.fromkeys(steps(dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED)))
    cause = run_failure_cause(instance, run_id)
    if running := [step for step in started if step not in ended]:
        return running[0], f"killed mid-step (worker gone): step {running[0]} started and never ended; {cause}"
    if started and (waiting := [step for step in planned if step not in started]):
        return waiting[0], (f"killed between steps (worker gone): step {started[-1]} ended and step "
                            f"{waiting[0]} never started; {cause}")
    if started:
        return None, f"failed after its steps ended: {cause}"
    return None, f"failed before any step: {cause}"


def run_failure_cause(instance: dg.DagsterInstance, run_id: str) -> str:
    """The error recorded with a run's failure, unwrapped to the user's; else the failure's message."""
    message = "no failure recorded (see the run's event log)"
    for entry in instance.all_logs(run_id, of_type=dg.DagsterEventType.RUN_FAILURE):
        event = entry.dagster_event
        err = getattr(event.event_specific_data, "error", None) if event is not None else None
        if err is not None:
            return describe_error(err)
        if event is not None and event.message:
            message = event.message.strip()
    return message


def describe_error(err) -> str:
    """`Class: message` of the user's error inside Dagster's wrappers (a step's or a resource's, and a
    retry policy's "Exceeded max_retries" around the last attempt's error). Dagster's message usually
    starts with the class name already, sometimes module-qualified."""
    while err.cause is not None and err.cls_name.startswith(("Dagster", "RetryRequested")):
        err = err.cause
    message = err.message.strip()
    named, sep, rest = message.partition(": ")
    return f"{err.cls_name}: {rest if sep and named.rsplit('.', 1)[-1] == err.cls_name else message}"


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds")
