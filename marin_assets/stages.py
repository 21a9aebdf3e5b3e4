"""The stages of the graph, in pipeline order. Each returns its definitions and catalog entries."""

from __future__ import annotations

from marin_assets.curation.assets import build_curation_stage

STAGES = [build_curation_stage]
