"""The 10 TB plan's partition count in a real instance: `marin status`, a new-shard sensor tick, the
planner's plan for one new shard, the UI's asset and partitions pages, and the daemon's and the
webserver's memory, at ``--shards`` dynamic partitions (default 75,000) on a PostgreSQL instance.

    python -m benchmarks.partition_scale [--shards 75000] [--database marin_partitions] \\
        [--workdir DIR] [--checkout DIR] [--skip-ui] [--keep]

Setup (not timed against a goal): a source `scale` of ``--shards`` small text files, one shard each
(`files_per_shard: 1`); for every shard a committed `raw/scale` and `documents/scale` artifact in the
store (synthetic: one small file each, manifests as the assets write them, identities and input
versions from the catalog's own specs, so `marin status` finds them fresh); the shards' partitions
in the instance, with one runless materialization of each of the two assets per partition and the
source's observation per shard (what a built corpus leaves in the event log). Later stages are
missing, as after a first `documents/` pass.

Measured, each beside its goal and the earlier baseline (2,000 shards on the embedded SQLite
instance: `marin status raw/<source>` 136 s, one shard materialized 29 s):

* `marin status raw/scale` and `marin status` (every asset), run as the CLI of ``--checkout``;
* the plan for one new shard: a file added, then in one process of ``--checkout`` the planner
  built, discovery (the new partition added), and the steps of `filtered/scale` for that partition
  with their freshness (`marin materialize filtered/scale --partition NEW` before its run; the
  "plan" figure); with ``--whole-plan``, reported beside it, the steps of `deduplicated/scale` and
  the freshness of every one, as `marin materialize deduplicated/scale` judges them (every shard's);
* with `marin ui` running (webserver and daemon), the new-shard sensor's tick that adds one
  partition (from the instance's tick record: start to end), the automation sensor's ticks, the
  asset page and the partitions page of `raw/scale` in Chromium (navigation to the network going
  quiet with the asset's content drawn), and the peak RSS of the webserver's and the daemon's
  process trees (each with its code server; the webserver's without the daemon's, its child).

The database is created and dropped (``--keep`` keeps it and the work folder). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.repo_tests import load_test_module

REPO = Path(__file__).resolve().parents[1]


# The UI test's module: its Chromium settings, port, GraphQL and wait.
ui_test = load_test_module("tests/ops/test_browser_ui.py")
CHROMIUM, CHROMIUM_ARGS, free_port, graphql, wait_until = (ui_test.CHROMIUM, ui_test.CHROMIUM_ARGS, ui_test.free_port,
                                                            ui_test.graphql, ui_test.wait_until)

SOURCE = "scale"
PG = {"host": "127.0.0.1", "port": 5432, "user": "postgres"}
GOALS_S = {"status raw/scale": 30, "status": 30, "plan": 10, "sensor tick": 10, "asset page": 5,
           "partitions page": 5}
BASELINE = "2,000 shards, embedded SQLite: status raw/<source> 136 s, one shard materialized 29 s"
PLAN_SCRIPT = textwrap.dedent("""
    import json, sys, time
    started = time.perf_counter()
    from marin_assets.cli import planner
    from marin_assets.planning import parse_key
    plan, _, _ = planner()
    loaded = time.perf_counter()
    added = plan.discover()
    discovered = time.perf_counter()
    new = sys.argv[1]
    shard_steps = plan.steps_of([(parse_key("filtered/scale"), new)])
    shard_stale = sum(any(s.state != "fresh" for s in plan._states(step, False, {})) for step in shard_steps)
    shard_planned = time.perf_counter()
    steps = plan.steps_of([(parse_key("deduplicated/scale"), None)]) if sys.argv[2:] == ["whole"] else []
    planned = time.perf_counter()
    memo = {}
    stale = sum(any(s.state != "fresh" for s in plan._states(step, False, memo)) for step in steps)
    judged = time.perf_counter()
    print(json.dumps({"added": {k: len(v) for k, v in added.items()}, "shard_steps": len(shard_steps),
                      "shard_stale_steps": shard_stale, "steps": len(steps), "stale_steps": stale,
                      "load_s": loaded - started, "discover_s": discovered - loaded,
                      "shard_plan_s": shard_planned - discovered, "steps_s": planned - shard_planned,
                      "judge_s": judged - planned, "total_s": shard_planned - started,
                      "with_whole_source_s": judged - started - (shard_planned - discovered)}))
""")


def psql(database: str, sql: str) -> None:
    subprocess.run(["psql", "-h", PG["host"], "-U", PG["user"], "-d", database, "-q", "-c", sql], check=True)


def instance_home(folder: Path, database: str) -> Path:
    """A DAGSTER_HOME of the embedded default's settings with its storage in PostgreSQL."""
    import yaml

    config = yaml.safe_load((REPO / "dagster.yaml").read_text())
    config["storage"] = {"postgres": {"postgres_db": {"hostname": PG["host"], "port": PG["port"],
                                                      "username": PG["user"], "password": "", "db_name": database,
                                                      "scheme": "postgresql+psycopg2"}}}
    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return home


def write_source(folder: Path, shards: int) -> Path:
    texts = folder / "texts"
    texts.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        (texts / f"doc-{i:06d}.txt").write_text(f"Document {i} of the partition-scale benchmark.\n")
    sources = folder / "sources.yaml"
    sources.write_text(f"sources:\n  - name: {SOURCE}\n    uri: {texts}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    return sources


def commit_shards(keys: list[str]) -> dict[str, str]:
    """Commit `raw/` and `documents/` of each shard (in a forked worker); each shard's listing version."""
    from benchmarks.shard_lookup import commit
    from marin_assets.definitions import catalog, defs
    from marin_resources.artifacts import ArtifactHandle

    store = defs.resources["store"].get()
    raw_spec, documents_spec = catalog.specs[f"raw/{SOURCE}"], catalog.specs[f"documents/{SOURCE}"]
    listings = {}
    for key in keys:
        (ext_key, version), = raw_spec.external(key).items()  # the listing the parent's discovery made
        listings[key] = version
        source = ArtifactHandle(ext_key, key, "external", "", version)
        raw = commit(store, raw_spec.key, raw_spec.version, key, raw_spec.identity(key),
                     {"listing.json": json.dumps([{"relpath": key}]).encode()}, upstream=[source])
        commit(store, documents_spec.key, documents_spec.version, key, documents_spec.identity(key),
               {"documents.parquet": key.encode()}, upstream=[ArtifactHandle.from_manifest(raw)])
    return listings


def populate(env: dict[str, str], workers: int) -> dict:
    """The store's raw/ and documents/ artifacts of every shard and the instance's partitions and
    events, through this checkout's catalog (see the module's docstring)."""
    os.environ.update(env)
    import multiprocessing

    import dagster as dg

    from marin_assets.definitions import catalog
    from marin_resources.dagster_private import DATA_VERSION_TAG, store_runless_events
    from marin_resources.keys import asset_key

    started = time.perf_counter()
    (name, discover), = ((n, d) for n, d in catalog.discoverers.items() if SOURCE in n)
    keys = discover()  # listed once here; the forked workers reuse this listing
    listings: dict[str, str] = {}
    chunks = [keys[i:i + 1000] for i in range(0, len(keys), 1000)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for done in pool.imap_unordered(commit_shards, chunks):
            listings.update(done)
            print(f"  store: {len(listings):,} of {len(keys):,} shards, {time.perf_counter() - started:.0f} s",
                  flush=True)
    stored = time.perf_counter()
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions(name, keys)
        for key_text in (f"raw/{SOURCE}", f"documents/{SOURCE}"):
            store_runless_events(instance, [dg.AssetMaterialization(asset_key(key_text), partition=k) for k in keys])
        store_runless_events(instance, [dg.AssetObservation(asset_key(f"external/{SOURCE}"), partition=k,
                                                            tags={DATA_VERSION_TAG: v}) for k, v in listings.items()])
    return {"partitions_def": name, "shards": len(keys), "store_s": round(stored - started, 1),
            "instance_s": round(time.perf_counter() - stored, 1)}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_cli(checkout: Path, env: dict[str, str], *args: str) -> tuple[float, float, str]:
    """Wall and CPU seconds of one `marin` command, and its last line."""
    started, cpu = time.perf_counter(), children_cpu_s()
    done = subprocess.run([str(checkout / ".venv/bin/python"), "-m", "marin_assets.cli", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - started, children_cpu_s() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"marin {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, cpu, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


class PeakRss:
    """The peak summed RSS of each named process tree, sampled every second in a thread. A tree
    leaves out the trees of the other names inside it (the daemon is a child of `marin ui`)."""

    def __init__(self):
        self.trees: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        while not self.done.wait(1.0):
            try:
                trees = {name: [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                         for name, pid in self.trees.items()}
                for name, procs in trees.items():
                    others = {p.pid for other, tree in trees.items() if other != name and tree[0].pid != procs[0].pid
                              and tree[0] in procs for p in tree}
                    rss = sum(p.memory_info().rss for p in procs if p.pid not in others)
                    self.peaks[name] = max(self.peaks.get(name, 0), rss)
            except psutil.NoSuchProcess:
                continue

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join()
        return {name: round(rss / 2**20) for name, rss in self.peaks.items()}


def ui_processes(ui: subprocess.Popen) -> dict[str, int]:
    """The webserver (the `marin ui` process) and its `dagster-daemon` child, by pid."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        daemons = [p.pid for p in psutil.Process(ui.pid).children() if "dagster-daemon" in " ".join(p.cmdline())]
        if daemons:
            return {"webserver": ui.pid, "daemon": daemons[0]}
        time.sleep(0.5)
    raise RuntimeError("marin ui started no dagster-daemon")


def tick_records(instance, sensor: str, after: float) -> list:
    return [tick for state in instance.all_instigator_state() if state.instigator_name == sensor
            for tick in instance.get_ticks(state.instigator_origin_id, state.selector_id, after=after)]


def page_seconds(page, url: str, content: str) -> float:
    """Navigation to the network going quiet (every GraphQL answer in) with ``content`` drawn."""
    started = time.perf_counter()
    page.goto(url, wait_until="networkidle", timeout=600_000)
    page.get_by_text(content, exact=False).first.wait_for(timeout=600_000)
    return time.perf_counter() - started


def measure_ui(checkout: Path, env: dict[str, str], folder: Path, partitions_def: str, new_file: Path,
               skip_pages: bool) -> dict:
    """With `marin ui` up: page times, the new-shard tick, the automation ticks, and peak RSS."""
    import dagster as dg

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(folder / "ui.log", "w")  # noqa: SIM115 - closed below
    ui = subprocess.Popen([str(checkout / ".venv/bin/python"), "-m", "marin_assets.cli", "ui", "--port", str(port)],
                          cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rss = PeakRss()
    out: dict = {}
    try:
        rss.trees.update(ui_processes(ui))
        procs, logs = [ui], [folder / "ui.log"]
        wait_until("the webserver", lambda: urllib.request.urlopen(f"{base}/server_info", timeout=5).status == 200,
                   600, procs, logs)
        os.environ.update(env)
        with dg.DagsterInstance.get() as instance:
            since = time.time()
            if not skip_pages:
                out.update(browse(base, folder))
            # The new file lands after the pages: the tick that follows adds its one partition.
            known = set(instance.get_dynamic_partitions(partitions_def))
            new_file.write_text("A document that landed while the daemon ran.\n")
            landed = time.time()
            wait_until("the new shard's partition",
                       lambda: set(instance.get_dynamic_partitions(partitions_def)) - known, 900, procs, logs)
            added_at = time.time()
            ticks = wait_until("the tick that added it", lambda: [
                t for t in tick_records(instance, f"{SOURCE}_new_shards", landed - 1) if t.end_timestamp], 120, procs,
                logs)
            tick = min(ticks, key=lambda t: t.timestamp)
            out["sensor tick"] = round(tick.end_timestamp - tick.timestamp, 1)
            out["file to partition s"] = round(added_at - landed, 1)
            automation = [t for t in tick_records(instance, "automation", since) if t.end_timestamp]
            out["automation ticks s"] = sorted(round(t.end_timestamp - t.timestamp, 1) for t in automation)
    finally:
        os.killpg(ui.pid, 15)
        try:
            ui.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, 9)
            ui.wait()
        log.close()
        out["peak RSS MiB"] = rss.stop()
    return out


def browse(base: str, folder: Path) -> dict:
    from playwright.sync_api import sync_playwright

    page_path = f"{base}/assets/raw/{SOURCE}_raw"
    times = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            graphql(base, "mutation { setNuxSeen }")
            page.goto(base, wait_until="networkidle", timeout=600_000)  # the app's scripts, cached for both pages
            times["asset page"] = round(page_seconds(page, f"{page_path}?view=overview", f"{SOURCE}_raw"), 1)
            page.screenshot(path=str(folder / "asset_page.png"))
            times["partitions page"] = round(page_seconds(page, f"{page_path}?view=partitions", "doc-000000"), 1)
            page.screenshot(path=str(folder / "partitions_page.png"))
        finally:
            browser.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=75_000)
    parser.add_argument("--database", default="marin_partitions")
    parser.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    parser.add_argument("--checkout", type=Path, default=REPO, help="whose CLI and planner are measured")
    parser.add_argument("--skip-ui", action="store_true", help="no webserver, daemon or browser")
    parser.add_argument("--skip-pages", action="store_true", help="the daemon's figures without the browser")
    parser.add_argument("--setup-workers", type=int, default=2, help="processes writing the synthetic store")
    parser.add_argument("--keep", action="store_true", help="keep the database and the work folder")
    parser.add_argument("--reuse", action="store_true", help="measure again on a kept --workdir (no setup)")
    parser.add_argument("--skip-cli", action="store_true", help="no status or plan")
    parser.add_argument("--skip-status", action="store_true", help="the plan without the two statuses")
    parser.add_argument("--whole-plan", action="store_true",
                        help="also plan and judge `deduplicated/scale`: every shard's step (minutes at 75,000)")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    folder = (args.workdir or Path(tempfile.mkdtemp(prefix="marin-partition-scale-"))).resolve()
    sources, home = folder / "sources.yaml", folder / "home"
    reuse = args.reuse and sources.exists() and home.exists()
    if not reuse:
        psql("postgres", f'CREATE DATABASE "{args.database}"')
    try:
        env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(folder / "store"),
               "DAGSTER_HOME": str(home), "MARIN_CACHE_DIR": str(folder / "cache"), "MARIN_ENV": "local"}
        print(f"{args.shards:,} shards, checkout {checkout}, {os.cpu_count()} cores, load "
              f"{os.getloadavg()[0]:.1f}; {'reusing' if reuse else 'setting up in'} {folder}", flush=True)
        if reuse:
            setup = json.loads((folder / "setup.json").read_text())
        else:
            write_source(folder, args.shards)
            instance_home(folder, args.database)
            setup = populate(env, args.setup_workers)
            (folder / "setup.json").write_text(json.dumps(setup))
        print(f"  setup: {setup}", flush=True)
        figures, cpu, plan = ({}, {}, None) if args.skip_cli else measure_cli(
            checkout, env, folder, status=not args.skip_status, whole_plan=args.whole_plan)
        ui = {} if args.skip_ui else measure_ui(checkout, env, folder, setup["partitions_def"],
                                                folder / "texts" / f"doc-new-tick-{int(time.time())}.txt",
                                                args.skip_pages)
        figures.update({k: v for k, v in ui.items() if k in GOALS_S})
        print(f"\n{'measure':>18} {'wall s':>9} {'CPU s':>7} {'goal s':>6}  at {setup['shards']:,} partitions, "
              f"PostgreSQL, load {os.getloadavg()[0]:.1f}")
        for what, goal in GOALS_S.items():
            if what in figures:
                value = figures[what]
                spent = f"{cpu[what]:>7.1f}" if what in cpu else f"{'':>7}"
                print(f"{what:>18} {value:>9.1f} {spent} {goal:>6}  {'met' if value <= goal else 'NOT MET'}")
        print(f"baseline: {BASELINE}")
        for what in ("automation ticks s", "file to partition s", "peak RSS MiB"):
            if what in ui:
                print(f"{what}: {ui[what]}")
        print(json.dumps({"shards": setup["shards"], "checkout": str(checkout), "setup": setup, "plan": plan,
                          "figures": {k: round(v, 1) for k, v in figures.items()},
                          "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
                          **{k: v for k, v in ui.items() if k not in GOALS_S}}))
    finally:
        if not args.keep:
            psql("postgres", f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
            shutil.rmtree(folder, ignore_errors=True)


def measure_cli(checkout: Path, env: dict[str, str], folder: Path, *, status: bool, whole_plan: bool
                ) -> tuple[dict, dict, dict]:
    """`marin status raw/scale`, `marin status` and the plan for one new shard: wall and CPU seconds."""
    figures: dict = {}
    cpu: dict = {}
    if status:
        figures["status raw/scale"], cpu["status raw/scale"], summary_raw = run_cli(checkout, env, "status",
                                                                                   f"raw/{SOURCE}")
        print(f"  status raw/{SOURCE}: {figures['status raw/scale']:.1f} s: {summary_raw}", flush=True)
        figures["status"], cpu["status"], summary_all = run_cli(checkout, env, "status")
        print(f"  status: {figures['status']:.1f} s: {summary_all}", flush=True)
    new_shard = f"doc-new-plan-{int(time.time())}.txt"
    (folder / "texts" / new_shard).write_text("A new document for the planner.\n")
    before = children_cpu_s()
    done = subprocess.run([str(checkout / ".venv/bin/python"), "-c", PLAN_SCRIPT, new_shard,
                           *(["whole"] if whole_plan else [])], cwd=checkout,
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the plan exited {done.returncode}: {done.stderr[-2000:]}")
    cpu["plan"] = children_cpu_s() - before
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    figures["plan"] = plan["total_s"]
    print(f"  plan: {plan}", flush=True)
    return figures, cpu, plan


if __name__ == "__main__":
    sys.exit(main())
