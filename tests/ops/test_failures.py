"""Failed materializations are read back from the instance, by the library and by `marin failures`."""

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime

import dagster as dg

from marin_assets.planning import parse_key
from marin_resources.failures import failed_materializations

TEXT = "Grey clouds gathered over the valley as the farmers brought the last of the hay into the barns. " * 20


class Threshold(dg.Config):
    min_rows: int


@dg.asset(key=["ops", "strict_table"], partitions_def=dg.StaticPartitionsDefinition(["2024", "2025"]))
def strict_table(context: dg.AssetExecutionContext, config: Threshold) -> None:
    raise ValueError(f"only 3 rows in {context.partition_key}, need {config.min_rows}")


def parse_time(value: str) -> datetime:
    stamp = datetime.fromisoformat(value)
    assert stamp.tzinfo is not None
    return stamp


def test_vanished_shard_and_failing_asset_are_recorded(tmp_path, curation_planner):
    watched = tmp_path / "in"
    watched.mkdir()
    for name in ("kept", "vanishing"):
        (watched / f"{name}.txt").write_text(f"{name}. {TEXT}")
    plan = curation_planner(f"sources:\n  - name: valley\n    uri: {watched}/*.txt\n    format: text\n    files_per_shard: 1\n")
    instance = plan.instance
    home, sources = tmp_path / "home", tmp_path / "sources.yaml"

    started = datetime.now(UTC).replace(microsecond=0)
    plan.discover()
    vanishing = next(k for k in plan.partitions_of(parse_key("raw/valley")) if k.startswith("vanishing"))
    # The shard was listed, then its file went away before the run read it.
    (watched / "vanishing.txt").unlink()
    steps = plan.materialize(parse_key("raw/valley"), vanishing, log=lambda m: None)
    assert [s.success for s in steps] == [False]

    bad = dg.materialize([strict_table], partition_key="2025", instance=instance, raise_on_error=False,
                         run_config={"ops": {"ops__strict_table": {"config": {"min_rows": 10}}}})
    assert not bad.success

    rows = {row["run_id"]: row for row in failed_materializations(instance)}

    shard_row = rows[steps[0].run_id]
    assert shard_row["assets"] == shard_row["failed_assets"] == ["raw/valley"]
    assert shard_row["partition"] == vanishing
    assert shard_row["error"].startswith("FileNotFoundError") and "vanishing.txt" in shard_row["error"]
    assert shard_row["step"] == "raw__valley_raw"
    assert shard_row["tags"]["marin/cli"] == "materialize"
    assert parse_time(shard_row["time"]) >= started

    asset_row = rows[bad.run_id]
    assert asset_row["assets"] == asset_row["failed_assets"] == ["ops/strict_table"] and asset_row["partition"] == "2025"
    assert asset_row["config"]["ops"]["ops__strict_table"]["config"] == {"min_rows": 10}
    assert asset_row["error"] == "ValueError: only 3 rows in 2025, need 10"
    assert parse_time(asset_row["time"]) >= started
    assert len(rows) == 2

    # The same record through the CLI, from a fresh process on the same DAGSTER_HOME.
    env = {**os.environ, "DAGSTER_HOME": str(home), "MARIN_SOURCES": str(sources),
           "MARIN_PREFIX": str(tmp_path / "store")}
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "failures", "--json"], env=env,
                          capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {row["run_id"]: row for row in json.loads(proc.stdout)}
    assert listed.keys() == rows.keys()
    for run_id, row in rows.items():
        for field in ("assets", "failed_assets", "partition", "config", "error", "time", "step"):
            assert listed[run_id][field] == row[field], field
    assert time.time() - parse_time(listed[bad.run_id]["time"]).timestamp() < 600


def test_failed_error_check_fails_the_step_and_is_recorded(tmp_path, curation_planner):
    """Issue #17: ERROR checks failed (quarantine bound, accounting) while the CLI said ok and
    `marin failures` listed nothing."""
    watched = tmp_path / "in"
    watched.mkdir()
    (watched / "good.txt").write_text(f"good. {TEXT}")
    (watched / "noise.txt").write_bytes(bytes(range(1, 32)) * 50)  # binary: its shard is all quarantine
    plan = curation_planner(f"sources:\n  - name: noisy\n    uri: {watched}/*.txt\n    format: text\n    files_per_shard: 1\n")
    plan.discover()
    steps = plan.materialize(parse_key("documents/noisy"), "noise.txt", log=lambda m: None)
    assert steps[-1].ran and not steps[-1].success
    assert "documents/noisy:documents_quarantine_bound" in steps[-1].error
    assert "quarantine_fraction=1.0" in steps[-1].error
    # Reused later, the artifact keeps its verdict: the command still fails.
    again = plan.materialize(parse_key("documents/noisy"), "noise.txt", log=lambda m: None)
    assert not again[-1].ran and not again[-1].success and "quarantine_bound" in again[-1].error
    good = plan.materialize(parse_key("documents/noisy"), "good.txt", log=lambda m: None)
    assert all(s.success for s in good)

    rows = [r for r in failed_materializations(plan.instance) if r["run_id"] == steps[-1].run_id]
    failed = {r["error"].split(" (")[0] for r in rows}
    assert "AssetCheckFailed: documents/noisy:documents_quarantine_bound" in failed
    assert "AssetCheckFailed: documents/noisy:documents_accounted" in failed
    assert all(r["partition"] == "noise.txt" and r["failed_assets"] == ["documents/noisy"] for r in rows)
