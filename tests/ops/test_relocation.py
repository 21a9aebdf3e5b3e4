"""A store copied to another prefix (the original deleted) still holds a complete, verifiable graph:
manifests and the mixture's Levanter config refer to other artifacts by store-relative URIs,
resolved against the prefix they are read from."""

import json
import shutil

import dagster as dg
import pytest
import yaml

from marin_assets.catalog import Catalog
from marin_assets.planning import Planner
from marin_assets.run_submission import InProcessRuns
from marin_assets.tokenization.assets import build_mixture_asset, read_mixture_config
from marin_assets.tokenization.registry import MIXTURE_VERSION, MixtureEntry
from marin_assets.training.assets import relocated_train_config
from marin_resources.artifacts import VERSION_METADATA_KEY, ArtifactHandle, ArtifactHandleIOManager, MarinStore
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.lineage import build_lineage
from marin_resources.storage.store import MANIFEST_NAME, STORE_SCHEME, ArtifactStore, UpstreamRef, writing

BODY = ("The harbour master counted the boats at dawn and wrote each name in a heavy green ledger. "
        "Gulls argued over the nets while the tide turned slowly against the stone wall of the pier. ")
MIXTURE = MixtureEntry("harbour", "harbour_bpe", {"letters": 1.0})


def commit_stand_in(store: ArtifactStore, key: str, upstream: list[UpstreamRef]) -> ArtifactHandle:
    """A committed tokenizer or cache (its bytes do not matter here, its references do)."""
    with writing(store, key, "v1", None, fingerprint=fingerprint({}), run_id="stand-in") as writer:
        writer.write_json("stand-in.json", {"key": key})
        return ArtifactHandle.from_manifest(writer.commit(config={}, upstream=upstream, producer={}))


def mixture_defs(prefix: str):
    specs = [dg.AssetSpec(asset_key(k), metadata={VERSION_METADATA_KEY: "v1"})
             .with_io_manager_key("artifact_io_manager") for k in ("tokenized/letters", "tokenizer/harbour_bpe")]
    store = MarinStore(prefix=prefix)
    return dg.Definitions(assets=[*specs, build_mixture_asset(MIXTURE, Catalog())],
                          resources={"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)})


def every_manifest(store: ArtifactStore):
    root = store.local_path(store.prefix)
    return [store.read_manifest(str(p.parent)) for p in sorted(root.rglob(MANIFEST_NAME))]


@pytest.mark.slow  # a curation build and a mixture
def test_a_copied_store_verifies_and_serves_from_its_new_prefix(curation_planner, tmp_path):
    data = tmp_path / "letters"
    data.mkdir()
    (data / "harbour.txt").write_text("Letter one. " + BODY * 6)
    plan = curation_planner(f"sources:\n  - name: letters\n    uri: {data}/*.txt\n    format: text\n")
    plan.discover()
    assert all(s.success for s in plan.materialize(asset_key("deduplicated/letters"), None, log=lambda m: None,
                                                   runs=InProcessRuns(plan.defs, plan.instance)))
    old = plan.store
    corpus = old.find("deduplicated/letters", "v1", None)
    tokenizer = commit_stand_in(old, "tokenizer/harbour_bpe", [])
    commit_stand_in(old, "tokenized/letters", [ArtifactHandle.from_manifest(corpus).ref(), tokenizer.ref()])
    defs = mixture_defs(old.prefix)
    with dg.instance_for_test() as instance:
        assert dg.materialize([*defs.assets], selection=[asset_key("mixture/harbour")], resources=defs.resources,
                              instance=instance).success
    mixture_uri = old.find("mixture/harbour", MIXTURE_VERSION, None).uri
    on_disk = json.loads((old.local_path(mixture_uri) / "data.json").read_text())
    assert on_disk["tokenizer"].startswith(STORE_SCHEME) and str(tmp_path) not in json.dumps(on_disk)

    moved = tmp_path / "moved" / "store"
    shutil.copytree(tmp_path / "store", moved)
    shutil.rmtree(tmp_path / "store")
    store = ArtifactStore(str(moved))

    manifests = every_manifest(store)
    assert len(manifests) >= 7  # raw, documents, filtered, dedup index, deduplicated, tokenizer, cache, mixture
    for manifest in manifests:
        assert f"{tmp_path}/store/" not in (store.local_path(manifest.uri) / MANIFEST_NAME).read_text()
        root = build_lineage(store, manifest, verify=True)  # what `marin lineage --verify` walks
        problems = [p for node in root.unique() for p in node.problems]
        assert not problems, (manifest.uri, problems)
        assert all(n.uri.startswith(store.prefix) for n in root.unique() if not n.external)

    # The reused mixture serves its caches and tokenizer from the new place.
    handle = ArtifactHandle.from_manifest(store.find("mixture/harbour", MIXTURE_VERSION, None))
    config = read_mixture_config(store, handle)
    assert config["tokenizer"] == store.find("tokenizer/harbour_bpe", "v1", None).uri
    assert config["tokenizer"] == tokenizer.uri.replace(old.prefix, store.prefix)
    assert {c["cache_dir"] for c in config["configs"].values()} == {store.find("tokenized/letters", "v1", None).uri}
    defs = mixture_defs(store.prefix)
    with dg.instance_for_test() as instance:
        again = dg.materialize([*defs.assets], selection=[asset_key("mixture/harbour")], resources=defs.resources,
                               instance=instance)
        [event] = again.asset_materializations_for_node(asset_key("mixture/harbour").to_python_identifier())
        assert event.metadata["marin/reused"].value is True
        # Every artifact of the moved store is fresh for a planner that reads it there.
        moved_plan = Planner(plan.defs, plan.catalog, store, instance)
        moved_plan.discover()
        assert {s.state for s in moved_plan.status()} == {"fresh"}


def test_a_checkpoint_config_is_read_relative_to_where_the_checkpoint_is(tmp_path):
    store = ArtifactStore(str(tmp_path / "new"))
    old = "/mnt/old-disk/store"
    text = yaml.safe_dump({"trainer": {"checkpointer": {"base_path": f"{old}/checkpoint/v1/tiny/checkpoints"}},
                           "data": {"tokenizer": f"{old}/tokenizer/bpe/v1", "other": "/elsewhere/file"}})
    moved = yaml.safe_load(relocated_train_config(text, f"{store.prefix}/checkpoint/v1/tiny", store))
    assert moved["trainer"]["checkpointer"]["base_path"] == f"{store.prefix}/checkpoint/v1/tiny/checkpoints"
    assert moved["data"] == {"tokenizer": f"{store.prefix}/tokenizer/bpe/v1", "other": "/elsewhere/file"}
    here = relocated_train_config(relocated_train_config(text, f"{store.prefix}/checkpoint/v1/tiny", store),
                                  f"{store.prefix}/checkpoint/v1/tiny", store)
    assert yaml.safe_load(here) == moved  # already in place: unchanged
