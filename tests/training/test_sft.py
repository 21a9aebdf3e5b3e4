"""Supervised fine-tuning (docs/post-training.md#sft_checkpoint): SFT runs' refusals, their assets
beside the pretraining ones, and a fine-tuning run whose loss counts the assistant's tokens only."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import data_fixtures
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.tokenization.cache_config import CacheConfig, ChatCacheConfig
from marin_assets.tokenization.registry import MixtureEntry, TokenizedEntry
from marin_assets.training.sft import extend_sft_runs, validate_sft_data
from marin_assets.training.spec import InitFrom, RunSpecError, extend_run_registry
from marin_assets.training.train_main import FINAL_EVAL_FILE, METRICS_FILE

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'assistant' %}<assistant>\n"
            "{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
            "{% else %}<{{ m['role'] }}>\n{{ m['content'] }}\n{% endif %}{% endfor %}")
SEQ_LEN = 64
PATTERN = ["one two three", "four five six", "seven eight nine"]


def _body() -> dict:
    spec = tiny_spec()
    model = {f: getattr(spec.model, f) for f in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads",
                                                 "num_kv_heads", "seq_len")}
    return {"mixture": "sft", "tokenizer": "t", "model": model, "optimizer": {"learning_rate": 0.01},
            "train_batch_size": 8, "num_train_steps": 10}


# ---- refusals ----------------------------------------------------------------------------------------


def test_an_sft_run_starts_from_a_pretraining_runs_export_under_its_own_name():
    pretraining = extend_run_registry({}, {"base": {**_body(), "mixture": "m"}}, "x")
    sft = extend_sft_runs(pretraining, {"chatty": {**_body(), "init_from": {"run": "base"}}}, "marin.yaml")
    assert list(sft) == ["chatty"] and sft["chatty"].init_from == InitFrom(run="base")


@pytest.mark.parametrize("raw, message", [
    ({"chatty": _body()}, r"run 'chatty': field 'init_from': an SFT run fine-tunes pretrained weights"),
    ({"base": {**_body(), "init_from": {"path": "/w"}}}, r"run 'base': field 'name': a pretraining run is named"),
    ({"chatty": {**_body(), "init_from": {"run": "base"}, "model": {**_body()["model"], "num_layers": 3}}},
     r"run 'chatty': field 'model.num_layers': 3 differs from 2 of run 'base'"),
])
def test_a_bad_sft_run_is_refused_in_one_line(raw, message):
    pretraining = extend_run_registry({}, {"base": _body()}, "x")
    with pytest.raises(RunSpecError, match=rf"^marin.yaml: {message}") as info:
        extend_sft_runs(pretraining, raw, "marin.yaml")
    assert "\n" not in str(info.value)


def _tokenized(seq_len: int) -> dict[str, TokenizedEntry]:
    return {"chats": TokenizedEntry("chats", "t", CacheConfig(chat=ChatCacheConfig(template=TEMPLATE,
                                                                                      seq_len=seq_len))),
            "prose": TokenizedEntry("prose", "t", CacheConfig())}


def test_an_sft_run_trains_on_chat_caches_that_fit_its_sequence():
    spec = tiny_spec(init_from=InitFrom(path="/w"))  # seq_len 64
    validate_sft_data(spec, MixtureEntry("sft", "t", {"chats": 1.0}, "chat"), _tokenized(64))
    validate_sft_data(spec, MixtureEntry("both", "t", {"chats": 1.0, "prose": 1.0}, "mixed"), _tokenized(64))
    with pytest.raises(RunSpecError, match=r"field 'mixture': 'pre' is a text mixture; an SFT run trains on chat"):
        validate_sft_data(spec, MixtureEntry("pre", "t", {"prose": 1.0}), _tokenized(64))
    with pytest.raises(RunSpecError, match=r"field 'model.seq_len': 64 is shorter than the rows of chat cache "
                                           r"'chats' \(chat.seq_len 128\).*at least 128$"):
        validate_sft_data(spec, MixtureEntry("sft", "t", {"chats": 1.0}, "chat"), _tokenized(128))


# ---- a fine-tuning run -------------------------------------------------------------------------------


def _conversations(count: int, seed: int = 0) -> list[list[dict]]:
    """User turns of random letters (nothing to learn), assistant turns a fixed cycle of phrases."""
    rng = random.Random(seed)
    noise = lambda: " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(4))  # noqa: E731
                             for _ in range(2))
    return [[turn for t in range(2) for turn in ({"role": "user", "content": noise()},
                                                  {"role": "assistant", "content": PATTERN[(i + t) % 3]})]
            for i in range(count)]


@pytest.fixture(scope="module")
def chat_run_inputs(tmp_path_factory):
    """(tokenizer dir, Levanter data config of a chat mixture, conversations by id) over a chat cache
    built by the tokenization stage's own encoder and assembler."""
    from marin_assets.tokenization.assembly import assemble_levanter_cache
    from marin_assets.tokenization.encoding import ShardSpec, encode_shard_rows
    from marin_assets.tokenization.mixture import MixtureComponent, MixtureSpec, render_levanter_data_config

    os.environ.update({k: v for k, v in SUBPROCESS_ENV.items() if k != "PYTHONUNBUFFERED"})
    out = tmp_path_factory.mktemp("sft")
    tokenizer_dir = str(out / "tokenizer")
    data_fixtures.train_byte_bpe_tokenizer(data_fixtures.stdlib_docstrings()[:200], tokenizer_dir, 300)
    conversations = {f"c{i}": c for i, c in enumerate(_conversations(400))}
    messages = [json.dumps(c) for c in conversations.values()]
    pq.write_table(pa.table({"id": list(conversations), "text": messages, "messages": messages}),
                   str(out / "chats.parquet"))
    cfg = CacheConfig(validation_fraction=0.1, chat=ChatCacheConfig(template=TEMPLATE, seq_len=SEQ_LEN))
    rows = encode_shard_rows(ShardSpec("store://chats/0", "fp-0", str(out / "chats.parquet")), tokenizer_dir,
                             str(out / "rows"), cfg)
    assemble_levanter_cache([rows], tokenizer_dir, str(out / "cache"), cfg)
    spec = MixtureSpec(name="sft", components={"chats": MixtureComponent(str(out / "cache"), 1.0,
                                                                         chat_template=TEMPLATE)},
                       tokenizer_dir=tokenizer_dir, seq_len=SEQ_LEN)
    return tokenizer_dir, render_levanter_data_config(spec), conversations


@pytest.mark.slow
def test_fine_tuning_learns_the_assistants_turns_and_never_trains_on_the_users(chat_run_inputs, tmp_path):
    """From a random Llama (transformers' own, as HF weights): the loss, counted on the assistant's
    tokens only, falls from chance to near zero on a pattern the assistant follows, while the user's
    random letters, which no model could learn, are never a target of the loss."""
    from test_init_from import write_hf_llama
    from transformers import AutoTokenizer

    from marin_assets.curation.content_hashes import ContentHashCache
    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.training.init_weights import resolve_path
    from marin_assets.training.levanter_config import build_train_config, parse_train_config, write_train_config

    tokenizer_dir, data_config, conversations = chat_run_inputs
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    write_hf_llama(tmp_path / "base", vocab_size=len(tokenizer))
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes:
        weights = resolve_path(str(tmp_path / "base"), hashes)
    spec = tiny_spec("sft", steps=40, watch_every=0, init_from=InitFrom(path=str(tmp_path / "base")))
    validate_sft_data(spec, MixtureEntry("sft", "t", {"chats": 1.0}, "chat"),
                      {"chats": TokenizedEntry("chats", "t", CacheConfig(chat=ChatCacheConfig(seq_len=SEQ_LEN)))})
    out = tmp_path / "run"
    config = write_train_config(build_train_config(spec, data_config, tokenizer_dir, str(out), init_weights=weights),
                                out / "train_config.yaml")
    proc = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config,
                           "--output-dir", str(out), "--init-sha256", weights.sha256, "--final-eval"],
                          env={**os.environ, **SUBPROCESS_ENV}, capture_output=True, text=True, timeout=900, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]

    losses = [json.loads(line)["loss"] for line in (out / METRICS_FILE).read_text().splitlines() if "loss" in line]
    assert losses[0] > 4.0 and losses[-1] < 0.5 * losses[0], losses
    report = json.loads((out / FINAL_EVAL_FILE).read_text())
    assert report["eval/chats/loss"] < 1.0 and report["eval/chats/bpb"] < report["eval/chats/loss"], report

    # What the loss counted, as the trained config reads the held-out split: the assistant's phrases and
    # EOS, never a letter of the user's noise nor a role label.
    parsed = parse_train_config(config)
    name_tokenizer_as_ledgers_do(parsed.data)
    validation = parsed.data.validation_sets(parsed.model.Pos)["chats"].as_sync_dataset()
    noise_words = {w for c in conversations.values() for t in c if t["role"] == "user" for w in t["content"].split()}
    counted = 0
    for example in validation.get_batch(list(range(min(8, len(validation))))):
        tokens, mask = np.asarray(example.tokens.array), np.asarray(example.loss_mask.array)
        targets = tokens[1:][mask[:-1] > 0]
        counted += len(targets)
        decoded = tokenizer.decode(targets)
        assert not noise_words & set(decoded.replace(tokenizer.eos_token, " ").split()), decoded
        assert "<user>" not in decoded and "<assistant>" not in decoded
        assert set(decoded.replace(tokenizer.eos_token, " ").split()) <= {w for p in PATTERN for w in p.split()}
    assert counted > 0
