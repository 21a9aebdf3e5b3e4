"""The stages of the graph, in pipeline order. Each returns its definitions and catalog entries."""

from marin_assets.curation.assets import build_curation_stage
from marin_assets.curation.sources import DEFAULT_SOURCES_PATH, load_curation_config
from marin_assets.tokenization.assets import build_tokenization_stage
from marin_resources.environments import MarinSettings


def curated_source_names(settings: MarinSettings) -> set[str]:
    return {s.name for s in load_curation_config(settings.sources_file or DEFAULT_SOURCES_PATH).sources}


def build_tokenization(settings: MarinSettings):
    return build_tokenization_stage(settings, curated_source_names(settings))


STAGES = [build_curation_stage, build_tokenization]
