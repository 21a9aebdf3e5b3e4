"""What `marin materialize` prints once it built an evaluation or an export: the figures a
researcher looks for, from the committed manifest, through the specs the deployment's catalog holds
(curation's counts: tests/curation/test_filter_report.py)."""

import pytest

from marin_assets.deployment import Deployment
from marin_assets.stages import build_catalog
from marin_resources.environments import MarinSettings
from marin_resources.storage.store import ArtifactStore, producer_info, writing


@pytest.fixture
def catalog_and_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MARIN_PREFIX", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    settings = MarinSettings.from_env()
    return build_catalog(settings, Deployment.load(settings)), ArtifactStore(str(tmp_path / "store"))


def commit(store, key: str, partition: str, metrics: dict):
    with writing(store, key, "v1", partition, fingerprint="e" * 64, run_id="t") as writer:
        with writer.open("report.json") as fh:
            fh.write(b"{}")
        return writer.commit(config={}, upstream=[], producer=producer_info("t"), metrics=metrics)


def test_an_evaluation_prints_its_loss_and_bits_per_byte_on_each_set(catalog_and_store):
    catalog, store = catalog_and_store
    manifest = commit(store, "eval", "nano-shakespeare", {
        "eval/shakespeare/loss": 5.13155293784352, "eval/shakespeare/bpb": 2.421663097056198,
        "eval/shakespeare/tokens": 282575, "eval/shakespeare/bytes": 836105, "eval/other/loss": 6.5})
    lines = ["eval other: loss 6.5000", "eval shakespeare: loss 5.1316, bpb 2.4217 over 282,575 tokens"]
    assert catalog.spec("eval").results(manifest) == lines
    assert catalog.spec("sweep_eval/demo").results(manifest) == lines  # a sweep's runs print theirs too


def test_an_export_prints_where_it_is_and_how_closely_transformers_agree(catalog_and_store):
    catalog, store = catalog_and_store
    manifest = commit(store, "hf_model", "nano-shakespeare", {"max_abs_logit_difference": 3.1e-06,
                                                              "greedy_matches": True, "parameters": 2098304})
    assert catalog.spec("hf_model").results(manifest) == [
        f"Hugging Face model at {manifest.uri} (transformers' logits within 3.1e-06 of Levanter's, greedy "
        "generation the same)"]
