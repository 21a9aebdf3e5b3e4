"""Scaling sweeps as data: a typed sweep config, its isoFLOP plan, and the run specs it trains.

A sweep names a recipe (``micro`` or ``delphi``, plus field overrides), the *fit budgets*
whose candidates are trained and fitted, and the *target budgets* whose loss is forecast
from that fit before any target run trains. Every fit-budget candidate becomes a `RunSpec`
named ``<sweep>-<budget>-d<width>``; a target budget's run is the candidate nearest the
forecast compute-optimal size and exists only once the forecast is stored.

A mixture-weight sweep (`MixtureSweepConfig`, the project file's ``mixture_sweeps:``) trains one run
of the deployment once per set of mixture weights, its points ``<sweep>-w<i>``.

Pure: no Dagster, JAX or Levanter import, so it loads with the code location and tests run
without either.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from marin_assets.training.spec import ModelSpec, OptimizerSpec, ResourceSpec, RunSpec, RunSpecError, validate_run
from marin_resources.config_identity import config_identity, derived, identity, runtime
from marin_resources.typed_config import ConfigError, FieldProblem, decode, resolve_bases, typed_config
from scaling.links import LINKS
from scaling.mixture import MixtureOptions
from scaling.recipe import Candidate, MicroRecipe, Recipe, Rejection

DEFAULT_SWEEPS_YAML = Path(__file__).with_name("sweeps.yaml")
RECIPES: dict[str, type[Recipe]] = {"micro": MicroRecipe, "delphi": Recipe}
RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9._=+-]+$")
ParamsColumn = Literal["total", "non_embedding"]
ForecastMethod = Literal["envelope", "joint"]
EVAL_METRICS = ("loss", "bpb")
HARNESS_METRICS = ("acc", "acc_norm")


class SweepConfigError(ConfigError):
    """A sweep config is invalid; the message names the sweep and the field."""

    kind = "sweep"

    def __init__(self, sweep: str, field_path: str, problem: str, origin: str | None = None):
        self.sweep, self.field_path, self.problem = sweep, field_path, problem
        super().__init__(f"{f'{origin}: ' if origin else ''}{self.kind} {sweep!r}: field {field_path!r}: {problem}")


class MixtureSweepError(SweepConfigError):
    kind = "mixture sweep"


@typed_config
@dataclass(frozen=True)
class SweepConfig:
    name: str = identity()
    recipe: Literal["micro", "delphi"] = identity()
    mixture: str = identity()
    tokenizer: str = identity()
    eval_set: str = identity()
    """Mixture component whose validation loss (``eval/<set>/loss``) is fitted and forecast."""
    fit_budgets: tuple[float, ...] = identity()
    target_budgets: tuple[float, ...] = identity()
    recipe_overrides: Mapping[str, Any] = identity(default_factory=dict)
    target_recipe_overrides: Mapping[str, Any] = identity(default_factory=dict)
    """Applied on top of ``recipe_overrides`` for target budgets only, e.g. a wider tokens-per-param
    window: only the forecast's chosen target candidate trains, so a wide window costs nothing and
    lets the target be the model nearest the forecast optimum."""
    params: ParamsColumn = identity("total")
    """Parameter count used as N in the fit: the recipe's total (embeddings counted once when tied) or non-embedding."""
    forecast_method: ForecastMethod = identity("envelope")
    """Primary forecast: ``envelope`` (approach 2, L*(C) and the valley) or ``joint`` (approach 3,
    L(N, D) fitted to all fit runs). It picks the target and is what the check scores; both are recorded."""
    max_steps: int | None = identity(None)
    """Candidates needing more optimizer steps are dropped (listed in the plan with the reason)."""
    seed: int = identity(0)
    steps_per_eval: int = identity(100_000)
    max_eval_batches: int | None = identity(None)
    eval_examples: int | None = identity(None, omit="default")
    """Validation sequences each run's eval/<run> scores, evenly spaced and the same for every run
    (`RunSpec.final_eval_examples`); None scores the whole split."""
    checkpoint_every: int = identity(100_000)
    watch_every: int = runtime(10)
    """Each run's `RunSpec.watch_every`: steps between gradient and parameter norm logs, 0 for none.
    Observability only: in neither the sweep's identity nor its runs'."""
    min_lr_ratio: float = identity(0.1)
    bootstrap_samples: int = identity(200)
    interval: float = identity(0.95)
    error_goal: float = identity(0.02)
    """Relative forecast error the sweep aims for; the forecast check reports against it."""
    metric: str | None = identity(None, omit="default")
    """What is forecast and checked: ``eval/<eval_set>/loss`` (the default), ``eval/<eval_set>/bpb``
    (fitted directly), or a harness task's ``harness_eval/<task>/acc`` (or ``acc_norm``), forecast
    from the fitted loss through ``link``."""
    link: Literal["sigmoid"] | None = identity(None, omit="default")
    """How a harness metric follows the loss (``scaling.links``); required for harness metrics only."""
    link_floor: float | None = identity(None, omit="default")
    """The metric's floor for the link, e.g. chance accuracy (0.25 for four choices); None: fitted."""

    def build_recipe(self, role: Literal["fit", "target"] = "fit") -> Recipe:
        overrides = {**self.recipe_overrides, **(self.target_recipe_overrides if role == "target" else {})}
        return dataclasses.replace(RECIPES[self.recipe](), **overrides)

    def identity(self) -> dict[str, Any]:
        """The sweep's config with the recipes fully resolved (so a changed default changes identity)."""
        data = config_identity(self)
        data["resolved_recipe"] = dataclasses.asdict(self.build_recipe("fit"))
        if self.target_recipe_overrides:
            data["resolved_target_recipe"] = dataclasses.asdict(self.build_recipe("target"))
        return data


@dataclass(frozen=True)
class PlannedRun:
    role: Literal["fit", "target"]
    candidate: Candidate
    spec: RunSpec

    @property
    def params(self) -> int:
        return self.candidate.params

    def to_dict(self, params_column: ParamsColumn) -> dict[str, Any]:
        return {"run": self.spec.name, "role": self.role, "fit_params": fit_params(self.candidate, params_column),
                **self.candidate.to_dict()}


@dataclass(frozen=True)
class BudgetRuns:
    budget: float
    role: Literal["fit", "target"]
    runs: tuple[PlannedRun, ...]
    rejected: tuple[Rejection, ...]


@dataclass(frozen=True)
class SweepPlan:
    config: SweepConfig
    budgets: tuple[BudgetRuns, ...]

    def fit_runs(self) -> list[PlannedRun]:
        return [r for b in self.budgets if b.role == "fit" for r in b.runs]

    def target_candidates(self, budget: float) -> list[PlannedRun]:
        for b in self.budgets:
            if b.role == "target" and b.budget == budget:
                return list(b.runs)
        raise KeyError(f"sweep {self.config.name!r} has no target budget {budget:g}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "sweep": self.config.name,
            "config": self.config.identity(),
            "budgets": [{"budget": b.budget, "role": b.role,
                         "runs": [r.to_dict(self.config.params) for r in b.runs],
                         "rejected": [dataclasses.asdict(x) for x in b.rejected]} for b in self.budgets],
        }


def fit_params(candidate: Candidate, column: ParamsColumn) -> int:
    return candidate.params if column == "total" else candidate.non_embedding_params


def budget_label(budget: float) -> str:
    """Compact, path-safe budget: 3e12, 2.5e13."""
    mantissa, _, exponent = f"{budget:.2e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def safe_name(text: str) -> str:
    """Letters, digits and ``. _ = + -`` only; anything else becomes ``-`` (no leading dot)."""
    cleaned = re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-")
    cleaned = cleaned.lstrip(".")
    if not cleaned:
        raise ValueError(f"{text!r} has no path-safe characters")
    return cleaned


def run_name(sweep: str, budget: float, width: int) -> str:
    return safe_name(f"{sweep}-{budget_label(budget)}-d{width}")


def run_spec(config: SweepConfig, candidate: Candidate) -> RunSpec:
    spec = RunSpec(
        name=run_name(config.name, candidate.budget, candidate.hidden_dim),
        model=ModelSpec(hidden_dim=candidate.hidden_dim, intermediate_dim=candidate.intermediate_dim,
                        num_layers=candidate.num_layers, num_heads=candidate.num_heads,
                        num_kv_heads=candidate.num_kv_heads, seq_len=candidate.seq_len,
                        tie_word_embeddings=candidate.tie_word_embeddings),
        mixture=config.mixture,
        tokenizer=config.tokenizer,
        # Warmup in steps (>= 1) or none; OptimizerSpec reads values below 1 as a fraction.
        optimizer=OptimizerSpec(learning_rate=candidate.learning_rate, weight_decay=candidate.weight_decay,
                                warmup=float(candidate.warmup), schedule="cosine", min_lr_ratio=config.min_lr_ratio,
                                beta1=candidate.beta1, beta2=candidate.beta2, epsilon=candidate.epsilon,
                                max_grad_norm=candidate.max_grad_norm),
        train_batch_size=candidate.batch_size,
        num_train_steps=candidate.steps,
        seed=config.seed,
        eval_sets=(config.eval_set,),
        steps_per_eval=config.steps_per_eval,
        max_eval_batches=config.max_eval_batches,
        checkpoint_every=config.checkpoint_every,
        final_eval_examples=config.eval_examples,
        watch_every=config.watch_every,
        resources=ResourceSpec(),
    )
    validate_run(spec)
    return spec


def plan_sweep(config: SweepConfig) -> SweepPlan:
    budgets = []
    for role, values in (("fit", config.fit_budgets), ("target", config.target_budgets)):
        recipe = config.build_recipe(role)
        for budget in values:
            plan = recipe.plan(budget)
            kept, rejected = [], list(plan.rejected)
            for candidate in plan.candidates:
                if config.max_steps is not None and candidate.steps > config.max_steps:
                    reason = f"{candidate.steps} steps > max_steps {config.max_steps}"
                    rejected.append(Rejection(candidate.hidden_dim, reason))
                else:
                    kept.append(PlannedRun(role, candidate, run_spec(config, candidate)))
            if role == "fit" and len(kept) < 3:
                raise SweepConfigError(config.name, "fit_budgets",
                                       f"budget {budget:g} has {len(kept)} candidate(s); an isoFLOP fit needs 3 "
                                       f"(rejected: {'; '.join(f'd{r.hidden_dim}: {r.reason}' for r in rejected)})")
            if role == "target" and not kept:
                raise SweepConfigError(config.name, "target_budgets", f"budget {budget:g} has no candidate")
            budgets.append(BudgetRuns(budget, role, tuple(kept), tuple(sorted(rejected, key=lambda r: r.hidden_dim))))
    names = [r.spec.name for b in budgets for r in b.runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SweepConfigError(config.name, "fit_budgets", f"budgets give the same run names {duplicates}; "
                                                           "use budgets that differ in their first 3 digits")
    return SweepPlan(config, tuple(budgets))


# --- loading ------------------------------------------------------------------------------------


def _number(sweep: str, name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)  # YAML 1.1 reads 3e12 (no dot) as a string
        except ValueError:
            raise SweepConfigError(sweep, name, f"not a number: {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SweepConfigError(sweep, name, f"expected a finite number, got {value!r}")
    return float(value)


def _recipe_overrides(sweep: str, recipe: str, raw: Mapping[str, Any], field_name: str = "recipe_overrides",
                      base_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    base = RECIPES[recipe]
    fields = {f.name: f for f in dataclasses.fields(base)}
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise SweepConfigError(sweep, f"{field_name}.{key}", f"unknown recipe field (known: {sorted(fields)})")
        out[key] = tuple(value) if isinstance(value, list) else value
    try:
        dataclasses.replace(base(), **{**(base_overrides or {}), **out})
    except (TypeError, ValueError) as exc:
        raise SweepConfigError(sweep, field_name, str(exc)) from None
    return out


def checked_body(name: str, raw: Any, error: type[SweepConfigError]) -> dict[str, Any]:
    """A sweep's entry as a mapping without ``name`` (its key is its name, path-safe); ``error`` otherwise."""
    if not isinstance(raw, Mapping):
        raise error(name, f"<{error.kind}>", f"expected a mapping, got {type(raw).__name__}")
    if safe_name(name) != name:
        raise error(name, "<name>", "use letters, digits and . _ = + - only")
    if "name" in raw:
        raise error(name, "name", "unknown field (the sweep's name is its key in the file)")
    return dict(raw)


def sweep_from_dict(name: str, raw: Any) -> SweepConfig:
    data = checked_body(name, raw, SweepConfigError)
    for field_name in ("fit_budgets", "target_budgets"):
        if isinstance(data.get(field_name), list):  # YAML 1.1 reads 3e12 (no dot) as a string
            data[field_name] = [_number(name, f"{field_name}[{i}]", v) for i, v in enumerate(data[field_name])]
    try:
        config = decode(SweepConfig, {**data, "name": name})
    except FieldProblem as exc:
        raise SweepConfigError(name, exc.dotted or "<sweep>", exc.problem) from None
    overrides = _recipe_overrides(name, config.recipe, config.recipe_overrides)
    config = dataclasses.replace(config, recipe_overrides=overrides, target_recipe_overrides=_recipe_overrides(
        name, config.recipe, config.target_recipe_overrides, "target_recipe_overrides", overrides))
    validate_sweep(config)
    return config


def validate_sweep(config: SweepConfig) -> None:
    def require(ok: bool, field_path: str, problem: str) -> None:
        if not ok:
            raise SweepConfigError(config.name, field_path, problem)

    for field_name in ("mixture", "tokenizer", "eval_set"):
        require(bool(getattr(config, field_name)), field_name, "must not be empty")
    require(bool(config.target_budgets), "target_budgets", "must name at least one budget")
    require(len(config.fit_budgets) >= 3, "fit_budgets",
            f"the envelope fit needs at least 3 budgets, got {len(config.fit_budgets)}")
    require(len(set(config.fit_budgets)) == len(config.fit_budgets), "fit_budgets", "contains duplicates")
    for field_name in ("fit_budgets", "target_budgets"):
        for i, budget in enumerate(getattr(config, field_name)):
            require(budget > 0, f"{field_name}[{i}]", f"must be positive FLOPs, got {budget:g}")
    largest_fit = max(config.fit_budgets)
    for i, budget in enumerate(config.target_budgets):
        require(budget > largest_fit, f"target_budgets[{i}]",
                f"{budget:g} is not above the largest fit budget {largest_fit:g}; a forecast must extrapolate")
    require(config.max_steps is None or config.max_steps > 0, "max_steps", "must be positive or null")
    require(0 < config.interval < 1, "interval", f"must be in (0, 1), got {config.interval}")
    require(config.eval_examples is None or config.eval_examples > 0, "eval_examples", "must be positive or null")
    require(config.watch_every >= 0, "watch_every", "must be >= 0 (0 turns the norm logs off)")
    require(config.bootstrap_samples >= 0, "bootstrap_samples", "must be >= 0")
    require(config.error_goal > 0, "error_goal", "must be positive")
    metric = config.metric or f"eval/{config.eval_set}/loss"
    parts = metric.split("/")
    if parts[0] == "eval":
        require(len(parts) == 3 and parts[1] == config.eval_set and parts[2] in EVAL_METRICS, "metric",
                f"an eval metric is eval/{config.eval_set}/<{'|'.join(EVAL_METRICS)}> (the runs evaluate "
                f"eval_set {config.eval_set!r}), got {metric!r}")
        require(config.link is None and config.link_floor is None, "link",
                "an eval metric is fitted directly; a link is for harness metrics")
    else:
        require(len(parts) == 3 and parts[0] == "harness_eval" and parts[2] in HARNESS_METRICS, "metric",
                f"expected eval/<set>/<{'|'.join(EVAL_METRICS)}> or harness_eval/<task>/<{'|'.join(HARNESS_METRICS)}>, "
                f"got {metric!r}")
        require(config.link is not None, "link", f"a harness metric needs a link from the loss (one of {list(LINKS)})")
        require(config.link_floor is None or 0 <= config.link_floor < 1, "link_floor", "must be in [0, 1)")


def load_sweeps(path: str | Path = DEFAULT_SWEEPS_YAML) -> dict[str, SweepConfig]:
    """Parse ``sweeps: {name: {...}}`` into validated configs."""
    with open(path) as fh:
        document = yaml.safe_load(fh)
    if not isinstance(document, Mapping) or not isinstance(document.get("sweeps"), Mapping):
        raise ValueError(f"{path}: expected a top-level 'sweeps:' mapping of sweep name to config")
    return extend_sweeps({}, document["sweeps"], str(path))


def extend_sweeps(sweeps: Mapping[str, SweepConfig], raw: Mapping[str, Any], origin: str) -> dict[str, SweepConfig]:
    """``sweeps`` with those of ``raw`` (``{name: {...}}``) added, each replacing the sweep of its name;
    a sweep may be declared as a difference from (``base:``) a sweep of ``raw`` or ``sweeps``
    (`resolve_bases`: its ``recipe_overrides`` merge key by key). Errors name ``origin``."""
    try:
        bodies = resolve_bases({str(name): body for name, body in raw.items()}, sweeps, SweepConfigError)
        return {**sweeps, **{name: sweep_from_dict(name, body) for name, body in bodies.items()}}
    except SweepConfigError as exc:
        raise SweepConfigError(exc.sweep, exc.field_path, exc.problem, origin=origin) from None


# --- mixture-weight sweeps ----------------------------------------------------------------------
# One run of the deployment trained once per set of mixture weights, as RegMix and Marin's mixture
# swarms do (many small runs whose per-source losses say how the weights matter). Each point is a
# `RunSpec`, the base run with the point's ``mixture_weights``, named ``<sweep>-w<i>``; the points are
# the partitions of the sweep's own checkpoint and eval assets, as a scaling sweep's runs are.


@typed_config
@dataclass(frozen=True)
class MixtureFitConfig:
    """How ``mixture_fit/<sweep>`` regresses the points' eval losses on their weights (`scaling.mixture`)."""

    target: tuple[str, ...] = identity(default=())
    """Eval sets whose mean metric the predicted best mixture minimises; empty: every set the runs evaluate."""
    metric: Literal["loss", "bpb"] = identity(default="loss")
    log_loss: bool = identity(default=False)
    """Regress log(metric) instead of the metric."""
    samples: int = identity(default=100_000)
    top_k: int = identity(default=100)
    seed: int = identity(default=0)
    interval: float = identity(default=0.9)

    def options(self) -> MixtureOptions:
        return MixtureOptions(log_loss=self.log_loss, samples=self.samples, top_k=self.top_k, seed=self.seed,
                              interval=self.interval)


@typed_config
@dataclass(frozen=True)
class MixtureSweepConfig:
    name: str = derived("the names of its runs")
    run: str = derived("its runs: that run's spec")
    """The run every point trains (a run of the deployment), its mixture's weights replaced by the point's."""
    weights: tuple[Mapping[str, float], ...] = derived("its runs' mixture_weights")
    """One run per entry, ``{component: weight}``; a component not named gets none."""
    fit: MixtureFitConfig = derived("mixture_fit/<sweep>'s identity", default_factory=MixtureFitConfig)
    """The regression of the points' losses on their weights (``mixture_fit/<sweep>``)."""

    def run_name(self, index: int) -> str:
        return f"{self.name}-w{index}"

    def runs(self, base: RunSpec) -> dict[str, RunSpec]:
        """The sweep's runs: ``base`` with each point's weights, by name."""
        return {self.run_name(i): dataclasses.replace(base, name=self.run_name(i), mixture_weights=dict(weights))
                for i, weights in enumerate(self.weights)}


def mixture_sweep_runs(config: MixtureSweepConfig, runs: Mapping[str, RunSpec]) -> dict[str, RunSpec]:
    """The sweep's runs over the deployment's ``runs``, each validated; MixtureSweepError naming the field."""
    base = runs.get(config.run)
    if base is None:
        raise MixtureSweepError(config.name, "run", f"no run named {config.run!r} (runs: {', '.join(sorted(runs))})")
    if base.cooldown is not None:
        raise MixtureSweepError(config.name, "run", f"run {config.run!r} is a cooldown; sweep the weights of a run "
                                                    "trained from its start")
    points = config.runs(base)
    for i, spec in enumerate(points.values()):
        try:
            validate_run(spec)
        except RunSpecError as exc:
            raise MixtureSweepError(config.name, f"weights[{i}]", exc.problem) from None
    return points


def validate_fit_target(config: MixtureSweepConfig, base: RunSpec, components: Mapping[str, float],
                        origin: str | None = None) -> None:
    """The fit's target sets are eval sets of the sweep's run (its ``eval_sets``, else every component
    of its mixture, ``components``); MixtureSweepError naming the first that is not."""
    evaluated = sorted(base.eval_sets or components)
    for i, eval_set in enumerate(config.fit.target):
        if eval_set not in evaluated:
            raise MixtureSweepError(config.name, f"fit.target[{i}]", f"run {config.run!r} does not evaluate "
                                                                     f"{eval_set!r} (it evaluates {evaluated})", origin)


def mixture_sweep_from_dict(name: str, raw: Any) -> MixtureSweepConfig:
    data = checked_body(name, raw, MixtureSweepError)
    try:
        config = decode(MixtureSweepConfig, {**data, "name": name})
    except FieldProblem as exc:
        raise MixtureSweepError(name, exc.dotted or "<mixture sweep>", exc.problem) from None
    if not config.weights:
        raise MixtureSweepError(name, "weights", "must list at least one set of weights")
    try:
        config.fit.options()
    except ValueError as exc:
        raise MixtureSweepError(name, "fit", str(exc)) from None
    if len(set(config.fit.target)) != len(config.fit.target):
        raise MixtureSweepError(name, "fit.target", "contains duplicates")
    return config


def extend_mixture_sweeps(sweeps: Mapping[str, MixtureSweepConfig], raw: Mapping[str, Any], runs: Mapping[str, RunSpec],
                          origin: str) -> dict[str, MixtureSweepConfig]:
    """``sweeps`` with those of ``raw`` (``{name: {...}}``, ``base:`` allowed) added, each checked
    against the deployment's ``runs``. Errors name ``origin``."""
    try:
        bodies = resolve_bases({str(name): body for name, body in raw.items()}, sweeps, MixtureSweepError)
        added = {name: mixture_sweep_from_dict(name, body) for name, body in bodies.items()}
        for config in added.values():
            mixture_sweep_runs(config, runs)
        return {**sweeps, **added}
    except MixtureSweepError as exc:
        raise MixtureSweepError(exc.sweep, exc.field_path, exc.problem, origin=origin) from None
