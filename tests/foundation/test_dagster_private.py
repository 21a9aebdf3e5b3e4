"""Every name of marin_resources/dagster_private.py against the installed Dagster (1.13.27): each is a
private Dagster API, so a Dagster upgrade that moves, renames or changes one fails here, by name."""

import contextlib
import time

import dagster as dg
import pytest
import yaml

from marin_assets.planning import Planner
from marin_assets.run_submission import WorkspaceRuns
from marin_resources import dagster_private as private

PARTITIONS = dg.StaticPartitionsDefinition(["a", "b"])


def source_and_consumer():
    @dg.observable_source_asset(key="listing", partitions_def=PARTITIONS)
    def listing():
        return dg.DataVersionsByPartition({"a": dg.DataVersion("1"), "b": dg.DataVersion("1")})

    external = private.observable_source_assets_def(listing).map_asset_specs(
        lambda spec: spec.replace_attributes(owners=["team:curation"]))

    @dg.asset(key="copied", partitions_def=PARTITIONS, deps=[external.key])
    def copied():
        return None

    return external, copied


def test_an_observed_data_version_drives_dagsters_staleness():
    """An observable source asset becomes an AssetsDefinition whose specs take owners; a runless
    observation tagged DATA_VERSION_TAG is its data version, which stale_status_reader follows."""
    external, copied = source_and_consumer()
    assert isinstance(external, dg.AssetsDefinition) and external.is_observable and not external.is_materializable
    (spec,) = external.specs
    assert spec.owners == ["team:curation"] and spec.partitions_def == PARTITIONS
    graph = dg.Definitions(assets=[external, copied]).resolve_asset_graph()

    def observe(version: str) -> None:
        instance.report_runless_asset_event(dg.AssetObservation(
            asset_key=external.key, partition="a", tags={private.DATA_VERSION_TAG: version}))

    with dg.instance_for_test() as instance:
        observe("1")
        assert private.stale_status_reader(instance, graph)(copied.key, "a") == "missing"
        result = dg.materialize([copied], partition_key="a", instance=instance)
        assert result.dagster_run.tags[private.PARTITION_NAME_TAG] == "a"
        assert private.stale_status_reader(instance, graph)(copied.key, "a") == "fresh"
        observe("2")
        assert private.stale_status_reader(instance, graph)(copied.key, "a") == "stale"
        assert private.stale_status_reader(instance, graph)(copied.key, "b") == "missing"


@pytest.mark.slow  # a code server
def test_the_webserver_app_serves_the_code_locations_of_its_workspace(tmp_path):
    """webserver_app: the UI's ASGI app over a workspace file, its GraphQL answering for that file's
    code location (what `marin ui` serves behind its guard)."""
    from starlette.testclient import TestClient

    (tmp_path / "defs.py").write_text("import dagster as dg\n\n\n@dg.asset\ndef probe():\n    return 1\n\n\n"
                                      "defs = dg.Definitions(assets=[probe])\n")
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_file:\n      relative_path: {tmp_path / 'defs.py'}\n"
                         "      location_name: probe\n")
    with dg.instance_for_test() as instance, contextlib.ExitStack() as stack:
        app = private.webserver_app(stack, instance, str(workspace))
        with TestClient(app) as client:
            answer = client.post("/graphql", json={"query": "{ assetNodes { assetKey { path } } }"})
    assert answer.status_code == 200 and answer.json()["data"] == {"assetNodes": [{"assetKey": {"path": ["probe"]}}]}


@pytest.mark.slow  # a code server and a run worker process
def test_a_workspace_run_is_created_and_launched_through_its_code_server(tmp_path, monkeypatch):
    """open_workspace and run_request_execution_data build a partition's run as the daemon would;
    the default launcher starts its worker through the code server (GRPC_INFO_TAG) and records
    the worker's pid as worker_started_event_data does."""
    (tmp_path / "tiny_defs.py").write_text(
        "import dagster as dg\n\n"
        "@dg.asset(partitions_def=dg.StaticPartitionsDefinition(['a', 'b']))\n"
        "def copied(context):\n    return context.partition_key\n\n"
        "defs = dg.Definitions(assets=[copied])\n")
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(yaml.safe_dump({"load_from": [{"python_file": {
        "relative_path": "tiny_defs.py", "working_directory": str(tmp_path), "location_name": "tiny"}}]}))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance, \
            WorkspaceRuns(instance, str(workspace)) as runs:
        run_id = runs.submit([dg.AssetKey("copied")], [], "b", {}, {"origin": "test"})
        deadline = time.monotonic() + 120
        while not instance.get_run_by_id(run_id).is_finished:
            assert time.monotonic() < deadline, "the launched run did not finish in 120 s"
            time.sleep(0.5)
        run = instance.get_run_by_id(run_id)
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert run.tags[private.PARTITION_NAME_TAG] == "b" and run.tags["origin"] == "test"
        assert run.tags.get(private.GRPC_INFO_TAG)  # launched through the code server, not in this process
        pid = Planner(dg.Definitions(), None, None, instance).run_worker_pid(run_id)
        assert pid is not None and pid.isdigit()
        started = [e.dagster_event.event_specific_data for e in instance.all_logs(
            run_id, of_type=dg.DagsterEventType.ENGINE_EVENT) if e.dagster_event.message.startswith("Started process")]
        assert [data.metadata for data in started] == [private.worker_started_event_data(int(pid)).metadata]


def test_instance_yaml_and_plugin_config_are_validated(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n"
        "run_coordinator:\n  module: dagster\n  class: QueuedRunCoordinator\n"
        "  config:\n    max_concurrent_runs: 3\n")
    config = private.instance_yaml_config(str(home))
    assert config["telemetry"] == {"enabled": False}
    assert private.plugin_config_errors(config["run_coordinator"]) == []
    bad = {**config["run_coordinator"], "config": {"max_concurrent_runs": "three"}}
    assert private.plugin_config_errors(bad)


def test_a_run_with_a_python_origin_is_handed_to_the_launcher(monkeypatch):
    """python_job_origin is what a run launcher reads off the run (the image, the module to load);
    launch_run_context is what it is handed."""
    @dg.asset
    def tokenized():
        return None

    job = dg.Definitions(assets=[tokenized]).resolve_implicit_global_asset_job_def()
    origin = private.python_job_origin(job.name, "/opt/venv/bin/python", "marin_assets.definitions", "defs",
                                       "/app", "registry.example/marin:abc")
    launched = []
    with dg.instance_for_test() as instance:
        monkeypatch.setattr(type(instance.run_launcher), "launch_run",
                            lambda self, context: launched.append(context.dagster_run))
        run = instance.create_run_for_job(job, job_code_origin=origin)
        instance.run_launcher.launch_run(private.launch_run_context(run))
    assert [r.run_id for r in launched] == [run.run_id]
    stored = launched[0].job_code_origin
    assert stored.repository_origin.container_image == "registry.example/marin:abc"
    assert stored.repository_origin.executable_path == "/opt/venv/bin/python"
    assert stored.repository_origin.code_pointer.module == "marin_assets.definitions"
    assert stored.job_name == job.name


def test_run_workers_are_warm_spares_forked_from_a_server_that_imported_dagster():
    """The code server makes its run workers through `_mp_ctx`, set in its `__init__`: the class's
    descriptor replaces that context with warm spares started from a fork server, whatever `__init__`
    assigns. Fails when a Dagster upgrade renames the attribute or changes the calls StartRun makes on
    it (Queue, Event, then Process with the queue and event last), or when the preloaded modules
    start a thread (forking a process with threads can deadlock the child)."""
    import inspect
    import multiprocessing
    import re
    import subprocess
    import sys

    from dagster._grpc.server import DagsterApiServer

    from marin_resources.run_workers import WarmRunWorkers

    assert private.warm_run_workers("marin_assets.definitions") == "forkserver"  # what a server's load does

    start_run = inspect.getsource(DagsterApiServer.StartRun)
    calls = re.findall(r"self\._mp_ctx\.(\w+)\(", start_run)
    assert calls == ["Queue", "Event", "Process"], calls
    assert re.search(r"event_queue,\s*termination_event,\s*\],\s*\)", start_run)  # the spare's own, last
    assert "self._mp_ctx = " in inspect.getsource(DagsterApiServer.__init__)
    server = object.__new__(DagsterApiServer)
    server._mp_ctx = multiprocessing.get_context("spawn")  # what __init__ does
    assert isinstance(server._mp_ctx, WarmRunWorkers) and server._mp_ctx.get_start_method() == "forkserver"
    from multiprocessing import forkserver

    assert forkserver._forkserver._preload_modules == list(private.RUN_WORKER_PRELOAD)
    threads = subprocess.run(
        [sys.executable, "-c", f"import os; [__import__(m) for m in {list(private.RUN_WORKER_PRELOAD)}]; "
                               "print(len(os.listdir('/proc/self/task')))"],
        capture_output=True, text=True, check=True).stdout
    assert threads.strip() == "1"


def test_a_custom_automation_condition_reads_the_instance_and_its_partitions():
    """automation_instance is the instance a condition is evaluated against; subset_partition_keys and
    subset_of_partitions turn its candidate subset into partition keys and back."""
    seen = []

    class OnlyA(dg.AutomationCondition):
        def evaluate(self, context):
            seen.append((private.automation_instance(context), private.subset_partition_keys(context.candidate_subset)))
            return dg.AutomationResult(context=context, true_subset=private.subset_of_partitions(
                context.candidate_subset, {"a", None}))

    @dg.asset(partitions_def=PARTITIONS, automation_condition=OnlyA())
    def built():
        return None

    @dg.asset(automation_condition=OnlyA())
    def whole():
        return None

    with dg.instance_for_test() as instance:
        result = dg.evaluate_automation_conditions([built, whole], instance)
        assert seen == [(instance, {"a", "b"}), (instance, {None})]
        assert result.get_requested_partitions(built.key) == {"a"} and result.get_num_requested(whole.key) == 1
        assert private.finished_sensor_ticks(instance, "automation", 0.0) == 0  # no daemon ticked here


def test_outside_a_code_server_nothing_is_installed_and_its_module_is_not_imported():
    import subprocess
    import sys

    probe = ("import sys; from marin_resources import dagster_private as p; "
             "print(p.warm_run_workers('marin_assets.definitions'), p.end_code_server_when_it_stops(), "
             "'dagster._grpc.server' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.split() == ["None", "False", "False"]


# A module whose one object says so when the interpreter's teardown frees it (by then the module's
# globals may be cleared, so what it calls is bound as it is defined).
TEARDOWN_MARKER = """import os

class TornDown:
    def __del__(self, write=os.write):
        write(2, b"interpreter teardown\\n")

marker = TornDown()
"""


def marker_on_path(tmp_path) -> dict:
    """`TEARDOWN_MARKER` as the module ``teardown_marker`` in ``tmp_path``, and an environment that
    imports from there."""
    import os

    (tmp_path / "teardown_marker.py").write_text(TEARDOWN_MARKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_a_code_server_ends_without_teardown_once_it_stops(tmp_path):
    """A real `dagster api grpc` server over a location that installs end_code_server_when_it_stops,
    shut down by the RPC the CLI's workspace sends as it closes: exit code 0, the exit handlers run,
    and no teardown (which took about a second of CPU after the command had returned)."""
    import subprocess
    import sys

    from dagster._grpc.client import DagsterGrpcClient

    env = marker_on_path(tmp_path)
    location = tmp_path / "stopping_location.py"
    location.write_text("import atexit, sys\nimport dagster as dg\nimport teardown_marker\n"
                        "from marin_resources.dagster_private import end_code_server_when_it_stops\n"
                        "atexit.register(lambda: sys.stderr.write('exit handlers ran\\n'))\n"
                        "sys.stderr.write(f'installed {end_code_server_when_it_stops()}\\n')\n"
                        "defs = dg.Definitions()\n")
    socket = tmp_path / "server.sock"
    server = subprocess.Popen([sys.executable, "-m", "dagster", "api", "grpc", "--python-file", str(location),
                               "--socket", str(socket)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        client = DagsterGrpcClient(socket=str(socket))
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.communicate()[1]
            try:
                client.ping("up")
                break
            except Exception:  # noqa: BLE001 -- not serving yet
                assert time.monotonic() < deadline, "the code server did not start"
                time.sleep(0.2)
        client.shutdown_server()
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err
    assert "installed True" in err and "exit handlers ran" in err, err
    assert "interpreter teardown" not in err, err


def test_the_fork_server_ends_without_teardown_and_its_workers_keep_their_exit_codes(tmp_path):
    """The run workers' fork server, with RUN_WORKER_PRELOAD's last module, ends without teardown once
    the process that started it has exited; a worker it forked still ends with its own exit code."""
    import subprocess
    import sys

    env = marker_on_path(tmp_path)
    script = tmp_path / "forks.py"
    script.write_text("import multiprocessing, sys\n"
                      "def worker(code):\n    sys.exit(code)\n"
                      "if __name__ == '__main__':\n"
                      "    context = multiprocessing.get_context('forkserver')\n"
                      f"    context.set_forkserver_preload(['teardown_marker', {private.RUN_WORKER_PRELOAD[-1]!r}])\n"
                      "    process = context.Process(target=worker, args=(3,))\n"
                      "    process.start()\n    process.join()\n"
                      "    print('worker exit code', process.exitcode)\n")
    # The output's end is the fork server's exit too: it holds the same pipes.
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "worker exit code 3\n", out.stdout + out.stderr
    assert "interpreter teardown" not in out.stderr, out.stderr


def test_under_a_temporary_directory_too_long_for_a_socket_workers_are_spawned(tmp_path):
    """The fork server's Unix socket lives in the temporary directory; a path past 107 bytes cannot
    be bound ("AF_UNIX path too long", every run failing at launch), so the spares are spawned."""
    import os
    import subprocess
    import sys

    long_dir = tmp_path / ("t" * 100)
    long_dir.mkdir()
    probe = ("import multiprocessing; from dagster._grpc.server import DagsterApiServer; "
             "from marin_resources import dagster_private as p; "
             "installed = p.warm_run_workers('marin_assets.definitions'); "
             "s = object.__new__(DagsterApiServer); s._mp_ctx = multiprocessing.get_context('spawn'); "
             "print(installed, s._mp_ctx.get_start_method())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "TMPDIR": str(long_dir)}).stdout.split()
    assert out == ["spawn", "spawn"]
    short = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           env={**os.environ, "TMPDIR": "/tmp"}).stdout.split()
    assert short == ["forkserver", "forkserver"]


def test_a_code_server_told_that_runs_start_there_warms_its_first_spare_as_it_loads():
    """The CLI sets RUNS_START_HERE_ENV for the code servers it starts: their first spare starts as the
    location loads. Any other server (a webserver's, or one whose runs are pods) waits for a first run."""
    import os
    import subprocess
    import sys

    probe = ("import time\n"
             "from dagster._grpc.server import DagsterApiServer\n"
             "from marin_resources import dagster_private as p\n"
             "p.warm_run_workers('json')\n"
             "workers = object.__new__(DagsterApiServer)._mp_ctx\n"
             "deadline = time.monotonic() + 60\n"
             "while workers._spare is None and time.monotonic() < deadline:\n"
             "    time.sleep(0.1)\n"
             "print(workers._spare is not None and workers._spare.process.is_alive())\n")
    env = {k: v for k, v in os.environ.items() if k != private.RUNS_START_HERE_ENV}
    told = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
                          env={**env, private.RUNS_START_HERE_ENV: "1"})
    assert told.stdout.split() == ["True"], told.stderr
    quiet = probe.replace("+ 60", "+ 3")
    untold = subprocess.run([sys.executable, "-c", quiet], capture_output=True, text=True, check=True, timeout=120,
                            env=env)
    assert untold.stdout.split() == ["False"], untold.stderr


def test_runless_events_stored_in_batches_are_what_dagster_reads_back():
    """Materializations and observations written `batch` at a time: the partitions Dagster counts as
    materialized, and the latest data version tag of each observed partition."""
    key = dg.AssetKey("copied")
    with dg.instance_for_test() as instance:
        private.store_runless_events(instance, [dg.AssetMaterialization(key, partition=p) for p in "abc"], batch=2)
        private.store_runless_events(instance, [dg.AssetObservation(key, partition=p, tags={
            private.DATA_VERSION_TAG: f"v{p}"}) for p in "ab"], batch=1)
        assert instance.get_materialized_partitions(key) == {"a", "b", "c"}
        latest = instance.event_log_storage.get_latest_tags_by_partition(
            key, dg.DagsterEventType.ASSET_OBSERVATION, [private.DATA_VERSION_TAG], asset_partitions=["a", "b"])
        assert latest == {"a": {private.DATA_VERSION_TAG: "va"}, "b": {private.DATA_VERSION_TAG: "vb"}}
