"""A stage's committed artifacts with a cache of their manifests: what `marin status` reads for a
partitioned asset instead of two or three store requests per partition.

A stage is one asset at one code version: its identity directories `{code_version}-{fingerprint}`
with their partitions, and its refs. On an object store `StageListing` lists them once (one
recursive listing, a request per 1,000 objects); on local disk `LocalStage` stats each partition's
manifest and listed files (a stat costs far less than reading the two directories a listing would).
Either answers for every partition what the per-partition lookups answered (`ArtifactStore.find`,
`find_previous`, `check_files`, whether a ref exists):

* **The listing (or the stat) is live, the index is a cache.** Which artifacts are committed, and
  each file's size for the cheap check, come from this command's listing or stats, so a commit, a
  rebuild's `begin` (its manifest removed) or a retraction that landed before is seen, as with the
  per-partition reads. The index, `{asset key}/.index/{code_version}.json.gz`, only saves reading
  each manifest: it holds every manifest's stored JSON with the *stamp* its object had (local disk:
  inode, size and mtime in ns; GCS: generation; S3: ETag, the MD5 of the one PUT that writes a
  manifest). An entry is used only where the store shows the same stamp now; every other manifest
  (the tail: committed or rewritten since the index was written) is read from the store. So a stale
  index costs reads, never a wrong answer, and two commands rewriting it at once need no lock: the
  last write wins and each write holds only entries it validated.
* **A partition caught between states** (a directory without a committed manifest: being written,
  rebuilt or abandoned, or a manifest gone between the listing and its read) is looked up one by one
  (`find`, then `find_previous`, then `find` again: a commit landing between two reads is seen).
* **Rewritten by its readers.** A command that read at least `REWRITE_AFTER` manifests of the tail,
  or found as many entries gone, writes the index again (atomically: rename, one PUT). Writers never
  touch it: a commit stays one manifest write, and 75,000 shards committing at once do not contend
  for one object.
* **Not for `--verify`.** A full check re-hashes every file and reads every manifest from the store
  (`ArtifactStore.verify`); the planner uses no index then.

A listing is a snapshot for one `marin status`: a command that builds (`marin materialize`) looks
its artifacts up one by one, since its own runs commit while it waits.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import stat as stat_module
from collections.abc import Iterator
from dataclasses import dataclass, field

from marin_resources.storage.store import (
    MANIFEST_NAME,
    PREVIOUS_DIR,
    REFS_DIR,
    ArtifactStore,
    Manifest,
    _is_bookkeeping,
    parse_version_dir,
    size_problems,
    version_dir,
)

INDEX_DIR = ".index"
INDEX_FORMAT = 1
# A listing that read this many manifests the index did not hold (or found as many entries gone)
# writes it again: a few new commits are cheaper to read than the index is to rewrite.
REWRITE_AFTER = 64
# Manifests of the tail fetched at once on an object store (fsspec's batched `cat`).
READS_IN_FLIGHT = 32


def index_path(store: ArtifactStore, asset_key: str, code_version: str) -> str:
    """The fsspec path of a stage's index of manifests."""
    return "/".join([store.root, *asset_key.split("/"), INDEX_DIR, f"{code_version}.json.gz"])


@dataclass
class ListedFile:
    bytes: int
    stamp: str  # what changes whenever the object is written again (see the module docstring)


def _local_names(root: str, top: str) -> Iterator[tuple[str, ListedFile]]:
    """The refs under ``root/top``: their names are all a listing needs (no stat each)."""
    try:
        versions = [e.name for e in os.scandir(f"{root}/{top}") if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return
    for version in versions:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(f"{root}/{top}/{version}"):
                yield f"{top}/{version}/{entry.name}", ListedFile(0, "")


def _object_stamp(info: dict) -> str:
    """What identifies one write of an object: its generation (GCS) or ETag (S3: the MD5 of a single
    PUT), with the size and modification time beside it."""
    tag = next((str(info[k]) for k in ("generation", "ETag", "etag", "md5Hash") if info.get(k) is not None), "")
    when = next((str(info[k]) for k in ("mtime", "LastModified", "updated") if info.get(k) is not None), "")
    return f"{tag}:{info.get('size')}:{when}"


@dataclass
class StageListing:
    """One listing of a partitioned stage (see the module docstring); made by `list_stage`."""

    store: ArtifactStore
    asset_key: str
    code_version: str
    # `{version dir}/{partition}` -> {file: bytes} of each artifact directory holding a manifest
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    manifests: dict[str, Manifest] = field(default_factory=dict)  # same keys: the committed manifest
    previous: set[str] = field(default_factory=set)  # same keys: a rebuild keeps a committed artifact there
    refs: dict[str, set[str]] = field(default_factory=dict)  # code version -> partitions with a ref
    code_versions: list[str] = field(default_factory=list)  # every code version with an identity directory
    # Same keys: a directory without a committed manifest as listed, being written, or abandoned, or
    # one whose manifest went while it was listed (a listing is no snapshot): looked up one by one.
    unsettled: set[str] = field(default_factory=set)
    _settled: dict[str, tuple[Manifest | None, Manifest | None]] = field(default_factory=dict)
    tail_reads: int = 0  # manifests read from the store, not from the index
    index_written: bool = False

    def _key(self, partition: str, fingerprint: str) -> str:
        return f"{version_dir(self.code_version, fingerprint)}/{partition}"

    def find(self, partition: str, fingerprint: str) -> Manifest | None:
        """`ArtifactStore.find` of this identity, as listed."""
        key = self._key(partition, fingerprint)
        if key in self.unsettled:
            return self._settle(partition, fingerprint)[0]
        manifest = self.manifests.get(key)
        if manifest is not None and manifest.fingerprint[:len(fingerprint)] != fingerprint:
            # A prefix collision: the store's own lookup says so.
            return self.store.find(self.asset_key, self.code_version, partition, fingerprint=fingerprint)
        return manifest

    def find_previous(self, partition: str, fingerprint: str) -> Manifest | None:
        """`ArtifactStore.find_previous` of this identity: read only where the listing shows one kept."""
        key = self._key(partition, fingerprint)
        if key in self.unsettled:
            return self._settle(partition, fingerprint)[1]
        if key not in self.previous:
            return None
        return self.store.find_previous(self.asset_key, self.code_version, partition, fingerprint=fingerprint)

    def _settle(self, partition: str, fingerprint: str) -> tuple[Manifest | None, Manifest | None]:
        """The committed artifact, or the one a rebuild keeps, of a directory the listing caught
        between states, read from the store: the manifest, else the kept one, else the manifest again
        (a commit that landed between the two reads), a few times over."""
        key = self._key(partition, fingerprint)
        if key not in self._settled:
            found: tuple[Manifest | None, Manifest | None] = (None, None)
            for _ in range(3):
                manifest = self.store.find(self.asset_key, self.code_version, partition, fingerprint=fingerprint)
                if manifest is not None:
                    found = (manifest, None)
                    break
                kept = self.store.find_previous(self.asset_key, self.code_version, partition, fingerprint=fingerprint)
                if kept is not None:
                    found = (None, kept)
                    break
            self._settled[key] = found
        return self._settled[key]

    def has_ref(self, code_version: str, partition: str) -> bool:
        return partition in self.refs.get(code_version, ())

    def check_files(self, manifest: Manifest) -> list[str]:
        """`ArtifactStore.check_files`, with the sizes of this listing."""
        key = self._key(manifest.partition, manifest.fingerprint)
        if key in self.unsettled:
            return self.store.check_files(manifest)  # read after the listing: its files are listed again
        return size_problems(manifest, self.files.get(key, {}))

    def finish(self) -> None:
        """Called when the command is done with the stage: a listing wrote its index already."""


@dataclass
class LocalStage(StageListing):
    """A stage on local disk, looked up partition by partition, without listing: its manifest's stat
    (the stamp), the manifest from the index where the stamp matches, else read, and each listed
    file's stat for the cheap check. A `stat` costs far less than reading a directory: the listing
    read two directories per partition (raw's partitions each have an identity directory of their
    own), 13 of 14 CPU-seconds of a status at 20,000 partitions. What a listing would have shown of
    a partition is what these calls show of it, at the moment they are made."""

    cached: dict[str, list] = field(default_factory=dict)  # the index as read: manifest path -> entry
    entries: dict[str, list] = field(default_factory=dict)  # the index to write: entries validated now
    gone: int = 0  # entries of the index whose manifest is no longer there
    _looked: dict[str, Manifest | None] = field(default_factory=dict)

    def _look(self, partition: str, fingerprint: str) -> Manifest | None:
        key = self._key(partition, fingerprint)
        if key in self._looked:
            return self._looked[key]
        base, rel = "/".join([self.store.root, *self.asset_key.split("/")]), f"{key}/{MANIFEST_NAME}"
        manifest = None
        try:
            st = os.stat(f"{base}/{rel}")
        except FileNotFoundError:
            if os.path.isdir(f"{base}/{key}"):
                self.unsettled.add(key)  # being written or rebuilt, or abandoned: read one by one
            self.gone += rel in self.cached
        else:
            stamp = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            entry = self.cached.get(rel)
            stored = entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[0] == stamp else None
            if stored is None:
                self.tail_reads += 1
                try:
                    with open(f"{base}/{rel}", "rb") as fh:
                        stored = json.loads(fh.read().decode("utf-8"))
                except FileNotFoundError:
                    self.unsettled.add(key)  # removed since its stat: a rebuild began
            if stored is not None:
                self.entries[rel] = [stamp, stored]
                uri = "/".join([self.store.prefix, *self.asset_key.split("/"), key])
                manifest = self.store.manifest_from_stored(stored, uri)
        self._looked[key] = manifest
        return manifest

    def find(self, partition: str, fingerprint: str) -> Manifest | None:
        manifest = self._look(partition, fingerprint)
        if self._key(partition, fingerprint) in self.unsettled:
            return self._settle(partition, fingerprint)[0]
        if manifest is not None and manifest.fingerprint[:len(fingerprint)] != fingerprint:
            return self.store.find(self.asset_key, self.code_version, partition, fingerprint=fingerprint)
        return manifest

    def find_previous(self, partition: str, fingerprint: str) -> Manifest | None:
        # A rebuild's kept artifact is looked for where no manifest is committed, as the planner does;
        # its directory is then there and the partition is unsettled.
        self._look(partition, fingerprint)
        if self._key(partition, fingerprint) in self.unsettled:
            return self._settle(partition, fingerprint)[1]
        return None

    def check_files(self, manifest: Manifest) -> list[str]:
        key = self._key(manifest.partition, manifest.fingerprint)
        if key in self.unsettled:
            return self.store.check_files(manifest)
        base, sizes = self.store.fs_path(manifest.uri), {}
        for entry in manifest.files:
            try:
                st = os.lstat(f"{base}/{entry.path}")
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat_module.S_ISREG(st.st_mode):  # a link is no content, as `file_stats` lists
                sizes[entry.path] = st.st_size
        return size_problems(manifest, sizes)

    def finish(self) -> None:
        """Write the index again when it was far behind, with the entries validated now: a status
        looks at every partition the asset has, so what it did not look at is an identity no longer
        wanted or a retired partition (kept, the index would grow with every config ever built)."""
        if self.tail_reads < REWRITE_AFTER and self.gone < REWRITE_AFTER:
            return
        _write_index(self.store, self.asset_key, self.code_version, self.entries)
        self.index_written = True


def _write_index(store: ArtifactStore, asset_key: str, code_version: str, entries: dict[str, list]) -> None:
    body = json.dumps({"format": INDEX_FORMAT, "asset_key": asset_key, "code_version": code_version,
                       "entries": dict(sorted(entries.items()))}, separators=(",", ":"))
    store._write_atomic(index_path(store, asset_key, code_version), gzip.compress(body.encode("utf-8"),
                                                                                   compresslevel=1))


def _list(store: ArtifactStore, base: str, code_version: str) -> tuple[dict[str, ListedFile | None], list[str]]:
    """Every object (and directory, with None) of the stage's identity directories and every ref of
    the asset, relative to the asset's directory ``base``, from one recursive listing of an object
    store, and every code version that has an identity directory."""
    try:
        found = store.retrying(lambda: store.fs.find(base, withdirs=True, detail=True))
    except FileNotFoundError:
        return {}, []
    listed, tops = {}, set()
    for path, info in found.items():
        rel = path[len(base):].strip("/")
        top = rel.split("/", 1)[0]
        tops.add(top)
        parsed = parse_version_dir(top)
        if "/" in rel and (top == REFS_DIR or (parsed is not None and parsed[0] == code_version)):
            listed[rel] = None if info.get("type") == "directory" else \
                ListedFile(int(info.get("size") or 0), _object_stamp(info))
    versions = sorted({parsed[0] for top in tops if (parsed := parse_version_dir(top)) is not None})
    return listed, versions


def _read_index(store: ArtifactStore, path: str) -> dict[str, list]:
    """The index's entries (manifest path -> [stamp, stored manifest]); none where there is no index
    or it cannot be read (a cache: a damaged one is written again, never trusted)."""
    try:
        body = json.loads(gzip.decompress(store.retrying(lambda: store.fs.cat_file(path))))
    except (OSError, EOFError, ValueError):  # FileNotFoundError among them
        return {}
    if not isinstance(body, dict) or body.get("format") != INDEX_FORMAT or not isinstance(body.get("entries"), dict):
        return {}
    return body["entries"]


def _read_manifests(store: ArtifactStore, base: str, rels: list[str]) -> dict[str, dict | None]:
    """The stored JSON of each manifest (None: removed since it was listed), ``READS_IN_FLIGHT`` at a
    time on an object store."""
    paths = [f"{base}/{rel}" for rel in rels]
    options = {} if store.is_local else {"batch_size": READS_IN_FLIGHT}
    bodies = store.fs.cat(paths, on_error="return", **options) if paths else {}
    out: dict[str, dict | None] = {}
    for rel, path in zip(rels, paths, strict=True):
        body = bodies.get(path)
        if isinstance(body, BaseException) and not isinstance(body, FileNotFoundError):
            try:  # a transient error: this one again, within the retry policy
                body = store.retrying(lambda p=path: store.fs.cat_file(p))
            except FileNotFoundError:
                body = None
        out[rel] = json.loads(body.decode("utf-8")) if isinstance(body, bytes) else None
    return out


def list_stage(store: ArtifactStore, asset_key: str, code_version: str) -> StageListing:
    """List a partitioned stage once and take each listed manifest from the index where its stamp
    matches, else from the store; rewrite the index when it was far behind (module docstring)."""
    base = "/".join([store.root, *asset_key.split("/")])
    if store.is_local:
        local = LocalStage(store, asset_key, code_version, cached=_read_index(store, index_path(
            store, asset_key, code_version)))
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            tops = [e.name for e in os.scandir(base) if e.is_dir(follow_symlinks=False)]
            local.code_versions = sorted({parsed[0] for top in tops if (parsed := parse_version_dir(top))})
            for rel, _ in _local_names(base, REFS_DIR):
                local.refs.setdefault(rel.split("/")[1], set()).add(rel.split("/")[2])
        return local
    listing = StageListing(store, asset_key, code_version)
    listed, listing.code_versions = _list(store, base, code_version)
    manifest_paths: dict[str, ListedFile] = {}
    directories = set()  # every artifact directory listed, committed or not
    for rel, listed_file in listed.items():
        parts = rel.split("/")
        if parts[0] != REFS_DIR and len(parts) >= 2:
            directories.add(f"{parts[0]}/{parts[1]}")
        if listed_file is None:
            continue
        if parts[0] == REFS_DIR:
            if len(parts) == 3:
                listing.refs.setdefault(parts[1], set()).add(parts[2])
        elif len(parts) == 4 and parts[2:] == [PREVIOUS_DIR, MANIFEST_NAME]:
            listing.previous.add(f"{parts[0]}/{parts[1]}")
        elif len(parts) == 3 and parts[2] == MANIFEST_NAME:
            manifest_paths[rel] = listed_file
    for rel, listed_file in listed.items():  # each artifact's files, as `file_stats` lists them
        parts = rel.split("/", 2)
        if listed_file is not None and len(parts) == 3 and parts[0] != REFS_DIR and not _is_bookkeeping(parts[2]) \
                and f"{parts[0]}/{parts[1]}/{MANIFEST_NAME}" in manifest_paths:
            listing.files.setdefault(f"{parts[0]}/{parts[1]}", {})[parts[2]] = listed_file.bytes

    path = index_path(store, asset_key, code_version)
    cached = _read_index(store, path)
    stored: dict[str, dict | None] = {}
    for rel, listed_file in manifest_paths.items():
        entry = cached.get(rel)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == listed_file.stamp:
            stored[rel] = entry[1]
    tail = [rel for rel in manifest_paths if rel not in stored]
    stored.update(_read_manifests(store, base, tail))
    listing.tail_reads = len(tail)
    uri_base = "/".join([store.prefix, *asset_key.split("/")])
    for rel in manifest_paths:
        if stored[rel] is not None:  # None: removed since the listing (a rebuild began)
            directory = rel[:-len(MANIFEST_NAME) - 1]
            listing.manifests[directory] = store.manifest_from_stored(stored[rel], f"{uri_base}/{directory}")
    listing.unsettled = directories - set(listing.manifests)
    gone = len(set(cached) - set(manifest_paths))
    if listing.tail_reads >= REWRITE_AFTER or gone >= REWRITE_AFTER:
        _write_index(store, asset_key, code_version, {rel: [manifest_paths[rel].stamp, stored[rel]]
                                                      for rel in manifest_paths if stored[rel] is not None})
        listing.index_written = True
    return listing
