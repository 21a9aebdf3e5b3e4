"""The marin code location: every asset, check, resource, sensor, schedule and job.

Loading this module must stay cheap (no jax, levanter, haliax or ray): those are imported
inside the processes that train. `benchmarks/load_time.py` measures it.
"""

from __future__ import annotations

import dagster as dg

from marin_assets import hide_dagster_notices
from marin_assets.catalog import Catalog
from marin_resources.dagster_private import end_code_server_when_it_stops, warm_run_workers
from marin_resources.environments import MarinSettings, build_resources, default_executor


def build_definitions(settings: MarinSettings) -> tuple[dg.Definitions, Catalog]:
    from marin_assets.stages import build_stages

    parts = build_stages(settings)
    catalog = Catalog()
    for _, stage_catalog in parts:
        catalog = catalog.merge(stage_catalog)
    defs = dg.Definitions.merge(*(d for d, _ in parts), dg.Definitions(resources=build_resources(settings),
                                                                       executor=default_executor()))
    return defs, catalog


hide_dagster_notices()
# A code server serving this location starts each run in a process that has imported this module
# already (docs/operations.md, "Run workers").
warm_run_workers(__name__)
# ...and ends without the interpreter's teardown once it stops (marin_resources/process_exit.py).
end_code_server_when_it_stops()
settings = MarinSettings.from_env()
defs, catalog = build_definitions(settings)
