"""`marin`: drive the asset graph from a terminal.

    marin demo                       materialize the tutorial graph on the embedded default
    marin materialize KEY [--partition P] [--json] [--force] [--verify] [--rebuild] [--max-parallel N]
    marin status [KEY ...] [--json] [--verify] [--why KEY [--partition P]]
    marin lineage KEY [--partition P] [--verify] [--json] [--bom [--sign KEYFILE]]
    marin lineage --verify-bom FILE --pubkey PUB
    marin keygen KEYFILE
    marin gc [--dry-run] [--keep PATTERN ...]
    marin pin KEY [--partition P]
    marin migrate [--dry-run]
    marin failures [--json]
    marin compare RUN [RUN ...] [--plot PNG] [--json]
    marin init DIR [--data FOLDER]      write a commented starter project file, DIR/marin.yaml
    marin ui [--host H] [--port P]      the web UI and daemon on this instance (cross-site writes refused)

Every command reads the project file: ./marin.yaml, or the file --config PATH (or MARIN_CONFIG)
names; it extends the built-in sources, tokenizers, mixtures, runs and sweeps, and names the store.

A refusal (bad config, unknown asset, unreachable store, unreadable instance database) is one
line, `marin: <cause>`, and exit 2; `marin --debug COMMAND ...` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from marin_assets import hide_dagster_notices

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TARGET = "eval"
DEMO_PARTITION = "nano-shakespeare"
DEMO_SWEEP = "demo"
"""The built-in sweep the demo fits after its run: 3 budgets x 3 model sizes of a few seconds each."""
# Local limits. Two CPU trainings at a time: a small Levanter run spends most of its wall time in
# single-threaded work (start-up, tracing, compilation, the Python step loop; a demo sweep run: 36 s,
# of which 10 s in steps), so a second one fills the other core. One accelerator run per device.
POOL_LIMITS = {"cpu-train": 2, "gpu": 1, "tpu": 1}
GRPC_TIMEOUT_S = 600


class InstanceHomeError(Exception):
    """DAGSTER_HOME cannot hold what opening the instance writes there."""


# What a home that is not writable refuses: permission, or a read-only file system.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def ensure_dagster_home() -> Path:
    """DAGSTER_HOME defaults to ./.dagster_home, seeded with the embedded-default dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or ".dagster_home").resolve()
    config = home / "dagster.yaml"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if not config.exists():
            shutil.copyfile(REPO_ROOT / "dagster.yaml", config)
    except OSError as exc:
        if exc.errno not in NOT_WRITABLE:
            raise
        raise InstanceHomeError(f"DAGSTER_HOME {home} is not writable ({exc.strerror}) and has no dagster.yaml "
                                "to open the instance with; point DAGSTER_HOME at a writable folder") from exc
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def storage_in_home(home: Path) -> bool:
    """Whether the instance keeps its runs and events under `home` (SQLite: `storage` absent or not a
    database server's)."""
    import yaml

    storage = (yaml.safe_load((home / "dagster.yaml").read_text()) or {}).get("storage")
    return not (isinstance(storage, dict) and {"postgres", "mysql"} & storage.keys())


@contextlib.contextmanager
def instance_open_lock(home: Path):
    """The lock one `marin` process at a time opens the instance under. A home that is not writable
    cannot hold it: an instance on a database server (PostgreSQL) is then opened without it (the race
    it prevents is SQLite's first open); one whose SQLite files live there is refused in one line."""
    from marin_resources.storage.leases import exclusive_file_lock

    path = home / ".instance-open.lock"
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive_file_lock(path))
        except OSError as exc:
            if exc.errno not in NOT_WRITABLE:
                raise
            if storage_in_home(home):
                raise InstanceHomeError(f"DAGSTER_HOME {home} is not writable ({exc.strerror}: {path}); the "
                                        "instance's SQLite database lives there: point DAGSTER_HOME at a writable "
                                        "folder") from exc
        yield


def open_instance():
    import dagster as dg

    from marin_resources.storage.object_stores import quiet_logger

    home = ensure_dagster_home()
    # One `marin` process at a time opens the instance: the first open creates its SQLite schema and
    # the pools' limits, and two processes doing that at once (`marin ui` and `marin materialize`
    # started together on a new home) stamped two schema versions, which left the instance unusable
    # for good, or inserted a pool twice. dagster-postgres logs each retry of an unreachable database
    # on the root logger; the refusal (`refusal`) says it once.
    with instance_open_lock(home), quiet_logger(""):
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


def store_only():
    """The store the environment names, without loading the code location (commands that need no graph)."""
    from marin_resources.environments import MarinSettings, store_resource

    settings = MarinSettings.from_env()
    return settings, store_resource(settings).get()


def planner():
    from marin_assets.planning import Planner

    instance = open_instance()
    defs, catalog, settings, store = load()
    return Planner(defs, catalog, store, instance), settings, instance


def cmd_materialize(args: argparse.Namespace) -> int:
    return materialize_plans([[args]])


def materialize_plans(plans: list[list[argparse.Namespace]], announce: Sequence[str] = ()) -> int:
    """Each plan is `marin materialize` of its arguments' targets (one plan: their steps overlap),
    the plans one after another, stopping at the first that fails. They share one planner, one
    discovery and one code server, which a command per plan would each pay again. `announce[i]` is
    printed before plan i. Every option comes from the plan's first arguments."""
    from marin_assets.planning import parse_key
    from marin_assets.run_submission import WorkspaceRuns
    from marin_resources.environments import check_ray_reachable

    plan, settings, _ = planner()
    plan.store.check_writable()  # before any run starts: a read-only store fails here in one line
    check_ray_reachable(settings)  # before any run starts, so nothing is built without its cluster
    json_out = plans[0][0].json
    say = (lambda m: print(m, file=sys.stderr)) if json_out else print
    added = plan.discover()
    for name, keys in added.items():
        if keys:
            say(f"discovered {len(keys)} new partition(s) of {name}: "
                f"{', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}")
    report_refused(plan)
    with WorkspaceRuns(plan.instance, str(REPO_ROOT / "workspace.yaml")) as runs:
        for number, targets in enumerate(plans):
            if number < len(announce):
                say(announce[number])
            args = targets[0]
            started = time.monotonic()
            if args.rebuild:
                plan.retract(parse_key(args.selection), args.partition, log=say)
            # A rebuild reads its inputs again, so it re-hashes them: tampered bytes are never carried downstream.
            with stdout_to_stderr(json_out):  # the code server and run workers, started here, inherit it
                steps = plan.materialize_all([(parse_key(t.selection), t.partition) for t in targets], log=say,
                                             force=args.force, verify=args.verify or args.rebuild, runs=runs,
                                             max_parallel=args.max_parallel, last_plan=number == len(plans) - 1)
            code = report_plan(steps, settings, started, say, json_out)
            if code != 0:
                return code
    return 0


def report_plan(steps, settings, started: float, say, json_out: bool) -> int:
    """The plan's one-line summary (and with --json its steps); its exit code."""
    failed = [s for s in steps if not s.success and not s.skipped]
    skipped = sum(s.skipped for s in steps)
    ran = sum(s.ran for s in steps)
    runs = len({s.run_id for s in steps if s.ran})  # a global step that joined a shard's run shares it
    failures = f" ({len(failed)} failed: {', '.join(str(s.partition or s.asset_keys[0]) for s in failed)})" \
        if failed else ""
    ok = all(s.success for s in steps)
    say(f"{'ok' if ok else 'FAILED'}: {runs} run(s){failures}, {len(steps) - ran - skipped} fresh step(s) skipped"
        f"{f', {skipped} step(s) not run after a failure' if skipped else ''}, "
        f"{time.monotonic() - started:.1f}s, prefix {settings.prefix}")
    if json_out:
        print(json.dumps({"success": ok, "prefix": settings.prefix,
                          "steps": [s.__dict__ for s in steps],
                          "manifests": sorted({m for s in steps for m in s.manifests})}, indent=2))
    # Steps that only refused their input (a missing config.json, a step that is not there) are refusals.
    return 0 if ok else 2 if all(s.refused for s in failed) and failed else 1


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
    if args.why:
        return print_why(plan, args.why, args.partition, verify=args.verify)
    keys = [parse_key(k) for k in args.keys] if args.keys else None
    states = plan.status(keys, verify=args.verify)
    if args.json:
        print(json.dumps([s.to_dict() for s in states], indent=2))
        return 0
    print("\n".join(status_lines(states, settings.prefix)))
    return 0


def status_lines(states, prefix: str) -> list[str]:
    """`marin status` in text: a line per partition, then what was never built and nothing built
    reads, one line per asset (not a gap: the project has not asked for it), then the counts."""
    listed = [s for s in states if not s.unrequested]
    width = max((len(s.asset_key) for s in listed), default=10)
    lines = []
    for s in listed:
        part = f"[{s.partition}]" if s.partition else ""
        lines.append(f"{s.state:8} {s.asset_key + part:<{width + 24}} {s.cause}")
    unrequested: dict[str, list[str | None]] = {}
    for s in states:
        if s.unrequested:
            unrequested.setdefault(s.asset_key, []).append(s.partition)
    if unrequested:
        lines.append("not built: never materialized, and nothing built reads them (marin materialize KEY builds one)")
        for key, parts in unrequested.items():
            named = [p for p in parts if p is not None]
            shown = f": {', '.join(named[:3])}{', ...' if len(named) > 3 else ''}" if named else ""
            lines.append(f"  {key}" + (f"  {len(named)} partition(s){shown}" if named else ""))
    counts = {st: sum(s.state == st for s in listed) for st in ("fresh", "stale", "missing", "damaged")}
    not_built = sum(len(parts) for parts in unrequested.values())
    lines.append(f"{counts['fresh']} fresh, {counts['stale']} stale, {counts['missing']} missing, "
                 f"{counts['damaged']} damaged, {not_built} not built  (prefix {prefix})")
    return lines


def print_why(plan, key_text: str, partition: str | None, *, verify: bool) -> int:
    """The cause chain of one asset (every partition, or one): each not-fresh input, down to the first cause."""
    from marin_assets.planning import parse_key

    key = parse_key(key_text)
    plan.require_asset(key)
    plan.require_partition(key, partition)
    memo: dict = {}
    for part in [partition] if partition is not None else plan.partitions_of(key):
        state = plan.state(key, part, verify=verify, memo=memo)
        print("\n".join(state.decision.chain()))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from marin_assets.planning import parse_key
    from marin_resources.storage.identity import InvalidPartitionKeyError, validate_partition_key
    from marin_resources.storage.lineage import bill_of_materials, build_lineage, render_tree
    from marin_resources.storage.signing import SignatureError, sign_bom

    if args.verify_bom:
        return verify_bom(args)
    if not args.key:
        print("marin: lineage needs an asset KEY (or --verify-bom FILE --pubkey PUB)", file=sys.stderr)
        return 2
    if args.sign and not args.bom:
        print("marin: --sign signs the bill of materials: add --bom", file=sys.stderr)
        return 2
    plan, _, _ = planner()
    key = parse_key(args.key)
    if key not in plan.graph.get_all_asset_keys():
        print(f"marin: unknown asset {args.key!r}", file=sys.stderr)
        return 2
    try:
        if args.partition is not None:
            validate_partition_key(args.partition)  # e.g. '../../etc': no path is built from it
        manifest = plan.current(key, args.partition)
    except (InvalidPartitionKeyError, KeyError) as exc:
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
        bom = bill_of_materials(root)
        if args.sign:
            try:
                bom = sign_bom(bom, args.sign)
            except (SignatureError, OSError) as exc:
                print(f"marin: {exc}", file=sys.stderr)
                return 2
        print(json.dumps(bom, indent=2))
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


def verify_bom(args: argparse.Namespace) -> int:
    """`marin lineage --verify-bom FILE --pubkey PUB`: the signature, then every listed file re-hashed."""
    from marin_resources.storage.signing import SignatureError, verify_signed_bom

    if not args.pubkey:
        print("marin: --verify-bom needs --pubkey PUB (the signer's public key)", file=sys.stderr)
        return 2
    _, store = store_only()
    try:
        signed = json.loads(Path(args.verify_bom).read_text())
        problems = verify_signed_bom(store, signed, args.pubkey)
    except (OSError, json.JSONDecodeError, SignatureError) as exc:
        print(f"marin: {exc}", file=sys.stderr)
        return 2
    artifacts = signed["bom"]["artifacts"]
    if problems:
        print(f"bill of materials verification FAILED: {len(problems)} problem(s)", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    files = sum(len(a.get("files", [])) for a in artifacts)
    print(f"signature good; {len(artifacts)} artifact(s), {files} file(s) re-hashed; chain hash "
          f"{signed['bom']['chain_hash'][:16]} matches")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from marin_resources.storage.signing import generate_keypair

    try:
        private, public = generate_keypair(args.keyfile)
    except FileExistsError:
        print(f"marin: {args.keyfile} exists; not replacing a key", file=sys.stderr)
        return 2
    print(f"private key {private} (keep it secret), public key {public}")
    return 0


def current_artifacts(plan) -> tuple[dict[str, tuple[bool, str]], list]:
    """Every stored asset (key -> (partitioned, code version)) and the artifacts the code wants now."""
    from marin_assets.planning import key_str

    assets, current = {}, []
    for key in plan.artifact_keys():
        assets[key_str(key)] = (plan.graph.get(key).partitions_def is not None, plan.version_of(key))
        current.extend(m for p in plan.partitions_of(key) if (m := plan.current(key, p)) is not None)
    return assets, current


def cmd_gc(args: argparse.Namespace) -> int:
    from marin_resources.storage.gc import PINS_PATH, plan_gc, run_gc

    plan, settings, _ = planner()
    plan.discover()
    assets, current = current_artifacts(plan)
    gc = plan_gc(plan.store, assets, current, keep=args.keep)
    verb = "would remove" if args.dry_run else "remove"
    for uri, size in gc.removed:
        print(f"{verb:12} {uri[len(plan.store.prefix) + 1:]}  ({size} bytes)")
    for uri, why in gc.skipped:
        print(f"{'skip':12} {uri[len(plan.store.prefix) + 1:]}  ({why})")
    if not args.dry_run:
        run_gc(plan.store, gc)
    print(f"{len(gc.removed)} artifact version(s), {gc.removed_bytes} bytes "
          f"{'would be removed (dry run)' if args.dry_run else 'removed'}; {len(gc.kept)} kept (current, pinned in "
          f"{settings.prefix}/{PINS_PATH}, or their inputs); {len(gc.skipped)} skipped")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    from marin_assets.planning import parse_key
    from marin_resources.storage.gc import PINS_PATH, add_pin

    plan, settings, _ = planner()
    key = parse_key(args.key)
    plan.require_asset(key)
    plan.require_partition(key, args.partition)
    manifest = plan.current(key, args.partition)
    if manifest is None:
        print(f"marin: {args.key} has no committed artifact of its current identity to pin", file=sys.stderr)
        return 2
    print(f"pinned {add_pin(plan.store, manifest.uri)} in {settings.prefix}/{PINS_PATH}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from marin_resources.storage.migrate import migrate

    settings, store = store_only()
    result = migrate(store, dry_run=args.dry_run)
    for line in result.refused:
        print(f"  refused {line}", file=sys.stderr)
    mib = result.bytes / 2**20
    if args.dry_run:
        print(f"would move {len(result.moved)} artifact(s), {result.files} file(s), {mib:.1f} MiB, rewrite the inputs "
              f"of {result.rewritten} manifest(s), write {result.pointed} ref(s), finish {result.finished} "
              f"interrupted move(s); {result.already} already in place (prefix {settings.prefix})")
        return 0
    print(f"moved {len(result.moved)} artifact(s), {result.files} file(s), {mib:.1f} MiB in {result.seconds:.2f}s, "
          f"rewrote the inputs of {result.rewritten} manifest(s), wrote {result.pointed} ref(s), finished "
          f"{result.finished} interrupted move(s); {result.already} already in place; verified in "
          f"{result.verify_seconds:.2f}s (prefix {settings.prefix})")
    for line in result.old_paths:
        print(f"  old path in {line[len(store.prefix) + 1:]}; rebuild it (marin materialize KEY --rebuild)",
              file=sys.stderr)
    if result.problems:
        print(f"verification FAILED: {len(result.problems)} problem(s)", file=sys.stderr)
        for problem in result.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 1 if result.refused else 0


def cmd_failures(args: argparse.Namespace) -> int:
    from marin_resources.failures import failed_materializations

    instance = open_instance()
    rows = failed_materializations(instance)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print("\n".join(failure_lines(instance, rows)))
    return 0


def failure_lines(instance, rows: list[dict]) -> list[str]:
    """`marin failures` in text: each failure's time, run, assets and error; a run automation started is
    marked so, and its newest failure says what automation does next (a retry, or that it gave up)."""
    from marin_assets.automation import AUTOMATION_RUN_TAGS, retry_note

    lines, noted = [], set()
    for row in rows:
        part = f"[{row['partition']}]" if row["partition"] else ""
        automated = AUTOMATION_RUN_TAGS.items() <= row["tags"].items()
        lines += [f"{row['time']}  run {row['run_id'][:8]}  {', '.join(row['assets']) or row['job']}{part}"
                  + ("  (automation)" if automated else ""), f"    {row['error'].splitlines()[0][:300]}"]
        for key in row["failed_assets"] if automated else ():
            if (key, row["partition"]) not in noted:  # the newest row of each: what comes next
                noted.add((key, row["partition"]))
                if note := retry_note(instance, key, row["partition"]):
                    lines.append(f"    {key}: {note}")
    return [*lines, f"{len(rows)} failed materialization(s)"]


def cmd_compare(args: argparse.Namespace) -> int:
    """The runs' committed results side by side, and their loss curves in one PNG (`reports.compare`)."""
    from marin_assets.deployment import Deployment
    from marin_assets.reports.compare import CompareError, compare, plot_loss_curves, text_table
    from marin_assets.reports.comparison import load_runs
    from marin_assets.stages import build_catalog

    settings, store = store_only()
    deployment = Deployment.load(settings)
    try:
        results = load_runs(deployment, store, build_catalog(settings, deployment), args.runs)
    except CompareError as exc:
        print(f"marin: {exc}", file=sys.stderr)
        return 2
    comparison = compare(results)
    plot = str(Path(args.plot).resolve()) if any(r.curve for r in results) else None
    if plot is not None:
        plot_loss_curves(results, plot)
    if args.json:
        print(json.dumps({**comparison.to_dict(), "plot": plot, "prefix": settings.prefix}, indent=2))
        return 0
    print(text_table(comparison))
    for note in comparison.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"\nloss curves: {plot or 'none (no run has metrics.jsonl)'}  (prefix {settings.prefix})")
    return 0


def demo_materialize_args() -> list[list[argparse.Namespace]]:
    """The demo's two plans, every option at its default: `marin materialize eval --partition
    nano-shakespeare`, then `hf_model --partition nano-shakespeare` and `scaling_fit/demo` as one
    plan."""
    parser = build_parser()
    return [[parser.parse_args(["materialize", DEMO_TARGET, "--partition", DEMO_PARTITION])],
            [parser.parse_args(["materialize", f"scaling_fit/{DEMO_SWEEP}"]),
             parser.parse_args(["materialize", "hf_model", "--partition", DEMO_PARTITION])]]


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    # The named run first and alone: beside sweep runs the Levanter processes compete for the two
    # cores (measured: the named run still training after 8 minutes instead of about 4, each sweep
    # run beside it 190-197 s). Its export then joins the sweep's plan, listed last so that it takes
    # the slot the sweep's odd run leaves free instead of a turn of its own.
    plans = demo_materialize_args()
    announce = [f"marin demo: materializing {DEMO_TARGET}[{DEMO_PARTITION}] and everything upstream of it: raw -> "
                "documents -> filtered -> deduplicated -> tokenizer, eval_ngrams -> decontaminated -> token_shards "
                "-> tokenized -> mixture -> checkpoint -> eval",
                f"marin demo: materializing scaling_fit/{DEMO_SWEEP} (sweep/{DEMO_SWEEP} -> 9 sweep runs "
                f"(sweep_checkpoint, sweep_eval) -> isoFLOP fit) and hf_model[{DEMO_PARTITION}] (the run's "
                "checkpoint in Hugging Face format, read back by transformers)"]
    code = materialize_plans(plans, announce)
    if code != 0:
        return code
    from marin_assets.export.assets import HF_MODEL_VERSION, loading_snippet

    settings, store = store_only()
    export = store.find("hf_model", HF_MODEL_VERSION, DEMO_PARTITION)
    model_lines = "".join(f"\n              {line}" for line in loading_snippet(export.uri).splitlines()) \
        if export is not None else ""
    print(f"\ndemo finished in {time.monotonic() - started:.1f}s\n"
          f"  store:      {settings.prefix} ({store_origin(settings)})\n"
          f"  model:      {export.uri if export else 'not exported'} (Hugging Face format){model_lines}\n"
          f"  manifests:  find {settings.prefix} -name .artifact.json\n"
          f"  status:     marin status\n"
          f"  web UI:     {ui_command(settings)}")
    return 0


def store_origin(settings) -> str:
    """Which setting named the store, for the lines that print it."""
    if settings.prefix_named_by == "default":
        return "the default, ./local_store in the working directory; set `store:` in marin.yaml to move it"
    if settings.prefix_named_by == "MARIN_PREFIX":
        return "MARIN_PREFIX"
    return f"store: in {settings.prefix_named_by}"


def ui_command(settings) -> str:
    """The `marin ui` command that shows this instance, store and project in the web UI. The code
    location finds ./marin.yaml itself; a project file elsewhere is named in MARIN_CONFIG."""
    from marin_resources.project import CONFIG_ENV, PROJECT_FILE

    project = settings.project
    elsewhere = project is not None and project.path != (Path.cwd() / PROJECT_FILE).resolve()
    named = f"{CONFIG_ENV}={project.path} " if elsewhere else ""
    return f"DAGSTER_HOME={os.environ['DAGSTER_HOME']} {named}marin ui"


def cmd_ui(args: argparse.Namespace) -> int:
    """Dagster's web UI behind the same-origin guard (`marin_resources.web_ui`), with the daemon beside it:
    what `dagster dev -w workspace.yaml` starts, without the cross-site writes."""
    from marin_resources.web_ui import serve

    serve(open_instance(), REPO_ROOT / "workspace.yaml", host=args.host, port=args.port, extra_hosts=args.allow_host,
          daemon=not args.no_daemon)
    return 0


STARTER_PROJECT = Path(__file__).with_name("starter_project.yaml")


def cmd_init(args: argparse.Namespace) -> int:
    """Write DIR/marin.yaml from the commented starter; never over an existing file."""
    from string import Template

    from marin_resources.project import PROJECT_FILE

    directory = Path(args.directory).expanduser()
    target = directory / PROJECT_FILE
    if target.exists():
        print(f"marin: {target} exists; not replacing a project file", file=sys.stderr)
        return 2
    # The source's files: FOLDER's .txt files at any depth, else texts/ beside the project file.
    source_uri = f"{Path(args.data).expanduser().resolve()}/**/*.txt" if args.data else "texts/**/*.txt"
    directory.mkdir(parents=True, exist_ok=True)
    with open(target, "x") as fh:  # "x": a file created meanwhile is not replaced either
        fh.write(Template(STARTER_PROJECT.read_text()).substitute(source_uri=source_uri))
    print(f"wrote {target}: source my_text ({source_uri}), tokenizer, mixture and run my-first-run; "
          f"next: cd {directory} && marin materialize eval --partition my-first-run")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marin", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--debug", action="store_true",
                        help="with a refusal (exit 2: bad config, unknown asset, unreachable store or instance "
                             "database), print the traceback too")
    parser.add_argument("--config", metavar="PATH",
                        help="the project file (default: MARIN_CONFIG, else ./marin.yaml if there is one)")
    parser.add_argument("--process-output", choices=("file", "console"),
                        help="where training/eval processes print (default: MARIN_PROCESS_OUTPUT, else file, in "
                             "the run's directory, where a failure shows the last lines; `ui`: console, the "
                             "step's logs in the UI)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="materialize the tutorial graph on the embedded default").set_defaults(fn=cmd_demo)
    m = sub.add_parser("materialize", help="materialize an asset and any missing or stale upstream")
    m.add_argument("selection", help="asset key, e.g. tokenized/shakespeare")
    m.add_argument("--partition", help="partition key of the selected asset")
    m.add_argument("--json", action="store_true", help="print a JSON summary with manifest URIs")
    m.add_argument("--force", action="store_true", help="run steps even when everything is fresh")
    m.add_argument("--max-parallel", type=positive_int, metavar="N",
                   help="partitions of a stage run at once, each its own Dagster run and process (default: "
                        f"the CPU count, {os.cpu_count() or 1} here, capped by the instance's max_concurrent_runs); "
                        "pools still bound each step")
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
    s.add_argument("--why", metavar="KEY", help="print the cause chain of one asset: each input that is not fresh, "
                                                "down to the first cause")
    s.add_argument("--partition", help="with --why: one partition")
    s.set_defaults(fn=cmd_status)
    lin = sub.add_parser("lineage", help="walk manifests upstream to the raw bytes")
    lin.add_argument("key", nargs="?")
    lin.add_argument("--partition")
    lin.add_argument("--verify", action="store_true", help="re-hash every file against its manifest")
    lin.add_argument("--json", action="store_true")
    lin.add_argument("--bom", action="store_true", help="bill of materials with a hash chain")
    lin.add_argument("--sign", metavar="KEYFILE", help="with --bom: sign it with this Ed25519 private key (PEM)")
    lin.add_argument("--verify-bom", metavar="FILE", help="check a signed BOM's signature and re-hash every "
                                                          "artifact it lists")
    lin.add_argument("--pubkey", metavar="PUB", help="with --verify-bom: the signer's Ed25519 public key (PEM)")
    lin.set_defaults(fn=cmd_lineage)
    key = sub.add_parser("keygen", help="write a new Ed25519 key pair for signing BOMs: KEYFILE and KEYFILE.pub")
    key.add_argument("keyfile")
    key.set_defaults(fn=cmd_keygen)
    gc = sub.add_parser("gc", help="remove artifact versions that nothing current references (pins are kept)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                    help="also keep artifacts whose path under the prefix matches this glob (repeatable)")
    gc.set_defaults(fn=cmd_gc)
    pin = sub.add_parser("pin", help="keep an asset's current artifact (and its inputs) through marin gc")
    pin.add_argument("key")
    pin.add_argument("--partition")
    pin.set_defaults(fn=cmd_pin)
    mig = sub.add_parser("migrate", help="move a store of the {key}/{code_version} layout to "
                                         "{key}/{code_version}-{fingerprint}, then verify it")
    mig.add_argument("--dry-run", action="store_true")
    mig.set_defaults(fn=cmd_migrate)
    fail = sub.add_parser("failures", help="every failed materialization recorded by the instance")
    fail.add_argument("--json", action="store_true")
    fail.set_defaults(fn=cmd_failures)
    cmp = sub.add_parser("compare", help="the runs' eval metrics side by side, and their loss curves in one plot")
    cmp.add_argument("runs", nargs="+", metavar="RUN", help="a named run (runs.yaml) or a sweep's run")
    cmp.add_argument("--plot", default="compare.png", metavar="PNG",
                     help="where to write the overlaid loss curves (default: ./compare.png)")
    cmp.add_argument("--json", action="store_true", help="print the table as JSON (rows, values by run, notes)")
    cmp.set_defaults(fn=cmd_compare)
    init = sub.add_parser("init", help="write a commented starter project file, DIR/marin.yaml (never over one)")
    init.add_argument("directory", metavar="DIR")
    init.add_argument("--data", metavar="FOLDER",
                      help="the folder of your text files (default: DIR/texts); its .txt files at any depth")
    init.set_defaults(fn=cmd_init)
    ui = sub.add_parser("ui", help="the Dagster web UI and daemon on this instance and project; the UI refuses "
                                   "writes from other origins (docs/ui.md)")
    ui.add_argument("--host", default="127.0.0.1", help="the address to bind (default: 127.0.0.1)")
    ui.add_argument("--port", type=positive_int, default=3000)
    ui.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="another host name the UI answers to, as a browser spells it (repeatable)")
    ui.add_argument("--no-daemon", action="store_true", help="the web UI alone (a daemon runs elsewhere)")
    ui.set_defaults(fn=cmd_ui)
    return parser


def main(argv: list[str] | None = None) -> int:
    hide_dagster_notices()
    args = build_parser().parse_args(argv)
    # Read by MarinSettings when the code location loads, after this point.
    os.environ["MARIN_PROCESS_OUTPUT"] = args.process_output or os.environ.get("MARIN_PROCESS_OUTPUT") or \
        ("console" if args.command == "ui" else "file")
    # Dagster waits 60 s for the code server to answer a run launch; on a loaded machine (an 800 MB
    # build, two cores, load 40+) it answered later and runs failed before they started.
    os.environ.setdefault("DAGSTER_GRPC_TIMEOUT_SECONDS", str(GRPC_TIMEOUT_S))
    try:
        use_project_file(args.config)
        return args.fn(args)
    except Exception as exc:
        known = refusal(exc)
        if known is None:
            raise
        if args.debug:
            traceback.print_exc()
        code, line = known
        print(f"marin: {line}", file=sys.stderr)
        return code


def use_project_file(config: str | None) -> None:
    """Name the project file (``--config``, else MARIN_CONFIG, else ./marin.yaml) in MARIN_CONFIG by its
    absolute path, so the code server and run workers read the same file whatever their directory."""
    from marin_resources.project import CONFIG_ENV, ProjectFileError, find_project_file

    if config:
        path = Path(config).expanduser().resolve()
        if not path.is_file():
            raise ProjectFileError(f"--config {config}: no such project file")
        os.environ[CONFIG_ENV] = str(path)
    project = find_project_file(os.environ, Path.cwd())
    if project is not None:
        os.environ[CONFIG_ENV] = str(project)


def refusal(exc: Exception) -> tuple[int, str] | None:
    """The exit code and one line for an error the user can act on: a config error, an unknown asset
    or partition, an unreachable store, Ray cluster or instance database, an unreadable one (exit 2), or an
    artifact another writer holds (exit 1: try again later). None for anything else, a bug, whose
    traceback is printed."""
    import sqlite3

    import dagster as dg
    import sqlalchemy.exc
    from dagster_postgres.utils import DagsterPostgresException

    from marin_assets.planning import RequestError
    from marin_resources.ray_address import RayUnavailableError
    from marin_resources.storage.gc import OldLayoutError
    from marin_resources.storage.identity import InvalidPartitionKeyError
    from marin_resources.storage.object_stores import StoreUnavailableError
    from marin_resources.storage.store import ArtifactLockedError
    from marin_resources.typed_config import ConfigError

    if isinstance(exc, ArtifactLockedError):
        return 1, one_line(exc)
    if isinstance(exc, (ConfigError, RequestError, InvalidPartitionKeyError, StoreUnavailableError,
                        RayUnavailableError, OldLayoutError, InstanceHomeError)):
        return 2, one_line(exc)
    if isinstance(exc, (sqlalchemy.exc.DatabaseError, sqlite3.DatabaseError)):
        return 2, instance_database_problem(exc)
    if isinstance(exc, dg.DagsterInvalidConfigError) and "instance config" in str(exc).partition("\n")[0]:
        problems = "; ".join(error.message.split(' Expected: "')[0].rstrip(".") for error in exc.errors)
        return 2, f"{Path(os.environ['DAGSTER_HOME']) / 'dagster.yaml'} is not a valid instance config: {problems}"
    if isinstance(exc, DagsterPostgresException):  # dagster-postgres gave up connecting
        cause = exc.__cause__
        detail = one_line(getattr(cause, 'orig', None) or cause or exc)
        return 2, f"cannot reach the Dagster instance database: {detail}"
    return None


def one_line(exc: Exception) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def instance_database_problem(exc: Exception) -> str:
    """Which of the instance's SQLite files is unreadable (the error does not say), and why."""
    import sqlite3

    cause = one_line(getattr(exc, "orig", None) or exc)
    home = Path(os.environ.get("DAGSTER_HOME") or ".dagster_home")
    damaged = []
    for db in sorted(home.rglob("*.db")):
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
                ok = connection.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        except sqlite3.DatabaseError:
            ok = False
        if not ok:
            damaged.append(str(db))
    if damaged:
        return (f"the Dagster instance database {', '.join(damaged)} is unreadable ({cause}); restore it from a "
                f"backup or move it aside (the runs' history in it is then lost to the instance)")
    return f"the Dagster instance database (DAGSTER_HOME={home}) cannot be used: {cause}"


def run() -> NoReturn:
    """The `marin` command: `main`, then the process ends without tearing its interpreter down
    (`exit_now`). When `main` returns, what the command built is committed and its runs have ended;
    the teardown cost 1.2-1.5 s at the end of a build and 0.35-0.45 s of a command with nothing to
    build, while nothing else ran."""
    from marin_resources.process_exit import exit_now

    exit_now(main())

if __name__ == "__main__":
    run()
