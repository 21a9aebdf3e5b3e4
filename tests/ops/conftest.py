"""Local S3 (moto server) and GCS (gcp-storage-emulator) on 127.0.0.1, started and stopped by PID."""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def start(cmd: list[str], port: int, tmp_path_factory, env: dict | None = None) -> subprocess.Popen:
    log = open(tmp_path_factory.mktemp("svc") / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=None if env is None else {**os.environ, **env})
    wait_for_port(port, proc)
    return proc


def stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Stop a process group: SIGTERM, then SIGKILL after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    port = free_port()
    proc = start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, tmp_path_factory)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="session")
def s3_server_checking_credentials(tmp_path_factory):
    """A moto_server that authenticates every request (unknown access keys are refused)."""
    port = free_port()
    proc = start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, tmp_path_factory,
                 env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    port = free_port()
    proc = start([str(BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(port),
                  "--in-memory"], port, tmp_path_factory)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture(scope="session")
def gcs_tensorstore_server(gcs_server, tmp_path_factory):
    """The GCS emulator behind a proxy that gives tensorstore what real GCS does (see gcs_tensorstore_proxy.py)."""
    port = free_port()
    proc = start([sys.executable, str(Path(__file__).parent / "gcs_tensorstore_proxy.py"), str(port), gcs_server],
                 port, tmp_path_factory)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def s3_prefix(s3_server, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"client_kwargs": {"endpoint_url": s3_server}, "key": "testing", "secret": "testing"}
    bucket = f"marin-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/store", options


@pytest.fixture
def gcs_prefix(gcs_server):
    import gcsfs

    options = {"endpoint_url": gcs_server, "token": "anon", "project": "test"}
    bucket = f"marin-{uuid.uuid4().hex[:8]}"
    gcsfs.GCSFileSystem(**options, skip_instance_cache=True).mkdir(bucket)
    return f"gs://{bucket}/store", options
