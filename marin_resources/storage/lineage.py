"""Lineage from manifests: walk `upstream` references down to the raw bytes, verify every
file against its recorded hash, and export a bill of materials with a hash chain.

Works from the store alone (no Dagster instance), so an auditor with read access to the
bucket can check a checkpoint's provenance.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from marin_resources.storage.store import ArtifactStore, Manifest, content_data_version


@dataclass
class LineageNode:
    asset_key: str
    partition: str | None
    uri: str
    data_version: str
    code_version: str | None = None
    fingerprint: str | None = None
    run_id: str | None = None
    git_sha: str | None = None
    external: bool = False
    files: int = 0
    # Content hash of the bytes actually found in the store, set by a verifying walk. It differs
    # from `data_version` (the recorded one) exactly when a file was changed, removed or added.
    observed_data_version: str | None = None
    problems: list[str] = field(default_factory=list)
    children: list[LineageNode] = field(default_factory=list)
    manifest: Manifest | None = None

    @property
    def node_id(self) -> str:
        """Unique per artifact. External inputs share their source URI across shards, so the shard
        and its listing hash tell them apart."""
        if self.external:
            return f"{self.uri}#{self.asset_key}[{self.partition}]@{self.data_version}"
        return self.uri

    def content_hash(self) -> str:
        """The content this node stands for: the hash of the bytes found in the store after a
        verifying walk, else the hash recomputed from the file hashes its manifest lists (an
        external input has only its listing hash)."""
        if self.observed_data_version is not None:
            return self.observed_data_version
        return content_data_version(self.manifest.files) if self.manifest is not None else self.data_version

    def chain_hash(self, _memo: dict[int, str] | None = None) -> str:
        """Merkle hash: this node's recorded data version, its content hash (from the file hashes,
        never the recorded version alone) and fingerprint, then its children's chain hashes. A
        change to content, or to content and manifest together, changes it. Shared upstream is
        hashed once."""
        memo = {} if _memo is None else _memo
        if id(self) not in memo:
            h = hashlib.sha256()
            h.update(f"{self.asset_key}\0{self.partition}\0{self.data_version}\0{self.content_hash()}\0"
                     f"{self.fingerprint}\n".encode())
            for child in sorted(self.children, key=lambda c: (c.asset_key, str(c.partition), c.data_version)):
                h.update(child.chain_hash(memo).encode())
            memo[id(self)] = h.hexdigest()
        return memo[id(self)]

    def describe(self) -> dict[str, Any]:
        """This node's own fields, without its upstream."""
        out: dict[str, Any] = {
            "asset_key": self.asset_key, "partition": self.partition, "uri": self.uri,
            "code_version": self.code_version, "fingerprint": self.fingerprint, "data_version": self.data_version,
            "run_id": self.run_id, "git_sha": self.git_sha, "external": self.external,
        }
        if self.observed_data_version is not None:
            out["observed_data_version"] = self.observed_data_version
        if self.problems:
            out["problems"] = self.problems
        return out

    def to_dict(self) -> dict[str, Any]:
        """The tree as nested dicts (shared upstream repeats under each consumer)."""
        return self.describe() | {"upstream": [c.to_dict() for c in self.children]}

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()

    def unique(self) -> list[LineageNode]:
        """Every distinct artifact under and including this node, each once."""
        return list({n.node_id: n for n in self.walk()}.values())


class LineageError(RuntimeError):
    pass


def listing_problems(store: ArtifactStore, manifest: Manifest) -> list[str]:
    """A raw shard's `listing.json` gives each copied file's content identity (`etag`); where that is
    a sha256 of the whole file, it must be the hash of the copy stored beside it (`files/<relpath>`),
    whose bytes `verify` checks against the manifest. A file that grew between listing and copy
    once recorded the hash of a shorter file than the one stored."""
    if not any(entry.path == "listing.json" for entry in manifest.files):
        return []
    import json

    try:
        with store.open(f"{manifest.uri}/listing.json") as fh:
            listing = json.load(fh)
    except (FileNotFoundError, ValueError):  # missing or altered: `verify` reports it
        return []
    stored = {entry.path: entry.sha256 for entry in manifest.files}
    problems = []
    for item in listing if isinstance(listing, list) else []:
        etag, relpath = item.get("etag") or "", item.get("relpath")
        if item.get("refused") or not etag.startswith("sha256:") or "#bytes=" in item.get("uri", ""):
            continue
        copy = stored.get(f"files/{relpath}")
        if copy != etag.removeprefix("sha256:"):
            problems.append(f"{manifest.uri}/files/{relpath}: stored copy sha256 {(copy or 'missing')[:12]} != "
                            f"listed {etag[:19]}")
    return problems


def build_lineage(store: ArtifactStore, manifest: Manifest, *, verify: bool = False,
                  _seen: dict[str, LineageNode] | None = None) -> LineageNode:
    seen = {} if _seen is None else _seen
    node = LineageNode(asset_key=manifest.asset_key, partition=manifest.partition, uri=manifest.uri,
                       data_version=manifest.data_version, code_version=manifest.code_version,
                       fingerprint=manifest.fingerprint, run_id=manifest.producer.get("run_id"),
                       git_sha=manifest.producer.get("git_sha"), files=len(manifest.files), manifest=manifest)
    if verify:
        node.problems.extend(store.verify(manifest))
        node.problems.extend(listing_problems(store, manifest))
        # Re-hash only when something is off: otherwise the stored bytes are the recorded ones.
        node.observed_data_version = content_data_version(
            [store.hash_file(manifest.uri, rel) for rel in store.list_files(manifest.uri)]
        ) if node.problems else manifest.data_version
    for ref in manifest.upstream:
        # External inputs of different shards share the source URI; key them by shard and listing too.
        seen_key = ref.uri if ref.uri.startswith(store.prefix) else f"{ref.uri}#{ref.asset_key}[{ref.partition}]" \
            f"@{ref.data_version}"
        if seen_key in seen:
            child = seen[seen_key]
        else:
            upstream = store.read_last_committed(ref.uri) if ref.uri.startswith(store.prefix) else None
            if upstream is None:
                child = LineageNode(asset_key=ref.asset_key, partition=ref.partition, uri=ref.uri,
                                    data_version=ref.data_version, external=True)
                if ref.uri.startswith(store.prefix):
                    child.external = False
                    child.problems.append(f"{ref.uri}: manifest missing")
            else:
                child = build_lineage(store, upstream, verify=verify, _seen=seen)
            seen[seen_key] = child
        # Each consumer's record is checked, also of an artifact another one reached first (a checkpoint
        # records the cache it read; its mixture, the cache it was rendered from).
        if child.manifest is not None and not child.manifest.holds_version(ref.data_version):
            problem = (f"{ref.uri}: data version {child.manifest.data_version[:12]} != {ref.data_version[:12]} "
                       f"recorded by {manifest.asset_key}" + (f"[{manifest.partition}]" if manifest.partition else ""))
            if problem not in child.problems:
                child.problems.append(problem)
        node.children.append(child)
    return node


def render_tree(node: LineageNode) -> str:
    """The lineage as an indented tree, one line per artifact. An artifact with upstream of its own
    that several consumers read (the deduplicated corpus every cache shard reads) is drawn in full
    once, marked `[n]`; every later occurrence is one line naming it, `[n] as above`, with FAILED
    where its subtree has problems. The walk verified every node whichever way it is drawn."""
    drawn: set[str] = set()
    referenced: set[str] = set()

    def find_references(n: LineageNode) -> None:  # the drawing's own order: what a later line names
        if n.children and n.node_id in drawn:
            referenced.add(n.node_id)
            return
        drawn.add(n.node_id)
        for c in n.children:
            find_references(c)

    find_references(node)
    lines: list[str] = []
    marks: dict[str, int] = {}

    def visit(n: LineageNode, prefix: str, last: bool, root: bool) -> None:
        label = n.asset_key + (f"[{n.partition}]" if n.partition else "")
        branch = "" if root else prefix + ("└── " if last else "├── ")
        if n.node_id in marks:
            failed = "  FAILED (above)" if any(c.problems for c in n.walk()) else ""
            lines.append(f"{branch}{label}  data {n.data_version[:12]}  [{marks[n.node_id]}] as above{failed}")
            return
        if n.external:
            desc = f"{label}  external {n.uri}  listing {n.data_version[:12]}"
        else:
            desc = (f"{label}  {n.code_version}  data {n.data_version[:12]}  fp {(n.fingerprint or '')[:12]}  "
                    f"run {(n.run_id or '-')[:8]}  git {(n.git_sha or '-')[:8]}")
        if n.node_id in referenced:
            marks[n.node_id] = len(marks) + 1
            desc += f"  [{marks[n.node_id]}]"
        status = "  FAILED: " + "; ".join(n.problems) if n.problems else ""
        lines.append(branch + desc + status)
        child_prefix = "" if root else prefix + ("    " if last else "│   ")
        for i, c in enumerate(n.children):
            visit(c, child_prefix, i == len(n.children) - 1, False)

    visit(node, "", True, True)
    return "\n".join(lines)


def bill_of_materials(node: LineageNode) -> dict[str, Any]:
    """Every artifact from raw bytes to the root, each with its files, and the chain hash.

    From a verifying walk the chain covers the bytes found in the store, so one flipped byte
    anywhere upstream changes the root's chain hash; otherwise it covers the recorded hashes.
    """
    memo: dict[int, str] = {}
    artifacts = []
    for n in sorted(node.unique(), key=lambda n: (n.asset_key, str(n.partition), n.data_version)):
        entry = n.describe() | {"chain_hash": n.chain_hash(memo), "upstream": [c.node_id for c in n.children]}
        if n.manifest is not None:
            entry["files"] = [{"path": f.path, "bytes": f.bytes, "sha256": f.sha256} for f in n.manifest.files]
        artifacts.append(entry)
    return {
        "root": {"asset_key": node.asset_key, "partition": node.partition, "uri": node.uri},
        "chain_hash": node.chain_hash(memo),
        "verified": node.observed_data_version is not None,
        "algorithm": "sha256 merkle over (asset_key, partition, recorded data_version, content hash, fingerprint) "
                     "and upstream chain hashes; the content hash is recomputed from the listed file hashes, or "
                     "from the bytes found in the store when verified",
        "artifacts": artifacts,
    }
