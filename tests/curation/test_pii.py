"""PII removal: planted e-mail and IP addresses are all replaced, in every position and form; text
without any comes back byte for byte; the counts add up per shard; the source YAML decides it and
it is part of filtered/'s identity."""

from __future__ import annotations

import random
import re

import dagster as dg
import polars as pl
import pytest

from marin_assets.catalog import Catalog
from marin_assets.curation import pii
from marin_assets.curation.config import SourceConfigError, parse_curation_config, pii_of
from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.filters import FilterConfig
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.pii import (
    EMAIL_PLACEHOLDERS,
    IPV4_PLACEHOLDERS,
    IPV6_PLACEHOLDERS,
    PiiConfig,
    scrub_frame,
    scrub_text,
    sub_in_runs,
)
from marin_assets.curation.refine import build_refinement_assets

from .conftest import NORMAL_TEXT

EMAILS = ["jane@example.net", "John.Smith@Example.COM", "a.b-c_d+tag@mail.sub.example.co.uk", "x@y.io",
          "o'brien@shop.example", "user%relay=host@example.org", "josé.núñez@exemple.fr", "info@bücher.de",
          "123@456.com", "first.last@[203.0.113.7]", "root@[IPv6:2001:4860::1]", "odd~name#1!x@weird.example"]
IPV4 = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "81.2.69.160", "101.0.0.1", "172.32.0.1"]
IPV6 = ["2001:4860:4860::8888", "2606:4700:4700::1111", "2a00:1450:4001:82a::200e",
        "2001:0DB9:0000:0000:0000:0000:0000:0001", "2400:cb00:2048:1::c629:d7a2", "::ffff:8.8.4.4",
        "64:ff9b::1.1.1.1", "2a03:2880:f12f:83:face:b00c:0:25de"]
# Each slot is one planted address: at the very start and end, inside brackets, quotes, angle
# brackets and a mailto link, before a full stop or a colon, and next to other addresses.
TEMPLATES = [
    "{0}",
    "{0} wrote to {1}, and {2}.",
    "({0}) [{1}] <{2}> \"{3}\" '{4}'",
    "mailto:{0}?subject=hi {1};{2},{3} {4} | {5}",
    "{0}\n{1}\t{2}\r\n{3}",
    "ends with {0}",
]
NOT_PII = [
    NORMAL_TEXT,
    "Private and special addresses name no one: 10.0.0.1, 192.168.1.10, 127.0.0.1, 172.16.5.4, 100.64.0.1, "
    "169.254.0.1, 192.0.2.44, 198.51.100.7, 203.0.113.99, 224.0.0.251, 0.0.0.0, ::1, fe80::1%eth0, fd12:3456::1, "
    "2001:db8::8a2e:370:7334 and :: itself.",
    "Versions and numbers that are not addresses: 1.2.3.4.5, 1.3.6.1.4.1.311, 10.0.0.1234, 256.1.1.1, 1.2.3, "
    "v2.0.1, 3.14159, 12:30:45, 2024-01-02T10:20:30Z, 00:1a:2b:3c:4d:5e, std::vector<int>, a::b::c.",
    "Handles and half addresses: @marin, user@localhost, @@, a@, @b.com, name at example dot com, x@-bad-.com.",
    "Unicode prose — «guillemets», 日本語の文章, emoji 🙂 and a lone @ sign.",
]


def _planted(kind: str, n: int, offset: int) -> list[str]:
    pool = {"email": EMAILS, "ipv4": IPV4, "ipv6": IPV6}[kind]
    return [pool[(offset + i) % len(pool)] for i in range(n)]


def _expected(template: str, planted: list[str], kinds: list[str]) -> str:
    """The template with each address replaced by the next placeholder of its kind, from the first."""
    lists = {"email": EMAIL_PLACEHOLDERS, "ipv4": IPV4_PLACEHOLDERS, "ipv6": IPV6_PLACEHOLDERS}
    seen = dict.fromkeys(lists, 0)
    filled = []
    for kind in kinds:
        filled.append(lists[kind][seen[kind] % len(lists[kind])])
        seen[kind] += 1
    return template.format(*filled)


def _cases():
    """Every template with every mix of kinds: all e-mails, all IPv4, all IPv6, and alternating."""
    cases = []
    for _t, template in enumerate(TEMPLATES):
        slots = template.count("{")
        mixes = {"email": ["email"] * slots, "ipv4": ["ipv4"] * slots, "ipv6": ["ipv6"] * slots,
                 "mixed": [("email", "ipv4", "ipv6")[i % 3] for i in range(slots)]}
        for _name, kinds in mixes.items():
            for offset in range(0, 12, 5):
                planted = []
                for i, kind in enumerate(kinds):
                    planted.append(_planted(kind, 1, offset + i)[0])
                cases.append((template, planted, kinds))
    return cases


@pytest.mark.parametrize("template, planted, kinds", _cases())
def test_every_planted_address_is_replaced_by_the_next_placeholder_of_its_kind(template, planted, kinds):
    text = template.format(*planted)
    scrubbed, counts = scrub_text(text, PiiConfig())
    assert scrubbed == _expected(template, planted, kinds)
    assert counts == {"emails": kinds.count("email"), "ipv4": kinds.count("ipv4"), "ipv6": kinds.count("ipv6")}
    for address in planted:
        assert address not in scrubbed


def test_an_ipv6_address_before_a_colon_keeps_the_colon():
    assert scrub_text("resolver 2606:4700:4700::1111: fast", PiiConfig())[0] == "resolver 2001:db8::1f: fast"
    assert scrub_text("host:2a00:1450::1 and IPv6:2001:4860::8888", PiiConfig())[0] == \
        "host:2001:db8::1f and IPv6:2001:db8:4c2::a:7"


@pytest.mark.parametrize("text", NOT_PII)
def test_text_without_pii_comes_back_byte_for_byte(text):
    scrubbed, counts = scrub_text(text, PiiConfig())
    assert scrubbed.encode() == text.encode() and counts == {"emails": 0, "ipv4": 0, "ipv6": 0}
    frame = pl.DataFrame({"text": [text, NORMAL_TEXT]})
    out, texts, frame_counts = scrub_frame(frame, None, PiiConfig())
    assert out["text"].to_list() == [text, NORMAL_TEXT] and texts == [text, NORMAL_TEXT]
    assert frame_counts["documents"] == 0


def test_private_addresses_are_replaced_only_when_asked_and_kinds_switch_off():
    text = "10.0.0.1 fd12:3456::1 8.8.8.8 a@b.example"
    assert scrub_text(text, PiiConfig(public_ips_only=False))[1] == {"emails": 1, "ipv4": 2, "ipv6": 1}
    assert scrub_text(text, PiiConfig(ip_addresses=False))[0] == "10.0.0.1 fd12:3456::1 8.8.8.8 email@example.com"
    assert scrub_text(text, PiiConfig(emails=False))[0] == "10.0.0.1 fd12:3456::1 22.214.171.124 a@b.example"


def test_a_second_pass_changes_nothing():
    for template, planted, _ in _cases():
        once, _ = scrub_text(template.format(*planted), PiiConfig())
        twice, counts = scrub_text(once, PiiConfig())
        assert twice == once and not any(counts.values())


def _documents(texts: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"id": [f"d{i}" for i in range(len(texts))], "text": texts, "source": "s",
                         "source_id": [f"f:{i}" for i in range(len(texts))], "metadata": "{}"})


def test_a_shard_counts_what_it_replaced_and_chunks_give_the_same_bytes():
    # Prose long enough to pass the rules, each with a few planted addresses, and some without.
    texts, planted = [], {"emails": 0, "ipv4": 0, "ipv6": 0}
    for i, (template, addresses, kinds) in enumerate(_cases()[:40]):
        texts.append(f"{NORMAL_TEXT}\n{template.format(*addresses)}\n" if i % 3 else NORMAL_TEXT)
        if i % 3:
            for kind in kinds:
                planted[{"email": "emails", "ipv4": "ipv4", "ipv6": "ipv6"}[kind]] += 1
    docs = _documents(texts)
    task = FilterTask(FilterConfig(languages=()), MinHashConfig(), pii=PiiConfig())
    whole = merge_chunks([filter_chunk(docs, task)], task)
    parts = merge_chunks([filter_chunk(docs.slice(start, 7), task) for start in range(0, docs.height, 7)], task)
    assert whole.kept.height == docs.height  # the addresses do not make a document fail a rule here
    assert whole.pii == {**planted, "documents": sum(1 for i in range(40) if i % 3)}
    assert parts.pii == whole.pii and parts.kept.equals(whole.kept)
    assert (parts.signatures.hashvalues == whole.signatures.hashvalues).all()
    stored = "\n".join(whole.kept["text"].to_list())
    assert not re.search(r"jane@example\.net|8\.8\.8\.8|2606:4700", stored)
    assert [t for t, i in zip(whole.kept["text"], range(40)) if i % 3 == 0] == [NORMAL_TEXT] * 14
    # Without the pass the text is stored as read and nothing is counted.
    plain = merge_chunks([filter_chunk(docs, FilterTask(FilterConfig(languages=()), MinHashConfig()))], task)
    assert plain.pii == {} and plain.kept["text"].to_list() == texts


def _filtered_identity(tmp_path, **fields) -> dict:
    config = parse_curation_config({"sources": [{"name": "s", "uri": "data/*", **fields}]}, tmp_path)
    catalog = Catalog()
    build_refinement_assets(config.sources[0], config, dg.DynamicPartitionsDefinition(name="s_shards"),
                            dg.AssetKey(["documents", "s"]), catalog)
    return catalog.specs["filtered/s"].identity(None)


def test_the_yaml_decides_pii_and_the_identity_says_so(tmp_path):
    on, off = PiiConfig(), None

    def decided(**fields):
        return pii_of(parse_curation_config({"sources": [{"name": "s", "uri": "x", **fields}]}, tmp_path).sources[0])

    assert decided(format="warc") == on and decided(format="html") == on
    assert decided(format="auto", uri="crawl/*.warc.gz") == on and decided(format="auto", uri="pages/*.htm") == on
    assert decided(format="text") is off and decided(format="jsonl") is off and decided(format="auto") is off
    assert decided(format="warc", pii=False) is off and decided(format="jsonl", pii=True) == on
    assert decided(format="jsonl", pii={"ip_addresses": False}) == PiiConfig(ip_addresses=False)
    with pytest.raises(SourceConfigError, match=r"source 's'.pii: expected true, false or a mapping, got 'yes'"):
        decided(pii="yes")
    with pytest.raises(SourceConfigError, match=r"source 's'.pii: unknown field 'phones'"):
        decided(pii={"phones": True})

    plain = _filtered_identity(tmp_path, format="jsonl")
    assert "pii" not in plain  # sources without the pass keep the identity they had
    scrubbed = _filtered_identity(tmp_path, format="jsonl", pii=True)
    assert scrubbed == {**plain, "pii": {"emails": True, "ip_addresses": True, "public_ips_only": True}}
    assert _filtered_identity(tmp_path, format="jsonl", pii={"public_ips_only": False}) != scrubbed
    assert _filtered_identity(tmp_path, format="warc")["pii"] == scrubbed["pii"]
    assert "pii" not in _filtered_identity(tmp_path, format="warc", pii=False)


@pytest.mark.parametrize("cfg", [PiiConfig(), PiiConfig(public_ips_only=False), PiiConfig(emails=False),
                                 PiiConfig(ip_addresses=False)])
def test_the_polars_pass_never_skips_a_text_that_holds_an_address(cfg):
    """Only the rows the polars pass picks are searched in Python, and only for the kinds it saw:
    the result must be what searching every text for everything gives."""
    texts = [template.format(*planted) for template, planted, _ in _cases()] + NOT_PII
    texts += [t.upper() for t in texts] + [f"x{t}y" for t in texts]
    out, _, counts = scrub_frame(pl.DataFrame({"text": texts}), None, cfg)
    each = [scrub_text(t, cfg) for t in texts]
    assert out["text"].to_list() == [text for text, _ in each]
    assert counts == {**{kind: sum(c[kind] for _, c in each) for kind in ("emails", "ipv4", "ipv6")},
                      "documents": sum(text != t for (text, _), t in zip(each, texts))}
    assert counts["documents"] > 0 or not cfg.emails and not cfg.ip_addresses


def test_searching_only_the_runs_around_anchors_finds_what_the_patterns_find():
    """`sub_in_runs` searches the runs around what every match holds instead of the whole text: on random
    strings of the characters that matter (and whole addresses), the same result as `pattern.sub`."""
    rnd = random.Random(0)
    alphabet = [*"ab.Z9_-+@: \n[]1.2é/'(),f0", "x@y.z", "1.2.3.4", "8.8.8.8", "[IPv6:2001:db8::1]", "2001:db8::",
                "::ffff:", "IPv6:", "host:", "ü", "@@", "255.", "10."]
    found = 0
    for _ in range(20_000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 30)))
        for pattern, core, in_run in (pii.EMAIL_SEARCH, pii.IPV6_SEARCH, pii.IPV4_SEARCH):
            expected = pattern.sub(lambda m: f"<{m.group()}>", text)
            assert sub_in_runs(text, pattern, lambda m: f"<{m.group()}>", core, in_run) == expected
            found += expected != text
    assert found > 1000  # the strings do hold addresses of each kind


@pytest.mark.parametrize("address, public", [
    ("9.255.255.255", True), ("10.0.0.0", False), ("10.255.255.255", False), ("11.0.0.0", True),
    ("100.63.255.255", True), ("100.64.0.0", False), ("100.127.255.255", False), ("100.128.0.0", True),
    ("172.15.255.255", True), ("172.16.0.0", False), ("172.31.255.255", False), ("172.32.0.0", True),
    ("192.167.255.255", True), ("192.168.0.0", False), ("198.17.255.255", True), ("198.19.255.255", False),
    ("223.255.255.255", True), ("224.0.0.0", False), ("255.255.255.255", False),
    ("1fff:ffff::1", False), ("2000::1", True), ("2001:1ff:ffff::1", False), ("2001:200::1", True),
    ("2001:db7:ffff::1", True), ("2001:db8::1", False), ("2002::1", False), ("2003::1", True),
    ("3ffe::1", True), ("3fff::1", False), ("4000::1", False), ("fe80::1", False), ("::ffff:10.1.2.3", False),
    ("::ffff:11.1.2.3", True), ("64:ff9b::192.168.0.1", False), ("64:ff9b::8.8.8.8", True),
])
def test_public_means_outside_the_special_purpose_ranges(address, public):
    import ipaddress

    parsed = ipaddress.ip_address(address)
    check = pii.is_public_ipv4 if parsed.version == 4 else pii.is_public_ipv6
    assert check(int(parsed)) is public
