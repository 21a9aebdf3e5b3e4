"""Every refusal is one line (issue #30): a bad config value, an unknown asset, a malformed or
unreachable instance database or a model too big for its devices prints `marin: <cause>` and exits
2, in a fresh process as a user runs it; `--debug` adds the traceback. (An unusable store:
tests/ops/test_object_store_chain.py::test_a_store_that_cannot_be_used_is_one_line_naming_it.)"""

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marin_assets.training.spec import DEFAULT_RUNS_YAML

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def env(tmp_path):
    data = tmp_path / "letters"
    data.mkdir()
    (data / "a.txt").write_text("A letter about the harbour, the boats and the gulls over the pier. " * 10)
    return {**os.environ, "MARIN_PREFIX": str(tmp_path / "store"), "DAGSTER_HOME": str(tmp_path / "home"),
            "MARIN_ENV": "local", "MARIN_SOURCES": str(sources(tmp_path, "files_per_shard: 1"))}


def sources(tmp_path: Path, extra: str, name: str = "letters") -> Path:
    path = tmp_path / "sources.yaml"
    path.write_text(f"sources:\n  - name: {name}\n    uri: {tmp_path}/letters/*.txt\n    format: text\n    {extra}\n")
    return path


def marin(env, *args):
    return subprocess.run([sys.executable, "-m", "marin_assets.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def refused(proc) -> str:
    """The one line of a refusal; fails on anything else (a traceback, two lines, another exit code)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("marin: "), \
        f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("extra, name, expected", [
    ("bytes_per_shard: -5", "letters", "source 'letters'.bytes_per_shard: must be between 4096 (4 KiB) and "
                                       "17179869184 (16 GiB), got -5"),
    ("bytes_per_shard: 100000000000000000000000000000000000000", "letters",
     "got 100000000000000000000000000000000000000"),
    ("bytes_per_shard: 1000", "letters", "and 17179869184 (16 GiB), got 1000"),
    ("colour: red", "letters", "source 'letters': unknown field 'colour'"),
    ("files_per_shard: 1", "../../evil", "sources[0].name: '../../evil' is not a safe source name"),
])
@pytest.mark.slow  # a `marin` process each, loading the code location
def test_a_bad_source_value_is_one_line_naming_the_file(env, tmp_path, extra, name, expected):
    path = sources(tmp_path, extra, name)
    line = refused(marin(env, "status"))
    assert line.startswith(f"marin: {path}: ") and expected in line, line


@pytest.mark.slow  # `marin` processes loading the code location
def test_a_bad_run_value_or_a_model_too_big_for_its_devices_is_one_line(env, tmp_path):
    runs = yaml.safe_load(DEFAULT_RUNS_YAML.read_text())["runs"]
    name, run = next(iter(runs.items()))
    bad = tmp_path / "runs.yaml"
    bad.write_text(yaml.safe_dump({"runs": {name: {**run, "num_train_steps": -300}}}))
    env = {**env, "MARIN_SOURCES": "", "MARIN_RUNS": str(bad)}  # the bundled sources, whose mixture the run trains on
    assert refused(marin(env, "status", "nosuch")) == \
        f"marin: {bad}: run {name!r}: field 'num_train_steps': must be positive, got -300"

    huge = {**run, "model": {**run["model"], "hidden_dim": 1_048_576, "num_layers": 4096}}
    bad.write_text(yaml.safe_dump({"runs": {"huge": huge}}))
    line = refused(marin(env, "status", "nosuch"))
    assert line.startswith("marin: run 'huge': field 'model': does not fit its resources: a training step needs "
                           "about "), line
    assert " GiB at the update (optimizer " in line and "per device with no checkpointing" in line
    assert "more than 90% of this machine's" in line


@pytest.mark.parametrize("field, value, problem", [
    ("weight", float("nan"), "expected a finite number, got nan"),
    ("weight", -1, "must be >= 0 (0: validation only), got -1.0"),
    ("weight", float("inf"), "expected a finite number, got inf"),
    ("optimizer.learning_rate", float("inf"), "expected a finite number, got inf"),
    ("optimizer.epsilon", float("inf"), "expected a finite number, got inf"),
    ("optimizer.weight_decay", float("inf"), "expected a finite number, got inf"),
    ("num_train_steps", 10**15, "must be at most 2147483647 (optax counts updates in int32), got 1000000000000000"),
])
@pytest.mark.slow  # a `marin` process loading the code location
def test_a_non_finite_or_impossible_number_is_one_line_at_load(env, tmp_path, field, value, problem):
    """Issue 50 (10): a mixture weight of NaN, -1 or inf was accepted at load and failed materialize with
    a 126-line traceback; a learning rate, epsilon or weight decay of inf, or 10**15 steps, were accepted."""
    env = {**env, "MARIN_SOURCES": ""}  # the bundled sources, whose mixture and runs these are
    if field == "weight":
        registry = yaml.safe_load((REPO / "marin_assets" / "tokenization" / "registry.yaml").read_text())
        registry["mixtures"]["shakespeare"]["components"]["shakespeare"]["weight"] = value
        bad = tmp_path / "registry.yaml"
        bad.write_text(yaml.safe_dump(registry))
        expected = f"marin: {bad}: mixture 'shakespeare'.components.shakespeare.weight: {problem}"
        env["MARIN_REGISTRY"] = str(bad)
    else:
        name, run = next(iter(yaml.safe_load(DEFAULT_RUNS_YAML.read_text())["runs"].items()))
        section, _, key = field.rpartition(".")
        (run[section] if section else run)[key] = value
        bad = tmp_path / "runs.yaml"
        bad.write_text(yaml.safe_dump({"runs": {name: run}}))
        expected = f"marin: {bad}: run {name!r}: field {field!r}: {problem}"
        env["MARIN_RUNS"] = str(bad)
    assert refused(marin(env, "status", "nosuch")) == expected


@pytest.mark.slow  # `marin` processes loading the code location
def test_an_unknown_asset_is_one_line_and_debug_shows_the_traceback(env):
    line = refused(marin(env, "status", "shakespeare"))
    assert line.startswith("marin: unknown asset 'shakespeare'; known: ") and "raw/letters" in line
    debug = marin(env, "--debug", "status", "shakespeare")
    assert debug.returncode == 2 and "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == line


@pytest.mark.slow  # `marin` processes loading the code location
def test_a_malformed_instance_database_is_one_line_naming_the_file(env, tmp_path):
    assert marin(env, "failures").returncode == 0  # creates the instance's databases
    runs_db = tmp_path / "home" / "history" / "runs.db"
    with sqlite3.connect(runs_db) as db:
        assert db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    damaged = bytearray(runs_db.read_bytes())
    damaged[100:4096] = b"\xff" * (4096 - 100)  # the schema page
    runs_db.write_bytes(bytes(damaged))
    for command in ("failures", "status"):
        line = refused(marin(env, command))
        assert line.startswith(f"marin: the Dagster instance database {runs_db} is unreadable "
                               "(database disk image is malformed)"), line


@pytest.mark.slow  # `marin` processes loading the code location
def test_an_unreachable_instance_database_is_one_line(env, tmp_path):
    """A PostgreSQL instance nobody answers for: Dagster retries (about 15 s), then one line."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump({"storage": {"postgres": {"postgres_db": {
        "username": "dagster", "password": "unused", "hostname": "127.0.0.1", "port": 9, "db_name": "dagster",
        "scheme": "postgresql+psycopg2"}}}}))
    line = refused(marin(env, "failures"))
    assert line.startswith('marin: cannot reach the Dagster instance database: connection to server at "127.0.0.1", '
                           "port 9 failed: Connection refused"), line


def test_an_invalid_instance_config_is_one_line_naming_it(env, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("storag: {}\n")
    assert refused(marin(env, "failures")) == \
        f'marin: {home / "dagster.yaml"} is not a valid instance config: ' \
        'Received unexpected config entry "storag" at the root'


def test_an_unsupported_store_scheme_is_one_line(env):
    line = refused(marin({**env, "MARIN_PREFIX": "ftp://files.example/marin"}, "status"))
    assert line == ("marin: MARIN_PREFIX=ftp://files.example/marin: ftp:// is not a store this project writes to "
                    "(a local path, file://, gs://, gcs:// or s3://)"), line


@contextlib.contextmanager
def read_only(folder: Path):
    """``folder`` read-only to this process: its mode for a user, the immutable attribute for root
    (whom modes do not stop); skips where neither is possible."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot make a folder read-only to root here (chattr +i refused)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.slow  # `marin` processes loading the code location
def test_a_store_on_a_file_or_a_read_only_folder_is_one_line_before_any_run(env, tmp_path):
    """Issue 50 (10): MARIN_PREFIX naming a file failed every command with a 61-line traceback, one naming
    a read-only folder failed `materialize` inside its first step (115 lines)."""
    afile = tmp_path / "afile"
    afile.write_text("not a store")
    for prefix in (afile, afile / "store"):
        for command in (["status"], ["materialize", "deduplicated/letters"]):
            assert refused(marin({**env, "MARIN_PREFIX": str(prefix)}, *command)) == \
                f"marin: MARIN_PREFIX={prefix}: {afile} is a file, not a directory"
    locked = tmp_path / "locked"
    locked.mkdir()
    with read_only(locked):
        env = {**env, "MARIN_PREFIX": str(locked)}
        line = refused(marin(env, "materialize", "deduplicated/letters"))
        assert line.startswith(f"marin: store {locked}: cannot write to it (PermissionError: "), line
        assert marin(env, "status").returncode == 0  # reading a read-only store is fine
        assert not any(locked.iterdir())
        assert json.loads(marin(env, "failures", "--json").stdout) == []  # no run started, none failed


@pytest.mark.slow  # a `marin` process loading the code location and discovering sources
def test_a_source_that_matches_no_file_is_one_line_and_builds_nothing(env, tmp_path):
    """Found trying issue #30 beyond its list: the whole-corpus steps ran over no shards, committed an
    empty dedup index and failed their checks with `documents=0: no document kept`."""
    (tmp_path / "letters" / "a.txt").unlink()
    line = refused(marin(env, "materialize", "deduplicated/letters"))
    assert line == ("marin: dedup_index/letters would be built from nothing: filtered/letters has no partitions "
                    "(discovery found none for letters_shards; does the source's uri match any file?)"), line
    assert not list((tmp_path / "store").rglob(".artifact.json"))



@pytest.mark.slow  # a `marin` process loading the code location
@pytest.mark.parametrize("content, problem", [(None, "cannot read it: No such file or directory"),
                                              (b"spam.example ham.example\n", "line 1: one entry per line")])
def test_a_missing_or_damaged_url_block_list_is_one_line_and_builds_nothing(env, tmp_path, content, problem):
    if content is not None:
        (tmp_path / "block.txt").write_bytes(content)
    path = sources(tmp_path, "url_blocklist: block.txt")
    line = refused(marin(env, "materialize", "filtered/letters"))
    assert line.startswith(f"marin: {path}: source 'letters'.url_blocklist: block list {tmp_path}/block.txt") \
        and problem in line, line
    assert not list((tmp_path / "store").rglob(".artifact.json"))
