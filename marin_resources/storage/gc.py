"""Garbage collection of artifact versions: with the identity in the path, every config ever built
stays in the store until removed here.

An artifact is kept when something current references it: it is the artifact of the identity
the code wants now, or the one its asset last committed or reused (its ref), or it is pinned, or
it is an input (transitively) of a kept artifact. Everything else under the assets the code
location knows is removed. Directories holding a lease (a writer at work) are never touched.

Pins live in the store, so every machine sharing it agrees: `{prefix}/.marin/pins`, one
artifact path relative to the prefix per line (`checkpoint/v1-1a2b3c4d/probe-d64`), or a glob
of them (`checkpoint/*/probe-d64`); `#` starts a comment.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from marin_resources.storage.store import (
    LOCK_NAME,
    MANIFEST_NAME,
    REFS_DIR,
    UNPARTITIONED_REF,
    ArtifactStore,
    Manifest,
    parse_version_dir,
)

PINS_PATH = ".marin/pins"


@dataclass
class GcPlan:
    kept: list[str] = field(default_factory=list)
    removed: list[tuple[str, int]] = field(default_factory=list)  # (uri, bytes)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (uri, why it stays)
    stale_refs: list[str] = field(default_factory=list)

    @property
    def removed_bytes(self) -> int:
        return sum(size for _, size in self.removed)


class OldLayoutError(RuntimeError):
    """The store still has artifacts in the `{key}/{code_version}/{partition}` layout."""


def read_pins(store: ArtifactStore) -> list[str]:
    try:
        text = store.fs.cat_file(f"{store.root}/{PINS_PATH}").decode("utf-8")
    except FileNotFoundError:
        return []
    return [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]


def add_pin(store: ArtifactStore, uri: str) -> str:
    """Pin one artifact (its path relative to the prefix); returns the pin line."""
    pin = relative(store, uri)
    pins = read_pins(store)
    if pin not in pins:
        body = "".join(f"{p}\n" for p in [*pins, pin])
        store._write_atomic(f"{store.root}/{PINS_PATH}", body.encode())
    return pin


def relative(store: ArtifactStore, uri: str) -> str:
    return uri[len(store.prefix):].strip("/")


def plan_gc(store: ArtifactStore, assets: dict[str, tuple[bool, str]], current: Iterable[Manifest],
            keep: Iterable[str] = ()) -> GcPlan:
    """What `marin gc` removes. `assets`: asset key -> (partitioned, code version), for every asset
    the code location knows (nothing outside them is touched); `current`: the artifacts the code
    wants now; `keep`: patterns like pins, from the command line."""
    patterns = [*read_pins(store), *keep]
    candidates: dict[str, Manifest | None] = {}
    for key, (partitioned, _) in sorted(assets.items()):
        for uri, manifest, identity_dir in _artifact_dirs(store, key, partitioned):
            if manifest is not None and not identity_dir:
                raise OldLayoutError(f"{uri} is in the old {{key}}/{{code_version}}/{{partition}} layout; "
                                     "run `marin migrate` first")
            candidates[uri] = manifest
    roots = [m.uri for m in current]
    # The refs of each asset's current code version: what it last committed or reused.
    roots += [uri for key, (_, version) in assets.items() for ref, uri in _refs(store, key)
              if ref.rsplit("/", 2)[-2] == version]
    roots += [uri for uri in candidates if any(fnmatch.fnmatchcase(relative(store, uri), p) for p in patterns)]
    referenced = _closure(store, roots)
    plan = GcPlan()
    for uri in sorted(candidates):
        if uri in referenced:
            plan.kept.append(uri)
        elif store.fs.exists(f"{store.fs_path(uri)}/{LOCK_NAME}"):
            plan.skipped.append((uri, "a writer holds its lease"))
        else:
            plan.removed.append((uri, _size(store, uri)))
    gone = {uri for uri, _ in plan.removed}
    for key in assets:
        for ref_path, target in _refs(store, key):
            if target in gone or (target not in candidates and not store.fs.exists(store.fs_path(target))):
                plan.stale_refs.append(ref_path)
    return plan


def run_gc(store: ArtifactStore, plan: GcPlan) -> None:
    """Remove what the plan lists: the manifest first (the artifact stops existing), then its files,
    then identity directories left empty and refs that name removed artifacts."""
    parents = set()
    for uri, _ in plan.removed:
        path = store.fs_path(uri)
        if store.fs.exists(f"{path}/{MANIFEST_NAME}"):
            store.fs.rm_file(f"{path}/{MANIFEST_NAME}")
        store.fs.rm(path, recursive=True)
        parents.add(path.rsplit("/", 1)[0])
    for path in plan.stale_refs:
        store.fs.rm_file(path)
    for parent in sorted(parents, reverse=True):
        if parse_version_dir(parent.rsplit("/", 1)[-1]) is not None and _is_empty(store, parent):
            store.fs.rm(parent, recursive=True)


def _is_empty(store: ArtifactStore, path: str) -> bool:
    try:
        return not store.fs.find(path, withdirs=False)
    except FileNotFoundError:
        return False


def _artifact_dirs(store: ArtifactStore, key: str,
                   partitioned: bool) -> list[tuple[str, Manifest | None, bool]]:
    """Every artifact directory of one asset, in either layout: (uri, its manifest or None when
    never committed or withdrawn, whether it sits in an identity directory)."""
    base = f"{store.prefix}/{key}"
    found = []
    for version in store._dirs(base):
        identity_dir = parse_version_dir(version) is not None
        uris = [f"{base}/{version}/{part}" for part in store._dirs(f"{base}/{version}")] if partitioned \
            else [f"{base}/{version}"]
        found.extend((uri, store.read_manifest(uri), identity_dir) for uri in uris)
    return found


def _refs(store: ArtifactStore, key: str) -> list[tuple[str, str]]:
    """(ref path, the artifact URI it names) of every ref of one asset."""
    base = f"{store.fs_path(f'{store.prefix}/{key}')}/{REFS_DIR}"
    try:
        paths = store.fs.find(base, withdirs=False)
    except FileNotFoundError:
        return []
    out = []
    for path in paths:
        code_version, name = path.rsplit("/", 2)[-2:]
        fingerprint = str(json.loads(store.fs.cat_file(path))["fingerprint"])
        partition = None if name == UNPARTITIONED_REF else name
        out.append((path, store.artifact_uri(key, code_version, partition, fingerprint=fingerprint)))
    return out


def _closure(store: ArtifactStore, roots: Iterable[str]) -> set[str]:
    """The roots and every artifact in the store they were built from."""
    seen: set[str] = set()
    todo = [r for r in roots]
    while todo:
        uri = todo.pop()
        if uri in seen:
            continue
        seen.add(uri)
        # An artifact whose rebuild has not committed keeps its inputs through the one it replaces.
        manifest = store.read_last_committed(uri)
        if manifest is not None:
            todo.extend(u.uri for u in manifest.upstream if u.uri.startswith(store.prefix + "/"))
    return seen


def _size(store: ArtifactStore, uri: str) -> int:
    try:
        return int(store.fs.du(store.fs_path(uri), total=True))
    except FileNotFoundError:
        return 0
