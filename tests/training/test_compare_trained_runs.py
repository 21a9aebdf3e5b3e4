"""Two real tiny runs trained and evaluated through the assets, then cross-evaluated and compared."""

import shutil

import dagster as dg
import pytest
from conftest import tiny_spec

from marin_assets.curation.assets import build_curation_stage
from marin_assets.evaluation.cross_eval import build_cross_eval_stage
from marin_assets.reports.compare import compare, loss_curves, plot_loss_curves, text_table
from marin_assets.reports.comparison import load_runs
from marin_assets.stages import build_catalog, build_stage
from marin_assets.tokenization.assets import MIXTURE_VERSION, TOKENIZED_VERSION, build_tokenization_stage
from marin_assets.training.assets import build_training_stage
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import UpstreamRef, producer_info, writing


def commit(store, key: str, version: str, *, config, copy_from=None, files=None, upstream=()):
    """An upstream artifact committed by hand: a directory copied in, or small files."""
    with writing(store, key, version, None, fingerprint=fingerprint(config), run_id="test") as writer:
        if copy_from is not None:
            shutil.copytree(copy_from, writer.staging_dir(), dirs_exist_ok=True)
        for name, data in (files or {}).items():
            writer.write_json(name, data)
        return writer.commit(config=config, upstream=list(upstream), producer=producer_info("test"))


def ref(manifest) -> UpstreamRef:
    return UpstreamRef(manifest.asset_key, manifest.partition, manifest.data_version, manifest.uri)


@pytest.mark.slow
def test_two_trained_runs_side_by_side_and_one_scored_on_a_cache_by_cross_eval(tmp_path, tiny_artifact,
                                                                               synthetic_deployment):
    cache_root, tokenizer_dir = tiny_artifact
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    resources = build_resources(settings)
    store = resources["store"].get()
    # What the tokenization stage would have committed: tokenizer/t, tokenized/src and mixture/m.
    tokenizer = commit(store, "tokenizer/t", "v1", config={"t": 1}, copy_from=tokenizer_dir)
    tokenized = commit(store, "tokenized/src", TOKENIZED_VERSION, config={"src": 1}, copy_from=cache_root,
                       upstream=[ref(tokenizer)])
    commit(store, "mixture/m", MIXTURE_VERSION, config={"m": 1}, upstream=[ref(tokenized)],
           files={"data.json": {"tokenizer": tokenizer.uri, "cache_dir": None, "train_weights": {"src": 1.0},
                                "configs": {"src": {"cache_dir": tokenized.uri, "train_urls": [],
                                                    "validation_urls": []}}}})
    runs = {"a": tiny_spec("a", steps=30, mixture="m", tokenizer="t"),
            "b": tiny_spec("b", steps=20, mixture="m", tokenizer="t", train_batch_size=16)}
    deployment = synthetic_deployment(runs=runs)
    stages = [build_stage(build, settings, deployment)[0] for build in (
        build_curation_stage, build_tokenization_stage, build_training_stage, build_cross_eval_stage)]
    assets = [a for defs in stages for a in defs.assets]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", sorted(runs))
        for run in runs:
            result = dg.materialize(assets, selection=[asset_key("checkpoint"), asset_key("eval")], partition_key=run,
                                    instance=instance, resources=resources)
            assert result.success
        cross = dg.materialize(assets, selection=[asset_key("cross_eval/src")], partition_key="a", instance=instance,
                               resources=resources)
        assert cross.success

        # The cross-evaluation rewrote the run's config to read only tokenized/src, the cache its
        # mixture also validates on: the same sequences, so the same loss as eval[a] to float precision.
        own = store.find("eval", "v1", "a").metrics
        scored = store.find("cross_eval/src", "v1", "a")
        assert scored.metrics["eval/src/tokens"] == own["eval/src/tokens"]
        assert scored.metrics["eval/src/loss"] == pytest.approx(own["eval/src/loss"], rel=1e-4)
        assert {u.asset_key for u in scored.upstream} == {"checkpoint", "tokenized/src"}

        # A cache built with another version of the tokenizer is refused before any process starts.
        commit(store, "tokenized/src", TOKENIZED_VERSION, config={"src": 2}, copy_from=cache_root,
               upstream=[UpstreamRef("tokenizer/t", None, "f" * 64, tokenizer.uri)])
        refused = dg.materialize(assets, selection=[asset_key("cross_eval/src")], partition_key="b",
                                 instance=instance, resources=resources, raise_on_error=False)
        assert not refused.success
        [failure] = [e for e in refused.all_events if e.event_type_value == "STEP_FAILURE"]
        error = failure.event_specific_data.error
        assert error.cls_name == "Failure" and error.message.partition(": ")[2].startswith(
            f"cross_eval/src[b]: run 'b' was trained with tokenizer/t at "
            f"data version {tokenizer.data_version[:12]}, tokenized/src was built with it at ffffffffffff")
        assert store.find("cross_eval/src", "v1", "b") is None

    results = load_runs(deployment, store, build_catalog(settings, deployment), ["a", "b"])
    comparison = compare(results)
    rows = dict(comparison.rows)
    assert rows["steps"] == (30, 20) and rows["tokens trained"] == (30 * 8 * 64, 20 * 16 * 64)
    assert all(loss > 0 for loss in rows["eval src loss"] + rows["eval src bpb"] + rows["final train loss"])
    assert rows["eval src loss"][0] == own["eval/src/loss"] and not comparison.notes
    x_label, curves = loss_curves(results)
    assert x_label == "tokens trained" and [len(c.x) for c in curves] == [30, 20]
    plot_loss_curves(results, tmp_path / "compare.png")
    table = text_table(comparison).splitlines()
    assert table[0].split() == ["metric", "a", "b"] and (tmp_path / "compare.png").stat().st_size > 0
