"""`marin lineage` on a real curated source: the tree down to the raw bytes, verification that
names a flipped byte, and a bill of materials whose chain hash follows the stored bytes.

The source is materialized once by the CLI in a fresh process. The lineage commands then run
through the CLI's `main()` in one more fresh process per store state (before and after the
byte flip), with MARIN_* set before the code location is imported, as a user's shell would.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from marin_resources.storage.lineage import bill_of_materials, build_lineage
from marin_resources.storage.store import ArtifactStore

# Every test reads the module's `marin materialize` build.
pytestmark = pytest.mark.slow

SENTENCES = [
    "The ferry left the harbour before dawn with a cargo of salt, rope and letters for the island.",
    "An old keeper trimmed the lamp each evening and wrote the weather into a narrow ledger.",
    "Children on the quay counted the gulls and argued about which boat would come home first.",
    "By noon the wind had turned, and the fishermen hauled their nets in under a grey sky.",
    "The schoolmaster read aloud from a history of the coast while rain rattled the windows.",
    "In the market the baker sold the last of his bread to a sailor who had no coins left.",
]
HEX40 = re.compile(r"^[0-9a-f]{40}$")

# Runs each argv through marin_assets.cli.main in this one process and prints their results as JSON.
_BATCH = """
import contextlib, io, json, sys
from marin_assets.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append({"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def write_source(root: Path, names: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        # One paragraph per starting sentence: a repeated paragraph would filter the document out,
        # failing filtered's drop-fraction ERROR check (and so the command).
        body = "\n\n".join(" ".join(SENTENCES[(i + j + k) % len(SENTENCES)] for k in range(4))
                             for j in range(len(SENTENCES)))
        (root / f"{name}.txt").write_text(f"{name.title()}.\n\n{body}\n")


def cli_env(tmp: Path) -> dict[str, str]:
    sources = tmp / "sources.yaml"
    sources.write_text(f"sources:\n  - name: harbour\n    uri: {tmp / 'text'}/*.txt\n    format: text\n"
                       "    files_per_shard: 1\n")
    return {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(tmp / "store"),
            "DAGSTER_HOME": str(tmp / "home"), "MARIN_ENV": "local"}


def run_batch(env: dict[str, str], *argvs: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _BATCH, json.dumps(list(argvs))], env=env, capture_output=True,
                          text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lineage")
    write_source(tmp / "text", ["north", "south"])
    env = cli_env(tmp)
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", "deduplicated/harbour", "--json"],
                          env=env, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["success"]
    return env, tmp / "store", summary


def test_lineage_tree_json_and_bill_of_materials(built):
    env, _, summary = built
    verify, as_json, bom = run_batch(env, ["lineage", "deduplicated/harbour", "--verify"],
                                     ["lineage", "deduplicated/harbour", "--json"],
                                     ["lineage", "deduplicated/harbour", "--bom"])

    assert verify["code"] == 0, verify["stderr"]
    tree = verify["stdout"]
    assert tree.splitlines()[0].startswith("deduplicated/harbour  v1")
    for key in ("filtered/harbour[", "documents/harbour[", "raw/harbour["):
        assert tree.count(key) == 2, tree  # one line per shard
    externals = [line for line in tree.splitlines() if "external " in line]
    assert len(externals) == 2 and len({line.split("external/harbour[")[1].split("]")[0] for line in externals}) == 2
    assert "verified" in verify["stderr"] and "FAILED" not in tree

    root = json.loads(as_json["stdout"])
    run_ids = {s["run_id"] for s in summary["steps"] if s["ran"]}
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node["upstream"])
    internal = [n for n in nodes if not n["external"]]
    assert {n["asset_key"] for n in internal} == {"deduplicated/harbour", "dedup_index/harbour", "filtered/harbour",
                                                  "documents/harbour", "raw/harbour"}
    for node in internal:
        assert node["code_version"] == "v1"
        assert re.fullmatch(r"[0-9a-f]{64}", node["fingerprint"]) and re.fullmatch(r"[0-9a-f]{64}",
                                                                                   node["data_version"])
        assert node["run_id"] in run_ids
        assert HEX40.match(node["git_sha"] or ""), node["git_sha"]
        assert (node["partition"] is None) == (node["asset_key"] in ("deduplicated/harbour", "dedup_index/harbour"))
        assert Path(node["uri"], ".artifact.json").is_file()
    raws = [n for n in internal if n["asset_key"] == "raw/harbour"]
    assert all(n["upstream"][0]["external"] and n["upstream"][0]["partition"] == n["partition"] for n in raws)

    doc = json.loads(bom["stdout"])
    assert re.fullmatch(r"[0-9a-f]{64}", doc["chain_hash"]) and doc["verified"] is False
    # deduplicated, dedup_index + 2 x (filtered, documents, raw, external listing)
    assert len(doc["artifacts"]) == 10
    assert all(a["files"] for a in doc["artifacts"] if not a["external"])


def test_flipped_byte_fails_verification_and_changes_the_chain_hash(built, tmp_path):
    env, store, _ = built
    # A private copy of the store: the other test reads the intact one.
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    for manifest in copy.rglob(".artifact.json"):  # manifests record absolute URIs of the original store
        manifest.write_text(manifest.read_text().replace(str(store), str(copy)))
    env = {**env, "MARIN_PREFIX": str(copy)}

    # Before the flip, through the library (no Dagster needed): verified chain == recorded chain.
    artifacts = ArtifactStore(str(copy))
    manifest = artifacts.find("deduplicated/harbour", "v1", None)
    recorded = bill_of_materials(build_lineage(artifacts, manifest))["chain_hash"]
    assert bill_of_materials(build_lineage(artifacts, manifest, verify=True))["chain_hash"] == recorded

    (target,) = copy.glob("raw/harbour/v1-*/*/files/south.txt")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))

    verify, bom_plain, bom_verified = run_batch(env, ["lineage", "deduplicated/harbour", "--verify"],
                                                ["lineage", "deduplicated/harbour", "--bom"],
                                                ["lineage", "deduplicated/harbour", "--bom", "--verify"])
    assert verify["code"] == 1
    assert "lineage verification FAILED: 1 problem(s)" in verify["stderr"]
    assert f"{target}: sha256" in verify["stderr"]
    assert "FAILED" in next(line for line in verify["stdout"].splitlines() if "raw/harbour[south" in line)

    # Without --verify the chain covers the recorded hashes; with it, the bytes actually stored.
    assert bom_plain["code"] == 0 and json.loads(bom_plain["stdout"])["chain_hash"] == recorded
    assert bom_verified["code"] == 1
    flipped = json.loads(bom_verified["stdout"])
    assert flipped["verified"] is True and flipped["chain_hash"] != recorded
    raw_south = next(a for a in flipped["artifacts"] if a["asset_key"] == "raw/harbour" and "south" in a["partition"])
    assert raw_south["observed_data_version"] != raw_south["data_version"]


def test_signed_bom_verifies_and_fails_after_one_flipped_byte(built, tmp_path):
    env, store, _ = built
    key = tmp_path / "bom.key"
    keygen, signed, gc = run_batch(env, ["keygen", str(key)],
                                   ["lineage", "deduplicated/harbour", "--bom", "--sign", str(key)],
                                   ["gc", "--dry-run"])
    assert keygen["code"] == 0 and signed["code"] == 0, signed["stderr"]
    # Everything in the store is current or an input of it: nothing to collect.
    assert gc["code"] == 0 and "0 artifact version(s), 0 bytes would be removed (dry run)" in gc["stdout"], gc
    document = json.loads(signed["stdout"])
    assert document["signature"]["algorithm"] == "ed25519"
    bom_file = tmp_path / "bom.json"
    bom_file.write_text(signed["stdout"])
    pub = f"{key}.pub"

    target = next(p for p in sorted(store.glob("filtered/harbour/v1-*/north.txt/**/*"))
                  if p.is_file() and not p.name.startswith("."))
    original = target.read_bytes()
    good, = run_batch(env, ["lineage", "--verify-bom", str(bom_file), "--pubkey", pub])
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    try:
        bad, = run_batch(env, ["lineage", "--verify-bom", str(bom_file), "--pubkey", pub])
    finally:
        target.write_bytes(original)  # the module's store is shared
    assert good["code"] == 0 and "signature good" in good["stdout"], good["stderr"]
    assert bad["code"] == 1 and f"{target}: sha256" in bad["stderr"] and "chain hash" in bad["stderr"]
