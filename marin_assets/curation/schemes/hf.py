"""``hf://datasets/ORG/NAME[@REVISION][/GLOB]``: files of a Hugging Face Hub repository, read through
huggingface_hub's ``HfFileSystem``, each pinned to a commit when listed (:func:`list_hf_files`)."""

from __future__ import annotations

import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from marin_assets.curation.listed_files import FileRef
from marin_assets.curation.schemes.base import (
    GLOB_CHARS,
    FileState,
    ListedSource,
    ReadThroughFsspec,
    SourceUriError,
    absolute_uri,
    file_sha256,
    is_pinned_file,
)
from marin_assets.curation.schemes.fsspec_listing import glob_root, listed_file, relative

HF_SCHEME = "hf"
_HF_PATH_RE = re.compile(r"^(?P<kind>datasets/|spaces/|models/)?(?P<repo>[^/@]+/[^/@]+)"
                         r"(?:@(?P<rev>[^/]+))?(?:/(?P<path>.*))?$")


def use_hf_endpoint() -> None:
    """Point fsspec's ``hf://`` filesystem at ``$HF_ENDPOINT`` (a mirror, or a test's stand-in) when it
    is set. Like the token (``$HF_TOKEN``, which huggingface_hub reads itself), the endpoint is a
    runtime choice: URIs, and so shard fingerprints, never carry it. huggingface_hub reads
    ``HF_ENDPOINT`` once at import; this reads it whenever a source is listed or opened."""
    import fsspec.config

    hf = {k: v for k, v in fsspec.config.conf.get(HF_SCHEME, {}).items() if k != "endpoint"}
    if os.environ.get("HF_ENDPOINT"):
        hf["endpoint"] = os.environ["HF_ENDPOINT"].rstrip("/")
    fsspec.config.conf[HF_SCHEME] = hf


def hub_commit(repo_id: str, repo_type: str, revision: str | None, where: str):
    """fsspec's ``hf://`` filesystem and the commit that ``revision`` (default main) of a Hub repository
    is now. A missing repository or revision is a ``FileNotFoundError`` with one line, after ``where``."""
    import fsspec
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

    fs = fsspec.filesystem(HF_SCHEME)
    try:
        return fs, HfApi(endpoint=fs.endpoint, token=fs.token).repo_info(repo_id, repo_type=repo_type,
                                                                         revision=revision).sha
    except (RepositoryNotFoundError, HFValidationError):
        raise FileNotFoundError(f"{where}: no {repo_type} repository {repo_id!r} at {fs.endpoint} (or it is "
                                "private or gated and HF_TOKEN does not grant access)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{where}: {repo_type} repository {repo_id!r} has no revision {revision!r}") from None


def list_hf_files(source: ListedSource) -> list[FileRef]:
    """The files of ``hf://datasets/ORG/NAME[@REVISION][/GLOB]``, each pinned to a commit.

    The revision (default ``main``; a branch, tag or sha) is resolved to its commit once, the glob
    is listed at that commit, and each file's URI names the last commit that changed the file
    (``hf://datasets/ORG/NAME@<sha>/path``): reading it later gives the same bytes whatever the
    branch has become, and a new commit that leaves a file alone leaves its URI, and so its shard's
    fingerprint, alone. The etag is the file's git blob id. A missing repository, revision or path
    is a ``FileNotFoundError`` with one line saying which.
    """
    where = f"source {source.name!r}"
    match = _HF_PATH_RE.match(source.uri[len(HF_SCHEME) + 3:])
    if match is None:
        raise SourceUriError(f"{where}.uri: expected hf://datasets/ORG/NAME[@REVISION][/GLOB], got {source.uri!r}")
    kind, repo_id, glob = match["kind"] or "", match["repo"], (match["path"] or "").strip("/")
    revision = urllib.parse.unquote(match["rev"]) if match["rev"] else None
    repo_type = {"datasets/": "dataset", "spaces/": "space"}.get(kind, "model")
    fs, sha = hub_commit(repo_id, repo_type, revision, where)
    root = f"{kind}{repo_id}@{sha}"
    target = f"{root}/{glob}".rstrip("/")
    is_dir = not GLOB_CHARS.search(glob) and fs.isdir(target)
    try:
        if is_dir:
            found = fs.find(target, detail=True, expand_info=True)
        elif GLOB_CHARS.search(glob):
            found = fs.glob(target, detail=True, expand_info=True)
        else:
            found = {target: fs.info(target, expand_info=True)}
    except FileNotFoundError:
        found = {}
    files = {p: info for p, info in found.items() if info.get("type") == "file"}
    if not files:
        raise FileNotFoundError(f"{where}: {glob or '/'} matches no file in {repo_type} {repo_id} at {sha}")
    base = target if is_dir else glob_root(target)
    refs = []
    for path, info in files.items():
        in_repo = path[len(root) + 1:]
        commit = (info.get("last_commit") or {}).get("oid") or sha
        refs.append(listed_file(f"{HF_SCHEME}://{kind}{repo_id}@{commit}/{in_repo}", relative(path, base), info))
    return refs


@dataclass(frozen=True)
class HfScheme(ReadThroughFsspec):
    """Files of a Hub repository: listed at a commit, so none changes under a reader."""

    name: str = HF_SCHEME

    def declared_uri(self, uri: str, base_dir: Path, where: str) -> str:
        return absolute_uri(uri, base_dir)  # checked when listed, where its repository and revision are looked up

    def is_pinned(self, source: ListedSource) -> bool:
        return is_pinned_file(source)

    def pinned_sha256(self, source: ListedSource) -> str | None:
        use_hf_endpoint()
        return file_sha256(source.uri)

    def list_files(self, source: ListedSource, excluded: tuple[str, ...] = ()) -> list[FileRef]:
        use_hf_endpoint()  # a repository's files, never a store's
        return list_hf_files(source)

    def resolve_url(self, uri: str, expected_sha256: str | None) -> str:
        use_hf_endpoint()
        return uri

    def splits_by_byte_range(self, uri: str) -> bool:
        return True  # a file at a commit: an hf:// URL is never into an archive (that one starts tar://)

    def file_state(self, uri: str) -> FileState | None:
        return None  # a file at a commit


HF = HfScheme()
