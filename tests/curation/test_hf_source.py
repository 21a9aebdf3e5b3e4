"""Hugging Face datasets as a source, against a local stand-in for the hub (tests/curation/hub_standin.py).

The fixture repository is real text: the licence files of the Python distributions installed
here, written as JSONL by this test. HfFileSystem talks real HTTP to the stand-in through
``HF_ENDPOINT``, the way it would to huggingface.co.
"""

from __future__ import annotations

import importlib.metadata
import json
import re

import polars as pl
import pytest

from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.readers import read_shard

from .conftest import make_source
from .hub_standin import HubStandIn

REPO = "marin-test/licences"


def _licence_records(limit: int) -> list[dict[str, str]]:
    """Real text: licence files of installed distributions, in a stable order, one record each."""
    records = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"].lower()):
        for file in sorted(dist.files or [], key=str):
            if re.match(r"(?i)^(licen[cs]e|copying)", file.name) and ".dist-info" in str(file.parent):
                text = (dist.read_text(str(file.relative_to(file.parts[0]))) or "").strip()
                if len(text.split()) >= 100:
                    records.append({"id": f"{dist.metadata['Name']}/{file.name}", "text": text})
                break
        if len(records) == limit:
            return records
    raise AssertionError(f"found only {len(records)} licence texts among the installed distributions")


def _jsonl(records: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def records() -> list[dict[str, str]]:
    return _licence_records(24)


@pytest.fixture
def hub(monkeypatch, records):
    """A stand-in hub with one dataset of two commits: train-0 and train-1, then train-2 added."""
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    # Other test modules put the process in offline mode for Levanter; this test talks to a local server.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    reset_sessions()
    with HubStandIn() as standin:
        repo = standin.repo("dataset", REPO)
        repo.commit({"README.md": b"# Licences\n", "data/train-0.jsonl": _jsonl(records[:8]),
                     "data/train-1.jsonl": _jsonl(records[8:16])}, "two shards")
        repo.commit({"data/train-2.jsonl": _jsonl(records[16:])}, "a third shard")
        monkeypatch.setenv("HF_ENDPOINT", standin.endpoint)
        yield standin
    reset_sessions()


def _shards(tmp_path, uri: str, **fields):
    src = make_source(tmp_path, uri=uri, format="jsonl", id_field="id", files_per_shard=1, **fields)
    return src, discover_shards(src)


def test_an_hf_dataset_is_listed_pinned_and_read(hub, records, tmp_path):
    repo = hub.repo("dataset", REPO)
    first, second = (c.sha for c in repo.commits)
    src, shards = _shards(tmp_path, f"hf://datasets/{REPO}@main/data/*.jsonl")
    assert [s.key for s in shards] == ["train-0.jsonl", "train-1.jsonl", "train-2.jsonl"]
    # main resolved to commits: each file names the last commit that changed it.
    assert [s.files[0].uri for s in shards] == [
        f"hf://datasets/{REPO}@{first}/data/train-0.jsonl",
        f"hf://datasets/{REPO}@{first}/data/train-1.jsonl",
        f"hf://datasets/{REPO}@{second}/data/train-2.jsonl",
    ]
    # The content checksum the hub keeps: the git blob id (a file's identity, with no mtime).
    assert all(re.fullmatch(r"blob_id:[0-9a-f]{40}", s.files[0].etag or "") and s.files[0].mtime is None
               for s in shards)
    results = [read_shard(src, shard) for shard in shards]
    docs = pl.concat([r.documents for r in results])
    assert sum(r.quarantine.height for r in results) == 0
    assert docs["source_id"].to_list() == [r["id"] for r in records]
    assert docs["text"].to_list() == [r["text"] for r in records]
    downloads = [path for method, path, _ in hub.requests if "/resolve/" in path]
    assert downloads and all("@" not in p and ("/resolve/" + first in p or "/resolve/" + second in p)
                             for p in downloads)


def test_a_moved_branch_changes_only_the_shards_whose_files_changed(hub, records, tmp_path):
    uri = f"hf://datasets/{REPO}/data"  # no revision: main
    _, before = _shards(tmp_path, uri)
    pinned_first = before[0].files[0].uri
    hub.repo("dataset", REPO).commit({"data/train-0.jsonl": _jsonl(records[:4])}, "shrink train-0")
    src, after = _shards(tmp_path, uri)
    assert [s.key for s in after] == [s.key for s in before]
    changed = [a.key for a, b in zip(after, before) if a.fingerprint != b.fingerprint]
    assert changed == ["train-0.jsonl"]
    # The old pin still reads the old bytes: a shard built from it can be rebuilt exactly.
    old = make_source(tmp_path, uri=pinned_first, format="jsonl", id_field="id")
    assert read_shard(old, discover_shards(old)[0]).documents.height == 8
    assert read_shard(src, after[0]).documents.height == 4


def test_branch_tag_and_sha_name_the_same_files(hub, tmp_path):
    sha = hub.repo("dataset", REPO).commits[-1].sha
    listings = [[f.uri for s in _shards(tmp_path, uri)[1] for f in s.files] for uri in (
        f"hf://datasets/{REPO}/data/*.jsonl", f"hf://datasets/{REPO}@main/data/*.jsonl",
        f"hf://datasets/{REPO}@{sha}/data/*.jsonl")]
    assert listings[0] == listings[1] == listings[2]


def test_endpoint_and_token_stay_out_of_the_fingerprint(hub, records, monkeypatch, tmp_path):
    _, plain = _shards(tmp_path, f"hf://datasets/{REPO}/data/*.jsonl")
    with HubStandIn() as mirror:  # the same repository served from another address, with a token
        repo = mirror.repo("dataset", REPO)
        repo.commits, repo.branches = hub.repo("dataset", REPO).commits, hub.repo("dataset", REPO).branches
        monkeypatch.setenv("HF_ENDPOINT", mirror.endpoint + "/")
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        _, mirrored = _shards(tmp_path, f"hf://datasets/{REPO}/data/*.jsonl")
        assert mirror.requests and all(h.get("authorization") == "Bearer hf_standin_token"
                                       for _, _, h in mirror.requests)
    assert [(s.key, s.fingerprint) for s in mirrored] == [(s.key, s.fingerprint) for s in plain]


@pytest.mark.parametrize(("uri", "message"), [
    ("hf://datasets/marin-test/nothing-here/data/*.jsonl", "no dataset repository 'marin-test/nothing-here'"),
    (f"hf://datasets/{REPO}@no-such-branch/data/*.jsonl", "has no revision 'no-such-branch'"),
    (f"hf://datasets/{REPO}@main/data/*.parquet", "data/*.parquet matches no file in dataset marin-test/licences"),
    (f"hf://datasets/{REPO}/missing.jsonl", "missing.jsonl matches no file"),
])
def test_a_missing_repo_revision_or_path_is_one_clear_error(hub, tmp_path, uri, message):
    with pytest.raises(FileNotFoundError) as caught:
        _shards(tmp_path, uri)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).startswith("source 'test': ")
