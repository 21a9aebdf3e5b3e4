"""Eval suites as data: which downstream tasks and held-out sets a model is evaluated on.

``suites.yaml`` (or the file named by MARIN_SUITES) declares

- ``offline_tasks``: multiple-choice tasks built from a source's held-out documents
  (``next_line.NextLineTaskSpec``); each becomes the asset ``eval_task/<name>``;
- ``suites``: named lists of lm-eval tasks (``task``, ``num_fewshot``, ``limit``, ``alias``) and/or
  held-out token caches evaluated for bits-per-byte (``bpb: [source, ...]``, validation-only
  components, as Marin does with Paloma). A task is an offline task when its name is one, otherwise
  a task of lm-eval's bundled registry (which may need the hub for its data);
- ``default_suite``: the suite ``harness_eval`` runs on a run not named under ``runs`` (MARIN_EVAL_SUITE
  picks another);
- ``runs``: run name -> the suite ``harness_eval[run]`` runs.

The project file's ``eval_suites:`` section extends this file (`parse_suites(..., extends=)`):
offline tasks, suites and ``runs`` by name, ``default_suite`` replaced.

Refused at load, with the file and field named: a ``limit`` below 1, a suite with nothing in it,
unknown fields, a duplicate task name in a suite, a default suite or a run's suite that is not
declared. An lm-eval task name is checked against lm-eval's registry where that registry is read
(``lm_eval_task_files``), before any model is loaded.

Pure: no Dagster, lm-eval or JAX import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from marin_assets.evaluation.next_line import NextLineTaskSpec, TaskSpecError
from marin_resources.config_identity import config_identity, identity, runtime
from marin_resources.typed_config import ConfigError

DEFAULT_SUITES_YAML = Path(__file__).with_name("suites.yaml")
LM_EVAL_DIST = "lm-eval"


class SuiteError(ConfigError):
    pass


@dataclass(frozen=True)
class HarnessTask:
    """One lm-eval task of a suite."""

    task: str = identity()
    num_fewshot: int = identity(0)
    limit: int | None = identity(None)
    """Evaluate the first ``limit`` documents (lm-eval's ``limit``); None: all of them."""
    alias: str | None = identity(None)
    """The name results are reported under (to run one task twice, e.g. 0- and 10-shot)."""
    hard: bool = runtime(False)
    """A task a small model may honestly be at chance on: recorded, its margin over chance reported,
    but ``beats_chance`` does not require it. A check policy, not part of the suite's identity."""

    @property
    def name(self) -> str:
        return self.alias or self.task


@dataclass(frozen=True)
class Suite:
    name: str = identity()
    description: str = runtime("")
    tasks: tuple[HarnessTask, ...] = identity(())
    bpb: tuple[str, ...] = identity(())
    """Tokenized sources whose validation split is evaluated for loss and bits-per-byte."""
    needs_hub: bool = runtime(False)
    """Whether its lm-eval tasks download data (clusters with hub access only)."""

    def identity(self) -> dict[str, Any]:
        return config_identity(self)


@dataclass(frozen=True)
class SuiteRegistry:
    offline_tasks: dict[str, NextLineTaskSpec]
    suites: dict[str, Suite]
    default_suite: str
    path: str = ""
    runs: dict[str, str] = dataclasses.field(default_factory=dict)
    """Run name -> the suite ``harness_eval[run]`` runs; any other run runs ``default_suite``."""

    def suite(self, name: str | None = None) -> Suite:
        name = name or self.default_suite
        if name not in self.suites:
            raise SuiteError(f"{self.path}: no suite named {name!r}; declared: {sorted(self.suites)}")
        return self.suites[name]

    def suite_of_run(self, run: str) -> Suite:
        return self.suite(self.runs.get(run))

    def with_default(self, name: str, where: str) -> SuiteRegistry:
        """The registry with another default suite (``where`` names the setting that picked it)."""
        if name not in self.suites:
            raise SuiteError(f"{where}: no suite named {name!r}; declared: {sorted(self.suites)}")
        return dataclasses.replace(self, default_suite=name)

    def offline_tasks_of(self, suite: Suite) -> list[NextLineTaskSpec]:
        return [self.offline_tasks[t.task] for t in suite.tasks if t.task in self.offline_tasks]

    def lm_eval_tasks_of(self, suite: Suite) -> list[HarnessTask]:
        return [t for t in suite.tasks if t.task not in self.offline_tasks]


_TASK_FIELDS = {f.name for f in dataclasses.fields(HarnessTask)}
_SUITE_FIELDS = {"description", "tasks", "bpb", "needs_hub"}
_OFFLINE_FIELDS = {f.name for f in dataclasses.fields(NextLineTaskSpec)} - {"name"}


def _fields(raw: Any, allowed: set[str], where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise SuiteError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise SuiteError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    return raw


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SuiteError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def _harness_task(raw: Any, where: str) -> HarnessTask:
    if isinstance(raw, str):
        raw = {"task": raw}
    body = _fields(raw, _TASK_FIELDS, where)
    task = body.get("task")
    if not isinstance(task, str) or not task.strip():
        raise SuiteError(f"{where}.task: must name a task")
    limit = body.get("limit")
    alias = body.get("alias")
    if alias is not None and (not isinstance(alias, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", alias)):
        raise SuiteError(f"{where}.alias: must be letters, digits, '_', '.' or '-', got {alias!r}")
    hard = body.get("hard", False)
    if not isinstance(hard, bool):
        raise SuiteError(f"{where}.hard: must be true or false, got {hard!r}")
    return HarnessTask(task=task.strip(), num_fewshot=_int(body.get("num_fewshot", 0), f"{where}.num_fewshot", 0),
                       limit=None if limit is None else _int(limit, f"{where}.limit", 1), alias=alias, hard=hard)


def parse_suites(document: Any, path: str = "<suites>", extends: SuiteRegistry | None = None) -> SuiteRegistry:
    """Validate a suites document (the parsed YAML); raises SuiteError naming the field. With ``extends``,
    the document adds to that registry (the project file's ``eval_suites:``): its offline tasks,
    suites and runs by name, and its ``default_suite`` if it names one."""
    top = _fields(document, {"offline_tasks", "suites", "default_suite", "runs"}, path)
    offline: dict[str, NextLineTaskSpec] = dict(extends.offline_tasks) if extends else {}
    for name, raw in (top.get("offline_tasks") or {}).items():
        body = _fields(raw, _OFFLINE_FIELDS, f"{path}: offline_tasks.{name}")
        try:
            offline[str(name)] = NextLineTaskSpec(name=str(name), **body)
        except (TaskSpecError, TypeError) as exc:
            raise SuiteError(f"{path}: offline_tasks.{name}: {exc}") from None
    suites: dict[str, Suite] = dict(extends.suites) if extends else {}
    raw_suites = top.get("suites", {} if extends else None)
    if not isinstance(raw_suites, Mapping) or not (raw_suites or extends):
        raise SuiteError(f"{path}: expected a non-empty 'suites:' mapping of suite name to tasks")
    for name, raw in raw_suites.items():
        suites[str(name)] = _suite(str(name), raw, f"{path}: suites.{name}")
    default = top.get("default_suite", extends.default_suite if extends else None)
    if default not in suites:
        raise SuiteError(f"{path}: default_suite {default!r} is not a declared suite ({sorted(suites)})")
    runs = dict(extends.runs) if extends else {}
    raw_runs = top.get("runs") or {}
    if not isinstance(raw_runs, Mapping):
        raise SuiteError(f"{path}: runs: expected a mapping of run name to suite name, got {raw_runs!r}")
    for run, suite in raw_runs.items():
        if suite not in suites:
            raise SuiteError(f"{path}: runs.{run}: {suite!r} is not a declared suite ({sorted(suites)})")
        runs[str(run)] = str(suite)
    return SuiteRegistry(offline, suites, str(default), path, runs)


def _suite(name: str, raw: Any, where: str) -> Suite:
    body = _fields(raw if raw is not None else {}, _SUITE_FIELDS, where)
    tasks = tuple(_harness_task(t, f"{where}.tasks[{i}]") for i, t in enumerate(body.get("tasks") or []))
    bpb = tuple(str(s) for s in body.get("bpb") or [])
    if not tasks and not bpb:
        raise SuiteError(f"{where}: the suite is empty (list lm-eval tasks under 'tasks' or sources under 'bpb')")
    names = [t.name for t in tasks]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SuiteError(f"{where}.tasks: {duplicates} listed twice; give one an 'alias'")
    if len(set(bpb)) != len(bpb):
        raise SuiteError(f"{where}.bpb: contains duplicates")
    return Suite(name=name, description=str(body.get("description", "")), tasks=tasks, bpb=bpb,
                 needs_hub=bool(body.get("needs_hub", False)))


def load_suites(path: str | Path | None = None) -> SuiteRegistry:
    path = Path(path or DEFAULT_SUITES_YAML)
    with open(path) as fh:
        return parse_suites(yaml.safe_load(fh), str(path))


# --- lm-eval: its version, its bundled task configs, and the rendered task spec -------------------


def lm_eval_version() -> str:
    return importlib.metadata.version(LM_EVAL_DIST)


@lru_cache(maxsize=1)
def _lm_eval_task_dir() -> Path:
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SuiteError("lm-eval is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


@lru_cache(maxsize=1)
def _bundled_task_files() -> dict[str, tuple[Path, ...]]:
    """Task name -> the YAML files defining it in lm-eval's bundled registry (text scan: importing
    lm-eval and building its index takes tens of seconds; this takes about one)."""
    found: dict[str, list[Path]] = {}
    pattern = re.compile(r"^task:\s*['\"]?([^'\"\s#]+)['\"]?\s*$", re.MULTILINE)
    for path in sorted(_lm_eval_task_dir().rglob("*.yaml")):
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in pattern.finditer(text):
            found.setdefault(match.group(1), []).append(path)
    return {k: tuple(v) for k, v in found.items()}


def lm_eval_task_files(task: str) -> tuple[Path, ...]:
    """The bundled YAML files of ``task`` and the files they ``include``; SuiteError if lm-eval has no such task."""
    roots = _bundled_task_files().get(task)
    if not roots:
        raise SuiteError(f"unknown lm-eval task {task!r}: lm-eval {lm_eval_version()} has no task of that name "
                         "(and it is not an offline task of the suites file)")
    files: list[Path] = []
    pending = list(roots)
    while pending:
        path = pending.pop(0)
        if path in files or not path.exists():
            continue
        files.append(path)
        for match in re.finditer(r"^include:\s*['\"]?([^'\"\s#]+)", path.read_text(encoding="utf-8"), re.MULTILINE):
            pending.append(path.parent / match.group(1))
    return tuple(files)


def lm_eval_task_hash(task: str) -> str:
    """sha256 over the task's config files (paths relative to lm-eval's task dir, and bytes)."""
    digest = hashlib.sha256()
    base = _lm_eval_task_dir()
    for path in lm_eval_task_files(task):
        digest.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def offline_task_hash(spec: NextLineTaskSpec) -> str:
    from marin_assets.evaluation.next_line import render_task_yaml

    return hashlib.sha256(render_task_yaml(spec, "<data>").encode()).hexdigest()


def task_config_hashes(registry: SuiteRegistry, suite: Suite) -> dict[str, str | None]:
    """Each task's config hash; None for an lm-eval task lm-eval does not know (refused when the suite runs)."""
    hashes: dict[str, str | None] = {}
    for task in suite.tasks:
        if task.task in registry.offline_tasks:
            hashes[task.name] = offline_task_hash(registry.offline_tasks[task.task])
        else:
            try:
                hashes[task.name] = lm_eval_task_hash(task.task)
            except SuiteError:
                hashes[task.name] = None
    return hashes


def suite_identity(registry: SuiteRegistry, suite: Suite) -> dict[str, Any]:
    """What defines a suite's results besides the model: its tasks, lm-eval's version, the task configs."""
    identity: dict[str, Any] = {"suite": suite.identity()}
    if suite.tasks:
        identity["lm_eval"] = lm_eval_version()
        identity["task_configs"] = task_config_hashes(registry, suite)
    return identity


def render_task_spec(suite: Suite) -> list[dict[str, Any]]:
    """The suite's tasks as Levanter ``TaskConfig`` dicts (``task``, ``num_fewshot``, ``task_alias``)."""
    spec = []
    for task in suite.tasks:
        entry: dict[str, Any] = {"task": task.task, "num_fewshot": task.num_fewshot}
        if task.alias:
            entry["task_alias"] = task.alias
        spec.append(entry)
    return spec


def render_harness_config(registry: SuiteRegistry, suite: Suite, task_dir: str | None = None) -> dict[str, Any]:
    """What the harness process runs: task groups by ``limit`` (lm-eval takes one limit per run),
    whether lm-eval's bundled tasks are needed, and where the offline task configs are."""
    groups: dict[int | None, list[HarnessTask]] = {}
    for task in suite.tasks:
        groups.setdefault(task.limit, []).append(task)
    return {
        "suite": suite.name,
        "groups": [{"limit": limit, "task_spec": render_task_spec(dataclasses.replace(suite, tasks=tuple(tasks)))}
                   for limit, tasks in groups.items()],
        "include_bundled_tasks": bool(registry.lm_eval_tasks_of(suite)),
        "task_dir": task_dir,
        "offline_tasks": {t.name: {"task": t.task, "choices": registry.offline_tasks[t.task].choices}
                          for t in suite.tasks if t.task in registry.offline_tasks},
        "bpb": list(suite.bpb),
    }


def chance_levels(registry: SuiteRegistry, suite: Suite) -> dict[str, float]:
    """Chance accuracy of the suite's offline tasks (1 / choices)."""
    return {t.name: registry.offline_tasks[t.task].chance for t in suite.tasks if t.task in registry.offline_tasks}


def margin_over_chance(metrics: Mapping[str, Any], task: str, chance: float) -> float | None:
    """``acc - 2 * stderr - chance`` of a task's results; None where either is missing."""
    acc, err = metrics.get(f"{task}/acc"), metrics.get(f"{task}/acc_stderr")
    return None if acc is None or err is None else float(acc - 2 * err - chance)

