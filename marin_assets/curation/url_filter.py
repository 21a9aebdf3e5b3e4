"""URL filtering: documents whose URL a block list names are dropped with the reason ``url_blocked``.

A source names a local file (``url_blocklist:`` in its YAML; nothing is downloaded). The file is
UTF-8 text, one entry per line; a line that starts with ``#`` is a comment, and so is anything
after whitespace and ``#`` following an entry. An entry is either

* a **host name** (``example.com``, ``ads.example.net``, an IP address, ``[2001:db8::1]``), which
  blocks that host and every host below it (``www.example.com``, ``a.b.example.com``); a leading
  ``*.`` or ``.`` means the same; or
* a **URL** (it has ``://``), which blocks exactly that URL. Both sides are compared in one
  normal form: scheme and host in lower case (an internationalised host in its ASCII ``xn--``
  form), the port left out where it is the scheme's default, an empty path written ``/``, the
  fragment and any user name dropped; the path and query are compared byte for byte.

Anything else (two entries on one line, a path without a scheme, a host name with spaces or
slashes, bytes that are not UTF-8) makes the file damaged, refused in one line naming the line.
A document's URL is the ``url`` field of its metadata: the ``WARC-Target-URI`` of a WARC record,
or a ``url`` field of a JSONL or Parquet record. A document without one is never blocked.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import polars as pl

from marin_resources.typed_config import ConfigError

URL_BLOCKED = "url_blocked"
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443, "ftp": 21}
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]*[a-z0-9_])?"
_HOST_RE = re.compile(rf"^(?:{_LABEL}\.)*{_LABEL}$")


class UrlBlocklistError(ConfigError):
    """A block list that cannot be read or is damaged; the message names the file and the line."""


def normal_host(host: str) -> str | None:
    """A host name in the form entries and URLs are compared in, or None if it is not one."""
    host = host.strip().rstrip(".").lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            return None
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    return host if _HOST_RE.match(host) else None


def normal_url(url: str) -> tuple[str, str] | None:
    """(the URL in normal form, its host), or None where it has no scheme and host."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:  # a bad port or an unbalanced IPv6 bracket
        return None
    scheme = parts.scheme.lower()
    host = normal_host(parts.hostname or "")
    if not scheme or host is None:
        return None
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and _DEFAULT_PORTS.get(scheme) != port:
        netloc += f":{port}"
    return f"{scheme}://{netloc}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else ""), host


@dataclass(frozen=True)
class UrlBlocklist:
    sha256: str  # of the file's bytes: part of filtered/'s identity
    hosts: frozenset[str]  # each blocks itself and every host below it
    urls: frozenset[str]  # exact URLs, in normal form

    def blocks(self, url: str) -> bool:
        normal = normal_url(url)
        if normal is None:
            return False
        url, host = normal
        if url in self.urls:
            return True
        if ":" in host:  # an IPv6 address has no parent domains
            return host in self.hosts
        labels = host.split(".")
        return any(".".join(labels[i:]) in self.hosts for i in range(len(labels)))

    def blocked_rows(self, urls: pl.Series) -> pl.Series:
        """True for each URL the list blocks (False for a missing one); each distinct URL is looked up once."""
        hits = [url for url in urls.drop_nulls().unique().to_list() if self.blocks(url)]
        return urls.is_in(pl.Series(hits, dtype=pl.String).implode()).fill_null(False).alias(URL_BLOCKED)


def document_urls(frame: pl.DataFrame) -> pl.Series:
    """Each document's URL from its metadata (null where it has none)."""
    return frame.select(pl.col("metadata").str.json_path_match("$.url"))["metadata"]


def parse_url_blocklist(data: bytes, where: str) -> UrlBlocklist:
    """The entries of a block list file's bytes (see the module docstring); ``where`` names it in errors."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UrlBlocklistError(f"block list {where}: not UTF-8 text (byte {exc.start})") from None
    hosts, urls = set(), set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split(None, 1)
        if not fields or fields[0].startswith("#"):
            continue
        entry, rest = fields[0], fields[1] if len(fields) > 1 else ""
        if rest and not rest.startswith("#"):
            raise UrlBlocklistError(f"block list {where} line {number}: one entry per line, got {line.strip()!r}")
        if "://" in entry:
            normal = normal_url(entry)
            if normal is None:
                raise UrlBlocklistError(f"block list {where} line {number}: not a URL with a host: {entry!r}")
            urls.add(normal[0])
            continue
        host = normal_host(entry.removeprefix("*.").removeprefix("."))
        if host is None:
            raise UrlBlocklistError(f"block list {where} line {number}: not a host name or a URL with its "
                                    f"scheme: {entry!r}")
        hosts.add(host)
    return UrlBlocklist(hashlib.sha256(data).hexdigest(), frozenset(hosts), frozenset(urls))


def read_blocklist_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise UrlBlocklistError(f"block list {path}: cannot read it: {exc.strerror or exc}") from None


def blocklist_bytes(path: str, identified: UrlBlocklist) -> bytes:
    """The block list file's bytes for a build, refused if they are not those its identity was taken
    from (the file changed after the code location loaded): the build fails and commits nothing."""
    data = read_blocklist_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != identified.sha256:
        raise UrlBlocklistError(f"block list {path} changed since the code location loaded it (sha256 "
                                f"{identified.sha256} then, {digest} now); reload the code location and build again")
    return data


@lru_cache(maxsize=16)
def _parsed(path: str, stamp: tuple[int, ...]) -> UrlBlocklist:
    return parse_url_blocklist(read_blocklist_bytes(path), path)


def read_url_blocklist(path: str) -> UrlBlocklist:
    """The block list at ``path``, parsed once while the file is unchanged (a code location loads it
    for the YAML check and for the identity)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UrlBlocklistError(f"block list {path}: cannot read it: {exc.strerror or exc}") from None
    return _parsed(path, (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))


@lru_cache(maxsize=2)
def blocklist_from_bytes(data: bytes) -> UrlBlocklist:
    """A block list sent as its bytes (to a chunk's worker), parsed once per process."""
    return parse_url_blocklist(data, "(sent to the worker)")
