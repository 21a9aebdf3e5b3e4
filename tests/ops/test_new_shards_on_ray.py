"""The new-shard flow on a running Ray cluster (`NewShardRunLauncher`, docs/scaling-out.md, "New shards
on a running Ray cluster"). The instance's launcher sends the runs the `<source>_new_shards` sensor
requests to a real two-node Ray cluster's job server, where each runs as a Ray job and commits its
shard; a run of a `marin materialize` plan, on the same instance, stays with the wrapped launcher. With
the job server gone, `when_unreachable: stop` fails the flow's run in one line before it starts, with
nothing committed, and `fallback` launches it locally and says so in its event log."""

import contextlib
import http.server
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import dagster as dg
import pytest
import yaml
from dagster._core.launcher import LaunchRunContext, RunLauncher

from marin_assets import run_submission
from marin_assets.curation.assets import build_curation_stage
from marin_assets.deployment import Deployment
from marin_assets.planning import CLI_TAG, Planner
from marin_assets.run_submission import WorkspaceRuns
from marin_assets.stages import build_stage
from marin_resources.dagster_private import PARTITION_NAME_TAG, RUNS_START_HERE_ENV, worker_started_event_data
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import NEW_SHARD_FLOW_TRIGGERS, TRIGGER_TAG, asset_key
from marin_resources.new_shard_launcher import (
    LAUNCHED_BY_TAG,
    NewShardRunLauncher,
    is_new_shard_flow,
    job_server_problem,
)
from marin_resources.storage.store import ArtifactStore
from marin_resources.typed_config import ConfigError
from tests.ops.conftest import free_port
from tests.ops.ray_nodes import NO_AUTH, two_node_cluster

REPO = Path(__file__).resolve().parents[2]
RAW = asset_key("raw/letters")
TEXT = "The ferryman rowed the last passengers across the river while the lamps were lit on the far bank. "
RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def job_server():
    """A two-node Ray cluster on 127.0.0.1 with the head's job server: the job server's address. Its
    nodes' PATH is the system's, not this environment's, as on a cluster's own machines: a job that
    relied on `dagster` being on PATH would never start its run."""
    with two_node_cluster() as jobs:
        yield jobs


def flow_instance(tmp_path: Path, monkeypatch, launcher: dict) -> tuple[dg.DagsterInstance, dg.Definitions]:
    """An embedded-default instance whose run launcher is `NewShardRunLauncher` with `launcher` as its
    config, a watched folder of two one-file shards, and the curation stage's definitions over it."""
    watched = tmp_path / "in"
    watched.mkdir()
    for name in ("north", "south"):
        (watched / f"{name}.txt").write_text("\n\n".join(f"{name} {i}. {TEXT * 3}" for i in range(4)))
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: letters\n    uri: {watched}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    home = tmp_path / "home"
    home.mkdir()
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    config["run_launcher"] = {"module": "marin_resources.new_shard_launcher", "class": "NewShardRunLauncher",
                              "config": launcher}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    # The code server, the local runs and (through the launcher's env_vars) the Ray jobs read these.
    for name, value in {"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_SOURCES": str(sources),
                        "MARIN_ENV": "local", "DAGSTER_HOME": str(home), **NO_AUTH}.items():
        monkeypatch.setenv(name, value)
    settings = MarinSettings.from_env()
    stage_defs, _ = build_stage(build_curation_stage, settings, Deployment.load(settings))
    defs = dg.Definitions.merge(stage_defs, dg.Definitions(resources=build_resources(settings)))
    return dg.DagsterInstance.from_config(str(home)), defs


def run_to_the_end(instance: dg.DagsterInstance, submit) -> list[dg.DagsterRun]:
    """Submits runs through the workspace, as the daemon's run queue launches them, and waits for them."""
    with WorkspaceRuns(instance, str(REPO / "workspace.yaml")) as runs:
        run_ids = submit(runs)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            found = [instance.get_run_by_id(run_id) for run_id in run_ids]
            if all(run is not None and run.is_finished for run in found):
                return found
            time.sleep(1)
    raise AssertionError(f"runs not finished after {RUN_TIMEOUT_S}s: {[r.status for r in found]}")


def sensor_requests(instance: dg.DagsterInstance, defs: dg.Definitions) -> list[dg.RunRequest]:
    """One tick of the real `letters_new_shards` sensor, its partitions added as the daemon adds them."""
    result = defs.get_sensor_def("letters_new_shards")(dg.build_sensor_context(instance=instance, definitions=defs))
    for request in result.dynamic_partitions_requests:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return list(result.run_requests)


def job_end(jobs, submission_id: str, timeout_s: float = 120) -> str:
    """The Ray job's final status: its run worker exits a moment after the run's last event."""
    deadline = time.monotonic() + timeout_s
    while (status := jobs.get_job_status(submission_id)) not in ("SUCCEEDED", "FAILED", "STOPPED"):
        assert time.monotonic() < deadline, f"{submission_id} still {status} after {timeout_s}s"
        time.sleep(0.5)
    return status


def committed(tmp_path: Path, partition: str) -> bool:
    store = ArtifactStore(str(tmp_path / "store"))
    manifest = store.find("raw/letters", "v1", partition)
    return manifest is not None and store.verify(manifest) == []


def messages(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[str]:
    return [record.message or "" for record in instance.all_logs(run.run_id)]


@pytest.mark.slow  # a two-node Ray cluster, Ray jobs and local runs of a code location
def test_the_sensors_runs_go_to_the_ray_cluster_and_a_plans_run_stays_local(job_server, tmp_path, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    instance, defs = flow_instance(tmp_path, monkeypatch, {"ray": {"address": job_server},
                                                           "when_unreachable": "stop"})
    requests = sensor_requests(instance, defs)
    assert len(requests) == 2
    flow, plan = requests

    def submit(runs: WorkspaceRuns) -> list[str]:
        # The second shard as a `marin materialize` plan would run it: no trigger tag.
        return [runs.submit([RAW], [], flow.partition_key, {}, flow.tags),
                runs.submit([RAW], [], plan.partition_key, {}, {"marin/plan_targets": "raw/letters_raw"})]

    on_ray, local = run_to_the_end(instance, submit)
    assert on_ray.status == dg.DagsterRunStatus.SUCCESS, messages(instance, on_ray)[-20:]
    assert local.status == dg.DagsterRunStatus.SUCCESS, messages(instance, local)[-20:]
    assert on_ray.tags[LAUNCHED_BY_TAG] == "ray" and LAUNCHED_BY_TAG not in local.tags
    jobs = JobSubmissionClient(job_server)
    assert job_end(jobs, f"dagster-run-{on_ray.run_id}") == "SUCCEEDED"
    assert f"dagster-run-{local.run_id}" not in {job.submission_id for job in jobs.list_jobs()}
    assert committed(tmp_path, flow.partition_key) and committed(tmp_path, plan.partition_key)
    # The Ray job's run worker is a process of the cluster, not of this machine's code server.
    assert any("Ray run job created" in line for line in messages(instance, on_ray))


@pytest.mark.slow  # local runs of a code location
@pytest.mark.parametrize("when_unreachable", ["stop", "fallback"])
def test_an_unreachable_cluster_stops_the_run_in_one_line_or_falls_back_as_set(when_unreachable, tmp_path,
                                                                                monkeypatch):
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    instance, defs = flow_instance(tmp_path, monkeypatch, {"ray": {"address": address},
                                                           "when_unreachable": when_unreachable})
    (request, _) = sensor_requests(instance, defs)
    (run,) = run_to_the_end(instance, lambda runs: [runs.submit([RAW], [], request.partition_key, {}, request.tags)])
    said = messages(instance, run)
    if when_unreachable == "stop":
        assert run.status == dg.DagsterRunStatus.FAILURE
        (failure,) = [line for line in said if "does not answer" in line]
        assert failure.startswith(f"not started: the Ray job server at {address} does not answer (")
        assert failure.endswith("; when_unreachable: stop") and "\n" not in failure
        assert not committed(tmp_path, request.partition_key)
        assert not list(tmp_path.glob("store/**/.artifact.json"))
    else:
        assert run.status == dg.DagsterRunStatus.SUCCESS, said[-20:]
        assert run.tags[LAUNCHED_BY_TAG] == "otherwise"
        (notice,) = [line for line in said if "does not answer" in line]
        assert notice.startswith(f"[NewShardRunLauncher] the Ray job server at {address} does not answer (")
        assert notice.endswith(": launched by DefaultRunLauncher instead (when_unreachable: fallback)")
        assert committed(tmp_path, request.partition_key)


def test_a_bad_when_unreachable_is_refused_when_the_instance_loads(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # the embedded default's paths name it
    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    config["run_launcher"] = {"module": "marin_resources.new_shard_launcher", "class": "NewShardRunLauncher",
                              "config": {"ray": {"address": "http://127.0.0.1:8265"}, "when_unreachable": "retry"}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="when_unreachable must be one of fallback, stop, got 'retry'"):
        dg.DagsterInstance.from_config(str(home)).run_launcher  # noqa: B018 -- built on first use


class RecordingLauncher(RunLauncher):
    """A wrapped launcher that records which runs it was asked to launch and cancel."""

    def __init__(self):
        self.launched, self.terminated = [], []
        super().__init__()

    def launch_run(self, context: LaunchRunContext) -> None:
        self.launched.append(context.dagster_run)

    def terminate(self, run_id: str) -> bool:
        self.terminated.append(run_id)
        return True

    def get_run_worker_debug_info(self, run, include_container_logs=True) -> str:
        return f"worker of {run.run_id}: OOMKilled"


@contextlib.contextmanager
def routing_instance(**overrides):
    """A test instance whose launcher is NewShardRunLauncher over the local default; nothing listens at
    its job server's address."""
    launcher = {"module": "marin_resources.new_shard_launcher", "class": "NewShardRunLauncher",
                "config": {"ray": {"address": f"http://127.0.0.1:{free_port()}"}}}
    with dg.instance_for_test(overrides={"run_launcher": launcher, **overrides}) as instance:
        yield instance


def started_run(instance: dg.DagsterInstance, tags: dict[str, str]) -> dg.DagsterRun:
    @dg.asset
    def shard():
        return 1

    job = dg.Definitions(assets=[shard]).resolve_implicit_global_asset_job_def()
    run = instance.create_run_for_job(job, tags=tags)
    instance.handle_run_event(run.run_id, dg.DagsterEvent(event_type_value=dg.DagsterEventType.RUN_START.value,
                                                          job_name=run.job_name))
    return instance.get_run_by_id(run.run_id)


def test_run_monitoring_leaves_a_run_of_the_wrapped_local_launcher_alone():
    """The local default checks no worker; the daemon's monitoring must not read that as a lost one."""
    from dagster._daemon.monitoring.run_monitoring import monitor_started_run

    with routing_instance(run_monitoring={"enabled": True}) as instance:
        run = started_run(instance, {})
        assert instance.run_launcher.supports_check_run_worker_health  # Ray's runs are checked
        monitor_started_run(instance, None, instance.get_run_record_by_id(run.run_id), logging.getLogger("test"))
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


def test_a_copied_ray_tag_on_a_run_the_wrapped_launcher_starts_is_corrected():
    """A retry copies its parent's tags: a run outside the flow carrying `ray` is relabelled, so that its
    cancel goes to the launcher that started it."""
    with routing_instance() as instance:
        launcher = instance.run_launcher
        launcher.otherwise = recording = RecordingLauncher()
        recording.register_instance(instance)
        run = instance.create_run_for_job(
            dg.Definitions(assets=[dg.asset(lambda: 1, name="shard")]).resolve_implicit_global_asset_job_def(),
            tags={LAUNCHED_BY_TAG: "ray"})
        launcher.launch_run(LaunchRunContext(run, None))
        assert instance.get_run_by_id(run.run_id).tags[LAUNCHED_BY_TAG] == "otherwise"
        assert recording.launched[0].tags[LAUNCHED_BY_TAG] == "otherwise"
        assert launcher.terminate(run.run_id) and recording.terminated == [run.run_id]
        # Run monitoring's account of a failed worker comes from the same launcher.
        stored = instance.get_run_by_id(run.run_id)
        assert launcher.get_run_worker_debug_info(stored) == f"worker of {run.run_id}: OOMKilled"


def test_a_dead_local_worker_is_detected_behind_the_wrapper():
    """`marin materialize` fails a run whose local worker died; the wrapped DefaultRunLauncher's runs too."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with routing_instance() as instance:
        run = started_run(instance, {CLI_TAG: "materialize"})
        instance.report_engine_event(f"Started process for run (pid: {dead.pid}).", run,
                                     worker_started_event_data(dead.pid))
        why = Planner(dg.Definitions(), None, None, instance).lost_worker(run.run_id)
        assert why is not None and str(dead.pid) in why
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE


def test_the_cli_warms_local_run_workers_behind_the_wrapper(monkeypatch):
    """The CLI's runs go to the wrapped local launcher: its code server warms their first worker."""
    monkeypatch.delenv(RUNS_START_HERE_ENV, raising=False)
    monkeypatch.setattr(run_submission, "open_workspace", lambda *_: SimpleNamespace(
        get_code_location_entries=dict))
    with routing_instance() as instance, WorkspaceRuns(instance, "workspace.yaml") as runs:
        assert runs.workspace is not None
        assert os.environ.get(RUNS_START_HERE_ENV) == "1"


def test_the_daemons_secrets_stay_out_of_the_ray_jobs_runtime_env(monkeypatch):
    """Ray shows a job's runtime_env on its dashboard: the default env list leaves secrets out, and a
    config naming one is refused."""
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", "hunter2-secret")
    monkeypatch.setenv("MARIN_PREFIX", "/tmp/store")
    with routing_instance() as instance:
        env_vars = instance.run_launcher.ray.env_vars
        assert "MARIN_PREFIX" in env_vars and "DAGSTER_PG_PASSWORD" not in env_vars
    for ray in ({"env_vars": ["DAGSTER_PG_PASSWORD"]}, {"env_vars": ["HF_TOKEN=abc"]},
                {"runtime_env": {"env_vars": {"WANDB_API_KEY": "k"}}}):
        with pytest.raises(ConfigError, match="name the secret .*; set it on the cluster's nodes"):
            NewShardRunLauncher(ray={"address": "http://127.0.0.1:8265", **ray})


@contextlib.contextmanager
def job_server_behind_a_proxy(token: str):
    """An HTTP server standing for a job server behind a proxy: `/api/version` answers only a request
    with the bearer token and the session cookie, else HTTP 401."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- http.server's name
            cookie = self.headers.get("Cookie", "")
            ok = self.headers.get("Authorization") == f"Bearer {token}" and "session=s1" in cookie
            body = b'{"version": "2.0"}' if ok else b"{}"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_reach_check_sends_the_submissions_headers_and_cookies():
    """Behind a proxy that wants a token, the check asks as the submission will: with the configured
    headers and cookies the flow's run goes to Ray; a refusal is said as one, not as silence."""
    with job_server_behind_a_proxy("t0k") as address, \
            dg.instance_for_test(overrides={"run_launcher": {
                "module": "marin_resources.new_shard_launcher", "class": "NewShardRunLauncher",
                "config": {"ray": {"address": address, "headers": {"Authorization": "Bearer t0k"},
                                   "cookies": {"session": "s1"}}, "when_unreachable": "stop"}}}) as instance:
        launcher = instance.run_launcher
        submitted = []
        launcher.ray.launch_run = lambda context: submitted.append(context.dagster_run.run_id)
        run = instance.create_run_for_job(
            dg.Definitions(assets=[dg.asset(lambda: 1, name="shard")]).resolve_implicit_global_asset_job_def(),
            tags={TRIGGER_TAG: NEW_SHARD_FLOW_TRIGGERS[0], PARTITION_NAME_TAG: "north.txt"})
        launcher.launch_run(LaunchRunContext(run, None))
        assert submitted == [run.run_id]
        assert instance.get_run_by_id(run.run_id).tags[LAUNCHED_BY_TAG] == "ray"
        assert job_server_problem(address) == f"the Ray job server at {address} refuses the request (HTTP 401 " \
                                              "Unauthorized)"


def test_only_the_flows_per_shard_runs_go_to_ray():
    def run(**tags: str) -> dg.DagsterRun:
        return dg.DagsterRun(job_name="__ASSET_JOB", tags=tags)

    assert is_new_shard_flow(run(**{TRIGGER_TAG: "new_shard_sensor", PARTITION_NAME_TAG: "north.txt"}))
    assert is_new_shard_flow(run(**{TRIGGER_TAG: "automation", PARTITION_NAME_TAG: "north.txt"}))
    assert not is_new_shard_flow(run(**{TRIGGER_TAG: "automation"}))  # the cache's append
    assert not is_new_shard_flow(run(**{PARTITION_NAME_TAG: "north.txt"}))  # a `marin materialize` plan's shard
