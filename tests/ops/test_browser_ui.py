"""The Dagster web UI, driven by headless Chromium: every node label of the global graph is
unique; a materialization launched from the UI is queued, dequeued by the daemon and succeeds;
the runs `marin materialize` started are listed with their assets, on the timeline, and one is
re-executed from the UI; a partitioned check shows its partition.

The web UI as `marin ui` serves it (Dagster's webserver behind the same-origin guard, which every
request of the browser here passes) and `dagster-daemon` run against a temporary DAGSTER_HOME (the
embedded default: SQLite, queued runs) on 127.0.0.1, each started and stopped by its process group.
The upstream shard and its dedup index are built first with `marin materialize`, so the UI launches
`deduplicated/<source>`, an unpartitioned asset. Its run uses the in-process executor (set in
the launchpad), which keeps the run to one Python process on a 2-core CI machine.

Chromium is the system one (/usr/bin/chromium, installed by .ci/run); no browser is downloaded.
Screenshots go to tests/artifacts/ (git-ignored).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import dagster as dg
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IN_PROCESS = "execution:\n  config:\n    in_process: {}\n"
TEXT = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp and watched the ships "
        "pass safely between the rocks while the tide turned slowly in the bay below. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End the process group we started (the server, its code server, any run workers)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def graphql(base: str, query: str, variables: dict | None = None) -> dict:
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query, "variables": variables or {}})
                                     .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.loads(response.read())
    assert "errors" not in body, body["errors"]
    return body["data"]


def wait_until(what: str, check, timeout: float, procs: list[subprocess.Popen], logs: list[Path]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs):
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args[0]} exited with {proc.returncode} while waiting for {what}:\n"
                                     f"{log.read_text()[-3000:]}")
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


LOCATIONS = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
    locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
RUNS = """{ runsOrError { ... on Runs { results { runId parentRunId status runConfigYaml assetSelection { path }
    tags { key value } } } } }"""
ASSET_NODES = """{ assetNodes { assetKey { path } groupName } }"""
CHECK_EXECUTIONS = """{ assetCheckExecutions(assetKey: {path: ["documents", "beacon_documents"]},
    checkName: "documents_accounted", limit: 5) { runId partition evaluation { timestamp
    targetMaterialization { timestamp runId } } } }"""
PARTITION = "lighthouse.txt"  # the one shard of the fixture's source


def beacon_instance(tmp_path: Path, monkeypatch, text: str) -> tuple[dict[str, str], Path]:
    """A source `beacon` of one file (lighthouse.txt, holding ``text``), a store, and a new DAGSTER_HOME of
    the embedded default with its storages made: (the environment of processes on them, the home)."""
    files = tmp_path / "text"
    files.mkdir()
    (files / "lighthouse.txt").write_text(text)
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: beacon\n    uri: {files}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {**os.environ, "DAGSTER_HOME": str(home), "MARIN_SOURCES": str(sources),
           "MARIN_PREFIX": str(tmp_path / "store"), "MARIN_ENV": "local"}
    # Create the SQLite storages once, here: processes that first open a fresh DAGSTER_HOME at the
    # same moment race on its schema migrations (two alembic heads, and the code location fails).
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # the embedded default reads its base_dir from it
    dg.DagsterInstance.from_config(str(home)).dispose()
    return env, home


@pytest.fixture
def dagster_ui(tmp_path, monkeypatch):
    env, _ = beacon_instance(tmp_path, monkeypatch, "\n\n".join(f"Night {i}. " + TEXT * 4 for i in range(10)))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = [tmp_path / "webserver.log", tmp_path / "daemon.log"]
    procs = [start([sys.executable, "-m", "marin_assets.cli", "ui", "--no-daemon", "--port", str(port)], env, logs[0])]
    try:
        # While the webserver loads: the upstream shard and the dedup index over it, built before the
        # daemon starts so that its automation sensor never races the CLI for the same partition.
        built = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "dedup_index/beacon"], env=env,
                               capture_output=True, text=True, check=False, timeout=180)
        assert built.returncode == 0, built.stderr
        procs.append(start([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"], env, logs[1]))
        wait_until("/server_info", lambda: urllib.request.urlopen(f"{base}/server_info", timeout=5).status == 200,
                   90, procs, logs)
        entry = wait_until("the marin code location", lambda: [
            e for e in graphql(base, LOCATIONS)["workspaceOrError"]["locationEntries"]
            if e["name"] == "marin" and e["loadStatus"] == "LOADED"], 90, procs, logs)[0]
        assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation", entry["locationOrLoadError"]
        yield base, tmp_path / "store", procs, logs
    finally:
        for proc in reversed(procs):
            stop(proc)


@pytest.mark.slow  # a webserver, a daemon and Chromium
def test_launch_materialization_from_the_ui(dagster_ui):
    from playwright.sync_api import expect, sync_playwright

    from marin_resources.storage.store import ArtifactStore

    base, store, procs, logs = dagster_ui
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install the system package (apt-get install chromium), as .ci/run does")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            # Under CI load a page can sit on "Loading runs..." for longer than Playwright's 5 s
            # default for expect (the timeline did, in one CI run): give expect the page's timeout.
            page.set_default_timeout(45_000)
            expect.set_options(timeout=45_000)
            # A first visit may get Dagster's newsletter prompt, which covers the page. Mark it seen
            # on the instance first (what its Skip button does), so it is never drawn; the handler
            # stays for a prompt that still appears. Over the launchpad's own dialog its Skip button
            # is not the only one: take the topmost.
            graphql(base, "mutation { setNuxSeen }")
            assert graphql(base, "query { shouldShowNux }")["shouldShowNux"] is False
            skip = page.get_by_role("button", name="Skip", exact=True).last
            page.add_locator_handler(page.get_by_text("Join the Dagster community"), lambda: skip.click(force=True))

            try:
                # The global graph, every group expanded: each node is labelled by its key's last
                # component, which names stage and subject (beacon_raw, beacon_filtered, ...).
                nodes = graphql(base, ASSET_NODES)["assetNodes"]
                groups = sorted({n["groupName"] for n in nodes})
                page.set_viewport_size({"width": 2400, "height": 1400})  # nodes off screen are not drawn
                page.goto(f"{base}/asset-groups?expanded=" + ",".join(f"global@global:{g}" for g in groups))
                tooltips = page.locator("[data-tooltip]")
                wanted = {n["assetKey"]["path"][-1] for n in nodes}
                labels = wait_until("every node label in the global graph", lambda: (
                    found if wanted <= set(found := [t for t in tooltips.evaluate_all(
                        "els => els.map(e => e.getAttribute('data-tooltip'))") if t not in groups]) else None),
                    60, procs, logs)
                assert len(labels) == len(set(labels)) == len(nodes), sorted(labels)
                assert {"beacon_raw", "beacon_filtered", "beacon_external", "beacon_deduplicated"} <= set(labels)
                assert ArtifactStore(str(store)).find("deduplicated/beacon", "v1", None) is None  # not built yet
                page.screenshot(path=str(ARTIFACTS / "browser_ui_graph.png"))
                page.set_viewport_size({"width": 1400, "height": 900})

                # Shift-click opens the launchpad; add the executor config and launch.
                page.goto(f"{base}/assets/deduplicated/beacon_deduplicated")
                page.locator("button", has_text=re.compile(r"^\s*Materialize\s*$")).first.click(modifiers=["Shift"])
                editor = page.locator(".CodeMirror").first
                # The launchpad scaffolds its config after it opens; text typed before that is replaced.
                expect(editor).to_contain_text("storage_options")
                editor.click()
                page.keyboard.press("Control+End")
                page.keyboard.insert_text("\n" + IN_PROCESS)
                expect(editor).to_contain_text("in_process")
                page.get_by_text("No errors").wait_for()
                page.get_by_role("dialog").locator("button", has_text=re.compile(r"^\s*Materialize\s*$")).click()

                def finished_run():
                    runs = [r for r in graphql(base, RUNS)["runsOrError"]["results"]
                            if [a["path"] for a in r["assetSelection"] or []] == [["deduplicated",
                                                                                   "beacon_deduplicated"]]]
                    return runs[0] if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

                run = wait_until("the launched run to finish", finished_run, 120, procs, logs)
                page.goto(f"{base}/runs/{run['runId']}")
                page.get_by_text(re.compile(r"^RUN_(SUCCESS|FAILURE|CANCELED)$")).first.wait_for()
                page.screenshot(path=str(ARTIFACTS / "browser_ui_run.png"))

                # The runs `marin materialize` started are runs of the code location's asset job:
                # listed with their assets, on the timeline, and re-executable from the UI.
                cli_runs = {r["runId"]: r for r in graphql(base, RUNS)["runsOrError"]["results"]
                            if {"key": "marin/cli", "value": "materialize"} in r["tags"]}
                # The index joined the run of the last shard it read (the planner's `_follower`).
                [index_run] = [r for r in cli_runs.values()
                               if {"path": ["dedup_index", "beacon_dedup_index"]} in r["assetSelection"]]
                page.goto(f"{base}/runs")
                for run_id, cli_run in cli_runs.items():
                    # The list is virtualized divs, not a table: a row is the run id's nearest ancestor
                    # that also holds its status.
                    row = page.get_by_text(run_id[:8], exact=True).first.locator(
                        "xpath=ancestor::*[contains(., 'Success')][1]")
                    selection = cli_run["assetSelection"]
                    shown = selection[0]["path"][-1] if len(selection) == 1 else f"{len(selection)} assets"
                    expect(row).to_contain_text(shown)
                page.goto(f"{base}/overview/activity/timeline")
                expect(page.get_by_text("Jobless asset materializations").first).to_be_visible()
                page.goto(f"{base}/runs/{index_run['runId']}")
                page.locator("button", has_text=re.compile(r"Re-execute all")).click()

                def reexecution():
                    runs = [r for r in graphql(base, RUNS)["runsOrError"]["results"]
                            if r["parentRunId"] == index_run["runId"]]
                    return runs[0] if runs and runs[0]["status"] in ("SUCCESS", "FAILURE", "CANCELED") else None

                again = wait_until("the re-executed CLI run to finish", reexecution, 120, procs, logs)
                assert again["status"] == "SUCCESS", logs[1].read_text()[-4000:]
                assert again["assetSelection"] == index_run["assetSelection"]

                # A partitioned check ran in its partition's run, after the materialization it judges,
                # and shows that partition.
                # (The re-execution above ran it again, in its own run.)
                [execution] = [e for e in graphql(base, CHECK_EXECUTIONS)["assetCheckExecutions"]
                               if e["runId"] in cli_runs]
                evaluation = execution["evaluation"]
                assert execution["partition"] == PARTITION
                assert evaluation["targetMaterialization"]["runId"] == execution["runId"]
                assert evaluation["timestamp"] > evaluation["targetMaterialization"]["timestamp"]
                page.goto(f"{base}/assets/documents/beacon_documents?view=checks")
                expect(page.get_by_text("Partition", exact=True).locator("xpath=..")).to_contain_text(PARTITION)
                page.screenshot(path=str(ARTIFACTS / "browser_ui_check.png"))
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "browser_ui_failure.png"))  # what the UI showed
                raise
        finally:
            browser.close()

    assert run["status"] == "SUCCESS", logs[1].read_text()[-4000:]
    assert "in_process" in run["runConfigYaml"]
    manifest = ArtifactStore(str(store)).find("deduplicated/beacon", "v1", None)
    assert manifest is not None and manifest.producer["run_id"] == run["runId"]
    assert ArtifactStore(str(store)).find("dedup_index/beacon", "v1", None).producer["run_id"] == index_run["runId"]
