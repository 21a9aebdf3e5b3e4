"""The local web UI refuses cross-site writes (issue 50, finding 9).

Any page open in the developer's browser can send a `text/plain` POST to 127.0.0.1 without asking
(no CORS preflight), and Dagster's webserver executes a GraphQL mutation carried in such a request's
query string: `wipeAssets`, `launchRun`. `marin ui` serves the same webserver behind
`marin_resources.web_ui.SameOriginGuard`. The attack, as curl sends it:

    curl -X POST -H 'Origin: http://evil.example' -H 'Content-Type: text/plain' --data-binary '' \\
         'http://127.0.0.1:PORT/graphql?query=mutation{wipeAssets(...){__typename}}'

The server is a real `marin ui` process on a temporary instance, started and stopped by its PID.
"""

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import dagster as dg
import pytest

from marin_resources.web_ui import allowed_hosts_for, refusal
from tests.ops.test_browser_ui import beacon_instance, free_port, start, stop, wait_until

EVIL = "http://evil.example"
PROBE = dg.AssetKey("guard_probe")
WIPE = 'mutation { wipeAssets(assetPartitionRanges: [{assetKey: {path: ["guard_probe"]}}]) { __typename } }'
LAUNCH = """mutation($params: ExecutionParams!) { launchRun(executionParams: $params) {
    __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }"""
LAUNCH_PARAMS = {"selector": {"repositoryLocationName": "marin", "repositoryName": "__repository__",
                              "jobName": "curation", "assetSelection": [{"path": ["dedup_index",
                                                                                  "beacon_dedup_index"]}]}}
HOSTS = allowed_hosts_for("127.0.0.1")


def refused(kind="http", method="POST", path="/graphql", query="", **headers) -> int | None:
    headers = {"host": "127.0.0.1:3000", **{k.replace("_", "-"): v for k, v in headers.items()}}
    answer = refusal(kind=kind, method=method, path=path, query_string=query, headers=headers, allowed_hosts=HOSTS)
    return None if answer is None else answer[0]


def test_writes_are_taken_only_from_the_uis_own_origin_as_json():
    json_body = {"content_type": "application/json"}
    same = {"origin": "http://127.0.0.1:3000", "sec_fetch_site": "same-origin"}
    mutation = urllib.parse.urlencode({"query": WIPE})
    # What the UI's own pages send, and clients outside a browser (curl, dagster-graphql: no Origin).
    assert refused(**json_body, **same) is None
    assert refused(**json_body) is None
    assert refused(kind="websocket", method="GET", origin="http://127.0.0.1:3000") is None
    assert refused(method="GET", query=urllib.parse.urlencode({"query": "{ shouldShowNux }"})) is None
    assert refused(path="/report_asset_materialization/a", **same) is None  # no body, as Dagster's docs send it
    assert refused(method="GET", host="[::1]:3000") is None and refused(method="GET", host="localhost") is None
    # Another origin: the attack, another port of localhost, a sandboxed frame, a browser that sends no Origin.
    assert refused(content_type="text/plain", origin=EVIL, query=mutation) == 403
    assert refused(**json_body, origin=EVIL) == 403
    assert refused(**json_body, origin="http://localhost:8080", sec_fetch_site="same-site") == 403
    assert refused(**json_body, origin="null") == 403
    assert refused(**json_body, sec_fetch_site="cross-site") == 403
    assert refused(kind="websocket", method="GET", origin=EVIL) == 403
    # A body a page may send anywhere without a preflight, even with no Origin; a mutation by GET.
    assert refused(content_type="text/plain", query=mutation) == 415
    assert refused(content_type="text/plain;charset=UTF-8", **same) == 415
    assert refused(path="/report_asset_materialization/a", content_type="application/x-www-form-urlencoded",
                   **same) == 415
    assert refused(path="/prefix/graphql", content_type="application/graphql", **same) == 415
    assert refused(method="GET", query=mutation) == 405
    assert refused(method="GET", query=urllib.parse.urlencode({"query": "query a { x } mutation b { y }"})) == 405
    # A page on a domain rebound to 127.0.0.1 names that domain in Host: refused, reads too.
    assert refused(method="GET", path="/server_info", host="evil.example:3000") == 403
    assert refused(**json_body, host="evil.example:3000", origin="http://evil.example:3000") == 403


def curl(*args: str) -> tuple[int, str]:
    """(HTTP status, body) of a curl request."""
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    body, _, status = out.rpartition("\n")
    return int(status), body


def post_json(base: str, query: str, variables: dict | None = None, **headers: str) -> dict:
    request = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query, "variables": variables or {}})
                                     .encode(), headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["data"]


@pytest.fixture
def guarded_ui(tmp_path, monkeypatch):
    """`marin ui --no-daemon` on a temporary instance and a one-file source: (base URL, instance)."""
    if shutil.which("curl") is None:
        pytest.fail("curl is missing: install the system package (apt-get install curl), as .ci/run does")
    env, home = beacon_instance(tmp_path, monkeypatch, "The lighthouse keeper climbed the stairs at dusk.\n" * 50)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "ui.log"
    proc = start([sys.executable, "-m", "marin_assets.cli", "ui", "--no-daemon", "--port", str(port)], env, log)
    try:
        wait_until("/server_info", lambda: urllib.request.urlopen(f"{base}/server_info", timeout=5).status == 200,
                   120, [proc], [log])
        with dg.DagsterInstance.from_config(str(home)) as instance:
            yield base, instance
    finally:
        stop(proc)


@pytest.mark.slow  # a webserver and its code server
def test_a_cross_site_mutation_is_refused_and_the_uis_own_goes_through(guarded_ui):
    base, instance = guarded_ui
    instance.report_runless_asset_event(dg.AssetMaterialization(PROBE))
    attack = ["-X", "POST", "-H", f"Origin: {EVIL}", "-H", "Content-Type: text/plain", "--data-binary", ""]

    status, body = curl(*attack, f"{base}/graphql?" + urllib.parse.urlencode({"query": WIPE}))
    assert status == 403 and "cross-origin request from 'http://evil.example' refused" in body, body
    status, body = curl(*attack, f"{base}/graphql?" + urllib.parse.urlencode(
        {"query": LAUNCH, "variables": json.dumps({"params": LAUNCH_PARAMS})}))
    assert status == 403, body
    # The same mutation by GET, as a link or an <img> sends it: no Origin at all.
    status, body = curl(f"{base}/graphql?" + urllib.parse.urlencode({"query": WIPE}))
    assert status == 405, body
    with pytest.raises(urllib.error.HTTPError) as cross_origin_json:
        post_json(base, LAUNCH, {"params": LAUNCH_PARAMS}, Origin=EVIL)
    assert cross_origin_json.value.code == 403
    assert instance.get_latest_materialization_event(PROBE) is not None  # nothing wiped
    assert instance.get_runs_count() == 0  # nothing launched

    # The UI's own requests: JSON from its origin, as Chromium sends them.
    ui = {"Origin": base, "Sec-Fetch-Site": "same-origin"}
    launched = post_json(base, LAUNCH, {"params": LAUNCH_PARAMS}, **ui)["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    assert post_json(base, WIPE, **ui)["wipeAssets"]["__typename"] == "AssetWipeSuccess"
    assert instance.get_latest_materialization_event(PROBE) is None
    assert [r.run_id for r in instance.get_runs()] == [launched["run"]["runId"]]
