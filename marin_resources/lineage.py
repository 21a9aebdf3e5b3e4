"""Lineage from manifests: walk `upstream` references down to the raw bytes, verify every
file against its recorded hash, and export a bill of materials with a hash chain.

Works from the store alone (no Dagster instance), so an auditor with read access to the
bucket can check a checkpoint's provenance.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from marin_resources.store import ArtifactStore, Manifest


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
    problems: list[str] = field(default_factory=list)
    children: list["LineageNode"] = field(default_factory=list)
    manifest: Manifest | None = None

    def chain_hash(self) -> str:
        """Merkle hash: this node's data version and fingerprint, then its children's chain hashes."""
        h = hashlib.sha256()
        h.update(f"{self.asset_key}\0{self.partition}\0{self.data_version}\0{self.fingerprint}\n".encode())
        for child in sorted(self.children, key=lambda c: (c.asset_key, str(c.partition))):
            h.update(child.chain_hash().encode())
        return h.hexdigest()

    def to_dict(self, with_chain: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "asset_key": self.asset_key, "partition": self.partition, "uri": self.uri,
            "code_version": self.code_version, "fingerprint": self.fingerprint, "data_version": self.data_version,
            "run_id": self.run_id, "git_sha": self.git_sha, "external": self.external,
        }
        if self.problems:
            out["problems"] = self.problems
        if with_chain:
            out["chain_hash"] = self.chain_hash()
            if self.manifest is not None:
                out["files"] = [{"path": f.path, "bytes": f.bytes, "sha256": f.sha256} for f in self.manifest.files]
        out["upstream"] = [c.to_dict(with_chain) for c in self.children]
        return out

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


class LineageError(RuntimeError):
    pass


def build_lineage(store: ArtifactStore, manifest: Manifest, *, verify: bool = False,
                  _seen: dict[str, LineageNode] | None = None) -> LineageNode:
    seen = {} if _seen is None else _seen
    node = LineageNode(asset_key=manifest.asset_key, partition=manifest.partition, uri=manifest.uri,
                       data_version=manifest.data_version, code_version=manifest.code_version,
                       fingerprint=manifest.fingerprint, run_id=manifest.producer.get("run_id"),
                       git_sha=manifest.producer.get("git_sha"), files=len(manifest.files), manifest=manifest)
    if verify:
        node.problems.extend(store.verify(manifest))
    for ref in manifest.upstream:
        if ref.uri in seen:
            node.children.append(seen[ref.uri])
            continue
        upstream = store.read_manifest(ref.uri) if ref.uri.startswith(store.prefix) else None
        if upstream is None:
            child = LineageNode(asset_key=ref.asset_key, partition=ref.partition, uri=ref.uri,
                                data_version=ref.data_version, external=True)
            if ref.uri.startswith(store.prefix):
                child.external = False
                child.problems.append(f"{ref.uri}: manifest missing")
        else:
            child = build_lineage(store, upstream, verify=verify, _seen=seen)
            if upstream.data_version != ref.data_version:
                child.problems.append(f"{ref.uri}: data version {upstream.data_version[:12]} != "
                                      f"{ref.data_version[:12]} recorded by {manifest.asset_key}")
        seen[ref.uri] = child
        node.children.append(child)
    return node


def render_tree(node: LineageNode) -> str:
    lines: list[str] = []

    def visit(n: LineageNode, prefix: str, last: bool, root: bool) -> None:
        label = n.asset_key + (f"[{n.partition}]" if n.partition else "")
        if n.external:
            desc = f"{label}  external {n.uri}  listing {n.data_version[:12]}"
        else:
            desc = (f"{label}  {n.code_version}  data {n.data_version[:12]}  fp {(n.fingerprint or '')[:12]}  "
                    f"run {(n.run_id or '-')[:8]}  git {(n.git_sha or '-')[:8]}")
        status = "  FAILED: " + "; ".join(n.problems) if n.problems else ""
        lines.append(("" if root else prefix + ("└── " if last else "├── ")) + desc + status)
        child_prefix = "" if root else prefix + ("    " if last else "│   ")
        for i, c in enumerate(n.children):
            visit(c, child_prefix, i == len(n.children) - 1, False)

    visit(node, "", True, True)
    return "\n".join(lines)


def bill_of_materials(node: LineageNode) -> dict[str, Any]:
    """Every artifact from raw bytes to the root, each with its files, and the chain hash."""
    unique = {n.uri: n for n in node.walk()}
    return {
        "root": {"asset_key": node.asset_key, "partition": node.partition, "uri": node.uri},
        "chain_hash": node.chain_hash(),
        "algorithm": "sha256 merkle over (asset_key, partition, data_version, fingerprint) and upstream chain hashes",
        "artifacts": [n.to_dict(with_chain=True) | {"upstream": [c.uri for c in n.children]}
                      for n in sorted(unique.values(), key=lambda n: (n.asset_key, str(n.partition)))],
    }
