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
