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

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from marin_resources.storage.lineage import build_lineage
from marin_resources.storage.store import (
    LOCK_NAME,
    MANIFEST_NAME,
    PREVIOUS_DIR,
    ArtifactStore,
    Manifest,
    UpstreamRef,
)

Log = Callable[[str], None]


@dataclass
class Migration:
    moved: dict[str, str] = field(default_factory=dict)  # old uri -> new uri
    already: int = 0
    refused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # "<file>: names <old uri>" for small config files that name a moved artifact's old location.
    old_paths: list[str] = field(default_factory=list)
    finished: int = 0  # old copies left by a run killed while it deleted them, deleted now
    rewritten: int = 0  # manifests whose input references were made to name the new locations
    pointed: int = 0  # refs written
    bytes: int = 0
    files: int = 0
    seconds: float = 0.0
    verify_seconds: float = 0.0


def manifests(store: ArtifactStore) -> list[Manifest]:
    """Every committed manifest in the store, from one listing (the artifacts unfinished rebuilds keep
    move with the directory they are kept in)."""
    suffix = "/" + MANIFEST_NAME
    found = []
    for path in sorted(store.fs.find(store.root, withdirs=False)):
        if path.endswith(suffix) and not path.endswith(f"/{PREVIOUS_DIR}{suffix}"):
            uri = store.prefix + path[len(store.root):-len(suffix)]
            found.append(store.parse_manifest(store.fs.cat_file(path).decode("utf-8"), uri))
    return found


def old_uri(store: ArtifactStore, manifest: Manifest) -> str:
    """Where the old layout kept this artifact."""
    segments = [*manifest.asset_key.split("/"), manifest.code_version]
    if manifest.partition is not None:
        segments.append(manifest.partition)
    return "/".join([store.prefix, *segments])


def target_uri(store: ArtifactStore, manifest: Manifest) -> str:
    """Where the identity layout puts this artifact."""
    return store.artifact_uri(manifest.asset_key, manifest.code_version, manifest.partition,
                              fingerprint=manifest.fingerprint)


def migrate(store: ArtifactStore, *, dry_run: bool = False, verify: bool = True, log: Log = print) -> Migration:
    """Move every old-layout artifact, then bring every manifest and ref in line with where the artifacts
    are. Each step's outcome is read back from the store, not remembered from this run, so a run killed
    at any point is finished by the next: an artifact it moved is in place, one it was copying (object
    stores) is copied again, one whose old copy it was deleting loses the rest of it, and every input
    reference that still names an old location, and every moved artifact still without a ref, is
    repaired then, whichever run moved it."""
    started = time.monotonic()
    result = Migration()
    everything = manifests(store)
    to_move: list[tuple[Manifest, str]] = []
    leftovers: list[Manifest] = []  # old copies of artifacts an interrupted run had copied in full
    for manifest in everything:
        target = target_uri(store, manifest)
        if manifest.uri == target:
            result.already += 1
        elif manifest.uri != old_uri(store, manifest):
            result.refused.append(f"{manifest.uri}: not where either layout puts {manifest.asset_key}; left alone")
        elif store.fs.exists(f"{store.fs_path(manifest.uri)}/{LOCK_NAME}") or \
                store.fs.exists(f"{store.fs_path(target)}/{LOCK_NAME}"):
            result.refused.append(f"{manifest.uri}: a writer holds its lease; migrate when it is done")
        elif not store.fs.exists(store.fs_path(target)):
            to_move.append((manifest, target))
        elif (there := store.read_manifest(target)) is None:
            to_move.append((manifest, target))  # a copy cut short (no manifest yet): it is made again
        elif (there.fingerprint, there.data_version) == (manifest.fingerprint, manifest.data_version):
            leftovers.append(manifest)
        else:
            result.refused.append(f"{manifest.uri}: {target} already exists; left alone")
    for manifest, target in to_move:
        result.moved[manifest.uri] = target
        result.files += len(manifest.files)
        result.bytes += sum(f.bytes for f in manifest.files)
        log(f"  {'would move' if dry_run else 'move'} {manifest.uri[len(store.prefix) + 1:]} -> "
            f"{target[len(store.prefix) + 1:]}")
    # Every artifact where it will be once the moves are done.
    moved_uris = set(result.moved)
    placed = [m for m in everything if m.uri == target_uri(store, m)] + \
        [dataclasses.replace(m, uri=t) for m, t in to_move]
    leftover_uris = {m.uri for m in leftovers}
    stay = {m.uri for m in everything if m.uri not in moved_uris and m.uri not in leftover_uris}
    rewrites = _input_rewrites(store, placed, live={m.uri for m in placed} | stay)
    unpointed = _without_ref(store, placed, moved=set(result.moved.values()))
    result.finished, result.rewritten, result.pointed = len(leftovers), len(rewrites), len(unpointed)
    touched = set(result.moved.values()) | {m.uri for m, _ in rewrites} | {m.uri for m in unpointed} | \
        {target_uri(store, m) for m in leftovers}
    for manifest in leftovers:
        log(f"  {'would finish' if dry_run else 'finish'} the move of {manifest.uri[len(store.prefix) + 1:]}")
    if dry_run:
        result.seconds = time.monotonic() - started
        return result
    for manifest in leftovers:
        _remove_artifact_dir(store, manifest.uri)
    for manifest, target in to_move:
        if store.fs.exists(store.fs_path(target)):
            store.fs.rm(store.fs_path(target), recursive=True)
        _move_dir(store, manifest.uri, target)
    for manifest, upstream in rewrites:
        manifest.upstream = upstream
        store.write_manifest(manifest)
    for manifest in unpointed:
        store.point(manifest)
    relocated = [old_uri(store, m) for m in placed if old_uri(store, m) not in stay]
    _remove_old_dirs(store, relocated)
    result.old_paths = _files_naming(store, sorted(touched), relocated)
    result.seconds = time.monotonic() - started
    if verify:
        verify_started = time.monotonic()
        seen: dict = {}
        for uri in sorted(touched):
            manifest = store.read_manifest(uri)
            if manifest is None:
                result.problems.append(f"{uri}: manifest missing after the move")
                continue
            root = build_lineage(store, manifest, verify=True, _seen=seen)
            result.problems.extend(p for n in root.unique() for p in n.problems if p not in result.problems)
        result.verify_seconds = time.monotonic() - verify_started
    return result


def _input_rewrites(store: ArtifactStore, placed: list[Manifest], live: set[str]) -> list[tuple[Manifest, list]]:
    """``(manifest, its new upstream)`` for each manifest with an input reference naming an old location
    where no artifact is any more: it names the artifact of that key, code version and partition now in
    the identity layout whose data version the reference records (there may be several fingerprints)."""
    by_old: dict[str, list[Manifest]] = {}
    for manifest in placed:
        by_old.setdefault(old_uri(store, manifest), []).append(manifest)

    def located(ref: UpstreamRef) -> str:
        if ref.uri in live:
            return ref.uri
        found = [m.uri for m in by_old.get(ref.uri, []) if m.data_version == ref.data_version]
        return found[0] if len(found) == 1 else ref.uri

    rewrites = []
    for manifest in placed:
        upstream = [dataclasses.replace(u, uri=located(u)) for u in manifest.upstream]
        if upstream != manifest.upstream:
            rewrites.append((manifest, upstream))
    return rewrites


def _without_ref(store: ArtifactStore, placed: list[Manifest], moved: set[str]) -> list[Manifest]:
    """The artifacts to make current: each one moved now, and each in the identity layout whose asset
    partition has no ref at all and no other identity (an artifact a killed run moved but never pointed)."""
    identities: dict[tuple, int] = {}
    for manifest in placed:
        key = (manifest.asset_key, manifest.code_version, manifest.partition)
        identities[key] = identities.get(key, 0) + 1
    return [m for m in placed if m.uri in moved or (
        identities[(m.asset_key, m.code_version, m.partition)] == 1
        and store.current_fingerprint(m.asset_key, m.code_version, m.partition) is None)]


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
    _remove_artifact_dir(store, old)


def _remove_artifact_dir(store: ArtifactStore, uri: str) -> None:
    """Delete an artifact's directory, its manifest first: a half-deleted one never looks committed."""
    path = store.fs_path(uri)
    store.fs.rm_file(f"{path}/{MANIFEST_NAME}")
    store.fs.rm(path, recursive=True)


def _remove_old_dirs(store: ArtifactStore, old_uris: list[str]) -> None:
    """What the moves left at the old locations of artifacts now in the identity layout: the rest of an
    old directory whose delete was cut short (its manifest went first; object stores), and the old
    `{key}/{code_version}` directories left empty. A directory holding a lease is left alone."""
    for uri in old_uris:
        path = store.fs_path(uri)
        if store.fs.exists(path) and not store.fs.exists(f"{path}/{LOCK_NAME}"):
            store.fs.rm(path, recursive=True)
    for path in sorted({store.fs_path(uri).rsplit("/", 1)[0] for uri in old_uris}, reverse=True):
        try:
            if store.fs.exists(path) and not store.fs.find(path, withdirs=False):
                store.fs.rm(path, recursive=True)
        except FileNotFoundError:
            continue
