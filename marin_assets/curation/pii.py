"""PII removal: e-mail addresses and public IP addresses replaced with placeholders.

The placeholders and the rules follow DataTrove's ``PIIFormatter``: every e-mail address becomes
one of two addresses at the reserved example domains, and every *public* IP address one of six
fixed IPv4 addresses, taken in turn, so a text keeps its shape (a page that lists three contacts
still lists three). Private, loopback, documentation and other special-purpose addresses are not
personal and stay. Departures, each for a reason given in docs/curation.md ("PII"):

* e-mail addresses in any case and script (DataTrove's pattern is lower-case ASCII only and misses
  ``John.Smith@Example.com``);
* IPv4 addresses only as whole tokens: not inside a longer dotted number (``1.3.6.1.4.1``, an OID,
  or ``10.0.0.1234``), which DataTrove's pattern cuts an address out of;
* IPv6 addresses too, replaced from addresses of the documentation prefix ``2001:db8::/32``;
* "public" is this module's table of special-purpose ranges (IANA's registries), not
  ``ipaddress.is_global``, whose answer changed between Python patch releases: the same text gives
  the same bytes on every interpreter;
* placeholders rotate per document (DataTrove's counter runs over a whole process), so a document
  is scrubbed the same whichever chunk or worker it lands on, and a placeholder is never replaced
  again, so a second pass changes nothing.

Vectorised where it pays: one polars pass over the whole column finds the documents that could
hold an address of each kind (an ``@`` between two non-space characters, four dotted numbers, a
hex group between colons); only those are searched in Python, only for those kinds, and only in the
runs of address characters around what each kind must hold (:func:`sub_in_runs`). Text with no
address is returned as the same string, byte for byte.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from marin_assets.curation import chat
from marin_resources.config_identity import identity
from marin_resources.typed_config import typed_config

# Reserved for examples (RFC 2606), as DataTrove uses them.
EMAIL_PLACEHOLDERS: tuple[str, ...] = ("email@example.com", "firstname.lastname@example.org")
# DataTrove's placeholder IPv4 addresses (public addresses that answered no ping when it chose them).
IPV4_PLACEHOLDERS: tuple[str, ...] = ("22.214.171.124", "126.96.36.199", "188.8.131.52", "184.108.40.206",
                                      "220.127.116.11", "18.104.22.168")
# Addresses of the IPv6 documentation prefix (RFC 3849): never anyone's, and not public by the table below.
IPV6_PLACEHOLDERS: tuple[str, ...] = ("2001:db8::1f", "2001:db8:4c2::a:7", "2001:db8:96e0::3b", "2001:db8:1d::5")

EMAILS, IPV4, IPV6 = "emails", "ipv4", "ipv6"
KINDS = (EMAILS, IPV4, IPV6)


@typed_config
@dataclass(frozen=True)
class PiiConfig:
    """What the PII pass replaces. In a source's YAML: ``pii: true`` (these defaults), ``pii: false``,
    or a mapping of these fields; without ``pii:``, web sources (HTML, WARC) get the defaults and
    the others none."""

    emails: bool = identity(True)
    ip_addresses: bool = identity(True)
    # Only public addresses are personal: 10.0.0.1 or ::1 name no one.
    public_ips_only: bool = identity(True)


# --------------------------------------------------------------------------- patterns

# A dot-atom local part (RFC 5322 atext, letters and digits of any script), then a dotted host name
# whose labels start and end with a letter or digit, or an address literal in brackets.
_ATOM = r"[\w!#$%&'*+/=?^`{|}~-]+"
_LABEL = r"[^\W_](?:(?:[^\W_]|-)*[^\W_])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_DOTTED_QUAD = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
EMAIL_PATTERN = (rf"\b{_ATOM}(?:\.{_ATOM})*@(?:(?:{_LABEL}\.)+{_LABEL}"
                 rf"|\[(?:{_DOTTED_QUAD}|[Ii][Pp][Vv]6:[0-9A-Fa-f:.]+)\])")
# Not glued to a longer dotted number on either side; a sentence's full stop may follow.
IPV4_PATTERN = rf"(?<![0-9.]){_DOTTED_QUAD}(?![0-9]|\.[0-9])"
# Two to seven colon-ended groups, then a group or a dotted quad; validated by `ipaddress` after.
# It starts after a non-word character, after a colon that ends a word (``host:``), or after
# ``IPv6:``, and no word character or colon may follow.
IPV6_PATTERN = (r"(?:(?<![\w:.])|(?<=[^\W0-9A-Fa-f]:)|(?<=[Ii][Pp][Vv]6:))"
                rf"(?:[0-9A-Fa-f]{{0,4}}:){{2,7}}(?:{_DOTTED_QUAD}|[0-9A-Fa-f]{{1,4}})?(?![\w:]|\.[0-9])")
EMAIL_RE = re.compile(EMAIL_PATTERN)
IPV4_RE = re.compile(IPV4_PATTERN)
IPV6_RE = re.compile(IPV6_PATTERN)
# What a document must contain to hold a match of each pattern, for the polars pass (its regex engine
# has no look-around): an e-mail address has an '@' between two characters that are neither space
# nor '@'; an IPv4 address four dotted numbers; an IPv6 address ':<hex>:', and a public one also
# its first group in 2000::/3 or an IPv4-embedding prefix (see is_public_ipv6).
_EMAIL_CANDIDATE = r"[^\s@]@[^\s@]"
_IPV4_CANDIDATE = r"[0-9]\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]"
_IPV6_CANDIDATE = r":[0-9A-Fa-f]{0,4}:"
_PUBLIC_IPV6_CANDIDATE = r"(?i)[23][0-9a-f]{3}:[0-9a-f]{0,4}:|ffff:|64:ff9b:"


def _ranges(*networks: str) -> tuple[tuple[int, int], ...]:
    """First and last address of each network, as integers: a comparison each, not an object."""
    return tuple((int(n.network_address), int(n.broadcast_address)) for n in map(ipaddress.ip_network, networks))


# Not public: IANA's special-purpose registries, plus multicast and the reserved 240/4.
_SPECIAL_IPV4 = _ranges("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
                        "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
                        "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4")
# IPv6 global unicast is 2000::/3; inside it, the IETF protocol block, documentation and 6to4.
(_GLOBAL_UNICAST,) = _ranges("2000::/3")
_SPECIAL_IPV6 = _ranges("2001::/23", "2001:db8::/32", "2002::/16", "3fff::/20")
# Prefixes that carry an IPv4 address in their low 32 bits: it decides (IPv4-mapped, NAT64's well-known prefix).
_EMBEDDING_IPV4 = _ranges("::ffff:0:0/96", "64:ff9b::/96")


def _within(address: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(first <= address <= last for first, last in ranges)


def is_public_ipv4(address: int) -> bool:
    """Whether an IPv4 address (as an integer) is outside every special-purpose range."""
    return not _within(address, _SPECIAL_IPV4)


def is_public_ipv6(address: int) -> bool:
    """Whether an IPv6 address (as an integer) is global unicast outside the special ranges, or
    embeds a public IPv4 address."""
    if _within(address, _EMBEDDING_IPV4):
        return is_public_ipv4(address & 0xFFFFFFFF)
    return _GLOBAL_UNICAST[0] <= address <= _GLOBAL_UNICAST[1] and not _within(address, _SPECIAL_IPV6)


# --------------------------------------------------------------------------- one text


class Scrubber:
    """One document's pass: the placeholders rotate from the first of each list in every document."""

    def __init__(self, cfg: PiiConfig):
        self.cfg = cfg
        self.counts = dict.fromkeys(KINDS, 0)

    def _next(self, kind: str, placeholders: tuple[str, ...]) -> str:
        placeholder = placeholders[self.counts[kind] % len(placeholders)]
        self.counts[kind] += 1
        return placeholder

    def email(self, match: re.Match) -> str:
        if match.group() in EMAIL_PLACEHOLDERS:
            return match.group()
        return self._next(EMAILS, EMAIL_PLACEHOLDERS)

    def ipv4(self, match: re.Match) -> str:
        found = match.group()
        if found in IPV4_PLACEHOLDERS:
            return found
        if self.cfg.public_ips_only and not is_public_ipv4(int(ipaddress.IPv4Address(found))):
            return found
        return self._next(IPV4, IPV4_PLACEHOLDERS)

    def ipv6(self, match: re.Match) -> str:
        found = match.group()
        readings = [(found, "")]
        if found.endswith(":") and not found.endswith("::"):
            # The last colon may be punctuation ("at 2001:4860::8888: the resolver").
            readings.append((found[:-1], ":"))
        for text, tail in readings:
            try:
                address = ipaddress.IPv6Address(text)
            except ValueError:
                continue
            if text in IPV6_PLACEHOLDERS or (self.cfg.public_ips_only and not is_public_ipv6(int(address))):
                return found
            return self._next(IPV6, IPV6_PLACEHOLDERS) + tail
        return found


def sub_in_runs(text: str, pattern: re.Pattern, replace: Callable[[re.Match], str], core: re.Pattern,
                in_run: Callable[[str], bool]) -> str:
    """``pattern.sub(replace, text)`` for a pattern each of whose matches lies inside one maximal run
    of characters ``in_run`` accepts and holds a match of ``core`` (made of such characters): only
    the runs around ``core``'s matches are searched.

    The patterns' own scan tries their look-behinds at every character of the text (15-25 MB/s per
    core); ``core`` starts with a literal or a digit, which the regex engine skips to in C, and its
    runs are a small part of prose. Matches never cross runs, so taking the runs in order, each
    from its start, finds the matches ``sub`` finds. ``finditer`` from a start position sees the real
    characters before it (for ``\b`` and the look-behinds), and its end is one character past the
    run, for the look-aheads."""
    pieces, done, pos, size = [], 0, 0, len(text)
    while (hit := core.search(text, pos)) is not None:
        start, end = hit.start(), hit.end()
        while start > pos and in_run(text[start - 1]):
            start -= 1
        while end < size and in_run(text[end]):
            end += 1
        pos = end
        for match in pattern.finditer(text, start, min(size, end + 1)):
            pieces += (text[done:match.start()], replace(match))
            done = match.end()
    return "".join(pieces) + text[done:] if pieces else text


def _not_space(char: str) -> bool:
    return not char.isspace()


# Each pattern, what every match of it holds (the polars candidates, but a plain '@' for e-mail: a
# literal is what the engine skips to fastest), and the characters of the runs its matches lie in.
EMAIL_SEARCH = (EMAIL_RE, re.compile("@"), _not_space)
IPV6_SEARCH = (IPV6_RE, re.compile(_IPV6_CANDIDATE), frozenset("0123456789abcdefABCDEF:.").__contains__)
IPV4_SEARCH = (IPV4_RE, re.compile(_IPV4_CANDIDATE), frozenset("0123456789.").__contains__)


def scrub_text(text: str, cfg: PiiConfig, passes: tuple[str, ...] = KINDS,
               scrubber: Scrubber | None = None) -> tuple[str, dict[str, int]]:
    """``text`` with its e-mail and (public) IP addresses replaced, and how many of each kind.
    E-mail addresses first, as DataTrove does: an address literal (``x@[203.0.113.9]``) is part of
    its e-mail address. Then IPv6, whose IPv4-embedding forms (``::ffff:8.8.8.8``) hold a dotted
    quad, then IPv4. ``passes`` leaves out the kinds a caller knows the text cannot hold. A
    ``scrubber`` passed in carries its placeholder rotation and counts over several texts (the
    turns of one conversation)."""
    scrubber = scrubber or Scrubber(cfg)
    for kind, wanted, (pattern, core, in_run), replace in (
            (EMAILS, cfg.emails, EMAIL_SEARCH, scrubber.email), (IPV6, cfg.ip_addresses, IPV6_SEARCH, scrubber.ipv6),
            (IPV4, cfg.ip_addresses, IPV4_SEARCH, scrubber.ipv4)):
        if wanted and kind in passes:
            text = sub_in_runs(text, pattern, replace, core, in_run)
    return text, scrubber.counts


# --------------------------------------------------------------------------- a frame


@dataclass
class ScrubbedTexts:
    texts: list[str]  # every text, scrubbed; the same string objects where nothing was replaced
    changed: list[int]  # row indices of the texts that changed
    counts: dict[str, int]  # kind -> addresses replaced; plus "documents": texts changed


def candidate_rows(texts: pl.Series, cfg: PiiConfig) -> list[tuple[int, tuple[str, ...]]]:
    """The rows that could hold an address, each with the kinds it could hold: one polars pass, so
    text with none costs no Python, and a text is searched only for what it may contain."""
    candidates = {EMAILS: _EMAIL_CANDIDATE if cfg.emails else None,
                  IPV6: (_PUBLIC_IPV6_CANDIDATE if cfg.public_ips_only else _IPV6_CANDIDATE) if cfg.ip_addresses
                  else None,
                  IPV4: _IPV4_CANDIDATE if cfg.ip_addresses else None}
    kinds = [kind for kind, pattern in candidates.items() if pattern is not None]
    if not kinds:
        return []
    hits = pl.DataFrame({"text": texts}).select(
        pl.col("text").str.contains(candidates[kind]).fill_null(False).alias(kind) for kind in kinds)
    rows = hits.with_row_index("row").filter(pl.any_horizontal(kinds))
    return [(row, tuple(kind for kind, hit in zip(kinds, flags) if hit)) for row, *flags in rows.iter_rows()]


def scrub_texts(texts: list[str], column: pl.Series, cfg: PiiConfig) -> ScrubbedTexts:
    """:func:`scrub_text` over a column (``texts`` are its values as Python strings)."""
    out = list(texts)
    changed = []
    counts = dict.fromkeys(KINDS, 0)
    for row, kinds in candidate_rows(column, cfg):
        text, found = scrub_text(out[row], cfg, kinds)
        if any(found.values()):
            out[row] = text
            changed.append(row)
            for kind, n in found.items():
                counts[kind] += n
    return ScrubbedTexts(out, changed, {**counts, "documents": len(changed)})


def scrub_frame(frame: pl.DataFrame, texts: list[str] | None, cfg: PiiConfig) -> tuple[pl.DataFrame, list[str],
                                                                                       dict[str, int]]:
    """``frame`` with its ``text`` column scrubbed (only the changed rows are written back), the
    texts as Python strings, and the counts."""
    if texts is None:
        texts = frame["text"].to_list()
    result = scrub_texts(texts, frame["text"], cfg)
    if not result.changed:
        return frame, result.texts, result.counts
    column = frame["text"].scatter(result.changed, [result.texts[row] for row in result.changed])
    return frame.with_columns(column), result.texts, result.counts


def scrub_conversations(frame: pl.DataFrame, cfg: PiiConfig) -> tuple[pl.DataFrame, list[str], dict[str, int]]:
    """A chat frame (``messages`` beside ``text``) with PII replaced in each turn's content and the
    text rendered again from the scrubbed turns, so both columns stay one conversation; the texts as
    Python strings, and the counts. Placeholders rotate over the whole conversation, as over one
    document. An address is searched for in a turn, never across two: the rendering's role labels
    and blank lines are not part of any address."""
    texts = frame["text"].to_list()
    messages = frame[chat.MESSAGES_COLUMN].to_list()
    changed: list[int] = []
    counts = dict.fromkeys(KINDS, 0)
    # The text holds every turn's content, so a row whose text cannot hold an address has no turn that can.
    for row, kinds in candidate_rows(frame["text"], cfg):
        turns = json.loads(messages[row])
        scrubber = Scrubber(cfg)
        for turn in turns:
            turn["content"], _ = scrub_text(turn["content"], cfg, kinds, scrubber)
        if any(scrubber.counts.values()):
            messages[row], texts[row] = chat.messages_json(turns), chat.render_text(turns)
            changed.append(row)
            for kind, n in scrubber.counts.items():
                counts[kind] += n
    counts["documents"] = len(changed)
    if not changed:
        return frame, texts, counts
    return frame.with_columns(
        frame["text"].scatter(changed, [texts[row] for row in changed]),
        frame[chat.MESSAGES_COLUMN].scatter(changed, [messages[row] for row in changed])), texts, counts
