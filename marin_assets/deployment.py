"""What one deployment builds: its sources, tokenizers and mixtures, training runs, scaling sweeps
and eval suites, read once and handed to every stage by `stages.py`. Each part is the bundled YAML file (or
the file MARIN_SOURCES, MARIN_REGISTRY, MARIN_RUNS, MARIN_SWEEPS or MARIN_SUITES names instead), with
the project file's sections (`marin.yaml`, see `marin_resources.project`) on top.

Each part is already resolved against the others: the tokenization registry keeps the entries
whose sources are curated here, and runs and sweeps keep those whose mixture and tokenizer this
deployment builds. Reading it touches only those files, never the artifact store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from marin_assets.curation.config import (
    DEFAULT_SOURCES_PATH,
    CurationConfig,
    extend_curation_config,
    load_curation_config,
)
from marin_assets.evaluation.suites import SuiteRegistry, load_suites, parse_suites
from marin_assets.scaling_sweeps.config import (
    DEFAULT_SWEEPS_YAML,
    MixtureSweepConfig,
    MixtureSweepError,
    SweepConfig,
    extend_mixture_sweeps,
    extend_sweeps,
    load_sweeps,
    mixture_sweep_runs,
    validate_fit_target,
)
from marin_assets.tokenization.registry import (
    REGISTRY_PATH,
    TokenizationRegistry,
    load_registry,
    parse_registry,
    registry_for_sources,
)
from marin_assets.training.memory import plan_run
from marin_assets.training.sft import SFT_RUNS_SECTION, extend_sft_runs, validate_sft_data
from marin_assets.training.spec import (
    DEFAULT_RUNS_YAML,
    RunSpec,
    RunSpecError,
    extend_run_registry,
    load_run_registry,
    validate_mixture_components,
)
from marin_resources.environments import MarinSettings
from marin_resources.project import CURATION_SECTIONS, EVAL_SUITES_SECTION, REGISTRY_SECTIONS
from marin_resources.typed_config import ConfigError


@dataclass(frozen=True)
class Deployment:
    curation: CurationConfig
    tokenization: TokenizationRegistry
    runs: Mapping[str, RunSpec]
    """Named runs (runs.yaml) on a mixture and tokenizer built here."""
    sweeps: Mapping[str, SweepConfig]
    """Sweeps on a mixture and tokenizer built here."""
    mixture_sweeps: Mapping[str, MixtureSweepConfig] = field(default_factory=dict)
    """Mixture-weight sweeps of the project file (none built in), over runs built here."""
    suites: SuiteRegistry = field(default_factory=load_suites)
    """The eval suites, and which one each run's `harness_eval` runs."""
    sft_runs: Mapping[str, RunSpec] = field(default_factory=dict)
    """Supervised fine-tuning runs of the project file (``sft_runs:``, none built in) on a chat mixture
    built here, each from pretrained weights (`marin_assets.training.sft`)."""
    unfit_suites: Mapping[str, str] = field(default_factory=dict)
    """Run -> why the built-in default suite, which no setting chose for it, cannot evaluate it (its
    bits-per-byte sets use another tokenizer): its `harness_eval` refuses in that one line."""

    @classmethod
    def load(cls, settings: MarinSettings) -> Deployment:
        curation = load_curation_config(settings.sources_file or DEFAULT_SOURCES_PATH)
        registry = load_registry(settings.registry_file or REGISTRY_PATH)
        runs = load_run_registry(settings.runs_file or DEFAULT_RUNS_YAML)
        sweeps = load_sweeps(settings.sweeps_file or DEFAULT_SWEEPS_YAML)
        suites = load_suites(settings.suites_file)
        project = settings.project
        if project is not None:
            origin = str(project.path)
            curation = extend_curation_config(curation, project.part(CURATION_SECTIONS), project.directory, origin)
            registry = parse_registry(project.part(REGISTRY_SECTIONS), origin, extends=registry)
            runs = extend_run_registry(runs, project.sections.get("runs", {}), origin)
            sweeps = extend_sweeps(sweeps, project.sections.get("sweeps", {}), origin)
            if EVAL_SUITES_SECTION in project.sections:
                suites = parse_suites(project.sections[EVAL_SUITES_SECTION], f"{origin}: {EVAL_SUITES_SECTION}",
                                      extends=suites)
        if settings.eval_suite:
            suites = suites.with_default(settings.eval_suite, "MARIN_EVAL_SUITE")
        deployment = cls.resolve(curation, registry, runs, sweeps, suites)
        if project is not None:
            deployment.require_built(project.sections, str(project.path), {"runs": runs, "sweeps": sweeps})
            deployment = dataclasses.replace(deployment, mixture_sweeps=extend_mixture_sweeps(
                {}, project.sections.get("mixture_sweeps", {}), deployment.runs, str(project.path)))
            for config in deployment.mixture_sweeps.values():
                base = deployment.runs[config.run]
                components = deployment.tokenization.mixtures[base.mixture].weights
                for spec in mixture_sweep_runs(config, deployment.runs).values():
                    try:
                        validate_mixture_components(spec, components)
                    except RunSpecError as exc:
                        raise MixtureSweepError(config.name, "weights", exc.problem, origin=str(project.path)) from None
                validate_fit_target(config, base, components, origin=str(project.path))
        if project is not None and project.sections.get(SFT_RUNS_SECTION):
            deployment = dataclasses.replace(deployment, sft_runs=deployment.built_sft_runs(
                extend_sft_runs(runs, project.sections[SFT_RUNS_SECTION], str(project.path)), str(project.path)))
        for run in deployment.runs.values():
            try:
                validate_mixture_components(run, deployment.tokenization.mixtures[run.mixture].weights)
            except RunSpecError as exc:
                in_project = project is not None and run.name in project.sections.get("runs", {})
                origin = str(project.path) if in_project else str(settings.runs_file or DEFAULT_RUNS_YAML)
                raise RunSpecError(exc.run, exc.field_path, exc.problem, origin=origin) from None
        default_chosen = bool(settings.eval_suite) or (
            project is not None and "default_suite" in (project.sections.get(EVAL_SUITES_SECTION) or {}))
        deployment = dataclasses.replace(deployment, unfit_suites=deployment.require_fitting_suites(
            str(project.path) if project is not None else suites.path, default_chosen=default_chosen))
        # Before anything launches: a run that no compute setting fits into the memory of the devices
        # it names is refused here, by the tokenizer's target vocabulary (runtime placement, never identity).
        for run in (*deployment.runs.values(), *deployment.sft_runs.values()):
            plan_run(run, deployment.vocab_size(run), settings.gpu_type)
        return deployment

    def vocab_size(self, run: RunSpec) -> int:
        """The target vocabulary of the run's tokenizer (a trained tokenizer's is at most that)."""
        return self.tokenization.tokenizers[run.tokenizer].config.vocab_size

    @classmethod
    def resolve(cls, curation: CurationConfig, registry: TokenizationRegistry, runs: Mapping[str, RunSpec],
                sweeps: Mapping[str, SweepConfig], suites: SuiteRegistry | None = None) -> Deployment:
        """Keep what this deployment can build."""
        tokenization = registry_for_sources(registry, {s.name for s in curation.sources},
                                            frozenset(s.name for s in curation.sources if s.format == "chat"))

        def buildable(mixture: str, tokenizer: str) -> bool:
            return mixture in tokenization.mixtures and tokenizer in tokenization.tokenizers

        return cls(curation, tokenization,
                   {n: r for n, r in runs.items() if buildable(r.mixture, r.tokenizer)},
                   {n: s for n, s in sweeps.items() if buildable(s.mixture, s.tokenizer)},
                   suites=suites if suites is not None else load_suites())

    def require_fitting_suites(self, origin: str, *, default_chosen: bool) -> dict[str, str]:
        """ConfigError for a run whose eval suite, as the settings chose it (its `eval_suites.runs` entry, or a
        default suite the project file or MARIN_EVAL_SUITE set), measures bits-per-byte on a cache of another
        tokenizer: the config already shows the numbers would be meaningless, so it is refused before any
        build. A run the built-in default suite does not fit is not an error of the config (a project's own
        run, before it declares a suite): returned, run -> the one line its `harness_eval` refuses with."""
        tokenized = self.tokenization.tokenized
        unfit = {}
        for name, run in sorted(self.runs.items()):
            suite = self.suites.suite_of_run(name)
            explicit = name in self.suites.runs
            for source in suite.bpb:
                if source in tokenized and tokenized[source].tokenizer != run.tokenizer:
                    problem = (f"run {name!r} (tokenizer {run.tokenizer!r}) is evaluated with suite {suite.name!r} "
                               f"({f'runs.{name}' if explicit else 'default_suite'}), whose bpb set {source!r} is "
                               f"tokenized with tokenizer {tokenized[source].tokenizer!r}; name a suite for it under "
                               "eval_suites.runs (or set eval_suites.default_suite) in the project file "
                               "(docs/evaluation.md)")
                    if explicit or default_chosen:
                        raise ConfigError(f"{origin}: {problem}")
                    unfit[name] = problem
                    break
        return unfit

    def require_built(self, sections: Mapping[str, Any], origin: str,
                      declared: Mapping[str, Mapping[str, RunSpec | SweepConfig]]) -> None:
        """ConfigError naming ``origin`` for an entry of the project file that `resolve` would drop: a
        typo in a name must not make a run or a mixture silently disappear. ``declared``: every run and
        sweep as resolved before that (an entry declared by difference names its mixture through its base)."""
        tokenization = self.tokenization
        for name in sections.get("tokenizers") or {}:
            if name not in tokenization.tokenizers:
                raise ConfigError(f"{origin}: tokenizer {name!r}: train_on names a source that is not declared "
                                  f"(sources: {', '.join(sorted(self.source_names))})")
        for name, body in (sections.get("tokenized") or {}).items():
            if name not in tokenization.tokenized:
                raise ConfigError(f"{origin}: tokenized {name!r}: " + (
                    f"no source named {name!r} (sources: {', '.join(sorted(self.source_names))})"
                    if name not in self.source_names else f"tokenizer {body['tokenizer']!r} cannot be built here"))
        for name, body in (sections.get("mixtures") or {}).items():
            if name not in tokenization.mixtures:
                missing = sorted(set(body["components"]) - set(tokenization.tokenized))
                raise ConfigError(f"{origin}: mixture {name!r}: component(s) {missing} are not tokenized here "
                                  f"(tokenized: {', '.join(sorted(tokenization.tokenized))})")
        for run in (sections.get(EVAL_SUITES_SECTION) or {}).get("runs") or {}:
            if run not in self.runs:
                raise ConfigError(f"{origin}: {EVAL_SUITES_SECTION}.runs.{run}: no run of that name is built here "
                                  f"(runs: {', '.join(sorted(self.runs))})")
        for section, kept in (("runs", self.runs), ("sweeps", self.sweeps)):
            for name in sections.get(section) or {}:
                if name not in kept:
                    entry = declared[section][name]
                    raise ConfigError(f"{origin}: {section[:-1]} {name!r}: {self.mixture_not_built(entry)}")

    def built_sft_runs(self, sft_runs: Mapping[str, RunSpec], origin: str) -> dict[str, RunSpec]:
        """``sft_runs`` checked against what this deployment builds: each on a chat mixture and tokenizer
        built here, whose caches fit its sequence; ConfigError naming ``origin`` otherwise (a typo must
        not make a run disappear)."""
        mixtures = self.tokenization.mixtures
        for name, run in sorted(sft_runs.items()):
            try:
                if run.mixture not in mixtures or run.tokenizer != mixtures[run.mixture].tokenizer:
                    raise RunSpecError(name, "mixture", self.mixture_not_built(run))
                validate_sft_data(run, mixtures[run.mixture], self.tokenization.tokenized)
                validate_mixture_components(run, mixtures[run.mixture].weights)
            except RunSpecError as exc:
                raise RunSpecError(exc.run, exc.field_path, exc.problem, origin=origin) from None
        return dict(sft_runs)

    def mixture_not_built(self, entry: RunSpec | SweepConfig) -> str:
        """Why a run or sweep on a mixture (and tokenizer) this deployment does not build is refused."""
        built = ", ".join(f"{m} ({e.tokenizer})" for m, e in sorted(self.tokenization.mixtures.items()))
        return f"mixture {entry.mixture!r} with tokenizer {entry.tokenizer!r} is not built here (mixtures: {built})"

    @property
    def source_names(self) -> set[str]:
        return {s.name for s in self.curation.sources}

