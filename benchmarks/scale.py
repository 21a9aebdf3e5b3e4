"""Scale: MB/s per stage, peak RSS, one new shard, dedup quality, many small files (issue #12).

    python -m benchmarks.scale [--sizes 50 200 800] [--workdir DIR] [--source-name scale]
                               [--shard-mb 25] [--skip-debian] [--code OTHER_CHECKOUT]
    python -m benchmarks.scale --max-parallel 1 2 [--sizes 160 800] [--shard-mb 20] [--repeats 3] [--ray off]

The second form is the fan-out benchmark (issue #28): per size, the first build through
`tokenized/<source>` with 1 and with 2 workers (cores; see `run_workers`), the speedup, the serial
share it implies (Amdahl), the core-seconds left idle by step, and whether every artifact came out
the same. The rest of this text is the first form.

Per size (MB of JSONL), on a fresh store, instance and sources file, a seeded corpus of
real paragraphs (`benchmarks/scale_corpus.py`: 1-5 KB documents, 25 MB shards, 3% planted
near-duplicates at word-5-shingle Jaccard >= 0.85) goes through `marin materialize
tokenized/<source> --json`, a subprocess as a user runs it. Reported:

- MB/s of each stage: corpus MB over the summed seconds of that stage's steps (STEP_START
  to STEP_SUCCESS in the instance's event log; per core while a step uses one), and MB/s of
  the whole command over wall time; CPU seconds of the whole process tree; load average.
- MB per CPU-second of each stage's artifact builds (`marin/build_cpu_seconds` of its
  materializations): the cost per core, apart from what the processes sharing the cores took.
- peak RSS of the whole process tree (the CLI and every run it starts), sampled every 0.2 s.
- one more shard lands; the same command again: which steps ran, their seconds, against
  one shard's share of the first build.
- planted-duplicate recall (a planted copy or its original is gone after dedup) and the
  number of unplanted documents dedup dropped, read from the committed store manifests
  (`filtered/<source>` documents vs `deduplicated/<source>` `data/` files).
Then the ~800 Debian `/usr/share/doc/*/copyright` files through `deduplicated/`, wall time.

Only the CLI and the store's manifests are used, so it runs against whichever dedup, token
cache and shard layout main has. `tokenized/<source>` needs a registry entry: the benchmark
writes one and points `MARIN_REGISTRY` at it; a checkout that does not read `MARIN_REGISTRY`
yet can run with `--source-name shakespeare`, which the bundled registry tokenizes.

Figures are printed next to the issue's goals; the last line is JSON.
"""

from __future__ import annotations

import os
import sys

# Scripts in benchmarks/ (e.g. tokenize.py) would shadow stdlib modules of the same name.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import polars as pl  # noqa: E402
import psutil  # noqa: E402

from benchmarks.scale_corpus import CorpusWriter  # noqa: E402
from marin_resources.display import parse_duration  # noqa: E402
from marin_resources.storage.store import MANIFEST_NAME, Manifest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CODE_DIR = REPO  # --code: another checkout's graph, for before/after comparisons
PER_SHARD_STAGES = ("raw", "documents", "filtered")
# Every stage with a run per shard in the fan-out build: no serial part, so two workers against one on
# these is what the machine gives this very workload (`shard_stage_ceiling`).
SHARD_RUN_STAGES = ("raw", "documents", "filtered", "decontaminated", "token_shards")
GOALS = {
    "per_shard_mb_per_s_per_core": 8.0,
    "mb_per_s_800_vs_50_within": 0.20,
    "peak_rss_800_over_50_at_most": 1.3,
    "new_shard_over_one_shard_at_most": 1.5,
    "planted_recall_at_least": 0.95,
    "unplanted_dropped": 0,
    "debian_dedup_s_at_most": 120.0,
}


@dataclass
class Command:
    """One `marin materialize` subprocess: its JSON summary and what it cost."""

    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    steps: list[dict]
    stderr_tail: str
    started_at: float = 0.0  # epoch seconds, to place the runs' step events in the command's time
    busy: list[tuple[float, float, float]] = field(default_factory=list)  # CPU seconds used per sampled slice
    ran: list[dict] = field(init=False)

    def __post_init__(self) -> None:
        self.ran = [s for s in self.steps if s["ran"]]

    @property
    def runs(self) -> dict[str, float]:
        """Seconds of each Dagster run the command started: steps that shared a run (a global step
        that joined a shard's run) count once."""
        return {s["run_id"]: s["seconds"] for s in self.ran}

    def run_events(self, dagster_home: str, of_type):
        """Each run's events of these types from the instance, one run's list at a time."""
        import dagster as dg

        os.environ["DAGSTER_HOME"] = dagster_home  # the instance's dagster.yaml reads it
        instance = dg.DagsterInstance.from_config(dagster_home)
        for run_id in sorted({s["run_id"] for s in self.ran if s.get("run_id")}):
            yield instance.all_logs(run_id, of_type=of_type)

    def step_intervals(self, dagster_home: str) -> list[tuple[str, float, float]]:
        """(stage, start, end) of every step that succeeded, in seconds since the command started."""
        import dagster as dg

        out = []
        for events in self.run_events(dagster_home, {dg.DagsterEventType.STEP_START, dg.DagsterEventType.STEP_SUCCESS}):
            started: dict[str, float] = {}
            for event in events:
                if event.dagster_event.event_type == dg.DagsterEventType.STEP_START:
                    started[event.step_key] = event.timestamp
                elif event.step_key in started:
                    out.append((event.step_key.split("__")[0], started.pop(event.step_key) - self.started_at,
                                event.timestamp - self.started_at))
        return out

    def stage_seconds(self, dagster_home: str) -> dict[str, float]:
        """Seconds per stage (asset key's first segment), from each run's STEP_START/STEP_SUCCESS events."""
        out: dict[str, float] = defaultdict(float)
        for stage, start, end in self.step_intervals(dagster_home):
            out[stage] += end - start
        return dict(out)

    def stage_build_cpu_seconds(self, dagster_home: str) -> dict[str, float]:
        """CPU seconds per stage of the artifact builds themselves (`marin/build_cpu_seconds` of each
        materialization): what the work costs in cores, whatever else shared them meanwhile."""
        import dagster as dg

        out: dict[str, float] = defaultdict(float)
        for events in self.run_events(dagster_home, {dg.DagsterEventType.ASSET_MATERIALIZATION}):
            for event in events:
                materialization = event.dagster_event.step_materialization_data.materialization
                value = materialization.metadata.get("marin/build_cpu_seconds")
                if value is not None:
                    out[materialization.asset_key.path[0]] += parse_duration(value.value)
        return dict(out)

    def rebuilt(self) -> list[str]:
        return sorted(f"{key}[{s['partition']}]" if s["partition"] else key
                      for s in self.ran for key in s["asset_keys"])


def tree_sample(proc: psutil.Process, sessions: set[int] = frozenset()) -> tuple[int, dict[int, float]]:
    """(RSS bytes of the process tree and of the processes of `sessions`, CPU seconds so far of each
    live member by pid)."""
    total, cpu = 0, {}
    members = {proc.pid: proc, **{p.pid: p for p in proc.children(recursive=True)}}
    if sessions:
        members |= {p.pid: p for p in psutil.process_iter() if _session_of(p) in sessions}
    for member in members.values():
        try:
            with member.oneshot():
                total += member.memory_info().rss
                times = member.cpu_times()
                cpu[member.pid] = times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total, cpu


def materialize(env: dict[str, str], selection: str, *extra: str, cores: set[int] | None = None,
                sessions: set[int] = frozenset()) -> Command:
    """`marin materialize SELECTION --json [EXTRA]` in a subprocess, sampling the tree's RSS and CPU
    (and those of the processes of `sessions`: a Ray cluster the command uses); with `cores`, the
    command and everything it starts (run workers, Ray) may use only those cores."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started, started_at = time.monotonic(), time.time()
    # `python -m` puts its working directory first on sys.path: the CLI runs the code of CODE_DIR.
    proc = subprocess.Popen([sys.executable, "-m", "marin_assets.cli", "materialize", selection, "--json", *extra],
                            env=env, cwd=CODE_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    peak = 0
    busy: list[tuple[float, float, float]] = []  # (from, to, CPU seconds the tree used in between)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        watched = psutil.Process(proc.pid)
        last_t, last_cpu = 0.0, {}
        while not done.is_set():
            try:
                rss, cpu = tree_sample(watched, sessions)
            except psutil.NoSuchProcess:
                return
            now = time.monotonic() - started
            peak = max(peak, rss)
            # A process that ended between samples takes its last slice with it: a small undercount.
            busy.append((last_t, now, sum(max(0.0, used - last_cpu.get(pid, 0.0)) for pid, used in cpu.items())))
            last_t, last_cpu = now, cpu
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    done.set()
    sampler.join()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"marin materialize {selection} failed (rc {proc.returncode}):\n{stderr[-4000:]}")
    summary = json.loads(stdout)
    return Command(round(wall, 2), round(cpu, 2), round(peak / 2**20, 1), summary["steps"], stderr[-2000:], started_at,
                   busy)


def environment(root: Path, source_name: str, corpus: Path) -> dict[str, str]:
    """A fresh store, instance, sources file and token registry under ``root``."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    sources = root / "sources.yaml"
    # The corpus is already cut into 25 MB shards (the unit): one partition per JSONL file,
    # so "one new shard" is one new partition and each step's memory is one shard's, whatever the size.
    sources.write_text(f"sources:\n  - name: {source_name}\n    uri: {corpus}/*.jsonl\n    format: jsonl\n"
                       "    id_field: id\n    files_per_shard: 1\n")
    registry = root / "registry.yaml"
    registry.write_text(f"tokenizers:\n  {source_name}:\n    train_on: [{source_name}]\n    vocab_size: 4096\n"
                        f"    min_frequency: 2\ntokenized:\n  {source_name}:\n    tokenizer: {source_name}\n"
                        "    validation_fraction: 0.1\nmixtures: {}\n")
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_REGISTRY": str(registry),
            "MARIN_PREFIX": str(root / "store"), "DAGSTER_HOME": str(root / "home"), "MARIN_ENV": "local"}


def committed_manifests(prefix: Path, asset_key: str) -> list[Manifest]:
    out = []
    for path in sorted((prefix / asset_key).rglob(MANIFEST_NAME)):
        out.append(Manifest.from_json(path.read_text(), uri=str(path.parent)))
    return out


def source_ids(prefix: Path, asset_key: str, wanted) -> set[str]:
    """`source_id`s in the parquet files of ``asset_key``'s committed artifacts whose path ``wanted`` accepts."""
    ids: set[str] = set()
    for manifest in committed_manifests(prefix, asset_key):
        for entry in manifest.files:
            if entry.path.endswith(".parquet") and wanted(entry.path):
                frame = pl.read_parquet(Path(manifest.uri) / entry.path, columns=["source_id"])
                ids.update(frame["source_id"].to_list())
    return ids


def dedup_quality(prefix: Path, source: str, planted: list[dict]) -> dict:
    """Planted-pair recall and unplanted drops: filtered's survivors against deduplicated's."""
    filtered = source_ids(prefix, f"filtered/{source}", lambda p: p == "documents.parquet")
    kept = source_ids(prefix, f"deduplicated/{source}", lambda p: p.startswith("data/"))
    dropped = filtered - kept
    in_pairs = {p["id"] for p in planted} | {p["original"] for p in planted}
    # A pair counts when both members passed the filters; it is found when one of them is gone.
    eligible = [p for p in planted if p["id"] in filtered and p["original"] in filtered]
    found = sum(p["id"] in dropped or p["original"] in dropped for p in eligible)
    return {"planted_pairs": len(eligible), "planted_found": found,
            "planted_recall": round(found / len(eligible), 4) if eligible else None,
            "unplanted_dropped": len(dropped - in_pairs), "dedup_dropped": len(dropped),
            "min_planted_jaccard": min((p["jaccard"] for p in planted), default=None)}


def run_size(megabytes: int, workdir: Path, source: str, shard_mb: float) -> dict:
    root = workdir / f"{megabytes}mb"
    corpus = root / "corpus"
    env = environment(root, source, corpus)
    writer = CorpusWriter(corpus, seed=megabytes, shard_bytes=int(shard_mb * 1e6))
    shards = max(1, round(megabytes / shard_mb))
    for _ in range(shards):
        writer.write_shard()
    corpus_mb = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6
    target = f"tokenized/{source}"
    load_before = os.getloadavg()
    first = materialize(env, target)
    quality = dedup_quality(Path(env["MARIN_PREFIX"]), source, writer.planted)

    writer.write_shard()
    new_mb = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6 - corpus_mb
    added = materialize(env, target)
    load_after = os.getloadavg()
    after_quality = dedup_quality(Path(env["MARIN_PREFIX"]), source, writer.planted)

    home = env["DAGSTER_HOME"]
    seconds, added_seconds = first.stage_seconds(home), added.stage_seconds(home)
    per_shard_s = sum(seconds.get(s, 0.0) for s in PER_SHARD_STAGES)
    cpu_seconds = first.stage_build_cpu_seconds(home)
    per_shard_cpu_s = sum(cpu_seconds.get(s, 0.0) for s in PER_SHARD_STAGES)
    in_run_s = sum(first.runs.values())
    one_shard_s = in_run_s / shards
    one_shard_runs = len(first.runs) / shards
    added_in_run_s = sum(added.runs.values())
    return {
        "megabytes": round(corpus_mb, 1), "shards": shards, "documents_planted": len(writer.planted),
        "wall_s": first.wall_s, "cpu_s": first.cpu_s, "runs": len(first.runs), "in_run_s": round(in_run_s, 1),
        "mb_per_s_wall": round(corpus_mb / first.wall_s, 2),
        "stage_mb_per_s": {stage: round(corpus_mb / s, 2) for stage, s in sorted(seconds.items()) if s > 0},
        "per_shard_stages_mb_per_s": round(corpus_mb / per_shard_s, 2) if per_shard_s else None,
        "stage_mb_per_cpu_s": {stage: round(corpus_mb / s, 2) for stage, s in sorted(cpu_seconds.items()) if s > 0},
        "per_shard_stages_mb_per_cpu_s": round(corpus_mb / per_shard_cpu_s, 2) if per_shard_cpu_s else None,
        "peak_rss_mb": first.peak_rss_mb,
        "stage_seconds": {k: round(v, 1) for k, v in sorted(seconds.items())},
        "new_shard": {"megabytes": round(new_mb, 1), "runs": len(added.runs), "rebuilt": added.rebuilt(),
                      "in_run_s": round(added_in_run_s, 1), "wall_s": added.wall_s, "cpu_s": added.cpu_s,
                      "peak_rss_mb": added.peak_rss_mb,
                      "one_shard_runs": round(one_shard_runs, 2), "one_shard_in_run_s": round(one_shard_s, 1),
                      "seconds_over_one_shard": round(added_in_run_s / one_shard_s, 2) if one_shard_s else None,
                      "runs_over_one_shard": round(len(added.runs) / one_shard_runs, 2) if one_shard_runs else None,
                      "stage_seconds": {k: round(v, 1) for k, v in sorted(added_seconds.items())}},
        "dedup": quality, "dedup_after_new_shard": after_quality,
        "load_average_1m": [round(load_before[0], 2), round(load_after[0], 2)],
    }


def idle_core_seconds_by_stage(command: Command, intervals: list[tuple[str, float, float]],
                               workers: int) -> dict[str, float]:
    """Core-seconds the `workers` cores were left idle, by what ran meanwhile: the stages whose
    steps were running (joined with "+"), or "outside steps" (the CLI, the code server, launching
    runs). At two workers this is the serial share, step by step."""
    out: dict[str, float] = defaultdict(float)
    for start, end, used in command.busy:
        middle = (start + end) / 2
        active = sorted({stage for stage, a, b in intervals if a <= middle < b})
        out["+".join(active) or "outside steps"] += max(0.0, workers * (end - start) - used)
    return {stage: round(seconds, 1) for stage, seconds in sorted(out.items(), key=lambda kv: -kv[1])
            if seconds >= 0.5}


def data_versions(prefix: Path) -> dict[str, str]:
    """Data version of every committed artifact under a store prefix, by its path in the store."""
    return {str(path.parent.relative_to(prefix)): Manifest.from_json(path.read_text()).data_version
            for path in sorted(prefix.rglob(MANIFEST_NAME))}


# `ray start` through Ray's own CLI, except that 127.0.0.1 stays 127.0.0.1 (Ray would put the machine's
# outward address in its place): the benchmark's cluster and its traffic stay on loopback.
RAY_CLI_ON_LOOPBACK = ("import sys, ray._private.services as services; services.resolve_ip_for_localhost = "
                       "lambda host: host; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()")
# The driver's side of the same, and no token authentication (a local `ray.init` elsewhere may have
# left ~/.ray/auth_token, which would turn it on).
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                    "RAY_USAGE_STATS_ENABLED": "0"}


class RayHead:
    """A one-node Ray cluster of `cpus` CPUs on 127.0.0.1, confined to `cores`, for the length of a
    `with`: what a team that runs on Ray already has when it starts a build."""

    def __init__(self, cpus: int, cores: set[int], temp_dir: Path):
        self.cpus, self.cores, self.temp_dir = cpus, cores, temp_dir

    def __enter__(self) -> RayHead:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **RAY_LOOPBACK_ENV}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RAY_CLI_ON_LOOPBACK, "start", "--head", "--node-ip-address=127.0.0.1",
             f"--port={port}", f"--num-cpus={self.cpus}", "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={self.temp_dir}"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, self.cores))
        out, _ = self.proc.communicate(timeout=180)
        if self.proc.returncode != 0:
            self.__exit__()
            raise SystemExit(f"ray start failed:\n{out[-3000:]}")
        self.address, self.session = f"127.0.0.1:{port}", self.proc.pid
        return self

    def __exit__(self, *exc) -> None:
        # The node's services run in the session `ray start` began; workers in groups of their own
        # are children of its raylet.
        group = self.proc.pid
        members = {p.pid for p in psutil.process_iter() if _session_of(p) == group}
        for pid in list(members):
            try:
                members |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
        for pid in members:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _session_of(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None


def run_workers(megabytes: int, workdir: Path, source: str, shard_mb: float, settings: list[int],
                repeats: int = 1, ray: str = "cluster") -> dict:
    """The whole first build through tokenized/ on a fresh store with N workers for each N of
    `settings`: the command and all it starts confined to N cores, at most N runs at once
    (`--max-parallel N`), and a step's own units of work (shards to encode, bucket-range passes,
    assembly's shard files, chunks) spread over a running Ray cluster of N CPUs on those cores
    (`MARIN_RAY=cluster`, started before the command as a team on Ray has it running); one worker
    runs them in its own process, as a machine without Ray does (`MARIN_RAY=off`). With ``ray="off"``
    every setting runs that way: N workers are then N runs at once and nothing else, the default
    (`MARIN_RAY` unset) of a user's `marin materialize --max-parallel N`. The same seeded
    corpus and the same store path every time, so that every artifact's data version can be
    compared across settings (a token cache's ledger names its files by their path).

    With `repeats` > 1 the settings take turns, in alternating order (1, 2, then 2, 1, ...), so that
    a VM whose speed drifts over the minutes weighs on both alike; a setting's figures are those of
    its run of median wall time, the speedup is the ratio of the median walls, and each round's own
    ratio is listed beside it."""
    available = sorted(os.sched_getaffinity(0))
    corpus = workdir / f"{megabytes}mb-corpus"
    if not corpus.exists():
        writer = CorpusWriter(corpus, seed=megabytes, shard_bytes=int(shard_mb * 1e6))
        for _ in range(max(1, round(megabytes / shard_mb))):
            writer.write_shard()
    corpus_mb = sum(p.stat().st_size for p in corpus.glob("*.jsonl")) / 1e6
    for workers in settings:
        if workers > len(available):
            raise SystemExit(f"--max-parallel {workers}: this machine has {len(available)} cores")
    runs: dict[int, list[dict]] = defaultdict(list)
    for round_number in range(repeats):
        for workers in settings if round_number % 2 == 0 else settings[::-1]:
            runs[workers].append(build_with_workers(megabytes, workdir, source, corpus, workers, available, ray))
    results = {}
    for workers, each in runs.items():
        results[workers] = sorted(each, key=lambda r: r["wall_s"])[(len(each) - 1) // 2]  # median (lower)
        results[workers]["wall_s_each_round"] = [r["wall_s"] for r in each]
    out = {"megabytes": round(corpus_mb, 1), "ray_at_more_workers": ray, "by_workers": results}
    if 1 in results and 2 in results:
        speedup = results[1]["wall_s"] / results[2]["wall_s"]
        # Amdahl at 2 workers: T2 = T1 * (s + (1 - s) / 2), so the serial share s = 2 T2 / T1 - 1.
        out |= {"speedup_2_over_1": round(speedup, 3), "serial_share": round(2 / speedup - 1, 3),
                "speedup_each_round": [round(one["wall_s"] / two["wall_s"], 3) for one, two in zip(runs[1], runs[2])],
                "same_artifacts": all(r["data_versions"] == runs[1][0]["data_versions"]
                                      for each in runs.values() for r in each)}
    return out


def build_with_workers(megabytes: int, workdir: Path, source: str, corpus: Path, workers: int,
                       available: list[int], ray: str = "cluster") -> dict:
    """One first build with `workers` workers (see `run_workers`, and ``ray`` there): its figures."""
    env = environment(workdir / f"{megabytes}mb-build", source, corpus)
    cores = set(available[:workers])
    with contextlib.ExitStack() as stack:
        sessions = set()
        if workers > 1 and ray == "cluster":
            head = stack.enter_context(RayHead(workers, cores, Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))))
            # The cluster's CPUs named, as a team would: a step's units are balanced over them.
            env |= {"MARIN_RAY": "cluster", "RAY_ADDRESS": head.address, "MARIN_RAY_CPUS": str(workers),
                    **RAY_LOOPBACK_ENV}
            sessions.add(head.session)
        else:
            env |= {"MARIN_RAY": "off"}
        load = os.getloadavg()[0]
        command = materialize(env, f"tokenized/{source}", "--max-parallel", str(workers), cores=cores,
                              sessions=sessions)
    intervals = command.step_intervals(env["DAGSTER_HOME"])
    result = {"wall_s": command.wall_s, "cpu_s": command.cpu_s, "runs": len(command.runs),
              "peak_rss_mb": command.peak_rss_mb, "load_average_1m": round(load, 2),
              "stage_seconds": {k: round(v, 1) for k, v in command.stage_seconds(env["DAGSTER_HOME"]).items()},
              "idle_core_seconds": idle_core_seconds_by_stage(command, intervals, workers),
              "data_versions": data_versions(Path(env["MARIN_PREFIX"]))}
    print(json.dumps({"megabytes": megabytes, "workers": workers,
                      **{k: v for k, v in result.items() if k != "data_versions"}}), flush=True)
    return result


def _hash_loop(rounds: int) -> float:
    """Seconds for a CPU-bound loop that stays in cache (no memory traffic, no I/O)."""
    import hashlib

    started, digest = time.perf_counter(), b"x" * 64
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return time.perf_counter() - started


def machine_ceiling(workers: int = 2, rounds: int = 1_500_000, repeats: int = 5) -> list[float]:
    """How much faster ``workers`` processes get through the same CPU-bound loop than one alone,
    each pinned to its own core: the most any build can gain from ``workers`` of this machine's cores.
    Two cores that are hyperthreads of one physical core, or share a throttled budget, give much
    less than ``workers``; a VM may not say which (``lscpu`` here reports one thread per core), and a
    VM whose neighbours take its host's cycles gives a ratio that moves from minute to minute. One
    ratio per repeat."""
    import multiprocessing

    cores = sorted(os.sched_getaffinity(0))[:workers]
    ratios = []
    for _ in range(repeats):
        alone = _hash_loop(rounds)
        # One process per core, all started before any is joined: a pool could hand both loops to one worker.
        results = multiprocessing.SimpleQueue()
        loops = [multiprocessing.Process(target=_hash_loop_on, args=(core, rounds, results)) for core in cores]
        for loop in loops:
            loop.start()
        for loop in loops:
            loop.join()
        ratios.append(round(len(loops) * alone / max(results.get() for _ in loops), 3))
    return ratios


def _hash_loop_on(core: int, rounds: int, results) -> None:
    os.sched_setaffinity(0, {core})
    results.put(_hash_loop(rounds))


def report_workers(results: list[dict], ceiling: float) -> dict:
    print(f"\nmachine: {os.cpu_count()} cores; load average {os.getloadavg()}; two processes of a CPU-bound loop "
          f"get through x{ceiling} the work of one (median of the probes: the most 2 workers can give here)")
    print(f"{'MB':>6} {'workers':>7} {'wall s':>7} {'runs':>5} {'load':>5}  step seconds by stage")
    for r in results:
        for workers, w in sorted(r["by_workers"].items()):
            print(f"{r['megabytes']:>6} {workers:>7} {w['wall_s']:>7} {w['runs']:>5} {w['load_average_1m']:>5}  "
                  f"{w['stage_seconds']}")
            print(f"{'':>14} idle core-seconds, by what ran then: {w['idle_core_seconds']}")
        if "speedup_2_over_1" in r:
            r["serial_share_at_machine_ceiling"] = serial_share_against(r["speedup_2_over_1"], ceiling)
            shard_ceiling = shard_stage_ceiling(r["by_workers"])
            r["shard_stage_ceiling"] = shard_ceiling
            r["serial_share_at_shard_stage_ceiling"] = serial_share_against(r["speedup_2_over_1"], shard_ceiling)
            if len(r["speedup_each_round"]) > 1:
                walls = "; ".join(f"{w} worker(s) {v['wall_s_each_round']}" for w, v in sorted(r["by_workers"].items()))
                print(f"  {r['megabytes']} MB: each round's speedup {r['speedup_each_round']}; wall s, {walls}")
            print(f"  {r['megabytes']} MB, 2 workers with MARIN_RAY={r['ray_at_more_workers']}: speedup 2 over 1 "
                  f"worker x{r['speedup_2_over_1']} (goal >= 1.7; "
                  f"{r['speedup_2_over_1'] / ceiling:.0%} of this machine's x{ceiling}), serial share "
                  f"{r['serial_share']:.1%} (goal <= 15%; {r['serial_share_at_machine_ceiling']:.1%} against the "
                  f"machine's ceiling), every artifact's data version the same at both: {r['same_artifacts']}")
            if shard_ceiling is not None:
                print(f"  {r['megabytes']} MB: the per-shard stages alone, no serial part, got x{shard_ceiling} from "
                      f"2 workers ({', '.join(SHARD_RUN_STAGES)}); against that, the build's serial share is "
                      f"{r['serial_share_at_shard_stage_ceiling']:.1%}")
    return {str(r["megabytes"]): {k: r.get(k) for k in ("ray_at_more_workers", "speedup_2_over_1",
                                                        "speedup_each_round", "serial_share",
                                                        "serial_share_at_machine_ceiling", "shard_stage_ceiling",
                                                        "serial_share_at_shard_stage_ceiling", "same_artifacts")}
            for r in results}


def serial_share_against(speedup: float, ceiling: float | None) -> float | None:
    """Amdahl with the machine's own parallel capacity c: T2 = T1 * (s + (1 - s) / c)."""
    return round((1 / speedup - 1 / ceiling) / (1 - 1 / ceiling), 3) if ceiling and ceiling > 1 else None


def shard_stage_ceiling(by_workers: dict) -> float | None:
    """Two workers against one on the stages that run a partition per shard (`SHARD_RUN_STAGES`): their
    step-seconds at one worker over half of theirs at two. Each step runs alone in its run, so this is
    how much slower two at once run here, on this very work (memory-bound, unlike the CPU probe)."""
    one, two = (sum(by_workers[w]["stage_seconds"].get(stage, 0.0) for stage in SHARD_RUN_STAGES)
                for w in (1, 2))
    return round(2 * one / two, 3) if one and two else None


def debian_copyright(workdir: Path) -> dict:
    root = workdir / "debian"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    files = sorted(Path("/usr/share/doc").glob("*/copyright"))
    sources = root / "sources.yaml"
    # This scenario measures many small files through dedup, not filtering. Licence texts fail
    # the prose rules (repeated lines, language), and a one-file shard whose only document is
    # dropped fails filtered's drop-fraction ERROR check, which fails the command.
    sources.write_text("sources:\n  - name: debian\n    uri: /usr/share/doc/*/copyright\n    format: text\n"
                       "    filters: {languages: [], min_words: null, max_mean_word_length: null,\n"
                       "              max_non_alpha_word_fraction: null, max_duplicate_line_fraction: null,\n"
                       "              max_duplicate_paragraph_fraction: null}\n")
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(root / "store"),
           "DAGSTER_HOME": str(root / "home"), "MARIN_ENV": "local"}
    load = os.getloadavg()[0]
    command = materialize(env, "deduplicated/debian")
    return {"files": len(files), "megabytes": round(sum(f.stat().st_size for f in files) / 1e6, 1),
            "wall_s": command.wall_s, "runs": len(command.runs), "cpu_s": command.cpu_s,
            "peak_rss_mb": command.peak_rss_mb, "load_average_1m": round(load, 2)}


def report(results: list[dict], debian: dict | None) -> dict:
    print(f"\nmachine: {os.cpu_count()} cores; load average {os.getloadavg()}")
    head = f"{'MB':>6} {'shards':>6} {'wall s':>7} {'CPU s':>7} {'MB/s wall':>9} {'per-shard MB/s':>14} " \
           f"{'peak RSS MB':>11} {'load 1m':>11}"
    print(head)
    for r in results:
        print(f"{r['megabytes']:>6} {r['shards']:>6} {r['wall_s']:>7} {r['cpu_s']:>7} {r['mb_per_s_wall']:>9} "
              f"{r['per_shard_stages_mb_per_s']!s:>14} "
              f"{r['peak_rss_mb']:>11} {str(r['load_average_1m']):>11}")
    for r in results:
        stages = ", ".join(f"{k} {v}" for k, v in r["stage_mb_per_s"].items())
        print(f"  {r['megabytes']} MB, MB/s per step-second by stage: {stages}")
        cpu = ", ".join(f"{k} {v}" for k, v in r["stage_mb_per_cpu_s"].items())
        print(f"  {r['megabytes']} MB, MB per CPU-second of the builds by stage: {cpu}; per-shard stages "
              f"{r['per_shard_stages_mb_per_cpu_s']}")
        n = r["new_shard"]
        print(f"  {r['megabytes']} MB + one {n['megabytes']} MB shard: {n['runs']} runs rebuilding {n['rebuilt']}, "
              f"{n['in_run_s']} s in runs ({n['wall_s']} s wall); one shard's share of the build: "
              f"{n['one_shard_runs']} runs, {n['one_shard_in_run_s']} s -> x{n['seconds_over_one_shard']} seconds, "
              f"x{n['runs_over_one_shard']} runs; by stage {n['stage_seconds']}")
        d, a = r["dedup"], r["dedup_after_new_shard"]
        print(f"  dedup: planted recall {d['planted_recall']} ({d['planted_found']}/{d['planted_pairs']}, min J "
              f"{d['min_planted_jaccard']}), unplanted dropped {d['unplanted_dropped']}; after the new shard: "
              f"recall {a['planted_recall']}, unplanted dropped {a['unplanted_dropped']}")
    first, last = results[0], results[-1]
    checks = {
        "per_shard_mb_per_s_per_core": min((r["per_shard_stages_mb_per_s"] or 0) for r in results),
        "per_shard_mb_per_cpu_s": min((r["per_shard_stages_mb_per_cpu_s"] or 0) for r in results),
        "mb_per_s_largest_vs_smallest": round(last["mb_per_s_wall"] / first["mb_per_s_wall"], 3),
        "per_shard_mb_per_s_largest_vs_smallest": round((last["per_shard_stages_mb_per_s"] or 0)
                                                        / (first["per_shard_stages_mb_per_s"] or 1), 3),
        "peak_rss_largest_over_smallest": round(last["peak_rss_mb"] / first["peak_rss_mb"], 3),
        "new_shard_seconds_over_one_shard": max((r["new_shard"]["seconds_over_one_shard"] or 0) for r in results),
        "new_shard_runs_over_one_shard": max((r["new_shard"]["runs_over_one_shard"] or 0) for r in results),
        "planted_recall": min((r["dedup_after_new_shard"]["planted_recall"] or 0) for r in results),
        "unplanted_dropped": max(r["dedup_after_new_shard"]["unplanted_dropped"] for r in results),
        "debian_dedup_s": debian["wall_s"] if debian else None,
    }
    print("\nfigure                              measured   goal")
    print(f"per-shard stages MB/s per step-s    {checks['per_shard_mb_per_s_per_core']:>8}   >= 8 per core")
    print(f"  MB per CPU-s of their builds      {checks['per_shard_mb_per_cpu_s']:>8}   >= 8 per core")
    # The goal is that a bigger corpus is not slower: at least 0.8 of the smallest size's rate.
    print(f"MB/s wall, largest / smallest size  {checks['mb_per_s_largest_vs_smallest']:>8}   >= 0.8 "
          f"(sizes {first['megabytes']} -> {last['megabytes']} MB)")
    print(f"  per-shard stages, the same ratio  {checks['per_shard_mb_per_s_largest_vs_smallest']:>8}   >= 0.8")
    print(f"peak RSS, largest / smallest size   {checks['peak_rss_largest_over_smallest']:>8}   <= 1.3")
    print(f"new shard / one shard, seconds      {checks['new_shard_seconds_over_one_shard']:>8}   <= 1.5")
    print(f"new shard / one shard, runs         {checks['new_shard_runs_over_one_shard']:>8}   <= 1.5")
    print(f"planted-duplicate recall            {checks['planted_recall']:>8}   >= 0.95")
    print(f"unplanted documents dropped         {checks['unplanted_dropped']:>8}   0")
    return checks


# The measurement: the Debian copyright files, one file per shard, through deduplicated/.
DEBIAN_BASELINE = {"files": 831, "runs": 832, "wall_s": 743.0}


def report_debian(debian: dict) -> None:
    print(f"Debian copyright ({debian['files']} files) -> deduplicated/: {debian['wall_s']} s wall, {debian['runs']} "
          f"runs, {debian['cpu_s']} CPU-s, peak RSS {debian['peak_rss_mb']} MB, "
          f"load average {debian['load_average_1m']}"
          f"   goal <= 120 s; the issue's baseline: {DEBIAN_BASELINE['wall_s']:.0f} s, {DEBIAN_BASELINE['runs']} runs")


def compile_checkout(code_dir: Path) -> None:
    """Byte-compile the checkout's own packages, as the image does (deploy/Dockerfile installs the project
    non-editable with UV_COMPILE_BYTECODE=1). An editable checkout under PYTHONDONTWRITEBYTECODE would
    otherwise compile every marin module again in each run worker (about 0.5 CPU-s per run, taken
    from the steps of the run beside it on a 2-core machine)."""
    import compileall

    for package in ("marin_assets", "marin_resources", "scaling"):
        if (code_dir / package).is_dir():
            compileall.compile_dir(code_dir / package, quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[50, 200, 800], help="corpus sizes in MB")
    parser.add_argument("--workdir", type=Path, default=REPO / "benchmarks" / "out" / "scale")
    parser.add_argument("--source-name", default="scale")
    parser.add_argument("--shard-mb", type=float, default=25.0, help="JSONL shard size (the issue's is 25)")
    parser.add_argument("--skip-debian", action="store_true")
    parser.add_argument("--max-parallel", type=int, nargs="+", metavar="N",
                        help="instead of the per-stage figures: the first build at each number of workers (cores), "
                             "its speedup and serial share, e.g. --max-parallel 1 2")
    parser.add_argument("--ray", choices=["cluster", "off"], default="cluster",
                        help="with --max-parallel: more than one worker also has a running Ray cluster of as many "
                             "CPUs for the steps' units (cluster), or is only that many runs at once (off, "
                             "MARIN_RAY's default); one worker is always off")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="with --max-parallel: R rounds of every setting, in alternating order; medians reported")
    parser.add_argument("--code", type=Path, default=REPO,
                        help="checkout whose marin CLI and graph to run (e.g. a worktree of an older commit)")
    args = parser.parse_args()
    global CODE_DIR
    CODE_DIR = args.code.resolve()
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and \
            not any((REPO / ".venv").glob("lib/python*/site-packages/dagster/__pycache__")):
        print("warning: PYTHONDONTWRITEBYTECODE is set and the venv has no bytecode, so every marin process compiles "
              "~3,000 modules (seconds of CPU per run); the image compiles it (UV_COMPILE_BYTECODE=1). "
              "`python -m compileall -q .venv/lib` first for comparable figures.", flush=True)
    compile_checkout(CODE_DIR)
    if args.max_parallel:
        # Probed before the builds and after them: on a shared VM the ratio moves with the neighbours' load.
        probes = machine_ceiling()
        scaling = [run_workers(size, args.workdir, args.source_name, args.shard_mb, args.max_parallel, args.repeats,
                               args.ray) for size in args.sizes]
        probes += machine_ceiling()
        ceiling = round(statistics.median(probes), 3)
        print(f"two processes against one, CPU-bound loop, {len(probes)} probes: {sorted(probes)}")
        figures = report_workers(scaling, ceiling)
        print(json.dumps({"benchmark": "scale-workers", "goals": {"speedup_2_over_1_at_least": 1.7,
                                                                   "serial_share_at_most": 0.15},
                          "figures": figures, "machine_ceiling_2_over_1": ceiling, "ceiling_probes": probes,
                          "sizes": scaling, "cores": os.cpu_count()}))
        return
    results = []
    for size in args.sizes:
        print(f"--- {size} MB", flush=True)
        results.append(run_size(size, args.workdir, args.source_name, args.shard_mb))
        print(json.dumps(results[-1]), flush=True)
    debian = None if args.skip_debian else debian_copyright(args.workdir)
    checks = report(results, debian) if results else {"debian_dedup_s": debian["wall_s"] if debian else None}
    if debian:
        report_debian(debian)
    print(json.dumps({"benchmark": "scale", "goals": GOALS, "figures": checks, "sizes": results, "debian": debian,
                      "debian_baseline": DEBIAN_BASELINE, "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
