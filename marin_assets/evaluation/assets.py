"""Evaluation beyond loss:

    tokenized/<source>  -->  eval_task/<task>  --+
    checkpoint[run]  ----------------------------+-->  harness_eval[run]
    sweep_checkpoint/<sweep>[run]  --------------+-->  sweep_harness_eval/<sweep>[run]

``eval_task/<task>`` is an offline multiple-choice task built from a source's held-out documents
(``next_line``), stored as an lm-eval task YAML and its JSON-lines data. ``harness_eval[run]`` runs
the deployment's eval suite (``suites.yaml``) on the run's final checkpoint through Levanter's eval
harness, launched exactly like ``eval``: the ``launcher`` resource (Pipes locally, Kubernetes pods
in production). lm-eval's version and every task config's hash are part of its identity.
A sweep that forecasts a harness metric gets the same asset over its own runs,
``sweep_harness_eval/<sweep>``, which its scaling fit and forecast check read.
"""


import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.evaluation.harness_main import ERROR_FILE
from marin_assets.evaluation.next_line import (
    DATA_FILE_SUFFIX,
    TASK_FILE_SUFFIX,
    NextLineTaskSpec,
    build_items,
    render_task_yaml,
    write_items,
)
from marin_assets.evaluation.suites import (
    Suite,
    SuiteError,
    SuiteRegistry,
    chance_levels,
    lm_eval_task_files,
    margin_over_chance,
    render_harness_config,
    suite_identity,
)
from marin_assets.scaling_sweeps.assets import SweepRuns, harness_key, runs_partitions, sweep_run_lookup
from marin_assets.scaling_sweeps.assets import checkpoint_key as sweep_checkpoint_key
from marin_assets.scaling_sweeps.config import plan_sweep
from marin_assets.scaling_sweeps.forecasting import forecast_metric, is_harness_metric
from marin_assets.training.assets import RUNS, SpecLookup, check_pool, find_handle, local_dir, named_run_lookup
from marin_assets.training.commands import HARNESS_REPORT_FILE, harness_command
from marin_assets.training.levanter_config import TRAIN_CONFIG_FILE
from marin_assets.training.spec import RunSpec
from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import (
    ArtifactHandle,
    Built,
    MarinStore,
    asset_partition,
    checked_manifest,
    input_of,
    input_refused,
    marin_check,
    materialize_artifact,
)
from marin_resources.environments import MarinSettings
from marin_resources.keys import asset_key
from marin_resources.launchers import TrainingLauncher

EVAL_TASK_VERSION = "v1"
HARNESS_EVAL_VERSION = "v1"
# RunSuites' name of the refusal a run gets where the built-in default suite does not fit it.
UNFIT_SUITE = "no-fitting-suite:{run}"
HARNESS_CONFIG_FILE = "harness_config.json"
TASKS_DIR = "tasks"
PREVIEW_ITEMS = 3
DISTRACTOR_TEXT = {"same_document": "the others of about its length from the same held-out document",
                   "other_documents": "the others of about its length from other held-out documents",
                   "shuffled_words": "the others its own words in shuffled orders"}


def eval_task_key(name: str) -> str:
    return f"eval_task/{name}"


# ---- eval_task/<name> ----------------------------------------------------------------------------


def held_out_documents(store, tokenized: ArtifactHandle, source: str) -> list[tuple[str, str]]:
    """The documents ``tokenized/<source>`` put in its validation split, read back from the
    deduplicated shards it was built from (so the task is text the model never trained on)."""
    from marin_assets.tokenization.assets import corpus_files
    from marin_assets.tokenization.cache import cache_config_of, iter_split_documents

    manifest = store.read_manifest(tokenized.uri)
    refs = {u.asset_key: u for u in (manifest.upstream if manifest else [])}
    corpus = refs.get(f"deduplicated/{source}")
    if corpus is None:
        raise dg.Failure(f"{tokenized.asset_key} records no deduplicated/{source} input; rebuild it")
    cfg, _ = cache_config_of(tokenized.uri)
    return list(iter_split_documents(list(corpus_files(store, corpus.uri)), cfg, "validation"))


def build_eval_task_asset(spec: NextLineTaskSpec, catalog: Catalog, tokenized: ArtifactSpec):
    """``tokenized``: the spec of the cache whose validation split the task is built from."""
    source_key = tokenized.key
    artifact = ArtifactSpec.fixed(eval_task_key(spec.name), EVAL_TASK_VERSION, spec.identity())

    @catalog.asset(artifact,
                   ins={"tokenized": input_of(tokenized)}, group_name="evaluation",
                   kinds={"lm-eval"},
                   description=f"Offline multiple-choice task `{spec.name}`: the true "
                               f"{'next line' if spec.continuation == 'next_line' else 'end of a line'} of a passage "
                               f"among {spec.choices} choices ({DISTRACTOR_TEXT[spec.distractors]}) from "
                               f"{source_key}'s validation split (never trained on). An lm-eval task YAML "
                               f"(`{spec.name}{TASK_FILE_SUFFIX}`) over JSON lines (`{spec.name}{DATA_FILE_SUFFIX}`); "
                               "deterministic in its config and the held-out text.")
    def eval_task(context: dg.AssetExecutionContext, store: MarinStore, tokenized: ArtifactHandle):
        artifacts = store.get()

        def build(writer) -> Built:
            documents = held_out_documents(artifacts, tokenized, spec.source)
            items = build_items(documents, spec)
            if not items:
                raise dg.Failure(f"offline task {spec.name!r}: the {len(documents)} held-out document(s) of "
                                 f"{source_key} yield no item; lower min_chars or context_lines, or hold out more")
            data_file = f"{spec.name}{DATA_FILE_SUFFIX}"
            with writer.open(data_file) as fh:
                fh.write(write_items(items).encode())
            with writer.open(f"{spec.name}{TASK_FILE_SUFFIX}") as fh:
                # Relative: harness_eval resolves it against the directory it copies the task to.
                fh.write(render_task_yaml(spec, data_file).encode())
            per_doc: dict[str, int] = {}
            for item in items:
                per_doc[item.doc_id] = per_doc.get(item.doc_id, 0) + 1
            return Built(metrics={"items": len(items), "held_out_documents": len(documents),
                                  "documents_used": len(per_doc), "choices": spec.choices, "chance": spec.chance},
                         metadata={"dagster/row_count": len(items),
                                   "preview": dg.MetadataValue.json([i.to_json() for i in items[:PREVIEW_ITEMS]]),
                                   "items_per_document": dg.MetadataValue.json(per_doc)})

        return materialize_artifact(context, store, artifact, upstream=[tokenized], build=build)

    return eval_task


# ---- harness_eval[run] ---------------------------------------------------------------------------


def localize_task(store, task: ArtifactHandle, name: str, task_dir: Path) -> None:
    """Copy an offline task into ``task_dir``, its data files made absolute paths there."""
    task_dir.mkdir(parents=True, exist_ok=True)
    with store.open(f"{task.uri}/{name}{TASK_FILE_SUFFIX}") as fh:
        config = yaml.safe_load(fh.read().decode())
    files = config.get("dataset_kwargs", {}).get("data_files", {})
    for split, rel in files.items():
        target = task_dir / Path(rel).name
        try:
            with store.open(f"{task.uri}/{rel}") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
        except FileNotFoundError:
            raise dg.Failure(f"offline task {name!r}: data file {task.uri}/{rel} is missing; "
                             f"rebuild it: marin materialize {task.asset_key}") from None
        files[split] = str(target)
    (task_dir / f"{name}{TASK_FILE_SUFFIX}").write_text(yaml.safe_dump(config, sort_keys=False))


def check_lm_eval_tasks(registry: SuiteRegistry, suite: Suite) -> None:
    """Refuse a suite naming a task lm-eval does not have, before any process starts."""
    for task in registry.lm_eval_tasks_of(suite):
        try:
            lm_eval_task_files(task.task)
        except SuiteError as exc:
            raise dg.Failure(f"suite {suite.name!r}: {exc}") from None


def harness_metrics(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items()
            if "/" in k and isinstance(v, (int, float)) and not isinstance(v, bool)}


def results_table(report: dict[str, Any], chance: dict[str, float]) -> str:
    """Markdown: one row per task, accuracy ± stderr and chance."""
    tasks = sorted({k.rsplit("/", 1)[0] for k in report if k.endswith("/acc")})
    rows = ["| task | acc | acc_norm | n | chance |", "|---|---|---|---|---|"]
    for task in tasks:
        def cell(metric: str) -> str:
            value, err = report.get(f"{task}/{metric}"), report.get(f"{task}/{metric}_stderr")  # noqa: B023 - called within this iteration
            return "" if value is None else f"{value:.4f} ± {err:.4f}" if err is not None else f"{value:.4f}"
        rows.append(f"| {task} | {cell('acc')} | {cell('acc_norm')} | {report.get(f'{task}/n', '')} | "
                    f"{chance.get(task, '')} |")
    for key in sorted(k for k in report if k.startswith("eval/") and k.endswith("/bpb")):
        rows.append(f"| {key} | {report[key]:.4f} | | | |")
    return "\n".join(rows)


@dataclass(frozen=True)
class HarnessSuite:
    """One eval suite, resolved against the deployment once per load: what a run evaluated with it reads."""

    registry: SuiteRegistry
    suite: Suite
    tasks: tuple[str, ...]
    """The suite's offline tasks built here: ``eval_task/<task>``."""
    heldout: dict[str, str]
    """Each bits-per-byte source tokenized here, and its tokenizer: ``tokenized/<source>``."""
    missing: tuple[str, ...]
    """What the suite needs that this deployment does not build."""
    unfit: str | None = None
    """Why this suite cannot evaluate the run it was given (`Deployment.unfit_suites`): it reads nothing
    then, so asking for that evaluation builds no other source's chain before the step refuses."""

    @classmethod
    def resolve(cls, registry: SuiteRegistry, suite: Suite, tasks: set[str],
                tokenized_sources: dict[str, str]) -> "HarnessSuite":
        offline = {t.task for t in suite.tasks if t.task in registry.offline_tasks}
        missing = sorted({eval_task_key(t) for t in offline - tasks}
                         | {f"tokenized/{s}" for s in suite.bpb if s not in tokenized_sources})
        return cls(registry, suite, tuple(sorted(offline & tasks)),
                   {s: tokenized_sources[s] for s in suite.bpb if s in tokenized_sources}, tuple(missing))

    def identity(self, spec: RunSpec) -> dict[str, Any]:
        return {"run": spec.identity(), **suite_identity(self.registry, self.suite)}

    def reads(self) -> set[str]:
        """The marin keys of the artifacts a run evaluated with this suite reads, besides its checkpoint."""
        if self.unfit is not None:
            return set()
        return {eval_task_key(t) for t in self.tasks} | {f"tokenized/{s}" for s in self.heldout}


@dataclass(frozen=True)
class RunSuites:
    """Which suite each partition of a harness asset runs: ``suite_of(partition)`` names one of ``suites``."""

    suites: Mapping[str, HarnessSuite]
    suite_of: Callable[[str], str]

    @classmethod
    def single(cls, harness: HarnessSuite) -> "RunSuites":
        return cls({harness.suite.name: harness}, lambda _run: harness.suite.name)

    def of(self, partition: str) -> HarnessSuite:
        return self.suites[self.suite_of(partition)]


def build_harness_asset(run_suites: RunSuites, *, key: str, checkpoint: ArtifactSpec,
                        heldout: Mapping[str, ArtifactSpec], partitions: dg.DynamicPartitionsDefinition,
                        spec_for: SpecLookup, pool: str, group_name: str, catalog: Catalog,
                        tags: dict[str, str] | None = None, subject: str = ""):
    """Each run's suite on its final ``checkpoint`` (the spec of the runs' checkpoints), a run per
    partition, and its ``beats_chance`` check; ``spec_for`` gives a partition's `RunSpec` when a step
    runs (dg.Failure for an unknown run); ``heldout``: the specs of the caches the suites' `bpb:` sets
    read. The offline tasks' assets are this catalog's. Every suite's tasks and caches are declared
    dependencies, and a partition reads those of its own suite only (as a run reads its own mixture),
    so building one run's evaluation builds no other suite's data."""
    reads_any = sorted(set().union(*(h.reads() for h in run_suites.suites.values())))
    deps = [asset_key(read) for read in reads_any]
    tags = {"marin/partitioned_by": "run", **(tags or {})}
    artifact = ArtifactSpec(key, HARNESS_EVAL_VERSION,
                            lambda run: run_suites.of(str(run)).identity(spec_for(str(run))),
                            reads=lambda run: {checkpoint.key, *run_suites.of(run).reads()})
    names = sorted({h.suite.name for h in run_suites.suites.values()})

    @catalog.asset(artifact, partitions_def=partitions, ins={"checkpoint": input_of(checkpoint)}, deps=deps,
                   group_name=group_name, pool=pool, kinds={"levanter", "lm-eval"}, tags=tags,
                   metadata={"suites": ", ".join(names)},
                   description=f"A run's eval suite ({', '.join(names)}; the suites' `runs:` name each run's) on "
                               f"its final checkpoint{subject} through Levanter's eval harness (lm-eval), and "
                               "bits-per-byte on the suite's held-out sets. Per task `<task>/acc`, `<task>/acc_norm` "
                               "and their stderr in the manifest; lm-eval's version and the task configs' hashes are "
                               "part of its identity.")
    def harness_eval(context: dg.AssetExecutionContext, store: MarinStore, launcher: TrainingLauncher,
                     checkpoint: ArtifactHandle):
        spec = spec_for(context.partition_key)
        check_pool(spec, pool)
        harness = run_suites.of(context.partition_key)
        registry, suite = harness.registry, harness.suite
        if harness.unfit is not None:
            raise input_refused(f"{key}[{spec.name}]: {harness.unfit}")
        if harness.missing:
            raise input_refused(f"{key}[{spec.name}]: suite {suite.name!r} needs {', '.join(harness.missing)}, "
                                "which this deployment does not build (see the tokenization registry and the "
                                "eval suites)")
        for source, tokenizer in harness.heldout.items():
            if tokenizer != spec.tokenizer:
                raise input_refused(f"{key}[{spec.name}]: held-out set {source!r} is tokenized with "
                                    f"tokenizer/{tokenizer}, the run with tokenizer/{spec.tokenizer}: bits-per-byte "
                                    "would be meaningless")
        check_lm_eval_tasks(registry, suite)
        artifacts = store.get()
        heldout_handles = {s: find_handle(store, heldout[s]) for s in harness.heldout}
        task_handles = {t: find_handle(store, catalog.spec(eval_task_key(t))) for t in harness.tasks}
        config = artifact.identity(spec.name)
        chance = chance_levels(registry, suite)

        def build(writer) -> Built:
            out = Path(local_dir(store, writer))
            out.mkdir(parents=True, exist_ok=True)
            for name, handle in task_handles.items():
                localize_task(artifacts, handle, name, out / TASKS_DIR)
            harness_config = render_harness_config(registry, suite, str(out / TASKS_DIR) if task_handles else None)
            harness_config["bpb"] = {s: h.uri for s, h in heldout_handles.items()}
            harness_path = out / HARNESS_CONFIG_FILE
            harness_path.write_text(json.dumps(harness_config, indent=2))
            with tempfile.TemporaryDirectory(prefix="marin-harness-") as scratch:
                config_path = os.path.join(scratch, TRAIN_CONFIG_FILE)
                with artifacts.open(f"{checkpoint.uri}/{TRAIN_CONFIG_FILE}") as src, open(config_path, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                try:
                    launcher.run_process(context, harness_command(config_path, str(harness_path), str(out)),
                                         resources=spec.resources.for_evaluation(),
                                         extras={"run": spec.name, "suite": suite.name})
                except dg.DagsterExecutionInterruptedError:
                    raise
                except Exception:
                    error = out / ERROR_FILE
                    if error.exists():  # bad input: the process's one line, not a traceback
                        raise dg.Failure(f"{key}[{spec.name}]: {error.read_text().strip()}") from None
                    raise
            report = json.loads((out / HARNESS_REPORT_FILE).read_text())
            return Built(metrics=harness_metrics(report),
                         metadata={"suite": suite.name, "lm_eval_version": str(config.get("lm_eval", "")),
                                   "results": dg.MetadataValue.md(results_table(report, chance)),
                                   "task_configs": dg.MetadataValue.json(config.get("task_configs", {}))})

        upstream = [checkpoint, *[task_handles[k] for k in sorted(task_handles)],
                    *[heldout_handles[k] for k in sorted(heldout_handles)]]
        return materialize_artifact(context, store, artifact, upstream=upstream, build=build)

    @marin_check(harness_eval, name="beats_chance",
                 description="Every offline task of the run's suite not marked `hard` has a positive margin over "
                             "chance, acc - 2 x stderr - chance; every task's margin is recorded.")
    def beats_chance(context: dg.AssetCheckExecutionContext, store: MarinStore) -> dg.AssetCheckResult:
        manifest = checked_manifest(context, store, artifact)
        if manifest is None:
            return dg.AssetCheckResult(passed=False, metadata={"error": f"no committed {key}"})
        harness = run_suites.of(asset_partition(context))
        suite = harness.suite
        chance = chance_levels(harness.registry, suite)
        hard = {t.name for t in suite.tasks if t.hard}
        margins = {task: margin_over_chance(manifest.metrics, task, level) for task, level in chance.items()}
        required = {t: m for t, m in margins.items() if t not in hard}
        passed = bool(required) and all(m is not None and math.isfinite(m) and m > 0 for m in required.values())
        # A warning: an early checkpoint of a sweep may honestly be at chance.
        recorded = {f"{t}/margin_over_chance": m for t, m in margins.items() if m is not None}
        recorded["hard_tasks"] = dg.MetadataValue.json(sorted(hard & set(margins)))
        return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.WARN, metadata=recorded)

    return harness_eval, beats_chance


def build_evaluation_stage(settings: MarinSettings, deployment: Deployment,
                           upstream: Catalog) -> tuple[dg.Definitions, Catalog]:
    """`eval_task/<task>` for the offline tasks on sources tokenized here; `harness_eval` over the
    deployment's named runs, each with its suite, and `sweep_harness_eval/<sweep>` over the runs of each
    sweep that forecasts a harness metric, with the default suite."""
    tokenized_sources = {s: e.tokenizer for s, e in deployment.tokenization.tokenized.items()}
    registry = deployment.suites
    catalog = Catalog()
    assets: list = []
    tasks: set[str] = set()
    caches = {source: upstream.spec(f"tokenized/{source}") for source in sorted(tokenized_sources)}
    for spec in registry.offline_tasks.values():
        if spec.source in tokenized_sources:
            assets.append(build_eval_task_asset(spec, catalog, caches[spec.source]))
            tasks.add(spec.name)

    def resolved(names: set[str]) -> dict[str, HarnessSuite]:
        return {n: HarnessSuite.resolve(registry, registry.suite(n), tasks, tokenized_sources) for n in sorted(names)}

    def named_suite(run: str) -> str:
        return UNFIT_SUITE.format(run=run) if run in deployment.unfit_suites else registry.suite_of_run(run).name

    suites = resolved({registry.default_suite, *(registry.suite_of_run(r).name for r in deployment.runs)})
    for run, problem in deployment.unfit_suites.items():
        suites[UNFIT_SUITE.format(run=run)] = dataclasses.replace(suites[registry.suite_of_run(run).name],
                                                                  unfit=problem)
    named = RunSuites(suites, named_suite)
    default = RunSuites.single(resolved({registry.default_suite})[registry.default_suite])
    run_sets = [dict(key="harness_eval", run_suites=named, checkpoint=upstream.spec("checkpoint"), partitions=RUNS,
                     spec_for=named_run_lookup(settings, deployment), group_name="evaluation")]
    for name, config in sorted(deployment.sweeps.items()):
        if is_harness_metric(forecast_metric(config)):
            run_sets.append(dict(key=harness_key(name), run_suites=default,
                                 checkpoint=upstream.spec(sweep_checkpoint_key(name)),
                                 partitions=runs_partitions(name),
                                 spec_for=sweep_run_lookup(settings, SweepRuns(plan_sweep(config))),
                                 group_name="scaling", tags={"marin/sweep": name}, subject=f" of sweep {name!r}"))
    checks = []
    for run_set in run_sets:
        asset, check = build_harness_asset(heldout=caches, pool=settings.train_pool, catalog=catalog, **run_set)
        assets.append(asset)
        checks.append(check)
    return dg.Definitions(assets=assets, asset_checks=checks), catalog
