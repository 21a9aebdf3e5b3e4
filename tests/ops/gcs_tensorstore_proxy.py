"""A reverse proxy in front of gcp-storage-emulator that fills the two gaps tensorstore trips on.

Real GCS sends ``x-goog-generation`` with every download, honours byte ranges (tensorstore reads
a shard's index with ``Range: bytes=-N``) and limits listings to ``startOffset``/``endOffset``.
The Python emulator does none of these: tensorstore reports "Malformed StorageGeneration" or
"Requested byte range [-N, ?) was ignored by server", and, worse, a ranged delete (``delete_existing``)
lists the whole bucket and deletes it. This proxy adds the header (from the object's metadata),
serves ranges from the full object and filters listings; every other request passes through
unchanged. Test-only: production talks to GCS itself.

    python tests/ops/gcs_tensorstore_proxy.py LISTEN_PORT UPSTREAM_URL
"""

import json
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_LIST = re.compile(r"^/storage/v1/b/[^/]+/o(\?|$)")
_MEDIA = re.compile(r"^/(?:download/)?storage/v1/b/([^/]+)/o/([^?]+)")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class Proxy(BaseHTTPRequestHandler):
    upstream = ""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _forward(self, method: str, headers: dict, body: bytes | None):
        req = urllib.request.Request(self.upstream + self.path, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def _generation(self, bucket: str, obj: str) -> str | None:
        url = f"{self.upstream}/storage/v1/b/{bucket}/o/{obj}"
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                return str(json.loads(resp.read())["generation"])
        except (urllib.error.HTTPError, KeyError, ValueError):
            return None

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "range", "accept-encoding")}
        wanted = self.headers.get("Range")
        status, out_headers, data = self._forward(method, headers, body)
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        media = _MEDIA.match(self.path) if method == "GET" and query.get("alt") == ["media"] else None
        if method == "GET" and status == 200 and _LIST.match(self.path) \
                and ("startOffset" in query or "endOffset" in query):
            listing = json.loads(data)
            start, end = query.get("startOffset", [""])[0], query.get("endOffset", [None])[0]
            listing["items"] = [i for i in listing.get("items", [])
                                if i["name"] >= start and (end is None or i["name"] < end)]
            data = json.dumps(listing).encode()
        if media and status == 200:
            generation = self._generation(media.group(1), media.group(2))
            if generation:
                out_headers["x-goog-generation"] = generation
            if wanted:
                m = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted.strip())
                if m:
                    size = len(data)
                    if m.group(1) == "":
                        start, end = max(0, size - int(m.group(2))), size - 1
                    else:
                        start = int(m.group(1))
                        end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
                    data = data[start:end + 1]
                    status = 206
                    out_headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        self.send_response(status)
        for k, v in out_headers.items():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_PATCH(self):
        self._handle("PATCH")

    def do_HEAD(self):
        self._handle("HEAD")


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2].rstrip("/")
    Proxy.upstream = upstream
    ThreadingHTTPServer(("127.0.0.1", port), Proxy).serve_forever()


if __name__ == "__main__":
    main()
