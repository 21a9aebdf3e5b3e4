"""The stages of the graph, in pipeline order. Each returns its definitions and catalog entries."""

from marin_assets.curation.assets import build_curation_stage
from marin_assets.curation.sources import DEFAULT_SOURCES_PATH, load_curation_config
from marin_assets.evaluation.assets import build_evaluation_stage
from marin_assets.tokenization.assets import MIXTURE_VERSION, build_tokenization_stage, deployment_registry
from marin_assets.reports.assets import build_reports_stage
from marin_assets.scaling_sweeps.assets import build_scaling_sweeps_stage
from marin_assets.training.assets import build_training_stage
from marin_resources.environments import MarinSettings


def curated_source_names(settings: MarinSettings) -> set[str]:
    return {s.name for s in load_curation_config(settings.sources_file or DEFAULT_SOURCES_PATH).sources}


def build_tokenization(settings: MarinSettings):
    return build_tokenization_stage(settings, curated_source_names(settings))


def build_training(settings: MarinSettings):
    registry = deployment_registry(settings, curated_source_names(settings))
    return build_training_stage(settings, {m: MIXTURE_VERSION for m in registry.mixtures},
                                {t: e.version for t, e in registry.tokenizers.items()}, pool=settings.train_pool)


def build_evaluation(settings: MarinSettings):
    registry = deployment_registry(settings, curated_source_names(settings))
    return build_evaluation_stage(settings, {s: e.tokenizer for s, e in registry.tokenized.items()},
                                  pool=settings.train_pool)


STAGES = [build_curation_stage, build_tokenization, build_training, build_evaluation, build_reports_stage,
          build_scaling_sweeps_stage]
