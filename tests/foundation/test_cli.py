"""The `marin` CLI end to end on a small source, in fresh processes as a user runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TEXT = ("It was a bright cold day in April and the clocks were striking thirteen while the wind blew "
        "dust along the street and the people hurried home before the rain began to fall again. ")
# Distinct bodies: near-duplicate letters would be deduplicated past the drop-fraction ERROR check.
BODIES = {
    "alpha": "The harbour master counted the boats at dawn and wrote each name in a heavy green ledger. "
             "Gulls argued over the nets while the tide turned slowly against the stone wall of the pier. ",
    "bravo": "In the mountain village the school bell rang twice, and the children climbed the steep path "
             "with their satchels, stopping to watch a hawk circle above the pine trees near the old mill. ",
    "charlie": "A travelling clockmaker arrived with a cart full of gears, springs and tiny brass hammers, "
               "offering to mend every broken timepiece in the province for the price of a warm supper. ",
}


@pytest.fixture
def env(tmp_path):
    data = tmp_path / "letters"
    data.mkdir()
    for i, word in enumerate(["alpha", "bravo", "charlie"]):
        (data / f"{word}.txt").write_text(f"Letter {word}. " + BODIES[word] * (5 + i))
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: letters\n    uri: {data}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(tmp_path / "store"),
            "DAGSTER_HOME": str(tmp_path / "home"), "MARIN_ENV": "local"}


def marin(env, *args, check=True):
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"marin {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.slow  # `marin` builds to deduplicated/, three times
def test_materialize_status_and_noop(env, tmp_path):
    first = json.loads(marin(env, "materialize", "deduplicated/letters", "--json").stdout)
    assert first["success"]
    manifests = [Path(m) for m in first["manifests"]]
    assert any(re.search(r"deduplicated/letters/v1-[0-9a-f]{8}/\.artifact\.json$", str(m)) for m in manifests)
    for m in manifests:
        body = json.loads(m.read_text())
        assert body["files"] and body["data_version"] and body["producer"]["run_id"]
    assert sum(s["ran"] for s in first["steps"]) >= 2

    again = json.loads(marin(env, "materialize", "deduplicated/letters", "--json").stdout)
    assert again["success"] and sum(s["ran"] for s in again["steps"]) == 0

    status = json.loads(marin(env, "status", "--json").stdout)
    letters = [s for s in status if "letters" in s["asset_key"]]
    assert letters and all(s["state"] == "fresh" for s in letters)

    # A changed source file makes exactly its shard stale, and everything built from it says why.
    bravo = Path(env["MARIN_SOURCES"]).parent / "letters" / "bravo.txt"
    bravo.write_text(bravo.read_text() + " A postscript arrived later. " + TEXT)
    changed = {(s["asset_key"], s["partition"]): s for s in json.loads(marin(env, "status", "--json").stdout)}
    assert changed[("raw/letters", "bravo.txt")]["state"] == "stale"
    assert changed[("raw/letters", "bravo.txt")]["cause"] == "upstream external/letters[bravo.txt] changed (data)"
    assert changed[("raw/letters", "alpha.txt")]["state"] == "fresh"
    for key in ("documents/letters", "filtered/letters"):
        assert changed[(key, "bravo.txt")]["state"] == "stale" and changed[(key, "alpha.txt")]["state"] == "fresh"
    assert changed[("documents/letters", "bravo.txt")]["cause"] == "upstream raw/letters[bravo.txt] is stale"
    why = marin(env, "status", "--why", "filtered/letters", "--partition", "bravo.txt").stdout.splitlines()
    assert why == ["filtered/letters[bravo.txt]: stale: upstream documents/letters[bravo.txt] is stale",
                   "  documents/letters[bravo.txt]: stale: upstream raw/letters[bravo.txt] is stale",
                   "    raw/letters[bravo.txt]: stale: upstream external/letters[bravo.txt] changed (data)"]
    rebuilt = json.loads(marin(env, "materialize", "deduplicated/letters", "--json").stdout)
    assert [s["partition"] for s in rebuilt["steps"] if s["ran"]] == ["bravo.txt", None]

    # A config change builds beside the old artifact: missing until built, with the field named.
    sources = Path(env["MARIN_SOURCES"])
    sources.write_text(sources.read_text() + "    filters:\n      min_words: 5\n")
    changed = json.loads(marin(env, "status", "--json").stdout)
    filtered = [s for s in changed if s["asset_key"] == "filtered/letters"]
    assert filtered and all(s["state"] == "missing" and s["kind"] == "config" and "min_words" in s["cause"]
                            for s in filtered)
    dedup = next(s for s in changed if s["asset_key"] == "deduplicated/letters")
    assert dedup["state"] == "stale" and dedup["cause"] == "upstream dedup_index/letters is stale"
    assert any(line.strip().startswith("filtered/letters[alpha.txt]: missing: config changed: ")
               for line in dedup["why"])


@pytest.mark.slow  # two `marin` processes loading the code location
def test_bad_partition_and_unknown_asset_are_clear_errors(env):
    bad = marin(env, "materialize", "raw/letters", "--partition", "../../etc", check=False)
    assert bad.returncode == 2 and "no partition" in bad.stderr
    unknown = marin(env, "materialize", "nope/nothing", check=False)
    assert unknown.returncode == 2 and "unknown asset" in unknown.stderr


@pytest.mark.slow  # `marin` builds
def test_rebuild_withdraws_one_partition_and_keeps_its_manifest(env, tmp_path):
    marin(env, "materialize", "documents/letters", "--partition", "alpha.txt")
    (manifest,) = (tmp_path / "store" / "documents" / "letters").glob("v1-*/alpha.txt/.artifact.json")
    before = json.loads(manifest.read_text())

    rebuilt = marin(env, "materialize", "documents/letters", "--partition", "alpha.txt", "--rebuild", "--json")
    summary = json.loads(rebuilt.stdout)
    assert "retract documents/letters [alpha.txt]" in rebuilt.stderr
    assert [s["partition"] for s in summary["steps"]
            if s["ran"] and "documents/letters" in s["asset_keys"]] == ["alpha.txt"]
    (kept,) = manifest.parent.glob(".artifact.json.retracted-*")
    assert json.loads(kept.read_text()) == before  # the withdrawn record is kept, not deleted
    after = json.loads(manifest.read_text())
    assert after["producer"]["run_id"] != before["producer"]["run_id"]
    assert after["data_version"] == before["data_version"]  # same input, same content
    assert ".artifact.json.retracted" not in json.dumps(after["files"])

    whole = marin(env, "materialize", "documents/letters", "--rebuild", check=False)
    assert whole.returncode == 2 and "needs --partition" in whole.stderr


def test_demo_materializes_with_every_materialize_option_at_its_default():
    from marin_assets.cli import build_parser, demo_materialize_args

    [run], [sweep, export] = demo_materialize_args()
    assert (run.selection, run.partition) == ("eval", "nano-shakespeare")
    # The export shares the sweep's plan, listed after it so that it fills a slot the sweep leaves.
    assert (sweep.selection, sweep.partition) == ("scaling_fit/demo", None)
    assert (export.selection, export.partition) == ("hf_model", "nano-shakespeare")
    materialize = build_parser()._subparsers._group_actions[0].choices["materialize"]
    for args in (run, export, sweep):
        assert not (args.force or args.rebuild or args.json)
        # Every option of `marin materialize` exists on the demo's arguments (a new flag cannot break the demo).
        assert {a.dest for a in materialize._actions if a.dest != "help"} <= set(vars(args))


@pytest.mark.slow  # `marin` builds of four partitions, twice
def test_partitions_run_in_parallel_and_a_failure_spares_its_siblings(env, tmp_path, monkeypatch):
    """Each partition is a real run launched by the instance's run launcher, in its own worker
    process; sibling runs overlap in time, one failing partition does not stop the others, and
    the rerun builds only the failed one."""
    import dagster as dg

    from marin_assets.planning import CLI_TAG, Planner
    from marin_resources.dagster_private import GRPC_INFO_TAG

    # Three words: the filters drop its one document, so that partition's ERROR check fails its run.
    # (A dangling link once served here; it is now quarantined alone, and its shard builds.)
    (tmp_path / "letters" / "broken.txt").write_text("far too short")
    first = marin(env, "materialize", "filtered/letters", "--max-parallel", "4", "--json", check=False)
    assert first.returncode == 1, first.stderr
    steps = {s["partition"]: s for s in json.loads(first.stdout)["steps"]}
    assert sorted(steps) == ["alpha.txt", "bravo.txt", "broken.txt", "charlie.txt"]
    assert not steps["broken.txt"]["success"] and "drop_fraction=1.0 > bound=0.5" in steps["broken.txt"]["error"]
    assert all(steps[p]["success"] and steps[p]["ran"] for p in ("alpha.txt", "bravo.txt", "charlie.txt"))
    assert "FAILED: 4 run(s) (1 failed: broken.txt)" in first.stderr

    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])  # the instance's SQLite paths name it
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        records = {r.dagster_run.run_id: r for r in instance.get_run_records(
            dg.RunsFilter(tags={CLI_TAG: "materialize"}))}
        runs = [records[s["run_id"]] for s in steps.values()]
        assert all(r.dagster_run.tags.get(GRPC_INFO_TAG) for r in runs)  # launched, not in-process
        planner = Planner(dg.Definitions(), None, None, instance)
        pids = {planner.run_worker_pid(r.dagster_run.run_id) for r in runs}
        assert None not in pids and len(pids) == len(runs) and str(os.getpid()) not in pids
        good = [records[steps[p]["run_id"]] for p in ("alpha.txt", "bravo.txt", "charlie.txt")]
        # Some two good runs were executing at once: one started before the other ended.
        assert any(a.start_time < b.end_time and b.start_time < a.end_time
                   for i, a in enumerate(good) for b in good[i + 1:])

    (tmp_path / "letters" / "broken.txt").write_text("Letter delta. " + BODIES["alpha"] * 5)  # fixed
    again = json.loads(marin(env, "materialize", "filtered/letters", "--json", check=False).stdout)
    assert [s["partition"] for s in again["steps"] if s["ran"]] == ["broken.txt"] and again["success"]


@pytest.mark.slow  # `marin` builds and a killed run
def test_a_run_killed_mid_partition_loses_nothing_and_the_rerun_redoes_only_it(tmp_path, monkeypatch):
    """kill -9 of one partition's run worker while it builds: the CLI reports that run failed and
    finishes its siblings; what the run had committed stays, nothing half-written is committed,
    and the rerun builds that partition alone."""
    import signal
    import time

    import dagster as dg

    from marin_assets.planning import Planner
    from marin_resources.storage.store import ArtifactStore

    data = tmp_path / "shards"
    data.mkdir()
    lines = [json.dumps({"id": f"{name}-{i}", "text": f"Note {i} of {name}. {BODIES[name] * 3}"}) + "\n"
             for name in BODIES for i in range(3)]
    (data / "small.jsonl").write_text("".join(lines))
    # Big enough that its documents and filtered steps take seconds: the kill lands inside them.
    (data / "big.jsonl").write_text("".join(lines * 2000))
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: notes\n    uri: {data}/*.jsonl\n    format: jsonl\n"
                       "    id_field: id\n    files_per_shard: 1\n    filters: {languages: []}\n")
    home, store = tmp_path / "home", tmp_path / "store"
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(store), "DAGSTER_HOME": str(home),
           "MARIN_ENV": "local"}
    cli = subprocess.Popen([sys.executable, "-m", "marin_assets.cli", "materialize", "filtered/notes", "--json"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def committed(stage: str) -> list[Path]:  # identity in the path: `{key}/v1-{fingerprint[:8]}/{partition}`
        return list((store / stage / "notes").glob("v1-*/big.jsonl/.artifact.json"))

    monkeypatch.setenv("DAGSTER_HOME", str(home))
    killed = None
    try:
        deadline = time.monotonic() + 300
        while killed is None and time.monotonic() < deadline and cli.poll() is None:
            time.sleep(0.1)
            if not committed("raw"):
                continue
            with dg.DagsterInstance.from_config(str(home)) as instance:
                (run,) = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "big.jsonl"}))
                pid = Planner(dg.Definitions(), None, None, instance).run_worker_pid(run.run_id)
            assert not committed("filtered"), "the big partition finished before it could be killed"
            os.kill(int(pid), signal.SIGKILL)
            killed = run.run_id
        out, err = cli.communicate(timeout=600)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert killed, f"the big partition's run never committed raw/notes\n{cli.stderr}"
    assert cli.returncode == 1, err
    steps = {s["partition"]: s for s in json.loads(out)["steps"]}
    assert steps["small.jsonl"]["success"] and not steps["big.jsonl"]["success"], steps
    assert steps["big.jsonl"]["run_id"] == killed and "died without reporting an end" in steps["big.jsonl"]["error"]
    # The record tells the kill apart from a run that failed before any step (issue #30).
    (row,) = [r for r in json.loads(marin(env, "failures", "--json").stdout) if r["run_id"] == killed]
    # The kill lands inside a step or, on a loaded machine, between raw's end and the next start.
    assert row["error"].startswith(("killed mid-step (worker gone): step ",
                                    "killed between steps (worker gone): step ")), row
    assert row["step"] in row["error"], row
    # What the killed run committed is whole (raw, perhaps documents); filtered was never committed.
    artifacts = ArtifactStore(str(store))
    kept = [m for key in ("raw/notes", "documents/notes", "filtered/notes")
            if (m := artifacts.find(key, "v1", "big.jsonl")) is not None]
    assert [m.asset_key for m in kept][:1] == ["raw/notes"] and not committed("filtered")
    assert all(artifacts.verify(m) == [] for m in kept)

    again = json.loads(marin(env, "materialize", "filtered/notes", "--json").stdout)
    assert again["success"] and [s["partition"] for s in again["steps"] if s["ran"]] == ["big.jsonl"]
    (filtered,) = committed("filtered")
    assert json.loads(filtered.read_text())["metrics"]["input_documents"] == len(lines) * 2000


def _run_entry_point(body: str) -> subprocess.CompletedProcess:
    """`marin_assets.cli.run` in a fresh process, with `main` replaced by ``body``'s `fake_main`."""
    script = ("import atexit, sys, threading, time\nimport marin_assets.cli as cli\n" + body +
              "\ncli.main = fake_main\ncli.run()\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_the_command_ends_with_its_exit_code_output_and_exit_handlers():
    # No flush of its own: the output sits in a pipe's buffer until the exit writes it.
    proc = _run_entry_point("def fake_main():\n"
                            "    atexit.register(lambda: print('exit handler ran'))\n"
                            "    print('the summary')\n    print('a warning', file=sys.stderr)\n    return 3\n")
    assert proc.returncode == 3
    assert proc.stdout == "the summary\nexit handler ran\n"
    assert proc.stderr == "a warning\n"


def test_the_command_waits_for_a_thread_that_is_still_working():
    proc = _run_entry_point("def fake_main():\n"
                            "    threading.Thread(target=lambda: (time.sleep(1), print('thread finished'))).start()\n"
                            "    return 0\n")
    assert proc.returncode == 0 and proc.stdout == "thread finished\n"
