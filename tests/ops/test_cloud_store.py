"""The store and the IO managers, unchanged, on s3:// and gs:// (local emulators)."""

import dagster as dg
import pytest

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import ArtifactHandleIOManager, Built, MarinStore, marin_asset, materialize_artifact
from marin_resources.io_managers import ValueIOManagerFactory
from marin_resources.keys import asset_key
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.retry import with_retries
from marin_resources.storage.store import ArtifactStore, producer_info, writing


@pytest.fixture(params=["s3", "gcs"])
def cloud(request):
    return request.getfixturevalue(f"{request.param}_prefix")


def test_commit_read_verify_on_object_store(cloud):
    prefix, options = cloud
    store = ArtifactStore(prefix, options)
    assert not store.is_local
    with writing(store, "raw/letters", "v1", "s1", fingerprint=fingerprint({}), run_id="r1") as w:
        with w.open("files/a.txt") as fh:
            fh.write(b"hello")
        (w.staging_dir() / "local.txt").write_text("from a tool that needs a path")
        m = w.commit(config={}, upstream=[], producer=producer_info("r1"))
    found = store.find("raw/letters", "v1", "s1")
    assert found.data_version == m.data_version
    assert sorted(f.path for f in found.files) == ["files/a.txt", "local.txt"]
    assert store.verify(found) == []
    assert not store.fs.exists(store.fs_path(found.uri) + "/.lock")
    # Uncommitted writes are invisible.
    w2 = store.begin("raw/letters", "v1", "s2", fingerprint=fingerprint({}), run_id="r2")
    with w2.open("x.bin") as fh:
        fh.write(b"partial")
    w2.release()
    assert store.find("raw/letters", "v1", "s2") is None


def test_a_rebuild_keeps_the_committed_artifact_readable_on_object_store(cloud):
    prefix, options = cloud
    store = ArtifactStore(prefix, options)

    def rebuild(text: bytes, *, commit: bool, resume: bool = False):
        with writing(store, "raw/letters", "v1", "s1", fingerprint=fingerprint({}), run_id="r",
                     resume=resume) as w:
            with w.open("files/a.txt", "wb") as fh:
                fh.write(text)
            return w.commit(config={}, upstream=[], producer=producer_info("r")) if commit else None

    first = rebuild(b"committed", commit=True)
    rebuild(b"half written", commit=False)  # stopped before its commit
    rebuild(b"rewritten in place", commit=False, resume=True)
    assert store.find("raw/letters", "v1", "s1") is None
    kept = store.find_previous("raw/letters", "v1", "s1")
    assert kept.data_version == first.data_version and store.verify(kept) == []
    second = rebuild(b"rebuilt", commit=True)
    assert store.find_previous("raw/letters", "v1", "s1") is None and store.verify(second) == []
    assert not store.fs.exists(f"{store.fs_path(second.uri)}/.previous")


def test_assets_and_io_managers_on_object_store(cloud, tmp_path):
    prefix, options = cloud
    store = MarinStore(prefix=prefix, storage_options=options)

    spec = ArtifactSpec.fixed("cloud/blob", "v1", {"k": 1})

    @marin_asset(spec)
    def blob(context: dg.AssetExecutionContext, store: MarinStore):
        def build(w):
            with w.open("blob.txt") as fh:
                fh.write(b"in the bucket")
            return Built(metrics={"n": 1})
        return materialize_artifact(context, store, spec, upstream=[], build=build)

    @dg.asset(key=["cloud", "summary"], ins={"blob": dg.AssetIn(key=asset_key("cloud/blob"))})
    def summary(blob) -> dict:
        return {"uri": blob.uri}

    resources = {"store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store),
                 "io_manager": ValueIOManagerFactory(store=store)}
    with dg.instance_for_test() as instance:
        first = dg.materialize([blob, summary], resources=resources, instance=instance)
        again = dg.materialize([blob], resources=resources, instance=instance)
    assert first.success
    assert again.asset_materializations_for_node("cloud__blob_cloud")[0].metadata["marin/reused"].value is True
    assert first.output_for_node("cloud__summary")["uri"].startswith(prefix)
    assert ArtifactStore(prefix, options).find("cloud/summary", "v1", None) is not None


def test_transient_errors_are_retried_with_backoff():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("injected fault")
        return "ok"

    assert with_retries(flaky, sleep=sleeps.append) == "ok"
    assert len(calls) == 3 and len(sleeps) == 2 and sleeps[1] > 0
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("permanent")), sleep=sleeps.append)


def test_store_survives_injected_faults_on_object_store(s3_prefix, monkeypatch):
    prefix, options = s3_prefix
    store = ArtifactStore(prefix, options)
    with writing(store, "raw/x", "v1", None, fingerprint="f", run_id="r") as w:
        with w.open("a.txt") as fh:
            fh.write(b"abc")
        real_pipe = store.fs.pipe_file
        failures = iter([True, True, False])

        def flaky_pipe(path, data, **kw):
            if path.endswith(".artifact.json") and next(failures, False):
                raise ConnectionError("injected: connection reset by peer")
            return real_pipe(path, data, **kw)

        monkeypatch.setattr(store.fs, "pipe_file", flaky_pipe)
        monkeypatch.setattr("marin_resources.storage.retry.time.sleep", lambda s: None)
        w.commit(config={}, upstream=[], producer={})
    assert store.find("raw/x", "v1", None) is not None
