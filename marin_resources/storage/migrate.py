"""Move a store from the `{key}/{code_version}/{partition}` layout to the identity layout
`{key}/{code_version}-{fingerprint[:8]}/{partition}`, then verify every moved artifact.

Each committed artifact moves as a whole directory (one rename on local disk; copy then delete on
object stores), its manifest's `upstream` URIs are rewritten to the new locations, and a ref makes
it the current identity of its partition. Files are moved byte for byte, so every data version and
chain hash stays what it was; text inside files that names an old path keeps the old text, so
small config files (JSON, YAML) naming a moved artifact's old location are listed (a mixture's
Levanter `data.json` names its token caches): rebuild those with `marin materialize KEY --rebuild`.
Directories without a manifest (an attempt that never committed, a withdrawn artifact) stay where
they are, for `marin gc` to remove. Run it with no writer at work: a directory holding a lease is
refused.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from marin_resources.storage.lineage import build_lineage
from marin_resources.storage.store import LOCK_NAME, MANIFEST_NAME, ArtifactStore, Manifest, UpstreamRef

Log = Callable[[str], None]


@dataclass
class Migration:
    moved: dict[str, str] = field(default_factory=dict)  # old uri -> new uri
    already: int = 0
    refused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # "<file>: names <old uri>" for small config files that name a moved artifact's old location.
    old_paths: list[str] = field(default_factory=list)
    bytes: int = 0
    files: int = 0
    seconds: float = 0.0
    verify_seconds: float = 0.0


def manifests(store: ArtifactStore) -> list[Manifest]:
    """Every committed manifest in the store, from one listing."""
    suffix = "/" + MANIFEST_NAME
    found = []
    for path in sorted(store.fs.find(store.root, withdirs=False)):
        if path.endswith(suffix):
            uri = store.prefix + path[len(store.root):-len(suffix)]
            found.append(store.parse_manifest(store.fs.cat_file(path).decode("utf-8"), uri))
    return found


def old_uri(store: ArtifactStore, manifest: Manifest) -> str:
    """Where the old layout kept this artifact."""
    segments = [*manifest.asset_key.split("/"), manifest.code_version]
    if manifest.partition is not None:
        segments.append(manifest.partition)
    return "/".join([store.prefix, *segments])


def migrate(store: ArtifactStore, *, dry_run: bool = False, verify: bool = True, log: Log = print) -> Migration:
    started = time.monotonic()
    result = Migration()
    everything = manifests(store)
    to_move = []
    for manifest in everything:
        target = store.artifact_uri(manifest.asset_key, manifest.code_version, manifest.partition,
                                    fingerprint=manifest.fingerprint)
        if manifest.uri == target:
            result.already += 1
        elif manifest.uri != old_uri(store, manifest):
            result.refused.append(f"{manifest.uri}: not where either layout puts {manifest.asset_key}; left alone")
        elif store.fs.exists(f"{store.fs_path(manifest.uri)}/{LOCK_NAME}"):
            result.refused.append(f"{manifest.uri}: a writer holds its lease; migrate when it is done")
        elif store.fs.exists(store.fs_path(target)):
            result.refused.append(f"{manifest.uri}: {target} already exists; left alone")
        else:
            to_move.append((manifest, target))
    for manifest, target in to_move:
        result.moved[manifest.uri] = target
        result.files += len(manifest.files)
        result.bytes += sum(f.bytes for f in manifest.files)
        log(f"  {'would move' if dry_run else 'move'} {manifest.uri[len(store.prefix) + 1:]} -> "
            f"{target[len(store.prefix) + 1:]}")
    if dry_run:
        result.seconds = time.monotonic() - started
        return result
    for manifest, target in to_move:
        _move_dir(store, manifest.uri, target)
    # Every manifest that names a moved input is rewritten, the moved ones and those already in place.
    for manifest in everything:
        uri = result.moved.get(manifest.uri, manifest.uri)
        upstream = [UpstreamRef(u.asset_key, u.partition, u.data_version, result.moved.get(u.uri, u.uri))
                    for u in manifest.upstream]
        if uri != manifest.uri or upstream != manifest.upstream:
            manifest.uri, manifest.upstream = uri, upstream
            store.write_manifest(manifest)
        if manifest.uri in result.moved.values():
            store.point(manifest)
    _remove_empty_old_dirs(store, list(result.moved))
    result.old_paths = _files_naming(store, list(result.moved.values()), list(result.moved))
    result.seconds = time.monotonic() - started
    if verify:
        verify_started = time.monotonic()
        seen: dict = {}
        for target in result.moved.values():
            moved = store.read_manifest(target)
            if moved is None:
                result.problems.append(f"{target}: manifest missing after the move")
                continue
            root = build_lineage(store, moved, verify=True, _seen=seen)
            result.problems.extend(p for n in root.unique() for p in n.problems if p not in result.problems)
        result.verify_seconds = time.monotonic() - verify_started
    return result


CONFIG_SUFFIXES = (".json", ".yaml", ".yml")
CONFIG_MAX_BYTES = 1 << 20


def _files_naming(store: ArtifactStore, artifacts: list[str], old_uris: list[str]) -> list[str]:
    """Small config files of these artifacts whose text names one of the old locations."""
    # Longest first, so that `.../v1/a` is reported rather than its parent `.../v1`.
    olds = sorted(old_uris, key=len, reverse=True)
    found = []
    for uri in artifacts:
        manifest = store.read_manifest(uri)
        for entry in manifest.files if manifest is not None else []:
            if not entry.path.endswith(CONFIG_SUFFIXES) or entry.bytes > CONFIG_MAX_BYTES:
                continue
            with store.open(f"{uri}/{entry.path}") as fh:
                text = fh.read().decode("utf-8", "replace")
            named = next((old for old in olds if re.search(re.escape(old) + r"(?![\w.=+-])", text)), None)
            if named is not None:
                found.append(f"{uri}/{entry.path}: names {named}")
    return found


def _move_dir(store: ArtifactStore, old: str, new: str) -> None:
    src, dst = store.fs_path(old), store.fs_path(new)
    store.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
    if store.is_local:
        import os

        os.rename(src, dst)  # one atomic step: the manifest never exists in two places
        return
    # Object stores: copy everything, the manifest last, then delete the old copy, the manifest first,
    # so that at every moment each location is either complete or has no manifest.
    files = sorted(store.fs.find(src, withdirs=False))
    manifest = f"{src}/{MANIFEST_NAME}"
    for path in [p for p in files if p != manifest] + [manifest]:
        store.retrying(lambda p=path: store.fs.copy(p, dst + p[len(src):]))
    store.fs.rm_file(manifest)
    store.fs.rm(src, recursive=True)


def _remove_empty_old_dirs(store: ArtifactStore, old_uris: list[str]) -> None:
    """The old `{key}/{code_version}` directories that the moves left empty."""
    parents = {store.fs_path(uri).rsplit("/", 1)[0] for uri in old_uris}
    for path in sorted(parents | {store.fs_path(uri) for uri in old_uris}, reverse=True):
        try:
            if store.fs.exists(path) and not store.fs.find(path, withdirs=False):
                store.fs.rm(path, recursive=True)
        except FileNotFoundError:
            continue
