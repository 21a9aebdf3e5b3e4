"""Verification and the bill of materials recompute data versions from file hashes (issue 17, defect 5).

An edited file whose new hash and size are written into its manifest used to pass `--verify`, and
the chain hash, built from recorded data versions only, stayed the same.
"""

import hashlib
import json

import pytest

from marin_resources.storage.identity import fingerprint
from marin_resources.storage.lineage import bill_of_materials, build_lineage, render_tree
from marin_resources.storage.store import (
    MANIFEST_NAME,
    ArtifactStore,
    FileEntry,
    UpstreamRef,
    content_data_version,
    producer_info,
    writing,
)


def commit(store, key, text, upstream=()):
    with writing(store, key, "v1", None, fingerprint=fingerprint({}), run_id="run-test") as w:
        with w.open("data.txt") as fh:
            fh.write(text.encode())
        return w.commit(config={}, upstream=list(upstream),
                        producer=producer_info("run-test"))


@pytest.fixture
def chain(tmp_path):
    store = ArtifactStore(str(tmp_path))
    filtered = commit(store, "filtered/x", "the original text")
    commit(store, "tokenized/x", "tokens of the original text",
           upstream=[UpstreamRef("filtered/x", None, filtered.data_version, filtered.uri)])
    root = bill_of_materials(build_lineage(store, store.find("tokenized/x", "v1", None)))["chain_hash"]
    return store, tmp_path / f"filtered/x/v1-{fingerprint({})[:8]}", root


def rewrite(directory, text, *, update_data_version):
    """Change the file and record its new hash and size in the manifest, as a careful forger would."""
    (directory / "data.txt").write_text(text)
    path = directory / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["files"] = [{"path": "data.txt", "bytes": len(text.encode()),
                          "sha256": hashlib.sha256(text.encode()).hexdigest()}]
    if update_data_version:
        manifest["data_version"] = content_data_version([FileEntry(**f) for f in manifest["files"]])
    path.write_text(json.dumps(manifest))


def lineage(store, verify):
    node = build_lineage(store, store.find("tokenized/x", "v1", None), verify=verify)
    return node, bill_of_materials(node)["chain_hash"], [p for n in node.unique() for p in n.problems]


def test_intact_chain_verifies_and_keeps_its_root(chain):
    store, _, root = chain
    _, verified_root, problems = lineage(store, verify=True)
    assert problems == [] and verified_root == root


@pytest.mark.parametrize("update_data_version, reported", [
    (False, "is not the content hash"),  # the manifest's own version no longer matches its files
    (True, "recorded by tokenized/x"),  # the whole manifest rewritten: its consumer recorded another version
])
def test_content_and_file_hashes_rewritten_fail_verify_and_change_the_root(chain, update_data_version, reported):
    store, filtered_dir, root = chain
    rewrite(filtered_dir, "a tampered text", update_data_version=update_data_version)
    _, recorded_root, _ = lineage(store, verify=False)
    _, verified_root, problems = lineage(store, verify=True)
    assert recorded_root != root and verified_root != root
    assert any(reported in p for p in problems), problems


def test_forged_data_version_fails_verify_and_changes_the_root(chain):
    store, filtered_dir, root = chain
    path = filtered_dir / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["data_version"] = "0" * 64
    path.write_text(json.dumps(manifest))
    assert any("is not the content hash" in p for p in store.verify(store.find("filtered/x", "v1", None)))
    _, recorded_root, _ = lineage(store, verify=False)
    assert recorded_root != root


def test_a_shared_subtree_is_drawn_once_and_named_where_it_recurs(tmp_path):
    # A classifier (with inputs of its own) read by two shards: its subtree once, then `[1] as above`;
    # its corpus, under it, is drawn once and so gets no mark.
    store = ArtifactStore(str(tmp_path))
    ref = lambda m: UpstreamRef(m.asset_key, None, m.data_version, m.uri)  # noqa: E731
    raw = commit(store, "raw_corpus", "text")
    corpus = commit(store, "classifier_corpus", "labelled text", upstream=[ref(raw)])
    classifier = commit(store, "quality_classifier", "weights", upstream=[ref(corpus)])
    shards = [commit(store, f"filtered/{name}", f"{name} text", upstream=[ref(classifier)]) for name in "ab"]
    commit(store, "deduplicated/x", "kept text", upstream=[ref(s) for s in shards])
    (tmp_path / f"classifier_corpus/v1-{fingerprint({})[:8]}/data.txt").write_text("relabelled text")

    root = build_lineage(store, store.find("deduplicated/x", "v1", None), verify=True)
    lines = render_tree(root).splitlines()
    assert len(lines) == 7 and sum("classifier_corpus" in line for line in lines) == 1
    assert lines[2].endswith("[1]") and lines[2].lstrip("│├└─ ").startswith("quality_classifier  v1")
    assert "classifier_corpus  v1" in lines[3] and "FAILED: " in lines[3]
    assert "raw_corpus  v1" in lines[4] and not lines[4].endswith("]")
    assert lines[6].lstrip("│├└─ ") == f"quality_classifier  data {classifier.data_version[:12]}  [1] as above  " \
                                      "FAILED (above)"
    # Each mark is named again below (a node drawn once because its consumer is elided gets none).
    marks = {line.rsplit("[", 1)[1] for line in lines if line.endswith("]")}
    assert marks == {line.split("[")[-1].split("]")[0] + "]" for line in lines if "as above" in line} == {"1]"}
    # Verification still covers every artifact, each once, whatever is drawn.
    assert [n.asset_key for n in root.unique() if n.problems] == ["classifier_corpus"]
