"""`marin`: drive the asset graph from a terminal.

    marin demo                       materialize the tutorial graph on the embedded default
    marin materialize KEY [--partition P] [--json] [--force] [--verify] [--rebuild] [--max-parallel N]
    marin status [KEY ...] [--json] [--verify]
    marin lineage KEY [--partition P] [--verify] [--json] [--bom]
    marin failures [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from marin_assets import hide_dagster_notices

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = "eval"
DEMO_PARTITION = "nano-shakespeare"
POOL_LIMITS = {"cpu-train": 1, "gpu": 1, "tpu": 1}


def ensure_dagster_home() -> Path:
    """DAGSTER_HOME defaults to ./.dagster_home, seeded with the embedded-default dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or ".dagster_home").resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    config = home / "dagster.yaml"
    if not config.exists():
        shutil.copyfile(REPO_ROOT / "dagster.yaml", config)
    return home


def open_instance():
    import dagster as dg

    ensure_dagster_home()
    instance = dg.DagsterInstance.get()
    storage = instance.event_log_storage
    for pool, limit in POOL_LIMITS.items():
        if storage.get_concurrency_info(pool).slot_count == 0:
            storage.set_concurrency_slots(pool, limit)
    return instance


def load():
    from marin_assets.definitions import catalog, defs, settings
    from marin_resources.artifacts import MarinStore

    store = defs.resources["store"]
    assert isinstance(store, MarinStore)
    return defs, catalog, settings, store.get()


def planner():
    from marin_assets.planning import Planner

    instance = open_instance()
    defs, catalog, settings, store = load()
    return Planner(defs, catalog, store, instance), settings, instance


def cmd_materialize(args: argparse.Namespace) -> int:
    from marin_assets.planning import WorkspaceRuns, parse_key
    from marin_resources.store import ArtifactLockedError

    plan, settings, _ = planner()
    say = (lambda m: print(m, file=sys.stderr)) if args.json else print
    added = plan.discover()
    for name, keys in added.items():
        if keys:
            say(f"discovered {len(keys)} new partition(s) of {name}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}")
    report_refused(plan)
    started = time.monotonic()
    try:
        if args.rebuild:
            plan.retract(parse_key(args.selection), args.partition, log=say)
        # A rebuild reads its inputs again, so it re-hashes them: tampered bytes are never carried downstream.
        with stdout_to_stderr(args.json), WorkspaceRuns(plan.instance, str(REPO_ROOT / "workspace.yaml")) as runs:
            steps = plan.materialize(parse_key(args.selection), args.partition, log=say, force=args.force,
                                     verify=args.verify or args.rebuild, runs=runs, max_parallel=args.max_parallel)
    except (KeyError, ValueError) as exc:
        print(f"marin: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except ArtifactLockedError as exc:
        print(f"marin: {exc}", file=sys.stderr)
        return 1
    ok = all(s.success for s in steps)
    ran = sum(s.ran for s in steps)
    say(f"{'ok' if ok else 'FAILED'}: {ran} run(s), {len(steps) - ran} fresh step(s) skipped, "
        f"{time.monotonic() - started:.1f}s, prefix {settings.prefix}")
    if args.json:
        print(json.dumps({"success": ok, "prefix": settings.prefix,
                          "steps": [s.__dict__ for s in steps],
                          "manifests": sorted({m for s in steps for m in s.manifests})}, indent=2))
    return 0 if ok else 1


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool):
    """Point file descriptor 1 at stderr while ``enabled``: the code server and run workers inherit
    it and log there, so with --json stdout carries the JSON summary alone."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def report_refused(plan) -> None:
    for name, refused in sorted(plan.refused.items()):
        for key, reason in sorted(refused.items()):
            print(f"marin: skipped partition {key!r} of {name}: {reason}", file=sys.stderr)


def cmd_status(args: argparse.Namespace) -> int:
    from marin_assets.planning import parse_key

    plan, settings, _ = planner()
    plan.discover()
    report_refused(plan)
    keys = [parse_key(k) for k in args.keys] if args.keys else None
    states = plan.status(keys, verify=args.verify)
    if args.json:
        print(json.dumps([s.to_dict() for s in states], indent=2))
        return 0
    width = max((len(s.asset_key) for s in states), default=10)
    for s in states:
        part = f"[{s.partition}]" if s.partition else ""
        print(f"{s.state:8} {s.asset_key + part:<{width + 24}} {s.cause}")
    counts = {st: sum(s.state == st for s in states) for st in ("fresh", "stale", "missing", "damaged")}
    print(f"{counts['fresh']} fresh, {counts['stale']} stale, {counts['missing']} missing, {counts['damaged']} damaged  "
          f"(prefix {settings.prefix})")
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from marin_assets.planning import parse_key
    from marin_resources.artifacts import asset_key_str
    from marin_resources.identity import InvalidPartitionKeyError
    from marin_resources.lineage import bill_of_materials, build_lineage, render_tree

    plan, _, _ = planner()
    key = parse_key(args.key)
    if key not in plan.graph.get_all_asset_keys():
        print(f"marin: unknown asset {args.key!r}", file=sys.stderr)
        return 2
    try:  # the store's path is the marin key, whichever spelling was typed
        manifest = plan.store.find(asset_key_str(key), plan.version_of(key), args.partition)
    except InvalidPartitionKeyError as exc:  # e.g. '../../etc': no path is built from it
        print(f"marin: {args.key} has no partition {args.partition!r}: {exc}", file=sys.stderr)
        return 2
    if manifest is None:
        where = f"[{args.partition}]" if args.partition else ""
        hint = " (partitioned: pass --partition)" if plan.graph.get(key).partitions_def and not args.partition else ""
        print(f"marin: {args.key}{where} has no committed artifact at {plan.version_of(key)}{hint}", file=sys.stderr)
        return 2
    root = build_lineage(plan.store, manifest, verify=args.verify)
    problems = [p for n in {n.uri: n for n in root.walk()}.values() for p in n.problems]
    if args.bom:
        print(json.dumps(bill_of_materials(root), indent=2))
    elif args.json:
        print(json.dumps(root.to_dict(), indent=2))
    else:
        print(render_tree(root))
    if problems:
        print(f"lineage verification FAILED: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    if args.verify:
        checked = sum(n.files for n in {n.uri: n for n in root.walk()}.values())
        print(f"verified {checked} file(s) against their manifests", file=sys.stderr)
    return 0


def cmd_failures(args: argparse.Namespace) -> int:
    from marin_resources.failures import failed_materializations

    rows = failed_materializations(open_instance())
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        part = f"[{row['partition']}]" if row["partition"] else ""
        print(f"{row['time']}  run {row['run_id'][:8]}  {', '.join(row['assets']) or row['job']}{part}\n"
              f"    {row['error'].splitlines()[0][:300]}")
    print(f"{len(rows)} failed materialization(s)")
    return 0


def demo_materialize_args() -> argparse.Namespace:
    """What `marin materialize eval --partition nano-shakespeare` parses to, every option at its default."""
    return build_parser().parse_args(["materialize", DEMO_TARGET, "--partition", DEMO_PARTITION])


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    print(f"marin demo: materializing {DEMO_TARGET}[{DEMO_PARTITION}] and everything upstream of it: "
          "raw -> documents -> filtered -> deduplicated -> tokenizer -> tokenized -> mixture -> checkpoint -> eval")
    code = cmd_materialize(demo_materialize_args())
    if code != 0:
        return code
    _, settings, instance = planner()
    home = os.environ["DAGSTER_HOME"]
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s\n"
          f"  artifacts:  {settings.prefix}\n"
          f"  manifests:  find {settings.prefix} -name .artifact.json\n"
          f"  status:     marin status\n"
          f"  web UI:     DAGSTER_HOME={home} dagster dev -w {REPO_ROOT / 'workspace.yaml'} -h 127.0.0.1")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marin", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--process-output", choices=("file", "console"),
                        default=os.environ.get("MARIN_PROCESS_OUTPUT", "file"),
                        help="where training/eval processes print (default: file, in the run's directory; "
                             "a failure shows the last lines)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="materialize the tutorial graph on the embedded default").set_defaults(fn=cmd_demo)
    m = sub.add_parser("materialize", help="materialize an asset and any missing or stale upstream")
    m.add_argument("selection", help="asset key, e.g. tokenized/shakespeare")
    m.add_argument("--partition", help="partition key of the selected asset")
    m.add_argument("--json", action="store_true", help="print a JSON summary with manifest URIs")
    m.add_argument("--force", action="store_true", help="run steps even when everything is fresh")
    m.add_argument("--max-parallel", type=positive_int, default=os.cpu_count() or 1, metavar="N",
                   help="partitions of a stage run at once, each its own Dagster run and process "
                        "(default: the CPU count, %(default)s here); pools still bound each step")
    m.add_argument("--rebuild", action="store_true",
                   help="withdraw the selected partition's committed artifact first (its manifest is kept "
                        "as .artifact.json.retracted-<time>), so it is built again; implies --verify")
    m.add_argument("--verify", action="store_true",
                   help="re-hash every committed artifact in the plan and every input a build reads, instead of "
                        "the cheap check (listed files present with their recorded sizes); damaged ones are rebuilt")
    m.set_defaults(fn=cmd_materialize)
    s = sub.add_parser("status", help="list each asset partition as fresh, stale, missing or damaged, with the cause")
    s.add_argument("keys", nargs="*")
    s.add_argument("--json", action="store_true")
    s.add_argument("--verify", action="store_true", help="re-hash every file instead of checking sizes")
    s.set_defaults(fn=cmd_status)
    lin = sub.add_parser("lineage", help="walk manifests upstream to the raw bytes")
    lin.add_argument("key")
    lin.add_argument("--partition")
    lin.add_argument("--verify", action="store_true", help="re-hash every file against its manifest")
    lin.add_argument("--json", action="store_true")
    lin.add_argument("--bom", action="store_true", help="bill of materials with a hash chain")
    lin.set_defaults(fn=cmd_lineage)
    fail = sub.add_parser("failures", help="every failed materialization recorded by the instance")
    fail.add_argument("--json", action="store_true")
    fail.set_defaults(fn=cmd_failures)
    return parser


def main(argv: list[str] | None = None) -> int:
    hide_dagster_notices()
    args = build_parser().parse_args(argv)
    # Read by MarinSettings when the code location loads, after this point.
    os.environ["MARIN_PROCESS_OUTPUT"] = args.process_output
    from marin_resources.object_stores import StoreUnavailableError

    try:
        return args.fn(args)
    except StoreUnavailableError as exc:
        print(f"marin: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
