"""The stages of the graph, in pipeline order. Each takes the runtime settings, the deployment (read
once, here) and the catalog of the stages before it, whose artifact specs it reads its inputs
from, and returns its definitions and its own catalog."""

import dagster as dg

from marin_assets.automation import build_automation_sensors
from marin_assets.catalog import Catalog
from marin_assets.curation.assets import build_curation_stage
from marin_assets.deployment import Deployment
from marin_assets.evaluation.assets import build_evaluation_stage
from marin_assets.evaluation.cross_eval import build_cross_eval_stage
from marin_assets.export.assets import build_export_stage
from marin_assets.jobs import build_stage_jobs
from marin_assets.reports.assets import build_reports_stage
from marin_assets.scaling_sweeps.assets import build_scaling_sweeps_stage
from marin_assets.tokenization.assets import build_tokenization_stage
from marin_assets.training.assets import build_training_stage
from marin_resources.environments import MarinSettings

STAGES = [build_curation_stage, build_tokenization_stage, build_training_stage, build_export_stage,
          build_scaling_sweeps_stage, build_evaluation_stage, build_cross_eval_stage, build_reports_stage]


def build_stages(settings: MarinSettings) -> list[tuple]:
    """Every stage's (definitions, catalog), all built from one `Deployment`, then the automation sensors
    and a job per stage (`marin_assets/jobs.py`)."""
    deployment = Deployment.load(settings)
    stages, upstream = [], Catalog()
    for stage in STAGES:
        defs, catalog = stage(settings, deployment, upstream)
        stages.append((defs, catalog))
        upstream = upstream.merge(catalog)
    stage_defs = [defs for defs, _ in stages]
    across = dg.Definitions(sensors=build_automation_sensors(stage_defs), jobs=build_stage_jobs(stage_defs))
    return stages + [(across, Catalog())]


def build_stage(stage, settings: MarinSettings, deployment: Deployment) -> tuple[dg.Definitions, Catalog]:
    """One stage as `build_stages` builds it: with the catalog of the stages before it."""
    return stage(settings, deployment, catalog_before(STAGES.index(stage), settings, deployment))


def build_catalog(settings: MarinSettings, deployment: Deployment) -> Catalog:
    """Every stage's specs, without the rest of the definitions (`marin compare`)."""
    return catalog_before(len(STAGES), settings, deployment)


def catalog_before(count: int, settings: MarinSettings, deployment: Deployment) -> Catalog:
    """The specs of the first ``count`` stages."""
    upstream = Catalog()
    for earlier in STAGES[:count]:
        upstream = upstream.merge(earlier(settings, deployment, upstream)[1])
    return upstream
