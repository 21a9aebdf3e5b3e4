"""Supervised fine-tuning (docs/post-training.md#sft_checkpoint): SFT runs' refusals, their assets
beside the pretraining ones, and a fine-tuning run whose loss counts the assistant's tokens only."""

import json
import os
import random
import subprocess
import sys

import dagster as dg
import data_fixtures
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
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
    ({"a": {**_body(), "init_from": {"path": "/w"}}, "b": {**_body(), "init_from": {"run": "a"}}},
     r"run 'b': field 'init_from.run': 'a' is not a pretraining run \(runs: base\)"),
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


def test_a_cross_entropy_block_levanter_would_count_twice_is_split_in_half():
    from marin_assets.training.levanter_config import levanter_block_size

    assert levanter_block_size(256, 300) == 150  # one block and a remainder: Levanter counts it twice
    assert [levanter_block_size(256, v) for v in (200, 256, 512, 600, 4096)] == [256] * 5
    assert levanter_block_size(None, 300) is None and levanter_block_size(4096, 5000) == 2500


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
    # A cross-entropy: never below zero (Levanter's blockwise loss counted part of this 300-token vocabulary
    # twice, and went negative, before `levanter_block_size`).
    assert losses[0] > 4.0 and 0 < losses[-1] < 0.2 * losses[0] and min(losses) > 0, losses
    report = json.loads((out / FINAL_EVAL_FILE).read_text())
    print(f"SFT figures: train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; held-out "
          f"assistant-token loss {report['eval/chats/loss']:.3f}, bpb {report['eval/chats/bpb']:.3f} "
          f"({report['eval/chats/tokens']} tokens)")
    assert 0 < report["eval/chats/loss"] < 1.0 and 0 < report["eval/chats/bpb"] < 1.0, report

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


# ---- the assets ----------------------------------------------------------------------------------------


def chat_deployment(runs_raw: dict, sft_raw: dict):
    """A deployment of a text source `src` (mixture `m`) and a chat source `chats` (mixture `sft`,
    format chat), tokenizer `t`, with the pretraining runs ``runs_raw`` and the SFT runs ``sft_raw``,
    read as the project file's sections are (`Deployment.load`)."""
    from dataclasses import replace

    from marin_assets.curation.config import CurationConfig, SourceConfig
    from marin_assets.deployment import Deployment
    from marin_assets.tokenization.registry import TokenizationRegistry, TokenizerEntry
    from marin_assets.tokenization.tokenizer import TokenizerConfig

    registry = TokenizationRegistry(
        tokenizers={"t": TokenizerEntry("t", TokenizerConfig(), train_on=("src",), version="v1")},
        tokenized={"src": TokenizedEntry("src", "t", CacheConfig()), **{
            k: v for k, v in _tokenized(SEQ_LEN).items() if k == "chats"}},
        mixtures={"m": MixtureEntry("m", "t", {"src": 1.0}), "sft": MixtureEntry("sft", "t", {"chats": 1.0}, "chat")})
    curation = CurationConfig(sources=(SourceConfig(name="src", uri="/nonexistent/*.txt", format="text"),
                                       SourceConfig(name="chats", uri="/nonexistent/*.jsonl", format="chat")))
    runs = extend_run_registry({}, runs_raw, "runs.yaml")
    deployment = Deployment.resolve(curation, registry, runs, {})
    return replace(deployment, sft_runs=deployment.built_sft_runs(extend_sft_runs(runs, sft_raw, "marin.yaml"),
                                                                  "marin.yaml"))


BASE = {"base": {**_body(), "mixture": "m"}}
CHATTY = {"chatty": {**_body(), "init_from": {"run": "base"}}}


@pytest.mark.parametrize("change, message", [
    ({"mixture": "m"}, r"field 'mixture': 'm' is a text mixture"),
    ({"mixture": "nope"}, r"field 'mixture': mixture 'nope' with tokenizer 't' is not built here \(mixtures: m \(t\), "
                          r"sft \(t\)\)"),
    ({"model": {**_body()["model"], "seq_len": 32}}, r"field 'model.seq_len': 32 is shorter than the rows of chat "
                                                     r"cache 'chats'"),
])
def test_an_sft_run_on_data_this_deployment_cannot_fine_tune_on_is_refused_naming_the_file(change, message):
    with pytest.raises(RunSpecError, match=rf"^marin.yaml: run 'chatty': {message}"):
        chat_deployment(BASE, {"chatty": {**CHATTY["chatty"], **change}})


def test_sft_runs_train_through_the_checkpoint_assets_under_their_own_keys(tmp_path):
    """The training stage builds `sft_checkpoint`/`sft_eval` over partitions `sft_runs` only where SFT runs
    are declared; an SFT run starts from its base's `hf_model`, recorded as its input, and trains on the
    chat mixture's Levanter config (its components' chat format); the export stage adds `sft_hf_model`."""
    from test_init_from import RecordingLauncher, _commit

    from marin_assets.export.assets import build_export_stage
    from marin_assets.stages import build_stage
    from marin_assets.training.assets import CHECKPOINT_VERSION, build_training_stage
    from marin_assets.training.export_main import HF_MODEL_VERSION
    from marin_resources.environments import MarinSettings, build_resources

    plain = build_stage(build_training_stage, MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "s")}),
                        chat_deployment(BASE, {}))[1]
    assert sorted(plain.specs) == ["checkpoint", "eval"]  # no SFT runs: the graph of before

    deployment = chat_deployment(BASE, CHATTY)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    resources = build_resources(settings)
    store = resources["store"].get()
    cache = _commit(store, "tokenized/chats", None, {"train/input_ids": b"rows"})
    chat = {"type": "chat", "chat_template": TEMPLATE}
    _commit(store, "mixture/sft", None, {"data.json": json.dumps({
        "cache_dir": None, "train_weights": {"chats": 1.0},
        "configs": {"chats": {"cache_dir": cache.uri, "format": chat}}}).encode()})
    _commit(store, "tokenizer/t", None, {"tokenizer.json": b"{}"})
    export = _commit(store, "hf_model", "base", {"config.json": b"{}", "model.safetensors": b"weights"},
                     version=HF_MODEL_VERSION)
    calls: list = []
    resources["launcher"] = RecordingLauncher.make(calls)
    defs, catalog = build_stage(build_training_stage, settings, deployment)
    assert sorted(catalog.specs) == ["checkpoint", "eval", "sft_checkpoint", "sft_eval"]
    [sft] = [a for a in defs.assets if a.key == dg.AssetKey("sft_checkpoint")]
    assert sft.partitions_def.name == "sft_runs" and catalog.discoverers["sft_runs"]() == ["chatty"]
    assert catalog.discoverers["runs"]() == ["base"]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("sft_runs", ["chatty"])
        assert dg.materialize([sft], partition_key="chatty", instance=instance, resources=resources).success
    manifest = store.find("sft_checkpoint", CHECKPOINT_VERSION, "chatty")
    assert ("hf_model", "base") in manifest.upstream_versions() and manifest.config["init_from"]["run"] == "base"
    [(process, config)] = calls
    assert config["initialize_from_hf"] == export.uri and config["data"]["configs"]["chats"]["format"] == chat
    assert "--final-eval" in process.args  # the held-out chat split's assistant-token loss and bpb

    export_catalog = build_stage(build_export_stage, settings, deployment)[1]
    assert sorted(export_catalog.specs) == ["hf_model", "sft_hf_model"]
    assert export_catalog.specs["sft_hf_model"].identity("chatty")["run"]["name"] == "chatty"


def test_a_chat_cache_is_scored_on_the_assistants_tokens_when_a_base_model_is_cross_evaluated():
    """`cross_eval/<chat source>[base]` reads the chat cache as the SFT run's mixture does, so `marin compare
    BASE SFT` puts the base's `eval/<source>/loss` beside the fine-tuned run's, both over the assistant's tokens."""
    from marin_assets.training.levanter_config import validation_only_config

    text = yaml.safe_dump({"data": {"cache_dir": None, "configs": {"x": {}}, "train_weights": {"x": 1.0}}})
    config = validation_only_config(text, {"chats": "/c", "prose": "/p"}, {"chats": TEMPLATE})
    assert config["data"]["configs"]["chats"]["format"]["chat_template"] == TEMPLATE
    assert config["data"]["configs"]["chats"]["format"]["mask_user_turns"] is True
    assert "format" not in config["data"]["configs"]["prose"]


def test_marin_compare_shows_the_base_model_beside_the_fine_tuned_one(tmp_path):
    """`marin compare base chatty`: the fine-tuned run's `sft_eval` and its base's `cross_eval/chats` give
    the same row, assistant-token loss and bpb on the chat cache's held-out split, side by side."""
    from marin_assets.reports.compare import compare
    from marin_assets.reports.comparison import load_runs
    from marin_assets.stages import build_catalog
    from marin_resources.environments import MarinSettings, build_resources
    from marin_resources.storage.store import UpstreamRef
    from tests.reports.test_run_comparison import commit

    deployment = chat_deployment(BASE, CHATTY)
    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store")})
    store = build_resources(settings)["store"].get()

    def trained(key: str, run: str, loss: float, evaluations: dict[str, float]) -> None:
        checkpoint = commit(store, key, run, config={"name": run, "train_batch_size": 8, "model": {"seq_len": 64}},
                            metrics={"final_step": 10, "train_loss_last": loss})
        for eval_key, chat_loss in evaluations.items():
            commit(store, eval_key, run, config={"run": run, "key": eval_key},
                   metrics={"eval/chats/loss": chat_loss, "eval/chats/bpb": chat_loss / 2},
                   upstream=[UpstreamRef(key, run, checkpoint.data_version, checkpoint.uri)])

    trained("checkpoint", "base", 3.0, {"cross_eval/chats": 4.5})
    trained("sft_checkpoint", "chatty", 1.0, {"sft_eval": 1.25})
    comparison = compare(load_runs(deployment, store, build_catalog(settings, deployment), ["base", "chatty"]))
    rows = {row["metric"]: row["values"] for row in comparison.to_dict()["rows"]}
    assert [r for r in rows if "chats" in r] == ["eval chats loss", "eval chats bpb"], rows
    assert rows["eval chats loss"] == {"base": 4.5, "chatty": 1.25}
    assert rows["eval chats bpb"] == {"base": 2.25, "chatty": 0.625}


def test_the_project_files_sft_runs_section_declares_them(tmp_path):
    """`sft_runs:` in marin.yaml: runs on a chat mixture, each from a pretraining run of the file (`init_from`);
    one on a text mixture is refused when the file is read, in one line naming it."""
    from marin_assets.deployment import Deployment
    from marin_resources.environments import MarinSettings
    from marin_resources.typed_config import ConfigError
    from tests.foundation.test_project_file import MODEL, NOTES

    chat = NOTES.replace("sources:\n", "sources:\n  - {name: chats, uri: chats/*.jsonl, format: chat}\n") \
        .replace("tokenized:\n", "tokenized:\n  chats:\n    tokenizer: notes\n    chat:\n      seq_len: 64\n"
                                 f"      template: {json.dumps(TEMPLATE)}\n") \
        .replace("mixtures:\n", "mixtures:\n  chat: {tokenizer: notes, format: chat, components: {chats: {weight: 1}}}"
                                 "\n")
    sft = f"{{mixture: chat, tokenizer: notes, model: {MODEL}, num_train_steps: 5, init_from: {{run: tiny}}}}"
    path = tmp_path / "marin.yaml"
    path.write_text(chat + f"sft_runs:\n  chatty: {sft}\n")
    settings = MarinSettings.from_env({}, cwd=tmp_path)
    deployment = Deployment.load(settings)
    assert list(deployment.sft_runs) == ["chatty"] and "chatty" not in deployment.runs
    assert deployment.sft_runs["chatty"].init_from.run == "tiny"
    from marin_assets.definitions import build_definitions

    defs, catalog = build_definitions(settings)  # the whole graph: a job per partitions definition
    assert {"sft_checkpoint", "sft_eval", "sft_hf_model", "cross_eval/chats"} <= set(catalog.specs)
    assert {"training_sft_runs", "export_sft_runs"} <= {job.name for job in defs.jobs}
    path.write_text(chat + f"sft_runs:\n  chatty: {sft.replace('mixture: chat', 'mixture: notes')}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: run 'chatty': field 'mixture': 'notes' is a text mixture"):
        Deployment.load(MarinSettings.from_env({}, cwd=tmp_path))


def test_levanters_one_block_loss_counts_the_remainder_twice_and_the_halved_block_does_not():
    """Why `levanter_block_size` exists: Levanter's blockwise loss over a 300-entry vocabulary in blocks of
    256 is not the whole-vocabulary loss (the 44-entry remainder is counted twice); in the halved blocks it is."""
    import haliax as hax
    import jax
    import numpy as np
    from levanter.models.loss import maybe_fused_next_token_loss

    from marin_assets.training.levanter_config import levanter_block_size

    Pos, Embed, Vocab = hax.Axis("position", 16), hax.Axis("embed", 8), hax.Axis("vocab", 300)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = hax.random.normal(keys[0], (Pos, Embed))
    head = hax.random.normal(keys[1], (Embed, Vocab))
    # Targets in the remainder (entries 256-299), where the double count shows most.
    labels = hax.named(jax.random.randint(keys[2], (Pos.size,), 256, 300), Pos)

    def loss(block):
        return float(maybe_fused_next_token_loss(Pos, Embed, Vocab, hidden, head, labels, block_size=block).scalar())

    whole = loss(None)
    assert abs(loss(256) - whole) > 0.1  # Levanter's own, as it stands
    np.testing.assert_allclose(loss(levanter_block_size(256, Vocab.size)), whole, rtol=1e-5)
