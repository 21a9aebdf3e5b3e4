"""Reports: the failure record as an asset, refreshed by a daily schedule, and the comparison of
runs (`comparison.py`)."""

from typing import TYPE_CHECKING

import dagster as dg
import polars as pl

from marin_assets.catalog import Catalog
from marin_assets.reports.comparison import build_run_comparison_asset
from marin_resources.environments import MarinSettings
from marin_resources.failures import failed_materializations
from marin_resources.keys import asset_key, stage_owners

if TYPE_CHECKING:
    from marin_assets.deployment import Deployment  # which reads this module's registry

FAILURE_COLUMNS = {"time": pl.String, "run_id": pl.String, "job": pl.String, "assets": pl.String,
                   "partition": pl.String, "step": pl.String, "error": pl.String, "config": pl.String}


@dg.asset(key=asset_key("reports/failures"), group_name="reports", code_version="v1",
          metadata={"marin/version": "v1"},
          kinds={"parquet"}, owners=stage_owners("reports"),
          description="Every failed materialization recorded by the instance (run id, assets, partition, run config, "
                      "error, time). Failed experiments are part of the record.")
def failure_report(context: dg.AssetExecutionContext) -> dg.Output[pl.DataFrame]:
    import json

    rows = failed_materializations(context.instance)
    frame = pl.DataFrame([{"time": r["time"], "run_id": r["run_id"], "job": r["job"], "assets": ",".join(r["assets"]),
                           "partition": r["partition"], "step": r["step"], "error": r["error"],
                           "config": json.dumps(r["config"], sort_keys=True, default=str)} for r in rows],
                         schema=FAILURE_COLUMNS)
    latest = frame["time"].max() if frame.height else None
    return dg.Output(frame, metadata={"dagster/row_count": frame.height, "failed_runs": frame["run_id"].n_unique(),
                                      "latest_failure": str(latest),
                                      "preview": dg.MetadataValue.md(_markdown(frame.head(20)))})


def _markdown(frame: pl.DataFrame) -> str:
    if frame.height == 0:
        return "No failed materializations."
    lines = ["| time | run | assets | partition | error |", "| --- | --- | --- | --- | --- |"]
    for r in frame.iter_rows(named=True):
        error = (r["error"] or "").splitlines()[0][:120].replace("|", "\\|")
        lines.append(f"| {r['time']} | {r['run_id'][:8]} | {r['assets']} | {r['partition'] or ''} | {error} |")
    return "\n".join(lines)


failure_report_job = dg.define_asset_job("failure_report_job", selection=[failure_report])
daily_failure_report = dg.ScheduleDefinition(job=failure_report_job, cron_schedule="0 6 * * *",
                                             default_status=dg.DefaultScheduleStatus.STOPPED,
                                             description="Refresh the failure report every morning.")


def build_reports_stage(settings: MarinSettings, deployment: "Deployment",
                        upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    comparison = build_run_comparison_asset(deployment, upstream)
    return dg.Definitions(assets=[failure_report, comparison], jobs=[failure_report_job],
                          schedules=[daily_failure_report]), Catalog()
