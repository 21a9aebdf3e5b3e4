"""The chat token cache (docs/post-training.md#the-chat-token-cache): conversations rendered through a
chat template into `input_ids` and `assistant_masks`, per shard, assembled into a Levanter cache that
Levanter's own chat dataset reads with the loss on the assistant's tokens."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marin_assets.tokenization.assembly import assemble_levanter_cache
from marin_assets.tokenization.cache_config import CacheConfig, ChatCacheConfig
from marin_assets.tokenization.chat_template import QUARANTINE_FILE
from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows
from tests.tokenization.test_tokenization_levanter import _file_hashes

# A ChatML-like template over the project's BPE (its turn markers are plain text): the assistant's
# content and the EOS after it are in `{% generation %}`, which is what the mask marks.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "{% if m['role'] == 'assistant' %}<assistant>\n"
            "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
            "{% else %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endif %}{% endfor %}")
SEQ_LEN = 256
LINES = ["Good morrow, sir.", "What news from the court?", "The king is well, and asks for thee.",
         "Then I shall go to him anon.", "Bring the horses round.", "It shall be done, my lord."]


def _conversation(i: int, turns: int = 4) -> list[dict]:
    turns_ = [{"role": "system", "content": f"Scene {i}."}] if i % 3 == 0 else []
    for t in range(turns):
        turns_.append({"role": "user" if t % 2 == 0 else "assistant",
                       "content": f"{LINES[(i + t) % len(LINES)]} ({i})"})
    return turns_


def _write_chats(path, conversations: list[list[dict] | str], ids: list[str]) -> str:
    messages = [c if isinstance(c, str) else json.dumps(c) for c in conversations]
    texts = [m if isinstance(m, str) else "\n\n".join(f"{t['role']}: {t['content']}" for t in c)
             for m, c in zip(messages, conversations)]
    pq.write_table(pa.table({"id": pa.array(ids, pa.string()), "text": texts, "messages": messages}), str(path))
    return str(path)


@pytest.fixture(scope="module")
def chat_shards(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("chats")
    return [_write_chats(folder / f"part-{k}.parquet", [_conversation(40 * k + i) for i in range(40)],
                         [f"c{40 * k + i}" for i in range(40)]) for k in range(3)]


@pytest.fixture(scope="module")
def chat_cfg() -> CacheConfig:
    return CacheConfig(validation_fraction=0.1, chat=ChatCacheConfig(template=TEMPLATE, seq_len=SEQ_LEN))


def _encoded(shards: list[str], tokenizer_dir: str, cfg: CacheConfig, folder) -> list[dict]:
    return [encode_shard_rows(ShardSpec(f"store://chats/{k}", f"fp-{k}", uri), tokenizer_dir, str(folder / str(k)), cfg)
            for k, uri in enumerate(shards)]


@pytest.fixture(scope="module")
def chat_cache(chat_shards, tokenizer_dir, chat_cfg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_cache")
    root = str(folder / "cache")
    return root, assemble_levanter_cache(_encoded(chat_shards, tokenizer_dir, chat_cfg, folder / "rows"),
                                         tokenizer_dir, root, chat_cfg)


def test_levanter_reads_the_chat_cache_with_the_loss_on_the_assistant_turns(chat_cache, chat_shards, tokenizer_dir,
                                                                            caplog):
    """Levanter's own path: a mixture with the chat component (`format: chat`) loads the cache with its
    ChatProcessor's exemplar and metadata (no mismatch, no rebuild) into a MultiturnChatDataset; the rows
    are what ChatProcessor makes of the same conversations, and the loss falls on the assistant's
    tokens alone."""
    import draccus
    import haliax as hax
    from levanter.data.text import ChatProcessor, LMMixtureDatasetConfig, MultiturnChatDataset

    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config

    root, stats = chat_cache
    with open(f"{root}/marin_tokenize_manifest.json") as f:
        assert not any(shard["truncated_conversations"] for shard in json.load(f)["shards"])
    spec = MixtureSpec(name="sft", components={"chats": MixtureComponent(root, 1.0, chat_template=TEMPLATE)},
                       tokenizer_dir=tokenizer_dir, seq_len=SEQ_LEN, shuffle=False)
    config = draccus.decode(LMMixtureDatasetConfig, render_levanter_data_config(spec))
    name_tokenizer_as_ledgers_do(config)
    Pos = hax.Axis("position", SEQ_LEN)
    with caplog.at_level(logging.INFO):
        caches = config.build_caches("validation")
        validation = config.validation_sets(Pos)["chats"]
    assert not [r for r in caplog.records if "Metadata mismatch" in r.getMessage() or "Building" in r.getMessage()]
    assert isinstance(validation, MultiturnChatDataset)

    # Every row is ChatProcessor's rendering of its conversation (validation rows, in document order).
    conversations = {row["id"]: json.loads(row["messages"]) for uri in chat_shards
                     for row in pq.read_table(uri).to_pylist()}
    store = caches["chats"].store.tree
    rows = [(store["input_ids"][i], store["assistant_masks"][i])
            for i in range(len(store["input_ids"]))]
    assert len(rows) == stats.validation.documents > 0
    processor = ChatProcessor(config.the_tokenizer, chat_template=TEMPLATE)
    from marin_resources.splits import id_hashes, in_validation
    held_out = [i for i in conversations if in_validation(id_hashes([i], 1), 0.1)[0]]
    expected = processor([{"messages": conversations[i]} for i in held_out])
    assert len(expected) == len(rows)
    for (ids, mask), theirs in zip(rows, expected):
        assert np.array_equal(ids, theirs["input_ids"]) and np.array_equal(mask, theirs["assistant_masks"])

    # The loss mask of a packed example (mask shifted back one: the target is the next token) predicts
    # exactly the assistant's content and EOS, as decoded.
    example = validation.as_sync_dataset()[0]
    tokens, loss = np.asarray(example.tokens.array), np.asarray(example.loss_mask.array)
    targets = tokens[1:][loss[:-1] > 0]
    assistant = [t["content"] for i in held_out for t in conversations[i] if t["role"] == "assistant"]
    decoded = config.the_tokenizer.decode(targets)
    assert decoded.startswith(assistant[0]) and config.the_tokenizer.eos_token in decoded
    assert "<user>" not in decoded and "Scene" not in decoded


def test_the_chat_ledger_metadata_is_chatprocessors_own(chat_cache, tokenizer_dir):
    from levanter.data.text import ChatProcessor
    from transformers import AutoTokenizer

    from marin_assets.tokenization.cache_format import tokenizer_ledger_name

    root, _ = chat_cache
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.name_or_path = tokenizer_ledger_name(tokenizer_dir)
    with open(f"{root}/train/shard_ledger.json") as f:
        ledger = json.load(f)
    assert ledger["metadata"]["preprocessor_metadata"] == ChatProcessor(tok, chat_template=TEMPLATE).metadata


def test_two_chat_builds_are_byte_identical_and_an_appended_shard_costs_its_own_work(
        chat_cache, chat_shards, tokenizer_dir, chat_cfg, tmp_path):
    root, stats = chat_cache
    again = str(tmp_path / "again")
    entries = _encoded(chat_shards, tokenizer_dir, chat_cfg, tmp_path / "rows")
    assert assemble_levanter_cache(entries, tokenizer_dir, again, chat_cfg).documents == stats.documents
    assert _file_hashes(again) == _file_hashes(root)

    grown = str(tmp_path / "grown")
    assemble_levanter_cache(entries[:2], tokenizer_dir, grown, chat_cfg)
    appended = assemble_levanter_cache(entries, tokenizer_dir, grown, chat_cfg)
    assert (appended.shards_reused, appended.shards_encoded) == (2, 1)
    assert appended.documents_encoded == entries[2]["train_documents"] + entries[2]["validation_documents"]
    # Levanter's arrays and ledgers are the fresh build's; the manifest differs by where it appended from.
    manifest = "marin_tokenize_manifest.json"
    assert {k: v for k, v in _file_hashes(grown).items() if k != manifest} \
        == {k: v for k, v in _file_hashes(root).items() if k != manifest}

    # The template is the cache's identity: another one rebuilds every shard, never appends to it.
    other = CacheConfig(validation_fraction=0.1, chat=ChatCacheConfig(template=TEMPLATE.replace("<assistant>", "<a>"),
                                                                      seq_len=SEQ_LEN))
    with pytest.raises(ValueError, match="encoded with another tokenizer or settings"):
        assemble_levanter_cache([*entries[:2], encode_shard_rows(ShardSpec("store://chats/2", "fp-2", chat_shards[2]),
                                                                 tokenizer_dir, str(tmp_path / "o"), other)],
                                tokenizer_dir, grown, chat_cfg)
    rebuilt = assemble_levanter_cache(_encoded(chat_shards, tokenizer_dir, other, tmp_path / "other"),
                                      tokenizer_dir, grown, other)
    assert rebuilt.shards_reused == 0 and rebuilt.shards_encoded == 3


def test_a_chat_shard_encoded_in_row_ranges_gives_the_one_piece_row_files(chat_shards, tokenizer_dir, chat_cfg,
                                                                           tmp_path):
    """A huge shard spreads over workers in row ranges (`DataParallel`): its chat rows, masks and
    quarantine list are the one-piece encoding's, byte for byte."""
    spec = ShardSpec("k", "fp", chat_shards[0])
    whole = encode_shard_rows(spec, tokenizer_dir, str(tmp_path / "whole"), chat_cfg)
    spread = encode_shard_rows(spec, tokenizer_dir, str(tmp_path / "spread"), chat_cfg,
                               split_rows=lambda weights: [(0, 13), (13, 29), (29, len(weights))],
                               parts_uri=str(tmp_path / "parts"))
    assert {k: v for k, v in spread.items() if k != "rows"} == {k: v for k, v in whole.items() if k != "rows"}
    assert _file_hashes(str(tmp_path / "spread")) == _file_hashes(str(tmp_path / "whole"))
    assert "train.assistant_masks" in _file_hashes(str(tmp_path / "whole"))


def test_bad_conversations_are_quarantined_or_cut_with_a_reason_and_counted(tokenizer_dir, tmp_path):
    long_turn = " ".join(LINES * 8)
    conversations = [
        _conversation(1),  # fine
        # The template raises on a role it does not know.
        [{"role": "user", "content": "Who goes there?"}, {"role": "narrator", "content": "A ghost."}],
        [{"role": "user", "content": long_turn}, {"role": "assistant", "content": "Aye."}],  # too long from the start
        _conversation(2, turns=2) + [{"role": "user", "content": long_turn},
                                     {"role": "assistant", "content": "So be it."}],  # cut after its first answer
        [{"role": "user", "content": "Is anyone there?"}],  # nothing to train on
        "[not json",
    ]
    ids = ["ok", "role", "long", "cut", "silent", "broken"]
    uri = _write_chats(tmp_path / "bad.parquet", conversations, ids)
    seq_len = 128
    cfg = CacheConfig(validation_fraction=0.0, chat=ChatCacheConfig(template=TEMPLATE, seq_len=seq_len))
    entry = encode_shard_rows(ShardSpec("bad", "fp", uri), tokenizer_dir, str(tmp_path / "rows"), cfg)
    assert entry["train_documents"] == 2  # "ok" and the cut "cut"
    assert {k: v for k, v in entry.items() if k.startswith(("quarantined_", "truncated_"))} == {
        "quarantined_template_error": 1, "quarantined_too_long": 1, "quarantined_no_assistant_tokens": 1,
        "quarantined_bad_messages": 1, "truncated_conversations": 1}
    with open(tmp_path / "rows" / QUARANTINE_FILE) as f:
        listed = {r["id"]: r for r in map(json.loads, f)}
    assert {i: r["reason"] for i, r in listed.items()} == {
        "role": "template_error", "long": "too_long", "cut": "truncated", "silent": "no_assistant_tokens",
        "broken": "bad_messages"}
    assert "unknown role narrator" in listed["role"]["detail"]
    assert "kept the first 2 of 4 turns" in listed["cut"]["detail"]
    lengths = np.fromfile(tmp_path / "rows" / "train.lengths", dtype="<i8")
    assert (lengths <= seq_len).all()
    # With `overflow: quarantine` the long conversation is not cut but quarantined.
    strict = CacheConfig(validation_fraction=0.0, chat=ChatCacheConfig(template=TEMPLATE, seq_len=seq_len,
                                                                       overflow="quarantine"))
    entry = encode_shard_rows(ShardSpec("bad", "fp", uri), tokenizer_dir, str(tmp_path / "strict"), strict)
    assert (entry["quarantined_too_long"], entry["truncated_conversations"], entry["train_documents"]) == (2, 0, 1)
    # The assembled cache's manifest keeps every shard's counts (the asset's metadata sums them).
    root = str(tmp_path / "cache")
    assemble_levanter_cache([entry], tokenizer_dir, root, strict)
    with open(f"{root}/marin_tokenize_manifest.json") as f:
        assert json.load(f)["shards"][0]["quarantined_too_long"] == 2


def test_a_template_is_required_and_must_mark_the_assistant(tokenizer_dir, tmp_path):
    from marin_resources.typed_config import FieldProblem, decode

    with pytest.raises(FieldProblem, match=r"no \{% generation %\} block"):
        decode(CacheConfig, {"chat": {"template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}})
    uri = _write_chats(tmp_path / "c.parquet", [_conversation(0)], ["c0"])
    with pytest.raises(ValueError, match="the tokenizer has no chat template; declare one"):
        encode_shard_rows(ShardSpec("c", "fp", uri), tokenizer_dir, str(tmp_path / "rows"),
                          CacheConfig(chat=ChatCacheConfig()))


def test_text_cache_identity_is_unchanged_by_the_chat_field():
    """The pretraining caches keep their fingerprints: `chat` is left out of a text cache's identity."""
    assert CacheConfig().identity() == {"validation_fraction": 0.01, "batch_rows": 1024, "flush_tokens": 16_000_000,
                                        "id_column": "id", "text_column": "text", "incremental": True}
    assert "chat" not in CacheConfig().row_identity()


@pytest.mark.slow  # `marin materialize` of a chat source through its chat cache and a chat mixture, then one more shard
def test_a_chat_source_through_its_chat_cache_and_a_chat_mixture_in_the_graph(tokenizer_dir, tmp_path):
    import os
    import subprocess
    import sys

    import yaml

    def materialize(key: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "marin_assets.cli", "materialize", key, "--json"], env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"

    def committed(key: str) -> dict:
        (path,) = (store / key).glob("v1-*/.artifact.json")
        return json.loads(path.read_text())

    data = tmp_path / "chats"
    data.mkdir()
    long_turn = " ".join(LINES * 12)
    for k in range(2):
        records = [{"messages": _conversation(100 * k + i), "id": f"c{100 * k + i}"} for i in range(30)]
        records.append({"id": f"long{k}", "messages": _conversation(100 * k + 99, turns=2)
                        + [{"role": "user", "content": long_turn}, {"role": "assistant", "content": "So be it."}]})
        (data / f"part{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "sources.yaml").write_text(f"sources:\n  - name: plays\n    uri: {data}/*.jsonl\n    format: chat\n"
                                           "    id_field: id\n    files_per_shard: 1\n")
    (tmp_path / "registry.yaml").write_text(yaml.safe_dump({
        "tokenizers": {"t": {"adopt": tokenizer_dir}},
        "tokenized": {"plays": {"tokenizer": "t", "validation_fraction": 0.1,
                                "chat": {"template": TEMPLATE, "seq_len": SEQ_LEN}}},
        "mixtures": {"sft": {"tokenizer": "t", "format": "chat", "components": {"plays": {"weight": 1.0}}}}}))
    store = tmp_path / "store"
    env = {**os.environ, "MARIN_SOURCES": str(tmp_path / "sources.yaml"),
           "MARIN_REGISTRY": str(tmp_path / "registry.yaml"), "MARIN_PREFIX": str(store),
           "DAGSTER_HOME": str(tmp_path / "home"), "MARIN_ENV": "local"}
    materialize("tokenized/plays")
    materialize("mixture/sft")
    cache = committed("tokenized/plays")
    metrics = cache["metrics"]
    # Each shard's long conversation is cut after its first answer; nothing else is cut or quarantined.
    assert (metrics["shards"], metrics["truncated_conversations"], metrics["quarantined_too_long"]) == (2, 2, 0)
    root = next((store / "tokenized/plays").glob("v1-*"))
    assert (root / "train/assistant_masks/offsets/zarr.json").exists()
    (mixture,) = (store / "mixture/sft").glob("v1-*/data.json")
    component = json.loads(mixture.read_text())["configs"]["plays"]
    assert component["format"]["type"] == "chat" and component["format"]["chat_template"] == TEMPLATE

    # One more shard: encoded alone and appended.
    (data / "part2.jsonl").write_text("".join(json.dumps({"messages": _conversation(200 + i), "id": f"c{200 + i}"})
                                              + "\n" for i in range(30)))
    materialize("tokenized/plays")
    metrics = committed("tokenized/plays")["metrics"]
    assert (metrics["shards"], metrics["shards_reused"], metrics["shards_encoded"]) == (3, 2, 1)


def test_the_chat_rows_check_passes_on_a_chat_cache_and_can_fail(chat_cache):
    from marin_assets.tokenization.cache import chat_rows_check

    root, _ = chat_cache
    assert chat_rows_check(root, SEQ_LEN) == []
    failures = chat_rows_check(root, 40)  # rows longer than a shorter sequence
    assert failures and all("tokens > seq_len 40" in f.reason for f in failures)
