"""Writer leases: heartbeat and expiry (issue 17, stale leases), conditional writes on object
stores (issue 11, item 3).

The object-store cases use the moto and GCS emulator fixtures of tests/ops/conftest.py (started by
PID on free ports). The GCS emulator ignores `ifGenerationMatch`, so the concurrent race runs on
local disk and S3 only; on GCS the sequential cases run (takeover, lost lease) through the same
code, protected there by the read-and-compare step (docs/identity.md).
"""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from marin_resources.storage.lineage import build_lineage
from marin_resources.storage.store import LOCK_NAME, ArtifactLockedError, ArtifactStore, producer_info, writing
from tests.ops.conftest import gcs_prefix, gcs_server, s3_prefix, s3_server  # noqa: F401 - fixtures


@pytest.fixture(params=["local", "s3", "gcs"])
def prefix(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store"), {}
    return request.getfixturevalue(f"{request.param}_prefix")


def put_lease(store: ArtifactStore, uri: str, body: dict) -> None:
    path = f"{store.fs_path(uri)}/{LOCK_NAME}"
    store.fs.makedirs(store.fs_path(uri), exist_ok=True)
    store.fs.pipe_file(path, json.dumps(body).encode())
    store.fs.invalidate_cache()


def read_lease(store: ArtifactStore, uri: str) -> dict | None:
    store.fs.invalidate_cache()
    try:
        return json.loads(store.fs.cat_file(f"{store.fs_path(uri)}/{LOCK_NAME}"))
    except FileNotFoundError:
        return None


def commit(writer, text="bytes"):
    with writer.open("data.txt") as fh:
        fh.write(text.encode())
    return writer.commit(config={}, upstream=[], producer=producer_info(writer.run_id))


@pytest.mark.parametrize("age_s, taken", [(100.0, True), (10.0, False)])
def test_lease_of_a_writer_on_another_host_expires_after_90s_without_renewal(prefix, age_s, taken):
    store = ArtifactStore(*prefix)
    uri = store.artifact_uri("raw/x", "v1", "p", fingerprint="f")
    renewed = time.time() - age_s
    put_lease(store, uri, {"run_id": "dead", "host": "another-host", "pid": 1, "created": renewed - 3600,
                           "renewed": renewed, "token": "t"})
    if taken:
        with writing(store, "raw/x", "v1", "p", fingerprint="f", run_id="me") as w:
            assert read_lease(store, uri)["run_id"] == "me"
            commit(w)
        assert store.find("raw/x", "v1", "p") is not None and read_lease(store, uri) is None
    else:
        with pytest.raises(ArtifactLockedError, match="being written by run dead .*host another-host.*renewed 10s ago"):
            store.begin("raw/x", "v1", "p", fingerprint="f", run_id="me")


def test_heartbeat_keeps_a_working_writers_lease(tmp_path):
    store = ArtifactStore(str(tmp_path), lease_heartbeat_s=0.1, lease_timeout_s=0.5)
    uri = store.artifact_uri("raw/x", "v1", "p", fingerprint="f")
    w = store.begin("raw/x", "v1", "p", fingerprint="f", run_id="slow")
    first = read_lease(store, uri)["renewed"]
    time.sleep(1.2)  # well past the timeout: only the heartbeat keeps the lease
    assert read_lease(store, uri)["renewed"] > first + 0.5
    with pytest.raises(ArtifactLockedError, match="being written by run slow"):
        ArtifactStore(str(tmp_path), lease_timeout_s=0.5).begin("raw/x", "v1", "p", fingerprint="f", run_id="eager")
    commit(w)
    assert read_lease(store, uri) is None


def test_a_writer_that_lost_its_lease_neither_commits_nor_removes_the_new_lease(prefix):
    first = ArtifactStore(*prefix)
    uri = first.artifact_uri("raw/x", "v1", "p", fingerprint="f")
    a = first.begin("raw/x", "v1", "p", fingerprint="f", run_id="a")
    # A second store that counts every lease as expired takes A's over (as after 90 s of silence).
    b = ArtifactStore(*prefix, lease_timeout_s=0).begin("raw/x", "v1", "p", fingerprint="f", run_id="b")
    assert read_lease(first, uri)["run_id"] == "b"
    with pytest.raises(ArtifactLockedError, match="not committing, its lease was taken over by run b"):
        commit(a, "from a")
    a.release()
    assert read_lease(first, uri)["run_id"] == "b"  # A's release left B's lease alone
    assert first.find("raw/x", "v1", "p") is None
    commit(b, "from b")
    assert first.find("raw/x", "v1", "p").producer["run_id"] == "b" and read_lease(first, uri) is None


_RACER = textwrap.dedent("""
    import asyncio, json, os, sys, time
    from pathlib import Path
    from marin_resources.storage.store import ArtifactLockedError, ArtifactStore, producer_info, writing
    prefix, options, run_id, gate = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    store = ArtifactStore(prefix, options)
    if not store.is_local:
        # Real PUTs take tens to hundreds of milliseconds, unevenly: racer i's lease PUTs take (i + 1) x 100 ms.
        send = store.fs._call_s3
        latency_s = 0.1 * (int(run_id.split("-")[1]) + 1)

        async def slow_put(method, *args, **kwargs):
            if method == "put_object" and kwargs.get("Key", "").endswith("/.lock"):
                await asyncio.sleep(latency_s)
            return await send(method, *args, **kwargs)

        store.fs._call_s3 = slow_put
    (gate / f"ready-{run_id}").touch()
    while not (gate / "go").exists():
        time.sleep(0.002)
    try:
        with writing(store, "tokenized/race", "v1", "p", fingerprint="f", run_id=run_id) as w:
            with w.open("data.txt") as fh:
                fh.write(run_id.encode())
            time.sleep(3)  # still writing when every other racer has tried
            w.commit(config={}, upstream=[], producer=producer_info(run_id))
        print("committed")
    except ArtifactLockedError as exc:
        print(f"locked: {exc}")
""")


# On S3: eight writer processes against the emulator (about 12 s on 2 loaded cores).
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_eight_racers_one_commits(where, tmp_path, request):
    prefix, options = (str(tmp_path / "store"), {}) if where == "local" else request.getfixturevalue("s3_prefix")
    gate = tmp_path / "gate"
    gate.mkdir()
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, prefix, json.dumps(options), f"racer-{i}", str(gate)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    deadline = time.monotonic() + 120
    while len(list(gate.glob("ready-*"))) < 8:
        assert time.monotonic() < deadline, "racers did not start"
        assert all(r.poll() is None for r in racers), [r.communicate() for r in racers if r.poll() is not None]
        time.sleep(0.05)
    (gate / "go").touch()
    outputs = [r.communicate(timeout=120) for r in racers]
    assert all(r.returncode == 0 for r in racers), [err for _, err in outputs]
    lines = [out.strip() for out, _ in outputs]
    assert sum(line == "committed" for line in lines) == 1, lines
    assert sum(line.startswith("locked: ") and "is being written by run racer-" in line for line in lines) == 7, lines

    store = ArtifactStore(prefix, options)
    manifest = store.find("tokenized/race", "v1", "p")
    winner = manifest.producer["run_id"]
    assert lines[int(winner.split("-")[1])] == "committed"
    assert store.open(f"{manifest.uri}/data.txt").read() == winner.encode()
    assert store.verify(manifest) == []
    assert [p for n in build_lineage(store, manifest, verify=True).unique() for p in n.problems] == []
    assert read_lease(store, manifest.uri) is None


def test_gcs_lease_writes_carry_generation_preconditions(gcs_prefix, monkeypatch):  # noqa: F811 - the fixture imported above
    """The GCS emulator ignores preconditions, so check that each lease write sends the right one:
    0 to create, then the generation this writer last saw to renew and to delete."""
    store = ArtifactStore(*gcs_prefix)
    sent = []
    real_call = store.fs.call

    def recording_call(method, path, *args, **kwargs):
        out = real_call(method, path, *args, **kwargs)
        if "ifGenerationMatch" in kwargs:
            sent.append((method, kwargs["ifGenerationMatch"], str(out["generation"]) if method == "POST" else None))
        return out

    monkeypatch.setattr(store.fs, "call", recording_call)
    with writing(store, "raw/x", "v1", "p", fingerprint="f", run_id="me") as w:
        commit(w)
    (create, renew, delete) = sent
    assert create[:2] == ("POST", "0")
    assert renew[:2] == ("POST", create[2])  # the commit's renewal names the created generation
    assert delete[:2] == ("DELETE", renew[2])  # the release names the renewed one
