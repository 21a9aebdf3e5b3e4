"""Where each run of the deployment keeps its results, and the `reports/run_comparison` asset: the
comparison of `marin compare` (`reports.compare`) in the web UI."""

import tempfile
from pathlib import Path

import dagster as dg

from marin_assets.catalog import Catalog
from marin_assets.deployment import Deployment
from marin_assets.evaluation.cross_eval import cross_eval_key
from marin_assets.reports.compare import (
    CompareError,
    RunKeys,
    RunResults,
    compare,
    load_run,
    markdown_table,
    plot_loss_curves,
)
from marin_assets.scaling_sweeps.assets import (
    SweepRuns,
    checkpoint_key,
    eval_key,
    harness_key,
    mixture_checkpoint_key,
    mixture_eval_key,
)
from marin_assets.scaling_sweeps.config import plan_sweep
from marin_assets.training.sft import SFT_CHECKPOINT_KEY, SFT_EVAL_KEY
from marin_resources.artifacts import MarinStore, input_refused
from marin_resources.display import png_markdown
from marin_resources.keys import asset_key, stage_owners
from marin_resources.storage.store import ArtifactStore

COMPARISON_KEY = "reports/run_comparison"


def run_locations(deployment: Deployment, store: ArtifactStore, catalog: Catalog) -> dict[str, RunKeys]:
    """Every run of the deployment: the named runs (runs.yaml) with their evaluations, and each
    sweep's runs (its fit runs, and the targets of its committed forecast) with the sweep's own, and
    each mixture-weight sweep's points with its own;
    each artifact's key and code version as its spec in ``catalog`` declares them. Evaluations this
    deployment does not build (a cross-evaluation on a cache no run's tokenizer reads, the harness of
    a sweep that forecasts no harness metric) are not looked for."""
    def located(key: str) -> tuple[str, str]:
        spec = catalog.spec(key)
        return spec.key, spec.version

    def declared(*keys: str) -> tuple[tuple[str, str], ...]:
        return tuple(located(k) for k in keys if k in catalog.specs)

    cross = [cross_eval_key(s) for s in sorted(deployment.tokenization.tokenized)]
    named = declared("eval", "harness_eval", *cross)
    checkpoint = located("checkpoint")
    locations = {run: RunKeys(checkpoint, named, f"marin materialize eval --partition {run}")
                 for run in deployment.runs}
    if deployment.sft_runs:  # fine-tuned runs beside their bases: `marin compare BASE SFT`
        sft = located(SFT_CHECKPOINT_KEY), declared(SFT_EVAL_KEY)
        for run in deployment.sft_runs:
            locations[run] = RunKeys(*sft, f"marin materialize {SFT_EVAL_KEY} --partition {run}")
    for sweep, config in sorted(deployment.sweeps.items()):
        evaluations = declared(eval_key(sweep), harness_key(sweep))
        sweep_checkpoint = located(checkpoint_key(sweep))
        for run in SweepRuns(plan_sweep(config)).names(store):
            locations.setdefault(run, RunKeys(sweep_checkpoint, evaluations,
                                              f"marin materialize {eval_key(sweep)} --partition {run}"))
    for sweep, mixture_sweep in sorted(deployment.mixture_sweeps.items()):
        keys = located(mixture_checkpoint_key(sweep)), declared(mixture_eval_key(sweep))
        for run in mixture_sweep.runs(deployment.runs[mixture_sweep.run]):
            locations.setdefault(run, RunKeys(*keys, f"marin materialize {mixture_eval_key(sweep)} --partition {run}"))
    return locations


def load_runs(deployment: Deployment, store: ArtifactStore, catalog: Catalog, names: list[str]) -> list[RunResults]:
    """The committed results of each named run, in the order given; `CompareError` (one line) for a
    run the deployment does not define or one never trained."""
    locations = run_locations(deployment, store, catalog)
    for name in names:
        if name not in locations:
            sft = f", an SFT run ({', '.join(sorted(deployment.sft_runs))})" if deployment.sft_runs else ""
            raise CompareError(f"unknown run {name!r}: neither a named run "
                               f"({', '.join(sorted(deployment.runs)) or 'none'}){sft}"
                               f" nor a run of a sweep ({', '.join(sorted(deployment.sweeps)) or 'none'})")
    return [load_run(store, name, locations[name]) for name in dict.fromkeys(names)]


class RunComparisonConfig(dg.Config):
    runs: list[str] = []
    """Runs to compare, named runs or sweep runs; empty: every named run with a committed checkpoint."""


def build_run_comparison_asset(deployment: Deployment, catalog: Catalog) -> dg.AssetsDefinition:
    checkpoint = catalog.spec("checkpoint")

    @dg.asset(key=asset_key(COMPARISON_KEY), group_name="reports", code_version="v1", owners=stage_owners("reports"),
              kinds={"markdown"},
              description="Runs side by side, as `marin compare` prints them: parameters, tokens, final train "
                          "loss, each eval set's loss and bits-per-byte (eval, harness_eval, cross_eval), each "
                          "harness task's accuracy and margin over chance; and their loss curves on one plot. "
                          "Read from the committed manifests; by default every named run that has a checkpoint, "
                          "or the runs given in the launchpad's config (`runs: [a, b]`).")
    def run_comparison(context: dg.AssetExecutionContext, config: RunComparisonConfig,
                       store: MarinStore) -> dg.MaterializeResult:
        artifacts = store.get()
        names = config.runs or [r for r in sorted(deployment.runs)
                                if artifacts.find(checkpoint.key, checkpoint.version, r) is not None]
        if not names:
            raise input_refused("no named run has a committed checkpoint to compare yet: "
                                "marin materialize eval --partition RUN")
        try:
            results = load_runs(deployment, artifacts, catalog, names)
        except CompareError as exc:
            raise input_refused(str(exc)) from None
        comparison = compare(results)
        metadata = {"runs": dg.MetadataValue.json(list(comparison.runs)),
                    "table": dg.MetadataValue.md(markdown_table(comparison)),
                    "comparison": dg.MetadataValue.json(comparison.to_dict())}
        if comparison.notes:
            metadata["notes"] = dg.MetadataValue.md("\n".join(f"- {n}" for n in comparison.notes))
        if any(r.curve for r in results):
            with tempfile.TemporaryDirectory(prefix="marin-compare-") as scratch:
                png = Path(plot_loss_curves(results, Path(scratch) / "loss_curves.png")).read_bytes()
            metadata["loss_curves"] = png_markdown(png, f"loss curves of {', '.join(comparison.runs)}")
        return dg.MaterializeResult(metadata=metadata)

    return run_comparison
