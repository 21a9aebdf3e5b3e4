"""Identity in the path, without Dagster: configs side by side with a ref naming the current one,
`gc` keeping what is current, pinned or an input of either, `migrate` from the old layout, and a
signed bill of materials that fails when one byte of any artifact changes."""

import json
import os

import pytest

from marin_resources.storage.gc import OldLayoutError, add_pin, plan_gc, read_pins, run_gc
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.lineage import bill_of_materials, build_lineage
from marin_resources.storage.migrate import migrate
from marin_resources.storage.signing import generate_keypair, sign_bom, verify_signed_bom
from marin_resources.storage.store import (
    MANIFEST_NAME,
    ArtifactStore,
    FileEntry,
    Manifest,
    UpstreamRef,
    content_data_version,
    producer_info,
    writing,
)
from tests.ops.conftest import gcs_prefix, gcs_server, s3_prefix, s3_server  # noqa: F401 - fixtures


def commit(store, key, partition, text, config, upstream=(), version="v1"):
    with writing(store, key, version, partition, fingerprint=fingerprint(config), run_id="run-test") as w:
        with w.open("data.txt") as fh:
            fh.write(text.encode())
        return w.commit(config=config, upstream=list(upstream), producer=producer_info("run-test"))


def ref(manifest):
    return UpstreamRef(manifest.asset_key, manifest.partition, manifest.data_version, manifest.uri)


def test_two_configs_sit_side_by_side_and_the_ref_names_the_current_one(tmp_path):
    store = ArtifactStore(str(tmp_path))
    small = commit(store, "filtered/x", "p", "small", {"min_words": 5})
    large = commit(store, "filtered/x", "p", "large", {"min_words": 50})
    assert small.uri == f"{tmp_path}/filtered/x/v1-{fingerprint({'min_words': 5})[:8]}/p"
    assert large.uri != small.uri and os.path.exists(f"{small.uri}/data.txt")
    assert store.find("filtered/x", "v1", "p").uri == large.uri  # the last commit is current
    assert store.find("filtered/x", "v1", "p", fingerprint=small.fingerprint).data_version == small.data_version
    assert store.point(small) is True and store.point(small) is False  # going back is one small write
    assert store.find("filtered/x", "v1", "p").uri == small.uri
    assert store.versions("filtered/x") == sorted([("v1", small.fingerprint[:8]), ("v1", large.fingerprint[:8])])
    assert store.code_versions("filtered/x") == ["v1"]


@pytest.fixture
def versions(tmp_path):
    """raw/x[p] once; filtered/x[p] under two configs, each built from raw; a pinned-able old one."""
    store = ArtifactStore(str(tmp_path))
    raw = commit(store, "raw/x", "p", "raw bytes", {"shard": "p"})
    old = commit(store, "filtered/x", "p", "old", {"min_words": 5}, [ref(raw)])
    new = commit(store, "filtered/x", "p", "new", {"min_words": 50}, [ref(raw)])
    older_code = commit(store, "filtered/x", "p", "v0", {"min_words": 5}, [ref(raw)], version="v0")
    assets = {"raw/x": (True, "v1"), "filtered/x": (True, "v1")}
    return store, raw, old, new, older_code, assets


def test_gc_removes_what_nothing_current_references(versions):
    store, raw, old, new, older_code, assets = versions
    plan = plan_gc(store, assets, current=[new])
    assert sorted(u for u, _ in plan.removed) == sorted([old.uri, older_code.uri])
    assert set(plan.kept) == {new.uri, raw.uri}  # the input of a current artifact stays
    assert plan.removed_bytes > 0
    run_gc(store, plan)
    assert not os.path.exists(old.uri) and not os.path.exists(older_code.uri)
    assert not os.path.exists(old.uri.rsplit("/", 1)[0])  # the emptied identity directory goes too
    assert store.find("filtered/x", "v1", "p").uri == new.uri and store.find("raw/x", "v1", "p") is not None
    assert store.find("filtered/x", "v0", "p") is None  # its ref was removed with it
    assert plan_gc(store, assets, current=[new]).removed == []


def test_gc_keeps_pins_keep_patterns_and_leased_directories(versions):
    store, raw, old, new, older_code, assets = versions
    assert add_pin(store, older_code.uri) == older_code.uri[len(store.prefix) + 1:]
    assert read_pins(store) == [f"filtered/x/v0-{older_code.fingerprint[:8]}/p"]
    writer = store.begin("filtered/x", "v1", "q", fingerprint=fingerprint({"min_words": 7}), run_id="busy")
    try:
        plan = plan_gc(store, assets, current=[new], keep=[f"filtered/x/v1-{old.fingerprint[:8]}/*"])
        assert plan.removed == []
        assert {older_code.uri, old.uri, new.uri, raw.uri} <= set(plan.kept)
        assert [why for uri, why in plan.skipped if uri == writer.uri] == ["a writer holds its lease"]
    finally:
        writer.release()


def write_old_layout(store, key, partition, text, config, upstream=(), name="data.txt"):
    """An artifact as the `{key}/{code_version}/{partition}` layout committed it."""
    uri = "/".join([store.prefix, key, "v1"] + ([partition] if partition else []))
    store.fs.makedirs(store.fs_path(uri), exist_ok=True)
    store.fs.pipe(store.fs_path(f"{uri}/{name}"), text.encode())
    files = [store.hash_file(uri, name)]
    manifest = Manifest(key, partition, "v1", fingerprint(config), config, content_data_version(files), files,
                        list(upstream), producer_info("old"), "t0", "t1", {}, uri)
    store.write_manifest(manifest)
    return manifest


def test_migrate_moves_the_old_layout_rewrites_inputs_and_verifies(tmp_path):
    store = ArtifactStore(str(tmp_path))
    raw = write_old_layout(store, "raw/x", "p", "raw bytes", {"shard": "p"})
    filtered = write_old_layout(store, "filtered/x", "p", "kept", {"min_words": 5}, [ref(raw)])
    dedup = write_old_layout(store, "deduplicated/x", None, "unique", {"bands": 8}, [ref(filtered)])
    chain = bill_of_materials(build_lineage(store, store.read_manifest(dedup.uri)))["chain_hash"]
    with pytest.raises(OldLayoutError, match="marin migrate"):
        plan_gc(store, {"raw/x": (True, "v1")}, current=[])

    assert len(migrate(store, dry_run=True, log=lambda _: None).moved) == 3 and os.path.exists(raw.uri)
    result = migrate(store, log=lambda _: None)
    assert result.problems == [] and len(result.moved) == 3 and result.files == 3
    moved = store.find("deduplicated/x", "v1", None)
    assert moved.uri == f"{tmp_path}/deduplicated/x/v1-{fingerprint({'bands': 8})[:8]}"
    assert moved.upstream[0].uri == store.find("filtered/x", "v1", "p").uri  # inputs follow the move
    assert not os.path.exists(f"{tmp_path}/raw/x/v1") and not os.path.exists(dedup.uri)
    # Same bytes, same data versions: the chain hash is unchanged, and a verifying walk agrees.
    node = build_lineage(store, moved, verify=True)
    assert [p for n in node.unique() for p in n.problems] == []
    assert bill_of_materials(node)["chain_hash"] == chain
    again = migrate(store, log=lambda _: None)
    assert again.moved == {} and again.already == 3
    assert result.old_paths == []
    assert plan_gc(store, {"raw/x": (True, "v1"), "filtered/x": (True, "v1"), "deduplicated/x": (False, "v1")},
                   current=[moved]).removed == []


@pytest.mark.parametrize("cloud", ["s3_prefix", "gcs_prefix"])
def test_migrate_on_an_object_store_copies_then_deletes_and_verifies(request, cloud):
    """On a bucket a move is a copy (manifest last) and a delete (manifest first): afterwards every
    artifact is at its new path, verified, with its inputs rewritten, and nothing is left behind."""
    prefix, options = request.getfixturevalue(cloud)
    store = ArtifactStore(prefix, options)
    raw = write_old_layout(store, "raw/x", "p", "raw bytes", {"shard": "p"})
    dedup = write_old_layout(store, "deduplicated/x", None, "unique", {"bands": 8}, [ref(raw)])
    chain = bill_of_materials(build_lineage(store, store.read_manifest(dedup.uri)))["chain_hash"]

    result = migrate(store, log=lambda _: None)
    assert result.problems == [] and len(result.moved) == 2 and result.files == 2
    moved = store.find("deduplicated/x", "v1", None)
    assert moved.uri == f"{prefix}/deduplicated/x/v1-{fingerprint({'bands': 8})[:8]}"
    assert moved.upstream[0].uri == store.find("raw/x", "v1", "p").uri
    store.fs.invalidate_cache()
    assert not store.fs.exists(store.fs_path(raw.uri)) and not store.fs.exists(store.fs_path(dedup.uri))
    node = build_lineage(store, moved, verify=True)
    assert [p for n in node.unique() for p in n.problems] == []
    assert bill_of_materials(node)["chain_hash"] == chain
    assert migrate(store, log=lambda _: None).already == 2


def test_migrate_reports_a_damaged_artifact(tmp_path):
    store = ArtifactStore(str(tmp_path))
    raw = write_old_layout(store, "raw/x", "p", "raw bytes", {"shard": "p"})
    with open(f"{raw.uri}/data.txt", "w") as fh:
        fh.write("RAW bytes")
    result = migrate(store, log=lambda _: None)
    assert len(result.problems) == 1 and "data.txt: sha256" in result.problems[0]


@pytest.fixture
def signed(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    raw = commit(store, "raw/x", "p", "raw bytes", {"shard": "p"})
    filtered = commit(store, "filtered/x", "p", "kept text", {"min_words": 5}, [ref(raw)])
    tokens = commit(store, "tokenized/x", None, "token ids", {"vocab": 64}, [ref(filtered)])
    private, public = generate_keypair(tmp_path / "bom.key")
    bom = bill_of_materials(build_lineage(store, tokens))
    return store, sign_bom(bom, private), public, [raw, filtered, tokens], tmp_path


def test_signed_bom_verifies_and_a_key_is_never_overwritten(signed):
    store, document, public, _, tmp_path = signed
    assert verify_signed_bom(store, json.loads(json.dumps(document)), public) == []
    assert oct(os.stat(tmp_path / "bom.key").st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        generate_keypair(tmp_path / "bom.key")


@pytest.mark.parametrize("index", [0, 1, 2], ids=["raw", "filtered", "tokenized"])
def test_one_flipped_byte_in_any_artifact_fails_the_signed_bom(signed, index):
    store, document, public, artifacts, _ = signed
    path = f"{artifacts[index].uri}/data.txt"
    data = bytearray(open(path, "rb").read())
    data[0] ^= 0x01
    with open(path, "wb") as fh:
        fh.write(bytes(data))
    problems = verify_signed_bom(store, document, public)
    assert any(p.startswith(f"{path}: sha256") for p in problems)
    assert any(p.startswith("chain hash of the store now") for p in problems)


def test_a_changed_bom_or_another_key_fails_the_signature(signed):
    store, document, public, _, tmp_path = signed
    forged = json.loads(json.dumps(document))
    forged["bom"]["artifacts"][0]["files"][0]["sha256"] = "0" * 64
    assert verify_signed_bom(store, forged, public)[0].startswith("signature does not match")
    _, other = generate_keypair(tmp_path / "other.key")
    assert verify_signed_bom(store, document, other)[0].startswith("signature does not match")


def test_a_forged_manifest_with_matching_file_hashes_fails_the_chain(signed):
    """Rewrite a file and its manifest consistently: per-file checks of the store's own manifests
    pass, but the signed BOM names the old hash."""
    store, document, public, artifacts, _ = signed
    raw = artifacts[0]
    with open(f"{raw.uri}/data.txt", "w") as fh:
        fh.write("RAW bytes")
    files = [store.hash_file(raw.uri, "data.txt")]
    body = json.loads(open(f"{raw.uri}/{MANIFEST_NAME}").read())
    body["files"] = [FileEntry(f.path, f.bytes, f.sha256).__dict__ for f in files]
    body["data_version"] = content_data_version(files)
    with open(f"{raw.uri}/{MANIFEST_NAME}", "w") as fh:
        fh.write(json.dumps(body))
    problems = verify_signed_bom(store, document, public)
    assert any("data.txt: sha256" in p for p in problems)


def test_migrate_lists_config_files_that_name_an_old_location(tmp_path):
    store = ArtifactStore(str(tmp_path))
    cache = write_old_layout(store, "tokenized/x", None, "token ids", {"vocab": 64})
    mixture = write_old_layout(store, "mixture/m", None, json.dumps({"cache_dir": cache.uri}), {"weights": {"x": 1}},
                               [ref(cache)], name="data.json")
    result = migrate(store, log=lambda _: None)
    assert result.problems == []
    moved = result.moved[mixture.uri]
    assert result.old_paths == [f"{moved}/data.json: names {cache.uri}"]
