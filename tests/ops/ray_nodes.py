"""A real Ray cluster on this machine for the tests: nodes started with `ray start` on 127.0.0.1, their
processes found through /proc, so that only a test's own Ray is ever signalled."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.ops.conftest import free_port

# `ray start` with the Ray CLI's own entry point, except that 127.0.0.1 stays 127.0.0.1: Ray replaces a
# loopback --node-ip-address (and a loopback --address) by the machine's outward address, and these
# tests keep every connection on loopback.
RAY_CLI_ON_LOOPBACK = ("import sys, ray._private.services as services; services.resolve_ip_for_localhost = "
                       "lambda host: host; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()")
# The marin driver's side of the same: with it, Ray takes the driver's node address to be 127.0.0.1
# (where both nodes registered) instead of the outward address. It changes nothing else on a driver.
DRIVER_ON_LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray turns token authentication on by itself wherever ~/.ray/auth_token exists, which any local
# `ray.init()` on the machine (another test) writes: this cluster and its driver say "off" outright.
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def processes() -> list[tuple[int, int, int, str]]:
    """(pid, parent pid, process group, title) of every live process on the machine (not zombies,
    which are dead already and wait for init to reap them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            title = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        state, ppid, pgid = stat.rsplit(")", 1)[1].split()[:3]
        if state != "Z":
            found.append((int(entry), int(ppid), int(pgid), title))
    return found


def node_processes(pgid: int) -> dict[int, str]:
    """A node's processes: the group `ray start` began (GCS, raylet, agents), and the raylet's workers,
    which Ray puts in process groups of their own."""
    table = processes()
    node = {pid: title for pid, _, group, title in table if group == pgid}
    grown = True
    while grown:
        children = {pid: title for pid, ppid, _, title in table if ppid in node and pid not in node}
        node.update(children)
        grown = bool(children)
    return node


def signal_node(pgid: int, sig: int) -> None:
    for pid in node_processes(pgid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_node(pgid: int, grace_s: float = 15) -> None:
    """SIGTERM (a worker node's raylet then leaves the cluster at once), then SIGKILL whatever is left."""
    signal_node(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while node_processes(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    signal_node(pgid, signal.SIGKILL)


def ray_start(*args: str, env: dict[str, str] | None = None) -> int:
    """`ray start ...` in a session of its own; the process group its node's services run in."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_USAGE_STATS_ENABLED": "0",
           **NO_AUTH, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-c", RAY_CLI_ON_LOOPBACK, "start", "--node-ip-address=127.0.0.1",
                             "--num-cpus=1", f"--dashboard-agent-listen-port={free_port()}", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out, _ = proc.communicate(timeout=180)
    if proc.returncode != 0:
        stop_node(proc.pid)
        raise RuntimeError(f"ray start {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}")
    return proc.pid


@contextlib.contextmanager
def ray_head(*, job_server: bool = False, env: dict[str, str] | None = None):
    """A Ray head node with one CPU on 127.0.0.1: its GCS address (RAY_ADDRESS) and, with `job_server`,
    the address of its job server (http://127.0.0.1:PORT, where dagster-ray submits jobs), else None.
    `env`: more of the node's environment, which its jobs inherit."""
    # Short: Ray's socket paths live under it and must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="rt-", dir="/tmp")
    port, dashboard_port = free_port(), free_port()
    dashboard = (["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
                 if job_server else ["--include-dashboard=false"])
    # The job server hands each job to the node's dashboard agent, which the raylet starts with Ray's
    # own entry point: this keeps that agent's connection to the GCS on loopback too.
    pgid = ray_start("--head", f"--port={port}", f"--temp-dir={temp_dir}", *dashboard, "--disable-usage-stats",
                     f"--ray-client-server-port={free_port()}",
                     env={**(DRIVER_ON_LOOPBACK if job_server else {}), **(env or {})})
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}" if job_server else None
    finally:
        # The whole cluster goes: nobody is left to tell, and the head's GCS sits out a SIGTERM for seconds.
        signal_node(pgid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextlib.contextmanager
def two_node_cluster():
    """A head with its job server and a second node (one CPU, resource `worker2`): the job server's address.
    The head's PATH is the system's, not this environment's, as on a cluster's own machines (its jobs
    run there)."""
    with ray_head(job_server=True, env={"PATH": os.defpath}) as (gcs, jobs):
        worker = ray_start(f"--address={gcs}", '--resources={"worker2": 1}')
        try:
            yield jobs
        finally:
            stop_node(worker)
