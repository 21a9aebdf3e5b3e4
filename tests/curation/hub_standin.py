"""A local stand-in for the Hugging Face Hub's file API, for tests (the hub is unreachable here).

It serves, over real HTTP on 127.0.0.1, the endpoints huggingface_hub's ``HfFileSystem`` calls:
repository info (``/api/datasets/ID[/revision/REV]``), tree listings (``/api/datasets/ID/tree/REV
[/PATH]``, recursive and expanded with each entry's last commit), ``paths-info`` (POST) and file
downloads (``/datasets/ID/resolve/REV/PATH``, with byte ranges), and answers a missing repository,
revision or path as the hub does (404 with ``X-Error-Code``). Repositories have a real history:
each commit is a snapshot, branches move, and old commits stay readable.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Commit:
    sha: str
    title: str
    date: str
    files: dict[str, bytes]  # the whole tree at this commit


@dataclass
class Repo:
    commits: list[Commit] = field(default_factory=list)
    branches: dict[str, str] = field(default_factory=dict)

    def commit(self, changes: dict[str, bytes | None], title: str, branch: str = "main") -> str:
        """Apply ``changes`` (None deletes a path) on top of ``branch``; return the new commit's sha."""
        parent = self.resolve(branch)
        files = dict(parent.files) if parent else {}
        for path, data in changes.items():
            if data is None:
                files.pop(path, None)
            else:
                files[path] = data
        sha = hashlib.sha1(json.dumps([parent.sha if parent else "", title, sorted(changes)]).encode()).hexdigest()
        date = (datetime(2026, 1, 1, tzinfo=UTC) + timedelta(hours=len(self.commits))).isoformat()
        self.commits.append(Commit(sha, title, date.replace("+00:00", "Z"), files))
        self.branches[branch] = sha
        return sha

    def resolve(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return next((c for c in self.commits if c.sha == sha), None)

    def last_commit(self, at: Commit, path: str) -> Commit:
        """The last commit up to ``at`` that changed ``path`` (for a folder: anything below it)."""
        history = self.commits[: self.commits.index(at) + 1]

        def state(c: Commit):
            return sorted((p, d) for p, d in c.files.items() if p == path or p.startswith(path + "/"))

        current = state(at)
        last = at
        for c in reversed(history[:-1]):
            if state(c) != current:
                break
            last = c
        return last


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    """``with HubStandIn() as hub: hub.endpoint`` -- a server thread on a free port, stopped on exit."""

    def __init__(self):
        self.repos: dict[tuple[str, str], Repo] = {}  # (repo type, repo id) -> repo
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers) as received
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, name="hub-standin", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        return self.repos.setdefault((repo_type, repo_id), Repo())

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


_TYPES = {"datasets": "dataset", "spaces": "space", "models": "model"}
_API_RE = re.compile(r"^/api/(?P<kind>datasets|spaces|models)/(?P<repo>[^/]+/[^/]+)"
                     r"(?:/(?P<op>revision|tree|paths-info)/(?P<rev>[^/]+)(?:/(?P<path>.*))?)?$")
_RESOLVE_RE = re.compile(r"^/(?:(?P<kind>datasets|spaces)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the test output is the record
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, payload) -> None:
            self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

        def _error(self, code: str, message: str) -> None:
            self._send(404, json.dumps({"error": message}).encode(),
                       {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message})

        def _lookup(self, kind: str | None, repo_id: str, revision: str | None):
            repo = hub.repos.get((_TYPES.get(kind or "models", "model"), repo_id))
            if repo is None:
                self._error("RepoNotFound", "Repository not found")
                return None, None
            commit = repo.resolve(urllib.parse.unquote(revision or "main"))
            if commit is None:
                self._error("RevisionNotFound", "Invalid rev id")
                return None, None
            return repo, commit

        def _entry(self, repo: Repo, commit: Commit, path: str, expand: bool) -> dict | None:
            if path in commit.files:
                data = commit.files[path]
                entry = {"type": "file", "oid": blob_id(data), "size": len(data), "path": path}
            elif any(p.startswith(path + "/") for p in commit.files):
                entry = {"type": "directory", "oid": hashlib.sha1(f"{commit.sha}:{path}".encode()).hexdigest(),
                         "size": 0, "path": path}
            else:
                return None
            if expand:
                last = repo.last_commit(commit, path)
                entry["lastCommit"] = {"id": last.sha, "title": last.title, "date": last.date}
            return entry

        def _tree(self, repo: Repo, commit: Commit, path: str, recursive: bool, expand: bool) -> None:
            if path and path in commit.files or path and self._entry(repo, commit, path, False) is None:
                self._error("EntryNotFound", f"{path} is not a folder")
                return
            prefix = path + "/" if path else ""
            below = sorted(p[len(prefix):] for p in commit.files if p.startswith(prefix))
            names: set[str] = set()
            for rest in below:
                parts = rest.split("/")
                depth = len(parts) if recursive else 1
                names.update(prefix + "/".join(parts[:i]) for i in range(1, depth + 1))
            self._json([self._entry(repo, commit, name, expand) for name in sorted(names)])

        def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
            hub.requests.append((self.command, self.path, dict(self.headers)))
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            api = _API_RE.match(url.path)
            if api:
                repo, commit = self._lookup(api["kind"], api["repo"], api["rev"])
                if repo is None:
                    return
                if api["op"] in (None, "revision"):
                    self._json({"id": api["repo"], "sha": commit.sha, "private": False, "lastModified": commit.date,
                                "siblings": [{"rfilename": p} for p in sorted(commit.files)]})
                elif api["op"] == "tree":
                    self._tree(repo, commit, urllib.parse.unquote(api["path"] or ""),
                               query.get("recursive", ["False"])[0] == "True",
                               query.get("expand", ["False"])[0] == "True")
                else:
                    self._send(405)
                return
            resolve = _RESOLVE_RE.match(url.path)
            if resolve:
                repo, commit = self._lookup(resolve["kind"] or "models", resolve["repo"], resolve["rev"])
                if repo is None:
                    return
                path = urllib.parse.unquote(resolve["path"])
                if path not in commit.files:
                    self._error("EntryNotFound", f"{path} does not exist at {commit.sha}")
                    return
                data = commit.files[path]
                headers = {"ETag": f'"{blob_id(data)}"', "X-Repo-Commit": commit.sha, "Accept-Ranges": "bytes"}
                byte_range = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if byte_range:
                    start = int(byte_range[1])
                    end = min(int(byte_range[2]) + 1 if byte_range[2] else len(data), len(data))
                    if start >= len(data) and data:
                        self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                        return
                    headers["Content-Range"] = f"bytes {start}-{max(end - 1, start)}/{len(data)}"
                    self._send(206, data[start:end], headers)
                else:
                    self._send(200, data, headers)
                return
            self._send(404)

        do_HEAD = do_GET

        def do_POST(self) -> None:  # noqa: N802
            hub.requests.append((self.command, self.path, dict(self.headers)))
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            api = _API_RE.match(urllib.parse.urlsplit(self.path).path)
            if not api or api["op"] != "paths-info":
                self._send(404)
                return
            repo, commit = self._lookup(api["kind"], api["repo"], api["rev"])
            if repo is None:
                return
            form = urllib.parse.parse_qs(body)
            expand = form.get("expand", ["False"])[0] == "True"
            entries = [self._entry(repo, commit, p, expand) for p in form.get("paths", [])]
            self._json([e for e in entries if e is not None])

    return Handler
