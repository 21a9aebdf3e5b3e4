"""`marin` processes started together on a new DAGSTER_HOME (`marin ui` and `marin materialize`, as
CI's browser test does) all open the instance, and it stays usable. Before the open was serialized,
four processes racing the first open failed in nearly every round: two stamped the SQLite schema
version twice (every later open then failed) or inserted a pool's limit twice."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OPEN = ("from marin_assets.cli import POOL_LIMITS, open_instance; storage = open_instance().event_log_storage; "
        "print({pool: storage.get_concurrency_info(pool).slot_count for pool in POOL_LIMITS})")


def open_together(home: Path, processes: int) -> list[subprocess.CompletedProcess]:
    env = {"PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(home)}
    started = [subprocess.Popen([sys.executable, "-c", OPEN], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(processes)]
    done = []
    for process in started:
        stdout, stderr = process.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return done


@pytest.mark.slow  # rounds of processes importing Dagster
def test_processes_opening_a_new_instance_together_all_succeed_and_it_stays_usable(tmp_path):
    from marin_assets.cli import POOL_LIMITS

    for round_ in range(2):
        home = tmp_path / f"home{round_}"
        for opened in (*open_together(home, 4), *open_together(home, 1)):
            assert opened.returncode == 0, opened.stderr[-2000:]
            assert opened.stdout.strip() == str(POOL_LIMITS)


def on_read_only_home(home: Path, command: str) -> subprocess.CompletedProcess:
    """`marin COMMAND` with DAGSTER_HOME bind-mounted read-only (a user and mount namespace: no root needed)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no user namespaces here to mount a read-only folder")
    marin = f"{sys.executable} -c 'import sys; from marin_assets.cli import main; sys.exit(main([\"{command}\"]))'"
    script = f"mount --bind {home} {home} && mount -o remount,ro,bind {home} {home} && exec {marin}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(home)}, timeout=120)


@pytest.mark.slow  # processes importing Dagster
def test_a_read_only_dagster_home_is_refused_in_one_line(tmp_path):
    """The open's lock file cannot be made in a read-only DAGSTER_HOME: a SQLite instance there (or a home
    without its dagster.yaml) is refused in one line; an instance on a database server opens without it."""
    sqlite_home, empty_home, server_home = (tmp_path / name for name in ("sqlite", "empty", "server"))
    for home in (sqlite_home, empty_home, server_home):
        home.mkdir()
    (sqlite_home / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    for home, why in ((sqlite_home, "the instance's SQLite database lives there"),
                      (empty_home, "has no dagster.yaml to open the instance with")):
        refused = on_read_only_home(home, "status")
        assert refused.returncode == 2, refused.stderr[-2000:]
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith(f"marin: DAGSTER_HOME {home} is not writable (") and why in line
    # A database server's instance gets past the lock, to the database (unreachable here: port 1).
    (server_home / "dagster.yaml").write_text(
        "storage:\n  postgres:\n    postgres_db: {hostname: 127.0.0.1, port: 1, username: u, password: p, "
        "db_name: d}\n")
    opened = on_read_only_home(server_home, "status")
    assert "is not writable" not in opened.stderr and ".instance-open.lock" not in opened.stderr
