"""What one deployment builds: its sources, tokenizers and mixtures, training runs and scaling
sweeps, read once from their YAML files (MARIN_SOURCES, MARIN_REGISTRY, MARIN_RUNS, MARIN_SWEEPS,
else the bundled ones) and handed to every stage by `stages.py`.

Each part is already resolved against the others: the tokenization registry keeps the entries
whose sources are curated here, and runs and sweeps keep those whose mixture and tokenizer this
deployment builds. Reading it touches only those files, never the artifact store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from marin_assets.curation.sources import DEFAULT_SOURCES_PATH, CurationConfig, load_curation_config
from marin_assets.scaling_sweeps.config import DEFAULT_SWEEPS_YAML, SweepConfig, load_sweeps
from marin_assets.tokenization.registry import (
    MIXTURE_VERSION,
    REGISTRY_PATH,
    TokenizationRegistry,
    load_registry,
    registry_for_sources,
)
from marin_assets.training.spec import DEFAULT_RUNS_YAML, RunSpec, check_memory_fit, load_run_registry
from marin_resources.environments import MarinSettings
from marin_resources.placement import device_memory


@dataclass(frozen=True)
class Deployment:
    curation: CurationConfig
    tokenization: TokenizationRegistry
    runs: Mapping[str, RunSpec]
    """Named runs (runs.yaml) on a mixture and tokenizer built here."""
    sweeps: Mapping[str, SweepConfig]
    """Sweeps on a mixture and tokenizer built here."""

    @classmethod
    def load(cls, settings: MarinSettings) -> Deployment:
        curation = load_curation_config(settings.sources_file or DEFAULT_SOURCES_PATH)
        deployment = cls.resolve(curation, load_registry(settings.registry_file or REGISTRY_PATH),
                                 load_run_registry(settings.runs_file or DEFAULT_RUNS_YAML),
                                 load_sweeps(settings.sweeps_file or DEFAULT_SWEEPS_YAML))
        # Before anything launches: a run too big for the devices it names is refused here, by the
        # tokenizer's target vocabulary and the devices' memory (runtime placement, never identity).
        for run in deployment.runs.values():
            check_memory_fit(run, deployment.tokenization.tokenizers[run.tokenizer].config.vocab_size,
                             device_memory(run.resources, settings.gpu_type))
        return deployment

    @classmethod
    def resolve(cls, curation: CurationConfig, registry: TokenizationRegistry, runs: Mapping[str, RunSpec],
                sweeps: Mapping[str, SweepConfig]) -> Deployment:
        """Keep what this deployment can build."""
        tokenization = registry_for_sources(registry, {s.name for s in curation.sources})

        def buildable(mixture: str, tokenizer: str) -> bool:
            return mixture in tokenization.mixtures and tokenizer in tokenization.tokenizers

        return cls(curation, tokenization,
                   {n: r for n, r in runs.items() if buildable(r.mixture, r.tokenizer)},
                   {n: s for n, s in sweeps.items() if buildable(s.mixture, s.tokenizer)})

    @property
    def source_names(self) -> set[str]:
        return {s.name for s in self.curation.sources}

    @property
    def mixture_versions(self) -> dict[str, str]:
        return {m: MIXTURE_VERSION for m in self.tokenization.mixtures}

    @property
    def tokenizer_versions(self) -> dict[str, str]:
        return {t: e.version for t, e in self.tokenization.tokenizers.items()}
